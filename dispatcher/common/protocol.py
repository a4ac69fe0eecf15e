"""The wire protocol shared by front ends, the dispatcher and workers.

Sockets (all owned by the dispatcher's addresses, see `Endpoints`):

    front end DEALER  -> frontend ROUTER   [PROTO, cmd, request_id, body]
    worker    DEALER  -> worker ROUTER     [PROTO, cmd, request_id, body]
    worker    XPUB    -> tokens_in XSUB  \\ proxy in the dispatcher
    front end SUB     <- tokens_out XPUB /  [topic = front-end id, request_id, event]
    ops tool  REQ     -> control ROUTER    [json request] -> [json reply]

`body` and `event` are UTF-8 JSON objects (an empty frame is an empty object). A front
end's id is fixed-width (`FRONTEND_ID_LEN`), so subscribing to it matches only its own
messages. Every stream event carries `s` (its sequence number, from 0, per attempt) and
`a` (the attempt: a request requeued after a worker died is attempt 2).

The dispatcher answers each PING twice: STATE over the DEALER, and a `beat` event (no
request id) published into its own proxy. A front end counts the dispatcher as there only
while both arrive: a beat proves its subscription has reached the proxy, so that workers'
events for it are not dropped there. (A SUB resubscribes on its own after the dispatcher
restarts, but not at the same moment its DEALER reconnects; and a worker's XPUB keeps the
subscriptions it saw before the restart, so it cannot tell the difference.)
"""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

PROTO = b"CMPL1"

# front end -> dispatcher
SUBMIT = b"S"       # body: the job
CANCEL = b"C"       # no body; idempotent
PING = b"P"         # heartbeat (+ metrics increments); dispatcher answers STATE
METRICS = b"M"      # the system's metrics; the answer is METRICS with the snapshot
# dispatcher -> front end
ACCEPTED = b"A"     # the job is queued
REJECTED = b"R"     # body: {status, type, code, message, retry_after?}
FAILED = b"F"       # the job was lost after it started; body: {status, type, code, message}
FINISHED = b"D"     # the worker finished; body: {attempt, last_seq}
STATE = b"T"        # heartbeat reply; body: {workers_ready, models, ...}
# worker -> dispatcher
READY = b"Y"        # body: worker info
HEARTBEAT = b"H"
STARTED = b"2"      # the request took a slot: prefill begins (no requeue after this)
FIRST = b"1"        # the request's first text is about to be published
DONE = b"E"         # body: {attempt, last_seq, finish_reason, usage, cancelled}
DISCONNECT = b"X"
# dispatcher -> worker
REQUEST = b"Q"      # body: the job plus {topic, attempt}
# (CANCEL, HEARTBEAT and DISCONNECT also go this way)

FRONTEND_ID_LEN = 15            # "fe-" + 12 hex digits

# A request's choices share their prompt: it crosses each hop once. A job whose prompt
# fields (these) are those of an earlier job of its request carries {"same_as": that
# job's id} instead of them. Front end -> dispatcher: the earlier job was submitted just
# before, in the same request. Dispatcher -> worker: the earlier job's body came with
# {"share_as": its id}; the worker keeps the last WORKER_SHARED such bodies, and the
# dispatcher sends "same_as" only for the last DISPATCHER_SHARED it sent that worker
# (fewer: the worker has them all, in the same order).
SHARED_FIELDS = ("prompt", "suffix", "infill")
WORKER_SHARED = 16
DISPATCHER_SHARED = 8

# llama.cpp's sampler names, as a job's `samplers` order list may give them
SAMPLER_NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                 "xtc", "temperature", "infill")
SAMPLER_ALIASES = {"typical_p": "typ_p", "typical": "typ_p", "nucleus": "top_p",
                   "temp": "temperature", "repetition": "penalties"}

# Stream events (field "e")
EV_START = "start"   # prompt tokenized and admitted: {prompt_tokens}
EV_TEXT = "text"     # {text}
EV_END = "end"       # {finish_reason, usage}
EV_ERROR = "error"   # {status, type, code, message}
EV_BEAT = "beat"     # the dispatcher's answer to a PING over the token stream (request id "")


class ProtocolError(Exception):
    """A message that does not follow this protocol."""


