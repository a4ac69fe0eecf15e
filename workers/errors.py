"""Errors of the worker side."""


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
