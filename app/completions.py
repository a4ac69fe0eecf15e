"""POST /v1/completions: validate, hand the job to the dispatcher, relay the worker's events."""
from __future__ import annotations

import json
import time

from flask import Blueprint, Response, current_app, jsonify, request, stream_with_context
from marshmallow import ValidationError

from app import sse
from app.client import ClientGone, RequestStream, get_client, watch_disconnect
from app.errors import (InvalidRequest, NotFound, ServiceUnavailable, UnsupportedMediaType,
                        from_wire)
from app.schemas import CompletionRequestSchema, fill_nulls, first_error
from dispatcher import config, protocol as P

bp = Blueprint("completions", __name__)
_schema = CompletionRequestSchema()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body() -> object:
    """The body as strict JSON (no NaN/Infinity), any JSON content type or none at all."""
    mimetype = request.mimetype
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, not {mimetype}")
    raw = request.get_data(cache=False)
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise InvalidRequest("The request body is not valid UTF-8.", code="invalid_json")
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply.", code="invalid_json")
    except ValueError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json")


def validate(body: object) -> dict:
    try:
        return fill_nulls(_schema, _schema.load(body))
    except ValidationError as exc:
        param, message = first_error(exc.messages)
        if message == "Unknown field.":
            text = f"Unrecognized request argument supplied: {param}"
        else:
            text = f"Invalid value for '{param}': {message}" if param else message
        raise InvalidRequest(text, param=param, code="invalid_value") from None


def resolve_model(requested: str | None, state: dict | None) -> str:
    """The model id to serve, or 404 (unknown) / 503 (known, nothing ready / no dispatcher)."""
    retry = {"Retry-After": str(config.RETRY_AFTER_SECONDS)}
    if state is None:
        raise ServiceUnavailable("the dispatcher is unreachable", headers=retry)
    models = state.get("models", {})
    if not models:
        raise ServiceUnavailable("no worker is ready yet", headers=retry, code="no_worker_ready")
    if requested is None:
        if len(models) != 1:
            raise InvalidRequest("'model' is required: this server has "
                                 f"{len(models)} models", param="model")
        requested = next(iter(models))
    if requested not in models:
        raise NotFound(f"The model '{requested}' does not exist. Served: "
                       + ", ".join(sorted(models)), param="model", code="model_not_found")
    if not models[requested].get("ready"):
        raise ServiceUnavailable(f"no worker for '{requested}' is ready yet", headers=retry,
                                 code="no_worker_ready")
    return requested


def build_job(request_id: str, model: str, req: dict) -> dict:
    max_tokens = req["max_tokens"]
    return {
        "id": request_id,
        "model": model,
        "prompt": req["prompt"],
        "max_tokens": None if max_tokens is None or max_tokens < 0 else max_tokens,
        "stop": req["stop"],
        "echo": req["echo"],
        "sampling": {name: req[name] for name in (
            "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
            "frequency_penalty", "repetition_penalty")},
    }


@bp.post("/v1/completions")
def create_completion():
    req = validate(parse_json_body())
    client = get_client(current_app)
    model = resolve_model(req["model"], client.wait_state())
    request_id = P.new_request_id()
    created = int(time.time())
    job = build_job(request_id, model, req)
    watcher = watch_disconnect(request.environ, lambda: client.client_gone(request_id))
    stream = None
    try:
        stream = client.submit(job)
        first = stream.next_event()
        if first["e"] == P.EV_ERROR:
            raise from_wire(first)
    except BaseException as exc:
        _stop(watcher)
        if stream is not None:
            stream.close()
        if isinstance(exc, ClientGone):
            return Response(status=499)     # nobody is listening; nginx logs 499 too
        raise
    headers = {"X-Request-Id": request_id}
    if req["stream"]:
        include_usage = bool((req["stream_options"] or {}).get("include_usage"))
        body = _stream_events(stream, watcher, request_id, created, model, include_usage)
        return Response(stream_with_context(body), mimetype="text/event-stream",
                        headers={**sse.SSE_HEADERS, **headers})
    try:
        return _collect(stream, request_id, created, model), 200, headers
    except ClientGone:
        return Response(status=499)
    finally:
        _stop(watcher)
        stream.close()


def _stop(watcher) -> None:
    if watcher is not None:
        watcher.kill(block=False)


def _collect(stream: RequestStream, request_id: str, created: int, model: str):
    parts: list[str] = []
    while True:
        event = stream.next_event()
        if event["e"] == P.EV_TEXT:
            parts.append(event["text"])
        elif event["e"] == P.EV_ERROR:
            raise from_wire(event)
        elif event["e"] == P.EV_END:
            usage = event["usage"]
            return jsonify(sse.completion(
                request_id, created, model,
                [sse.choice("".join(parts), event["finish_reason"])],
                sse.usage(usage["prompt_tokens"], usage["completion_tokens"])))


def _stream_events(stream: RequestStream, watcher, request_id: str, created: int, model: str,
                   include_usage: bool):
    """SSE chunks; an error after the stream started goes out as an error event."""
    def chunk(text: str, finish_reason: str | None) -> bytes:
        obj = sse.completion(request_id, created, model, [sse.choice(text, finish_reason)],
                             None)
        if not include_usage:
            del obj["usage"]
        return sse.event(obj)

    try:
        while True:
            try:
                event = stream.next_event()
            except ClientGone:
                return
            if event["e"] == P.EV_TEXT:
                yield chunk(event["text"], None)
            elif event["e"] == P.EV_END:
                yield chunk("", event["finish_reason"])
                if include_usage:
                    usage = event["usage"]
                    yield sse.event(sse.completion(
                        request_id, created, model, [],
                        sse.usage(usage["prompt_tokens"], usage["completion_tokens"])))
                yield sse.DONE
                return
            elif event["e"] == P.EV_ERROR:
                yield sse.event(from_wire(event).to_dict())
                yield sse.DONE
                return
    finally:
        _stop(watcher)
        stream.close()
