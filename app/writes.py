"""How long a write of an answer may take (--send-timeout): a client that stopped
reading is let go, one reading slowly but steadily is not."""
from __future__ import annotations

import time

from flask import current_app, request


# A client reading at least this fast is never cut by --send-timeout: a whole answer goes
# out in one write (gevent's timeout bounds the write, not a stall within it)
SEND_RATE_FLOOR = 64 * 1024     # bytes a second


def bound_the_writes(response):
    """The answer goes out now (the body, if any, was read): a write that cannot finish
    within --send-timeout s (more for a large answer: SEND_RATE_FLOOR) ends the
    connection, and with it the request (a client that stopped reading held its
    greenlet, and a stream's jobs, for ever); FrontendWorker.handle_request clears it for
    the connection's next request. A stream's writes are its events, each small."""
    size = 0 if response.is_streamed else (response.content_length or 0)
    allow_write(size)
    return response


def allow_write(size: int, deadline: float | None = None,
                at_most: float | None = None) -> bool:
    """The next write of `size` bytes may take --send-timeout s and a second for each
    SEND_RATE_FLOOR bytes of it (a stream's large event: an echoed prompt's
    probabilities go out in one), `at_most` s where that is less, and must end by
    `deadline` (time.monotonic()'s) where one is given: False, and no write, once it
    has passed."""
    sock = request.environ.get("gunicorn.socket")
    seconds = _send_timeout()
    if sock is None or not seconds:
        return True
    allowed = seconds + size / SEND_RATE_FLOOR
    if at_most is not None:
        allowed = min(allowed, at_most)
    if deadline is not None:
        allowed = min(allowed, deadline - time.monotonic())
        if allowed <= 0:
            return False
    sock.settimeout(allowed)
    return True


def drain_deadline() -> float | None:
    """When a stream whose jobs have all ended must be written to its end, before what
    is left of it: in --send-timeout (time.monotonic()'s), which each chunk then moves
    on by a second per SEND_RATE_FLOOR bytes of it. So a client reading at that floor
    or faster is never cut, and one slower at most that long: each write alone was
    bounded, not their sum, and a client that took one small event a minute held the
    connection, and the up to 8 MiB waiting for it (app.fanout.MAX_BACKLOG_BYTES),
    for days. None without a --send-timeout."""
    seconds = _send_timeout()
    return time.monotonic() + seconds if seconds else None


def _send_timeout() -> float:
    return float(current_app.config.get("SEND_TIMEOUT") or 0)
