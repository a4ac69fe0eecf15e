"""What a request must be before anything is queued: a valid body (the marshmallow
schemas; strict JSON and Unicode text are `app.bodies`'), a served model, a route some
worker can meet, sizes within the limits. Shared by every route that takes a body."""
from __future__ import annotations

import hashlib
import threading
import time

import msgspec
from flask import Response, current_app, has_request_context, request
from marshmallow import Schema, ValidationError

from app import bodies
from app.auth import api_key_fingerprint, client_address
from app.bodies import BigBodySlots, clipped, off_loop
from app.errors import InvalidRequest, NotFound, PayloadTooLarge, ServiceUnavailable
from app.schemas import CompletionRequestSchema, first_error, normalize
from dispatcher.common import grammar as gbnf, protocol as P
from dispatcher.common.fit import explain_unfit, fits
from dispatcher.common.schemagrammar import SchemaBusy, SchemaGrammars, SchemaRefused
from dispatcher.common.tenantlru import TenantLRU

_schema = CompletionRequestSchema()
_schema_grammars = SchemaGrammars(off_loop=lambda function, *args: off_loop(function, *args))
PROFILE_HEADER = "X-SIE-MACHINE-PROFILE"
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds the request may wait in the queue
SESSION_HEADER = "X-Session-Id"     # a new request of a session supersedes the older ones



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
        BigBodySlots.give_back()
        bodies.body_bytes.give_back()   # (the raw body is gone: its bytes are free)
    scope = tenant_of(request) if has_request_context() else None
    who = api_key_fingerprint(request) if has_request_context() else None
    if isinstance(data, dict) and data.get("grammar"):
        refusal = checked_grammar(data["grammar"], scope, who)
        if refusal is not None:
            raise InvalidRequest(f"Invalid value for 'grammar': The grammar cannot be used: "
                                 f"{refusal}.", param="grammar", code="invalid_value")
    if isinstance(data, dict) and data.get("json_schema") is not None:
        # made into a grammar here, within its budget: a worker only ever gets grammars
        try:
            data["grammar"] = _schema_grammars.grammar(data["json_schema"], scope=scope,
                                                       who=who)
        except SchemaRefused as exc:        # (named as it was sent)
            asked = "response_format" if isinstance(body, dict) and isinstance(
                body.get("response_format"), dict) and body["response_format"].get(
                "type") in ("json_object", "json_schema") else "json_schema"
            raise InvalidRequest(str(exc), param=asked, code="invalid_value") from None
        except SchemaBusy as exc:
            raise ServiceUnavailable(str(exc), code="server_busy") from None
        data["json_schema"] = None
    return data


# Grammars checked lately, by tenant and digest: what was wrong with each (None:
# nothing). A client sends the same grammar with every request, and a check takes up to
# ~0.8 s of a pool thread (32,768 rules): each was checked again. Per tenant, as the
# schemas' grammars are: another key's grammar answered at once would tell it was sent.
GRAMMARS_KEPT = 256
_checked = TenantLRU(GRAMMARS_KEPT)     # scope -> digest -> the refusal (None: none)
# Checks not remembered run GRAMMAR_CHECKS at a time in a front end, one at a time for
# each tenant, waiting up to CHECK_WAIT s for their turn (then 503 server_busy): each
# holds a thread of the pool and the GIL for up to ~0.8 s, and a key sending new large
# grammars at once took every thread, so that every request of the front end waited to
# be validated and its streams stalled.
GRAMMAR_CHECKS = 2
CHECK_WAIT = 15.0
_check_slots: list = []         # (made at first use: after gevent has patched threading)
_own_checks: dict[str, threading.BoundedSemaphore] = {}   # by key fingerprint
_MISSING = object()


