"""Noticing that an HTTP client closed its connection while its request is still queued
or generating, not only at the next failed write (the route cancels the request's jobs
then)."""
from __future__ import annotations

import select
import socket

import gevent
import gevent.monkey
import gevent.socket

HANGUP_POLL = 0.25
_poll = gevent.monkey.get_original("select", "poll")


def _hung_up(fd: int) -> bool:
    """Whether the peer has closed its side (or the connection failed), unread bytes or
    not: a poll that does not wait."""
    poller = _poll()
    poller.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def watch_disconnect(environ: dict, on_gone) -> gevent.Greenlet | None:
    """Call `on_gone()` as soon as the HTTP client closes its connection.

    Waits for the client socket to become readable and peeks: end of file means the client
    left. This notices a disconnect while the request is still queued or prefilling,
    not only at the next failed write. Bytes waiting after the request (a pipelined
    request, or one stray byte before a close) are left unread, and from then on the
    socket is polled for the peer's FIN (POLLRDHUP) every HANGUP_POLL seconds: a byte
    and a close must not leave a generation running for nobody.
    """
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return None

    def watch() -> None:
        try:
            gevent.socket.wait_read(sock.fileno())
            while sock.recv(1, socket.MSG_PEEK) != b"":
                if _hung_up(sock.fileno()):
                    break
                gevent.sleep(HANGUP_POLL)
        except (OSError, ValueError):
            pass
        on_gone()

    return gevent.spawn(watch)
