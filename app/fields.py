"""marshmallow fields for JSON as OpenAI's API reads it: strict numbers, booleans and
strings (no coercion), and the compound fields of the completion request (prompt forms,
stop strings, logit bias, string lists), with the limits they enforce (JSON schemas are
bounded by dispatcher.common.schemagrammar, grammars by dispatcher.common.grammar)."""
from __future__ import annotations

import math
import numbers
import re

from marshmallow import ValidationError, fields

from dispatcher.common import fields as F
from dispatcher.common.fields import INT_MAX, SAMPLER_ALIASES, SAMPLER_NAMES, TEXT_BIAS


# another name a field is sent under -> the field: llama.cpp's names for OpenAI's, and the
# aliases the field declarations name (dispatcher.common.fields)
ALIASES = {"n_predict": "max_tokens", "n_cmpl": "n",
           **{knob.alias: knob.name for knob in F.KNOBS.values() if knob.alias}}


MAX_STOP_STRINGS = 256
MAX_STOP_LENGTH = 512
# ... and characters in all: each generated token's text is checked against every stop
# string where it could begin (workers/textstream.py), about this many steps at worst
MAX_STOP_CHARS = 16384
MAX_PROMPTS = 64
# Texts in one prompt of llama.cpp's mixed form ([12, "text", 34]): a worker tokenizes
# each on its own, a call of microseconds: three million empty strings, within the body's
# bound, held the generation loop for seconds a choice (the watchdog's mark)
MAX_PROMPT_TEXTS = 1024
MAX_CHOICES = 128
MAX_LOGPROBS = 5
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)


_TOKEN_ID = re.compile(r"-?[0-9]{1,10}")     # a token id written as a JSON object key


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class StrictFloat(fields.Field):
    """A JSON number (not a string, not a boolean), finite, as a float."""

    default_error_messages = {"invalid": "Must be a number."}

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self.make_error("invalid")
        try:
            value = float(value)
        except OverflowError:            # a JSON integer of 310+ digits
            raise self.make_error("invalid") from None
        if not math.isfinite(value):
            raise self.make_error("invalid")
        return value


class StrictInteger(fields.Field):
    """A JSON integer (not a string, not a boolean, not 1.5)."""

    default_error_messages = {"invalid": "Must be an integer."}

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, float) and value.is_integer() and not isinstance(value, bool):
            value = int(value)
        if not _is_int(value):
            raise self.make_error("invalid")
        return int(value)


class _ExactType(fields.Field):
    """A JSON value of exactly `json_type`, no coercion."""

    json_type: type = object

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, self.json_type):
            raise self.make_error("invalid")
        return value


class StrictBoolean(_ExactType):
    """A JSON true or false."""

    json_type = bool
    default_error_messages = {"invalid": "Must be true or false."}


class StrictString(_ExactType):
    """A JSON string."""

    json_type = str
    default_error_messages = {"invalid": "Must be a string."}


class JSONObject(_ExactType):
    """Any JSON object."""

    json_type = dict
    default_error_messages = {"invalid": "Must be a JSON object."}


