"""POST /v1/fim/completions: Mistral's fill-in-the-middle API (Continue's `fimStream`,
Codestral-style clients), on the same validation, queue, routing and workers as
`/v1/completions`.

The body is `/v1/completions`' FIM subset under Mistral's names (`random_seed` for
`seed`, `max_completion_tokens` beside `max_tokens`), laid out as fill-in-the-middle with
the model's FIM tokens or its `--fim-template` when a `suffix` is given (as
`/v1/completions` with `suffix`), a plain completion without one; the answer is Mistral's,
chat-completion-shaped: `choices[].message.content`, streamed as `choices[].delta.content`
chunks, the last with `finish_reason` and `usage`, then `data: [DONE]`.
"""
from __future__ import annotations

from flask import Blueprint
from marshmallow import ValidationError, fields, validates_schema

from app import sse
from app.completions import serve
from app.fields import SEED_RANGE, StrictFloat, StrictInteger, StrictString
from dispatcher.common.fields import INT_MAX
from app.bodies import parse_json_body
from app.requests import validate
from app.responses import Result
from app.schemas import CompletionRequestSchema, doc, in_range
from dispatcher.common import protocol as P

bp = Blueprint("fim", __name__)

# Mistral's fields, by attribute name (the wire name of `seed` is `random_seed`)
FIM_FIELDS = ("model", "prompt", "suffix", "max_tokens", "max_completion_tokens",
              "min_tokens", "temperature", "top_p", "stop", "seed", "stream",
              "frequency_penalty", "presence_penalty", "metadata", "prompt_cache_key")
UNUSED = ("metadata", "prompt_cache_key")       # accepted, with no meaning here
PASSED_ON = tuple(name for name in FIM_FIELDS if name not in UNUSED)


class FimRequestSchema(CompletionRequestSchema):
    """Mistral's FIM request: `/v1/completions`' fields of the same meaning, strict."""

    dialects = False

    prompt = StrictString(required=True, metadata=doc(
        "The code before the cursor.", type="string"))
    suffix = StrictString(load_default=None, allow_none=True, metadata=doc(
        "The code after the cursor: the completion fills the middle. Without it, a plain "
        "completion of the prompt (Mistral's meaning).", type="string"))
    temperature = StrictFloat(load_default=0.7, allow_none=True, validate=in_range(0.0, 2.0),
                              metadata=doc("0 is greedy; default 0.7, the top of "
                                            "Mistral's recommended range for code.",
                                            type="number", minimum=0, maximum=2,
                                            default=0.7))
    metadata = fields.Dict(load_default=None, allow_none=True, metadata=doc(
        "Accepted and not used.", type="object"))
    prompt_cache_key = StrictString(load_default=None, allow_none=True, metadata=doc(
        "Accepted and not used: the prompt cache is automatic.", type="string"))
    max_tokens = StrictInteger(load_default=None, allow_none=True,
                               validate=in_range(0, INT_MAX), metadata=doc(
                                   "Tokens to generate; null: until the end of sequence "
                                   "or of the context.", type="integer", minimum=0))
    max_completion_tokens = StrictInteger(load_default=None, allow_none=True,
                                          validate=in_range(0, INT_MAX), metadata=doc(
                                              "The same as max_tokens (OpenAI's newer "
                                              "name).", type="integer", minimum=0))
    seed = StrictInteger(data_key="random_seed", load_default=None, allow_none=True,
                         validate=in_range(SEED_RANGE[0], SEED_RANGE[1]), metadata=doc(
                             "Same seed and parameters → same text.", type="integer"))

    @validates_schema
    def check_fim(self, data, **kwargs):
        if data.get("prompt") == "" and not data.get("suffix"):
            # (code to complete: with nothing before the cursor and nothing after it
            # there is none; /v1/completions' "" is OpenAI's start of a document)
            raise ValidationError("Must not be empty.", "prompt")
        both = data.get("max_tokens"), data.get("max_completion_tokens")
        if None not in both and both[0] != both[1]:
            raise ValidationError("max_tokens and max_completion_tokens are the same "
                                  "setting and differ here.", "max_completion_tokens")


FIM_SCHEMA = FimRequestSchema(only=FIM_FIELDS)


def completion_request(data: dict) -> dict:
    """The validated FIM body as a `/v1/completions` request (validated again, whole)."""
    limit = data.pop("max_completion_tokens", None)
    if data.get("max_tokens") is None:
        data["max_tokens"] = limit
    return validate({k: v for k, v in data.items() if k in PASSED_ON})


@bp.post("/v1/fim/completions")
def create_fim_completion():
    req = completion_request(validate(parse_json_body(), FIM_SCHEMA))
    req["parse_special"] = False        # (code to complete: `<eos>` in it is text, as with
    return serve(req, FimResult)        # a suffix; Mistral's prompt is text)


class FimResult(Result):
    """Mistral's answer shape for one prompt and one choice."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.role_sent = False

    def _usage(self) -> dict:
        return sse.usage(self.prompt_tokens[0], self.completion_tokens[0])

    def _object(self, kind: str, choice: dict, usage: dict | None = None) -> dict:
        obj = {"id": self.request_id, "object": kind, "created": self.created,
               "model": self.model, "choices": [choice]}
        if usage is not None:
            obj["usage"] = usage
        return obj

    def body(self) -> dict:
        message = {"role": "assistant", "content": "".join(self.texts[0]),
                   "tool_calls": None, "prefix": False}
        return self._object("chat.completion", {"index": 0, "message": message,
                                                "finish_reason": self.finish[0]},
                            self._usage())

    def chunk(self, job_index: int, event: P.AnyEvent) -> bytes | None:
        if isinstance(event, P.Text):
            delta = {"content": event.text}
            if not self.role_sent:
                delta = {"role": "assistant", **delta}
                self.role_sent = True
            return sse.event(self._object("chat.completion.chunk", {
                "index": 0, "delta": delta, "finish_reason": None}))
        if isinstance(event, P.End):
            return sse.event(self._object("chat.completion.chunk", {
                "index": 0, "delta": {"content": ""},
                "finish_reason": event.finish_reason}, self._usage()))
        return None

    def trailer(self, error: bool) -> list[bytes]:
        return [sse.DONE]
