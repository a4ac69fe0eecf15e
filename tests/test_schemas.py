"""Request validation: every field, strict types, errors naming the field (unit)."""
import pytest
from flask import Flask

from app.bodies import parse_json_body
from app.requests import validate
from app.errors import InvalidRequest, UnsupportedMediaType
from app.schemas import CompletionRequestSchema
from dispatcher.common.tenantlru import TenantLRU


def test_defaults_follow_openai():
    req = validate({"prompt": "hi"})
    assert req["max_tokens"] == 16
    assert req["temperature"] == 1.0 and req["top_p"] == 1.0
    assert req["stop"] == [] and req["stream"] is False and req["echo"] is False
    assert req["model"] is None


@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ["hi"]),
    (["hi"], ["hi"]),
    (["a", "b"], ["a", "b"]),                          # a batch of two
    ([1, 2, 3], [[1, 2, 3]]),                          # token ids: one prompt
    ([[1, 2], [3]], [[1, 2], [3]]),                    # a batch of token prompts
    ([12, "text", 34], [[12, "text", 34]]),            # llama.cpp's mix: one prompt
    ([[12, "x"], "y"], [[12, "x"], "y"]),              # mixed batch
])
def test_prompt_forms_become_a_list_of_prompts(prompt, prompts):
    assert validate({"prompt": prompt})["prompt"] == prompts


def test_an_empty_prompt_is_the_start_of_a_document_as_openai_has_it():
    """OpenAI (and vLLM, llama-server, for a model with a BOS) write from the start of a
    document for `""`: it was a 400 here. An empty list or token list is still none."""
    assert validate({"prompt": ""})["prompt"] == [""]
    assert validate({"prompt": ["a", ""]})["prompt"] == ["a", ""]
    for empty in ([], [[]], [""] * 0):
        with pytest.raises(InvalidRequest):
            validate({"prompt": empty})


def test_a_prompt_of_ids_and_texts_has_at_most_max_prompt_texts_texts():
    """A worker tokenizes each text of llama.cpp's mixed form on its own: three million
    empty strings (within the body's bound; a prompt of one token, by its size) held
    the generation loop for seconds a choice, past the watchdog's mark."""
    from app.fields import MAX_PROMPT_TEXTS
    assert validate({"prompt": [0] + [""] * MAX_PROMPT_TEXTS})["prompt"][0][0] == 0
    for prompt in ([0] + [""] * (MAX_PROMPT_TEXTS + 1), [[0, "a"], [0] + ["b"] * 2000]):
        with pytest.raises(InvalidRequest) as caught:
            validate({"prompt": prompt})
        assert "texts in one prompt" in str(caught.value)


def test_stop_string_becomes_a_list_without_empties_or_duplicates():
    assert validate({"prompt": "p", "stop": "\n"})["stop"] == ["\n"]
    assert validate({"prompt": "p", "stop": ["a", "", "a", "b"]})["stop"] == ["a", "b"]


def test_best_of_equal_to_n_streams_it_chooses_nothing():
    req = validate({"prompt": "p", "n": 2, "best_of": 2, "stream": True})
    assert (req["n"], req["best_of"], req["stream"]) == (2, 2, True)


