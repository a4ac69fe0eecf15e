"""What a request must be before anything is queued: strict JSON, Unicode text, a valid
body (the marshmallow schemas), a served model, a route some worker can meet, sizes
within the limits. Shared by every route that takes a body."""
from __future__ import annotations

import hashlib
import json
import re
import socket

import gevent
import gevent.monkey

import msgspec
from flask import Response, current_app, has_request_context, request
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import ClientDisconnected
from marshmallow import Schema, ValidationError

from app.errors import (ClientClosedRequest, InvalidRequest, NotFound, PayloadTooLarge,
                        RequestTimeout, ServiceUnavailable, UnsupportedMediaType)
from app.schemas import CompletionRequestSchema, first_error, normalize
from dispatcher.common import protocol as P
from dispatcher.common.fit import explain_unfit, fits
from dispatcher.common.schemagrammar import SchemaBusy, SchemaGrammars, SchemaRefused

_schema = CompletionRequestSchema()
_schema_grammars = SchemaGrammars(off_loop=lambda function, *args: off_loop(function, *args))
PROFILE_HEADER = "X-SIE-MACHINE-PROFILE"
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds the request may wait in the queue
SESSION_HEADER = "X-Session-Id"     # a new request of a session supersedes the older ones


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(any_content_type: bool = False) -> object:
    """The body as strict JSON (no NaN/Infinity), with a JSON content type or none at all
    (any content type for llama.cpp's native endpoints, which do not look at it)."""
    mimetype = request.mimetype
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json") \
            and not any_content_type:
        raise UnsupportedMediaType(f"Content-Type must be application/json, not {mimetype}")
    encoding = (request.headers.get("Content-Encoding") or "").strip().lower() or "identity"
    if encoding != "identity":
        raise UnsupportedMediaType(f"Content-Encoding {encoding[:40]!r} is not accepted: "
                                   "send the body uncompressed")
    raw = read_body()
    if len(raw) > BIG_BODY:
        big_body_slots.take()       # (given back once validated, or as the request ends)
    return off_loop(decode_json_body, raw)


# Bodies over BIG_BODY bytes are decoded and validated a few at a time per front end:
# decoded, a body is ten times its size or more (8 MB of two-letter strings: 80 MB), and
# each decoded one waited for the pool's threads behind every other's decode before
# validation let it go (a hundred at once: 8 GB and more). The C decoder holds the GIL: more at
# once would not be sooner.
BIG_BODY = 1 << 20
BIG_BODIES_AT_ONCE = 2


class BigBodySlots:
    """The front end's slots for big bodies, taken by `parse_json_body` and given back by
    `validate` (or, where a request ends before it, the app's teardown)."""

    def __init__(self, at_once: int = BIG_BODIES_AT_ONCE) -> None:
        self.at_once = at_once
        self.slots = None                   # (made in the serving process, after forks)

    def take(self) -> None:
        if self.slots is None:
            import threading                # (gevent's, where the front end patched it)
            self.slots = threading.BoundedSemaphore(self.at_once)
        self.slots.acquire()
        request.environ["completions.big_body"] = self.slots

    @staticmethod
    def give_back() -> None:
        if not has_request_context():
            return                          # (validate called on its own)
        taken = request.environ.pop("completions.big_body", None)
        if taken is not None:
            taken.release()


big_body_slots = BigBodySlots()


def read_body() -> bytes:
    """The whole body within --body-timeout: a client trickling it a byte at a time
    must not hold a connection (and its greenlet) for ever."""
    seconds = float(current_app.config.get("BODY_TIMEOUT") or 0)
    try:
        with gevent.Timeout(seconds or None, False):
            return request.get_data(cache=False)
    except (ClientDisconnected, NoMoreData, ConnectionError):
        # the client left before its body was whole (werkzeug's reader, bounding the body
        # by --max-body, says so of any OSError: a generic 400 with no code)
        _stop_reading()
        raise ClientClosedRequest("the client closed the connection before the body "
                                  "arrived") from None
    except (ParseException, OSError) as exc:
        # a chunked body whose framing is wrong (a size that is not hex, data past its
        # size, no CRLF): gunicorn's reader raises, and it was a 500
        _stop_reading()
        why = clipped(str(exc) or type(exc).__name__)
        raise InvalidRequest(f"the body could not be read: {why}",
                             code="invalid_body") from None
    _stop_reading()
    raise RequestTimeout(f"the body did not arrive within {seconds:g} s")


