"""A front end's connection to the dispatcher (app.client.DispatcherClient): when it counts
the dispatcher as there. Against a scripted dispatcher (a ROUTER and an XPUB at the
dispatcher's addresses) and against the real broker."""
import os
import threading
import time

import gevent
import msgspec
import pytest
import zmq
import zmq.green as gzmq

import app.client as client_module
from dispatcher.common.addresses import Endpoints
from dispatcher.common import config, protocol as P
from dispatcher.broker import Broker

STATE = P.State(epoch="run-1", workers_ready=1)


class ScriptedDispatcher:
    """Answers every PING with `state` and, while `beats` is set, a beat of `beat_epoch`
    on its XPUB."""

    def __init__(self, endpoints: Endpoints):
        self.endpoints = endpoints
        self.context = gzmq.Context()
        self.router = self.context.socket(gzmq.ROUTER)
        self.xpub = self.context.socket(gzmq.XPUB)
        self.state = STATE
        self.beats = True
        self.beat_epoch = STATE.epoch
        self.pings = []
        self.received = []          # (command, request id) of every other message
        self.ping_bodies = []
        self._greenlet = None

    def start(self) -> "ScriptedDispatcher":
        self.router.bind(self.endpoints.frontend)
        self.xpub.bind(self.endpoints.tokens_out)
        self._greenlet = gevent.spawn(self._answer)
        return self

    def _answer(self) -> None:
        while True:
            frames = self.router.recv_multipart()
            msg = P.decode(frames[1:])
            if msg.cmd != P.PING:
                self.received.append((msg.cmd, msg.request_id))
                continue
            self.pings.append(time.monotonic())
            self.ping_bodies.append(msg.body)
            self.router.send_multipart([frames[0]] + P.encode(P.STATE, body=self.state))
            if self.beats:
                self.xpub.send_multipart(P.encode_event(
                    frames[0], "", P.Beat(epoch=self.beat_epoch)))

    def close(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill()
        self.router.close(0)
        self.xpub.close(0)
        self.context.term()


def open_request_when_ready(client) -> client_module.RequestStream:
    """Wait until the client counts the dispatcher as there; register an open request."""
    with gevent.Timeout(20):
        assert client.wait_state(timeout=20) == STATE
    stream = client_module.RequestStream(client, "cmpl-1")
    client.streams["cmpl-1"] = stream
    return stream


@pytest.fixture
def endpoints(tmp_path):
    return Endpoints.from_base(f"ipc://{tmp_path}")


def test_a_front_end_asks_again_soon_until_the_dispatcher_first_answers(monkeypatch,
                                                                        endpoints):
    """Its first ping is dropped while no dispatcher listens (the DEALER never queues for
    a missing peer); it must not wait a whole heartbeat interval to ask again."""
    monkeypatch.setattr(client_module, "UNANSWERED_FAST_PINGS", 10_000)   # a slow machine
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(60.0))
    dispatcher = ScriptedDispatcher(endpoints)
    try:
        gevent.sleep(0.3)                       # its first ping went nowhere
        dispatcher.start()
        with gevent.Timeout(20):                # not the 60 s interval
            assert client.wait_state(timeout=20) == STATE
        assert client.dispatcher_alive
    finally:
        client.close()
        dispatcher.close()


def test_a_front_end_is_not_ready_until_its_token_stream_is_through(monkeypatch,
                                                                      endpoints):
    """The state alone is not enough: until a beat comes over the token stream, workers'
    events for this front end could be dropped at the dispatcher (its subscription not
    there yet, as just after the dispatcher restarted), so it must answer 503s."""
    monkeypatch.setattr(client_module, "UNANSWERED_FAST_PINGS", 10_000)   # a slow machine
    dispatcher = ScriptedDispatcher(endpoints)
    dispatcher.beats = False
    dispatcher.start()
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(60.0))
    try:
        with gevent.Timeout(20):
            while client.state != STATE:                  # states come...
                gevent.sleep(0.05)
        assert client.wait_state(timeout=0.5) is None     # ...no beat: not there
        assert not client.dispatcher_alive
        dispatcher.beats = True
        with gevent.Timeout(20):                # it kept asking: the next beat is soon
            assert client.wait_state(timeout=20) == STATE
    finally:
        client.close()
        dispatcher.close()


