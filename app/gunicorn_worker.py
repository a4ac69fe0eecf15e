"""The front ends' gunicorn worker: gunicorn's gevent worker, made to stop promptly.

gunicorn's own gevent worker looks at its stop flag once a second, then waits for every
open connection to close, idle keep-alive ones included, checking again once a second.
nginx's upstream keep-alive pool (deploy/nginx.conf) and editors' HTTP clients hold such
connections open for minutes, so a restart could take the whole `graceful_timeout`.
This one notices a stop within `POLL` seconds and closes the connections that are
between requests at once; a request in flight still gets `graceful_timeout` to finish,
and its connection is closed after its response.
"""
from __future__ import annotations

import _socket
import os
import socket
import time
from functools import partial

import gevent
from gevent.pool import Pool
from gevent.server import StreamServer
from gunicorn.sock import ssl_context
from gunicorn.workers.ggevent import GeventWorker

POLL = 0.05             # seconds between looks at the stop flag and the open requests
NOTIFY_EVERY = 1.0      # seconds between "still alive" notes to the gunicorn master


class FrontendWorker(GeventWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._idle: set[socket.socket] = set()     # connections between requests

    def handle(self, listener, client, addr):
        self._idle.add(client)                     # nothing asked yet
        try:
            super().handle(listener, client, addr)
        finally:
            self._idle.discard(client)

    def handle_request(self, listener_name, req, sock, addr):
        self._idle.discard(sock)
        try:
            return super().handle_request(listener_name, req, sock, addr)
        finally:
            self._idle.add(sock)                   # waiting for its next request

    def _close_idle(self) -> None:
        """End every connection that is between requests: its reader sees end of file."""
        for sock in list(self._idle):
            # through a duplicate: gevent's own shutdown() fails the waiting reader with
            # EBADF, which gunicorn logs as an error; a plain one lets it read end of file
            try:
                dup = _socket.socket(fileno=os.dup(sock.fileno()))
            except OSError:
                continue                                   # closed meanwhile
            try:
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                dup.close()

    def run(self):
        ssl_args = {"ssl_context": ssl_context(self.cfg)} if self.cfg.is_ssl else {}
        servers = []
        for listener in self.sockets:
            listener.setblocking(1)
            server = StreamServer(listener, handle=partial(self.handle, listener),
                                  spawn=Pool(self.worker_connections), **ssl_args)
            if self.cfg.workers > 1:
                server.max_accept = 1                  # leave connections to the others
            server.start()
            servers.append(server)
        noted = 0.0
        while self.alive:
            if time.monotonic() - noted >= NOTIFY_EVERY:
                self.notify()
                noted = time.monotonic()
            gevent.sleep(POLL)
        for server in servers:
            server.close()                             # no new connections
        deadline = time.monotonic() + self.cfg.graceful_timeout
        while any(s.pool.free_count() != s.pool.size for s in servers):
            if time.monotonic() >= deadline:
                self.log.warning("requests still running after graceful_timeout "
                                 "(%ss): ending them", self.cfg.graceful_timeout)
                for server in servers:
                    server.stop(timeout=1)
                return
            self._close_idle()
            if time.monotonic() - noted >= NOTIFY_EVERY:
                self.notify()
                noted = time.monotonic()
            gevent.sleep(POLL)
