"""GET /health and GET /v1/models, answered from the dispatcher's last heartbeat."""
from __future__ import annotations

from flask import Blueprint, current_app, jsonify

from app.client import get_client
from app.errors import NotFound, ServiceUnavailable
from dispatcher.common import config

bp = Blueprint("status", __name__)


@bp.get("/health")
def health():
    state = get_client(current_app).wait_state()
    if state is None:
        body, status = {"status": "unavailable", "reason": "dispatcher unreachable"}, 503
    elif state.draining:
        body, status = {"status": "draining", "reason": "shutting down"}, 503
    elif state.workers_ready < 1:
        body, status = {"status": "unavailable", "reason": "no worker ready",
                        "workers_ready": 0}, 503
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
def list_models():
    state = _state()
    return jsonify({"object": "list", "data": [
        _model_object(model_id, info, state.aliases)
        for model_id, info in sorted(state.models.items())]})


@bp.get("/v1/models/<path:model>")
def retrieve_model(model: str):
    """OpenAI's `models.retrieve`: the model, also by one of its aliases."""
    state = _state()
    models, aliases = state.models, state.aliases
    model_id = aliases.get(model, model)
    if model_id not in models:
        raise NotFound(f"The model '{model}' does not exist. Served: "
                       + ", ".join(sorted(models)), param="model", code="model_not_found")
    return jsonify(_model_object(model_id, models[model_id], aliases))
