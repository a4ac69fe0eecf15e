"""gunicorn settings for the front ends, from COMPLETIONS_* variables (and the config file
that COMPLETIONS_CONFIG names).

Used by `python -m dispatcher serve` (as `-c python:app.gunicorn_conf`) and by
`deploy/gunicorn.conf.py` for a front end run on its own.
"""
import logging
import math
import os
import signal

from dispatcher.common import logs as _logs
from dispatcher.common.apikeys import load_keys as _load_keys
from dispatcher.common.configfile import SettingError as _SettingError
from dispatcher.common.configfile import effective as _effective

try:
    _options = _effective(["host", "port", "frontends", "log_level", "log_format",
                           "max_connections", "stop_grace", "api_key_file"])
    if _options["api_key_file"]:        # (a file of no keys: refused, not an open server)
        try:
            _load_keys(None, _options["api_key_file"])
        except (OSError, ValueError) as _exc:
            raise _SettingError(f"COMPLETIONS_API_KEY_FILE: {_exc}") from None
except _SettingError as _exc:          # one line, not a traceback
    raise SystemExit(str(_exc)) from None
# (an IPv6 address as written in a URL, "[::1]", as well as bare)
_host, _port = _options["host"].strip("[]"), _options["port"]

wsgi_app = "app:create_app()"
bind = [f"[{_host}]:{_port}" if ":" in _host else f"{_host}:{_port}"]
workers = max(1, _options["frontends"])
worker_class = "app.gunicorn_worker.FrontendWorker"   # gevent, stops promptly
worker_connections = _options["max_connections"]   # and a reserve for /health: see
                                                    # app/gunicorn_worker.py
timeout = 30            # gevent workers heartbeat from a greenlet: not a request timeout
# in-flight streams get this long after SIGTERM (--stop-grace, as the dispatcher and the
# workers; `serve` drains first and passes a few seconds on the command line)
graceful_timeout = math.ceil(_options["stop_grace"])     # (gunicorn takes whole seconds)
keepalive = 75          # longer than nginx's upstream keepalive_timeout
proc_name = "completions-frontend"
control_socket_disable = True   # gunicorn 27's control socket: one fixed path per user
loglevel = _options["log_level"]
# the app's own loggers (`app.*`: the debug line for ignored native fields, errors) at the
# same level, in the format of the dispatcher's and workers' lines
_logs.setup(loglevel, _options["log_format"], "frontend")
if _options["log_format"] == "json":
    # gunicorn's own error log (its access log stays off: app/access.py is the access log)
    logconfig_dict = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"json": {"()": "dispatcher.common.logs.JsonFormatter",
                                "part": "frontend"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json",
                                "stream": "ext://sys.stderr"}},
        "loggers": {"gunicorn.error": {"handlers": ["stderr"], "level": loglevel.upper(),
                                       "propagate": False}},
        "root": {"handlers": ["stderr"], "level": loglevel.upper()}}


def on_starting(server):
    if os.environ.get("COMPLETIONS_PARENT_PID"):
        from dispatcher.common.process import die_with_parent
        die_with_parent(int(os.environ["COMPLETIONS_PARENT_PID"]))


def _leave_ctrl_c_to_the_launcher():
    # Ctrl-C in a terminal signals `serve`'s whole process group; gunicorn's answer is a
    # quick shutdown that cuts open streams. The launcher drains the dispatcher first,
    # then stops the front ends (SIGTERM, a graceful stop).
    if os.environ.get("COMPLETIONS_PARENT_PID"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def when_ready(server):
    _leave_ctrl_c_to_the_launcher()          # (the arbiter's handlers are set by now)


def post_worker_init(worker):
    _leave_ctrl_c_to_the_launcher()
    # Connect and subscribe at start-up, not on the first request.
    from app.client import get_client
    get_client(worker.wsgi)


def worker_exit(server, worker):
    # The counts since the last heartbeat (requests, latency, each key's usage) go to the
    # dispatcher before the process ends: a restart lost up to an interval of them.
    client = getattr(worker, "wsgi", None) and worker.wsgi.extensions.get("dispatcher_client")
    if client is not None and client.pid == os.getpid():
        client.close(send_counts=True)
