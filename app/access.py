"""The access log: one line per request, written once its answer is done (a stream's
last byte sent, or the client gone), in logfmt (`key=value`, space-separated;
a value with spaces, quotes or anything but printable ASCII is a quoted JSON string).

It says who asked for what and how it went, never what was asked: no prompt, suffix,
grammar or generated text, no query string, and the API key only as a short fingerprint
(the first 8 hex digits of its SHA-256, the same on every front end).

`--access-log` (COMPLETIONS_ACCESS_LOG): `-` the server's stderr (the default), `off`,
or a file path (reopened when logrotate moves it).

The same record gives the usage per API key (`--usage-by-key`, on by default): each
answered request adds its prompt and completion tokens, and whether it failed, to its
key's name (app.auth) in the counts the front end sends the dispatcher with its
heartbeat (`dispatcher.common.latency`), which /metrics and `dispatcher usage` show.
"""
from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from datetime import datetime, timezone

from flask import Flask, request

from app.auth import TENANT, client_address
from app.metrics import QUIET_PATHS
from dispatcher.common.apikeys import key_fingerprint as fingerprint
from dispatcher.common.logs import one_line_json

ENVIRON_KEY = "completions.access"
FIELDS = ("time", "request_id", "method", "route", "status", "duration_ms", "ttft_ms",
          "prompt_tokens", "cached_tokens", "completion_tokens", "model", "worker", "key",
          "client", "user_agent", "error")
MAX_VALUE = 200         # a client-chosen value (path, user agent) is cut to this length


def key_fingerprint(authorization: str) -> str:
    """The bearer token's fingerprint, or "-" without one."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return "-"
    return fingerprint(token)


def logfmt_value(value) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    text = str(value)[:MAX_VALUE]
    if text.isascii() and text.isprintable() and not any(c in text for c in ' ="\\'):
        return text
    return json.dumps(text)         # quoted: a JSON string, ASCII only, one line


def format_line(record: dict) -> str:
    return " ".join(f"{name}={logfmt_value(record.get(name))}" for name in FIELDS)


class RequestRecord(dict):
    """What the route learns about its request for the access line (see `serve`)."""

    def jobs(self, plans) -> None:
        self["_prompt_of"] = [plan.prompt_index for plan in plans]

    def observe(self, index: int, event, kind: str, now: float) -> None:
        """One event of job `index` (protocol Start / Text / End)."""
        if kind == "start":
            workers = self.setdefault("_workers", [])
            worker = str(event.worker or "")
            if worker and worker not in workers:
                workers.append(worker)
            prompt_of = self.get("_prompt_of") or []
            key = prompt_of[index] if index < len(prompt_of) else index
            self.setdefault("_prompts", {})[key] = (event.prompt_tokens, event.cached_tokens)
        elif kind == "text" and "ttft_ms" not in self:
            self["ttft_ms"] = (now - self["_started"]) * 1000
        elif kind == "end":
            self["_completion"] = self.get("_completion", 0) + \
                (event.usage.completion_tokens if event.usage else 0)

    def failed(self, code: str | None) -> None:
        self.setdefault("error", code or "error")

    def tokens(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens) of the request so far."""
        prompts = self.get("_prompts") or {}
        return sum(p for p, _ in prompts.values()), self.get("_completion", 0)

    def line(self, status: int) -> str:
        prompts = self.get("_prompts") or {}
        out = {**self, "status": status,
               "duration_ms": (time.perf_counter() - self["_started"]) * 1000,
               "worker": ",".join(self.get("_workers") or [])}
        if prompts:
            out["prompt_tokens"] = sum(p for p, _ in prompts.values())
            out["cached_tokens"] = sum(c for _, c in prompts.values())
        if "_completion" in self:
            out["completion_tokens"] = self["_completion"]
        return format_line(out)

    def json_line(self, status: int) -> str:
        """The same fields as one JSON object (--log-format json), with `level` and
        `part`; a field with no value left out."""
        prompt, completion = self.tokens()
        prompts = self.get("_prompts") or {}
        fields = {"time": self.get("time"), "level": "info", "part": "access",
                  "request_id": self.get("request_id"), "method": self.get("method"),
                  "route": (self.get("route") or "")[:MAX_VALUE], "status": status,
                  "duration_ms": round((time.perf_counter() - self["_started"]) * 1000, 1),
                  "ttft_ms": round(self["ttft_ms"], 1) if "ttft_ms" in self else None,
                  "prompt_tokens": prompt if prompts else None,
                  "cached_tokens": sum(c for _, c in prompts.values()) if prompts else None,
                  "completion_tokens": completion if "_completion" in self else None,
                  "model": self.get("model"), "worker": ",".join(self.get("_workers") or [])
                  or None, "key": self.get("key"), "client": self.get("client"),
                  "user_agent": (self.get("user_agent") or "")[:MAX_VALUE] or None,
                  "error": self.get("error")}
        return one_line_json({k: v for k, v in fields.items() if v is not None})


def current() -> RequestRecord:
    """This request's record (a detached one outside a request or before init_app)."""
    record = request.environ.get(ENVIRON_KEY)
    if record is None:
        record = request.environ[ENVIRON_KEY] = RequestRecord(_started=time.perf_counter())
    return record


def _logger(destination: str) -> logging.Logger | None:
    """A logger of this app's own (outside the logging tree: several apps in one process,
    as in the tests, keep their destinations apart)."""
    if destination.lower() == "off":
        return None
    logger = logging.Logger("completions.access", logging.INFO)
    if destination == "-":
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        handler = logging.handlers.WatchedFileHandler(destination, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    return logger


def init_app(app: Flask) -> None:
    logger = _logger(str(app.config.get("ACCESS_LOG") or "-"))
    usage = bool(app.config.get("USAGE_BY_KEY", True))
    as_json = app.config.get("LOG_FORMAT") == "json"
    if logger is None and not usage:
        return

    @app.before_request
    def open_record():
        now = datetime.now(timezone.utc)
        request.environ[ENVIRON_KEY] = RequestRecord(
            _started=time.perf_counter(),
            time=now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            method=request.method, route=request.path,
            key=key_fingerprint(request.headers.get("Authorization", "")),
            client=client_address(request), user_agent=request.headers.get("User-Agent"))

    @app.after_request
    def close_record(response):
        record = request.environ.get(ENVIRON_KEY)
        if request.path == "/v1/status" and response.status_code < 400:
            return response         # (the status page reads it every 1.5 s; a refusal
                                    # is logged: key guessing there is seen)
        if record is not None and not record.get("_closing"):
            record["_closing"] = True
            status = response.status_code
            code = _error_code(response) if status >= 400 else None
            if code:
                record.failed(code)
            # (what machines read every second or so is no one's usage: app.metrics)
            tenant = request.environ.get(TENANT) \
                if usage and request.path not in QUIET_PATHS else None
            client = app.extensions.get("dispatcher_client")

            def done():                 # the answer's last byte is out (or the client left)
                if logger is not None:
                    logger.info(record.json_line(status) if as_json else record.line(status))
                if tenant is not None and client is not None:
                    client.recorder.used(tenant, *record.tokens(),
                                         error=status >= 400 or "error" in record)
            response.call_on_close(done)
        return response


def _error_code(response) -> str | None:
    if response.is_streamed or response.mimetype != "application/json":
        return None
    body = response.get_json(silent=True)
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") or error.get("type") if isinstance(error, dict) else None
