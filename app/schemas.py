"""marshmallow schemas for the request bodies; every accepted field is declared here.

Numbers and booleans are strict: `"0.5"` is not a temperature and `1` is not `true`,
as in OpenAI's API. Unknown fields are rejected by name. Each field's `metadata` is its
OpenAPI description (`app.openapi` builds /openapi.json from these declarations).
"""
from __future__ import annotations

from marshmallow import (RAISE, Schema, ValidationError, fields, pre_load, validate,
                         validates_schema)

from app.fields import (COMPUTE_KINDS, INT_MAX, MAX_CHOICES, MAX_LOGPROBS,  # noqa: F401
                        MAX_PROMPTS, MAX_STOP_LENGTH, MAX_STOP_STRINGS, SEED_RANGE,
                        JSONObject, LogitBiasField, PromptField, StopField, StrictBoolean,
                        StrictFloat, StrictInteger, StrictString, StringListField,
                        MAX_SCHEMA_COUNT, schema_count_over)
from dispatcher.common import grammar as gbnf
from dispatcher.common.protocol import SAMPLER_ALIASES, SAMPLER_NAMES

# The most candidates the infill sampler may be given (about 2 ms a token at 1,000 on one
# core; 16,000 took 150 ms a token, the whole vocabulary minutes)
MAX_INFILL_CANDIDATES = 1000

def _range(low=None, high=None, **kw):
    return validate.Range(min=low, max=high, **kw)


def _doc(text: str, **extra) -> dict:
    return {"description": text, **extra}


class StreamOptionsSchema(Schema):
    class Meta:
        unknown = RAISE

    include_usage = StrictBoolean(load_default=False, metadata=_doc(
        "Send a last chunk with `usage` and empty `choices`.", type="boolean"))


