"""POST /v1/completions: validate, hand the jobs to the dispatcher, relay the events."""
from __future__ import annotations

import hashlib
import itertools
import json
import time

from flask import Blueprint, Response, current_app, jsonify, request, stream_with_context
from marshmallow import Schema, ValidationError

from app import sse
from app.client import ClientGone, get_client, watch_disconnect
from app.errors import (InvalidRequest, NotFound, PayloadTooLarge, ServiceUnavailable,
                        UnsupportedMediaType, from_wire)
from app.fanout import Fanout
from app.jobs import plan_jobs
from app.schemas import CompletionRequestSchema, first_error, normalize
from dispatcher import protocol as P
from dispatcher.routing import explain_unfit, fits

bp = Blueprint("completions", __name__)
_schema = CompletionRequestSchema()
PROFILE_HEADER = "X-SIE-MACHINE-PROFILE"
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds the request may wait in the queue
SESSION_HEADER = "X-Session-Id"     # a new request of a session supersedes the older ones


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body() -> object:
    """The body as strict JSON (no NaN/Infinity), any JSON content type or none at all."""
    mimetype = request.mimetype
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, not {mimetype}")
    raw = request.get_data(cache=False)
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
    encoded as UTF-8, so it must never reach a tokenizer or a grammar parser."""
    stack: list[tuple[object, list]] = [(body, [])]
    while stack:                                  # iterative: any nesting json accepts
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return _path_text(path[:1]), _path_text(path)
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                if not _encodable(key):
                    return _path_text((path + [key])[:1]), _path_text(path + [key])
                stack.append((item, path + [key]))
        elif isinstance(value, list):
            stack.extend((item, path + [i]) for i, item in reversed(list(enumerate(value))))
    return None


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


def validate(body: object, schema: Schema = _schema) -> dict:
    try:
        data = schema.load(body)
    except ValidationError as exc:
        param, message = first_error(exc.messages)
        if message == "Unknown field.":
            text = f"Unrecognized request argument supplied: {param}"
        else:
            text = f"Invalid value for '{param}': {message}" if param else message
        raise InvalidRequest(text, param=param, code="invalid_value") from None
    return normalize(schema, data, body) if schema is _schema else data


def resolve_model(requested: str | None, state: dict | None) -> str:
    """The model id to serve, or 404 (unknown) / 503 (known, nothing ready / no dispatcher)."""
    if state is None:
        raise ServiceUnavailable("the dispatcher is unreachable")
    models = state.get("models", {})
    if not models:
        raise ServiceUnavailable("no worker is ready yet", code="no_worker_ready")
    if requested is None:
        if len(models) != 1:
            raise InvalidRequest("'model' is required: this server has "
                                 f"{len(models)} models", param="model")
        requested = next(iter(models))
    if requested not in models:
        raise NotFound(f"The model '{requested}' does not exist. Served: "
                       + ", ".join(sorted(models)), param="model", code="model_not_found")
    if not models[requested].get("ready"):
        raise ServiceUnavailable(f"no worker for '{requested}' is ready yet",
                                 code="no_worker_ready")
    return requested


def check_route(job: dict, state: dict) -> None:
    """400 naming what is available when no worker could ever run the job (the dispatcher
    checks again; this answers before anything is queued)."""
    workers = state.get("workers", [])
    if any(fits(job, w) for w in workers) or len(workers) < state.get("expected_workers", 0):
        return
    param, code, message = explain_unfit(job, workers)
    raise InvalidRequest(message, param=param, code=code)


def queue_timeout() -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400 or value != value:
        raise InvalidRequest(f"{TIMEOUT_HEADER} must be a number of seconds, more than 0 "
                             "and at most 86400", param=TIMEOUT_HEADER)
    return value


def session_of(req) -> str | None:
    """The X-Session-Id, scoped by API key: with keys configured, one key's clients can
    never supersede (cancel) another key's requests by sending the same value."""
    session = req.headers.get(SESSION_HEADER) or None
    if session is None or not current_app.config.get("API_KEYS_ENABLED"):
        return session
    _, _, token = req.headers.get("Authorization", "").partition(" ")
    scope = hashlib.sha256(token.strip().encode()).hexdigest()[:16]
    return f"{scope}:{session}"


