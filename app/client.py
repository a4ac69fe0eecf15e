"""The front end's connection to the dispatcher: one per gunicorn worker process.

One DEALER (jobs, cancels, heartbeats) and one SUB (token events, subscribed once to this
front end's id), each read by its own greenlet, which routes every message to the
`RequestStream` of its request. The dispatcher counts as there while it answers pings over
both (its state, and a beat over the token stream: see dispatcher.common.protocol). Created
lazily in the process that uses it: a ZeroMQ context made before gunicorn forks is dead
in the child.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Union

import gevent
import gevent.event
import gevent.lock
import gevent.queue
import zmq.green as zmq

from app.errors import ServiceUnavailable, from_wire
from dispatcher.common.addresses import Endpoints
from dispatcher.common import config, protocol as P
from dispatcher.common.curve import PartKeys
from dispatcher.common.latency import LatencyRecorder

log = logging.getLogger(__name__)
# Seconds between pings while the dispatcher has not answered, for at most this many
# pings in a row; then one per heartbeat interval (see _heartbeat).
UNANSWERED_PING_INTERVAL = 0.1
UNANSWERED_FAST_PINGS = 30
# CANCELs the DEALER could not take (its queue full, or no connection) wait here and are
# sent again, first after this many seconds, then twice as long each time up to the
# heartbeat interval; at most this many wait (the oldest give way).
CANCEL_RETRY_FIRST = 0.02
MAX_UNSENT_CANCELS = 10_000
# A request this front end no longer has open whose events still come this many seconds
# after its first such event is cancelled again, at most once per that many seconds:
# a CANCEL the DEALER took while its connection was dropping (a front end on another
# host; IMMEDIATE discards what waits for a connection) was lost, and the job ran to its
# max_tokens for nobody. At most ORPHANS_KEPT such requests are remembered.
ORPHAN_CANCEL_AFTER = 1.0
ORPHANS_KEPT = 1024
# Seconds a front end's last counts may take to reach the dispatcher as it exits.
FINAL_COUNTS_LINGER = 0.5
# Seconds a request waits, once its grace after FINISHED has run out, for the events its
# SUB reader takes from the socket when woken (a process held past the grace).
READER_WAKE_WAIT = 0.05
# Seconds an accepted request may hear nothing before the heartbeat asks the dispatcher
# whether it still holds it (Ping.quiet; a long prefill, a queue's wait: it does)
QUIET_AFTER = 10.0


def wake_readers(sock) -> int:
    """A zmq.green socket's events, read the way that wakes its waiting readers."""
    return sock.get(zmq.EVENTS)


class ClientGone(Exception):
    """The HTTP client closed its connection."""


