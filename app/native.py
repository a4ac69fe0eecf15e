"""llama.cpp's native API on the same stack: `POST /completion`, `POST /completions` and
`POST /infill` (what llama.vim, llama.vscode, Continue's llama.cpp provider and Tabby post).

llama.cpp's conventions, not OpenAI's: its sampling defaults, `n_predict` -1 (until end
of sequence) by default, unknown fields ignored (logged at debug), answers and stream
events in its shape (`content`, `stop`, `stop_type`, `timings`, ...), no `[DONE]`.
Validation, queueing, routing, workers and errors are the OpenAI endpoint's.
"""
from __future__ import annotations

import logging
import math

from flask import Blueprint, current_app, request
from marshmallow import EXCLUDE, Schema, fields, pre_load
from marshmallow.validate import Length

from app import sse
from app.client import get_client
from app.completions import serve
from app.errors import NotSupported, PayloadTooLarge
from app.fields import (MAX_CHOICES, BoundedList, LogitBiasField, StrictFloat, StrictInteger,
                        StrictString)
from dispatcher.common.fields import INT_MAX
from app.bodies import parse_json_body
from app.requests import resolve_model, validate
from app.schemas import CompletionRequestSchema, doc, in_range
from dispatcher.common import fields as F, protocol as P

bp = Blueprint("native", __name__)
MAX_EXTRA_CHUNKS = 256          # llama.vim's ring holds 16 by default
MAX_FILENAME = 4096             # a chunk's file name: a path (Linux's PATH_MAX)
MAX_RESPONSE_FIELDS = 64        # paths in `response_fields` (llama.vim asks for 13) ...
MAX_FIELD_PATH = 256            # ... of at most this many characters each
log = logging.getLogger(__name__)


# OpenAI's fields llama-server does not take on its own routes: ignored there as any
# unknown field (`echo` put the prompt into `content` and forced prompt logprobs that were
# thrown away; `suffix` made a /completion a fill-in-the-middle one, a 400 on a model
# without FIM tokens; `best_of`: a llama.cpp client reads one answer, not a list)
OPENAI_ONLY = ("best_of", "echo", "suffix", "response_format")   # (llama-server's native
# routes ignore response_format: they constrain with grammar and json_schema)


class NativeCompletionSchema(CompletionRequestSchema):
    """POST /completion: the OpenAI endpoint's fields with llama.cpp's defaults; fields
    it does not know are ignored, as llama.cpp does (OpenAI's `best_of` among them: a
    llama.cpp client gets the one answer it reads, not a list of unselected ones)."""

    class Meta:
        unknown = EXCLUDE
        exclude = OPENAI_ONLY

    dialects = False        # (unknown fields are ignored here, as llama-server does)

    @pre_load
    def logprobs_as_n_probs(self, data, **kwargs):
        """OpenAI's `logprobs` count is llama-server's `n_probs` where that is not given
        (as llama-server reads it; it was taken as OpenAI's, its probabilities never
        shown, and a count over 5 refused)."""
        if isinstance(data, dict) and "logprobs" in data:
            count = data["logprobs"]
            if isinstance(count, float) and count.is_integer():    # (2.0: the count 2, as
                count = int(count)                                 # StrictInteger reads it)
            if count is None or (isinstance(count, int) and not isinstance(count, bool)):
                data = {k: v for k, v in data.items() if k != "logprobs"}
                if count is not None and data.get("n_probs") is None:
                    data["n_probs"] = count
        return data

    @pre_load
    def max_completion_tokens(self, data, **kwargs):
        """llama-server's limit is `n_predict`, else `max_completion_tokens`, else
        `max_tokens` (dropped as an unknown field, it left an answer unlimited)."""
        if isinstance(data, dict) and "max_completion_tokens" in data:
            data = dict(data)
            limit = data.pop("max_completion_tokens")
            if limit is not None and data.get("n_predict") is None:
                data["max_tokens"] = limit
        return data

    @staticmethod
    def random_seed(seed: int) -> bool:
        """llama-server reads the seed as a uint32: -1 and LLAMA_DEFAULT_SEED (the seed
        it reports as its default), any seed that is 4294967295 mod 2^32, draw a random
        one."""
        return F.random_seed(seed)

    max_tokens = StrictInteger(load_default=None, allow_none=True,
                               validate=in_range(-1, INT_MAX), metadata=doc(
                                   "Tokens to generate (n_predict); -1 or null: until the "
                                   "end of sequence.", type="integer"))
    # (llama-server takes a negative temperature as greedy, and clients send -1 so)
    temperature = StrictFloat(load_default=0.8, allow_none=True, validate=in_range(-2.0, 2.0),
                              metadata=doc("llama.cpp's default 0.8; 0 or below: greedy.",
                                           type="number"))
    top_k = StrictInteger(load_default=40, allow_none=True, validate=in_range(-1, INT_MAX),
                          metadata=doc("llama.cpp's default 40.", type="integer"))
    top_p = StrictFloat(load_default=0.95, allow_none=True, validate=in_range(0.0, 1.0),
                        metadata=doc("llama.cpp's default 0.95.", type="number"))
    min_p = StrictFloat(load_default=0.05, allow_none=True, validate=in_range(0.0, 1.0),
                        metadata=doc("llama.cpp's default 0.05.", type="number"))
    repeat_last_n = StrictInteger(load_default=64, allow_none=True,
                                  validate=in_range(-1, INT_MAX),
                                  metadata=doc("llama.cpp's default 64.", type="integer"))
    logit_bias = LogitBiasField(text_keys=True, load_default=None, allow_none=True,
                                metadata=doc(
        "Token id → bias (-100..100, or `false`; -100 and `false` ban), as an object or "
        "`[[id, bias]]`; as llama-server, an object's key that is not a token id is a "
        "text, and in the list form a string always is (`\"1\"` too), its bias given to "
        "each of its tokens (`{\"Hello\": -0.5}`, `[[\"Hello\", -0.5]]`).",
        oneOf=[{"type": "object", "additionalProperties": {"type": "number", "minimum": -100,
                                                           "maximum": 100}},
               {"type": "array", "items": {"type": "array"}}]))
    n_cmpl = StrictInteger(load_default=None, allow_none=True,
                           validate=in_range(1, MAX_CHOICES), metadata=doc(
                               "Completions of the prompt (llama.vscode sends 3): the "
                               "answer is then a list, as llama.cpp's.", type="integer",
                               minimum=1, maximum=MAX_CHOICES))
    response_fields = BoundedList(StrictString(validate=Length(max=MAX_FIELD_PATH)),
                                  max_items=MAX_RESPONSE_FIELDS, load_default=None,
                                  allow_none=True,
                                  metadata=doc("Only these fields of the answer, by path "
                                                "(`timings/prompt_n`), flat.", type="array",
                                                maxItems=MAX_RESPONSE_FIELDS,
                                                items={"type": "string",
                                                       "maxLength": MAX_FIELD_PATH}))


