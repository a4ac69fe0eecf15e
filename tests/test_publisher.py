"""The worker's publisher (workers/publisher.py) on real ZeroMQ sockets in one process:
events wait for their front end's subscription without the publishing thread waiting."""
import time

import pytest
import zmq

from dispatcher.common import config, protocol as P
from workers.publisher import Publisher


@pytest.fixture
def pair():
    context = zmq.Context()
    xpub = context.socket(zmq.XPUB)
    xpub.bind("inproc://tokens")
    yield context, xpub, Publisher(xpub)
    xpub.close(0)
    context.term()


def subscriber(context, topic: bytes) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect("inproc://tokens")
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    return sub


def received(sub) -> list[str]:
    out = []
    while sub.poll(200, zmq.POLLIN):
        out.append(P.decode_event(sub.recv_multipart())[1].text)
    return out


def event(text: str) -> P.Text:
    return P.Text(seq=0, attempt=1, text=text)


def test_events_are_held_until_the_subscription_then_sent_in_order(pair):
    context, _, publisher = pair
    publisher.publish(b"fe-1", "r", event("a"))
    publisher.publish(b"fe-1", "r", event("b"))
    assert list(publisher.held) == [b"fe-1"]          # held, not waited for
    sub = subscriber(context, b"fe-1")
    deadline = time.monotonic() + 10                 # (ZeroMQ's own threads may be slow)
    while time.monotonic() < deadline:
        publisher.tick()
        if not publisher.held:
            break
        time.sleep(0.01)
    publisher.publish(b"fe-1", "r", event("c"))
    assert received(sub) == ["a", "b", "c"]
    sub.close()


def test_a_front_end_that_went_away_costs_no_wait(pair):
    context, _, publisher = pair
    sub = subscriber(context, b"fe-2")
    deadline = time.monotonic() + 10                 # (ZeroMQ's own threads may be slow)
    while time.monotonic() < deadline:
        publisher.tick()
        if b"fe-2" in publisher.topics:
            break
        time.sleep(0.01)
    sub.close()                                      # the front end died
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        publisher.tick()
        if b"fe-2" in publisher.gone:
            break
        time.sleep(0.01)
    publisher.publish(b"fe-2", "r", event("lost"))
    assert not publisher.held                        # sent at once, to nobody


def test_held_events_go_out_after_the_wait_anyway(pair, monkeypatch):
    context, _, publisher = pair
    monkeypatch.setattr(config, "SUBSCRIPTION_WAIT", 0.05)
    publisher.publish(b"fe-3", "r", event("late"))
    time.sleep(0.1)
    publisher.tick()
    assert not publisher.held
