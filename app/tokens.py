"""POST /tokenize and POST /detokenize, in llama.cpp's shapes, answered by a worker."""
from __future__ import annotations

from flask import Blueprint, Response, current_app, request

from app import access
from app.client import ClientGone, get_client
from app.disconnect import watch_disconnect
from app.bodies import parse_json_body
from app.requests import api_key_fingerprint, json_answer, resolve_model, tenant_of, validate
from app.errors import PayloadTooLarge, from_wire
from app.schemas import DetokenizeRequestSchema, TokenizeRequestSchema
from dispatcher.common import protocol as P

bp = Blueprint("tokens", __name__)


# UTF-8 bytes of /tokenize content answered with its pieces: the answer is a token a byte
# at worst (byte fallback), each piece an object the front end's loop decodes (~2 µs:
# a megabyte of such content held every stream of that front end half a second)
MAX_PIECES_BYTES = 32_768


def _check_size(op: str, req: dict) -> None:
    """413 for more than a prompt's work (`--max-prompt-chars`: characters, ids, and
    content bytes, a token being one byte at least), or than MAX_PIECES_BYTES of content
    with its pieces."""
    limit = int(current_app.config["MAX_PROMPT_CHARS"])
    if op == "detokenize":
        if len(req["tokens"]) > limit:
            raise PayloadTooLarge(f"the tokens has {len(req['tokens'])} tokens; this "
                                  f"server takes at most {limit}", param="tokens",
                                  code="prompt_too_large")
        return
    chars = len(req["content"])
    size = len(req["content"].encode("utf-8", "surrogatepass")) if chars <= limit else chars
    if chars > limit or size > limit:
        raise PayloadTooLarge(f"the content has {chars} characters ({size} bytes); this "
                              f"server takes at most {limit} of each", param="content",
                              code="prompt_too_large")
    if req.get("with_pieces") and size > MAX_PIECES_BYTES:
        raise PayloadTooLarge(f"the content has {size} bytes; with_pieces takes at most "
                              f"{MAX_PIECES_BYTES} (one piece a byte at worst)",
                              param="content", code="prompt_too_large")


def _run(op: str, req: dict) -> dict:
    _check_size(op, req)
    client = get_client(current_app)
    model = resolve_model(req.pop("model"), client.wait_state(), any_name=True)
    # (its key's: a worker keeps long texts' tokenizations per tenant, so another key's
    # same text is never answered sooner, and the dispatcher counts it to the key)
    job = P.WorkerJob(id=P.new_request_id(), model=model, op=op,
                      tenant=tenant_of(request), api_key=api_key_fingerprint(request),
                      generation=P.Generation(**req))
    access.current().update(request_id=job.id, model=model)
    # a client that leaves cancels it (a worker drops one not started: a key's texts of
    # a megabyte kept others waiting for answers nobody would read)
    watcher = watch_disconnect(request.environ, lambda: client.client_gone(job.id))
    try:
        stream = client.submit(job)
        try:
            event = stream.next_event()
        finally:
            stream.close()
    finally:
        if watcher is not None:
            watcher.kill(block=False)
    if isinstance(event, P.Error):
        raise from_wire(event)
    return event.result


def _answer(op: str, schema) -> Response:
    req = validate(parse_json_body(any_content_type=True), schema)
    try:
        result = _run(op, req)
    except ClientGone:
        access.current().failed("client_closed")
        return Response(status=499)         # nobody is listening; nginx logs 499 too
    return json_answer(lambda: result)


@bp.post("/tokenize")
def tokenize():
    return _answer("tokenize", TokenizeRequestSchema())


@bp.post("/detokenize")
def detokenize():
    return _answer("detokenize", DetokenizeRequestSchema())
