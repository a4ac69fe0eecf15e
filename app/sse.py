"""Server-Sent Events framing and OpenAI's text_completion objects."""
from __future__ import annotations

import json

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    """One `data:` event. JSON never contains a raw newline, so one line is enough."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


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
