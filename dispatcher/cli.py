"""`python -m dispatcher`: the launcher (`serve`, `broker`), the ops tool (`status`,
`drain`, `resume`, `restart`, `reload`, `usage`, `check-config`), `selftest`, `bench` and
`soak`."""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import sys

from dispatcher.common.addresses import Endpoints, directory_problem, private_directory
from dispatcher.common import apikeys, config, configfile, logs
from dispatcher.common.models import resolve_model_path
from dispatcher.tools.ctl import default_dispatcher_address, dispatcher_answers

log = logging.getLogger("dispatcher")
FRONTEND_STOP_GRACE = 3     # seconds gunicorn gets once the dispatcher has drained
SERVE_OPTIONS = ["config", "host", "port", "frontends", "model", "model_id", "model_alias",
                 "operator_key", "fim_template", "prefill_chunk", "draft_max", "draft_model",
                 "cache_reuse",
                 "cors_origin", "device",
                 "nctx", "ngl", "slots", "kv_type", "batch", "ubatch", "deterministic",
                 "engine", "dispatcher",
                 "log_level", "log_format", "max_body", "max_prompt_chars", "max_queue",
                 "queue_timeout",
                 "stop_grace", "api_key", "api_key_file", "access_log", "step_timeout",
                 "max_connections", "header_timeout", "body_timeout", "send_timeout",
                 "heartbeat_interval",
                 "cache_scope", "max_queue_per_key", "log_content", "curve_keys",
                 "insecure_transport", "infer_sessions", "any_model_name", "usage_by_key",
                 "status_access"]


def _setup_logging(level: str, log_format: str = "text") -> None:
    logs.setup(level, log_format, "dispatcher")


def access_log_problem(destination: str) -> str | None:
    """Why the front ends could not write `--access-log` there, or None."""
    if destination in ("-", "off"):
        return None
    path = os.path.abspath(destination)
    if os.path.isdir(path):
        return f"--access-log {destination}: a directory, not a file"
    writable = os.access(path, os.W_OK) if os.path.exists(path) else \
        os.access(os.path.dirname(path), os.W_OK | os.X_OK)
    return None if writable else f"--access-log {destination}: not writable"