def test_explicit_null_means_default_but_max_tokens_null_means_unlimited():
    req = validate({"prompt": "p", "temperature": None, "max_tokens": None, "stop": None})
    assert req["temperature"] == 1.0 and req["stop"] == []
    assert req["max_tokens"] is None


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, 2.5]}, "prompt"),
    ({"prompt": [[1], [True]]}, "prompt"),
    ({"prompt": ["x"] * 65}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "p", "n": 0}, "n"),
    ({"prompt": "p", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "p", "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "p", "n": 2, "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": ["p"] * 10, "n": 20}, "n"),
    ({"prompt": ["p"] * 10, "n": 1, "best_of": 20}, "best_of"),     # (the one that set it)
    ({"prompt": "p", "logprobs": 6}, "logprobs"),
    ({"prompt": "p", "logprobs": True}, "logprobs"),
    ({"prompt": "p", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "p", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "p", "logit_bias": [[5]]}, "logit_bias"),
    # echoed, the fill-in-the-middle layout (suffix and all) is not the prompt sent
    ({"prompt": "p", "suffix": "s", "echo": True}, "echo"),
    # texts a worker tokenizes: 16 Ki characters of them in all (1,024 of 256 were seconds)
    ({"prompt": "p", "logit_bias": [["%04d" % i + "x" * 252, -1] for i in range(65)]},
     "logit_bias"),
    ({"prompt": "p", "mirostat": 3}, "mirostat"),
    ({"prompt": "p", "samplers": ["penalties"] * 16}, "samplers"),
    ({"prompt": "p", "samplers": ["top_k", "typ_p", "typical_p"]}, "samplers"),
    ({"prompt": "p", "mirostat_tau": 0}, "mirostat_tau"),
    ({"prompt": "p", "typical_p": 1.5}, "typical_p"),
    ({"prompt": "p", "grammar": 'root ::= "a"', "json_schema": {}}, "json_schema"),
    ({"prompt": "p", "json_schema": "{}"}, "json_schema"),
    ({"prompt": "p", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "p", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "p", "compute": "tpu"}, "compute"),
    ({"prompt": "p", "nctx": 0}, "nctx"),
    ({"prompt": "p", "ngl": -1}, "ngl"),
    ({"prompt": "p", "suffix": 3}, "suffix"),
    ({"prompt": "p", "n_predict": 5, "max_tokens": 6}, "n_predict"),
    ({"prompt": "p", "repeat_penalty": 1.1, "repetition_penalty": 1.2}, "repeat_penalty"),
    ({"prompt": "p", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "p", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "p", "max_tokens": True}, "max_tokens"),
    ({"prompt": "p", "max_tokens": -2}, "max_tokens"),
    ({"prompt": "p", "temperature": 2.5}, "temperature"),
    ({"prompt": "p", "temperature": "0.5"}, "temperature"),
    ({"prompt": "p", "top_p": 1.1}, "top_p"),
    ({"prompt": "p", "top_k": -5}, "top_k"),
    ({"prompt": "p", "min_p": -0.1}, "min_p"),
    ({"prompt": "p", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "p", "frequency_penalty": -2.1}, "frequency_penalty"),
    ({"prompt": "p", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "p", "seed": "1"}, "seed"),
    ({"prompt": "p", "seed": 2 ** 70}, "seed"),
    ({"prompt": "p", "stop": [1]}, "stop"),
    ({"prompt": "p", "stop": ["x"] * 257}, "stop"),
    ({"prompt": "p", "echo": 1}, "echo"),
    ({"prompt": "p", "stream": "true"}, "stream"),
    ({"prompt": "p", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "p", "stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus"),
    ({"prompt": "p", "model": 7}, "model"),
    ({"prompt": "p", "no_such_field": 1}, "no_such_field"),
])
def test_bad_fields_are_rejected_naming_the_field(body, param):
    with pytest.raises(InvalidRequest) as info:
        validate(body)
    assert info.value.param == param
    assert info.value.status == 400
    assert param.split(".")[-1] in info.value.message


def test_unknown_field_message_names_it_as_openai_does():
    with pytest.raises(InvalidRequest) as info:
        validate({"prompt": "p", "best_off": 2})
    assert info.value.message == "Unrecognized request argument supplied: best_off"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "p", "_schema": 1}, "_schema"),          # marshmallow's own error keys,
    ({"prompt": "p", "_body": 1}, "_body"),              # as field names
    ({"prompt": "p", "stream": True, "stream_options": {"_schema": 1}},
     "stream_options._schema"),
])
def test_an_unknown_field_named_as_marshmallows_error_keys_is_named(body, param):
    with pytest.raises(InvalidRequest) as info:
        validate(body)
    assert info.value.param == param
    assert info.value.message == f"Unrecognized request argument supplied: {param}"


def test_a_null_in_stream_options_means_its_default():
    req = validate({"prompt": "p", "stream": True, "stream_options": {
        "include_usage": None, "include_obfuscation": None}})
    assert not req["stream_options"]["include_usage"]


