"""RequestStream: ordering and completeness checks of a front end's token stream (unit)."""
import time

import msgspec
import pytest

from app.client import ClientGone, Control, Left, Lost, RequestStream, TokenEvent
from app.errors import APIError
from dispatcher.common import config, protocol as P


class FakeClient:
    """Stands in for DispatcherClient: records what the stream sends."""

    def __init__(self):
        self.sent = []
        self.forgotten = []

    def send(self, cmd, request_id="", body=None):
        self.sent.append((cmd, request_id))
        return True

    def cancel(self, request_id):
        self.send(P.CANCEL, request_id)

    def wake_reader(self):
        pass

    def forget(self, request_id):
        self.forgotten.append(request_id)


def ev(s, e, a=1, **fields):
    """An event as the SUB socket hands it on (decoded)."""
    return TokenEvent(msgspec.convert({"s": s, "e": e, "a": a, **fields}, P.AnyEvent))


def ctl(cmd, body):
    """A message from the dispatcher, its body decoded as the DEALER reader does."""
    return Control(cmd, P.decode_body(cmd, msgspec.json.encode(body)))


def make(*items):
    stream = RequestStream(FakeClient(), "cmpl-1")
    for item in items:
        stream.inbox.put(item)
    return stream


def drain(stream):
    """The stream's events, each as JSON (its wire form)."""
    events = []
    while True:
        event = stream.next_event()
        events.append(msgspec.to_builtins(event))
        if isinstance(event, P.ENDS):
            return events


def test_events_in_order_pass_through():
    stream = make(ev(0, "start", prompt_tokens=3), ev(1, "text", text="a"),
                  ev(2, "end", finish_reason="stop"))
    assert [e["e"] for e in drain(stream)] == ["start", "text", "end"]


def test_a_sequence_gap_becomes_an_error_not_missing_text():
    stream = make(ev(0, "start"), ev(1, "text", text="a"), ev(3, "text", text="c"))
    events = drain(stream)
    assert events[-1]["e"] == "error" and events[-1]["code"] == "stream_gap"
    assert "2..2" in events[-1]["message"]


def test_events_of_an_older_attempt_are_ignored():
    stream = make(ev(0, "start", a=2), ev(1, "text", a=1, text="stale"),
                  ev(1, "text", a=2, text="fresh"), ev(2, "end", a=2))
    events = drain(stream)
    assert [e.get("text") for e in events if e["e"] == "text"] == ["fresh"]


def test_a_requeued_attempt_restarts_the_sequence_before_any_text():
    stream = make(ev(0, "start", a=1), ev(0, "start", a=2), ev(1, "end", a=2))
    assert [e["e"] for e in drain(stream)] == ["start", "start", "end"]


def test_a_new_attempt_after_text_was_shown_is_an_error():
    stream = make(ev(0, "start"), ev(1, "text", text="shown"), ev(0, "start", a=2))
    events = drain(stream)
    assert events[-1]["code"] == "worker_lost"


def test_failed_from_the_dispatcher_ends_the_stream():
    stream = make(ev(0, "start"), ctl(P.FAILED, {"status": 503, "code": "worker_lost",
                                                 "message": "gone"}))
    events = drain(stream)
    assert {k: events[-1][k] for k in ("e", "status", "code", "message")} == \
        {"e": "error", "status": 503, "code": "worker_lost", "message": "gone"}


def test_messages_missing_after_finished_become_an_error(monkeypatch):
    monkeypatch.setattr(config, "DONE_GRACE", 0.05)
    stream = make(ev(0, "start"), ctl(P.FINISHED, {"attempt": 1, "last_seq": 2}))
    events = drain(stream)
    assert events[-1]["code"] == "stream_incomplete"


def test_finished_overtaking_the_last_events_is_fine(monkeypatch):
    monkeypatch.setattr(config, "DONE_GRACE", 5)
    stream = make(ev(0, "start"), ctl(P.FINISHED, {"attempt": 1, "last_seq": 1}),
                  ev(1, "end", finish_reason="length"))
    assert drain(stream)[-1]["e"] == "end"


def test_events_still_arriving_after_finished_renew_the_grace(monkeypatch):
    """Under a deep backlog a job's events drain well behind the word that it finished
    (the dispatcher's FINISHED): while they keep coming nothing is lost, and the request
    must not end in stream_incomplete two seconds after that word."""
    import gevent
    monkeypatch.setattr(config, "DONE_GRACE", 0.2)
    stream = make(ev(0, "start"), ctl(P.FINISHED, {"attempt": 1, "last_seq": 7}))

    def trickle():
        for s in range(1, 7):
            gevent.sleep(0.1)
            stream.inbox.put(ev(s, "text", text="x"))
        gevent.sleep(0.1)
        stream.inbox.put(ev(7, "end", finish_reason="length"))

    gevent.spawn(trickle)
    events = drain(stream)
    assert events[-1]["e"] == "end" and len(events) == 8