# Readable names for logs.
COMMAND_NAMES = {SUBMIT: "SUBMIT", CANCEL: "CANCEL", PING: "PING", METRICS: "METRICS",
                 ACCEPTED: "ACCEPTED", REJECTED: "REJECTED", FAILED: "FAILED",
                 FINISHED: "FINISHED", STATE: "STATE", READY: "READY",
                 HEARTBEAT: "HEARTBEAT", STARTED: "STARTED", FIRST: "FIRST", DONE: "DONE",
                 DISCONNECT: "DISCONNECT", REQUEST: "REQUEST"}


def command_name(cmd: bytes) -> str:
    return COMMAND_NAMES.get(cmd, repr(cmd))


# OpenAI's error `type` follows from the HTTP status: one table for every layer.
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error",
               501: "not_supported_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else
                           "invalid_request_error")


@dataclass(frozen=True)
class WireError:
    """An error for one request, as it crosses the wire (REJECTED and FAILED bodies, the
    `error` stream event): status, code and message; the OpenAI type from the status."""
    status: int
    code: str
    message: str
    param: str | None = None
    retry_after: int | None = None

    @property
    def type(self) -> str:
        return error_type(self.status)

    def body(self) -> dict:
        body = {"status": self.status, "type": self.type, "code": self.code,
                "message": self.message, "param": self.param}
        if self.retry_after:
            body["retry_after"] = self.retry_after
        return body

    def event(self) -> dict:
        return {"e": EV_ERROR, **self.body()}


@dataclass(frozen=True)
class Message:
    cmd: bytes
    request_id: str
    body: dict


def new_frontend_id() -> bytes:
    return b"fe-" + secrets.token_hex(6).encode()


def new_request_id() -> str:
    return "cmpl-" + secrets.token_hex(12)


def encode_body(body: dict | None) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode() if body else b""


def decode_body(frame: bytes) -> dict:
    if not frame:
        return {}
    try:
        body = json.loads(frame)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("body is not a JSON object")
    return body


def encode(cmd: bytes, request_id: str = "", body: dict | None = None) -> list[bytes]:
    return [PROTO, cmd, request_id.encode(), encode_body(body)]


def decode(frames: list[bytes]) -> Message:
    """Decode [PROTO, cmd, request_id, body] (identity frames already stripped)."""
    if len(frames) != 4:
        raise ProtocolError(f"expected 4 frames, got {len(frames)}")
    if frames[0] != PROTO:
        raise ProtocolError(f"unknown protocol {frames[0][:16]!r}")
    try:
        request_id = frames[2].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("request id is not ASCII") from None
    return Message(frames[1], request_id, decode_body(frames[3]))


def encode_event(topic: bytes, request_id: str, event: dict) -> list[bytes]:
    return [topic, request_id.encode(), encode_body(event)]


def decode_event(frames: list[bytes]) -> tuple[str, dict]:
    if len(frames) != 3:
        raise ProtocolError(f"expected 3 event frames, got {len(frames)}")
    try:
        request_id = frames[1].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("request id is not ASCII") from None
    event = decode_body(frames[2])
    if not isinstance(event.get("s"), int) or not isinstance(event.get("e"), str):
        raise ProtocolError("event lacks its sequence number or kind")
    return request_id, event


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Endpoints:
    """The dispatcher's five addresses, all derived from one base address.

    `ipc:///some/dir` puts five sockets in that directory; `tcp://host:port` uses
    port .. port+4. Workers and front ends on other hosts need only the base address.
    """
    frontend: str
    worker: str
    tokens_in: str
    tokens_out: str
    control: str

    NAMES = ("frontend", "worker", "tokens_in", "tokens_out", "control")

    @classmethod
    def from_base(cls, base: str) -> "Endpoints":
        if base.startswith("ipc://"):
            if not base[len("ipc://"):].strip("/"):
                raise ValueError(f"an ipc address names a directory: ipc:///dir, not {base!r}")
            directory = base[len("ipc://"):].rstrip("/") or "/"
            return cls(*(f"ipc://{os.path.join(directory, name)}.sock" for name in cls.NAMES))
        if base.startswith("tcp://"):
            host, sep, port = base[len("tcp://"):].rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65531:
                raise ValueError(f"tcp address needs host:port with port <= 65531: {base!r}")
            return cls(*(f"tcp://{host}:{int(port) + i}" for i in range(len(cls.NAMES))))
        raise ValueError(f"dispatcher address must start with ipc:// or tcp://: {base!r}")

    def ipc_paths(self) -> list[str]:
        return [a[len("ipc://"):] for a in (getattr(self, n) for n in self.NAMES)
                if a.startswith("ipc://")]