# What a RequestStream's inbox carries, put by the socket readers and the HTTP handler
@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A token-stream event of the request (the SUB socket), and its size on the wire."""
    event: P.AnyEvent
    size: int = 0


@dataclass(frozen=True, slots=True)
class Control:
    """A message of the dispatcher about the request (the DEALER): ACCEPTED, REJECTED,
    FAILED, DONE, METRICS, with its decoded body."""
    cmd: bytes
    body: Any


@dataclass(frozen=True, slots=True)
class Left:
    """The HTTP client closed its connection."""


@dataclass(frozen=True, slots=True)
class Lost:
    """The dispatcher stopped answering (or restarted)."""


@dataclass(frozen=True, slots=True)
class Unheld:
    """The dispatcher holds the request no more (State.unheld): its end was lost."""


StreamItem = Union[TokenEvent, Control, Left, Lost, Unheld]


def error_event(status: int, message: str, code: str) -> P.Error:
    return P.WireError(status=status, code=code, message=message).event()


class RequestStream:
    """The events of one request, checked for order and completeness.

    Yields `start`, `text`..., then exactly one `end` or `error` event. Events of an older
    attempt are dropped; a gap in the sequence numbers, or messages missing once the
    dispatcher says the worker finished, become an error event instead of silently
    missing text.
    """

    def __init__(self, client: "DispatcherClient", request_id: str):
        self.client = client
        self.request_id = request_id
        self.inbox: gevent.queue.Queue = gevent.queue.Queue()
        self.attempt = 1
        self.next_seq = 0
        self.text_seen = False
        self.finished = False
        self._still_running = False     # ended here while its worker runs on (_end)
        self._complete_by: float | None = None
        self._finished_attempt: int | None = None   # the attempt a FINISHED was for
        self._woken = False             # the reader woken since the last progress
        self._early: list[StreamItem] = []
        self.last_size = 0              # wire bytes of the event next_event last returned
        self.accepted = False           # the dispatcher said ACCEPTED
        self.heard_at = time.monotonic()    # when a message of it last came (QUIET_AFTER)
        self.asked_at = 0.0             # when a ping last asked after it (Ping.quiet)
        self._unheld = False            # the dispatcher said it holds it no more

    def put(self, item: StreamItem) -> None:
        """A message of the request, from a socket's reader."""
        self.heard_at = time.monotonic()
        self.inbox.put(item)

    def wait_accepted(self, timeout: float = config.SUBMIT_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except gevent.queue.Empty:
                raise ServiceUnavailable("the dispatcher did not answer in time")
            match item:
                case Control(P.ACCEPTED):
                    self.accepted = True
                    return
                case Control(P.REJECTED | P.FAILED, body):
                    raise from_wire(body)
                case Lost():
                    raise ServiceUnavailable("the dispatcher is unreachable")
                case Left():
                    raise ClientGone()
            # token events can overtake ACCEPTED (they travel another path): keep them
            self._early.append(item)

    def next_event(self) -> P.AnyEvent:
        self.last_size = 0
        while True:
            timeout = None
            if self._complete_by is not None:
                timeout = max(0.0, self._complete_by - time.monotonic())
            try:
                item = self._early.pop(0) if self._early else self.inbox.get(timeout=timeout)
            except gevent.queue.Empty:
                if not self._woken:
                    # the process was held (a long write, a parse): the events may be
                    # in the socket behind the timer that fired first; the reader takes
                    # whatever waits there before the stream counts them lost
                    self._woken = True
                    self.client.wake_reader()
                    self._complete_by = time.monotonic() + READER_WAKE_WAIT
                    continue
                return self._end(error_event(
                    502, "the token stream lost messages: the dispatcher holds this "
                    "request no more, and its end never arrived" if self._unheld else
                    "the token stream lost messages: the worker finished but not all "
                    "of its output arrived", "stream_incomplete"))
            match item:
                case TokenEvent(event, size):
                    accepted = self._accept_event(event)
                    self.last_size = size
                case Control(cmd, body):
                    accepted = self._accept_control(cmd, body)
                case Lost():
                    # (running: a dispatcher that restarted may run the job on for
                    # nobody; a CANCEL to one that is gone is dropped)
                    return self._end(error_event(503, "lost the connection to the "
                                                 "dispatcher", "dispatcher_unavailable"),
                                     running=True)
                case Left():
                    raise ClientGone()
                case Unheld():
                    # over at the dispatcher: what is on its way gets the grace a FINISHED
                    # gives (a FAILED resent there may come behind this word, and ends it)
                    self._unheld = True
                    if self._complete_by is None:
                        self._complete_by = time.monotonic() + config.DONE_GRACE
                    continue
            if accepted is not None:
                return accepted

    def _accept_event(self, event: P.AnyEvent) -> P.AnyEvent | None:
        attempt = event.attempt
        if attempt < self.attempt:
            return None
        if attempt > self.attempt:
            if self.text_seen:
                return self._end(error_event(
                    503, "the worker serving this request was lost after output had started",
                    "worker_lost"), running=True)
            self.attempt, self.next_seq = attempt, 0
            if self._finished_attempt != attempt:   # (a FINISHED of this attempt that
                self._complete_by = None            # came first keeps its deadline)
        if event.seq != self.next_seq:
            return self._end(error_event(
                502, f"the token stream skipped messages {self.next_seq}..{event.seq - 1}",
                "stream_gap"), running=True)
        self.next_seq += 1
        if self._complete_by is not None:   # the grace counts from the last progress:
            # events drain behind the word of the end under a deep backlog
            self._complete_by = time.monotonic() + config.DONE_GRACE
            self._woken = False
        if isinstance(event, P.Text):
            self.text_seen = True
        if isinstance(event, P.ENDS):
            return self._end(event)
        return event

    def _accept_control(self, cmd: bytes, body) -> P.AnyEvent | None:
        if cmd in (P.FAILED, P.REJECTED):
            return self._end(body.event())
        if cmd == P.FINISHED and body.attempt >= self.attempt:
            # The worker is done; whatever has not arrived shortly is lost.
            self._complete_by = time.monotonic() + config.DONE_GRACE
            self._finished_attempt = body.attempt
        return None

    def _end(self, event: P.AnyEvent, running: bool = False) -> P.AnyEvent:
        """The request's last event; `running`: one this front end concluded while a
        worker still runs the job (a gap in its stream, a retry after text was sent),
        which closing then cancels."""
        self.finished = True
        self._still_running = running
        return event

    def close(self) -> None:
        """Forget the request; cancel it if it has not finished, or if it ended here
        while its worker runs on (idempotent)."""
        self.client.forget(self.request_id)
        if not self.finished or self._still_running:
            self.finished, self._still_running = True, False
            self.client.cancel(self.request_id)


class DispatcherClient:
    """This process's DEALER and SUB sockets and the requests waiting on them."""

    def __init__(self, endpoints: Endpoints, heartbeat: config.Heartbeat = config.Heartbeat(),
                 keys: PartKeys | None = None):
        self.pid = os.getpid()
        self.heartbeat = heartbeat
        self.id = P.new_frontend_id()
        self.context = zmq.Context()
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, self.id)
        self.dealer.setsockopt(zmq.IMMEDIATE, 1)     # never queue for a missing dispatcher
        self.dealer.setsockopt(zmq.LINGER, 0)
        if keys is not None:                         # CURVE: this front end's key
            keys.apply(self.dealer)
        self.dealer.connect(endpoints.frontend)
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, config.TOKEN_HWM)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.id)
        if keys is not None:
            keys.apply(self.sub)
        self.sub.connect(endpoints.tokens_out)
        self.streams: dict[str, RequestStream] = {}
        self.state = P.State()
        self.state_at = 0.0
        self.beat_at = 0.0
        self.epoch = None           # the dispatcher's run, from its state
        self.state_event = gevent.event.Event()
        self._send_lock = gevent.lock.Semaphore()
        self._unsent_cancels: dict[str, None] = {}  # (ordered: the oldest first)
        # requests closed here whose events still come: when the first came, or when
        # one was last cancelled again (_orphan_event; ordered: the oldest first)
        self._orphans: dict[str, float] = {}
        self._cancel_retry: gevent.Greenlet | None = None
        self._alive = False
        self.recorder = LatencyRecorder()      # increments for the dispatcher's metrics
        self.served = 0
        self._greenlets = [gevent.spawn(self._read_dealer), gevent.spawn(self._read_sub),
                           gevent.spawn(self._heartbeat)]

    # -- sending -----------------------------------------------------------------------
    def send(self, cmd: bytes, request_id: str = "", body=None) -> bool:
        with self._send_lock:
            try:
                self.dealer.send_multipart(P.encode(cmd, request_id, body), zmq.NOBLOCK)
                return True
            except zmq.Again:
                return False

    def cancel(self, request_id: str) -> None:
        """Cancel a job at the dispatcher. One the DEALER cannot take now is kept and
        sent again: a job left running for a client that is gone holds a worker's slot
        until its max_tokens (a CANCEL for a job the dispatcher no longer knows is
        dropped there)."""
        if self.send(P.CANCEL, request_id):
            return
        self._unsent_cancels[request_id] = None
        while len(self._unsent_cancels) > MAX_UNSENT_CANCELS:
            del self._unsent_cancels[next(iter(self._unsent_cancels))]
        if self._cancel_retry is None:
            self._cancel_retry = gevent.spawn(self._send_unsent_cancels)
            self._greenlets.append(self._cancel_retry)

    def _send_unsent_cancels(self) -> None:
        delay = CANCEL_RETRY_FIRST
        try:
            while self._unsent_cancels:
                gevent.sleep(delay)
                for request_id in list(self._unsent_cancels):
                    if not self.send(P.CANCEL, request_id):
                        break
                    self._unsent_cancels.pop(request_id, None)
                delay = min(delay * 2, self.heartbeat.interval)
        finally:
            self._greenlets.remove(self._cancel_retry)
            self._cancel_retry = None

    def wake_reader(self) -> None:
        """Have the SUB's reader take what waits in the socket: zmq.green's `get` of
        EVENTS wakes it (`getsockopt`, pyzmq's plain one, reads the same flag and leaves
        the reader asleep until pyzmq's fallback timeout, ~11 s, every stream of the
        process with it)."""
        try:
            wake_readers(self.sub)
        except zmq.ZMQError:
            pass

    def submit(self, job: P.WorkerJob) -> RequestStream:
        if not self._alive:
            # (lost since the caller saw its state: a stream registered now would wait
            # for a loss already said, for as long as its client stayed)
            raise ServiceUnavailable("the dispatcher is unreachable")
        stream = RequestStream(self, job.id)
        self.streams[job.id] = stream
        if not self.send(P.SUBMIT, job.id, job):
            self.forget(job.id)
            raise ServiceUnavailable("the dispatcher is unreachable")
        try:
            stream.wait_accepted()
        except BaseException:       # (an error, the client gone, the greenlet killed)
            stream.finished = True
            self.forget(job.id)
            self.cancel(job.id)
            raise
        return stream

    def forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def client_gone(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.inbox.put(Left())

    # -- state -------------------------------------------------------------------------
    @property
    def dispatcher_alive(self) -> bool:
        """Both paths answered lately: a state over the DEALER, a beat over the SUB."""
        now = time.monotonic()
        return (now - self.state_at < self.heartbeat.expiry
                and now - self.beat_at < self.heartbeat.expiry)

    def _answered(self) -> None:
        if self.dispatcher_alive:
            self._alive = True
            self.state_event.set()

    def wait_state(self, timeout: float = 2.0) -> P.State | None:
        """The dispatcher's last state, waiting briefly for the first one after start-up."""
        if not self.state_event.is_set():
            self.state_event.wait(timeout)
        return self.state if self.dispatcher_alive else None

    # -- greenlets ---------------------------------------------------------------------
    def _read_dealer(self) -> None:
        while True:
            try:
                msg = P.decode(self.dealer.recv_multipart())
            except P.ProtocolError as exc:
                log.warning("bad message from the dispatcher: %s", exc)
                continue
            except zmq.ContextTerminated:
                return
            if msg.cmd == P.STATE:
                epoch = msg.body.epoch
                if epoch != self.epoch:
                    # another run of the dispatcher (restarted sooner than the heartbeat
                    # expiry, say): it knows nothing of our requests, and our token
                    # stream is proven only by a beat of its own
                    if self._alive:
                        self._lose("the dispatcher restarted")
                    self.epoch, self.beat_at = epoch, 0.0
                self.state, self.state_at = msg.body, time.monotonic()
                self._answered()
                for request_id in msg.body.unheld:
                    stream = self.streams.get(request_id)
                    if stream is not None:
                        stream.inbox.put(Unheld())
                continue
            stream = self.streams.get(msg.request_id)
            if stream is not None:
                stream.put(Control(msg.cmd, msg.body))

    def _read_sub(self) -> None:
        while True:
            try:
                frames = self.sub.recv_multipart()
                request_id, event = P.decode_event(frames)
            except P.ProtocolError as exc:
                log.warning("bad token event: %s", exc)
                continue
            except zmq.ContextTerminated:
                return
            if not request_id and isinstance(event, P.Beat):
                if event.epoch == self.epoch:
                    self.beat_at = time.monotonic()
                    self._answered()
                continue
            if self._alive:
                # come through the proxy like a beat, and maybe queued before it: an
                # established stream busy with events stays alive
                self.beat_at = time.monotonic()
            stream = self.streams.get(request_id)
            if stream is not None:
                stream.put(TokenEvent(event, len(frames[2])))
            elif request_id and not isinstance(event, P.ENDS):
                self._orphan_event(request_id)

    def _orphan_event(self, request_id: str) -> None:
        """An event of a request no longer open here (ORPHAN_CANCEL_AFTER): the first
        ones are those in flight when it was closed; events still coming a second later
        mean its CANCEL was lost, and it is sent again."""
        now = time.monotonic()
        since = self._orphans.pop(request_id, None)
        if since is None:
            since = now
        elif now - since >= ORPHAN_CANCEL_AFTER:
            log.info("events still come for %s, closed here: cancelling it again",
                     request_id)
            self.cancel(request_id)
            since = now
        self._orphans[request_id] = since
        while len(self._orphans) > ORPHANS_KEPT:
            del self._orphans[next(iter(self._orphans))]

    def metrics_snapshot(self, timeout: float = 3.0) -> dict | None:
        """The system's metrics, as the dispatcher adds them up; None if it is away."""
        request_id = P.new_request_id()
        stream = RequestStream(self, request_id)
        self.streams[request_id] = stream
        try:
            if not self.send(P.METRICS, request_id):
                return None
            deadline = time.monotonic() + timeout
            while True:
                item = stream.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                if isinstance(item, Control) and item.cmd == P.METRICS:
                    return item.body
        except gevent.queue.Empty:
            return None
        finally:
            self.forget(request_id)

    def _heartbeat(self) -> None:
        fast = UNANSWERED_FAST_PINGS
        while True:
            delta = self.recorder.take()
            body = self._ping(delta)
            if not self.send(P.PING, body=body) and delta:
                self.recorder.restore(delta)          # the dispatcher is away: keep them
            # Until the dispatcher answers, ask again soon: the DEALER (IMMEDIATE) drops
            # what it cannot send before its connection is up, at start-up and after the
            # dispatcher restarts, and the state would come a whole interval late (so
            # would the beat, whose subscription may come through after the state). Not
            # for long: over a connection that is up but silent (a network partition) the
            # pings queue, and all of them would be answered when it heals.
            answered = self.dispatcher_alive
            fast = UNANSWERED_FAST_PINGS if answered else fast - 1
            gevent.sleep(UNANSWERED_PING_INTERVAL if not answered and fast > 0
                         else self.heartbeat.interval)
            if self._alive and not self.dispatcher_alive:
                self._lose("lost the dispatcher")

    def _ping(self, metrics: dict | None) -> P.Ping:
        return P.Ping(open=len(self.streams), pid=self.pid, served=self.served,
                      metrics=metrics, quiet=self._quiet())

    def _quiet(self) -> list[str]:
        """The accepted requests open here that have heard nothing for QUIET_AFTER s, at
        most MAX_QUIET, those asked after least lately first (a front end with hundreds
        of requests queued for long, and held, asks after each in turn)."""
        now = time.monotonic()
        quiet = [s for s in self.streams.values()
                 if s.accepted and not s.finished and s.heard_at <= now - QUIET_AFTER]
        quiet.sort(key=lambda s: (s.asked_at, s.heard_at))
        for stream in quiet[:P.MAX_QUIET]:
            stream.asked_at = now
        return [s.request_id for s in quiet[:P.MAX_QUIET]]

    def _lose(self, why: str) -> None:
        self._alive = False
        log.error("%s: failing %d open requests", why, len(self.streams))
        for stream in list(self.streams.values()):
            stream.inbox.put(Lost())

    def close(self, send_counts: bool = False) -> None:
        """Close the sockets; `send_counts`: first send the counts since the last
        heartbeat, given up to FINAL_COUNTS_LINGER seconds to go out."""
        gevent.killall(list(self._greenlets))
        linger = 0
        delta = self.recorder.take() if send_counts else None
        if delta and self.send(P.PING, body=self._ping(delta)):
            linger = int(FINAL_COUNTS_LINGER * 1000)
        self.dealer.close(linger)
        self.sub.close(0)
        self.context.term()


def get_client(app) -> DispatcherClient:
    """This process's client, made on first use (after gunicorn has forked)."""
    client = app.extensions.get("dispatcher_client")
    if client is None or client.pid != os.getpid():
        keys = app.config.get("CURVE_KEYS")
        client = DispatcherClient(Endpoints.from_base(app.config["DISPATCHER"]),
                                  config.Heartbeat(app.config["HEARTBEAT_INTERVAL"]),
                                  PartKeys.load(keys, app.config.get("CURVE_NAME") or "local")
                                  if keys else None)
        app.extensions["dispatcher_client"] = client
    return client