def _stop_reading() -> None:
    """The rest of the body is never read: end the connection (what is left of it could
    not be parsed as a next request)."""
    sock = request.environ.get("gunicorn.socket")
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass


# Arrays and objects one body may hold, counted in the raw bytes before anything walks
# them (an 8 MB body of empty lists took 9 s to walk): prompts, stop strings, infill
# chunks, logit biases and JSON schemas need far fewer.
MAX_JSON_CONTAINERS = 100_000
# A string, or what is left of the body after a quote never closed: possessive and
# always matching, so each quote is read once (where a string had to end with a quote,
# an unclosed one over 70,000 escaped quotes was scanned again from each of them,
# quadratic: a 300 KB body held a front end's CPU past its 30 s heartbeat)
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.S)


def check_shape(raw: bytes) -> None:
    """Refuse, at C speed, a body whose parse and checks would cost more than any
    request needs."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_JSON_CONTAINERS:        # brackets inside strings do not count
        outside = _JSON_STRING.sub(b'""', raw)
        containers = outside.count(b"[") + outside.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise InvalidRequest(f"The request body has over {MAX_JSON_CONTAINERS} arrays and "
                             "objects.", code="invalid_json")


class _Raised:
    """An exception caught on a pool thread, to be raised again on the loop."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _caught(function, args):
    try:
        return function(*args)
    except Exception as exc:      # (gevent's hub would print it, request text and all)
        return _Raised(exc)


def off_loop(function, *args):
    """`function(*args)` on a thread of gevent's pool when this process runs under gevent
    (the front ends): parsing and checking a large body takes the CPU for a while, and
    the loop's heartbeats and other requests must go on meanwhile. Exceptions are
    caught on the pool's thread and raised here: left to the pool, gevent's hub prints
    each with its traceback to stderr, and their messages quote the request."""
    if gevent.monkey.is_module_patched("socket"):
        result = gevent.get_hub().threadpool.apply(_caught, (function, args))
        if isinstance(result, _Raised):
            raise result.exc
        return result
    return function(*args)


def decode_json_body(raw: bytes) -> object:
    check_shape(raw)
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise InvalidRequest("The request body is not valid UTF-8.", code="invalid_json")
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply.", code="invalid_json")
    except ValueError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json")
    check_encodable(body)
    return body


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unencodable_field(body: object) -> tuple[str, str] | None:
    """(top-level field, path) of the first string, object keys included, that is not
    Unicode text: a lone UTF-16 surrogate (`"\\ud800"`) is valid JSON but cannot be
    encoded as UTF-8, so it must never reach a tokenizer or a grammar parser. Iterative
    (any nesting json accepts), and a path is only built for the string it reports."""
    stack: list[tuple[object, tuple | None]] = [(body, None)]     # (value, (key, parent))
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return _report(where)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):
                    return _report((key, where))
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (key, where)))
        elif isinstance(value, list):
            stack.extend((item, (i, where)) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))
    return None


def _report(where: tuple | None) -> tuple[str, str]:
    path: list = []
    while where is not None:
        key, where = where
        path.append(key)
    path.reverse()
    return _path_text(path[:1]), _path_text(path)


def _path_text(path: list) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return text.encode("utf-8", "backslashreplace").decode("utf-8") or "_body"


def check_encodable(body: object) -> None:
    found = unencodable_field(body)
    if found is not None:
        param, where = found
        raise InvalidRequest(f"Invalid value for '{where}': the text contains a lone UTF-16 "
                             "surrogate (\\ud800-\\udfff), which is not a Unicode "
                             "character and cannot be encoded as UTF-8.", param=param,
                             code="invalid_unicode")


