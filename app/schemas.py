"""marshmallow schemas for the request bodies; every accepted field is declared here.

Numbers and booleans are strict: `"0.5"` is not a temperature and `1` is not `true`,
as in OpenAI's API. Unknown fields are rejected by name. Each field's `metadata` is its
OpenAPI description (`app.openapi` builds /openapi.json from these declarations).
"""
from __future__ import annotations

from marshmallow import (EXCLUDE, RAISE, Schema, ValidationError, fields, post_load, pre_load,
                         validate, validates_schema)

from app.fields import (MAX_CHOICES, MAX_LOGPROBS,  # noqa: F401
                        MAX_PROMPTS, MAX_STOP_LENGTH, MAX_STOP_STRINGS, SEED_RANGE,
                        JSONObject, LogitBiasField, PromptField, StopField, StrictBoolean,
                        SamplerOrderField, StrictFloat, StrictInteger, StrictString,
                        StringListField,
                        TokenIdsField)
from app import dialects
from app.fields import ALIASES, SAMPLER_CHARS
from dispatcher.common import fields as F
from dispatcher.common.fields import INT_MAX, SAMPLER_ALIASES, SAMPLER_NAMES

# The most candidates the infill sampler may be given (about 2 ms a token at 1,000 on one
# core; 16,000 took 150 ms a token, the whole vocabulary minutes)
MAX_INFILL_CANDIDATES = 1000

def in_range(low=None, high=None, **kw):
    """A field's bounds (either may be open), as every schema of the front ends states them."""
    return validate.Range(min=low, max=high, **kw)


def doc(text: str, **extra) -> dict:
    """A field's description and OpenAPI extras (its `metadata`)."""
    return {"description": text, **extra}