def test_body_must_be_an_object():
    with pytest.raises(InvalidRequest):
        validate(["prompt"])


@pytest.fixture
def flask_app():
    return Flask(__name__)


@pytest.mark.parametrize("data", [b'{"prompt": NaN}', b'{"prompt": Infinity}', b"{",
                                  b"\xff\xfe", b"[" * 100000 + b"]" * 100000])
def test_body_that_is_not_strict_json_is_a_400(flask_app, data):
    with flask_app.test_request_context(data=data, content_type="application/json"):
        with pytest.raises(InvalidRequest):
            parse_json_body()


def test_json_body_without_content_type_is_accepted(flask_app):
    with flask_app.test_request_context(data=b'{"prompt": "x"}'):
        assert parse_json_body() == {"prompt": "x"}


def test_other_content_types_are_a_415(flask_app):
    with flask_app.test_request_context(data=b"prompt=x",
                                        content_type="application/x-www-form-urlencoded"):
        with pytest.raises(UnsupportedMediaType):
            parse_json_body()


def test_aliases_fold_into_their_openai_names():
    req = validate({"prompt": "p", "n_predict": 7, "repeat_penalty": 1.3})
    assert req["max_tokens"] == 7 and req["repetition_penalty"] == 1.3
    assert "n_predict" not in req and "repeat_penalty" not in req
    assert validate({"prompt": "p"})["repetition_penalty"] == 1.0


def test_llama_cpps_random_seed_and_empty_grammar_mean_none():
    """seed -1 is llama.cpp's default, "a random seed" (it drew the same fixed seed every
    time); grammar "" is its "no grammar" (UIs send it; it was a 400)."""
    req = validate({"prompt": "p", "seed": -1, "grammar": ""})
    assert req["seed"] is None and req["grammar"] is None
    assert validate({"prompt": "p", "seed": -2})["seed"] == -2
    made = validate({"prompt": "p", "grammar": "", "json_schema": {"type": "object"}})
    assert made["grammar"] == validate({"prompt": "p", "json_schema": {"type": "object"}})[
        "grammar"]                                      # (the schema's, not a refusal)


def test_the_openai_packages_stream_options_are_taken():
    """openai's types declare stream_options.include_obfuscation: sent, it was a 400."""
    req = validate({"prompt": "p", "stream": True, "stream_options": {
        "include_usage": True, "include_obfuscation": False}})
    assert req["stream_options"]["include_usage"] is True


def test_logit_bias_forms():
    assert validate({"prompt": "p", "logit_bias": {"5": -100, "7": 2.5}})["logit_bias"] == \
        {"5": -100.0, "7": 2.5}
    assert validate({"prompt": "p", "logit_bias": [[5, False], [7, 1]]})["logit_bias"] == \
        {"5": -100.0, "7": 1.0}
    # in the list form a string is a text, digits too (llama-server's [["1", false]] bans
    # the text "1"; token 1 is an end token on many vocabularies)
    from dispatcher.common.fields import TEXT_BIAS
    assert validate({"prompt": "p", "logit_bias": [["1", False], [" 7", 2]]})[
        "logit_bias"] == {TEXT_BIAS + "1": -100.0, TEXT_BIAS + " 7": 2.0}


def test_a_bias_of_minus_100_is_a_ban_to_the_sampler():
    """OpenAI's -100 and llama.cpp's `false` ban their token: -inf to the chain (a grammar
    that then allows only banned tokens ends the request with a 400)."""
    from workers.sampling import SamplingParams
    params = SamplingParams.from_job({"logit_bias": {"5": -100.0, "6": -99.5, "7": 3}})
    assert params.logit_bias == {5: float("-inf"), 6: -99.5, 7: 3.0}


def test_every_openai_completions_field_is_declared():
    openai_fields = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias",
                     "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
                     "stream", "stream_options", "suffix", "temperature", "top_p", "user"}
    assert openai_fields <= set(CompletionRequestSchema().fields)


