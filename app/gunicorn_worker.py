"""The front ends' gunicorn worker: gunicorn's gevent worker, made to stop promptly.

gunicorn's own gevent worker looks at its stop flag once a second, then waits for every
open connection to close, idle keep-alive ones included, checking again once a second.
nginx's upstream keep-alive pool (deploy/nginx.conf) and editors' HTTP clients hold such
connections open for minutes, so a restart could take the whole `graceful_timeout`.

This one notices a stop within `POLL` seconds. A request in flight still gets
`graceful_timeout` to finish, and its connection is closed after its response. A
connection between requests with nothing sent is closed at once (its next request, if
one is on its way, meets a closed connection: the usual keep-alive race, which nginx
retries); one with bytes waiting is served; one that has not sent its first request gets
`FRESH_GRACE` seconds from the stop to send it.
"""
from __future__ import annotations

import _socket
import json
import os
import socket
import time
from functools import partial

import gevent
import gevent.socket
from gevent.pool import Pool
from gevent.server import StreamServer
from gunicorn import util as gunicorn_util
from gunicorn.sock import ssl_context
from gunicorn.workers.ggevent import GeventWorker

POLL = 0.05             # seconds between looks at the stop flag and the open requests
NOTIFY_EVERY = 1.0      # seconds between "still alive" notes to the gunicorn master
# A connection that has not sent its first request yet is left this long after a stop
# (or after it was made, if later): a client connects in order to send one.
FRESH_GRACE = 1.0


# A new connection beyond worker_connections (--max-connections) first takes the place of
# the quiet connection that has waited longest: one between requests, or one that has
# sent nothing for EVICT_AFTER seconds (it is closed: idle editors and proxies reconnect,
# as after any keep-alive timeout). So silent or idle connections never lock a fresh
# client out; only connections whose requests are running fill the front end.
EVICT_AFTER = 0.5
# Connections beyond worker_connections with no quiet one to replace are still accepted, to
# answer /health and /metrics: a load balancer must see a full front end as alive.
RESERVE = 64
RESERVE_PATHS = ("/health", "/v1/health", "/metrics")
RESERVE_HEAD_TIMEOUT = 2.0
FULL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")
FULL_BODY = (b'{"error": {"message": "this front end has as many connections open as it '
             b'serves", "type": "server_error", "param": null, "code": "too_many_connections"}}')


# What gunicorn answers itself, before the application sees a request it cannot parse (a
# malformed request line, a header too large, Content-Length beside Transfer-Encoding):
# an HTML page, which OpenAI clients cannot read. Here the same status in OpenAI's
# envelope; 501 for a transfer coding gunicorn does not take is a 400 (the request is
# what is wrong). gunicorn calls `util.write_error` for nothing else.
PARSE_ERROR_CODES = {400: "bad_request", 403: "forbidden", 414: "uri_too_long",
                     417: "expectation_failed", 431: "headers_too_large"}