def test_a_front_end_whose_beats_stop_fails_its_open_requests(monkeypatch, endpoints):
    """A token stream gone silent loses requests as surely as a silent dispatcher."""
    dispatcher = ScriptedDispatcher(endpoints).start()
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(0.25, 4))
    try:
        stream = open_request_when_ready(client)
        dispatcher.beats = False                # states still come
        with gevent.Timeout(20):
            assert stream.next_event().code == "dispatcher_unavailable"
        assert client.wait_state(timeout=0) is None
    finally:
        client.close()
        dispatcher.close()


def test_a_request_submitted_after_the_dispatcher_was_lost_is_refused(endpoints):
    """A handler that saw the dispatcher's state, then yielded (a check on the pool)
    while the loss was said: its SUBMIT went out and its stream waited for a `Lost`
    already sent, for as long as its client stayed. Refused (503) instead, unsent."""
    import msgspec

    from app.errors import ServiceUnavailable
    dispatcher = ScriptedDispatcher(endpoints).start()
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(0.25, 4))
    try:
        assert client.wait_state(timeout=10) is not None
        client._lose("lost the dispatcher")               # (as the heartbeat check does)
        with pytest.raises(ServiceUnavailable):
            client.submit(msgspec.convert({"id": "late", "model": "m", "prompt": "x",
                                           "generation": {"max_tokens": 1}}, P.WorkerJob))
        assert "late" not in client.streams
        gevent.sleep(0.3)
        assert (P.SUBMIT, "late") not in dispatcher.received
    finally:
        client.close()
        dispatcher.close()


def test_a_dispatcher_restarted_within_the_expiry_is_noticed(monkeypatch, endpoints):
    """Another run of the dispatcher at the same address knows nothing of the open
    requests, and its proxy has not seen our subscription: the state of a new run fails
    them, and only a beat of that run makes the front end ready again."""
    monkeypatch.setattr(client_module, "UNANSWERED_FAST_PINGS", 10_000)
    dispatcher = ScriptedDispatcher(endpoints).start()
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(0.25))
    try:
        stream = open_request_when_ready(client)
        dispatcher.state = msgspec.structs.replace(STATE, epoch="run-2")   # beats: run 1
        with gevent.Timeout(20):
            assert stream.next_event().code == "dispatcher_unavailable"
        gevent.sleep(0.6)                                   # pings answered: no beat of run 2
        assert client.wait_state(timeout=0) is None and client.state.epoch == "run-2"
        dispatcher.beat_epoch = "run-2"
        with gevent.Timeout(20):
            while client.wait_state(timeout=0) is None:
                gevent.sleep(0.05)
    finally:
        client.close()
        dispatcher.close()


def test_a_silent_dispatcher_gets_a_few_quick_pings_then_one_per_interval(monkeypatch,
                                                                          endpoints):
    """Over a connection that is up but never answered (a partition), quick pings would
    pile up: after a few the front end falls back to one per heartbeat interval."""
    monkeypatch.setattr(client_module, "UNANSWERED_FAST_PINGS", 5)
    context = gzmq.Context()
    router = context.socket(gzmq.ROUTER)
    router.bind(endpoints.frontend)                   # listening, never answering
    started = time.monotonic()
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(60.0))
    pings = []
    try:
        while time.monotonic() - started < 10.0:     # (until a second's quiet after 3)
            if router.poll(100):
                router.recv_multipart()
                pings.append(time.monotonic() - started)
            elif len(pings) >= 3 and time.monotonic() - started - pings[-1] > 1.0:
                break
    finally:
        client.close()
        router.close(0)
        context.term()
    # the first may go before the link is up; then quiet: the next is 60 s away
    assert 3 <= len(pings) <= 5, pings


def test_a_cancel_the_dealer_cannot_take_is_sent_when_it_can(monkeypatch, endpoints):
    """A CANCEL the DEALER refuses (no connection to the dispatcher for a moment, or its
    queue full) must not be lost: the job would run on for nobody to its max_tokens."""
    monkeypatch.setattr(client_module, "UNANSWERED_FAST_PINGS", 10_000)
    dispatcher = ScriptedDispatcher(endpoints).start()
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(0.5, 1000))
    try:
        open_request_when_ready(client)
        dispatcher.close()                      # the connection goes: the DEALER refuses
        with gevent.Timeout(20):
            while client.send(P.CANCEL, "probe"):
                gevent.sleep(0.05)
        client.cancel("cmpl-gone")
        gevent.sleep(0.3)                       # retried meanwhile: still nobody there
        dispatcher = ScriptedDispatcher(endpoints).start()
        with gevent.Timeout(20):
            while (P.CANCEL, "cmpl-gone") not in dispatcher.received:
                gevent.sleep(0.05)
        assert dispatcher.received.count((P.CANCEL, "cmpl-gone")) == 1
    finally:
        client.close()
        dispatcher.close()