def test_grammar_and_schema_sizes_that_would_hurt_a_worker_are_refused():
    deep = "root ::= " + "(" * 101 + '"a"' + ")" * 101
    with pytest.raises(InvalidRequest) as info:
        validate({"prompt": "p", "grammar": deep})
    assert info.value.param == "grammar"
    validate({"prompt": "p", "grammar": 'root ::= "((((" [(] ' + "(" * 50 + '"a"' + ")" * 50})
    with pytest.raises(InvalidRequest) as info:
        validate({"prompt": "p", "json_schema": {"type": "object", "properties": {
            "s": {"type": "string", "maxLength": 2_000_000_000}}}})
    assert info.value.param == "json_schema"
    validate({"prompt": "p", "json_schema": {"type": "array", "maxItems": 150}})
    # (an array's bounds without `items` are kept now: 2,000 of any value is refused as
    # 2,000 integers always were; the converter's bare array had left the bound out)
    with pytest.raises(InvalidRequest) as info:
        validate({"prompt": "p", "json_schema": {"type": "array", "maxItems": 2000}})
    assert info.value.param == "json_schema"


def test_a_grammar_is_checked_once_however_often_it_is_sent(monkeypatch):
    """Clients send one grammar with every request, and its check costs up to ~0.8 s of a
    pool thread: what the check said of each of the last grammars is kept by digest,
    refusals too, a bounded number of them, and per tenant (another key's grammar
    answered at once would tell that it was sent)."""
    from app import requests as R
    from dispatcher.common import grammar as gbnf
    calls = []
    check = gbnf.check
    monkeypatch.setattr(gbnf, "check", lambda g: calls.append(g) or check(g))
    monkeypatch.setattr(R, "_checked", TenantLRU(R.GRAMMARS_KEPT))
    good, bad = 'root ::= "yes" | "no"', 'root ::= undefined-rule'
    for _ in range(3):
        validate({"prompt": "p", "grammar": good})
        with pytest.raises(InvalidRequest) as info:
            validate({"prompt": "p", "grammar": bad})
        assert info.value.param == "grammar" and "undefined" in str(info.value)
    assert calls == [good, bad]
    for i in range(R.GRAMMARS_KEPT + 10):
        R.grammar_refusal(f'root ::= "{i}"')
    assert len(R._checked) == R.GRAMMARS_KEPT
    validate({"prompt": "p", "grammar": good})              # (pushed out: checked again)
    assert calls.count(good) == 2
    assert R.grammar_refusal(good, scope="key-b") is None and calls.count(good) == 3


def test_grammar_checks_run_a_few_at_a_time_and_one_at_a_time_per_key(monkeypatch):
    """A check holds a pool thread and the GIL for up to ~0.8 s: a key sending new large
    grammars at once took every thread, and every request of the front end waited to be
    validated. Checks not remembered run GRAMMAR_CHECKS at a time, one per key; a check
    that cannot start within CHECK_WAIT is a 503 server_busy."""
    import threading

    from app import requests as R
    from app.errors import ServiceUnavailable
    from dispatcher.common import grammar as gbnf
    release, started = threading.Event(), []
    check = gbnf.check
    monkeypatch.setattr(gbnf, "check", lambda g: (started.append(g), release.wait(10),
                                                  check(g))[2])
    monkeypatch.setattr(R, "_checked", TenantLRU(R.GRAMMARS_KEPT))
    monkeypatch.setattr(R, "_check_slots", [threading.BoundedSemaphore(R.GRAMMAR_CHECKS)])
    monkeypatch.setattr(R, "_own_checks", {})
    monkeypatch.setattr(R, "CHECK_WAIT", 0.3)
    outcomes = {}

    def run(name, scope, grammar):
        try:
            outcomes[name] = R.checked_grammar(grammar, None, scope)   # (any cache scope)
        except ServiceUnavailable as exc:
            outcomes[name] = exc.code
    threads = []
    for name, scope, grammar in (("a1", "a", 'root ::= "1"'), ("b1", "b", 'root ::= "3"'),
                                 ("a2", "a", 'root ::= "2"'), ("c1", "c", 'root ::= "4"')):
        threads.append(threading.Thread(target=run, args=(name, scope, grammar)))
        threads[-1].start()
        while name in ("a1", "b1") and len(started) < len(threads):   # (a1, b1 checking)
            threading.Event().wait(0.01)
    threads[2].join()
    threads[3].join()
    assert outcomes == {"a2": "server_busy", "c1": "server_busy"}    # key a's turn; 2 slots
    release.set()
    for thread in threads:
        thread.join()
    assert outcomes["a1"] is None and outcomes["b1"] is None
    started.clear()
    assert R.checked_grammar('root ::= "1"', None, "a") is None and not started   # kept


