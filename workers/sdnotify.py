"""systemd's notify protocol for a worker its own unit started (`Type=notify`,
`WatchdogSec=`, deploy/systemd/completions-worker@.service): READY=1 once it serves,
WATCHDOG=1 while its IO thread runs, STOPPING=1 when it stops. Without it a worker
frozen whole (SIGSTOP, a call holding the GIL) was dropped by the dispatcher for its
missed heartbeats and then held its GPU for ever, systemd seeing it running: under
`serve` the launcher kills a silent worker, under systemd nobody did.

One datagram to $NOTIFY_SOCKET (a path, or `@name` in the abstract namespace), as
sd_notify(3) sends it. Nothing is sent where systemd did not start this very process:
no $NOTIFY_SOCKET, a $WATCHDOG_PID that is another process's, or a worker `serve`
started (COMPLETIONS_PARENT_PID: its launcher watches it, and a `serve` run under
systemd passes its own $NOTIFY_SOCKET on to its children).
"""
from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)

PING_EVERY = 1.0        # s between WATCHDOG=1 datagrams (the unit allows 30 s without)


class SystemdNotify:
    def __init__(self, environ=os.environ) -> None:
        path = environ.get("NOTIFY_SOCKET") or ""
        watched = environ.get("WATCHDOG_PID")
        self.address: str | None = None
        if path and not environ.get("COMPLETIONS_PARENT_PID") and \
                (not watched or watched == str(os.getpid())):
            self.address = "\0" + path[1:] if path.startswith("@") else path
        self.sock: socket.socket | None = None
        self.last_ping = 0.0
        self.failed = False

    @property
    def active(self) -> bool:
        return self.address is not None

    def send(self, message: bytes) -> None:
        if self.address is None:
            return
        try:
            if self.sock is None:
                self.sock = socket.socket(socket.AF_UNIX,
                                          socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self.sock.sendto(message, self.address)
        except OSError as exc:
            if not self.failed:          # (said once: systemd gone, or not listening)
                self.failed = True
                log.warning("could not tell systemd %s: %s", message.decode(), exc)

    def ping(self, now: float | None = None) -> None:
        """WATCHDOG=1, at most once every PING_EVERY s."""
        now = time.monotonic() if now is None else now
        if self.address is not None and now - self.last_ping >= PING_EVERY:
            self.last_ping = now
            self.send(b"WATCHDOG=1")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
