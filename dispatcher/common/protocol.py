"""The wire protocol shared by front ends, the dispatcher and workers.

Sockets (all owned by the dispatcher's addresses, see `dispatcher.common.addresses`):

    front end DEALER  -> frontend ROUTER   [PROTO, cmd, request_id, body]
    worker    DEALER  -> worker ROUTER     [PROTO, cmd, request_id, body]
    worker    XPUB    -> tokens_in XSUB  \\ proxy in the dispatcher
    front end SUB     <- tokens_out XPUB /  [topic = front-end id, request_id, event]
    ops tool  REQ     -> control ROUTER    [json request] -> [json reply]

`body` and `event` are UTF-8 JSON objects (an empty frame: no body), each one of the typed
structs below (`msgspec.Struct`): `BODIES` says which struct each command's body is, and
`decode` turns the frames into a `Message` whose body is that struct, validated, once, at
the socket that receives it. A job's `generation` (what only a worker reads) crosses the
dispatcher as raw JSON it never parses (`SubmittedJob`); the worker decodes it typed
(`WorkerJob`). A front end's id is fixed-width (`FRONTEND_ID_LEN`), so subscribing to it
matches only its own messages. Every stream event carries `s` (its sequence number, from
0, per attempt) and `a` (the attempt: a request requeued after a worker died is
attempt 2).

The dispatcher answers each PING twice: STATE over the DEALER, and a `beat` event (no
request id) published into its own proxy. A front end counts the dispatcher as there only
while both arrive: a beat proves its subscription has reached the proxy, so that workers'
events for it are not dropped there. (A SUB resubscribes on its own after the dispatcher
restarts, but not at the same moment its DEALER reconnects; and a worker's XPUB keeps the
subscriptions it saw before the restart, so it cannot tell the difference.)
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Union

import msgspec

from dispatcher.common import fields as F

PROTO = b"CMPL1"
# Request ids one PING asks after (Ping.quiet)
MAX_QUIET = 256

# front end -> dispatcher
SUBMIT = b"S"       # body: the job
CANCEL = b"C"       # idempotent; a CancelUpTo body (a worker's: up to an attempt) or none
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
REFUSED = "refused"         # Disconnect.code to a worker that registered and must not serve
STOPPED = "stopped"         # Disconnect.code from a worker that stopped as asked (no loss)
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


class Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A message body: fields with their defaults left out on the wire."""


# -- routing ---------------------------------------------------------------------------
class Route(Body, frozen=True):
    """What a worker must offer to run a job, each key named as the worker names it in
    `Capabilities` (the request's `nctx` is `n_ctx` here, its `ngl` `n_gpu_layers`; the
    names are mapped once, where the request fields are declared: dispatcher.common.fields).
    The one rule that judges a fit: dispatcher.common.fit."""
    n_ctx: int | None = None            # at least this context
    n_gpu_layers: int | None = None     # 0: no offload; N: at least N layers
    compute: str | None = None          # this compute kind (cpu, cuda, hybrid, ...)
    profile: str | None = None          # SIE's machine profile
    fim: bool = False                   # fill-in-the-middle tokens or a template


class Capabilities(Body):
    """What the dispatcher's state says of a worker: what a route is judged against."""
    model: str
    n_ctx: int = 0
    compute: str = "cpu"
    n_gpu_layers: int = 0
    profile: str | None = None
    fim: bool = False


class WorkerInfo(Capabilities):
    """READY: a worker registers (again, after a reconnect) with what it is."""
    model_path: str = ""
    device: str = ""
    pid: int | None = None
    slots: int = 1
    fingerprint: str | None = None
    deterministic: bool = False
    engine: str = "llama"
    placement: dict = {}
    model_digest: str | None = None     # its model file's (models.model_file_digest)
    # tokens a second each sequence gets with 1, 2, ... slots sequences running, from the
    # step costs measured on its device at start-up (routing.expected_rate); [] unknown
    rates: list[float] = []

    def capabilities(self) -> Capabilities:
        return Capabilities(model=self.model, n_ctx=self.n_ctx, compute=self.compute,
                            n_gpu_layers=self.n_gpu_layers, profile=self.profile,
                            fim=self.fim)


# -- jobs ------------------------------------------------------------------------------
class Infill(Body, frozen=True):
    """llama.cpp's /infill context: repository chunks before the prefix, text after MID."""
    extra: list[dict] = []              # {"filename", "text"}
    middle: str = ""


# A job's sampling settings: one field per declared sampling field (dispatcher.common.
# fields.SAMPLING), None where the request left it to the default
_SAMPLING_TYPES = {float: float, int: int, bool: bool, str: str, "seed": int,
                   "logit_bias": Any, "grammar": str, "json_schema": Any,
                   "strings": list[str], "samplers": list[str]}
