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


def wire_error(exc: Exception) -> P.WireError:
    """The error a request that failed with `exc` gets (its `error` event's content)."""
    if isinstance(exc, InvalidInput):
        return P.WireError(status=400, code=exc.code, message=str(exc), param=exc.param)
    if isinstance(exc, Stopping):
        return P.WireError(status=503, code="worker_stopping", message=str(exc))
    # Anything else (the engine refused, or a bug met odd content): this request
    # failed, the worker did not (SIE's "generation failed").
    detail = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
    return P.WireError(status=500, code="generation_failed",
                       message=f"generation failed: {detail}")