class ExtraChunkSchema(Schema):
    class Meta:
        unknown = EXCLUDE

    filename = StrictString(load_default="tmp", allow_none=True,
                            validate=Length(max=MAX_FILENAME),
                            metadata=doc(f"The chunk's file name (at most {MAX_FILENAME} "
                                         "characters).", type="string"))
    text = StrictString(load_default="", allow_none=True,
                        metadata=doc("The chunk's text.", type="string"))


class NativeInfillSchema(NativeCompletionSchema):
    """POST /infill: the code before and after the cursor, repository context, and the
    text already typed on the cursor's line (`prompt`, placed after FIM_MID)."""

    prompt = StrictString(load_default="", allow_none=True, metadata=doc(
        "Text already typed on the cursor's line: placed after FIM_MID.", type="string"))
    input_prefix = StrictString(load_default="", allow_none=True, metadata=doc(
        "The code before the cursor.", type="string"))
    input_suffix = StrictString(load_default="", allow_none=True, metadata=doc(
        "The code after the cursor.", type="string"))
    input_extra = BoundedList(fields.Nested(ExtraChunkSchema), max_items=MAX_EXTRA_CHUNKS,
                              load_default=list, allow_none=True,
                              metadata=doc(
                                  "Repository context, oldest first: {filename, text} "
                                  "chunks laid out before the prefix (at most "
                                  f"{MAX_EXTRA_CHUNKS}).", type="array",
                                  maxItems=MAX_EXTRA_CHUNKS,
                                  items={"type": "object", "properties": {
                                      "filename": {"type": "string"},
                                      "text": {"type": "string"}}}))


_completion_schema = NativeCompletionSchema()
_infill_schema = NativeInfillSchema()


def _validated(schema: Schema) -> dict:
    body = parse_json_body(any_content_type=True)
    if isinstance(body, dict) and log.isEnabledFor(logging.DEBUG):
        # (only at debug: a body of half a million names took 0.4 s of the loop to sort)
        ignored = sorted(set(body) - set(schema.fields))
        if ignored:
            # names a client chose: bounded, and escaped to one printable line
            names = ", ".join(ascii(name)[1:-1][:64] for name in ignored[:20])
            more = f" and {len(ignored) - 20} more" if len(ignored) > 20 else ""
            log.debug("%s: ignoring fields %s%s", request.path, names, more)
    if isinstance(body, dict) and any(name in body for name in OPENAI_ONLY):
        body = {k: v for k, v in body.items() if k not in OPENAI_ONLY}
    req = validate(body, schema)
    req.update(echo=False, suffix=None)     # (the schema has neither: OPENAI_ONLY)
    return req