Sampling = msgspec.defstruct(
    "Sampling", [(knob.name, _SAMPLING_TYPES[knob.kind] | None if
                  _SAMPLING_TYPES[knob.kind] is not Any else Any, None)
                 for knob in F.SAMPLING],
    bases=(Body,), kw_only=True, frozen=True, module=__name__)
NO_SAMPLING = Sampling()                # every field at its default


class Generation(Body):
    """What only a worker reads of a job: the dispatcher forwards it unparsed."""
    max_tokens: int | None = None       # None: until the context is full
    stop: list[str] = []
    echo: bool = False
    logprobs: int | None = None
    score: bool = False                 # sum the logprobs (best_of)
    sampling: Sampling = NO_SAMPLING
    cache_prompt: bool = True
    n_indent: int | None = None
    t_max_predict_ms: float | None = None
    t_max_prompt_ms: float | None = None
    n_probs: int | None = None
    return_tokens: bool | None = None
    timings_per_token: bool = False     # llama.cpp's: each streamed chunk says its timings
    draft_max: int | None = None
    warm: bool = False                  # n_predict 0 fills the cache (llama.vim's warm-up)
    # the penalties count the prompt's last tokens too (llama-server's; OpenAI's count
    # the output alone); DRY always reads the prompt
    penalize_prompt: bool = False
    # tokenize / detokenize (op jobs)
    content: str | None = None
    add_special: bool | None = None
    with_pieces: bool | None = None
    parse_special: bool | None = None
    tokens: list[int] | None = None


G = TypeVar("G")


class Job(Body, Generic[G], kw_only=True):
    """One job: a prompt × candidate of an HTTP request, or a tokenize/detokenize op.

    The envelope is what the dispatcher reads: identity, model, route, session, queue
    deadline, admission unit (`parent`, `fanout`), adoption key and the prompt fields it
    hashes to route by cache (SHARED_FIELDS, which may be replaced by `same_as`). The
    dispatcher adds `topic`, `attempt` and `share_as`/`same_as`/`adopt` when it hands the
    job to a worker. `generation` is the payload it forwards as it came."""
    id: str
    model: str
    parent: str | None = None           # the HTTP request (None: the job is the request)
    fanout: int = 1                     # jobs of that request
    tokens: int | None = None           # the most each may generate (None: its context)
    prompt_work: int = 0                # the request's prompt tokens to prefill, about
    route: Route = Route()
    session: str | None = None          # X-Session-Id (scoped by key)
    client: str | None = None           # without one: its key and address, fingerprinted
    session_order: int = 0              # the client's order of its session's requests
    session_seq: bool = False           # ... its own counter (X-Session-Seq), not arrival
    timeout: float | None = None        # seconds it may wait in the queue
    adopt_key: str | None = None        # type-along adoption (app.jobs.adopt_key)
    tenant: str | None = None           # whose prompt cache it may reuse (None: shared)
    api_key: str | None = None          # its API key's fingerprint: fair shares per key
    op: str | None = None               # tokenize / detokenize: no queue, no slot
    # text, or token ids mixed with text as llama.cpp takes them: one level, never deeper
    # (a peer's list nested a thousand deep passed a bare `list` and ended the
    # dispatcher's loop in a json.dumps of it)
    prompt: str | list[int | str] | None = None
    suffix: str | None = None           # fill in the middle
    infill: Infill | None = None
    same_as: str | None = None          # the prompt fields are those of this job
    share_as: str | None = None         # keep this job's prompt fields under its id
    topic: str | None = None            # the owning front end (dispatcher -> worker)
    attempt: int = 1
    adopt: str | None = None            # the running job it may take over
    generation: G


SubmittedJob = Job[msgspec.Raw]         # as the dispatcher holds it
WorkerJob = Job[Generation]             # as a worker reads it


def without_prompt(job: Job, same_as: str) -> Job:
    """The job naming `same_as`'s prompt fields instead of carrying them."""
    return msgspec.structs.replace(job, prompt=None, suffix=None, infill=None,
                                   same_as=same_as)


def with_prompt(job: Job, fields: dict) -> Job:
    """The job carrying the prompt fields (`prompt_fields` of the job it named)."""
    return msgspec.structs.replace(job, same_as=None, **fields)


def prompt_fields(job: Job) -> dict:
    return {name: getattr(job, name) for name in SHARED_FIELDS}


# -- control bodies --------------------------------------------------------------------
class WireError(Body, frozen=True):
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

    def event(self, seq: int = 0, attempt: int = 1) -> "Error":
        return Error(seq=seq, attempt=attempt, status=self.status, type=self.type,
                     code=self.code, message=self.message, param=self.param,
                     retry_after=self.retry_after)


class Attempt(Body):
    """STARTED and FIRST: which attempt of the job it is about."""
    attempt: int = 1