def test_each_request_field_is_declared_once_and_every_layer_follows_it():
    """dispatcher.common.fields declares every sampling and routing field: the schema
    has each (and each alias, folded into it), with the declared default and range; the
    worker's SamplingParams has each sampling field with the declared default; each
    routing field names a capability of protocol.Route. Fails when one layer drifts."""
    from dataclasses import MISSING, fields as dataclass_fields

    from dispatcher.common import fields as F, protocol as P
    from workers.sampling import SamplingParams
    from app.schemas import ALIASES, CompletionRequestSchema
    schema = CompletionRequestSchema().fields
    params = {f.name: f for f in dataclass_fields(SamplingParams)}
    for knob in F.KNOBS.values():
        assert knob.name in schema, knob.name
        if knob.alias:
            assert ALIASES[knob.alias] == knob.name and knob.alias in schema
        if knob.built:
            field = schema[knob.name]
            assert field.load_default == (None if knob.alias else knob.default), knob.name
            ranges = [v for v in field.validators if hasattr(v, "min")]
            if knob.low is not None or knob.high is not None:
                assert (ranges[0].min, ranges[0].max) == (knob.low, knob.high), knob.name
                if knob.alias:
                    alias = [v for v in schema[knob.alias].validators if hasattr(v, "min")]
                    assert (alias[0].min, alias[0].max) == (knob.low, knob.high)
        if knob in F.SAMPLING and knob.name != "json_schema":     # (-> grammar)
            field = params[knob.name]
            value = field.default_factory() if field.default is MISSING else field.default
            # (logit_bias: none is an empty table to the worker)
            assert value == knob.default or (knob.default is None and value == {}), \
                (knob.name, value, knob.default)
        if knob.route:
            assert knob.route in P.Route.__struct_fields__, knob.name


@pytest.mark.parametrize("given, loaded", [
    ("edkypmxt", ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc",
                  "temperature"]),                    # llama.vscode's string form
    (["Top-K", "nucleus", "min-p", "temp", "typ"],
     ["top_k", "top_p", "min_p", "temperature", "typ_p"]),
    (["TOPK", "topnsigma", "typical-p"], ["top_k", "top_n_sigma", "typ_p"]),
    (["top_k", "temperature"], ["top_k", "temperature"]),
])
def test_samplers_take_llama_servers_forms_as_canonical_names(given, loaded):
    """llama-server takes `samplers` as names in any case, kebab-case or without
    separators, or as one string of characters: here they were a 400."""
    assert validate({"prompt": "p", "samplers": given})["samplers"] == loaded


@pytest.mark.parametrize("given, says", [
    ("edka", "Unknown sampler character 'a'"), (["top-x"], "Unknown sampler 'top-x'"),
    (5, "Must be an array of sampler names or a string"), ("k" * 17, "At most 16")])
def test_a_sampler_nobody_knows_is_named_in_the_400(given, says):
    with pytest.raises(InvalidRequest) as info:
        validate({"prompt": "p", "samplers": given})
    assert info.value.param == "samplers" and says in info.value.message


