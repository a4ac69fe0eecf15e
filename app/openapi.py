"""GET /openapi.json: the API described from the marshmallow schemas themselves.

Request bodies are generated from the schema declarations (each field's OpenAPI
description is its `metadata`), so the document cannot drift from what the server
accepts; tests/test_openapi.py checks the ranges and enums against the validators too.
"""
from __future__ import annotations

from flask import Blueprint, jsonify
from marshmallow import Schema, fields

from app.fim import FIM_SCHEMA
from app.native import NativeCompletionSchema, NativeInfillSchema
from app.schemas import (CompletionRequestSchema, DetokenizeRequestSchema,
                         TokenizeRequestSchema)

bp = Blueprint("openapi", __name__)
VERSION = "0.1.0"


def field_schema(field: fields.Field) -> dict:
    if isinstance(field, fields.Nested):
        schema = object_schema(field.schema)
        if field.metadata.get("description"):
            schema["description"] = field.metadata["description"]
    else:
        schema = {k: v for k, v in field.metadata.items() if v != ""}
    if field.allow_none:
        if "oneOf" in schema:
            schema["oneOf"] = schema["oneOf"] + [{"type": "null"}]
        elif "type" in schema:
            schema["type"] = [schema["type"], "null"]
    return schema


def object_schema(schema: Schema) -> dict:
    out = {"type": "object", "additionalProperties": False,
           "properties": {f.data_key or name: field_schema(f)
                          for name, f in schema.fields.items()}}
    required = [f.data_key or name for name, f in schema.fields.items() if f.required]
    if required:
        out["required"] = required
    return out


def _error_responses(*statuses: int) -> dict:
    text = {400: "Invalid request", 401: "No valid API key (with keys configured)",
            404: "Unknown model or route", 408: "The body did not arrive in time",
            409: "Superseded by a newer request of its session",
            413: "Body too large", 415: "Body is not JSON", 429: "Queue full",
            500: "The worker failed on this request", 502: "The answer's stream was lost",
            503: "No worker ready, dispatcher unreachable or worker lost",
            504: "No worker took it within its queue time"}
    return {str(s): {"description": text[s], "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}} for s in statuses}


def _json(ref: str) -> dict:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


LOGPROBS = {"type": ["object", "null"], "properties": {
    "tokens": {"type": "array", "items": {"type": "string"}},
    "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
    "top_logprobs": {"type": "array", "items": {"type": ["object", "null"]}},
    "text_offset": {"type": "array", "items": {"type": "integer"}}}}
USAGE = {"type": "object", "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {
        "cached_tokens": {"type": "integer"}}}}}


NATIVE_COMPLETION = {"type": "object", "properties": {
    "content": {"type": "string"}, "stop": {"type": "boolean"},
    "stop_type": {"enum": ["eos", "word", "limit"]}, "stopping_word": {"type": "string"},
    "tokens_predicted": {"type": "integer"}, "tokens_evaluated": {"type": "integer"},
    "tokens_cached": {"type": "integer"}, "truncated": {"type": "boolean"},
    "tokens": {"type": "array", "items": {"type": "integer"}},
    "completion_probabilities": {"type": "array", "items": {"type": "object"}},
    "generation_settings": {"type": "object"}, "model": {"type": "string"},
    "input_extra_dropped": {"type": "integer"},
    "timings": {"type": "object", "properties": {k: {"type": "number"} for k in (
        "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
        "predicted_n", "predicted_ms", "predicted_per_token_ms",
        "predicted_per_second")}}}}


FIM_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model",
                                                  "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"},
    "created": {"type": "integer"}, "model": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object", "properties": {
        "index": {"type": "integer"},
        "message": {"type": "object", "properties": {
            "role": {"const": "assistant"}, "content": {"type": "string"},
            "tool_calls": {"type": "null"}, "prefix": {"type": "boolean"}}},
        "finish_reason": {"enum": ["stop", "length"]}}}},
    "usage": USAGE}}


