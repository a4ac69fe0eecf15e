"""Errors of the worker side, and the `error` stream event each one becomes."""
from dispatcher.common import protocol as P


class EngineError(Exception):
    """The inference engine refused an operation; the affected requests fail, the worker
    goes on serving."""


class InvalidInput(EngineError):
    """The request cannot run as asked (a bad grammar, a token id outside the vocabulary,
    a prompt longer than the context): a 400 for that request only."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


class Stopping(EngineError):
    """The worker is shutting down with this request's text already out."""


def error_event(exc: Exception) -> dict:
    """The `error` event for a request that failed with `exc`."""
    if isinstance(exc, InvalidInput):
        error = P.WireError(400, exc.code, str(exc), exc.param)
    elif isinstance(exc, Stopping):
        error = P.WireError(503, "worker_stopping", str(exc))
    else:
        # Anything else (the engine refused, or a bug met odd content): this request
        # failed, the worker did not (SIE's "generation failed").
        detail = str(exc) if isinstance(exc, EngineError) else \
            f"{type(exc).__name__}: {exc}"
        error = P.WireError(500, "generation_failed", f"generation failed: {detail}")
    return error.event()