def write_parse_error(sock, status: int, reason: str, message: str) -> None:
    if status == 501:
        status, reason = 400, "Bad Request"
    client = 400 <= status < 500
    body = json.dumps({"error": {
        "message": f"the request could not be parsed: {message}" if message else reason,
        "type": "invalid_request_error" if client else "server_error", "param": None,
        "code": PARSE_ERROR_CODES.get(status, "bad_request" if client else
                                      "internal_error")}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    gunicorn_util.write_nonblock(sock, head.encode("latin-1") + body)


gunicorn_util.write_error = write_parse_error


class FrontendWorker(GeventWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._idle: dict[socket.socket, float] = {}      # served, awaiting the next: since
        self._fresh: dict[socket.socket, float] = {}     # no request yet: since when
        self._leaving: set[socket.socket] = set()        # closed to make room, not yet gone
        self._stopped_at = float("inf")
        self._noted = 0.0                                 # last "still alive" note
        self._open = 0                                    # connections being handled
        from dispatcher.common.configfile import effective
        self._head_timeout = effective(["header_timeout"])["header_timeout"]

    def timeout_ctx(self):
        """How long the next request's line and headers may take to arrive: a new
        connection gets --header-timeout (a client connects in order to send one, and
        a slow-loris one is let go), one that has been served the keep-alive time; one
        in the reserve, a moment."""
        greenlet = gevent.getcurrent()
        if getattr(greenlet, "completions_reserve", False):
            seconds = RESERVE_HEAD_TIMEOUT
        elif getattr(greenlet, "completions_served", False):
            seconds = self.cfg.keepalive
        else:
            seconds = self._head_timeout or self.cfg.keepalive
        return gevent.Timeout(seconds, False)

    def _note_alive(self) -> None:
        """Tell the gunicorn master this worker is alive, once per NOTIFY_EVERY."""
        if time.monotonic() - self._noted >= NOTIFY_EVERY:
            self.notify()
            self._noted = time.monotonic()

    def handle(self, listener, client, addr):
        # a session's order of requests is their arrival (app.requests.session_order):
        # the first request of a connection arrives with its first bytes (reading its
        # head may lag behind on a busy loop; a connection opened ahead of time and kept
        # silent, as a client's pool does, arrives when it sends, not when it was made)
        self._fresh[client] = time.monotonic()
        self._open += 1
        reserve = gevent.getcurrent().completions_reserve = \
            self._open - len(self._leaving) > self.worker_connections and not self._make_room()
        try:
            try:
                gevent.socket.wait_read(client.fileno(), timeout=RESERVE_HEAD_TIMEOUT
                                        if reserve else self._head_timeout or None)
            except TimeoutError:                   # nothing sent: let go (--header-timeout)
                client.close()
                return
            except OSError:
                pass                               # (the parser meets it too)
            gevent.getcurrent().completions_accepted_ns = time.time_ns()
            super().handle(listener, client, addr)
        finally:
            self._open -= 1
            self._fresh.pop(client, None)
            self._idle.pop(client, None)
            self._leaving.discard(client)

    def _make_room(self) -> bool:
        """Close the quiet connection that has waited longest, for a new one (True), or
        find none: every connection is running a request or has only just been made."""
        now = time.monotonic()
        quiet = sorted([(since, id(s), s) for s, since in self._idle.items()] +
                       [(since, id(s), s) for s, since in self._fresh.items()
                        if now - since >= EVICT_AFTER])
        for _, _, sock in quiet:
            if self._end_if_quiet(sock):
                self._idle.pop(sock, None)
                self._fresh.pop(sock, None)
                self._leaving.add(sock)
                return True
        return False

    @staticmethod
    def _end_if_quiet(sock: socket.socket) -> bool:
        """Shut a connection down if it has nothing waiting to be read (True): its reader
        sees end of file. One with bytes waiting (a request arriving) is left alone."""
        try:
            # a plain duplicate: gevent's own socket would wait for data on a peek,
            # and its shutdown() fails the waiting reader with EBADF (logged as an error)
            dup = _socket.socket(fileno=os.dup(sock.fileno()))
        except OSError:
            return False                           # closed meanwhile (or out of fds)
        try:
            dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return False                           # a request is arriving (or EOF)
        except BlockingIOError:
            dup.shutdown(socket.SHUT_RDWR)         # nothing sent: end it
            return True
        except OSError:
            return False
        finally:
            dup.close()

    def handle_request(self, listener_name, req, sock, addr):
        self._fresh.pop(sock, None)
        self._idle.pop(sock, None)
        greenlet = gevent.getcurrent()
        # ... a later one on the same connection when its head has been read (this call)
        greenlet.completions_arrived_ns = time.time_ns() if getattr(
            greenlet, "completions_served", False) else greenlet.completions_accepted_ns
        greenlet.completions_served = True
        if greenlet.completions_reserve and req.path not in RESERVE_PATHS:
            sock.sendall(FULL % (len(FULL_BODY), FULL_BODY))
            raise StopIteration()                  # and close the connection
        try:
            return super().handle_request(listener_name, req, sock, addr)
        except TimeoutError:
            # a write of the answer waited --send-timeout for a client that stopped
            # reading (app.bound_the_writes), or a stream's rest outlasted the time its
            # end allowed (app.writes.drain_deadline): the request ended; close, in one line
            self.log.info("closed a connection from %s: its client read nothing of the "
                          "answer for --send-timeout, or not its rest in the time allowed",
                          addr[0] if isinstance(addr, tuple) else addr or "?")
            raise StopIteration() from None
        finally:
            self._idle[sock] = time.monotonic()    # waiting for its next request
            try:
                sock.settimeout(None)              # (app.bound_the_writes: its answer's)
            except OSError:
                pass

    def _close_idle(self) -> None:
        """End the connections that are between requests, nothing sent: their readers
        see end of file. One with bytes waiting is left to be served."""
        now = time.monotonic()
        for sock in list(self._idle) + [s for s, since in list(self._fresh.items())
                                        if now - max(since, self._stopped_at) >= FRESH_GRACE]:
            self._end_if_quiet(sock)

    def init_process(self):
        # every connection is a file descriptor: the soft limit (often 1024) up to the hard
        # one, so --max-connections can be held
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = self.worker_connections + RESERVE + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (
                want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
            if hard != resource.RLIM_INFINITY and hard < want:
                self.log.warning(
                    "open files are limited to %d (hard limit): fewer than the %d that "
                    "--max-connections %d needs; raise it (LimitNOFILE=, ulimit -Hn)",
                    hard, want, self.worker_connections)
        super().init_process()

    def run(self):
        ssl_args = {"ssl_context": ssl_context(self.cfg)} if self.cfg.is_ssl else {}
        servers = []
        for listener in self.sockets:
            listener.setblocking(1)
            server = StreamServer(listener, handle=partial(self.handle, listener),
                                  spawn=Pool(self.worker_connections + RESERVE), **ssl_args)
            if self.cfg.workers > 1:
                server.max_accept = 1                  # leave connections to the others
            server.start()
            servers.append(server)
        while self.alive:
            self._note_alive()
            gevent.sleep(POLL)
        try:
            self._finish(servers)
        except Exception:
            self.log.exception("error while stopping: ending open requests")
            for server in servers:
                server.stop(timeout=1)

    def _finish(self, servers: list) -> None:
        """No new connections; wait for requests in flight, closing idle connections."""
        self._stopped_at = time.monotonic()
        for server in servers:
            server.close()
        deadline = time.monotonic() + self.cfg.graceful_timeout
        while any(s.pool.free_count() != s.pool.size for s in servers):
            if time.monotonic() >= deadline:
                self.log.warning("requests still running after graceful_timeout "
                                 "(%ss): ending them", self.cfg.graceful_timeout)
                for server in servers:
                    server.stop(timeout=1)
                return
            self._close_idle()
            self._note_alive()
            gevent.sleep(POLL)
