"""`python -m dispatcher`: the launcher (`serve`, `broker`) and the ops tool (`status`)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile

import zmq

from dispatcher import config, protocol as P
from dispatcher.devices import parse_device
from dispatcher.models import default_model_id, resolve_model_path

log = logging.getLogger("dispatcher")


def default_dispatcher_address(port: int) -> str:
    """A private ipc directory named after the HTTP port, so ops commands can find it."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'completions-{port}')}"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _run_broker(broker, cleanup_dir: str | None, grace: float = 0.0) -> int:
    def on_signal(signum, frame):
        if broker.draining_until is None and grace > 0:
            log.info("%s: finishing in-flight requests (up to %.0fs; again to stop now)",
                     signal.Signals(signum).name, grace)
            broker.drain(grace)
        else:
            log.info("%s: stopping", signal.Signals(signum).name)
            broker.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        broker.run()
    finally:
        if broker.supervisor is not None:
            broker.supervisor.stop_all()
        broker.close()
        if cleanup_dir:
            shutil.rmtree(cleanup_dir, ignore_errors=True)
    return 0


def _endpoints(args) -> tuple[P.Endpoints, str, str | None]:
    base = args.dispatcher or default_dispatcher_address(args.port)
    endpoints = P.Endpoints.from_base(base)
    cleanup = None
    if base.startswith("ipc://"):
        cleanup = base[len("ipc://"):]
        os.makedirs(cleanup, mode=0o700, exist_ok=True)
        if args.dispatcher:
            cleanup = None           # a directory the operator chose is theirs to keep
    return endpoints, base, cleanup


def cmd_serve(args) -> int:
    from dispatcher.broker import Broker
    from dispatcher.supervisor import Child, Supervisor, python_module_argv

    try:
        devices = [parse_device(d) for d in args.device]
    except ValueError as exc:
        raise SystemExit(f"--device: {exc}")
    allowed = os.sched_getaffinity(0)
    for spec in devices:
        if spec.cores is not None and not set(spec.cores) <= allowed:
            raise SystemExit(f"--device {spec}: this machine lets us use cores "
                             f"{sorted(allowed)} only")
    if args.frontends and not _port_free(args.host, args.port):
        raise SystemExit(f"{args.host}:{args.port} is already in use")
    model_path = resolve_model_path(args.model)
    model_id = args.model_id or default_model_id(model_path)
    endpoints, base, cleanup = _endpoints(args)
    supervisor = Supervisor()
    broker = Broker(endpoints, supervisor, known_models={model_id: {"n_ctx": args.nctx}},
                    max_queue=args.max_queue, queue_timeout=args.queue_timeout)
    for i, spec in enumerate(devices):
        name = f"w{i}-{spec.slug}"
        argv = python_module_argv(
            "workers", "--dispatcher", base, "--device", str(spec), "--model", str(model_path),
            "--model-id", model_id, "--nctx", str(args.nctx), "--ngl", str(args.ngl),
            "--slots", str(args.slots), "--deterministic", str(args.deterministic),
            "--engine", args.engine, "--name", name, "--log-level", args.log_level)
        supervisor.add(Child(name, argv, env=spec.visible_devices(),
                             extra={"device": str(spec), "model": model_id}))
    if args.frontends:
        env = {"COMPLETIONS_DISPATCHER": base, "COMPLETIONS_HOST": args.host,
               "COMPLETIONS_PORT": str(args.port), "COMPLETIONS_FRONTENDS": str(args.frontends),
               "COMPLETIONS_MAX_BODY": str(args.max_body),
               "COMPLETIONS_MAX_PROMPT_CHARS": str(args.max_prompt_chars),
               "COMPLETIONS_LOG_LEVEL": args.log_level,
               # keys travel in the environment, never on a command line (ps shows those)
               "COMPLETIONS_API_KEY": ",".join(args.api_key),
               "COMPLETIONS_API_KEY_FILE": args.api_key_file or ""}
        supervisor.add(Child("frontend", python_module_argv(
            "gunicorn", "-c", "python:app.gunicorn_conf"), env, kind="frontend"))
    print(f"serving {model_id} ({model_path}) on http://{args.host}:{args.port} with "
          f"{args.frontends} front end(s) and {len(devices)} worker(s): "
          f"{', '.join(map(str, devices))}; dispatcher at {base}", file=sys.stderr, flush=True)
    return _run_broker(broker, cleanup, args.stop_grace)


