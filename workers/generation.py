"""The worker's generation loop: admit jobs into engine slots, step, publish events.

Runs in one thread that owns the engine and the XPUB socket. Jobs and cancels arrive
from the IO thread through a queue and take effect between steps, so a cancel frees its
slot within one token.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import zmq

from dispatcher import config, protocol as P
from workers.errors import EngineError
from workers.sampling import SamplingParams
from workers.textstream import TextAssembler

log = logging.getLogger(__name__)


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


@dataclass
class Active:
    """One request admitted into a slot."""
    request_id: str
    topic: bytes
    attempt: int
    slot: int
    max_tokens: int | None
    prompt_tokens: int
    assembler: TextAssembler
    seq: int = 0
    generated: int = 0
    text_sent: bool = False
    started: float = field(default_factory=time.monotonic)


class GenerationLoop:
    def __init__(self, engine, publisher: Publisher,
                 notify: Callable[[bytes, str, dict | None], None]):
        self.engine = engine
        self.publisher = publisher
        self.notify = notify                      # -> dispatcher, through the IO thread
        self.inbox: queue.Queue = queue.Queue()   # ("job", id, body) | ("cancel", id) | ("reset",)
        self.waiting: deque[tuple[str, dict]] = deque()
        self.active: dict[str, Active] = {}
        self.free_slots = list(range(engine.n_slots))

    # -- inbox -------------------------------------------------------------------------
    def run(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            self._read_inbox(block=not self.active and not self.waiting)
            self._admit()
            if self.active:
                self._step()

    def _read_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.2) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, item: tuple) -> None:
        kind = item[0]
        if kind == "job":
            self.waiting.append((item[1], item[2]))
        elif kind == "cancel":
            self.cancel(item[1])
        elif kind == "reset":
            # The dispatcher forgot us: it has requeued or failed everything we hold.
            for request_id in list(self.active):
                self._drop(self.active[request_id])
            self.waiting.clear()

    def cancel(self, request_id: str) -> None:
        for i, (waiting_id, body) in enumerate(self.waiting):
            if waiting_id == request_id:
                del self.waiting[i]
                self.notify(P.DONE, request_id, {"attempt": body.get("attempt", 1),
                                                 "last_seq": -1, "cancelled": True})
                return
        active = self.active.get(request_id)
        if active is not None:
            self._drop(active)
            self.notify(P.DONE, request_id, {
                "attempt": active.attempt, "last_seq": active.seq - 1, "cancelled": True,
                "usage": {"prompt_tokens": active.prompt_tokens,
                          "completion_tokens": active.generated}})
            log.info("%s cancelled after %d tokens", request_id, active.generated)

    def _drop(self, active: Active) -> None:
        self.active.pop(active.request_id, None)
        self.engine.release(active.slot)
        self.free_slots.append(active.slot)

    # -- admission ---------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            request_id, body = self.waiting.popleft()
            try:
                self._start(request_id, body)
            except EngineError as exc:
                active = self.active.get(request_id)
                if active is not None:
                    self._fail(active, 500, "server_error", "engine_error", str(exc))
                else:
                    self._reject(request_id, body["topic"].encode(),
                                 int(body.get("attempt", 1)), 500, "server_error",
                                 "engine_error", str(exc))

    def _start(self, request_id: str, body: dict) -> None:
        topic = body["topic"].encode()
        attempt = int(body.get("attempt", 1))
        tokens = self.engine.tokenize(body["prompt"])
        n_ctx = self.engine.n_ctx
        if len(tokens) >= n_ctx:
            self._reject(request_id, topic, attempt, 400, "invalid_request_error",
                         "context_length_exceeded",
                         f"This model's maximum context length is {n_ctx} tokens, "
                         f"but the prompt has {len(tokens)} tokens.", param="prompt")
            return
        active = Active(request_id, topic, attempt, self.free_slots.pop(0),
                        body.get("max_tokens"), len(tokens), TextAssembler(body.get("stop")))
        self.active[request_id] = active
        self._publish(active, {"e": P.EV_START, "prompt_tokens": len(tokens)})
        if body.get("echo"):
            self._send_text(active, body["prompt"])
        if active.max_tokens == 0:
            self._finish(active, "length")
            return
        self.engine.add(active.slot, tokens, SamplingParams.from_job(body.get("sampling", {})))

    def _reject(self, request_id: str, topic: bytes, attempt: int, status: int, type_: str,
                code: str, message: str, param: str | None = None) -> None:
        event = {"e": P.EV_ERROR, "s": 0, "a": attempt, "status": status, "type": type_,
                 "code": code, "message": message, "param": param}
        self.publisher.publish(topic, request_id, event)
        self.notify(P.DONE, request_id, {"attempt": attempt, "last_seq": 0, "error": code})

    # -- generation --------------------------------------------------------------------
    def _step(self) -> None:
        try:
            sampled = self.engine.step()
        except EngineError as exc:
            log.error("engine step failed: %s", exc)
            for active in list(self.active.values()):
                self._fail(active, 500, "server_error", "engine_error",
                           f"the inference engine failed: {exc}")
            return
        by_slot = {a.slot: a for a in self.active.values()}
        for slot, token in sampled.items():
            active = by_slot.get(slot)
            if active is not None:
                self._on_token(active, token)

    def _on_token(self, active: Active, token: int) -> None:
        if self.engine.is_eog(token):
            self._finish(active, "stop")
            return
        active.generated += 1
        text = active.assembler.feed(self.engine.piece(token))
        if text:
            self._send_text(active, text)
        if active.assembler.stopped:
            self._finish(active, "stop")
        elif active.max_tokens is not None and active.generated >= active.max_tokens:
            self._finish(active, "length")
        elif active.prompt_tokens + active.generated >= self.engine.n_ctx:
            self._finish(active, "length")

    def _send_text(self, active: Active, text: str) -> None:
        if not active.text_sent:
            active.text_sent = True
            self.notify(P.FIRST, active.request_id, None)
        self._publish(active, {"e": P.EV_TEXT, "text": text})

    def _finish(self, active: Active, reason: str) -> None:
        tail = active.assembler.finish()
        if tail:
            self._send_text(active, tail)
        usage = {"prompt_tokens": active.prompt_tokens, "completion_tokens": active.generated}
        self._publish(active, {"e": P.EV_END, "finish_reason": reason, "usage": usage})
        self._drop(active)
        self.notify(P.DONE, active.request_id, {
            "attempt": active.attempt, "last_seq": active.seq - 1, "finish_reason": reason,
            "usage": usage, "seconds": round(time.monotonic() - active.started, 3)})

    def _fail(self, active: Active, status: int, type_: str, code: str, message: str) -> None:
        self._publish(active, {"e": P.EV_ERROR, "status": status, "type": type_,
                               "code": code, "message": message})
        self._drop(active)
        self.notify(P.DONE, active.request_id, {"attempt": active.attempt,
                                                "last_seq": active.seq - 1, "error": code})

    def _publish(self, active: Active, event: dict) -> None:
        event["s"] = active.seq
        event["a"] = active.attempt
        active.seq += 1
        self.publisher.publish(active.topic, active.request_id, event)

    def abort_all(self, reason: str) -> list[str]:
        """On shutdown: fail requests that already sent text; return the others' ids,
        which the dispatcher requeues when we disconnect."""
        untouched = [request_id for request_id, _ in self.waiting]
        for active in list(self.active.values()):
            if active.text_sent:
                self._fail(active, 503, "server_error", "worker_stopping", reason)
            else:
                self._drop(active)
                untouched.append(active.request_id)
        self.waiting.clear()
        return untouched