def test_events_waiting_in_the_socket_when_the_grace_runs_out_are_read(monkeypatch):
    """A process held past the grace (a long write) wakes with the grace's timer and the
    socket both ready: the reader is woken and what waited in the socket is read, not
    declared lost; with nothing there the stream ends a moment later."""
    monkeypatch.setattr(config, "DONE_GRACE", 0.05)
    stream = make(ev(0, "start"), ctl(P.FINISHED, {"attempt": 1, "last_seq": 1}))
    waiting = [ev(1, "end", finish_reason="stop")]
    stream.client.wake_reader = lambda: stream.inbox.put(waiting.pop())
    assert drain(stream)[-1]["e"] == "end"

    stuck = make(ev(0, "start"), ctl(P.FINISHED, {"attempt": 1, "last_seq": 1}))
    wakes = []
    stuck.client.wake_reader = lambda: wakes.append(1)
    started = time.monotonic()
    assert drain(stuck)[-1]["code"] == "stream_incomplete"
    assert wakes == [1] and time.monotonic() - started < 1.0     # woken once, not waited


def test_waking_the_reader_does_not_put_it_to_sleep():
    """pyzmq's plain getsockopt(EVENTS) on a zmq.green socket takes the wake-up a reader
    blocked in recv waits for: the next message then waited ~11 s (pyzmq's fallback
    timeout), every stream of the front end with it. The wake used reads it as
    zmq.green does. (Real sockets: a PUB and a SUB over inproc.)"""
    import gevent
    import zmq.green as gzmq

    from app.client import wake_readers
    context = gzmq.Context()
    pub, sub = context.socket(gzmq.PUB), context.socket(gzmq.SUB)
    try:
        pub.bind("inproc://wake")
        sub.setsockopt(gzmq.SUBSCRIBE, b"")
        sub.connect("inproc://wake")
        got = []

        def reader():
            while True:
                got.append((sub.recv(), time.monotonic()))
        greenlet = gevent.spawn(reader)
        with gevent.Timeout(10):
            while not got:                          # (the subscription goes through)
                pub.send(b"hello")
                gevent.sleep(0.05)
        gevent.sleep(0.1)
        got.clear()
        pub.send(b"one")
        wake_readers(sub)
        gevent.sleep(0.05)
        sent = time.monotonic()
        pub.send(b"two")
        with gevent.Timeout(10):
            while not any(m == b"two" for m, _ in got):
                gevent.sleep(0.01)
        assert [t for m, t in got if m == b"two"][0] - sent < 2.0
        greenlet.kill()
    finally:
        pub.close(0)
        sub.close(0)
        context.term()


def test_lost_dispatcher_fails_the_request():
    stream = make(ev(0, "start"), Lost())
    assert drain(stream)[-1]["code"] == "dispatcher_unavailable"


def test_client_gone_raises():
    stream = make(Left())
    with pytest.raises(ClientGone):
        stream.next_event()


def test_events_arriving_before_accepted_are_kept_in_order():
    stream = make(ev(0, "start"), ev(1, "text", text="a"), ctl(P.ACCEPTED, {}),
                  ev(2, "end"))
    stream.wait_accepted(timeout=1)
    assert [e["e"] for e in drain(stream)] == ["start", "text", "end"]


def test_rejection_raises_the_api_error_it_describes():
    stream = make(ctl(P.REJECTED, {"status": 503, "code": "no_worker_ready",
                                   "message": "none", "retry_after": 5}))
    with pytest.raises(APIError) as info:
        stream.wait_accepted(timeout=1)
    assert info.value.status == 503 and info.value.headers == {"Retry-After": "5"}


def test_close_cancels_an_unfinished_request_once():
    stream = make()
    stream.close()
    stream.close()
    assert stream.client.sent == [(P.CANCEL, "cmpl-1")]
    finished = make(ev(0, "end"))
    drain(finished)
    finished.close()
    assert finished.client.sent == []



def test_a_requeued_attempts_finished_that_came_first_keeps_its_deadline(monkeypatch):
    """FINISHED of attempt 2 overtook attempt 2's first event (they travel apart): the
    new attempt kept no deadline, so a lost last event left the request waiting for
    ever instead of ending in stream_incomplete."""
    monkeypatch.setattr(config, "DONE_GRACE", 0.05)
    stream = make(ev(0, "start", a=1), ctl(P.FINISHED, {"attempt": 2, "last_seq": 2}),
                  ev(0, "start", a=2), ev(1, "text", a=2, text="x"))
    events = drain(stream)
    assert events[-1]["code"] == "stream_incomplete"


def test_a_request_ended_by_losing_the_dispatcher_is_cancelled_on_close():
    """A dispatcher that restarted may run the job on for nobody: closing sends CANCEL
    (one that is gone drops it)."""
    stream = make(ev(0, "start"), Lost())
    assert drain(stream)[-1]["code"] == "dispatcher_unavailable"
    stream.close()
    assert (P.CANCEL, "cmpl-1") in stream.client.sent


