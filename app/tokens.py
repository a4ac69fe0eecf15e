"""POST /tokenize and POST /detokenize, in llama.cpp's shapes, answered by a worker."""
from __future__ import annotations

from flask import Blueprint, current_app, jsonify

from app import access
from app.client import get_client
from app.requests import parse_json_body, resolve_model, validate
from app.errors import from_wire
from app.schemas import DetokenizeRequestSchema, TokenizeRequestSchema
from dispatcher import protocol as P

bp = Blueprint("tokens", __name__)


def _run(op: str, req: dict) -> dict:
    client = get_client(current_app)
    model = resolve_model(req.pop("model"), client.wait_state(), any_name=True)
    job = {"id": P.new_request_id(), "model": model, "op": op, **req}
    access.current().update(request_id=job["id"], model=model)
    stream = client.submit(job)
    try:
        event = stream.next_event()
    finally:
        stream.close()
    if event["e"] == P.EV_ERROR:
        raise from_wire(event)
    return event["result"]


@bp.post("/tokenize")
def tokenize():
    return jsonify(_run("tokenize", validate(parse_json_body(), TokenizeRequestSchema())))


@bp.post("/detokenize")
def detokenize():
    return jsonify(_run("detokenize", validate(parse_json_body(), DetokenizeRequestSchema())))