def test_a_token_named_twice_gets_both_biases_and_a_ban_stays_one():
    """llama-server applies every pair of `logit_bias`: one token named by id and by a
    text, or twice, gets the sum (the last one won here). A ban with anything is a ban."""
    assert validate({"prompt": "p", "logit_bias": [[5, 1.5], [5, 2]]})["logit_bias"] == \
        {"5": 3.5}
    assert validate({"prompt": "p", "logit_bias": [[5, False], [5, 50]]})["logit_bias"] == \
        {"5": -100.0}
    from types import SimpleNamespace

    from dispatcher.common import protocol as P
    from dispatcher.common.fields import TEXT_BIAS
    from workers.preparation import sampling_of

    class Vocabulary:                     # a text is its characters' codes, as tokens
        def tokenize(self, text, add_special, parse_special):
            return [ord(c) for c in text]
    biases = {TEXT_BIAS + "aab": 1.0, "97": 0.5, TEXT_BIAS + "b": -100.0}
    gen = SimpleNamespace(sampling=P.Sampling(logit_bias=biases))
    assert sampling_of(gen, Vocabulary())["logit_bias"] == {"97": 2.5, "98": -100.0}


def test_the_native_routes_read_logprobs_as_n_probs():
    """As llama-server: OpenAI's `logprobs` count is n_probs where n_probs is not sent (it
    was taken as OpenAI's, never shown in the native answer, and over 5 a 400)."""
    from app.native import NativeCompletionSchema
    schema = NativeCompletionSchema()
    loaded = validate({"prompt": "p", "logprobs": 10}, schema)
    assert loaded["n_probs"] == 10 and loaded.get("logprobs") is None
    loaded = validate({"prompt": "p", "logprobs": 3, "n_probs": 2}, schema)
    assert loaded["n_probs"] == 2 and loaded.get("logprobs") is None
    with pytest.raises(InvalidRequest):
        validate({"prompt": "p", "logprobs": "3"}, schema)
    # a whole float is its integer, as every count field reads it (6.0 was OpenAI's
    # logprobs, over 5 a 400, 2.0 computed and never shown)
    loaded = validate({"prompt": "p", "logprobs": 6.0}, schema)
    assert loaded["n_probs"] == 6 and loaded.get("logprobs") is None


def test_the_native_routes_read_max_completion_tokens_after_n_predict():
    """llama-server's limit: `n_predict`, else `max_completion_tokens`, else `max_tokens`
    (dropped as an unknown field, an answer asked for 64 tokens had no limit)."""
    from app.native import NativeCompletionSchema
    schema = NativeCompletionSchema()
    assert validate({"prompt": "p", "max_completion_tokens": 64}, schema)["max_tokens"] == 64
    assert validate({"prompt": "p", "max_completion_tokens": 64, "max_tokens": 8},
                    schema)["max_tokens"] == 64
    assert validate({"prompt": "p", "max_completion_tokens": 64, "n_predict": 8},
                    schema)["max_tokens"] == 8
    with pytest.raises(InvalidRequest):
        validate({"prompt": "p", "max_completion_tokens": "64"}, schema)


def test_mirostat_leaves_out_the_penalties_and_dry():
    """llama.cpp's Mirostat chain is logit bias, temperature, Mirostat: a request's
    repeat_penalty or DRY beside it was applied here, never there."""
    from workers.sampling import SamplingParams
    params = SamplingParams.from_job({"mirostat": 2, "repetition_penalty": 1.3,
                                      "presence_penalty": 0.5, "dry_multiplier": 0.8})
    assert not params.penalized and params.dry_multiplier == 0.0
    plain = SamplingParams.from_job({"repetition_penalty": 1.3, "dry_multiplier": 0.8})
    assert plain.penalized and plain.dry_multiplier == 0.8


