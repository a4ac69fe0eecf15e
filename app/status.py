"""GET /health, GET /v1/models and GET /props, answered from the dispatcher's last heartbeat; the
status page (`/`, `/ui/`) and its JSON (`GET /v1/status`), from the dispatcher's metrics
snapshot: every worker's state, slots, counters and latency histogram, and never any
request content."""
from __future__ import annotations

import time
from importlib import metadata
from pathlib import Path

from flask import Blueprint, current_app, jsonify, request, send_from_directory

from app.client import get_client
from app.errors import NotFound, ServiceUnavailable
from app.native import NativeCompletionSchema
from app.requests import clipped, resolve_model
from dispatcher.common import config

bp = Blueprint("status", __name__)


@bp.get("/health")
@bp.get("/v1/health")                   # (llama-server's other name for it)
def health():
    state = get_client(current_app).wait_state()
    if state is None:
        body, status = {"status": "unavailable", "reason": "dispatcher unreachable"}, 503
    elif state.draining:
        body, status = {"status": "draining", "reason": "shutting down"}, 503
    elif state.workers_ready < 1:
        body, status = {"status": "unavailable", "reason": "no worker ready",
                        "workers_ready": 0}, 503
    elif state.workers_drained >= state.workers_ready:
        # (an operator drained them all: a balancer should send the work elsewhere; every
        # request here would wait, then get a 503)
        body, status = {"status": "unavailable", "reason": "every worker is drained",
                        "workers_ready": state.workers_ready,
                        "workers_drained": state.workers_drained}, 503
    else:
        body, status = {"status": "ok", "workers_ready": state.workers_ready,
                        "workers_expected": max(state.expected_workers,
                                                state.workers_ready)}, 200
    response = jsonify(body)
    response.status_code = status
    if status == 503:
        response.headers["Retry-After"] = str(config.RETRY_AFTER_SECONDS)
    return response


def _state():
    state = get_client(current_app).wait_state()
    if state is None:
        raise ServiceUnavailable("the dispatcher is unreachable")
    return state


def _model_object(model_id: str, info, aliases: dict) -> dict:
    return {"id": model_id, "object": "model", "created": info.created,
            "owned_by": "completions-server",
            "aliases": sorted(a for a, m in aliases.items() if m == model_id),
            "meta": {"n_ctx": info.n_ctx, "workers_ready": info.ready}}


@bp.get("/v1/models")
@bp.get("/models")                      # (llama-server's other name for it)
def list_models():
    state = _state()
    # the model a request without `model` gets first (clients take `data[0]` for the
    # default), then the others in the config's order
    models = sorted(state.models.items(), key=lambda item: item[0] != state.default_model)
    return jsonify({"object": "list", "data": [
        _model_object(model_id, info, state.aliases) for model_id, info in models]})


@bp.get("/v1/models/<path:model>")
def retrieve_model(model: str):
    """OpenAI's `models.retrieve`: the model, also by one of its aliases."""
    state = _state()
    models, aliases = state.models, state.aliases
    model_id = aliases.get(model, model)
    if model_id not in models:
        raise NotFound(f"The model '{clipped(model)}' does not exist. Served: "
                       + ", ".join(sorted(models)), param="model", code="model_not_found")
    return jsonify(_model_object(model_id, models[model_id], aliases))


def _native_defaults() -> dict:
    """The sampling settings a /completion without them gets (llama.cpp's defaults)."""
    defaults = {name: field.load_default for name, field
                in NativeCompletionSchema().fields.items()
                if isinstance(field.load_default, (int, float, str, list))}
    return {"n_predict": -1, **defaults}


@bp.get("/props")
def props():
    """llama-server's GET /props, which llama.cpp's web UI and client libraries read
    before anything else: the model (`?model=` or the default; with one model served,
    any name means it, as on llama.cpp's other routes), its context and slots
    (all of its workers'), and the sampling defaults of /completion. Nothing of the
    host: the model's id, not its file's path."""
    state = _state()
    model_id = resolve_model(request.args.get("model"), state, any_name=True)
    info = state.models[model_id]
    return jsonify({
        "default_generation_settings": {"n_ctx": info.n_ctx, "params": _native_defaults()},
        "total_slots": info.slots, "model_alias": model_id, "model_path": model_id,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": False, "endpoint_props": False, "endpoint_metrics": True,
        "chat_template": "", "build_info": f"completions-server {_version()}",
        "is_sleeping": False, "infill": info.fim, "workers_ready": info.ready})


def _version() -> str:
    try:
        return metadata.version("completions-server")
    except metadata.PackageNotFoundError:
        return "unknown"


STATIC = Path(__file__).resolve().parent / "static"
PAGE_FILES = {"status.js", "status.css"}


@bp.get("/")
@bp.get("/ui/")
def status_page():
    """The live status page with its FIM playground (plain HTML, CSS and a script)."""
    return send_from_directory(STATIC, "status.html", max_age=0)


@bp.get("/ui/<name>")
def status_page_file(name: str):
    if name not in PAGE_FILES:
        raise NotFound(f"There is no file {name[:80]!r} here.")
    return send_from_directory(STATIC, name, max_age=0)


@bp.get("/v1/status")
def status_json():
    """Every worker: its device, model, state, slots, restarts and last loss, and the
    counters a reader turns into rates over a window (generated tokens, drafts, the time
    to first token's histogram); the queue by model. Cumulative since the dispatcher
    started: the page takes differences between two reads."""
    snapshot = get_client(current_app).metrics_snapshot()
    if snapshot is None:
        raise ServiceUnavailable("the dispatcher is unreachable")
    tokens: dict[str, dict[str, int]] = {}
    for kind, worker, _, n in snapshot.get("tokens", []):
        tokens.setdefault(worker, {})[kind] = tokens.get(worker, {}).get(kind, 0) + n
    ttft: dict[str, dict] = {}
    for kind, worker, _, histogram in snapshot.get("histograms", []):
        if kind == "ttft":
            ttft[worker] = {"buckets": histogram["buckets"], "counts": histogram["counts"]}
    workers = []
    for w in snapshot.get("workers", []):
        steps = w.get("steps") or {}
        drafted = sum(d for d, _ in (steps.get("sources") or {}).values())
        workers.append({
            "name": w["worker"], "device": w.get("device"), "model": w.get("model"),
            "state": w.get("state"), "slots": w.get("slots", 0), "busy": w.get("busy", 0),
            "restarts": w.get("restarts", 0), "last_lost": w.get("last_lost"),
            "generated_tokens": tokens.get(w["worker"], {}).get("generated", 0),
            "prompt_tokens": tokens.get(w["worker"], {}).get("prompt", 0),
            "drafted_tokens": drafted, "accepted_tokens": steps.get("accepted", 0),
            "ttft": ttft.get(w["worker"])})
    state = get_client(current_app).wait_state()
    models = {} if state is None else {
        model: {"ready": info.ready, "fim": info.fim} for model, info in state.models.items()}
    return jsonify({"object": "status", "time": round(time.time(), 3), "models": models,
                    "queue": snapshot.get("queue", {}),
                    "frontends": snapshot.get("frontends", 0), "workers": workers})
