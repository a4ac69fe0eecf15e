"""The ops client of `python -m dispatcher` (a client only: the server's side of these
commands is `dispatcher.operations`): status, drain, resume, restart, reload. Each talks
to a running dispatcher over its control socket and prints a table, or JSON with --json.
"""
from __future__ import annotations

import json
import os
import sys

import zmq

from dispatcher.common.addresses import Endpoints
from dispatcher.common import protocol as P
from dispatcher.common.curve import OPS, CurveKeyError, PartKeys
from dispatcher.common.models import resolve_model_path


def default_dispatcher_address(port: int) -> str:
    """A private ipc directory named after the HTTP port, so ops commands can find it."""
    import tempfile
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'completions-{port}')}"


def control_request(base: str, request: dict, timeout: float = 3.0,
                    keys: PartKeys | None = None) -> dict:
    endpoints = Endpoints.from_base(base)
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.apply(sock)
    sock.connect(endpoints.control)
    try:
        sock.send(P.encode_json(request))
        if not sock.poll(int(timeout * 1000)):
            hint = " (or its --curve-keys differ from these)" if keys is not None else ""
            raise SystemExit(f"no answer from the dispatcher at {base} in "
                             f"{timeout:.0f}s: is `serve` running, and still answering"
                             f"{hint}? {WHERE}")
        return json.loads(sock.recv())
    finally:
        sock.close()
        context.term()


WHERE = "give the --port, --config or --dispatcher `serve` was given, and run as its user"


def ops_request(base: str, request: dict, keys: PartKeys | None = None) -> dict:
    """An ops command's request: where no dispatcher can be listening (no control socket
    there, or one this user may not use) one line at once, not after the wait."""
    endpoints = Endpoints.from_base(base)
    if endpoints.control.startswith("ipc://"):
        path = endpoints.control[len("ipc://"):]
        if not os.path.exists(path):
            parent = os.path.dirname(path)
            if os.path.isdir(parent) and not os.access(parent, os.R_OK | os.X_OK):
                raise SystemExit(f"no dispatcher reachable at {base}: its directory is "
                                 f"not readable by this user; {WHERE}")
            raise SystemExit(f"no dispatcher at {base} (no control socket there): is "
                             f"`serve` running? {WHERE}")
        if not os.access(path, os.R_OK | os.W_OK):
            raise SystemExit(f"no dispatcher reachable at {base}: its control socket is "
                             f"not this user's to use; {WHERE}")
    return control_request(base, request, keys=keys)


def dispatcher_answers(base: str, timeout: float = 1.0) -> bool:
    """Whether a live dispatcher answers on `base` (its control socket)."""
    endpoints = Endpoints.from_base(base)
    if endpoints.control.startswith("ipc://") and \
            not os.path.exists(endpoints.control[len("ipc://"):]):
        return False
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoints.control)
        sock.send(P.encode_json({"cmd": "status"}))
        return bool(sock.poll(int(timeout * 1000)))
    finally:
        sock.close()
        context.term()


def _base(args) -> str:
    return args.dispatcher or default_dispatcher_address(args.port)


def table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in rows)


def format_status(status: dict) -> str:
    rows = [("WORKER", "STATE", "DEVICE", "OFFLOAD", "MODEL", "PID", "BUSY", "TOK/S",
             "STEP MS HOST/DEV", "DONE", "CANCELLED", "TOKENS", "UPTIME", "RESTARTS")]
    for w in status["workers"]:
        uptime, where = w.get("uptime_s"), w.get("placement") or {}
        offload = f"{where['layers_offloaded']}/{where['layers_total']}" \
            if where.get("layers_total") else "-"
        rows.append((w["name"], w["state"], w.get("device") or "-", offload,
                     w.get("model") or "-",
                     w.get("pid") or "-", f"{w.get('busy_slots', 0)}/{w.get('slots', '-')}",
                     w.get("tokens_per_s", "-"),
                     f"{w['step_ms']['host']}/{w['step_ms']['device']}" if w.get("step_ms")
                     else "-", w.get("completed", 0), w.get("cancelled", 0),
                     w.get("tokens", 0), "-" if uptime is None else f"{uptime:.0f}s",
                     w.get("restarts", 0)))
    queue = ", ".join(f"{m}: {n}" for m, n in status["queue"].items()) or "empty"
    losses = "".join(f"\n{w['name']} was lost {w['last_lost']['ago_s']:.0f}s ago: "
                     f"{w['last_lost']['reason']}" for w in status["workers"]
                     if w.get("last_lost"))
    fronts = [("FRONT END", "PID", "OPEN", "SERVED")] + [
        (f["id"], f.get("pid") or "-", f.get("open", 0), f.get("served") or 0)
        for f in status["frontends"]]
    return (table(rows) + losses + f"\n\nqueue: {queue}\n\n" + table(fronts))


