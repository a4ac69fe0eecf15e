"""Errors of the worker side."""


class EngineError(Exception):
    """The inference engine refused an operation; the affected requests fail, the worker
    goes on serving."""