class CancelUpTo(Body):
    """CANCEL (to a worker): the job's attempts up to `attempt` (None: any). A worker's
    old connection's attempts are cancelled so, not the later one the dispatcher may
    hand the same worker next (its IO thread may give that one to the preparing thread
    before its generation loop reads this)."""
    attempt: int | None = None


class Finished(Body):
    """FINISHED: the worker is done with this attempt; its last event's number."""
    attempt: int = 1
    last_seq: int | None = None


class Usage(msgspec.Struct, kw_only=True):
    """Token counts (zeros are said, not left out)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Done(Body):
    """DONE: a worker is through with a job, one way or another."""
    attempt: int = 1
    last_seq: int = -1
    finish_reason: str | None = None
    usage: Usage | None = None
    cached_tokens: int = 0
    seconds: float | None = None
    error: str | None = None            # its error event's code
    cancelled: bool = False
    adopted_by: str | None = None       # cancelled: another job took its generation over
    released: bool = False              # handed back unstarted (the worker is stopping)
    unshared: bool = False              # named prompt fields the worker no longer had


class Disconnect(Body):
    reason: str | None = None
    code: str | None = None             # worker_stuck: the watchdog gave up; to a worker,
                                        # REFUSED: the dispatcher will not take it


class StepTotals(msgspec.Struct, kw_only=True):
    """A worker's decode steps since it started, for the step profile (`/metrics`,
    `bench --profile`): where a step's time goes. Counters only; a reader takes the
    difference over a period."""
    steps: int = 0
    token_rows: int = 0                 # one per generating sequence a step
    draft_rows: int = 0                 # speculative tokens verified
    prompt_rows: int = 0                # prompt tokens decoded
    filler_rows: int = 0                # rows of free sequences joining runs (bridged)
    batches: int = 0                    # llama.cpp's sub-batches: runs of consecutive
                                        # sequence ids (a KV stream per sequence)
    sat_out: int = 0                    # sequences that sat a step out (first line first)
    accepted: int = 0                   # draft tokens confirmed
    sources: dict[str, list[int]] = {}  # draft source -> [tokens drafted, confirmed]
    plan_seconds: float = 0.0           # choosing rows and drafts, filling the batch
    decode_seconds: float = 0.0         # llama_decode, to the device's end
    sample_seconds: float = 0.0         # sampling and verifying every row
    draft_seconds: float = 0.0          # the draft model's decodes (--draft-model)


class WorkerBeat(Body):
    """A worker's HEARTBEAT (the dispatcher's carries no body)."""
    steps: StepTotals | None = None
    leaving: bool = False               # stopping: it takes no new job (its own drain)


class Ping(Body):
    open: int = 0                       # requests the front end has open
    pid: int | None = None
    served: int = 0
    metrics: dict | None = None         # dispatcher.common.latency increments
    # accepted requests open there that have heard nothing for a while (at most
    # MAX_QUIET): the STATE answering says which of them the dispatcher no longer holds
    quiet: list[str] = []


class ModelState(Body):
    ready: int = 0
    n_ctx: int = 0
    slots: int = 0
    fim: bool = False
    created: int = 0


class State(Body):
    """STATE: the dispatcher's answer to a PING (and its broadcast on changes)."""
    epoch: str | None = None            # this run of the dispatcher
    workers_ready: int = 0
    workers_drained: int = 0            # of those, the ones an operator drained (`drain`)
    models: dict[str, ModelState] = {}
    default_model: str | None = None    # a request without a model gets this one
    aliases: dict[str, str] = {}
    queued: int = 0
    expected_workers: int = 0
    coming_workers: int = 0             # of those, the ones that are or will be ready
    draining: bool = False
    workers: list[Capabilities] = []
    unheld: list[str] = []              # of the PING's `quiet`, those not queued nor run


# -- stream events ---------------------------------------------------------------------
class Event(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="e"):
    """One event of a job's stream, tagged by kind (`e`), numbered per attempt (-1: not
    numbered yet; the worker numbers each as it publishes it, and an event that arrives
    without its number is refused)."""
    seq: int = msgspec.field(default=-1, name="s")
    attempt: int = msgspec.field(default=1, name="a")


