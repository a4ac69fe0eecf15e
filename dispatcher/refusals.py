"""What the dispatcher tells a front end when it does not run a request, or stops running
one: each refusal and failure with its status, code and message, stated once.

The core (`dispatcher.core`) decides when; this module says what. `admission` is the
ladder of checks a job meets before it is queued (a job naming no earlier job of its
request, a job without an id, a stopping server, no worker, an unknown model, a route no
worker can meet), in the order a client should hear them; the other functions are the errors of one situation each.
"""
from __future__ import annotations

from dispatcher.common import config, protocol as P
from dispatcher.common.fit import explain_unfit, fits


def admission(request_id: str, body: P.SubmittedJob | None, models: dict, infos: list,
              draining: bool, short_of_workers: bool) -> P.WireError | None:
    """Why a job cannot be queued at all, or None. `body` None: it named (same_as) no
    earlier job of its request; `short_of_workers`: fewer workers are registered than
    the fleet runs (one still starting may meet the route)."""
    if body is None:
        return P.WireError(status=400, code="bad_job",
                           message="the job's same_as names no earlier job of its request")
    if not request_id:
        return P.WireError(status=400, code="bad_job", message="the job lacks an id")
    if draining:
        return shutting_down()
    if not models:
        return no_worker_ready("no worker is ready")
    model = body.model
    if model not in models:
        return P.WireError(status=404, code="model_not_found",
                           message=f"The model '{model}' does not exist")
    if any(fits(model, body.route, info) for info in infos):
        return None
    if not models[model]["ready"] or short_of_workers:
        return no_worker_ready(f"no worker for '{model}' that can run this is ready")
    param, code, message = explain_unfit(model, body.route, infos)
    return P.WireError(status=400, code=code, message=message, param=param)


def no_worker_ready(message: str) -> P.WireError:
    return P.WireError(status=503, code="no_worker_ready", message=message,
                       retry_after=config.RETRY_AFTER_SECONDS)


def key_queue_full(per_key: int, max_queue: int, lane: tuple) -> P.WireError:
    return P.WireError(status=429, code="key_queue_full", retry_after=1, message=(
        f"this API key already has {per_key} requests waiting for '{lane[0]}' (its "
        f"share of the queue of {max_queue})"))


def queue_full(max_queue: int, lane: tuple) -> P.WireError:
    profile = f" (profile '{lane[1]}')" if lane[1] else ""
    return P.WireError(status=429, code="queue_full", retry_after=1, message=(
        f"{max_queue} requests are already waiting for '{lane[0]}'{profile}"))


def superseded(by_newer_first: bool) -> P.WireError:
    """409: the session's client sent a newer request (before this one arrived, or while
    this one waited or ran)."""
    return P.WireError(status=409, code="superseded", message=(
        "superseded: the session sent a newer request first" if by_newer_first else
        "superseded by a newer request of the same session"))


def shutting_down(running: bool = False) -> P.WireError:
    """The server is stopping: a new request is refused; one still queued or running
    when --stop-grace ends is ended (`running`: it had started)."""
    message = "the server stopped before this request finished (--stop-grace)" \
        if running else "the server is shutting down"
    return P.WireError(status=503, code="shutting_down", message=message,
                       retry_after=config.RETRY_AFTER_SECONDS)


def queue_timeout(waited: float) -> P.WireError:
    return P.WireError(status=504, code="queue_timeout", message=(
        f"waited {waited:.1f}s in the queue, past the request's deadline"))


def no_worker_became_ready(model: str, waited: float, paused: bool = False) -> P.WireError:
    if paused:
        return no_worker_ready(f"every worker for '{model}' that can run this was drained "
                               f"(python -m dispatcher resume NAME) for {waited:.0f}s")
    return no_worker_ready(f"no worker for '{model}' became ready in {waited:.0f}s")


def tokenizer_busy(by_key: bool = False) -> P.WireError:
    if by_key:
        return P.WireError(status=429, code="tokenizer_busy", retry_after=1, message=(
            f"this API key already has {config.MAX_OPS_PER_WORKER // 2} tokenize/detokenize "
            "requests running on every worker"))
    return P.WireError(status=429, code="tokenizer_busy", retry_after=1, message=(
        f"every worker already has {config.MAX_OPS_PER_WORKER} tokenize/detokenize "
        "requests running"))


def frontend_silent(running: bool = False) -> P.WireError:
    """A queued (or `running`) request of a front end the dispatcher took for gone (it
    missed its heartbeats): told, in case it is alive, rather than left waiting for ever
    (or, running, ended without a word: a 502 `stream_incomplete` later, or nothing)."""
    what = "stopped its running requests" if running else "dropped its queued requests"
    return P.WireError(status=503, code="frontend_silent", retry_after=1, message=(
        f"this front end missed its heartbeats to the dispatcher, which {what}; send the "
        "request again"))


def dispatcher_fault() -> P.WireError:
    """Handling the job raised in the dispatcher (a bug one message or job meets)."""
    return P.WireError(status=500, code="dispatcher_fault",
                       message="the dispatcher failed on this job (its log says how)")


def no_worker_took() -> P.WireError:
    return P.WireError(status=503, code="no_worker_ready",
                       message="no worker could take the request")


def worker_lost(code: str | None, reason: str) -> P.WireError:
    """What a request gets when its worker is lost: `code` worker_stuck (the watchdog
    replaced it) or worker_lost (anything else)."""
    code = code if code in ("worker_lost", "worker_stuck") else "worker_lost"
    return P.WireError(status=503, code=code,
                       message=f"the worker serving this request was lost ({reason})")
