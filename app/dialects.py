"""Fields other servers' clients send to an OpenAI-style `/v1/completions`, folded into
this server's own before the schema reads the body (which refuses a field it does not
know by name, as OpenAI does).

Ollama's (`options`, `keep_alive`, `raw`): twinny's "openai-compatible" provider and
editor configs copied from Ollama's examples send them to any server; vLLM and
llama-server drop them unread, so `options.num_predict` (the answer's length) and the
sampling options were lost there. Here each option that has a meaning becomes its field;
an Ollama runtime setting (its context, GPU layers, threads, ...) is this server's
configuration and is left out; any other option is refused by name.

vLLM's extra sampling fields (sent through the openai SDK's `extra_body`, LangChain's
`model_kwargs`): those asking for what this server does anyway are accepted and dropped
(`skip_special_tokens: true`, `include_stop_str_in_output: false`, beam search off, ...);
`guided_json` and `guided_choice` become a JSON schema and a grammar; any other value is
refused by name (served as if it had not been sent, its answer would not be the one
asked for).
"""
from __future__ import annotations

import json

from marshmallow import ValidationError

from app.bodies import unencodable_field
from app.fields import ALIASES

# Ollama's options -> this server's fields
OLLAMA_OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature",
                  "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "typical_p": "typical_p", "seed": "seed", "stop": "stop",
                  "repeat_penalty": "repetition_penalty", "repeat_last_n": "repeat_last_n",
                  "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty", "mirostat": "mirostat",
                  "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta"}
# ... and its runtime settings: the server's configuration here, not a request's
OLLAMA_RUNTIME = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread",
                            "num_keep", "use_mmap", "use_mlock", "low_vram", "numa",
                            "vocab_only", "f16_kv", "logits_all", "penalize_newline"})
OLLAMA_DROPPED = ("keep_alive", "raw")

# vLLM's fields whose value asks for what this server does: (accepted values, or None for
# any) and what it means
VLLM_SAME = {
    "skip_special_tokens": ((True,), "control tokens are never written as text here"),
    "spaces_between_special_tokens": (None, "control tokens are never written here"),
    "include_stop_str_in_output": ((False,), "a stop string is never part of the text"),
    "use_beam_search": ((False,), "there is no beam search"),
    "length_penalty": (None, "beam search's alone"),
    "early_stopping": ((False,), "beam search's alone"),
    "priority": (None, "requests are served in their turn"),
    "add_special_tokens": ((True,), "a BOS is added in front of leading text"),
    "stop_token_ids": (([], None), "use stop strings"),
    "bad_words": (([], None), "use logit_bias"),
    "allowed_token_ids": (([], None), "use logit_bias or a grammar"),
    "truncate_prompt_tokens": ((None,), "a prompt over the context is refused"),
    "prompt_logprobs": ((None,), "use echo with logprobs"),
    "return_tokens_as_token_ids": ((False, None), "tokens are text here"),
    "guided_regex": ((None,), "use a grammar (GBNF) or json_schema"),
    "guided_grammar": ((None,), "use grammar, in GBNF"),
    "guided_decoding_backend": (None, "the grammar engine is llama.cpp's"),
    "guided_whitespace_pattern": ((None,), "the schema's grammar sets the spaces"),
}
MAX_CHOICE_STRINGS = 1024
MAX_CHOICE_CHARS = 64 * 1024


def fold(data: dict) -> dict:
    """`data` with Ollama's and vLLM's fields made this server's, or a ValidationError
    naming the one that cannot be."""
    if not any(k in data for k in ("options", *OLLAMA_DROPPED, "guided_json",
                                   "guided_choice", *VLLM_SAME)):
        return data
    data = dict(data)
    for name in OLLAMA_DROPPED:
        data.pop(name, None)
    options = data.pop("options", None)
    if options is not None:
        if not isinstance(options, dict):
            raise ValidationError("options (Ollama's) must be an object.", "options")
        for key, value in options.items():
            if key in OLLAMA_RUNTIME:
                continue
            name = OLLAMA_OPTIONS.get(key)
            if name is None:
                raise ValidationError(f"Ollama's option {str(key)[:64]!r} has no meaning "
                                      "here.", "options")
            for given in (name, *_aliases_of(name)):    # (llama.cpp's n_predict too)
                if data.get(given) is not None and _differ(data[given], value, name):
                    raise ValidationError(f"options.{key} and {given} are the same "
                                          "setting and differ here.", "options")
            data[name] = value
    for name, (accepted, why) in VLLM_SAME.items():
        if name not in data:
            continue
        value = data.pop(name)
        if accepted is not None and not any(value == a and type(value) is type(a)
                                            for a in accepted):
            raise ValidationError(f"{name} {json.dumps(value)[:64]} is not supported "
                                  f"({why}).", name)
    _guided(data)
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _aliases_of(name: str) -> list[str]:
    return [alias for alias, target in ALIASES.items() if target == name]


def _differ(given, option, name: str) -> bool:
    if name == "stop":                      # ("\n" and ["\n"] are one stop)
        given, option = ([v] if isinstance(v, str) else v for v in (given, option))
    return given != option


def _guided(data: dict) -> None:
    """vLLM's guided_json as json_schema, guided_choice as a grammar of its strings."""
    schema, choices = data.pop("guided_json", None), data.pop("guided_choice", None)
    if schema is None and choices is None:
        return
    if schema is not None and choices is not None:
        raise ValidationError("Use guided_json or guided_choice, not both.", "guided_choice")
    taken = [k for k in ("grammar", "json_schema", "response_format") if data.get(k)
             and not (k == "response_format" and isinstance(data[k], dict)
                      and data[k].get("type") == "text")]      # (text: no format)
    if taken:
        raise ValidationError(f"Use guided_json or guided_choice, or {taken[0]}, not both.",
                              "guided_json" if schema is not None else "guided_choice")
    if schema is not None:
        if isinstance(schema, str):             # (vLLM takes the schema as JSON text too)
            try:                                # (strict, as the body: no NaN; nested
                schema = json.loads(schema, parse_constant=_no_constant)   # past json's
            except (ValueError, RecursionError):                           # depth: none)
                schema = None
        if not isinstance(schema, dict):
            raise ValidationError("guided_json must be a JSON schema object.",
                                  "guided_json")
        if unencodable_field(schema) is not None:    # (escaped in the text, past the
            raise ValidationError("guided_json holds a lone UTF-16 surrogate, which is "
                                  "not a Unicode character.", "guided_json")   # body's check)
        data["json_schema"] = schema
        return
    if not isinstance(choices, list) or not choices or \
            not all(isinstance(c, str) and c for c in choices) or \
            len(choices) > MAX_CHOICE_STRINGS or \
            sum(len(c) for c in choices) > MAX_CHOICE_CHARS:
        raise ValidationError(f"guided_choice must be a list of at most "
                              f"{MAX_CHOICE_STRINGS} non-empty strings "
                              f"({MAX_CHOICE_CHARS:,} characters in all).", "guided_choice")
    data["grammar"] = "root ::= " + " | ".join(_gbnf_literal(c) for c in dict.fromkeys(choices))


def _gbnf_literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    escaped = []
    for ch in text:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif ch == "\n":
            escaped.append("\\n")
        elif ch == "\r":
            escaped.append("\\r")
        elif ch == "\t":
            escaped.append("\\t")
        elif ord(ch) < 0x20 or ch == "\x7f":
            escaped.append(f"\\x{ord(ch):02x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'