class CompletionRequestSchema(Schema):
    """POST /v1/completions: OpenAI's fields, llama.cpp's, geniex's."""

    class Meta:
        unknown = RAISE

    # -- OpenAI ------------------------------------------------------------------------
    model = StrictString(load_default=None, allow_none=True, metadata=_doc(
        "Model id or alias (see /v1/models); omitted, null or empty: the served model "
        "(the first of the config when several are).",
        type="string"))
    prompt = PromptField(required=True, metadata=_doc(
        "A string, an array of strings (one choice set per prompt), an array of token "
        "ids, an array of token-id arrays, or llama.cpp's mix `[12, \"text\", 34]`.",
        oneOf=[{"type": "string"}, {"type": "array", "items": {"type": "string"}},
               {"type": "array", "items": {"oneOf": [{"type": "integer"},
                                                     {"type": "string"}]}},
               {"type": "array", "items": {"type": "array"}}]))
    suffix = StrictString(load_default=None, allow_none=True, metadata=_doc(
        "Text after the completion: a fill-in-the-middle request laid out with the "
        "model's FIM tokens (400 if the model has none).", type="string"))
    max_tokens = StrictInteger(
        load_default=16, allow_none=True, validate=_range(-1, INT_MAX),
        metadata=_doc("Tokens to generate; null or -1: until the end of sequence or of the "
                      "context.", type="integer", minimum=-1, maximum=INT_MAX, default=16))
    temperature = StrictFloat(load_default=1.0, allow_none=True, validate=_range(0.0, 2.0),
                              metadata=_doc("0 is greedy.", type="number", minimum=0,
                                            maximum=2, default=1))
    top_p = StrictFloat(load_default=1.0, allow_none=True, validate=_range(0.0, 1.0),
                        metadata=_doc("Nucleus sampling.", type="number", minimum=0,
                                      maximum=1, default=1))
    n = StrictInteger(load_default=1, allow_none=True, validate=_range(1, MAX_CHOICES),
                      metadata=_doc("Choices per prompt.", type="integer", minimum=1,
                                    maximum=MAX_CHOICES, default=1))
    best_of = StrictInteger(load_default=None, allow_none=True, validate=_range(1, 20),
                            metadata=_doc("Candidates per prompt; the n with the highest "
                                          "mean token logprob are returned. ≥ n; not with "
                                          "stream.", type="integer", minimum=1, maximum=20))
    stream = StrictBoolean(load_default=False, allow_none=True,
                           metadata=_doc("Server-Sent Events.", type="boolean",
                                         default=False))
    stream_options = fields.Nested(StreamOptionsSchema, load_default=None, allow_none=True,
                                   metadata=_doc("Only with stream.", type="object"))
    logprobs = StrictInteger(load_default=None, allow_none=True,
                             validate=_range(0, MAX_LOGPROBS), metadata=_doc(
                                 "Return the sampled tokens' logprobs and this many most "
                                 "likely alternatives.", type="integer", minimum=0,
                                 maximum=MAX_LOGPROBS))
    echo = StrictBoolean(load_default=False, allow_none=True, metadata=_doc(
        "Prepend the prompt (and, with logprobs, its tokens' logprobs).", type="boolean",
        default=False))
    stop = StopField(load_default=list, allow_none=True, metadata=_doc(
        "Strings that end the completion; never part of the text.",
        oneOf=[{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                    "maxItems": MAX_STOP_STRINGS}]))
    presence_penalty = StrictFloat(load_default=0.0, allow_none=True,
                                   validate=_range(-2.0, 2.0), metadata=_doc(
                                       "Penalty for tokens already generated at all.",
                                       type="number", minimum=-2, maximum=2, default=0))
    frequency_penalty = StrictFloat(load_default=0.0, allow_none=True,
                                    validate=_range(-2.0, 2.0), metadata=_doc(
                                        "Penalty growing with how often a token was "
                                        "generated.", type="number", minimum=-2, maximum=2,
                                        default=0))
    logit_bias = LogitBiasField(load_default=None, allow_none=True, metadata=_doc(
        "Token id → bias (-100..100); llama.cpp's [[id, bias]] form too, bias false bans.",
        oneOf=[{"type": "object", "additionalProperties": {"type": "number", "minimum": -100,
                                                           "maximum": 100}},
               {"type": "array", "items": {"type": "array"}}]))
    seed = StrictInteger(load_default=None, allow_none=True,
                         validate=_range(SEED_RANGE[0], SEED_RANGE[1]), metadata=_doc(
                             "Same seed and parameters → same text.", type="integer"))
    user = StrictString(load_default=None, allow_none=True,
                        metadata=_doc("Accepted and ignored.", type="string"))
    # -- llama.cpp ---------------------------------------------------------------------
    n_predict = StrictInteger(
        load_default=None, allow_none=True, validate=_range(-1, INT_MAX),
        metadata=_doc("llama.cpp's name for max_tokens.", type="integer", minimum=-1,
                      maximum=INT_MAX))
    top_k = StrictInteger(
        load_default=0, allow_none=True, validate=_range(-1, INT_MAX),
        metadata=_doc("Keep the k most likely tokens; 0 or -1: off.", type="integer",
                      minimum=-1, maximum=INT_MAX, default=0))
    min_p = StrictFloat(load_default=0.0, allow_none=True, validate=_range(0.0, 1.0),
                        metadata=_doc("Drop tokens less likely than min_p × the most "
                                      "likely one; 0: off.", type="number", minimum=0,
                                      maximum=1, default=0))
    typical_p = StrictFloat(load_default=1.0, allow_none=True, validate=_range(0.0, 1.0),
                            metadata=_doc("Locally typical sampling; 1: off.", type="number",
                                          minimum=0, maximum=1, default=1))
    repetition_penalty = StrictFloat(load_default=None, allow_none=True,
                                     validate=_range(0.0, 10.0, min_inclusive=False),
                                     metadata=_doc("1: off.", type="number",
                                                   exclusiveMinimum=0, maximum=10,
                                                   default=1))
    repeat_penalty = StrictFloat(load_default=None, allow_none=True,
                                 validate=_range(0.0, 10.0, min_inclusive=False),
                                 metadata=_doc("llama.cpp's name for repetition_penalty.",
                                               type="number", exclusiveMinimum=0,
                                               maximum=10))
    repeat_last_n = StrictInteger(
        load_default=-1, allow_none=True, validate=_range(-1, INT_MAX),
        metadata=_doc("Tokens the penalties look back over; -1: all generated.",
                      type="integer", minimum=-1, maximum=INT_MAX, default=-1))
    mirostat = StrictInteger(load_default=0, allow_none=True,
                             validate=validate.OneOf([0, 1, 2]), metadata=_doc(
                                 "0 off, 1 Mirostat, 2 Mirostat 2.0.", type="integer",
                                 enum=[0, 1, 2], default=0))
    mirostat_tau = StrictFloat(load_default=5.0, allow_none=True,
                               validate=_range(0.0, 100.0, min_inclusive=False),
                               metadata=_doc("Mirostat target entropy.", type="number",
                                             exclusiveMinimum=0, maximum=100, default=5))
    mirostat_eta = StrictFloat(load_default=0.1, allow_none=True,
                               validate=_range(0.0, 1.0, min_inclusive=False),
                               metadata=_doc("Mirostat learning rate.", type="number",
                                             exclusiveMinimum=0, maximum=1, default=0.1))
    grammar = StrictString(load_default=None, allow_none=True, metadata=_doc(
        "GBNF grammar (root rule `root`) the output must follow.", type="string"))
    json_schema = JSONObject(load_default=None, allow_none=True, metadata=_doc(
        "JSON schema the output must validate against.", type="object"))
    min_tokens = StrictInteger(
        load_default=0, allow_none=True, validate=_range(0, INT_MAX),
        metadata=_doc("No end of sequence before this many tokens.", type="integer",
                      minimum=0, maximum=INT_MAX, default=0))
    ignore_eos = StrictBoolean(load_default=False, allow_none=True, metadata=_doc(
        "Never end at end of sequence.", type="boolean", default=False))
    cache_prompt = StrictBoolean(load_default=True, allow_none=True, metadata=_doc(
        "Reuse the longest prefix of this prompt already in a worker's KV cache "
        "(usage.prompt_tokens_details.cached_tokens says how much).", type="boolean",
        default=True))
    # -- llama.cpp's other samplers and fields (its /completion documents them) ------------
    dry_multiplier = StrictFloat(load_default=0.0, allow_none=True, validate=_range(0.0, 100.0),
                                 metadata=_doc("DRY (don't repeat yourself) strength; 0: off.",
                                               type="number", minimum=0, maximum=100,
                                               default=0))
    dry_base = StrictFloat(load_default=1.75, allow_none=True, validate=_range(1.0, 10.0),
                           metadata=_doc("DRY penalty base.", type="number", minimum=1,
                                         maximum=10, default=1.75))
    dry_allowed_length = StrictInteger(
        load_default=2, allow_none=True, validate=_range(0, INT_MAX),
        metadata=_doc("Repeats up to this long go unpenalized.", type="integer", minimum=0,
                      maximum=INT_MAX, default=2))
    dry_penalty_last_n = StrictInteger(
        load_default=-1, allow_none=True, validate=_range(-1, INT_MAX),
        metadata=_doc("Tokens DRY looks back over; -1: the context, 0: off.", type="integer",
                      minimum=-1, maximum=INT_MAX, default=-1))
    dry_sequence_breakers = StringListField(
        load_default=None, allow_none=True, max_items=16, max_length=64,
        metadata=_doc("Strings that end a repeated sequence for DRY (default \\n, :, \", *).",
                      type="array", items={"type": "string"}))
    xtc_probability = StrictFloat(load_default=0.0, allow_none=True, validate=_range(0.0, 1.0),
                                  metadata=_doc("XTC (exclude top choices) chance; 0: off.",
                                                type="number", minimum=0, maximum=1, default=0))
    xtc_threshold = StrictFloat(load_default=0.1, allow_none=True, validate=_range(0.0, 1.0),
                                metadata=_doc("XTC removes choices above this probability "
                                              "(> 0.5: off).", type="number", minimum=0,
                                              maximum=1, default=0.1))
    top_n_sigma = StrictFloat(load_default=-1.0, allow_none=True, validate=_range(-1.0, 100.0),
                              metadata=_doc("Keep tokens within n standard deviations of the "
                                            "best logit; -1: off.", type="number", minimum=-1,
                                            maximum=100, default=-1))
    dynatemp_range = StrictFloat(load_default=0.0, allow_none=True, validate=_range(0.0, 2.0),
                                 metadata=_doc("Dynamic temperature: temperature ± this, by "
                                               "entropy; 0: off.", type="number", minimum=0,
                                               maximum=2, default=0))
    dynatemp_exponent = StrictFloat(load_default=1.0, allow_none=True,
                                    validate=_range(0.0, 10.0, min_inclusive=False),
                                    metadata=_doc("Dynamic temperature exponent.",
                                                  type="number", exclusiveMinimum=0,
                                                  maximum=10, default=1))
    samplers = StringListField(
        load_default=None, allow_none=True, max_items=16, max_length=32,
        choices=SAMPLER_NAMES + tuple(SAMPLER_ALIASES),
        metadata=_doc("llama.cpp's sampler order (penalties, dry, top_n_sigma, top_k, typ_p, "
                      "top_p, min_p, xtc, temperature, infill); samplers not listed are not "
                      "applied.", type="array", items={"type": "string"}))
    n_probs = StrictInteger(load_default=0, allow_none=True, validate=_range(0, 100),
                            metadata=_doc("llama.cpp: most likely tokens to report per "
                                          "position (native endpoints).", type="integer",
                                          minimum=0, maximum=100, default=0))
    min_keep = StrictInteger(load_default=0, allow_none=True, validate=_range(0, INT_MAX),
                             metadata=_doc("Accepted; the samplers always keep one token.",
                                           type="integer", minimum=0, maximum=INT_MAX,
                                           default=0))
    n_keep = StrictInteger(load_default=0, allow_none=True, validate=_range(-1, INT_MAX),
                           metadata=_doc("Accepted; a prompt never exceeds the context here "
                                         "(longer is a 400), so nothing is shifted out.",
                                         type="integer", minimum=-1, maximum=INT_MAX,
                                         default=0))
    id_slot = StrictInteger(load_default=-1, allow_none=True, validate=_range(-1, INT_MAX),
                            metadata=_doc("Accepted; the dispatcher and the worker choose the "
                                          "slot (by cached prefix).", type="integer",
                                          minimum=-1, maximum=INT_MAX, default=-1))
    return_tokens = StrictBoolean(load_default=False, allow_none=True, metadata=_doc(
        "llama.cpp: also return token ids (native endpoints).", type="boolean",
        default=False))
    timings_per_token = StrictBoolean(load_default=False, allow_none=True, metadata=_doc(
        "Accepted; native answers carry `timings` at the end.", type="boolean",
        default=False))
    post_sampling_probs = StrictBoolean(load_default=False, allow_none=True, metadata=_doc(
        "Accepted; probabilities are the model's, before sampling.", type="boolean",
        default=False))
    draft_max = StrictInteger(
        data_key="speculative.n_max", load_default=None, allow_none=True,
        validate=_range(0, 64), metadata=_doc(
            "llama.cpp's speculative.n_max: at most this many drafted tokens a step for "
            "this request (prompt-lookup speculation); 0: none; default: the server's "
            "--draft-max.", type="integer", minimum=0, maximum=64))
    n_indent = StrictInteger(load_default=0, allow_none=True, validate=_range(0, INT_MAX),
                             metadata=_doc("After the first newline, a line indented less "
                                           "than this ends the completion (llama.cpp).",
                                           type="integer", minimum=0, maximum=INT_MAX,
                                           default=0))
    t_max_predict_ms = StrictFloat(
        load_default=-1.0, allow_none=True, validate=_range(-1.0, 86_400_000.0),
        metadata=_doc("Once a newline has been generated, stop when generating took longer "
                      "than this (llama.cpp); ≤ 0: off.", type="number", minimum=-1,
                      maximum=86400000, default=-1))
    t_max_prompt_ms = StrictFloat(
        load_default=-1.0, allow_none=True, validate=_range(-1.0, 86_400_000.0),
        metadata=_doc("Keep the prefill within this by leaving out the oldest extra context "
                      "chunks (/infill), at the worker's measured rate; ≤ 0: off.",
                      type="number", minimum=-1, maximum=86400000, default=-1))
    # -- geniex ------------------------------------------------------------------------
    nctx = StrictInteger(
        load_default=None, allow_none=True, validate=_range(1, INT_MAX),
        metadata=_doc("This request's context length; goes to a worker with at least this "
                      "context.", type="integer", minimum=1, maximum=INT_MAX))
    ngl = StrictInteger(
        load_default=None, allow_none=True, validate=_range(0, INT_MAX),
        metadata=_doc("0: a worker without offload; N: one with at least N layers "
                      "offloaded.", type="integer", minimum=0, maximum=INT_MAX))
    compute = StrictString(load_default=None, allow_none=True,
                           validate=validate.OneOf(COMPUTE_KINDS), metadata=_doc(
                               "Workers of this kind only.", type="string",
                               enum=list(COMPUTE_KINDS)))

    @pre_load
    def require_object(self, data, **kwargs):
        if not isinstance(data, dict):
            raise ValidationError("The request body must be a JSON object.", "_body")
        return data

    @validates_schema(pass_original=True)
    def check_combinations(self, data, original, **kwargs):
        if data.get("stream_options") is not None and not data.get("stream"):
            raise ValidationError("stream_options is only allowed when stream is true.",
                                  "stream_options")
        n, best_of = data.get("n_cmpl") or data.get("n") or 1, data.get("best_of")
        if best_of is not None and best_of < n:
            raise ValidationError(f"best_of ({best_of}) must be at least n ({n}).",
                                  "best_of")
        if best_of is not None and best_of > 1 and data.get("stream"):
            raise ValidationError("best_of cannot be used with stream.", "best_of")
        prompt = data.get("prompt")
        prompts = len(prompt) if isinstance(prompt, list) else 1
        if prompts * max(n, best_of or 1) > MAX_CHOICES:
            raise ValidationError(f"prompts × max(n, best_of) is at most {MAX_CHOICES}.",
                                  "n")
        samplers = [SAMPLER_ALIASES.get(n, n) for n in data.get("samplers") or []]
        if "infill" in samplers:
            # llama.cpp's infill sampler compares every pair of candidates: over a whole
            # vocabulary that is minutes a token, so a top_k before it bounds the pairs
            top_k = data.get("top_k") or 0
            if "top_k" not in samplers[:samplers.index("infill")] \
                    or not 0 < top_k <= MAX_INFILL_CANDIDATES:
                raise ValidationError(
                    "The infill sampler needs top_k before it in 'samplers', with top_k "
                    f"from 1 to {MAX_INFILL_CANDIDATES} (it compares every pair of the "
                    "candidates it is given).", "samplers")
        if data.get("grammar") is not None and data.get("json_schema") is not None:
            raise ValidationError("Use grammar or json_schema, not both.", "json_schema")
        if data.get("grammar") is not None:
            try:
                gbnf.check(data["grammar"])      # as llama.cpp parses it, bounded
            except gbnf.GrammarError as exc:
                raise ValidationError(f"The grammar cannot be used: {exc}.", "grammar")
        if data.get("json_schema") is not None:
            too_big = schema_count_over(data["json_schema"], MAX_SCHEMA_COUNT)
            if too_big:
                raise ValidationError(f"{too_big} is at most {MAX_SCHEMA_COUNT} here (the "
                                      "grammar built from it grows with it).", "json_schema")
        for alias, name in ALIASES.items():
            if data.get(alias) is not None and original.get(name) is not None \
                    and data[alias] != data[name]:
                raise ValidationError(f"{alias} and {name} are the same setting and "
                                      "differ here.", alias)


