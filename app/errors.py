"""One exception hierarchy, each class one HTTP status, all rendered in OpenAI's envelope.
Each error's `type` follows from its status by the one table every layer uses
(`protocol.error_type`): no class states it.

`{"error": {"message", "type", "param", "code"}}` as a JSON body before a response has
started, or as the next SSE event once a stream has (see `app.sse`).
"""
from __future__ import annotations

from flask import Flask, current_app, jsonify, request
from werkzeug.exceptions import HTTPException

from dispatcher.common import protocol as P
from dispatcher.common.config import RETRY_AFTER_SECONDS


class APIError(Exception):
    """An error a client can act on; the base of every error the API returns."""
    status = 500
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        """OpenAI's error type, from the status (protocol.ERROR_TYPES)."""
        return P.error_type(self.status)

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    """The request is malformed or a field is invalid (400)."""
    status = 400


class Unauthorized(APIError):
    """No valid API key (401)."""
    status = 401
    code = "invalid_api_key"


class NotFound(APIError):
    """No such model or route (404)."""
    status = 404


class MethodNotAllowed(APIError):
    """The route exists but not for this method (405)."""
    status = 405


class Conflict(APIError):
    """Superseded by a newer request of the same session (409)."""
    status = 409
    code = "superseded"


class RequestTimeout(APIError):
    """The client did not send its body within --body-timeout (408)."""
    status = 408
    code = "body_timeout"


class ClientClosedRequest(APIError):
    """The client left before its request was read whole (nginx's 499: nobody reads it,
    the access log does)."""
    status = 499
    code = "client_closed"


class PayloadTooLarge(APIError):
    """The body or prompt is over the configured limit (413)."""
    status = 413
    code = "request_too_large"


class UnsupportedMediaType(APIError):
    """The body is not JSON (415)."""
    status = 415
    code = "unsupported_media_type"


class Overloaded(APIError):
    """The queue is full (429)."""
    status = 429
    code = "queue_full"


class BadGateway(APIError):
    """The token stream from the worker lost messages (502): never silently missing text."""
    status = 502
    code = "stream_gap"


class ServiceUnavailable(APIError):
    """No worker can take the request now: none ready, dispatcher gone, worker lost (503).
    Always says when to try again."""
    status = 503
    code = "service_unavailable"

    def __init__(self, message: str, **kwargs):
        super().__init__(message, **kwargs)
        self.headers.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))


class GatewayTimeout(APIError):
    """The request's deadline passed before it could run (504)."""
    status = 504
    code = "timeout"


class ServerError(APIError):
    """A fault of ours; never the result of bad input (500)."""


class NotSupported(APIError):
    """The model cannot do what the request asks (501, llama.cpp's answer to /infill on a
    model without fill-in-the-middle)."""
    status = 501
    code = "not_supported"


_BY_STATUS = {cls.status: cls for cls in (InvalidRequest, Unauthorized, NotFound,
                                          MethodNotAllowed, Conflict, PayloadTooLarge,
                                          RequestTimeout,
                                          UnsupportedMediaType, Overloaded, BadGateway,
                                          ServiceUnavailable, GatewayTimeout, ServerError,
                                          NotSupported)}


def from_wire(error) -> APIError:
    """Rebuild an error sent by the dispatcher or a worker (a `protocol.WireError` or an
    `Error` event): the class of its status, whose `type` is the one
    `protocol.error_type` gives that status."""
    cls = _BY_STATUS.get(error.status, ServerError)
    api_error = cls(error.message, param=error.param, code=error.code)
    if error.retry_after:
        api_error.headers["Retry-After"] = str(error.retry_after)
    return api_error


def error_response(error: APIError):
    response = jsonify(error.to_dict())
    response.status_code = error.status
    for name, value in error.headers.items():
        response.headers[name] = value
    if error.status == 409:
        # superseded by a newer request of the session: the openai packages retry a 409
        # (a lock timeout to them) unless told not to, and the retry superseded the newer
        response.headers["X-Should-Retry"] = "false"
    return response


def _routes() -> list[str]:
    """The routes this app serves, read from its URL map (a list written out by hand
    fell behind the routes added since): method and path, the status page's files and
    static files left out."""
    out = set()
    for rule in current_app.url_map.iter_rules():
        if rule.endpoint == "static" or "<" in rule.rule and rule.endpoint != \
                "status.retrieve_model":
            continue
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            path = rule.rule.replace("<path:model>", "{model}")
            out.add(f"{method} {path}" + (" (the status page)" if path == "/" else ""))
    return sorted(out, key=lambda r: (not r.split()[1].startswith("/v1/"), r.split()[1]))


def _no_route(path: str) -> str:
    """A 404's message: what this server is and the routes it has (never a generic page:
    a client pointed at the wrong route should learn which one it wanted)."""
    shown = ascii(path)[1:-1][:80]
    what = ("This server serves raw-text completions (the prompt passed to the model "
            "verbatim), not chat: send the prompt to POST /v1/completions." if "chat" in path
            else f"There is no route {shown} here.")
    return f"{what} Routes: {', '.join(_routes())}."


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(APIError, error_response)

    @app.errorhandler(HTTPException)
    def http_exception(exc: HTTPException):
        cls = _BY_STATUS.get(exc.code or 500, InvalidRequest if (exc.code or 500) < 500
                             else ServerError)
        error = cls(exc.description or exc.name)
        error.status = exc.code or 500
        if exc.code == 404:
            error.code = "not_found"
            error.message = _no_route(request.path)
        elif exc.code == 400 and error.code is None:   # (werkzeug's own: a code, always)
            error.code = "bad_request"
            if request.headers.get("Upgrade", "").lower() == "websocket":
                error.message = ("This server speaks HTTP (Server-Sent Events for "
                                 "streams), not WebSocket.")
        elif exc.code == 405:
            allowed = sorted(getattr(exc, "valid_methods", None) or [])
            error.code = "method_not_allowed"
            error.message = f"{request.method} is not allowed here; use " + \
                " or ".join(allowed) if allowed else error.message
            error.headers["Allow"] = ", ".join(allowed)
        return error_response(error)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        app.logger.exception("unhandled error")
        return error_response(ServerError("internal server error"))