class PromptField(fields.Field):
    """OpenAI's and llama.cpp's prompt forms, as a list of prompts.

    A string; an array of strings (a batch); an array of token ids; an array of
    token-id arrays (a batch); llama.cpp's mix of ids and strings `[12, "text", 34]`
    (one prompt), also as batch elements. Each prompt comes out as a string or as a
    list of ints and strings.
    """

    default_error_messages = {
        "invalid": "Must be a string, an array of strings, an array of token ids, or an "
                   "array of such arrays.",
        "empty": "Must not be empty.",
        "too_many": f"At most {MAX_PROMPTS} prompts in one request.",
        "negative": "Token ids are not negative.",
        "too_large": f"Token ids are at most {INT_MAX}.",
        "too_many_texts": f"At most {MAX_PROMPT_TEXTS} texts in one prompt of token ids "
                          "and texts.",
    }

    def __init__(self, *args, empty_text: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.empty_text = empty_text

    def _deserialize(self, value, attr, data, **kwargs):
        # an empty prompt is the code before a cursor at the start of a file where a
        # suffix follows it (Mistral's FIM, /v1/completions' `suffix`); alone, nothing,
        # but where `empty_text` says it is the start of a document (OpenAI's: the model
        # writes from its BOS; a model without one has no token to start from: a 400)
        suffix = data.get("suffix") if isinstance(data, dict) else None
        fim = (isinstance(suffix, str) and suffix != "") or self.empty_text
        if isinstance(value, str):
            prompts = [value]
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            prompts = list(value)
        elif isinstance(value, list) and value and any(_is_int(v) for v in value):
            prompts = [value]                    # token ids, maybe mixed with text
        elif isinstance(value, list) and value and all(isinstance(v, (list, str))
                                                       for v in value):
            prompts = list(value)
        elif value == []:
            raise self.make_error("empty")
        else:
            raise self.make_error("invalid")
        if len(prompts) > MAX_PROMPTS:
            raise self.make_error("too_many")
        return [self._one(p, fim) for p in prompts]

    def _one(self, prompt, fim: bool = False):
        if isinstance(prompt, str):
            if prompt == "" and not fim:
                raise self.make_error("empty")
            return prompt
        if not prompt or all(isinstance(p, str) and p == "" for p in prompt):
            raise self.make_error("empty")
        if all(type(p) is int for p in prompt):     # token ids alone: one pass at C speed
            if min(prompt) < 0:                     # (a million took 1.1 s item by item)
                raise self.make_error("negative")
            if max(prompt) > INT_MAX:               # (2**63 and up broke the worker's
                raise self.make_error("too_large")  # int64 arrays: a 500)
            return list(prompt)
        texts = 0
        for part in prompt:
            if _is_int(part):
                if part < 0:
                    raise self.make_error("negative")
                if part > INT_MAX:
                    raise self.make_error("too_large")
            elif not isinstance(part, str):
                raise self.make_error("invalid")
            else:
                texts += 1
                if texts > MAX_PROMPT_TEXTS:
                    raise self.make_error("too_many_texts")
        return [int(p) if _is_int(p) else p for p in prompt]


class BoundedList(fields.List):
    """A JSON array of at most `max_items` items, its length checked before any item is
    (an 8 MB body holds millions: each validated item costs microseconds)."""

    def __init__(self, cls_or_instance, max_items: int, **kwargs):
        super().__init__(cls_or_instance, **kwargs)
        self.max_items = max_items

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, list) and len(value) > self.max_items:
            raise ValidationError(f"At most {self.max_items} items.")
        return super()._deserialize(value, attr, data, **kwargs)


class TokenIdsField(fields.Field):
    """An array of token ids (non-negative integers), checked in one pass: an 8 MB body
    holds four million of them (whether each is in the vocabulary is the worker's)."""

    default_error_messages = {"invalid": "Must be an array of token ids (integers from 0 "
                                         f"to {INT_MAX})."}

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, list):
            raise self.make_error("invalid")
        if not all(type(t) is int for t in value):      # (a whole float: as StrictInteger)
            if not all(type(t) is int or (type(t) is float and t.is_integer())
                       for t in value):
                raise self.make_error("invalid")
            value = [int(t) for t in value]
        if value and (min(value) < 0 or max(value) > INT_MAX):
            raise self.make_error("invalid")
        return list(value)


class StringListField(fields.Field):
    """An array of at most `max_items` non-empty strings of at most `max_length`
    characters, each one of `choices` if given."""

    default_error_messages = {"invalid": "Must be an array of strings."}

    def __init__(self, max_items: int = 64, max_length: int = 256,
                 choices: tuple[str, ...] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.max_items, self.max_length, self.choices = max_items, max_length, choices

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise self.make_error("invalid")
        if len(value) > self.max_items:
            raise ValidationError(f"At most {self.max_items} items.")
        if any(not s or len(s) > self.max_length for s in value):
            raise ValidationError(f"Items are 1 to {self.max_length} characters.")
        if self.choices is not None:
            unknown = [s for s in value if s not in self.choices]
            if unknown:
                raise ValidationError(f"Unknown {unknown[0]!r}; use "
                                      + ", ".join(self.choices) + ".")
        return list(value)


# llama.cpp's one-character sampler names (`"samplers": "edkypmxt"`, its string form)
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma",
                 "m": "min_p", "t": "temperature", "x": "xtc", "i": "infill",
                 "e": "penalties"}
# ... and the spellings its names may take: any case, kebab-case, no separator
SAMPLER_SPELLINGS = {spelling: canonical for name, canonical in [
    *((n, n) for n in SAMPLER_NAMES), *SAMPLER_ALIASES.items(), ("typ", "typ_p")]
    for spelling in (name, name.replace("_", "-"), name.replace("_", ""))}


