"""The worker's side of the token stream: publishing events on XPUB once the front end's
subscription is there."""
from __future__ import annotations

import logging
import time

import zmq

from dispatcher.common import config, protocol as P

log = logging.getLogger("workers.generation")


class Publisher:
    """Publishes stream events on an XPUB socket, once the topic's subscriber is there.

    XPUB hands us the subscriptions forwarded by the dispatcher's proxy, so the events of
    a front end whose subscription has not arrived yet are held (not lost to the
    slow-joiner race) and sent as soon as it arrives, or after SUBSCRIPTION_WAIT anyway.
    Nothing here waits: the generation thread that publishes goes on decoding the other
    streams meanwhile. A topic that unsubscribed (its front end went away) is sent to at
    once: its messages go nowhere, and no time is spent on them.
    """

    MAX_REMEMBERED = 4096          # topics remembered as gone (front-end ids: few)

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.topics: set[bytes] = set()
        self.gone: set[bytes] = set()
        self.held: dict[bytes, tuple[float, list]] = {}     # topic -> (until, messages)

    def _read_subscriptions(self) -> None:
        while self.sock.poll(0, zmq.POLLIN):
            msg = self.sock.recv()
            topic = msg[1:]
            if msg[:1] == b"\x01":
                self.topics.add(topic)
                self.gone.discard(topic)
            elif msg[:1] == b"\x00":
                self.topics.discard(topic)
                if len(self.gone) >= self.MAX_REMEMBERED:
                    self.gone.clear()
                self.gone.add(topic)

    def tick(self) -> None:
        """Send held events whose subscription has arrived or whose wait is over."""
        self._read_subscriptions()
        if not self.held:
            return
        now = time.monotonic()
        for topic, (until, messages) in list(self.held.items()):
            if topic in self.topics or topic in self.gone or now >= until:
                if topic not in self.topics and topic not in self.gone:
                    log.warning("front end %r has not subscribed; publishing anyway", topic)
                del self.held[topic]
                for frames in messages:
                    self.sock.send_multipart(frames)

    def flush(self) -> None:
        """Send everything held (the worker is stopping)."""
        for _, messages in self.held.values():
            for frames in messages:
                self.sock.send_multipart(frames)
        self.held.clear()

    def publish(self, topic: bytes, request_id: str, event: P.Event) -> None:
        self.tick()
        frames = P.encode_event(topic, request_id, event)
        if topic in self.held:                     # behind its earlier events
            self.held[topic][1].append(frames)
        elif topic in self.topics or topic in self.gone:
            self.sock.send_multipart(frames)
        else:
            self.held[topic] = (time.monotonic() + config.SUBSCRIPTION_WAIT, [frames])