def test_a_front_end_sends_its_last_counts_as_it_exits(monkeypatch, endpoints):
    """The counts since the last heartbeat (requests, latency, each key's usage) go to
    the dispatcher when the process exits (gunicorn's worker_exit): a restart lost up to
    an interval of them. (Here the interval is a minute: only the last ping carries it.)"""
    monkeypatch.setattr(client_module, "UNANSWERED_FAST_PINGS", 10_000)
    dispatcher = ScriptedDispatcher(endpoints).start()
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(60.0))
    try:
        open_request_when_ready(client)
        client.recorder.used("alice", 12, 34, False)
        before = len(dispatcher.ping_bodies)
        client.close(send_counts=True)
        with gevent.Timeout(20):
            while not any(body.metrics for body in dispatcher.ping_bodies[before:]):
                gevent.sleep(0.05)
        last = [b.metrics for b in dispatcher.ping_bodies[before:] if b.metrics][-1]
        assert last["usage"] == [["alice", 1, 12, 34, 0]]
    finally:
        dispatcher.close()


@pytest.fixture
def broker(endpoints):
    """The real broker, its loop on a thread; stopped, and its loop seen to end, after."""
    broker = Broker(endpoints)
    loop = threading.Thread(target=broker.run)
    loop.start()
    yield broker
    broker.stop()
    loop.join(timeout=10)
    broker.close()
    assert not loop.is_alive()


def test_the_dispatcher_answers_a_ping_with_a_beat_over_the_token_stream(endpoints, broker):
    context = zmq.Context()
    fe_id = P.new_frontend_id()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, fe_id)
    sub.connect(endpoints.tokens_out)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, fe_id)
    dealer.connect(endpoints.frontend)
    try:
        deadline = time.monotonic() + 20
        beat = None
        while beat is None and time.monotonic() < deadline:
            dealer.send_multipart(P.encode(P.PING, body=P.Ping(open=0)))
            assert dealer.poll(5000)
            assert P.decode(dealer.recv_multipart()).cmd == P.STATE
            if sub.poll(200):       # the first beats go before the subscription is through
                beat = sub.recv_multipart()
        assert beat is not None
        assert beat[0] == fe_id
        assert P.decode_event(beat) == ("", P.Beat(epoch=broker.core.epoch))
    finally:
        sub.close(0)
        dealer.close(0)
        context.term()


def test_a_peer_without_a_front_ends_identity_is_dropped_and_the_dispatcher_serves_on(
        endpoints, broker):
    """A socket that sets no identity (libzmq gives it five random bytes, not text) on
    the front ends' address: its job would have stopped the dispatcher when handed to a
    worker (its topic is named from the identity). It is dropped; front ends are served."""
    context = zmq.Context()
    stranger, dealer = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, P.new_frontend_id())
    try:
        stranger.connect(endpoints.frontend)
        job = P.WorkerJob(id=P.new_request_id(), model="m", prompt="x",
                          generation=P.Generation(max_tokens=3))
        stranger.send_multipart(P.encode(P.SUBMIT, job.id, job))
        deadline = time.monotonic() + 20
        while broker.strangers == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert broker.strangers == 1 and len(broker.core.queue) == 0
        dealer.connect(endpoints.frontend)
        dealer.send_multipart(P.encode(P.PING, body=P.Ping(open=0)))
        assert dealer.poll(10_000)
        assert P.decode(dealer.recv_multipart()).cmd == P.STATE     # (its loop runs)
    finally:
        stranger.close(0)
        dealer.close(0)
        context.term()