def check_prompt_size(req: dict) -> None:
    size = sum(len(p) if isinstance(p, str) else sum(
        len(x) if isinstance(x, str) else 1 for x in p) for p in req["prompt"])
    size += len(req.get("suffix") or "")
    limit = int(current_app.config["MAX_PROMPT_CHARS"])
    if size > limit:
        raise PayloadTooLarge(f"the prompt has {size} characters; this server takes at "
                              f"most {limit}", param="prompt", code="prompt_too_large")


def measured(events, started: float, recorder):
    """Pass events through, recording time to first text and between texts per job."""
    last_text: dict[int, float] = {}
    origin: dict[int, tuple[str, str]] = {}
    for index, event in events:
        kind = event["e"]
        if kind == P.EV_START:
            origin[index] = (str(event.get("worker", "unknown")),
                             str(event.get("device", "unknown")))
        elif kind == P.EV_TEXT:
            now = time.perf_counter()
            worker, device = origin.get(index, ("unknown", "unknown"))
            if index in last_text:
                recorder.observe("itl", worker, device, now - last_text[index])
            else:
                recorder.observe("ttft", worker, device, now - started)
            last_text[index] = now
        yield index, event


@bp.post("/v1/completions")
def create_completion():
    started = time.perf_counter()
    req = validate(parse_json_body())
    check_prompt_size(req)
    timeout = queue_timeout()
    client = get_client(current_app)
    state = client.wait_state()
    model = resolve_model(req["model"], state)
    request_id = P.new_request_id()
    plans = plan_jobs(request_id, model, req, request.headers.get(PROFILE_HEADER),
                      session_of(request), timeout)
    check_route(plans[0].job, state)
    fanout = Fanout(client, [p.job for p in plans])
    watcher = watch_disconnect(request.environ, fanout.client_gone)
    result = Result(request_id, int(time.time()), model, req, plans)
    try:
        fanout.submit()
        events = measured(fanout.events(), started, client.recorder)
        first = next(events)
        if first[1]["e"] == P.EV_ERROR:
            raise from_wire(first[1])
    except BaseException as exc:
        _stop(watcher)
        fanout.close()
        if isinstance(exc, ClientGone):
            return Response(status=499)     # nobody is listening; nginx logs 499 too
        raise
    events = itertools.chain([first], events)
    headers = {"X-Request-Id": request_id}
    if req["stream"]:
        body = _stream(result, events, fanout, watcher)
        return Response(stream_with_context(body), mimetype="text/event-stream",
                        headers={**sse.SSE_HEADERS, **headers})
    try:
        for index, event in events:
            if event["e"] == P.EV_ERROR:
                raise from_wire(event)
            result.add(index, event)
        return jsonify(result.body()), 200, headers
    except ClientGone:
        return Response(status=499)
    finally:
        _stop(watcher)
        fanout.close()


def _stop(watcher) -> None:
    if watcher is not None:
        watcher.kill(block=False)


