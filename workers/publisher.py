"""The worker's side of the token stream: publishing events on XPUB once the front end's
subscription is there, and the test hooks that lose or break events on purpose."""
from __future__ import annotations

import logging
import os
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


class FaultInjection:
    """Test hooks. Lost stream events, to show that a front end turns the loss into an
    error: COMPLETIONS_FAULT_DROP_EVENT=N drops every request's event with sequence number
    N; COMPLETIONS_FAULT_DROP_END=1 drops every `end` event. A failure inside one request,
    to show that it ends that request alone: COMPLETIONS_FAULT_RAISE=PHASE:MARKER raises
    in PHASE (admit, token, finish) for requests whose prompt contains MARKER (several
    PHASE:MARKER pairs separated by commas). A step that never returns, to show that the
    watchdog replaces a stuck worker: COMPLETIONS_FAULT_HANG=MARKER hangs the generation
    loop at the first token of a request whose prompt contains MARKER."""

    PHASES = ("admit", "token", "finish")

    def __init__(self, drop_seq: int | None = None, drop_end: bool = False,
                 raises: dict[str, str] | None = None, hang: str | None = None):
        self.drop_seq, self.drop_end = drop_seq, drop_end
        self.raises = raises or {}              # phase -> marker
        self.hang = hang

    @classmethod
    def from_env(cls) -> "FaultInjection":
        seq = os.environ.get("COMPLETIONS_FAULT_DROP_EVENT")
        raises = {}
        for spec in os.environ.get("COMPLETIONS_FAULT_RAISE", "").split(","):
            phase, _, marker = spec.strip().partition(":")
            if phase in cls.PHASES and marker:
                raises[phase] = marker
        return cls(int(seq) if seq else None,
                   os.environ.get("COMPLETIONS_FAULT_DROP_END") == "1", raises,
                   os.environ.get("COMPLETIONS_FAULT_HANG") or None)

    def drops(self, event: P.Event) -> bool:
        return event.seq == self.drop_seq or (self.drop_end and isinstance(event, P.End))

    def check(self, phase: str, prompt) -> None:
        if self.hang and phase == "token" and self.hang in str(prompt):
            while True:                 # signals are handled, and the sleep goes on
                time.sleep(1)
        marker = self.raises.get(phase)
        if marker and marker in str(prompt):
            raise RuntimeError(f"fault injection: failing in {phase}")