def _port_problem(host: str, port: int) -> str | None:
    """Why the front ends could not listen at host:port, in one line (None: they can)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            return f"--host {host}: not a name or address this host knows ({exc.strerror})"
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"{host}:{port} is already in use"
            return f"cannot listen at {host}:{port}: {exc.strerror or exc}"
    return None


def signal_handler(broker, grace: float):
    """SIGTERM/SIGINT/SIGHUP: the first drains (when there is a grace), the next stops now."""
    def on_signal(signum, frame):
        # No logging here: a handler that interrupts a log write in progress fails with a
        # reentrant call. The broker's loop logs what it was asked.
        if not broker.draining and grace > 0:
            broker.drain(grace, because=signal.Signals(signum).name)
        else:
            broker.stop(because=signal.Signals(signum).name)
    return on_signal


def _run_broker(broker, cleanup_dir: str | None, grace: float = 0.0) -> int:
    on_signal = signal_handler(broker, grace)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # a hangup (the terminal closed, an ssh session gone) stops it as SIGTERM does: its
    # default ended the launcher at once, streams cut and the ipc directory left behind
    signal.signal(signal.SIGHUP, on_signal)
    # A signal that lands on another thread (the token proxy's) still wakes the poll.
    signal.set_wakeup_fd(broker.wakeup_fd, warn_on_full_buffer=False)
    try:
        broker.run()
    finally:
        signal.set_wakeup_fd(-1)
        if broker.supervisor is not None:
            broker.supervisor.stop_all()
        broker.close()
        if cleanup_dir:
            shutil.rmtree(cleanup_dir, ignore_errors=True)
    return broker.exit_code


def _endpoints(args) -> tuple[Endpoints, str, str | None]:
    base = args.dispatcher or default_dispatcher_address(args.port)
    endpoints = Endpoints.from_base(base)
    # Binding an ipc address takes it over silently (and the leaving process would
    # remove the live one's directory): refuse while another dispatcher answers there.
    if dispatcher_answers(base):
        raise SystemExit(f"a dispatcher is already running at {base}: stop it first, or "
                         "choose another --port or --dispatcher")
    cleanup = None
    if base.startswith("ipc://"):
        cleanup = base[len("ipc://"):]
        problem = private_directory(cleanup)
        if problem:
            raise SystemExit(problem)
        if args.dispatcher:
            cleanup = None           # a directory the operator chose is theirs to keep
    return endpoints, base, cleanup


def _count_keys(args) -> int:
    """The API keys configured (flags, variables, the key file), or one line why not."""
    if any("," in key for key in args.api_key or []):
        # (keys reach the front ends comma-separated: one was split into two)
        raise SystemExit("--api-key: a key holds a comma, which separates keys; put such "
                         "a key in --api-key-file")
    if any("," in key for key in getattr(args, "operator_key", None) or []):
        raise SystemExit("--operator-key: a key holds a comma, which separates keys")
    for flag, keys in (("--api-key", args.api_key), ("--operator-key",
                                                      getattr(args, "operator_key", None))):
        if any(not key.strip() for key in keys or []):
            # (`--api-key "$KEY"` with KEY unset: no key at all, and an open server)
            raise SystemExit(f"{flag}: a key is empty (an unset variable?); without keys "
                             "leave the option out")
    try:
        return len(apikeys.load_keys(",".join(args.api_key or []), args.api_key_file))
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"--api-key-file {args.api_key_file}: cannot be read ({exc})") \
            from None
    except ValueError as exc:
        raise SystemExit(f"--api-key-file: {exc}") from None


def _make_broker(broker_class, base: str, *args, **kwargs):
    import zmq
    try:
        return broker_class(*args, **kwargs)
    except zmq.ZMQError as exc:           # a tcp port in use, an ipc path not writable
        raise SystemExit(f"cannot listen at {base}: {exc}") from None


def cmd_serve(args) -> int:
    from dispatcher.broker import Broker
    from dispatcher.supervisor import Child, Supervisor

    try:
        plan = configfile.plan_for(args)
    except configfile.ConfigError as exc:
        raise SystemExit(exc.report())
    if args.api_key_file and not os.access(args.api_key_file, os.R_OK):
        raise SystemExit(f"--api-key-file {args.api_key_file}: not readable")
    if args.draft_model:                # (one line now, not a worker refusing later)
        try:
            args.draft_model = str(resolve_model_path(args.draft_model))
        except SystemExit as exc:
            raise SystemExit(f"--draft-model: {exc}") from None
    if args.frontends and access_log_problem(args.access_log):
        raise SystemExit(access_log_problem(args.access_log))
    problem = _port_problem(args.host, args.port) if args.frontends else None
    if problem:
        raise SystemExit(problem)
    if args.log_content:
        log.warning("--log-content: request content (prompts, grammars) may reach the logs "
                    "of this server and its workers at --log-level debug")
    n_keys = _count_keys(args)          # (before the ipc directory is made)
    endpoints, base, cleanup = _endpoints(args)
    keys = _dispatcher_keys(args, base, n_keys > 0)
    supervisor = Supervisor()
    broker = _make_broker(Broker, base, endpoints, supervisor,
                          known_models={m.id: {"n_ctx": m.nctx, "aliases": list(m.aliases)}
                                        for m in plan.models},
                          max_queue=args.max_queue, queue_timeout=args.queue_timeout,
                          heartbeat=config.Heartbeat.of(args),
                          max_queue_per_key=config.queue_share(
                              args.max_queue, args.max_queue_per_key, n_keys),
                          keys=keys, infer_sessions=args.infer_sessions,
                          key_slot_share=config.KEY_SLOT_SHARE if n_keys > 1 else 1.0)
    for worker in plan.workers:
        supervisor.add(_worker_child(Child, worker, args, base, keys is not None))
    if args.frontends:
        supervisor.add(_frontend_child(Child, args, base, keys is not None))
    models = ", ".join(f"{m.id} ({m.path})" for m in plan.models)
    banner = (f"serving {models} on http://{args.host}:{args.port} with {args.frontends} "
              f"front end(s) and {len(plan.workers)} worker(s): "
              f"{', '.join(str(w.device) for w in plan.workers)}; dispatcher at {base}")
    if args.log_format == "json":
        log.info("%s", banner)
    else:
        print(banner, file=sys.stderr, flush=True)
    return _run_broker(broker, cleanup, args.stop_grace)


def _worker_child(Child, worker: configfile.WorkerPlan, args, base: str, keyed: bool):
    """A worker's process: every option on its command line (only the device's visibility
    variables, which the inference library reads when it loads, go by environment)."""
    from dispatcher.common.process import python_module_argv
    argv = python_module_argv("workers", *worker.argv(base, args.engine, args.log_level),
                              "--prefill-chunk", str(args.prefill_chunk),
                              "--draft-max", str(args.draft_max),
                              *(["--draft-model", args.draft_model]
                                if args.draft_model else []),
                              "--cache-reuse", str(args.cache_reuse),
                              "--step-timeout", str(args.step_timeout),
                              "--heartbeat-interval", str(args.heartbeat_interval),
                              "--log-content", str(args.log_content),
                              "--log-format", args.log_format,
                              *(["--curve-keys", args.curve_keys, "--curve-name", "local"]
                                if keyed else []),
                              *(["--insecure-transport"] if args.insecure_transport else []))
    return Child(worker.name, argv, env=worker.device.visible_devices(),
                 extra={"device": str(worker.device), "model": worker.model.id})


def _frontend_child(Child, args, base: str, keyed: bool):
    """The front ends' process: gunicorn, configured by environment (keys too: ps shows
    command lines)."""
    from dispatcher.common.process import python_module_argv
    env = {"COMPLETIONS_DISPATCHER": base, "COMPLETIONS_HOST": args.host,
           "COMPLETIONS_PORT": str(args.port), "COMPLETIONS_FRONTENDS": str(args.frontends),
           "COMPLETIONS_MAX_BODY": str(args.max_body),
           "COMPLETIONS_MAX_PROMPT_CHARS": str(args.max_prompt_chars),
           "COMPLETIONS_LOG_LEVEL": args.log_level,
           "COMPLETIONS_LOG_FORMAT": args.log_format,
           "COMPLETIONS_ACCESS_LOG": args.access_log,
           "COMPLETIONS_MAX_CONNECTIONS": str(args.max_connections),
           "COMPLETIONS_HEADER_TIMEOUT": str(args.header_timeout),
           "COMPLETIONS_BODY_TIMEOUT": str(args.body_timeout),
           "COMPLETIONS_SEND_TIMEOUT": str(args.send_timeout),
           "COMPLETIONS_HEARTBEAT_INTERVAL": str(args.heartbeat_interval),
           "COMPLETIONS_CACHE_SCOPE": args.cache_scope or "",
           "COMPLETIONS_CURVE_KEYS": args.curve_keys if keyed else "",
           "COMPLETIONS_CURVE_NAME": "local",
           "COMPLETIONS_INSECURE_TRANSPORT": "true" if args.insecure_transport else "",
           "COMPLETIONS_API_KEY": ",".join(args.api_key),
           "COMPLETIONS_OPERATOR_KEY": ",".join(args.operator_key or []),
           "COMPLETIONS_API_KEY_FILE": args.api_key_file or "",
           # (blank items dropped: a variable of commas alone is refused where read)
           "COMPLETIONS_CORS_ORIGIN": ",".join(o for o in args.cors_origin if o.strip()),
           "COMPLETIONS_ANY_MODEL_NAME": "true" if args.any_model_name else "",
           "COMPLETIONS_USAGE_BY_KEY": "true" if args.usage_by_key else "false",
           "COMPLETIONS_STATUS_ACCESS": args.status_access}
    return Child(configfile.FRONTEND_NAME, python_module_argv(
        # The dispatcher has drained in-flight requests (--stop-grace) before the front
        # ends are stopped: their worker (app/gunicorn_worker.py) closes idle keep-alive
        # connections at once; this bounds whatever else is left.
        "gunicorn", "-c", "python:app.gunicorn_conf", "--graceful-timeout",
        str(FRONTEND_STOP_GRACE)), env, kind="frontend")


def _dispatcher_keys(args, base: str, tenants: bool):
    """The dispatcher's CURVE keys (None: unkeyed), refusing in one line a tcp address
    beyond loopback without them unless --insecure-transport (with API keys, `tenants`,
    a loopback one too)."""
    from dispatcher.common import curve
    problem = curve.transport_problem(base, args.curve_keys, args.insecure_transport,
                                      tenants)
    if problem:
        raise SystemExit(problem)
    if not args.curve_keys:
        if not curve.is_loopback(base):
            log.warning("--insecure-transport: %s is UNAUTHENTICATED and UNENCRYPTED; "
                        "anyone who reaches it can read every token and submit work", base)
        return None
    try:
        return curve.DispatcherKeys.load(args.curve_keys)
    except curve.CurveKeyError as exc:
        raise SystemExit(str(exc)) from None


def cmd_keygen(args) -> int:
    from dispatcher.common import curve
    try:
        written = curve.keygen(args.directory, args.worker or [], args.frontend or [])
    except curve.CurveKeyError as exc:
        raise SystemExit(str(exc)) from None
    print(f"keys in {args.directory}: " + (", ".join(written) + " written" if written
                                           else "nothing new"))
    return 0


def cmd_broker(args) -> int:
    from dispatcher.broker import Broker
    # the same shares and model names as `serve` gives its dispatcher, from the same file
    # (the front ends check the keys; the dispatcher counts them for the shares)
    try:
        known = configfile.known_models(args.file_data)
    except configfile.ConfigError as exc:
        raise SystemExit(exc.report())
    if args.api_key_file and not os.access(args.api_key_file, os.R_OK):
        raise SystemExit(f"--api-key-file {args.api_key_file}: not readable")
    n_keys = _count_keys(args)
    endpoints, base, cleanup = _endpoints(args)
    broker = _make_broker(Broker, base, endpoints, known_models=known,
                          max_queue=args.max_queue,
                          queue_timeout=args.queue_timeout, heartbeat=config.Heartbeat.of(args),
                          max_queue_per_key=config.queue_share(
                              args.max_queue, args.max_queue_per_key, n_keys),
                          keys=_dispatcher_keys(args, base, n_keys > 0),
                          infer_sessions=args.infer_sessions,
                          key_slot_share=config.KEY_SLOT_SHARE if n_keys > 1 else 1.0)
    print(f"dispatcher at {base}", file=sys.stderr, flush=True)
    return _run_broker(broker, cleanup, args.stop_grace)


def cmd_check_config(args) -> int:
    """Everything `serve` would check, without starting anything."""
    problems: list[str] = []
    try:
        plan = configfile.plan_for(args)
    except configfile.ConfigError as exc:
        problems, plan = exc.problems, None
    unreadable = args.api_key_file and not os.access(args.api_key_file, os.R_OK)
    if unreadable:
        problems.append(f"api_key_file {args.api_key_file}: not readable")
    if args.draft_model:                # (as serve resolves it)
        try:
            resolve_model_path(args.draft_model)
        except SystemExit as exc:
            problems.append(f"draft_model: {exc}")
    if access_log_problem(args.access_log):
        problems.append(access_log_problem(args.access_log))
    if args.frontends and _port_problem(args.host, 0):  # (the host; a port in use may
        problems.append(_port_problem(args.host, 0))    # be free by the time serve runs)
    from dispatcher.common import curve
    base = args.dispatcher or default_dispatcher_address(args.port)
    try:
        tenants = _count_keys(args) > 0
    except SystemExit as exc:           # (its one line, as a problem; once)
        if not unreadable:
            problems.append(str(exc))
        tenants = True
    problem = curve.transport_problem(base, args.curve_keys, args.insecure_transport, tenants)
    if problem:
        problems.append(problem)
    if args.curve_keys:
        try:
            curve.DispatcherKeys.load(args.curve_keys)
        except curve.CurveKeyError as exc:
            problems.append(str(exc))
    base = args.dispatcher or default_dispatcher_address(args.port)
    try:
        Endpoints.from_base(base)
        problem = directory_problem(base[len("ipc://"):]) \
            if base.startswith("ipc://") else None
        if problem:                     # (as `serve` would refuse it; nothing made here)
            problems.append(problem)
    except ValueError as exc:
        problems.append(f"dispatcher: {exc}")
    if args.json:
        print(json.dumps({"ok": not problems, "problems": problems, "models": [
            {"id": m.id, "path": str(m.path), "nctx": m.nctx, "aliases": list(m.aliases),
             "fim_template": m.fim_template} for m in plan.models]
            if plan else [], "workers": [
            {"name": w.name, "device": str(w.device), "model": w.model.id, "slots": w.slots,
             "nctx": w.nctx, "kv_type": w.kv_type, "batch": w.batch, "ubatch": w.ubatch}
            for w in plan.workers] if plan else [],
            "unserved_models": unserved(plan) if plan else []}, indent=2))
    elif problems:
        print(f"{len(problems)} problem(s):")
        for problem in problems:
            print(f"  - {problem}")
    else:
        print(f"config OK: {len(plan.models)} model(s), {len(plan.workers)} worker(s), "
              f"{args.frontends} front end(s) on {args.host}:{args.port}")
        for w in plan.workers:
            print(f"  {w.name}: {w.device} serves {w.model.id} ({w.model.path}), "
                  f"{w.slots} slots, context {w.nctx}, KV {w.kv_type}, batch "
                  f"{w.batch}/{w.ubatch}")
        for model in unserved(plan):
            print(f"  note: no worker here serves {model}: only a worker started on "
                  "another host can (until one is ready its requests wait, then 503 "
                  "no_worker_ready)")
    return 1 if problems else 0


def unserved(plan) -> list[str]:
    """The plan's models that none of its workers serve (a remote worker's, or a typo in
    a [[workers]] entry's `model` left to its default)."""
    served = {w.model.id for w in plan.workers}
    return [m.id for m in plan.models if m.id not in served]


