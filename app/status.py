"""GET /health and GET /v1/models, answered from the dispatcher's last heartbeat."""
from __future__ import annotations

from flask import Blueprint, current_app, jsonify

from app.client import get_client
from app.errors import ServiceUnavailable
from dispatcher import config

bp = Blueprint("status", __name__)


@bp.get("/health")
def health():
    state = get_client(current_app).wait_state()
    if state is None:
        body, status = {"status": "unavailable", "reason": "dispatcher unreachable"}, 503
    elif state.get("draining"):
        body, status = {"status": "draining", "reason": "shutting down"}, 503
    elif state.get("workers_ready", 0) < 1:
        body, status = {"status": "unavailable", "reason": "no worker ready",
                        "workers_ready": 0}, 503
    else:
        body, status = {"status": "ok", "workers_ready": state["workers_ready"],
                        "workers_expected": max(state.get("expected_workers", 0),
                                                state["workers_ready"])}, 200
    response = jsonify(body)
    response.status_code = status
    if status == 503:
        response.headers["Retry-After"] = str(config.RETRY_AFTER_SECONDS)
    return response


@bp.get("/v1/models")
def list_models():
    state = get_client(current_app).wait_state()
    if state is None:
        raise ServiceUnavailable("the dispatcher is unreachable")
    data = [{"id": model_id, "object": "model", "created": info.get("created", 0),
             "owned_by": "completions-server",
             "meta": {"n_ctx": info.get("n_ctx"), "workers_ready": info.get("ready", 0)}}
            for model_id, info in sorted(state.get("models", {}).items())]
    return jsonify({"object": "list", "data": data})