def test_a_fault_handling_one_message_fails_that_job_and_the_loop_goes_on(
        endpoints, broker, monkeypatch):
    """A message whose handling raises (a bug one job meets) gets its job a 500, and what
    of it got queued is cancelled (it would run for nobody); the dispatcher serves on,
    through a fault of its tick's too: an exception that escaped the loop ended
    `serve`, and it stopped every worker and stream with it."""
    submit, tick = broker.core.submit, broker.core.tick
    ticks = []

    def faulty(fe_id, request_id, body):
        submit(fe_id, request_id, body)         # (queued: no worker yet) ... then a bug
        if body.prompt == "fault":
            raise RuntimeError("a bug met by this job alone")

    def faulty_tick(now):
        ticks.append(now)
        if len(ticks) == 1:
            raise RuntimeError("a bug met by the tick")
        return tick(now)

    monkeypatch.setattr(broker.core, "submit", faulty)
    monkeypatch.setattr(broker.core, "tick", faulty_tick)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, P.new_frontend_id())
    dealer.connect(endpoints.frontend)
    worker = context.socket(zmq.DEALER)            # a worker the jobs are sent to
    worker.setsockopt(zmq.IDENTITY, b"w-test")
    worker.connect(endpoints.worker)
    worker.send_multipart(P.encode(P.READY, body=P.WorkerInfo(
        model="m", slots=4, n_ctx=4096, compute="cpu", pid=os.getpid())))
    deadline = time.monotonic() + 20
    while not broker.core.registry.workers and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        for _ in range(2):          # (the second: the loop still reads and answers)
            job = P.WorkerJob(id=P.new_request_id(), model="m", prompt="fault",
                              generation=P.Generation(max_tokens=3))
            dealer.send_multipart(P.encode(P.SUBMIT, job.id, job))
            msg = None
            while msg is None or msg.cmd in (P.ACCEPTED, P.STATE):   # (it got that far)
                assert dealer.poll(10_000)
                msg = P.decode(dealer.recv_multipart())
            assert (msg.cmd, msg.request_id) == (P.REJECTED, job.id)
            assert (msg.body.status, msg.body.code) == (500, "dispatcher_fault")
            to_worker = []          # (it got to the worker: cancelled there, not left to
            while (P.CANCEL, job.id) not in to_worker and worker.poll(10_000):  # run on)
                sent = P.decode(worker.recv_multipart())
                to_worker.append((sent.cmd, sent.request_id))
            assert (P.REQUEST, job.id) in to_worker and (P.CANCEL, job.id) in to_worker
        dealer.send_multipart(P.encode(P.PING, body=P.Ping(open=0)))
        assert dealer.poll(10_000)
        assert P.decode(dealer.recv_multipart()).cmd == P.STATE
        deadline = time.monotonic() + 20    # (a turn reads on while messages come: its
        while len(ticks) < 2 and time.monotonic() < deadline:      # tick is after them)
            time.sleep(0.01)
        assert broker.core.stats["loop_faults"] == 3 and len(ticks) > 1    # (and the tick)
    finally:
        dealer.close(0)
        worker.close(0)
        context.term()


def test_a_requests_end_a_full_front_end_pipe_refuses_is_sent_when_it_can_take_it(
        endpoints, broker, monkeypatch):
    """A REJECTED or FAILED that meets a front end's full pipe (EAGAIN: 1,000 messages
    behind) is sent again once it drains: dropped, it left the stream waiting for an end
    that would never come (its job was over: no worker sends one)."""
    submit = broker.core.submit

    def faulty(fe_id, request_id, body):
        if body.prompt == "fault":
            raise RuntimeError("ends the job with a REJECTED")
        return submit(fe_id, request_id, body)

    monkeypatch.setattr(broker.core, "submit", faulty)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, P.new_frontend_id())
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(endpoints.frontend)
    try:
        for count in (5000, 100):   # each answered with ~300 bytes nobody reads yet;
            for _ in range(count):  # the second lot once the pipes have settled full
                dealer.send_multipart(P.encode(P.METRICS, "m"))
            time.sleep(0.5)
        job = P.WorkerJob(id=P.new_request_id(), model="m", prompt="fault",
                          generation=P.Generation(max_tokens=3))
        dealer.send_multipart(P.encode(P.SUBMIT, job.id, job))
        deadline = time.monotonic() + 30
        while broker.core.stats["loop_faults"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        ends = []
        while not ends and time.monotonic() < deadline:
            if dealer.poll(200):
                msg = P.decode(dealer.recv_multipart())
                if msg.cmd != P.METRICS:
                    ends.append(msg)
        assert [(m.request_id, m.body.code) for m in ends] == [(job.id, "dispatcher_fault")]
        while broker.core.stats["frontend_resent"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)        # (counted by the loop's thread right after the send)
        assert broker.core.stats["frontend_resent"] == 1, "it went at once: no full pipe"
        assert broker.core.stats["frontend_undelivered"] == 0
    finally:
        dealer.close(0)
        context.term()


def test_events_of_a_closed_request_that_keep_coming_cancel_it_again(monkeypatch, endpoints):
    """A CANCEL the DEALER took while its connection was dropping is lost (IMMEDIATE),
    and the job ran to its max_tokens for nobody, its events dropped here unread. Events
    still coming ORPHAN_CANCEL_AFTER s after a closed request's first one cancel it again,
    once a period; those in flight at the close, and its end, do not."""
    monkeypatch.setattr(client_module, "ORPHAN_CANCEL_AFTER", 0.2)
    dispatcher = ScriptedDispatcher(endpoints).start()
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(60.0))
    try:
        open_request_when_ready(client)
        topic = client.id

        def event(rid, seq, end=False):
            body = P.End(seq=seq, finish_reason="length") if end else \
                P.Text(seq=seq, text="x")
            dispatcher.xpub.send_multipart(P.encode_event(topic, rid, body))

        event("cmpl-1", 0)                     # open: read, no cancel
        for seq in range(3):                   # closed a moment ago: in flight
            event("cmpl-gone", seq)
        gevent.sleep(0.1)
        assert dispatcher.received == []
        for seq in range(3, 12):               # still coming: its CANCEL was lost
            event("cmpl-gone", seq)
            gevent.sleep(0.05)
        event("cmpl-ended", 0, end=True)
        with gevent.Timeout(5):
            while (P.CANCEL, "cmpl-gone") not in dispatcher.received:
                gevent.sleep(0.02)
        gevent.sleep(0.1)
        assert dispatcher.received.count((P.CANCEL, "cmpl-gone")) in (1, 2)
        assert all(rid == "cmpl-gone" for _, rid in dispatcher.received)
    finally:
        client.close()
        dispatcher.close()