class Start(Event, tag=EV_START):
    """Prompt tokenized and admitted into a slot (or its generation adopted)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    fingerprint: str | None = None
    worker: str | None = None
    device: str | None = None
    adopted: bool = False


class Text(Event, tag=EV_TEXT, kw_only=True):
    text: str
    logprobs: dict | None = None        # OpenAI's legacy shape, for this text
    ids: list[int] | None = None        # llama.cpp's `tokens`
    probs: list | None = None           # llama.cpp's completion_probabilities
    generated: int = 0                  # tokens generated so far (llama.cpp's partials'
                                        # tokens_predicted)
    timings: dict | None = None         # prompt_ms, predicted_ms so far (timings_per_token)


class End(Event, tag=EV_END):
    finish_reason: str | None = None
    usage: Usage | None = None
    stop_type: str | None = None        # llama.cpp's: eos, word, limit
    stopping_word: str | None = None
    timings: dict | None = None         # prompt_ms, predicted_ms
    dropped_chunks: int = 0             # input_extra left out (to fit, t_max_prompt_ms)
    truncated: bool = False             # an /infill's prefix or suffix cut to fit
    draft: dict | None = None           # proposed, accepted
    logprobs: dict | None = None
    ids: list[int] | None = None        # return_tokens: ids no text went out with (a stop
                                        # string's), llama-server counts them
    score: float | None = None          # mean logprob (best_of)
    result: Any = None                  # an op's answer


class Error(Event, tag=EV_ERROR, kw_only=True):
    status: int
    type: str
    code: str
    message: str
    param: str | None = None
    retry_after: int | None = None


class Beat(Event, tag=EV_BEAT):
    """The dispatcher's answer to a PING over the token stream (request id "")."""
    seq: int = msgspec.field(default=0, name="s")
    epoch: str | None = None


AnyEvent = Union[Start, Text, End, Error, Beat]
ENDS = (End, Error)                     # the last event of a stream

# Which struct each command's body is (None: no body). A command is read on one side.
BODIES: dict[bytes, Any] = {
    SUBMIT: SubmittedJob, CANCEL: CancelUpTo, PING: Ping, METRICS: dict,
    ACCEPTED: None, REJECTED: WireError, FAILED: WireError, FINISHED: Finished,
    STATE: State, READY: WorkerInfo, HEARTBEAT: WorkerBeat, STARTED: Attempt, FIRST: Attempt,
    DONE: Done, DISCONNECT: Disconnect, REQUEST: WorkerJob,
}

_encoder = msgspec.json.Encoder()
_decoders = {cmd: msgspec.json.Decoder(kind) for cmd, kind in BODIES.items()
             if kind is not None}
_event_decoder = msgspec.json.Decoder(AnyEvent)


@dataclass(frozen=True)
class Message:
    cmd: bytes
    request_id: str
    body: Any = None                    # the struct BODIES names (None: no body)


def new_frontend_id() -> bytes:
    return b"fe-" + secrets.token_hex(6).encode()


_FRONTEND_ID = re.compile(rb"fe-[0-9a-f]{12}")


def is_frontend_id(identity: bytes) -> bool:
    """Whether a peer's identity is a front end's (`new_frontend_id`): a socket that set
    none has libzmq's five random bytes, which name no topic and are not text."""
    return _FRONTEND_ID.fullmatch(identity) is not None


def new_request_id() -> str:
    return "cmpl-" + secrets.token_hex(12)


def encode_body(body: Any) -> bytes:
    return _encoder.encode(body) if body is not None else b""


# msgspec raises RecursionError, not a DecodeError, for JSON nested past ~1,000 levels
# (even inside a field it skips or keeps raw): a peer's message that deep is malformed
TOO_DEEP = "body is nested too deeply"


def decode_body(cmd: bytes, frame: bytes) -> Any:
    decoder = _decoders.get(cmd)
    if decoder is None:
        return None                     # (a body where none belongs is ignored)
    if not frame:
        frame = b"{}"
    try:
        return decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{command_name(cmd)} body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"body is not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(TOO_DEEP) from None


def encode(cmd: bytes, request_id: str = "", body: Any = None) -> list[bytes]:
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
    return Message(frames[1], request_id, decode_body(frames[1], frames[3]))


def malformed_request(frames: list[bytes], cmd: bytes) -> str | None:
    """The request id of a `cmd` message whose body did not decode (None: not such a
    message), so that it can be answered instead of dropped."""
    if len(frames) == 4 and frames[0] == PROTO and frames[1] == cmd and frames[2].isascii():
        return frames[2].decode() or None
    return None


def encode_event(topic: bytes, request_id: str, event: Event) -> list[bytes]:
    return [topic, request_id.encode(), _encoder.encode(event)]


def decode_event(frames: list[bytes]) -> tuple[str, AnyEvent]:
    if len(frames) != 3:
        raise ProtocolError(f"expected 3 event frames, got {len(frames)}")
    try:
        request_id = frames[1].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("request id is not ASCII") from None
    try:
        event = _event_decoder.decode(frames[2])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"bad event: {exc}") from None
    except RecursionError:
        raise ProtocolError(TOO_DEEP) from None
    if event.seq < 0:
        raise ProtocolError("event lacks its sequence number")
    return request_id, event


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def to_dict(struct) -> dict:
    """A struct as plain JSON values (for status output, logs and tests)."""
    return msgspec.to_builtins(struct)