MAX_PARAM = 128          # characters of a name the client chose quoted back to it


def clipped(name: str) -> str:
    """A name the client chose (a field's path, a model), as an error quotes it."""
    return name if len(name) <= MAX_PARAM else name[:MAX_PARAM] + "…"


def json_answer(build, *args, headers: dict | None = None) -> Response:
    """A 200 whose JSON body is `build(*args)`, assembled and encoded off the loop: a
    large answer (a /tokenize of a million characters with its pieces, n_probs 100 over
    every token of several choices) took a front end's loop for seconds in Python's json,
    and every stream of that process stalled meanwhile."""
    data = off_loop(lambda: msgspec.json.encode(build(*args)))
    return Response(data, status=200, mimetype="application/json", headers=headers)


def validate(body: object, schema: Schema = _schema) -> dict:
    try:
        data = off_loop(_validate, body, schema)
    finally:
        big_body_slots.give_back()
    if isinstance(data, dict) and data.get("json_schema") is not None:
        # made into a grammar here, within its budget: a worker only ever gets grammars
        try:
            data["grammar"] = _schema_grammars.grammar(data["json_schema"])
        except SchemaRefused as exc:
            raise InvalidRequest(str(exc), param="json_schema", code="invalid_value") \
                from None
        except SchemaBusy as exc:
            raise ServiceUnavailable(str(exc), code="server_busy") from None
        data["json_schema"] = None
    return data


def _validate(body: object, schema: Schema) -> dict:
    try:
        data = schema.load(body)
    except ValidationError as exc:
        param, message = first_error(exc.messages)
        if param is not None:
            param = clipped(param)
        if message == "Unknown field.":
            text = f"Unrecognized request argument supplied: {param}"
        else:
            text = f"Invalid value for '{param}': {message}" if param else message
        raise InvalidRequest(text, param=param, code="invalid_value") from None
    return normalize(schema, data, body) if isinstance(schema, CompletionRequestSchema) \
        else data


def resolve_model(requested: str | None, state: P.State | None, any_name: bool = False) -> str:
    """The model id to serve, or 404 (unknown) / 503 (known, nothing ready / no dispatcher).

    No `model`, or an empty one (llama.vim always sends its `model_fim` setting, "" by
    default), means the served model: the only one, or the first of the config. With
    `any_name` (llama.cpp's native routes, where llama-server ignores `model`), or on every
    route with --any-model-name, a name that is not served means the same when one model
    is served."""
    if state is None:
        raise ServiceUnavailable("the dispatcher is unreachable")
    models = state.models
    if not models:
        raise ServiceUnavailable("no worker is ready yet", code="no_worker_ready")
    default = state.default_model
    if default not in models:
        default = next(iter(models))        # the config's order (dispatcher.core)
    if requested is None or not requested.strip():
        requested = default
    requested = state.aliases.get(requested, requested)    # --model-alias
    if requested not in models:
        if (any_name or current_app.config.get("ANY_MODEL_NAME")) and len(models) == 1:
            requested = default
        else:
            raise NotFound(f"The model '{clipped(requested)}' does not exist. Served: "
                           + ", ".join(sorted(models)), param="model",
                           code="model_not_found")
    if not models[requested].ready:
        raise ServiceUnavailable(f"no worker for '{requested}' is ready yet",
                                 code="no_worker_ready")
    return requested


def check_route(job: P.WorkerJob, state: P.State) -> None:
    """400 naming what is available when no worker could ever run the job (the dispatcher
    checks again; this answers before anything is queued). While a worker that may meet
    it is still starting, the dispatcher answers (a 503 to retry); one that gave up (it
    cannot load its model) is not waited for."""
    workers = state.workers
    if any(fits(job.model, job.route, w) for w in workers) \
            or len(workers) < state.coming_workers:
        return
    param, code, message = explain_unfit(job.model, job.route, workers)
    raise InvalidRequest(message, param=param, code=code)