ALIASES = {"n_predict": "max_tokens", "repeat_penalty": "repetition_penalty",
           "n_cmpl": "n"}
KEEP_NULL = {"max_tokens", "seed", "model", "stream_options", "user", "suffix", "logprobs",
             "draft_max",
             "best_of", "logit_bias", "grammar", "json_schema", "nctx", "ngl", "compute"}


def normalize(schema: Schema, data: dict, raw: dict) -> dict:
    """Fold aliases into their names; an explicit null means the default, except where
    null has its own meaning."""
    for alias, name in ALIASES.items():
        if data.get(alias) is not None and raw.get(name) is None:
            data[name] = data[alias]
        data.pop(alias, None)
    if data.get("repetition_penalty") is None:
        data["repetition_penalty"] = 1.0
    for name, field in schema.fields.items():
        if name in ALIASES:
            continue
        if data.get(name) is None and name not in KEEP_NULL:
            default = field.load_default
            data[name] = default() if callable(default) else default
    return data


def first_error(messages) -> tuple[str | None, str]:
    """The first (field, message) of a marshmallow error, for OpenAI's `param`/`message`."""
    if isinstance(messages, dict):
        for name, value in messages.items():
            param, text = first_error(value)
            if name in ("_schema", "_body"):
                return param, text
            return (name if param is None else f"{name}.{param}"), text
    if isinstance(messages, list) and messages:
        return first_error(messages[0])
    return None, str(messages)


class _VocabularyRequestSchema(Schema):
    """A request about a model's vocabulary: which model, nothing unknown."""

    class Meta:
        unknown = RAISE

    model = StrictString(load_default=None, allow_none=True,
                         metadata=_doc("Model id or alias; omitted, null or empty: the "
                                       "served model.", type="string"))


class TokenizeRequestSchema(_VocabularyRequestSchema):
    """POST /tokenize (llama.cpp's shape)."""

    content = StrictString(required=True, metadata=_doc("Text to tokenize.", type="string"))
    add_special = StrictBoolean(load_default=False, metadata=_doc(
        "Add BOS (if the model uses one).", type="boolean", default=False))
    with_pieces = StrictBoolean(load_default=False, metadata=_doc(
        "Return {id, piece} objects instead of ids.", type="boolean", default=False))


class DetokenizeRequestSchema(_VocabularyRequestSchema):
    """POST /detokenize (llama.cpp's shape)."""

    tokens = fields.List(StrictInteger(validate=_range(0)), required=True, metadata=_doc(
        "Token ids.", type="array", items={"type": "integer", "minimum": 0}))