class SamplerOrderField(StringListField):
    """llama.cpp's `samplers`: an array of names (any case, kebab-case or no separator,
    llama.cpp's aliases) or one string of their characters, as llama-server takes it;
    loaded as the canonical names. A name or character it does not know is refused,
    naming it (llama-server drops it with a log line: a typo silently changed the
    chain)."""

    default_error_messages = {"invalid": "Must be an array of sampler names or a string "
                                         "of sampler characters."}

    def __init__(self, **kwargs):
        super().__init__(max_items=16, max_length=32, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, str):
            if len(value) > self.max_items:
                raise ValidationError(f"At most {self.max_items} samplers.")
            unknown = [c for c in value if c not in SAMPLER_CHARS]
            if unknown:
                raise ValidationError(f"Unknown sampler character {unknown[0]!r}; use "
                                      + ", ".join(f"{c} ({n})" for c, n in
                                                  SAMPLER_CHARS.items()) + ".")
            return [SAMPLER_CHARS[c] for c in value]
        names = super()._deserialize(value, attr, data, **kwargs)
        unknown = [n for n in names if n.lower() not in SAMPLER_SPELLINGS]
        if unknown:
            raise ValidationError(f"Unknown sampler {unknown[0]!r}; use "
                                  + ", ".join(SAMPLER_NAMES) + ".")
        return [SAMPLER_SPELLINGS[n.lower()] for n in names]


class StopField(fields.Field):
    """A string or an array of strings; empty strings are ignored."""

    default_error_messages = {
        "invalid": "Must be a string or an array of strings.",
        "too_many": f"At most {MAX_STOP_STRINGS} stop strings.",
        "too_long": f"A stop string is at most {MAX_STOP_LENGTH} characters.",
        "too_much": f"The stop strings have at most {MAX_STOP_CHARS} characters in all.",
    }

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise self.make_error("invalid")
        value = [s for s in value if s]
        if len(value) > MAX_STOP_STRINGS:
            raise self.make_error("too_many")
        if any(len(s) > MAX_STOP_LENGTH for s in value):
            raise self.make_error("too_long")
        value = list(dict.fromkeys(value))
        if sum(map(len, value)) > MAX_STOP_CHARS:
            raise self.make_error("too_much")
        return value


MAX_BIAS_TEXT = 256        # characters of such a text
MAX_BIAS_TEXTS = 16_384    # ... and of all of them (a worker tokenizes them, ~5 µs each)


def add_biases(a: float, b: float) -> float:
    """Two biases of one token together: their sum, a ban (-100) if either bans."""
    return -100.0 if min(a, b) <= -100 else a + b


class LogitBiasField(fields.Field):
    """OpenAI's `{"token id": bias}` or llama.cpp's `[[id, bias], ...]`, where llama.cpp
    also takes a text for the id (`[["Hello", -0.5]]`: each of its tokens); bias
    -100..100 (-100: never this token, as OpenAI's ban), or `false` (llama.cpp's ban).
    In the list form an id is a JSON integer and a string is always a text, digits too
    (as llama-server: `[["1", false]]` bans the text "1", not token 1). With `text_keys`
    (llama.cpp's own routes, as llama-server) an object's key that is not a token id is
    a text too (`{"Hello": -0.5}`); on OpenAI's route such a key is a 400."""

    default_error_messages = {
        "invalid": "Must map token ids (or, in llama.cpp's [[token, bias]] form and on its "
                   f"routes, texts of at most {MAX_BIAS_TEXT} characters) to numbers from "
                   "-100 to 100.",
        "too_many": "At most 1024 biased tokens.",
        "too_much_text": f"At most {MAX_BIAS_TEXTS} characters of biased texts in all.",
    }

    def __init__(self, *args, text_keys: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_keys = text_keys

    def _deserialize(self, value, attr, data, **kwargs):
        texts_allowed = isinstance(value, list) or self.text_keys
        if isinstance(value, dict):
            pairs = list(value.items())
        elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2
                                             for p in value):
            pairs = [tuple(p) for p in value]
        else:
            raise self.make_error("invalid")
        if len(pairs) > 1024:
            raise self.make_error("too_many")
        out: dict[str, float] = {}
        if texts_allowed and sum(len(t) for t, _ in pairs
                                 if isinstance(t, str)) > MAX_BIAS_TEXTS:
            raise self.make_error("too_much_text")
        for token, bias in pairs:
            text = False
            if isinstance(token, str) and not isinstance(value, list) and \
                    _TOKEN_ID.fullmatch(token.strip()):
                token = int(token)       # ASCII digits only ("²" is a digit to isdigit)
            elif isinstance(token, str) and texts_allowed and \
                    0 < len(token) <= MAX_BIAS_TEXT:
                token, text = TEXT_BIAS + token, True   # (tokenized by the worker)
            if not text and (not _is_int(token) or not 0 <= token <= INT_MAX):
                raise self.make_error("invalid")     # (2**63 and up: the worker's int64, a 500)
            if bias is False:
                bias = -100.0
            if isinstance(bias, bool) or not isinstance(bias, numbers.Real) \
                    or not -100 <= bias <= 100:      # (NaN fails it too; never float())
                raise self.make_error("invalid")
            # (one token named twice, by id and by a text, or twice in one text: the
            # biases add up, as llama-server applies every pair)
            out[str(token)] = add_biases(out.get(str(token), 0.0), float(bias))
        return out