def cmd_broker(args) -> int:
    from dispatcher.broker import Broker
    endpoints, base, cleanup = _endpoints(args)
    broker = Broker(endpoints, max_queue=args.max_queue, queue_timeout=args.queue_timeout)
    print(f"dispatcher at {base}", file=sys.stderr, flush=True)
    return _run_broker(broker, cleanup, args.stop_grace)


def control_request(base: str, request: dict, timeout: float = 3.0) -> dict:
    endpoints = P.Endpoints.from_base(base)
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoints.control)
    try:
        sock.send(P.encode_json(request))
        if not sock.poll(int(timeout * 1000)):
            raise SystemExit(f"no answer from the dispatcher at {base} in {timeout:.0f}s")
        return json.loads(sock.recv())
    finally:
        sock.close()
        context.term()


def cmd_status(args) -> int:
    base = args.dispatcher or default_dispatcher_address(args.port)
    status = control_request(base, {"cmd": "status"})
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    rows = [("WORKER", "STATE", "DEVICE", "MODEL", "PID", "BUSY", "DONE", "CANCELLED",
             "TOKENS", "RESTARTS")]
    for w in status["workers"]:
        rows.append((w["name"], w["state"], w.get("device") or "-", w.get("model") or "-",
                     str(w.get("pid") or "-"),
                     f"{w.get('busy_slots', 0)}/{w.get('slots', '-')}",
                     str(w.get("completed", 0)), str(w.get("cancelled", 0)),
                     str(w.get("tokens", 0)), str(w.get("restarts", 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    queue = ", ".join(f"{m}: {n}" for m, n in status["queue"].items()) or "empty"
    print(f"\nqueue: {queue}; front ends connected: {len(status['frontends'])}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dispatcher", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the dispatcher, the workers and the front ends")
    config.add_options(serve, ["host", "port", "frontends", "model", "model_id", "device",
                               "nctx", "ngl", "slots", "deterministic", "engine",
                               "dispatcher", "log_level", "max_body", "max_prompt_chars",
                               "max_queue", "queue_timeout", "stop_grace", "api_key",
                               "api_key_file"])
    serve.set_defaults(func=cmd_serve)
    broker = sub.add_parser("broker", help="run the dispatcher alone; workers and front ends "
                                           "connect to it by address")
    config.add_options(broker, ["dispatcher", "port", "log_level", "max_queue",
                                "queue_timeout", "stop_grace"])
    broker.set_defaults(func=cmd_broker)
    status = sub.add_parser("status", help="show workers, queue and front ends")
    config.add_options(status, ["dispatcher", "port"])
    status.add_argument("--json", action="store_true", help="print JSON for scripts")
    status.set_defaults(func=cmd_status, log_level="warning")
    bench = sub.add_parser("bench", help="load-test any OpenAI-compatible server (this one "
                                         "by default) and print latency and throughput")
    config.add_options(bench, ["port"])
    from dispatcher import bench as bench_module
    bench_module.add_arguments(bench)
    bench.set_defaults(func=bench_module.run, log_level="warning")
    soak = sub.add_parser("soak", help="a bounded chaos run on loopback: mixed requests, "
                                       "dropped clients, killed workers; lost must be 0")
    from dispatcher import soak as soak_module
    soak_module.add_arguments(soak)
    soak.set_defaults(func=soak_module.run, log_level="warning")
    args = config.resolve_repeats(parser.parse_args(argv))
    _setup_logging(args.log_level)
    return args.func(args)
