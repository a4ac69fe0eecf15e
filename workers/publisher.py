"""The worker's side of the token stream: publishing events on XPUB once the front end's
subscription is there, and the test hooks that lose or break events on purpose."""
from __future__ import annotations

import logging
import os
import time

import zmq

from dispatcher import config, protocol as P

log = logging.getLogger("workers.generation")


class Publisher:
    """Publishes stream events on an XPUB socket, once the topic's subscriber is there.

    XPUB hands us the subscriptions forwarded by the dispatcher's proxy, so before the
    first event for a front end we can wait until its subscription has arrived instead
    of losing messages to the slow-joiner race.
    """

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.topics: set[bytes] = set()

    def _read_subscriptions(self, timeout_ms: int) -> None:
        while self.sock.poll(timeout_ms, zmq.POLLIN):
            msg = self.sock.recv()
            if msg[:1] == b"\x01":
                self.topics.add(msg[1:])
            elif msg[:1] == b"\x00":
                self.topics.discard(msg[1:])
            timeout_ms = 0

    def publish(self, topic: bytes, request_id: str, event: dict) -> None:
        self._read_subscriptions(0)
        if topic not in self.topics:
            deadline = time.monotonic() + config.SUBSCRIPTION_WAIT
            while topic not in self.topics and time.monotonic() < deadline:
                self._read_subscriptions(50)
            if topic not in self.topics:
                log.warning("front end %r has not subscribed; publishing anyway", topic)
        self.sock.send_multipart(P.encode_event(topic, request_id, event))


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

    def drops(self, event: dict) -> bool:
        return event["s"] == self.drop_seq or (self.drop_end and event["e"] == P.EV_END)

    def check(self, phase: str, prompt) -> None:
        if self.hang and phase == "token" and self.hang in str(prompt):
            while True:                 # signals are handled, and the sleep goes on
                time.sleep(1)
        marker = self.raises.get(phase)
        if marker and marker in str(prompt):
            raise RuntimeError(f"fault injection: failing in {phase}")