class Result:
    """Choices assembled from the jobs' events: OpenAI's numbering (prompt × n), best_of
    selection by mean token logprob, usage over every job."""

    def __init__(self, request_id: str, created: int, model: str, req: dict, plans):
        self.request_id, self.created, self.model = request_id, created, model
        self.plans = plans
        self.n = req["n"]
        self.want_logprobs = req.get("logprobs") is not None
        self.include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        self.texts = [[] for _ in plans]
        self.logprobs = [None] * len(plans)
        self.finish = [None] * len(plans)
        self.scores = [0.0] * len(plans)
        self.prompt_tokens = [0] * len(plans)
        self.cached_tokens = [0] * len(plans)
        self.completion_tokens = [0] * len(plans)
        self.fingerprint = None

    def index(self, job_index: int) -> int:
        plan = self.plans[job_index]
        return plan.prompt_index * self.n + plan.candidate

    def add(self, job_index: int, event: dict) -> None:
        kind = event["e"]
        if kind == P.EV_START:
            self.prompt_tokens[job_index] = event["prompt_tokens"]
            self.cached_tokens[job_index] = event.get("cached_tokens", 0)
            self.fingerprint = self.fingerprint or event.get("fingerprint")
        elif kind == P.EV_TEXT:
            self.texts[job_index].append(event["text"])
        elif kind == P.EV_END:
            self.finish[job_index] = event["finish_reason"]
            self.completion_tokens[job_index] = event["usage"]["completion_tokens"]
            self.scores[job_index] = event.get("score", 0.0)
        if self.want_logprobs and event.get("logprobs"):
            self.logprobs[job_index] = merge_logprobs(self.logprobs[job_index],
                                                      event["logprobs"])

    def usage(self) -> dict:
        prompts, cached = {}, {}
        for plan, tokens, hit in zip(self.plans, self.prompt_tokens, self.cached_tokens):
            prompts.setdefault(plan.prompt_index, tokens)
            cached.setdefault(plan.prompt_index, hit)
        usage = sse.usage(sum(prompts.values()), sum(self.completion_tokens))
        usage["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
        return usage

    def body(self) -> dict:
        by_prompt: dict[int, list[int]] = {}
        for i, plan in enumerate(self.plans):
            by_prompt.setdefault(plan.prompt_index, []).append(i)
        choices = []
        for prompt_index, jobs in sorted(by_prompt.items()):
            if len(jobs) > self.n:        # best_of: the n with the best mean logprob
                jobs = sorted(jobs, key=lambda i: -self.scores[i])[:self.n]
            for rank, i in enumerate(jobs):
                choice = sse.choice("".join(self.texts[i]), self.finish[i],
                                    prompt_index * self.n + rank)
                choice["logprobs"] = self._logprobs(i)
                choices.append(choice)
        return sse.completion(self.request_id, self.created, self.model, choices,
                              self.usage(), system_fingerprint=self.fingerprint)

    def _logprobs(self, i: int) -> dict | None:
        if not self.want_logprobs:
            return None
        return self.logprobs[i] or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}

    def chunk(self, job_index: int, event: dict, include_usage: bool) -> bytes | None:
        kind = event["e"]
        if kind == P.EV_TEXT:
            choice = sse.choice(event["text"], None, self.index(job_index))
        elif kind == P.EV_END:
            choice = sse.choice("", event["finish_reason"], self.index(job_index))
        else:
            return None
        if self.want_logprobs:
            choice["logprobs"] = event.get("logprobs")
        obj = sse.completion(self.request_id, self.created, self.model, [choice], None,
                             system_fingerprint=self.fingerprint)
        if not include_usage:
            del obj["usage"]
        return sse.event(obj)


def merge_logprobs(into: dict | None, more: dict) -> dict:
    if into is None:
        return {key: list(values) for key, values in more.items()}
    for key, values in more.items():
        into[key].extend(values)
    return into


def _stream(result: Result, events, fanout: Fanout, watcher):
    """SSE chunks; an error after the stream started goes out as an error event."""
    include_usage = result.include_usage
    try:
        for index, event in events:
            result.add(index, event)
            if event["e"] == P.EV_ERROR:
                yield sse.event(from_wire(event).to_dict())
                yield sse.DONE
                return
            chunk = result.chunk(index, event, include_usage)
            if chunk is not None:
                yield chunk
        if include_usage:
            yield sse.event(sse.completion(result.request_id, result.created, result.model,
                                           [], result.usage(),
                                           system_fingerprint=result.fingerprint))
        yield sse.DONE
    except ClientGone:
        return
    finally:
        _stop(watcher)
        fanout.close()