def test_a_finished_a_full_front_end_pipe_refuses_is_sent_again(endpoints):
    """FINISHED starts a stream's grace for its last events: dropped at a full pipe (a
    front end falling behind, whose token path drops the worker's last event as well),
    nothing ended the stream, a non-streaming request waited for ever. It waits with
    the other ends of requests and goes once the pipe takes it."""
    from dispatcher.core import Send

    class FullOnce:
        def __init__(self):
            self.sent, self.refused = [], 0

        def send_multipart(self, frames, flags=0):
            if not self.refused:
                self.refused += 1
                raise zmq.ZMQError(zmq.EAGAIN)
            self.sent.append(frames)

    broker = Broker(endpoints)
    real, broker.frontend = broker.frontend, FullOnce()
    try:
        end = Send("frontend", b"fe-1", P.FINISHED, "cmpl-1",
                   P.Finished(attempt=1, last_seq=7))
        broker.deliver([end])
        assert [send for _, send in broker.unsent] == [end] and not broker.frontend.sent
        broker.resend()
        assert not broker.unsent and broker.core.stats["frontend_resent"] == 1
        msg = P.decode(broker.frontend.sent[0][1:])
        assert (msg.cmd, msg.request_id, msg.body.last_seq) == (P.FINISHED, "cmpl-1", 7)
    finally:
        broker.frontend = real
        broker.close()


def test_a_tick_that_fails_every_turn_stops_the_dispatcher(endpoints, monkeypatch):
    """A fault of the tick's is logged and the loop goes on, but one that recurs every
    turn leaves a dispatcher that dispatches nothing: after TEND_FAULTS turns in a row
    the loop stops (its service restarts it), as it did at the first before."""
    import dispatcher.broker as B
    monkeypatch.setattr(B, "TEND_FAULTS", 5)
    broker = Broker(endpoints)

    def tick(now):
        raise RuntimeError("a bug met by every tick")

    monkeypatch.setattr(broker.core, "tick", tick)
    ended = []

    def run():
        try:
            broker.run()
        except RuntimeError as exc:
            ended.append(exc)

    loop = threading.Thread(target=run)
    loop.start()
    loop.join(timeout=20)
    try:
        assert not loop.is_alive() and len(ended) == 1
        assert broker.core.stats["loop_faults"] == 5
    finally:
        broker.stop()
        loop.join(timeout=10)
        broker.close()



