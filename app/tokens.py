"""POST /tokenize and POST /detokenize, in llama.cpp's shapes, answered by a worker."""
from __future__ import annotations

from flask import Blueprint, current_app

from app import access
from app.client import get_client
from app.requests import json_answer, parse_json_body, resolve_model, validate
from app.errors import PayloadTooLarge, from_wire
from app.schemas import DetokenizeRequestSchema, TokenizeRequestSchema
from dispatcher.common import protocol as P

bp = Blueprint("tokens", __name__)


def _run(op: str, req: dict) -> dict:
    size = len(req["content"]) if op == "tokenize" else len(req["tokens"])
    limit = int(current_app.config["MAX_PROMPT_CHARS"])
    if size > limit:                   # the limit of a prompt: these are prompts' work
        param = "content" if op == "tokenize" else "tokens"
        raise PayloadTooLarge(f"the {param} has {size} "
                              f"{'characters' if op == 'tokenize' else 'tokens'}; this "
                              f"server takes at most {limit}", param=param,
                              code="prompt_too_large")
    client = get_client(current_app)
    model = resolve_model(req.pop("model"), client.wait_state(), any_name=True)
    job = P.WorkerJob(id=P.new_request_id(), model=model, op=op,
                      generation=P.Generation(**req))
    access.current().update(request_id=job.id, model=model)
    stream = client.submit(job)
    try:
        event = stream.next_event()
    finally:
        stream.close()
    if isinstance(event, P.Error):
        raise from_wire(event)
    return event.result


@bp.post("/tokenize")
def tokenize():
    result = _run("tokenize", validate(parse_json_body(any_content_type=True),
                                           TokenizeRequestSchema()))
    return json_answer(lambda: result)


@bp.post("/detokenize")
def detokenize():
    result = _run("detokenize", validate(parse_json_body(any_content_type=True),
                                             DetokenizeRequestSchema()))
    return json_answer(lambda: result)