def header_number(name: str, parse, valid, must: str):
    """The header's value parsed by `parse` (None if absent), or 400 saying it `must`..."""
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or value != value or not valid(value):
        raise InvalidRequest(f"{name} must be {must}", param=name, code="invalid_value")
    return value


def queue_timeout() -> float | None:
    return header_number(TIMEOUT_HEADER, float, lambda v: 0 < v <= 86400,
                         "a number of seconds, more than 0 and at most 86400")


MAX_SESSION_ID = 128               # characters of an X-Session-Id (400 above)


def api_key_fingerprint(req) -> str | None:
    """The API key the request was admitted with, as a fingerprint (None: no keys are
    configured): what sessions and, with --cache-scope key, the prompt cache are
    partitioned by."""
    if not current_app.config.get("API_KEYS_ENABLED"):
        return None
    _, _, token = req.headers.get("Authorization", "").partition(" ")
    return hashlib.sha256(token.strip().encode()).hexdigest()[:16]


def tenant_of(req) -> str | None:
    """Whose prompt cache the request may reuse and fill: its key's (--cache-scope key,
    the default when keys are configured), or everyone's (None: shared)."""
    return api_key_fingerprint(req) if current_app.config.get("CACHE_SCOPE") == "key" else None


def session_of(req) -> str | None:
    """The X-Session-Id, scoped by API key: with keys configured, one key's clients can
    never supersede (cancel) another key's requests by sending the same value. Bounded:
    an id longer than MAX_SESSION_ID characters is a 400."""
    session = req.headers.get(SESSION_HEADER) or None
    if session is not None and len(session) > MAX_SESSION_ID:
        raise InvalidRequest(f"{SESSION_HEADER} has {len(session)} characters; at most "
                             f"{MAX_SESSION_ID}", param=SESSION_HEADER,
                             code="header_too_long")
    if session is None:
        return None
    # (never a name the dispatcher gives an inferred session, `~client:n`: a client
    # cannot join another address's inferred session by forging its id)
    return f"{api_key_fingerprint(req) or 'h'}:{session}"


def client_of(req) -> str | None:
    """Who sent a request that names no session, for the sessions the dispatcher infers
    (admission.InferredSessions): its API key and address, fingerprinted. Behind a proxy
    on this host (nginx) the address is the last one X-Forwarded-For names, the one the
    proxy saw; a direct client's own X-Forwarded-For is not believed."""
    if req.headers.get(SESSION_HEADER):
        return None
    address = req.remote_addr or ""
    forwarded = req.headers.get("X-Forwarded-For")
    if forwarded and address in ("127.0.0.1", "::1"):
        address = forwarded.rsplit(",", 1)[-1].strip()[:64]
    return hashlib.sha256(f"{api_key_fingerprint(req) or ''}|{address}".encode()).hexdigest()[:16]


SEQUENCE_HEADER = "X-Session-Seq"   # the client's own order of its session's requests


def session_order(arrived_ns: int) -> int:
    """The order of this request among its session's: the client's X-Session-Seq if it
    sends one (a session should use it always or never), else the arrival time here."""
    raw = request.headers.get(SEQUENCE_HEADER)
    if raw is not None and len(raw) > 20:             # (2 ** 63 has 19 digits)
        raise InvalidRequest(f"{SEQUENCE_HEADER} must be an integer from 0 below 2**63",
                             param=SEQUENCE_HEADER, code="header_too_long")
    value = header_number(SEQUENCE_HEADER, int, lambda v: 0 <= v < 2 ** 63,
                          "an integer from 0")
    return arrived_ns if value is None else value


def _prompt_chars(prompts: list) -> int:
    return sum(len(p) if isinstance(p, str) else sum(
        len(x) if isinstance(x, str) else 1 for x in p) for p in prompts)


