"""Server-Sent Events framing and OpenAI's text_completion objects."""
from __future__ import annotations

import msgspec

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    """One `data:` event. JSON never contains a raw newline, so one line is enough.
    msgspec's encoder, as the whole answers': an echoed prompt's chunk with its logprobs
    (half a million entries) took json's 0.28 s on the front end's loop, every other
    stream of the process waiting (a thread would not help: neither lets go of the GIL),
    msgspec's a sixth of that; and a float past JSON (an infinite logprob) is null in
    both kinds of answer, not json's `-Infinity` that clients' parsers refuse."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(request_id: str, created: int, model: str, choices: list[dict],
               usage_: dict | None, **extra) -> dict:
    obj = {"id": request_id, "object": "text_completion", "created": created,
           "model": model, "choices": choices}
    obj["usage"] = usage_
    obj.update(extra)
    return obj


def choice(text: str, finish_reason: str | None, index: int = 0) -> dict:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}
