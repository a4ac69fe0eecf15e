"""How long a write of an answer may take (--send-timeout): a client that stopped
reading is let go, one reading slowly but steadily is not."""
from __future__ import annotations

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


def allow_write(size: int) -> None:
    """The next write of `size` bytes may take --send-timeout s and a second for each
    SEND_RATE_FLOOR bytes of it (a stream's large event: an echoed prompt's
    probabilities go out in one)."""
    sock = request.environ.get("gunicorn.socket")
    seconds = float(current_app.config.get("SEND_TIMEOUT") or 0)
    if sock is not None and seconds:
        sock.settimeout(seconds + size / SEND_RATE_FLOOR)