# Token probabilities one answer may hold (a token with its top entries counting 1 + k):
# a front end assembles a whole answer in memory, and `n` 128 × a whole context × 101
# entries of n_probs was ~50 million, gigabytes in one process and every stream on it gone
MAX_ANSWER_ENTRIES = 1 << 19
UNKNOWN_CONTEXT = 4096      # a model's context before any of its workers has said it


def _unlimited(req: dict) -> bool:
    """Whether the request writes until the context is full: no `max_tokens`, or a
    negative one (llama.cpp's `n_predict: -1`, taken on every route)."""
    return req.get("max_tokens") is None or req["max_tokens"] < 0


def answer_entries(req: dict, n_ctx: int) -> int:
    """The most token probabilities the answer can hold: choices × (tokens written +
    prompt tokens echoed) × (1 + top entries); a stream holds none but sends an echoed
    prompt's in one chunk, so there the largest of those. 0 without probabilities."""
    k = max(req.get("logprobs") or 0, req.get("n_probs") or 0)
    if req.get("logprobs") is None and not k:
        return 0
    n_ctx = n_ctx or UNKNOWN_CONTEXT
    written = n_ctx if _unlimited(req) else min(req["max_tokens"], n_ctx)
    choices = max(req.get("n") or 1, req.get("best_of") or 1)
    echo = bool(req.get("echo")) and req.get("logprobs") is not None
    per_prompt = [min(_prompt_chars([p]), n_ctx) if echo else 0 for p in req["prompt"]]
    if req.get("stream"):
        return max(per_prompt) * (1 + k)
    return sum(choices * (written + echoed) for echoed in per_prompt) * (1 + k)


def check_token_prompts(req: dict, n_ctx: int) -> None:
    """400 before anything runs for a prompt of token ids that cannot fit the model's
    context (`n_ctx`: the largest of its workers', 0 if not known yet): its ids are its
    tokens (text in the list only adds to them). A worker would build and count them for
    each of the request's choices."""
    for prompt in req["prompt"] if n_ctx else ():
        if isinstance(prompt, list):
            ids = off_loop(_ids_in, prompt) if len(prompt) > 4096 else _ids_in(prompt)
            if ids >= n_ctx:
                raise InvalidRequest(
                    f"This model's maximum context length is {n_ctx} tokens, but the "
                    f"prompt has at least {ids} tokens.", param="prompt",
                    code="context_length_exceeded")


def _ids_in(prompt: list) -> int:
    return sum(1 for item in prompt if not isinstance(item, str))


def check_answer_size(req: dict, n_ctx: int, native: bool = False) -> None:
    """400 before anything runs where the answer's probabilities would be over
    MAX_ANSWER_ENTRIES (`n_ctx`: the model's context, 0 if not known yet), naming the
    field as the route calls it (`native`: llama.cpp's `n_predict`, `n_probs`)."""
    entries = answer_entries(req, n_ctx)
    if entries > MAX_ANSWER_ENTRIES:
        tokens = "n_predict" if native else "max_tokens"
        top = "n_probs" if req.get("n_probs") else "logprobs"      # (the one it sent)
        raise InvalidRequest(
            f"this answer could hold {entries:,} token probabilities (choices × tokens × "
            f"(1 + top entries)); at most {MAX_ANSWER_ENTRIES:,} are sent: ask for fewer "
            f"tokens ({tokens}), choices or top entries ({top})"
            + ("" if req.get("stream") else ", or stream it"),
            param=tokens if _unlimited(req) else top, code="answer_too_large")


def check_prompt_size(req: dict) -> None:
    """The prompts' characters, a token id counting one, against --max-prompt-chars
    (an 8 MB body holds four million ids: they are counted off the loop)."""
    prompts = req["prompt"]
    size = off_loop(_prompt_chars, prompts) if any(isinstance(p, list) for p in prompts) \
        else sum(map(len, prompts))
    size += len(req.get("suffix") or "")
    limit = int(current_app.config["MAX_PROMPT_CHARS"])
    if size > limit:
        raise PayloadTooLarge(f"the prompt has {size} characters; this server takes at "
                              f"most {limit}", param="prompt", code="prompt_too_large")