def cmd_status(args) -> int:
    status = ops_request(_base(args), {"cmd": "status"}, keys=_keys(args))
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def format_usage(usage: dict) -> str:
    if "error" in usage:
        return f"error: {usage['error']}"
    rows = [("KEY", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS", "ERRORS")] + [
        (k["key"], k["requests"], k["prompt_tokens"], k["completion_tokens"], k["errors"])
        for k in usage.get("keys", [])]
    if len(rows) == 1:
        return "no usage counted yet (no API keys, --usage-by-key off, or no requests)"
    return table(rows)


def cmd_usage(args) -> int:
    usage = ops_request(_base(args), {"cmd": "usage"}, keys=_keys(args))
    failed = "error" in usage and not args.json          # (a mistake: one line on stderr)
    print(json.dumps(usage, indent=2) if args.json else format_usage(usage),
          file=sys.stderr if failed else sys.stdout)
    return 1 if "error" in usage else 0


def cmd_worker_action(args) -> int:
    request = {"cmd": args.command, "worker": args.worker}
    if args.command in ("restart", "reload"):
        request["grace"] = args.grace
    if args.command == "reload":
        if args.model_id is not None and not args.model_id.strip():
            # (it was taken for no id: a plain restart, said ok)
            print("--model-id: an empty id names nothing; leave it out to keep the "
                  "model's id", file=sys.stderr)
            raise SystemExit(2)                 # (a flag's mistake, as argparse's)
        if args.model:
            request["model"] = str(resolve_model_path(args.model))   # as serve checks it
        if args.model_id:
            request["model_id"] = args.model_id
    reply = ops_request(_base(args), request, keys=_keys(args))
    if args.json:
        print(json.dumps(reply, indent=2))
    elif "error" in reply:
        print(f"error: {reply['error']}", file=sys.stderr)
    else:
        details = ", ".join(f"{k} {v}" for k, v in reply.items() if k not in ("ok", "worker"))
        print(f"{args.command}: {reply['worker']}" + (f" ({details})" if details else ""))
    return 1 if "error" in reply else 0


def _keys(args) -> PartKeys | None:
    """The ops tool's key (--curve-keys, --curve-name ops by default), if keyed."""
    if not getattr(args, "curve_keys", None):
        return None
    name = args.curve_name if "curve_name" in args.explicit else OPS
    try:
        return PartKeys.load(args.curve_keys, name)
    except CurveKeyError as exc:
        raise SystemExit(str(exc)) from None


def add_worker_commands(sub, config, file_values: dict, options: list[str]) -> None:
    helps = {"drain": "stop giving WORKER new work; it finishes what it runs, then idles",
             "resume": "give a drained WORKER work again",
             "restart": "drain WORKER, then restart its process (other workers serve on)",
             "reload": "drain WORKER, then restart it on the same or another model"}
    for name, text in helps.items():
        parser = sub.add_parser(name, help=text)
        parser.add_argument("worker", help="worker name, as `status` shows it")
        config.add_options(parser, options, file_values)
        if name in ("restart", "reload"):
            parser.add_argument("--grace", type=config.non_negative_seconds, default=30.0,
                                help="seconds to wait for its requests (default 30)")
        if name == "reload":
            parser.add_argument("--model", default=None, help="GGUF file to load instead")
            parser.add_argument("--model-id", default=None,
                                help="id clients use for it (default: from the file name)")
        parser.add_argument("--json", action="store_true")
        parser.set_defaults(func=cmd_worker_action, log_level="warning")
