"""CORS for browser-based clients (`--cors-origin ORIGIN`, repeatable, `*` for any; none by
default): preflights are answered before authentication (browsers send no credentials on
them), and `Access-Control-Allow-Origin` echoes an allowed origin, never another one."""
from __future__ import annotations

from flask import Flask, request

from app.auth import OPERATOR_PATHS

REQUEST_HEADERS = ("Authorization, Content-Type, X-Session-Id, X-Request-Timeout, "
                   "X-SIE-MACHINE-PROFILE")
EXPOSED_HEADERS = "X-Request-Id, Retry-After"
MAX_AGE = "600"


def init_app(app: Flask) -> None:
    origins = {o.strip() for o in app.config.get("CORS_ORIGINS") or [] if o.strip()}
    if not origins:
        return
    any_origin = "*" in origins

    def allowed(origin: str | None) -> bool:
        return bool(origin) and (any_origin or origin in origins)

    @app.before_request
    def preflight():
        if request.method != "OPTIONS" or \
                "Access-Control-Request-Method" not in request.headers:
            return None
        response = app.response_class(status=204)
        origin = request.headers.get("Origin")
        if allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Access-Control-Allow-Headers"] = \
                request.headers.get("Access-Control-Request-Headers") or REQUEST_HEADERS
            response.headers["Access-Control-Max-Age"] = MAX_AGE
        response.vary.add("Origin")
        return response

    @app.after_request
    def allow_origin(response):
        origin = request.headers.get("Origin")
        # (an operator path answered without a key, to a client on this host, is not
        # for another origin's page to read: a page a browser here loaded could read
        # every key's usage off /metrics)
        unkeyed_operator = request.path in OPERATOR_PATHS and \
            not request.headers.get("Authorization")
        if allowed(origin) and not unkeyed_operator and \
                "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        response.vary.add("Origin")
        return response