def test_a_request_whose_events_wait_unwritten_past_the_backlog_is_ended():
    """The HTTP handler blocked in a write (a client that stopped reading): the readers
    moved every event its jobs made into memory. Past MAX_BACKLOG_BYTES of them waiting
    its jobs are cancelled as if the client had left, and reading stops; what waits
    unwritten is dropped (held, it went out at the slow client's pace, hours at a few
    KB a minute, before the answer's error), so the handler's next read ends it."""
    from types import SimpleNamespace

    import gevent

    from app.fanout import MAX_BACKLOG_BYTES, Fanout

    class Client(FakeClient):
        def client_gone(self, request_id):
            self.sent.append(("gone", request_id))
            streams[0].inbox.put(Left())

    client = Client()
    chunk = MAX_BACKLOG_BYTES // 8
    stream = RequestStream(client, "cmpl-1")
    streams = [stream]
    for s in range(200):                 # far more than the backlog holds
        stream.inbox.put(TokenEvent(ev(s, "text", text="x").event, chunk))
    fanout = Fanout(client, [SimpleNamespace(id="cmpl-1")])
    fanout.streams = streams
    fanout._readers = [gevent.spawn(fanout._read, 0, stream)]
    gevent.joinall(fanout._readers, timeout=5)
    assert fanout.overflowed and ("gone", "cmpl-1") in client.sent
    # cancelled at once, not once the handler has written the backlog (a slow reader)
    assert (P.CANCEL, "cmpl-1") in client.sent and client.forgotten == ["cmpl-1"]
    # it stopped at the first event with more than the bound waiting before it, and
    # dropped what waited
    assert fanout.backlog == 0 and fanout.merged.qsize() == 1       # (the end's mark)
    with pytest.raises(ClientGone):
        next(fanout.events())

    calm = Fanout(client, [SimpleNamespace(id="cmpl-2")])   # one that is read
    quiet = RequestStream(client, "cmpl-2")

    def worker():                        # events as they come off the socket, a few
        for s in range(100):             # at a time
            quiet.inbox.put(TokenEvent(ev(s, "text", text="x").event, chunk))
            if s % 4 == 3:
                gevent.sleep(0.001)
        quiet.inbox.put(TokenEvent(ev(100, "end").event, 10))
    gevent.spawn(worker)
    calm.streams, calm._readers = [quiet], [gevent.spawn(calm._read, 0, quiet)]
    read = [event.seq for _, event in calm.events()]
    assert read == list(range(101)) and not calm.overflowed



def _read_slowly(choices: int, feed, write_s: float):
    """A Fanout over `choices` streams, `feed(streams)` putting their events on its own
    greenlet, read by a handler whose every write takes `write_s`: (events read, fanout,
    client)."""
    from types import SimpleNamespace

    import gevent

    from app.fanout import Fanout

    client = FakeClient()
    streams = [RequestStream(client, f"cmpl-{i}") for i in range(choices)]
    fanout = Fanout(client, [SimpleNamespace(id=f"cmpl-{i}") for i in range(choices)])
    fanout.streams = streams
    fanout._readers = [gevent.spawn(fanout._read, i, s) for i, s in enumerate(streams)]
    gevent.spawn(feed, streams)
    read = 0
    for _ in fanout.events():
        read += 1
        gevent.sleep(write_s)                # each write takes a while
    return read, fanout, client


def test_a_burst_that_comes_while_the_handler_waits_is_no_backlog():
    """Four choices' echoes (each over half the backlog bound) arriving in one turn while
    the handler waits, then tokens while it writes them: counted as a backlog, the first
    token after the first write's start cancelled a request whose client read it all."""
    import gevent

    from app.fanout import MAX_BACKLOG_BYTES
    big = MAX_BACKLOG_BYTES // 2 + 1

    def feed(streams):
        gevent.sleep(0.01)                   # the handler waits by now
        for stream in streams:               # the echoes, in one turn
            stream.inbox.put(TokenEvent(ev(0, "text", text="x").event, big))
        for seq in range(1, 40):             # then tokens, a few at a time
            for stream in streams:
                stream.inbox.put(TokenEvent(ev(seq, "text", text="y").event, 100))
            gevent.sleep(0.001)
        for stream in streams:
            stream.inbox.put(TokenEvent(ev(40, "end").event, 10))

    read, fanout, client = _read_slowly(4, feed, 0.002)
    assert read == 4 * 41 and not fanout.overflowed and client.sent == []


def test_one_event_larger_than_the_backlog_coming_while_the_handler_writes_is_kept():
    """Two choices' echoes of 9 MB each (within the answer's bound: a stream counts an
    echo once per prompt), the second coming while the handler writes the first: no
    backlog of a slow client waited before it, so the request goes on."""
    import gevent

    from app.fanout import MAX_BACKLOG_BYTES
    big = MAX_BACKLOG_BYTES + (1 << 20)

    def feed(streams):
        gevent.sleep(0.01)
        streams[0].inbox.put(TokenEvent(ev(0, "text", text="x").event, big))
        gevent.sleep(0.02)                   # the handler is writing it now
        streams[1].inbox.put(TokenEvent(ev(0, "text", text="y").event, big))
        for stream in streams:
            stream.inbox.put(TokenEvent(ev(1, "end").event, 10))

    read, fanout, client = _read_slowly(2, feed, 0.05)
    assert read == 4 and not fanout.overflowed and client.sent == []
