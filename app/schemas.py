"""marshmallow schemas for the request bodies; every accepted field is declared here.

Numbers and booleans are strict: `"0.5"` is not a temperature and `1` is not `true`,
as in OpenAI's API. Unknown fields are rejected by name.
"""
from __future__ import annotations

import math
import numbers

from marshmallow import (RAISE, Schema, ValidationError, fields, pre_load, validate,
                         validates_schema)

MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 512
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)


class StrictFloat(fields.Field):
    """A JSON number (not a string, not a boolean), finite, as a float."""

    default_error_messages = {"invalid": "Must be a number."}

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self.make_error("invalid")
        value = float(value)
        if not math.isfinite(value):
            raise self.make_error("invalid")
        return value


class StrictInteger(fields.Field):
    """A JSON integer (not a string, not a boolean, not 1.5)."""

    default_error_messages = {"invalid": "Must be an integer."}

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, bool):
            raise self.make_error("invalid")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, numbers.Integral):
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


class PromptField(fields.Field):
    """A string, or an array holding exactly one string."""

    default_error_messages = {
        "invalid": "Must be a string or an array of one string.",
        "empty": "Must not be empty.",
    }

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, list):
            if len(value) != 1 or not isinstance(value[0], str):
                raise self.make_error("invalid")
            value = value[0]
        if not isinstance(value, str):
            raise self.make_error("invalid")
        if value == "":
            raise self.make_error("empty")
        return value


class StopField(fields.Field):
    """A string or an array of strings; empty strings are ignored."""

    default_error_messages = {
        "invalid": "Must be a string or an array of strings.",
        "too_many": f"At most {MAX_STOP_STRINGS} stop strings.",
        "too_long": f"A stop string is at most {MAX_STOP_LENGTH} characters.",
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
        return list(dict.fromkeys(value))


class StreamOptionsSchema(Schema):
    class Meta:
        unknown = RAISE

    include_usage = StrictBoolean(load_default=False)


class CompletionRequestSchema(Schema):
    """POST /v1/completions."""

    class Meta:
        unknown = RAISE

    model = StrictString(load_default=None, allow_none=True)
    prompt = PromptField(required=True)
    max_tokens = StrictInteger(load_default=16, allow_none=True,
                               validate=validate.Range(min=-1))
    temperature = StrictFloat(load_default=1.0, allow_none=True,
                              validate=validate.Range(min=0.0, max=2.0))
    top_p = StrictFloat(load_default=1.0, allow_none=True,
                        validate=validate.Range(min=0.0, max=1.0))
    top_k = StrictInteger(load_default=0, allow_none=True, validate=validate.Range(min=-1))
    min_p = StrictFloat(load_default=0.0, allow_none=True,
                        validate=validate.Range(min=0.0, max=1.0))
    stop = StopField(load_default=list, allow_none=True)
    seed = StrictInteger(load_default=None, allow_none=True,
                         validate=validate.Range(min=SEED_RANGE[0], max=SEED_RANGE[1]))
    presence_penalty = StrictFloat(load_default=0.0, allow_none=True,
                                   validate=validate.Range(min=-2.0, max=2.0))
    frequency_penalty = StrictFloat(load_default=0.0, allow_none=True,
                                    validate=validate.Range(min=-2.0, max=2.0))
    repetition_penalty = StrictFloat(load_default=1.0, allow_none=True,
                                     validate=validate.Range(min=0.0, max=10.0,
                                                             min_inclusive=False))
    echo = StrictBoolean(load_default=False, allow_none=True)
    stream = StrictBoolean(load_default=False, allow_none=True)
    stream_options = fields.Nested(StreamOptionsSchema, load_default=None, allow_none=True)
    user = StrictString(load_default=None, allow_none=True)

    @pre_load
    def require_object(self, data, **kwargs):
        if not isinstance(data, dict):
            raise ValidationError("The request body must be a JSON object.", "_body")
        return data

    @validates_schema
    def check_stream_options(self, data, **kwargs):
        if data.get("stream_options") is not None and not data.get("stream"):
            raise ValidationError("stream_options is only allowed when stream is true.",
                                  "stream_options")


def fill_nulls(schema: Schema, data: dict) -> dict:
    """An explicit null means the field's default, except where null has its own meaning."""
    keep_null = {"max_tokens", "seed", "model", "stream_options", "user"}
    for name, field in schema.fields.items():
        if data.get(name) is None and name not in keep_null:
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