def _grammar_key(grammar: str) -> bytes:
    return hashlib.blake2b(grammar.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def checked_grammar(grammar: str, scope: str | None, who: str | None = None) -> str | None:
    """`grammar_refusal` on a thread of the pool, in its turn (GRAMMAR_CHECKS, one at a
    time for the API key `who`, whatever the cache's scope); at once where it is
    remembered within `scope`."""
    known = _checked.get(scope, _grammar_key(grammar), _MISSING)
    if known is not _MISSING:
        return known
    busy = ServiceUnavailable(f"Every grammar check of this front end was busy for "
                              f"{CHECK_WAIT:g} s: try again.", code="server_busy")
    deadline = time.monotonic() + CHECK_WAIT
    if not _check_slots:
        _check_slots.append(threading.BoundedSemaphore(GRAMMAR_CHECKS))
    own = _own_checks.setdefault(who, threading.BoundedSemaphore(1)) \
        if who is not None else None
    if own is not None and not own.acquire(timeout=CHECK_WAIT):
        raise busy
    try:
        if not _check_slots[0].acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise busy
        try:
            return off_loop(grammar_refusal, grammar, scope)
        finally:
            _check_slots[0].release()
    finally:
        if own is not None:
            own.release()


def grammar_refusal(grammar: str, scope: str | None = None) -> str | None:
    """What makes `grammar` unusable (`gbnf.check`, as llama.cpp parses it, bounded),
    None if nothing; remembered for the last GRAMMARS_KEPT grammars within `scope` (the
    request's tenant; validation runs on several threads: a lost race only checks one
    twice)."""
    key = _grammar_key(grammar)
    known = _checked.get(scope, key, _MISSING)
    if known is not _MISSING:
        return known
    try:
        gbnf.check(grammar)
        refusal = None
    except gbnf.GrammarError as exc:
        refusal = str(exc)
    _checked.put(scope, key, refusal)
    return refusal


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


def tenant_of(req) -> str | None:
    """Whose prompt cache the request may reuse and fill: its key's (--cache-scope key,
    the default when keys are configured), or everyone's (None: shared)."""
    return api_key_fingerprint(req) if current_app.config.get("CACHE_SCOPE") == "key" else None


def profile_of(req) -> str | None:
    """The X-SIE-MACHINE-PROFILE, as UTF-8 (WSGI hands a header over as Latin-1: `é`
    came as `Ã©`, a name no profile had), at most MAX_SESSION_ID characters (400 above:
    a 6 KB header was repeated whole in the 400 naming the profiles)."""
    profile = req.headers.get(PROFILE_HEADER) or None
    if profile is None:
        return None
    try:
        profile = profile.encode("latin-1").decode("utf-8")
    except UnicodeError:
        pass                            # (not UTF-8 underneath: as it came)
    return _bounded(PROFILE_HEADER, profile)


def _bounded(header: str, value: str) -> str:
    """`value`, or a 400 header_too_long past MAX_SESSION_ID characters."""
    if len(value) > MAX_SESSION_ID:
        raise InvalidRequest(f"{header} has {len(value)} characters; at most "
                             f"{MAX_SESSION_ID}", param=header, code="header_too_long")
    return value


def session_of(req) -> str | None:
    """The X-Session-Id, scoped by API key: with keys configured, one key's clients can
    never supersede (cancel) another key's requests by sending the same value. Bounded:
    an id longer than MAX_SESSION_ID characters is a 400."""
    session = req.headers.get(SESSION_HEADER) or None
    if session is None:
        return None
    _bounded(SESSION_HEADER, session)
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
    address = client_address(req)
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
# Echoed prompt characters one answer may hold over all its choices (a token id counting
# one): each choice's job sends the whole prompt back, so `echo` with `n` 128 of an 8 MB
# prompt (one prefill: the others copy it) was a gigabyte through ZeroMQ and the front
# end's memory, three times over while the answer was joined and encoded
MAX_ECHO_CHARS = 1 << 25
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
    choices = max(req.get("n") or 1, req.get("best_of") or 1)
    if req.get("echo") and choices > 1:
        prompts = req["prompt"]
        size = off_loop(_prompt_chars, prompts) if any(isinstance(p, list) for p in prompts) \
            else sum(map(len, prompts))
        if choices * size > MAX_ECHO_CHARS:
            raise InvalidRequest(
                f"this answer would echo its prompt {choices} times, {choices * size:,} "
                f"characters (a token id counting one); at most {MAX_ECHO_CHARS:,} are "
                "sent: ask for fewer choices (n, best_of), or no echo",
                param="n" if (req.get("n") or 1) >= (req.get("best_of") or 1) else "best_of",
                code="answer_too_large")


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