def _config_values(argv: list[str] | None) -> dict:
    """Phase one: find and read the config file (--config or COMPLETIONS_CONFIG)."""
    try:
        return configfile.read_for(argv)
    except configfile.ConfigError as exc:
        raise SystemExit(exc.report())
    except ValueError as exc:           # (COMPLETIONS_CONFIG's value: config._path)
        raise SystemExit(f"COMPLETIONS_CONFIG: {exc}") from None


# What the ops commands read to find the dispatcher (the config file's [server] too)
OPS_OPTIONS = ["config", "dispatcher", "port", "curve_keys", "curve_name"]


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    try:
        data = _config_values(argv)
    except SystemExit as exc:
        if "check-config" in given and "--json" in given:      # (a reader wants JSON)
            print(json.dumps({"ok": False, "problems": [str(exc)], "models": [],
                              "workers": [], "unserved_models": []}, indent=2))
            return 1
        if not (given[:1] == ["keygen"] or "-h" in given or "--help" in given):
            raise
        data = {}               # (help, and keys made, whatever the file says)
    file_values = configfile.server_defaults(data)
    parser = config.ArgumentParser(prog="python -m dispatcher", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the dispatcher, the workers and the front ends")
    config.add_options(serve, SERVE_OPTIONS, file_values)
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check-config", help="check the configuration (file, variables, "
                                                "flags) without starting anything")
    config.add_options(check, SERVE_OPTIONS, file_values)
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=cmd_check_config, log_level="warning")
    broker = sub.add_parser("broker", help="run the dispatcher alone; workers and front ends "
                                           "connect to it by address")
    config.add_options(broker, ["config", "dispatcher", "port", "log_level", "log_format",
                                "max_queue",
                                "queue_timeout", "stop_grace", "heartbeat_interval",
                                "max_queue_per_key", "curve_keys", "insecure_transport",
                                "infer_sessions", "api_key", "api_key_file"],
                       file_values)
    broker.set_defaults(func=cmd_broker)
    keygen = sub.add_parser("keygen", help="write CURVE key pairs for the dispatcher and "
                                           "its parts (see docs/deploying.md)")
    keygen.add_argument("directory")
    keygen.add_argument("--worker", action="append", metavar="NAME",
                        help="a key for workers named NAME or NAME-... (repeatable)")
    keygen.add_argument("--frontend", action="append", metavar="NAME",
                        help="a key for a front end started on its own (repeatable)")
    keygen.set_defaults(func=cmd_keygen, log_level="warning")
    from dispatcher.tools import ctl
    status = sub.add_parser("status", help="show workers, queue and front ends")
    config.add_options(status, OPS_OPTIONS, file_values)
    status.add_argument("--json", action="store_true", help="print JSON for scripts")
    status.set_defaults(func=ctl.cmd_status, log_level="warning")
    usage = sub.add_parser("usage", help="show requests, tokens and errors per API key")
    config.add_options(usage, OPS_OPTIONS, file_values)
    usage.add_argument("--json", action="store_true", help="print JSON for scripts")
    usage.set_defaults(func=ctl.cmd_usage, log_level="warning")
    ctl.add_worker_commands(sub, config, file_values, OPS_OPTIONS)
    bench = sub.add_parser("bench", help="load-test any OpenAI-compatible server (this one "
                                         "by default) and print latency and throughput")
    config.add_options(bench, ["port"], file_values)
    from dispatcher.tools import bench as bench_module, selftest as selftest_module
    bench_module.add_arguments(bench)
    bench.set_defaults(func=bench_module.run, log_level="warning")
    selftest = sub.add_parser("selftest", help="check each configured device alone: "
                              "placement, prefill and decode speed; one line per failure")
    # (every `serve` flag, so that `selftest` runs with the same command line; those
    # that are not the devices' are read and left unused)
    config.add_options(selftest, SERVE_OPTIONS, file_values)
    selftest_module.add_arguments(selftest)
    selftest.set_defaults(func=selftest_module.run, log_level="warning")
    soak = sub.add_parser("soak", help="a bounded chaos run on loopback: mixed requests, "
                                       "dropped clients, killed workers; lost must be 0")
    from dispatcher.tools import soak as soak_module
    soak_module.add_arguments(soak)
    soak.set_defaults(func=soak_module.run, log_level="warning")
    args = config.resolve(parser.parse_args(argv), data)
    _setup_logging(args.log_level, getattr(args, "log_format", "text"))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:         # one line, never a traceback (at debug: the traceback)
        log.debug("%s failed", args.command, exc_info=True)
        kind = "" if isinstance(exc, (OSError, ValueError)) else f"{type(exc).__name__}: "
        print(f"python -m dispatcher {args.command}: error: {kind}{exc}", file=sys.stderr)
        return 1