def _number(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def knob_field(name: str, *, alias: bool = False):
    """The schema field of a request field declared in dispatcher.common.fields: its type,
    range, default and description as declared there."""
    knob = F.KNOBS[name]
    kind = {float: StrictFloat, int: StrictInteger, bool: StrictBoolean,
            str: StrictString}[knob.kind]
    types = {float: "number", int: "integer", bool: "boolean", str: "string"}
    extra = {"type": types[knob.kind]}
    validators = []
    if knob.enum is not None:
        validators.append(validate.OneOf(list(knob.enum)))
        extra["enum"] = list(knob.enum)
    if knob.low is not None or knob.high is not None:
        validators.append(in_range(knob.low, knob.high, min_inclusive=not knob.low_open))
        if knob.low is not None:
            extra["exclusiveMinimum" if knob.low_open else "minimum"] = _number(knob.low)
        if knob.high is not None:
            extra["maximum"] = _number(knob.high)
    if knob.default is not None:
        extra["default"] = _number(knob.default)
    if alias:                   # the same field under its alias: no default of its own
        extra.pop("default", None)
        return kind(load_default=None, allow_none=True, validate=validators or None,
                    metadata=doc(f"Another name of {name} (llama.cpp's).", **extra))
    # an aliased field's default is filled in after the alias is folded in (normalize)
    return kind(load_default=None if knob.alias else knob.default, allow_none=True,
                validate=validators or None, metadata=doc(knob.doc, **extra))


def alias_field(name: str):
    """The field of a declared request field under its alias (`Knob.alias`): the same
    type and range."""
    return knob_field(name, alias=True)


class StreamOptionsSchema(Schema):
    class Meta:
        unknown = RAISE

    include_usage = StrictBoolean(load_default=False, allow_none=True, metadata=doc(
        "Send a last chunk with `usage` and empty `choices`.", type="boolean"))
    continuous_usage_stats = StrictBoolean(
        load_default=None, allow_none=True,
        validate=validate.Equal(False, error="Not supported: usage comes once, in the last "
                                             "chunk (include_usage)."),
        metadata=doc("vLLM's; false (or null) only.", type="boolean"))
    include_obfuscation = StrictBoolean(load_default=None, allow_none=True, metadata=doc(
        "Accepted and ignored (OpenAI pads streamed chunks with random characters; "
        "this server's stream is not padded).", type="boolean"))


class CompletionRequestSchema(Schema):
    """POST /v1/completions: OpenAI's fields, llama.cpp's, geniex's."""

    class Meta:
        unknown = RAISE

    # -- OpenAI ------------------------------------------------------------------------
    model = StrictString(load_default=None, allow_none=True, metadata=doc(
        "Model id or alias (see /v1/models); omitted, null or empty: the served model "
        "(the first of the config when several are).",
        type="string"))
    prompt = PromptField(required=True, empty_text=True, metadata=doc(
        "A string, an array of strings (one choice set per prompt), an array of token "
        "ids, an array of token-id arrays, or llama.cpp's mix `[12, \"text\", 34]`; "
        "`\"\"` is the start of a document (as OpenAI's).",
        oneOf=[{"type": "string"}, {"type": "array", "items": {"type": "string"}},
               {"type": "array", "items": {"oneOf": [{"type": "integer"},
                                                     {"type": "string"}]}},
               {"type": "array", "items": {"type": "array"}}]))
    suffix = StrictString(load_default=None, allow_none=True, metadata=doc(
        "Text after the completion: a fill-in-the-middle request laid out with the "
        "model's FIM tokens (400 if the model has none).", type="string"))
    max_tokens = StrictInteger(
        load_default=16, allow_none=True, validate=in_range(-1, INT_MAX),
        metadata=doc("Tokens to generate; null or -1: until the end of sequence or of the "
                      "context.", type="integer", minimum=-1, maximum=INT_MAX, default=16))
    temperature = knob_field("temperature")
    top_p = knob_field("top_p")
    n = StrictInteger(load_default=1, allow_none=True, validate=in_range(1, MAX_CHOICES),
                      metadata=doc("Choices per prompt.", type="integer", minimum=1,
                                    maximum=MAX_CHOICES, default=1))
    best_of = StrictInteger(load_default=None, allow_none=True, validate=in_range(1, 20),
                            metadata=doc("Candidates per prompt; the n with the highest "
                                          "mean token logprob are returned. ≥ n; not with "
                                          "stream.", type="integer", minimum=1, maximum=20))
    stream = StrictBoolean(load_default=False, allow_none=True,
                           metadata=doc("Server-Sent Events.", type="boolean",
                                         default=False))
    stream_options = fields.Nested(StreamOptionsSchema, load_default=None, allow_none=True,
                                   metadata=doc("Only with stream.", type="object"))
    logprobs = StrictInteger(load_default=None, allow_none=True,
                             validate=in_range(0, MAX_LOGPROBS), metadata=doc(
                                 "Return the sampled tokens' logprobs and this many most "
                                 "likely alternatives.", type="integer", minimum=0,
                                 maximum=MAX_LOGPROBS))
    echo = StrictBoolean(load_default=False, allow_none=True, metadata=doc(
        "Prepend the prompt (and, with logprobs, its tokens' logprobs).", type="boolean",
        default=False))
    stop = StopField(load_default=list, allow_none=True, metadata=doc(
        "Strings that end the completion; never part of the text.",
        oneOf=[{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                    "maxItems": MAX_STOP_STRINGS}]))
    presence_penalty = knob_field("presence_penalty")
    frequency_penalty = knob_field("frequency_penalty")
    logit_bias = LogitBiasField(load_default=None, allow_none=True, metadata=doc(
        F.KNOBS["logit_bias"].doc,
        oneOf=[{"type": "object", "additionalProperties": {"type": "number", "minimum": -100,
                                                           "maximum": 100}},
               {"type": "array", "items": {"type": "array"}}]))
    seed = StrictInteger(load_default=None, allow_none=True,
                         validate=in_range(SEED_RANGE[0], SEED_RANGE[1]), metadata=doc(
                             F.KNOBS["seed"].doc, type="integer"))
    user = StrictString(load_default=None, allow_none=True,
                        metadata=doc("Accepted and ignored.", type="string"))
    # -- llama.cpp ---------------------------------------------------------------------
    n_predict = StrictInteger(
        load_default=None, allow_none=True, validate=in_range(-1, INT_MAX),
        metadata=doc("llama.cpp's name for max_tokens.", type="integer", minimum=-1,
                      maximum=INT_MAX))
    top_k = knob_field("top_k")
    min_p = knob_field("min_p")
    typical_p = knob_field("typical_p")
    repetition_penalty = knob_field("repetition_penalty")
    repeat_penalty = alias_field("repetition_penalty")
    repeat_last_n = knob_field("repeat_last_n")
    mirostat = knob_field("mirostat")
    mirostat_tau = knob_field("mirostat_tau")
    mirostat_eta = knob_field("mirostat_eta")
    grammar = StrictString(load_default=None, allow_none=True, metadata=doc(
        F.KNOBS["grammar"].doc, type="string"))
    json_schema = JSONObject(load_default=None, allow_none=True, metadata=doc(
        F.KNOBS["json_schema"].doc, type="object"))
    response_format = JSONObject(load_default=None, allow_none=True, metadata=doc(
        "OpenAI's structured output, as vLLM takes it on /v1/completions: "
        '{"type": "text"} (none), {"type": "json_object"} (a JSON object), or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} (that '
        "schema, as json_schema); not beside grammar or json_schema.", type="object"))
    min_tokens = knob_field("min_tokens")
    ignore_eos = knob_field("ignore_eos")
    cache_prompt = StrictBoolean(load_default=True, allow_none=True, metadata=doc(
        "Reuse the longest prefix of this prompt already in a worker's KV cache "
        "(usage.prompt_tokens_details.cached_tokens says how much).", type="boolean",
        default=True))
    # -- llama.cpp's other samplers and fields (its /completion documents them) ------------
    dry_multiplier = knob_field("dry_multiplier")
    dry_base = knob_field("dry_base")
    dry_allowed_length = knob_field("dry_allowed_length")
    dry_penalty_last_n = knob_field("dry_penalty_last_n")
    dry_sequence_breakers = StringListField(
        load_default=None, allow_none=True, max_items=16, max_length=64,
        metadata=doc(F.KNOBS["dry_sequence_breakers"].doc,
                      type="array", items={"type": "string"}))
    xtc_probability = knob_field("xtc_probability")
    xtc_threshold = knob_field("xtc_threshold")
    top_n_sigma = knob_field("top_n_sigma")
    dynatemp_range = knob_field("dynatemp_range")
    dynatemp_exponent = knob_field("dynatemp_exponent")
    samplers = SamplerOrderField(
        load_default=None, allow_none=True,
        metadata=doc(F.KNOBS["samplers"].doc + " As llama-server: also one string of "
                     "their characters (" + ", ".join(f"{c} {n}" for c, n in
                                                      SAMPLER_CHARS.items()) + "), names "
                     "in any case, kebab-case or without separators.",
                     oneOf=[{"type": "array", "items": {"type": "string"}},
                            {"type": "string"}]))
    n_probs = StrictInteger(load_default=0, allow_none=True, validate=in_range(0, 100),
                            metadata=doc("llama.cpp: most likely tokens to report per "
                                          "position (native endpoints).", type="integer",
                                          minimum=0, maximum=100, default=0))
    min_keep = StrictInteger(load_default=0, allow_none=True, validate=in_range(0, INT_MAX),
                             metadata=doc("Accepted; the samplers always keep one token.",
                                           type="integer", minimum=0, maximum=INT_MAX,
                                           default=0))
    n_keep = StrictInteger(load_default=0, allow_none=True, validate=in_range(-1, INT_MAX),
                           metadata=doc("Accepted; a prompt never exceeds the context here "
                                         "(longer is a 400), so nothing is shifted out.",
                                         type="integer", minimum=-1, maximum=INT_MAX,
                                         default=0))
    id_slot = StrictInteger(load_default=-1, allow_none=True, validate=in_range(-1, INT_MAX),
                            metadata=doc("Accepted; the dispatcher and the worker choose the "
                                          "slot (by cached prefix).", type="integer",
                                          minimum=-1, maximum=INT_MAX, default=-1))
    return_tokens = StrictBoolean(load_default=False, allow_none=True, metadata=doc(
        "llama.cpp: also return token ids (native endpoints).", type="boolean",
        default=False))
    timings_per_token = StrictBoolean(load_default=False, allow_none=True, metadata=doc(
        "llama.cpp: each streamed chunk carries `timings` so far (native endpoints).",
        type="boolean",
        default=False))
    post_sampling_probs = StrictBoolean(load_default=False, allow_none=True, metadata=doc(
        "llama.cpp: completion_probabilities as `prob`/`top_probs` (probabilities) "
        "instead of `logprob`/`top_logprobs`; here the model's, before the samplers.",
        type="boolean",
        default=False))
    draft_max = StrictInteger(
        data_key="speculative.n_max", load_default=None, allow_none=True,
        validate=in_range(0, 64), metadata=doc(
            "llama.cpp's speculative.n_max: at most this many drafted tokens a step for "
            "this request (prompt-lookup speculation); 0: none; default: the server's "
            "--draft-max.", type="integer", minimum=0, maximum=64))
    n_indent = StrictInteger(load_default=0, allow_none=True, validate=in_range(0, INT_MAX),
                             metadata=doc("After the first newline, a line indented less "
                                           "than this ends the completion (llama.cpp).",
                                           type="integer", minimum=0, maximum=INT_MAX,
                                           default=0))
    t_max_predict_ms = StrictFloat(
        load_default=-1.0, allow_none=True, validate=in_range(-1.0, 86_400_000.0),
        metadata=doc("Once a newline has been generated, stop when generating took longer "
                      "than this (llama.cpp); ≤ 0: off.", type="number", minimum=-1,
                      maximum=86400000, default=-1))
    t_max_prompt_ms = StrictFloat(
        load_default=-1.0, allow_none=True, validate=in_range(-1.0, 86_400_000.0),
        metadata=doc("Keep the prefill within this by leaving out the oldest extra context "
                      "chunks (/infill), at the worker's measured rate; ≤ 0: off.",
                      type="number", minimum=-1, maximum=86400000, default=-1))
    # -- geniex ------------------------------------------------------------------------
    nctx = knob_field("nctx")
    ngl = knob_field("ngl")
    compute = knob_field("compute")

    dialects = True         # Ollama's and vLLM's fields folded in (app.dialects)

    @pre_load
    def require_object(self, data, **kwargs):
        if not isinstance(data, dict):
            raise ValidationError("The request body must be a JSON object.", "_body")
        return dialects.fold(data) if getattr(self, "dialects", False) else data

    @post_load
    def structured_output(self, data, **kwargs):
        """`response_format` as the `json_schema` it asks for (checked in
        check_combinations), then dropped: nothing past the schema reads it."""
        schema = response_schema(data.pop("response_format", None))
        if schema is not None:
            data["json_schema"] = schema
        return data

    @staticmethod
    def random_seed(seed: int) -> bool:
        """Whether the seed asks for a random one: -1, llama.cpp's (its default)."""
        return seed == -1

    @validates_schema(pass_original=True)
    def check_combinations(self, data, original, **kwargs):
        if data.get("stream_options") is not None and not data.get("stream"):
            raise ValidationError("stream_options is only allowed when stream is true.",
                                  "stream_options")
        n, best_of = data.get("n_cmpl") or data.get("n") or 1, data.get("best_of")
        if best_of is not None and best_of < n:
            raise ValidationError(f"best_of ({best_of}) must be at least n ({n}).",
                                  "best_of")
        if best_of is not None and best_of > n and data.get("stream"):
            # (best_of equal to n chooses nothing: every candidate is a choice, streamed)
            raise ValidationError("best_of greater than n cannot be used with stream.",
                                  "best_of")
        if data.get("echo") and data.get("suffix") is not None:
            # (the prompt the model reads is the fill-in-the-middle layout, suffix and
            # all: echoed, its text and its logprobs would not be the prompt sent)
            raise ValidationError("echo is not supported with suffix.", "echo")
        prompt = data.get("prompt")
        prompts = len(prompt) if isinstance(prompt, list) else 1
        if prompts * max(n, best_of or 1) > MAX_CHOICES:
            # (named by the field that set the count)
            raise ValidationError(f"prompts × max(n, best_of) is at most {MAX_CHOICES}.",
                                  "best_of" if (best_of or 1) > n else
                                  "n_cmpl" if data.get("n_cmpl") else "n")
        samplers = [SAMPLER_ALIASES.get(n, n) for n in data.get("samplers") or []]
        twice = sorted({n for n in samplers if samplers.count(n) > 1})
        if twice:
            # each is a pass over the candidates every token: ["penalties"] × 16 was 16
            # passes over the whole vocabulary for every token of every stream
            raise ValidationError(f"Each sampler may be named once in 'samplers' "
                                  f"({', '.join(twice)} more than once).", "samplers")
        if "infill" in samplers:
            # llama.cpp's infill sampler compares every pair of candidates: over a whole
            # vocabulary that is minutes a token, so a top_k before it bounds the pairs
            top_k = data.get("top_k")
            if top_k is None:                   # (null: the route's default)
                top_k = self.fields["top_k"].load_default or 0
            if "top_k" not in samplers[:samplers.index("infill")] \
                    or not 0 < top_k <= MAX_INFILL_CANDIDATES:
                raise ValidationError(
                    "The infill sampler needs top_k before it in 'samplers', with top_k "
                    f"from 1 to {MAX_INFILL_CANDIDATES} (it compares every pair of the "
                    "candidates it is given).", "samplers")
        # (an empty grammar is none, as llama.cpp reads it: UIs send "" by default)
        if data.get("grammar") and data.get("json_schema") is not None:
            raise ValidationError("Use grammar or json_schema, not both.", "json_schema")
        if response_schema(data.get("response_format")) is not None and \
                (data.get("grammar") or data.get("json_schema") is not None):
            raise ValidationError("Use one of grammar, json_schema and response_format.",
                                  "response_format")
        # (the grammar itself is checked by app.requests.validate, remembered per tenant)
        for alias, name in ALIASES.items():
            if data.get(alias) is not None and original.get(name) is not None \
                    and data[alias] != data[name]:
                raise ValidationError(f"{alias} and {name} are the same setting and "
                                      "differ here.", alias)


RESPONSE_TYPES = ("text", "json_object", "json_schema")


def response_schema(fmt: dict | None) -> dict | None:
    """The JSON schema a `response_format` asks for (None: none, `text`), or a
    ValidationError naming what is wrong with it."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in RESPONSE_TYPES:
        raise ValidationError(f"response_format's type must be one of "
                              f"{', '.join(RESPONSE_TYPES)}.", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        # (llama-server's own form carries its schema beside the type)
        return fmt["schema"] if isinstance(fmt.get("schema"), dict) else {"type": "object"}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValidationError("response_format of type json_schema needs json_schema."
                              "schema, a JSON schema object.", "response_format")
    return spec["schema"]


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
    for knob in F.SAMPLING:
        if knob.alias and data.get(knob.name) is None:
            data[knob.name] = knob.default
    if data.get("seed") is not None and schema.random_seed(data["seed"]):
        data["seed"] = None
    if data.get("grammar") == "":       # llama.cpp's "no grammar"
        data["grammar"] = None
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
            if name in ("_schema", "_body") and text != "Unknown field.":
                return param, text              # (one the schema raised, not a field)
            return (name if param is None else f"{name}.{param}"), text
    if isinstance(messages, list) and messages:
        return first_error(messages[0])
    return None, str(messages)


class _VocabularyRequestSchema(Schema):
    """A request about a model's vocabulary (llama.cpp's native routes): which model;
    unknown fields ignored, as llama-server does (llama.vscode sends its own)."""

    class Meta:
        unknown = EXCLUDE

    @pre_load
    def require_object(self, data, **kwargs):
        # (a list, a string or null was marshmallow's "Invalid input type.", no field named)
        return CompletionRequestSchema.require_object(self, data)

    model = StrictString(load_default=None, allow_none=True,
                         metadata=doc("Model id or alias; omitted, null or empty: the "
                                       "served model.", type="string"))


class TokenizeRequestSchema(_VocabularyRequestSchema):
    """POST /tokenize (llama.cpp's shape)."""

    content = StrictString(required=True, metadata=doc("Text to tokenize.", type="string"))
    add_special = StrictBoolean(load_default=False, metadata=doc(
        "Add BOS (if the model uses one).", type="boolean", default=False))
    with_pieces = StrictBoolean(load_default=False, metadata=doc(
        "Return {id, piece} objects instead of ids.", type="boolean", default=False))
    parse_special = StrictBoolean(load_default=True, metadata=doc(
        "Parse special-token text (`<start_of_turn>`) as those tokens (llama.cpp's "
        "default); false: tokenize it as plain text.", type="boolean", default=True))


class DetokenizeRequestSchema(_VocabularyRequestSchema):
    """POST /detokenize (llama.cpp's shape)."""

    tokens = TokenIdsField(required=True, metadata=doc(
        "Token ids.", type="array", items={"type": "integer", "minimum": 0,
                                           "maximum": INT_MAX}))