def test_response_format_asks_for_a_schema_in_openais_and_llama_servers_forms():
    """OpenAI's {"type": "json_schema", "json_schema": {"schema": ...}}, llama-server's
    {"type": "json_object", "schema": ...} (its schema, not any object), a bare
    json_object (any object); `text` or null is no constraint, beside a grammar too;
    llama.cpp's own routes ignore it, as llama-server's do."""
    from app.native import NativeCompletionSchema
    schema = {"type": "object", "properties": {"zebra": {"type": "integer"}},
              "required": ["zebra"]}
    for fmt in ({"type": "json_schema", "json_schema": {"name": "z", "schema": schema}},
                {"type": "json_object", "schema": schema}):
        assert "zebra" in validate({"prompt": "p", "response_format": fmt})["grammar"]
    assert "zebra" not in validate({"prompt": "p", "response_format": {
        "type": "json_object"}})["grammar"]
    for fmt in ({"type": "text"}, None):
        assert validate({"prompt": "p", "response_format": fmt,
                         "grammar": 'root ::= "a"'})["grammar"] == 'root ::= "a"'
    native = NativeCompletionSchema()
    assert "response_format" not in native.fields


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2 ** 63, 5]}, "prompt"),
    ({"prompt": [1, "x", 2 ** 63]}, "prompt"),
    ({"prompt": [[1, 2], [2 ** 31]]}, "prompt"),
    ({"prompt": "x", "logit_bias": [[2 ** 63, False]]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [[2 ** 31, -100]]}, "logit_bias"),
])
def test_token_ids_past_int_max_are_a_400(body, param):
    """A prompt id or a biased id of 2**63 or more passed the front end and broke the
    worker's int64 arrays (numpy's OverflowError: a 500 generation_failed); one past
    INT_MAX is no token of any vocabulary."""
    with pytest.raises(InvalidRequest) as info:
        validate(body)
    assert info.value.param == param
    assert validate({"prompt": [1, 2 ** 31 - 1]})["prompt"] == [[1, 2 ** 31 - 1]]


def test_a_lone_surrogates_field_path_is_quoted_back_clipped():
    """The path of a field holding a lone surrogate was quoted whole, in the message and
    in `param`: a key of 200,000 characters made an answer of 400 KB (an 8 MiB body's,
    16 MB, encoded on the front end's loop)."""
    from app.bodies import MAX_PARAM, check_encodable
    with pytest.raises(InvalidRequest) as info:
        check_encodable({"prompt": "x", "k" * 200_000 + "\ud800": 1})
    assert len(info.value.param) <= MAX_PARAM + 1 and len(str(info.value)) < 500
    assert info.value.code == "invalid_unicode"


def test_vllms_guided_fields_become_a_schema_and_a_checked_grammar():
    """guided_choice's strings, quotes, backslashes and control characters included, are
    a grammar llama.cpp's parser takes (the front end's check runs on it); guided_json,
    an object or its JSON text, the json_schema; beside another constraint, a 400."""
    from dispatcher.common import grammar as gbnf
    loaded = validate({"prompt": "p", "guided_choice": ['say "hi"', "a\\b", "x\ny\t\x01", "é"]})
    gbnf.check(loaded["grammar"])
    assert loaded["grammar"].startswith('root ::= "say \\"hi\\"" | "a\\\\b" | ')
    assert validate({"prompt": "p", "guided_json": '{"type": "boolean"}'})["grammar"]
    for body, param in (({"prompt": "p", "guided_json": {"type": "integer"},
                          "grammar": 'root ::= "1"'}, "guided_json"),
                        ({"prompt": "p", "guided_choice": []}, "guided_choice"),
                        ({"prompt": "p", "guided_choice": ["a"] * 2000}, "guided_choice"),
                        ({"prompt": "p", "guided_json": "not json"}, "guided_json"),
                        ({"prompt": "p", "guided_json": "[" * 100_000}, "guided_json"),
                        ({"prompt": "p", "guided_json": '{"minimum": NaN}'}, "guided_json"),
                        ({"prompt": "p", "guided_json": '{"enum": ["\\ud800"]}'},
                         "guided_json"),
                        ({"prompt": "p", "options": {"num_predict": 5}, "max_tokens": 6},
                         "options"),
                        ({"prompt": "p", "options": {"num_predict": 5}, "n_predict": 6},
                         "options"),
                        ({"prompt": "p", "options": {"repeat_penalty": 1.3},
                          "repeat_penalty": 1.1}, "options")):
        with pytest.raises(InvalidRequest) as info:
            validate(body)
        assert info.value.param == param, body