def test_a_quiet_request_the_dispatcher_holds_no_more_ends_instead_of_waiting(
        monkeypatch, endpoints):
    """A request whose end was lost (its FINISHED or FAILED and the worker's last event
    all dropped, for a front end far behind) waited for ever, its stream kept open by
    the heartbeats, until its client left. An accepted request that has heard nothing
    for QUIET_AFTER s is named in the pings; once the dispatcher answers that it holds
    it no more, it ends `stream_incomplete` after the grace a FINISHED gives. One that
    hears something is not asked after; one not yet accepted is not either."""
    monkeypatch.setattr(client_module, "QUIET_AFTER", 0.5)
    monkeypatch.setattr(config, "DONE_GRACE", 0.3)
    dispatcher = ScriptedDispatcher(endpoints).start()
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(0.1))
    try:
        stream = open_request_when_ready(client)
        waiting = client_module.RequestStream(client, "cmpl-waiting")   # (no ACCEPTED)
        client.streams["cmpl-waiting"] = waiting
        stream.accepted = True
        sent = time.monotonic()
        dispatcher.xpub.send_multipart(P.encode_event(client.id, "cmpl-1", P.Text(
            seq=0, text="x")))
        with gevent.Timeout(10):
            assert stream.next_event().text == "x"
        assert stream.heard_at >= sent          # (hearing something: quiet no more)
        assert client._quiet() == [] or time.monotonic() - sent > 0.5
        with gevent.Timeout(10):                # (and once the stream is quiet: asked)
            while not any(body.quiet for body in dispatcher.ping_bodies):
                gevent.sleep(0.05)
        # (the one not accepted, as quiet, never asked after)
        assert {tuple(b.quiet) for b in dispatcher.ping_bodies} == {(), ("cmpl-1",)}
        told = time.monotonic()
        dispatcher.state = msgspec.structs.replace(STATE, unheld=["cmpl-1"])
        with gevent.Timeout(10):
            event = stream.next_event()
        assert event.code == "stream_incomplete" and "holds this request no" in event.message
        assert time.monotonic() - told >= 0.25 and stream.finished   # (its grace: 0.3 s)
    finally:
        client.close()
        dispatcher.close()


def test_quiet_requests_are_asked_after_in_turn(monkeypatch, endpoints):
    """More quiet requests than a ping names (MAX_QUIET): those asked after least lately
    go first, so requests held for long (queued behind hundreds) do not crowd out a
    newer one whose end was lost."""
    monkeypatch.setattr(client_module, "QUIET_AFTER", 0.0)
    monkeypatch.setattr(P, "MAX_QUIET", 2)
    dispatcher = ScriptedDispatcher(endpoints).start()
    client = client_module.DispatcherClient(endpoints, config.Heartbeat(60.0))
    try:
        open_request_when_ready(client).finished = True     # (ended: never asked after)
        for n, rid in enumerate("abcde"):
            stream = client.streams[rid] = client_module.RequestStream(client, rid)
            stream.accepted, stream.heard_at = True, time.monotonic() - 100.0 + n
        client.streams["x"] = client_module.RequestStream(client, "x")  # (not accepted)
        assert [client._quiet() for _ in range(3)] == [["a", "b"], ["c", "d"], ["e", "a"]]
    finally:
        client.close()
        dispatcher.close()


def test_a_state_never_says_unheld_a_request_whose_end_waits_to_be_resent(endpoints):
    """The answer to a ping goes out at once, the ends a full pipe refused later in the
    loop: a STATE naming such a request unheld overtook its FAILED or FINISHED, and the
    stream ended `stream_incomplete` in its stead (a 504, a `superseded` lost)."""
    from dispatcher.core import Send

    class Pipe:
        def __init__(self):
            self.sent, self.full = [], True

        def send_multipart(self, frames, flags=0):
            if self.full:
                raise zmq.ZMQError(zmq.EAGAIN)
            self.sent.append(P.decode(frames[1:]))

    broker = Broker(endpoints)
    real, broker.frontend = broker.frontend, Pipe()
    try:
        broker.deliver([Send("frontend", b"fe-1", P.FAILED, "cmpl-1", P.WireError(
            status=504, code="queue_timeout", message="m"))])
        assert len(broker.unsent) == 1
        broker.frontend.full = False
        broker.deliver([Send("frontend", peer, P.STATE, body=msgspec.structs.replace(
            STATE, unheld=["cmpl-1", "cmpl-2"])) for peer in (b"fe-1", b"fe-2")])
        assert [m.body.unheld for m in broker.frontend.sent] == [["cmpl-2"],
                                                                  ["cmpl-1", "cmpl-2"]]
        broker.resend()
        assert broker.frontend.sent[-1].cmd == P.FAILED
    finally:
        broker.frontend = real
        broker.close()