def build_openapi() -> dict:
    """The OpenAPI 3.1 document of every route, its request schemas built from the
    marshmallow schemas that validate them."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "completions-server", "version": VERSION,
                 "description": "OpenAI-compatible raw-text completions (with llama.cpp's, "
                                "geniex's and SIE's extensions)."},
        "paths": _paths(),
        "components": {"schemas": _schemas()},
    }


def _post(summary: str, request: str, answer: str, description: str, errors: tuple,
          streamed: bool = True, **extra) -> dict:
    """A POST route: its JSON request schema, its answer (or, `streamed`, its answer's
    chunks as Server-Sent Events) and its errors."""
    content = _json(answer)
    if streamed:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": _json(request)},
                     "responses": {"200": {"description": description, "content": content},
                                   **_error_responses(*errors)}, **extra}}


# what a generating route may answer besides 200 (docs/api.md, failures-and-limits.md)
GENERATING = (400, 401, 404, 408, 409, 413, 415, 429, 500, 502, 503, 504)


def _paths() -> dict:
    sse = "as Server-Sent Events ending in `data: [DONE]`"
    native = _post("llama.cpp's native completion (its defaults and answer shape; unknown "
                   "fields ignored; SSE without [DONE] with stream: true)",
                   "NativeCompletionRequest", "NativeAnswer", "llama.cpp's answer (a "
                   "list of them for several prompts or n_cmpl)", GENERATING)
    infill = _post("llama.cpp's code infill: prefix, suffix, repository context (SSE "
                   "without [DONE] with stream: true)",
                   "NativeInfillRequest", "NativeAnswer", "llama.cpp's answer", GENERATING)
    infill["post"]["responses"]["501"] = {
        "description": "The model has no fill-in-the-middle tokens and no --fim-template",
        "content": _json("Error")}
    return {
        "/v1/completions": _post(
            "Create a completion (JSON, or SSE with stream: true)", "CompletionRequest",
            "Completion", f"A completion, or its chunks {sse}", GENERATING,
            parameters=[{"name": "X-SIE-MACHINE-PROFILE", "in": "header", "required": False,
                         "schema": {"type": "string", "maxLength": 128},
                         "description": "Only workers of this machine profile."}]),
        "/v1/fim/completions": _post(
            "Mistral's fill-in-the-middle completion (JSON, or SSE with stream: true)",
            "FimRequest", "FimCompletion", f"A chat-completion-shaped answer, or its chunks "
            f"{sse}", GENERATING),
        "/v1/models": {"get": {"summary": "Models served (also /models, as llama-server)",
                               "responses": {
            "200": {"description": "Model list", "content": _json("ModelList")},
            **_error_responses(401, 503)}}},
        "/v1/status": {"get": {
            "summary": "Every worker's state, slots, counters and time-to-first-token "
                       "histogram, and the queue (the status page's data; no request content)",
            "responses": {"200": {"description": "Status", "content": _json("Status")},
                          **_error_responses(401, 503)}}},
        "/metrics": {"get": {
            "summary": "Prometheus metrics of the whole system, from any front end (who may "
                       "read it: --status-access)",
            "responses": {"200": {"description": "Prometheus text format"},
                          **_error_responses(401, 503)}}},
        "/": {"get": {"summary": "The status page, with a fill-in-the-middle playground "
                                 "(also /ui/)",
                      "responses": {"200": {"description": "HTML"}}}},
        "/health": {"get": {"summary": "200 when at least one worker is ready (also "
                                       "/v1/health, as llama-server)",
                            "responses": {"200": {"description": "Ready"},
                                          "503": {"description": "No worker ready"}}}},
        "/tokenize": _post("Text to token ids (llama.cpp's shape)", "TokenizeRequest",
                           "TokenizeResponse", "Tokens", (400, 401, 404, 413, 429, 503),
                           streamed=False),
        "/detokenize": _post("Token ids to text (llama.cpp's shape)", "DetokenizeRequest",
                             "DetokenizeResponse", "Text", (400, 401, 404, 413, 429, 503),
                             streamed=False),
        "/v1/models/{model}": {"get": {
            "summary": "One model, by id or alias",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": {"description": "The model"},
                          **_error_responses(401, 404, 503)}}},
        "/props": {"get": {
            "summary": "llama-server's server properties: the model (`?model=` or the "
                       "default), its context, its slots and /completion's sampling defaults",
            "parameters": [{"name": "model", "in": "query", "required": False,
                            "schema": {"type": "string"}}],
            "responses": {"200": {"description": "The properties"},
                          **_error_responses(401, 404, 503)}}},
        "/models": {"get": {"summary": "Models served (llama-server's name for /v1/models)",
                            "responses": {"200": {"description": "Model list",
                                                  "content": _json("ModelList")},
                                          **_error_responses(401, 503)}}},
        "/v1/health": {"get": {"summary": "As /health (llama-server's other name for it)",
                               "responses": {"200": {"description": "Ready"},
                                             "503": {"description": "No worker ready"}}}},
        "/completion": native,
        "/completions": native,
        "/infill": infill,
        "/openapi.json": {"get": {"summary": "This document",
                                  "responses": {"200": {"description": "OpenAPI 3.1"}}}},
    }


def _schemas() -> dict:
    completion = {"type": "object", "required": ["id", "object", "created", "model",
                                                 "choices"], "properties": {
        "id": {"type": "string"}, "object": {"const": "text_completion"},
        "created": {"type": "integer"}, "model": {"type": "string"},
        "system_fingerprint": {"type": ["string", "null"]},
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "text": {"type": "string"}, "index": {"type": "integer"},
            "logprobs": LOGPROBS,
            "finish_reason": {"enum": ["stop", "length", None]}}}},
        "usage": {"oneOf": [USAGE, {"type": "null"}]}}}
    return {
        "CompletionRequest": object_schema(CompletionRequestSchema()),
        "NativeCompletionRequest": {**object_schema(NativeCompletionSchema()),
                                    "additionalProperties": True},
        "NativeInfillRequest": {**object_schema(NativeInfillSchema()),
                                "additionalProperties": True},
        "NativeCompletion": NATIVE_COMPLETION,
        "NativeAnswer": {"oneOf": [{"$ref": "#/components/schemas/NativeCompletion"},
                                   {"type": "array", "items": {
                                       "$ref": "#/components/schemas/NativeCompletion"}}]},
        # (other fields are ignored, as llama-server ignores them)
        "TokenizeRequest": {**object_schema(TokenizeRequestSchema()),
                            "additionalProperties": True},
        "DetokenizeRequest": {**object_schema(DetokenizeRequestSchema()),
                              "additionalProperties": True},
        "Completion": completion,
        "FimRequest": object_schema(FIM_SCHEMA),
        "FimCompletion": FIM_COMPLETION,
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "null"]}}}}},
        "ModelList": {"type": "object", "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {
                "type": "object", "properties": {"id": {"type": "string"},
                                                 "object": {"const": "model"},
                                                 "created": {"type": "integer"},
                                                 "owned_by": {"type": "string"},
                                                 "aliases": {"type": "array", "items": {
                                                     "type": "string"}},
                                                 "meta": {"type": "object"}}}}}},
        "TokenizeResponse": {"type": "object", "properties": {"tokens": {
            "type": "array", "items": {"oneOf": [
                {"type": "integer"},
                {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "piece": {"type": "string"}}}]}}}},
        "DetokenizeResponse": {"type": "object", "properties": {
            "content": {"type": "string"}}},
        "Status": {"type": "object", "required": ["object", "time", "workers"], "properties": {
            "object": {"const": "status"}, "time": {"type": "number"},
            "models": {"type": "object", "additionalProperties": {
                "type": "object", "properties": {"ready": {"type": "integer"},
                                                 "fim": {"type": "boolean"}}}},
            "queue": {"type": "object", "additionalProperties": {"type": "integer"}},
            "frontends": {"type": "integer"},
            "workers": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "device": {"type": ["string", "null"]},
                "model": {"type": ["string", "null"]},
                "state": {"enum": ["idle", "busy", "draining", "drained", "starting",
                                   "restarting", "failed"]},
                "slots": {"type": "integer"}, "busy": {"type": "integer"},
                "restarts": {"type": "integer"},
                "last_lost": {"type": ["object", "null"]},
                "generated_tokens": {"type": "integer"}, "prompt_tokens": {"type": "integer"},
                "drafted_tokens": {"type": "integer"}, "accepted_tokens": {"type": "integer"},
                "ttft": {"type": ["object", "null"], "properties": {
                    "buckets": {"type": "array", "items": {"type": "number"}},
                    "counts": {"type": "array", "items": {"type": "integer"}}}}}}}}},
    }


@bp.get("/openapi.json")
def openapi_document():
    return jsonify(build_openapi())