@bp.post("/completion")
@bp.post("/completions")
def completion():
    req = _validated(_completion_schema)
    req["model"] = resolve_model(req["model"], get_client(current_app).wait_state(),
                                 any_name=True)
    return serve(req, NativeResult, native=True)


@bp.post("/infill")
def infill():
    req = _validated(_infill_schema)
    state = get_client(current_app).wait_state()
    model = req["model"] = resolve_model(req["model"], state, any_name=True)
    workers = [w for w in state.workers if w.model == model]
    if workers and not any(w.fim for w in workers):
        raise NotSupported(f"Infill is not supported by '{model}': its GGUF has no "
                           "fill-in-the-middle tokens and the server has no --fim-template "
                           "for it")
    extra = [{"filename": "tmp" if c.get("filename") is None else c["filename"],
              "text": c.get("text") or ""}
             for c in req.pop("input_extra") or []]
    limit = int(current_app.config["MAX_PROMPT_CHARS"])
    size = sum(len(c["text"]) + len(c["filename"]) for c in extra) + \
        len(req["input_prefix"] or "") + \
        len(req["input_suffix"] or "") + len(req["prompt"] or "")
    if size > limit:
        # (named by its largest part: the one to shorten)
        parts = {"input_extra": size - len(req["input_prefix"] or "") -
                 len(req["input_suffix"] or "") - len(req["prompt"] or ""),
                 "input_prefix": len(req["input_prefix"] or ""),
                 "input_suffix": len(req["input_suffix"] or ""),
                 "prompt": len(req["prompt"] or "")}
        raise PayloadTooLarge(f"the infill context has {size} characters; this server "
                              f"takes at most {limit}", param=max(parts, key=parts.get),
                              code="prompt_too_large")
    middle = req["prompt"] or ""
    req.update(prompt=[req.pop("input_prefix") or ""], suffix=req.pop("input_suffix") or "")
    return serve(req, NativeResult, native=True, infill=P.Infill(extra=extra, middle=middle))


SETTINGS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_last_n",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "mirostat",
            "mirostat_tau", "mirostat_eta", "seed", "stop", "ignore_eos", "min_tokens",
            "stream", "cache_prompt", "grammar")


def timings(prompt_tokens: int, cached: int, predicted: int, measured: dict | None) -> dict:
    """llama.cpp's `timings` from a job's counts and its worker's milliseconds (the
    prompt's, to the first token; the generation's since)."""
    measured = measured or {}
    prompt_ms = float(measured.get("prompt_ms", 0.0))
    predicted_ms = float(measured.get("predicted_ms", 0.0))
    prompt_n = max(0, prompt_tokens - cached)
    return {
        "cache_n": cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n * 1000.0 / prompt_ms if prompt_ms else 0.0,
        "predicted_n": predicted, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
        "predicted_per_second": predicted * 1000.0 / predicted_ms if predicted_ms else 0.0}


class NativeResult:
    """llama.cpp's answer (`content`, `stop`, `stop_type`, `timings`, ...) assembled from
    the jobs' events; a list when the request had several prompts."""

    def __init__(self, request_id: str, created: int, model: str, req: dict, plans):
        self.request_id, self.model, self.req, self.plans = request_id, model, req, plans
        self.texts: list[list[str]] = [[] for _ in plans]
        self.ids: list[list[int]] = [[] for _ in plans]
        self.probs: list[list[dict]] = [[] for _ in plans]
        self.starts: list[P.Start | None] = [None] * len(plans)
        self.ends: list[P.End | None] = [None] * len(plans)
        self.newline = [False] * len(plans)
        self.streaming = bool(req.get("stream"))

    def add(self, job_index: int, event: P.AnyEvent) -> None:
        if isinstance(event, P.Start):
            self.starts[job_index] = event
        elif isinstance(event, P.Text):
            self.newline[job_index] = self.newline[job_index] or "\n" in event.text
            if not self.streaming:      # (a stream's went out with its chunk: kept, the
                self.texts[job_index].append(event.text)  # probabilities of n × n_predict
                self.ids[job_index] += event.ids or []    # tokens piled up here)
                self.probs[job_index] += event.probs or []
        elif isinstance(event, P.End):
            self.ends[job_index] = event
            if not self.streaming:      # (llama-server's tokens: every one sampled)
                self.ids[job_index] += event.ids or []

    def settings(self) -> dict:
        req = self.req
        out = {name: req.get(name) for name in SETTINGS}
        for name in list(out):          # llama.cpp names a few fields its own way
            knob = F.KNOBS.get(name)
            if knob is not None and knob.alias:
                out[knob.alias] = out.pop(name)
        out["n_predict"] = -1 if req.get("max_tokens") is None else req["max_tokens"]
        out["model"] = self.model
        return out

    def summary(self, i: int, content: str) -> dict:
        start, end = self.starts[i] or P.Start(), self.ends[i] or P.End()
        prompt_tokens = end.usage.prompt_tokens if end.usage else start.prompt_tokens
        cached = start.cached_tokens
        written = end.usage.completion_tokens if end.usage else 0
        # (llama-server counts the end token it sampled among the predicted, as its
        # n_decoded does; OpenAI's usage does not, nor does the cache, which never holds it)
        predicted = written + (1 if end.stop_type == "eos" else 0)
        return {
            "index": i, "content": content, "tokens": self.ids[i],
            "id_slot": -1, "stop": True,
            "model": self.model, "tokens_predicted": predicted,
            # what the slot holds after it (llama-server's n_tokens of the slot's prompt:
            # llama.vim shows it, and warns of a full context by it); the reused prefix
            # is timings.cache_n
            "tokens_evaluated": prompt_tokens, "tokens_cached": prompt_tokens + written,
            "generation_settings": self.settings(), "has_new_line": self.newline[i],
            "truncated": end.truncated, "stop_type": end.stop_type or "limit",
            "stopping_word": end.stopping_word or "",
            "timings": {**timings(prompt_tokens, cached, predicted, end.timings),
                        # llama.cpp's speculative counts
                        "draft_n": int((end.draft or {}).get("proposed", 0)),
                        "draft_n_accepted": int((end.draft or {}).get("accepted", 0))},
            "fingerprint": start.fingerprint,
            # the oldest input_extra chunks left out: to fit the context, or to meet
            # t_max_prompt_ms
            "input_extra_dropped": end.dropped_chunks,
        }

    def body(self):
        bodies = []
        for i, text in enumerate(self.texts):
            summary = self.summary(i, "".join(text))
            if self.req.get("n_probs"):
                summary["completion_probabilities"] = self.probabilities(self.probs[i])
            bodies.append(self.pick(summary))
        return bodies[0] if len(bodies) == 1 else bodies

    def probabilities(self, entries: list) -> list:
        """`completion_probabilities` in the form the request asked for: llama-server's
        `logprob`/`top_logprobs`, or with `post_sampling_probs` its `prob`/`top_probs`
        (clients read those keys). The values here are the model's distribution before
        the samplers either way (llama-server's post-sampling ones are what its sampler
        chain kept), as probabilities in the second form."""
        if not self.req.get("post_sampling_probs"):
            return entries

        def prob(entry: dict) -> dict:
            out = {k: v for k, v in entry.items() if k not in ("logprob", "top_logprobs")}
            logprob = entry.get("logprob")
            out["prob"] = math.exp(logprob) if logprob is not None else 0.0
            return out
        return [{**prob(e), "top_probs": [prob(t) for t in e.get("top_logprobs") or []]}
                for e in entries]

    def pick(self, summary: dict) -> dict:
        """llama.cpp's `response_fields`: only those, by path (`timings/prompt_n`), flat."""
        wanted = self.req.get("response_fields")
        if not wanted:
            return summary
        out = {}
        for path in wanted:
            value = summary
            for key in str(path).split("/"):
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                out[path] = value
        return out

    def chunk(self, job_index: int, event: P.AnyEvent) -> bytes | None:
        if isinstance(event, P.Text):
            start = self.starts[job_index] or P.Start()
            chunk = {"index": job_index, "content": event.text,
                     "tokens": event.ids or [], "stop": False, "id_slot": -1,
                     "tokens_predicted": event.generated,
                     "tokens_evaluated": start.prompt_tokens}
            if self.req.get("n_probs"):
                chunk["completion_probabilities"] = self.probabilities(event.probs or [])
            if event.timings is not None:                # (timings_per_token)
                chunk["timings"] = timings(start.prompt_tokens, start.cached_tokens,
                                           event.generated, event.timings)
            return sse.event(chunk)
        if isinstance(event, P.End):                 # llama.cpp's last event: the summary,
            return sse.event(self.pick(self.summary(job_index, "")))  # response_fields too
        return None

    def trailer(self, error: bool) -> list[bytes]:
        return []                            # llama.cpp's native stream has no [DONE]
