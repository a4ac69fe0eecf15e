"""The whole /v1/completions surface (OpenAI, llama.cpp, geniex, SIE fields) against the
real stack on the bundled model; FIM against a tiny generated GGUF model."""
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from conftest import ServerProcess, SSEStream, http_json

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def port(real_server):
    return real_server.port


@pytest.fixture(scope="module")
def det_port(det_server):
    """For comparisons across concurrent requests (see det_server)."""
    return det_server.port


def complete(port, **body):
    status, headers, payload = http_json(port, "POST", "/v1/completions", body)
    assert status == 200, payload
    return payload


def error_of(port, body, headers=None, path="/v1/completions"):
    status, _, payload = http_json(port, "POST", path, body, headers=headers)
    return status, payload["error"]


def tokens_of(port, text, add_special=True):
    status, _, payload = http_json(port, "POST", "/tokenize",
                                   {"content": text, "add_special": add_special})
    assert status == 200
    return payload["tokens"]


def greedy(port, prompt, max_tokens=8, **extra):
    """Greedy, decoded in full (no cached prefix): the same prompt always gives the same
    text, on the default server too, when nothing else runs at the same time."""
    extra.setdefault("cache_prompt", False)
    return complete(port, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra)


# -- 1. prompt forms ---------------------------------------------------------------------
def test_token_id_and_mixed_prompts_mean_the_same_as_text(det_port):
    text = greedy(det_port, PROMPT)
    ids = tokens_of(det_port, PROMPT)
    by_ids = greedy(det_port, ids)
    mixed = greedy(det_port, [ids[0], PROMPT])                  # BOS id, then text
    assert by_ids["choices"][0]["text"] == mixed["choices"][0]["text"] \
        == text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == mixed["usage"]["prompt_tokens"] == len(ids)


def test_batched_prompts_give_one_choice_per_prompt_in_order(det_port):
    prompts = [PROMPT, "def fibonacci(n):"]
    singles = [greedy(det_port, p)["choices"][0]["text"] for p in prompts]
    batch = greedy(det_port, prompts)
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["text"] for c in batch["choices"]] == singles
    token_batch = greedy(det_port, [tokens_of(det_port, p) for p in prompts])
    assert [c["text"] for c in token_batch["choices"]] == singles
    assert batch["usage"]["prompt_tokens"] == sum(len(tokens_of(det_port, p)) for p in prompts)


@pytest.mark.parametrize("prompt", [[], [[]]])
def test_empty_prompts_are_400(port, prompt):
    status, error = error_of(port, {"prompt": prompt})
    assert status == 400 and error["param"] == "prompt"


@pytest.mark.parametrize("prompt", ["", [""]])
def test_an_empty_text_is_the_start_of_a_document(port, prompt):
    """As OpenAI (and vLLM and llama-server for a model with a BOS): the model writes
    from its BOS alone."""
    body = complete(port, prompt=prompt, max_tokens=4, temperature=0)
    assert body["usage"]["prompt_tokens"] == 1 and len(body["choices"]) == 1
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


def test_token_ids_outside_the_vocabulary_are_400(port):
    status, error = error_of(port, {"prompt": [2, 10 ** 7]})
    assert status == 400 and error["param"] == "prompt"


# -- 2. n and best_of --------------------------------------------------------------------
def test_n_choices_are_numbered_across_prompts(det_port):
    body = complete(det_port, prompt=[PROMPT, "Once upon a time"], n=2, max_tokens=6,
                    temperature=1.0, seed=11)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    singles = [complete(det_port, prompt=p, max_tokens=6, temperature=1.0, seed=11 + c)
               for p in (PROMPT, "Once upon a time") for c in range(2)]
    assert [c["text"] for c in body["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert body["usage"]["prompt_tokens"] == sum(
        len(tokens_of(det_port, p)) for p in (PROMPT, "Once upon a time"))
    assert body["usage"]["completion_tokens"] == sum(
        s["usage"]["completion_tokens"] for s in singles)


def test_best_of_returns_the_candidate_with_the_best_mean_logprob(det_port):
    seeds = [21, 22, 23]
    candidates = [complete(det_port, prompt=PROMPT, max_tokens=6, temperature=1.5, seed=s,
                           logprobs=0) for s in seeds]

    def mean(c):
        lps = c["choices"][0]["logprobs"]["token_logprobs"]
        return sum(lps) / len(lps)

    best = max(candidates, key=mean)
    body = complete(det_port, prompt=PROMPT, max_tokens=6, temperature=1.5, seed=21, best_of=3)
    assert len(body["choices"]) == 1
    assert body["choices"][0]["text"] == best["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == sum(
        c["usage"]["completion_tokens"] for c in candidates)


def test_streamed_n_chunks_carry_their_index(det_port):
    stream = SSEStream(det_port, {"prompt": PROMPT, "n": 2, "max_tokens": 4, "temperature": 0,
                              "stream": True})
    chunks = [json.loads(d) for d in stream.events() if d != "[DONE]"]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        texts[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert texts[0] == texts[1] == greedy(det_port, PROMPT, 4)["choices"][0]["text"]
    finals = [c for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["index"] for c in finals) == [0, 1]


# -- 3. logprobs -------------------------------------------------------------------------
def test_logprobs_match_llama_cpp_python(port, reference_llm):
    ours = greedy(port, PROMPT, 6, logprobs=3, **{"speculative.n_max": 0})["choices"][0]
    theirs = reference_llm.create_completion(PROMPT, max_tokens=6, temperature=0,
                                             logprobs=3)["choices"][0]
    assert ours["text"] == theirs["text"]
    lp, ref = ours["logprobs"], theirs["logprobs"]
    assert lp["tokens"] == ref["tokens"]
    assert lp["token_logprobs"] == pytest.approx(ref["token_logprobs"], abs=2e-3)
    for mine, their in zip(lp["top_logprobs"], ref["top_logprobs"]):
        assert set(their) <= set(mine) and len(mine) <= 4
        for token, value in their.items():
            assert mine[token] == pytest.approx(value, abs=2e-3)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i])
                                 for i in range(len(lp["tokens"]))]


def test_streamed_logprobs_add_up_to_the_plain_ones(port):
    exact = {"speculative.n_max": 0}        # (drafts change the arithmetic's last bits)
    plain = greedy(port, PROMPT, 6, logprobs=2, **exact)["choices"][0]["logprobs"]
    stream = SSEStream(port, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                              "logprobs": 2, "stream": True, "cache_prompt": False, **exact})
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for data in stream.events():
        if data == "[DONE]":
            break
        lp = json.loads(data)["choices"][0]["logprobs"]
        assert isinstance(lp, dict), data    # (the finish's chunk too: lists, not null)
        for key in merged:
            merged[key] += lp[key]
    assert merged == plain


def test_echo_with_logprobs_scores_the_prompt(port):
    body = complete(port, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT
    ids = tokens_of(port, PROMPT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert all(v < 0 for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == PROMPT
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                             "total_tokens": len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    more = complete(port, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0)
    assert len(more["choices"][0]["logprobs"]["tokens"]) == len(ids) + 3


# -- 4. sampling -------------------------------------------------------------------------
def test_logit_bias_bans_and_forces_tokens(port):
    first = greedy(port, PROMPT, 1)["choices"][0]["text"]
    banned = tokens_of(port, first, add_special=False)[0]
    text = greedy(port, PROMPT, 1, logit_bias={str(banned): -100})["choices"][0]["text"]
    assert text != first
    forced = tokens_of(port, " Paris", add_special=False)[0]
    text = greedy(port, PROMPT, 3, logit_bias=[[forced, 100]])["choices"][0]["text"]
    assert text == " Paris" * 3
    # llama.cpp's text form: the bias goes to each of the text's tokens
    text = greedy(port, PROMPT, 3, logit_bias=[[" Paris", 100]])["choices"][0]["text"]
    assert text == " Paris" * 3
    text = greedy(port, PROMPT, 1, logit_bias=[[first, False]])["choices"][0]["text"]
    assert text != first
    # llama.cpp's own routes take a text as an object's key too, as llama-server does
    # (OpenAI's route keeps OpenAI's token-id keys: a 400 there)
    for bias in ({" Paris": 100}, {" Paris": 100, str(banned): False}):
        status, _, native = http_json(port, "POST", "/completion", {
            "prompt": PROMPT, "n_predict": 3, "temperature": 0, "logit_bias": bias})
        assert status == 200 and native["content"] == " Paris" * 3, native
    status, error = error_of(port, {"prompt": PROMPT, "logit_bias": {" Paris": 100}})
    assert status == 400 and error["param"] == "logit_bias"
    # in the list form a string is always a text, digits too, as llama-server reads it
    # (token 1 is this vocabulary's end token: read as an id, nothing would be written)
    text = greedy(port, PROMPT, 3, logit_bias=[["1", 100]])["choices"][0]["text"]
    assert text == "111"


def test_a_bias_of_minus_100_bans_even_the_grammars_only_token(port):
    """-100 (OpenAI's ban) and `false` (llama.cpp's) ban their token: where the grammar
    allows only that token, the answer is a 400 naming logit_bias, never the token."""
    only = tokens_of(port, " Paris", add_special=False)[0]
    grammar = f"root ::= <[{only}]>"
    status, error = error_of(port, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                    "grammar": grammar, "logit_bias": {str(only): -100}})
    assert status == 400 and error["param"] == "logit_bias", error
    status, error = error_of(port, {"prompt": PROMPT, "n_predict": 2, "grammar": grammar,
                                    "logit_bias": [[only, False]]}, path="/completion")
    assert status == 400 and error["param"] == "logit_bias", error
    ok = greedy(port, PROMPT, 1, grammar=grammar)["choices"][0]["text"]
    assert ok == " Paris"


def test_ignore_eos_and_min_tokens_keep_generating(port):
    # a +100 bias makes end-of-sequence the certain next token at every step
    eos = tokens_of(port, "<eos>", add_special=False)
    assert len(eos) == 1
    bias = {str(eos[0]): 100}
    ended = greedy(port, PROMPT, 20, logit_bias=bias)
    assert ended["choices"][0] == {"text": "", "index": 0, "logprobs": None,
                                   "finish_reason": "stop"}
    assert ended["usage"]["completion_tokens"] == 0
    forced = greedy(port, PROMPT, 7, logit_bias=bias, ignore_eos=True)
    assert forced["usage"]["completion_tokens"] == 7
    assert forced["choices"][0]["finish_reason"] == "length"
    delayed = greedy(port, PROMPT, 20, logit_bias=bias, min_tokens=3)
    assert delayed["usage"]["completion_tokens"] == 3
    assert delayed["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("params", [
    {"mirostat": 1, "mirostat_tau": 4.0, "mirostat_eta": 0.2},
    {"mirostat": 2},
    {"typical_p": 0.8},
    {"top_k": 10, "top_p": 0.8, "min_p": 0.05},
    {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repeat_penalty": 1.3,
     "repeat_last_n": 32},
])
def test_samplers_are_deterministic_under_a_seed(port, params):
    body = dict(prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=5, **params)
    assert complete(port, **body)["choices"][0]["text"] == \
        complete(port, **body)["choices"][0]["text"]


SAMPLED = "Once upon a time, in a small village by the sea,"


def sampled(port, **params):
    body = dict(prompt=SAMPLED, max_tokens=16, temperature=1.5, seed=1)
    body.update(params)
    return complete(port, **body)["choices"][0]["text"]


def sampled_together(port, *params: dict) -> list[str]:
    """`sampled` for each of `params`, the requests sent at once. Only on the deterministic
    server, where running in one batch changes no result: it takes about as long as one."""
    with ThreadPoolExecutor(len(params)) as pool:
        return list(pool.map(lambda p: sampled(port, **p), params))


@pytest.mark.parametrize("params", [
    {"top_k": 1},
    {"min_p": 1.0},                           # only tokens as likely as the best one
    {"mirostat": 2, "mirostat_tau": 0.01},    # target surprise ~0: the most likely token
    {"mirostat": 1, "mirostat_tau": 0.01},
])
def test_each_truncating_sampler_is_applied(det_port, params):
    """Each of these keeps only the most likely token here, so hot sampling gives the
    greedy text whatever the seed; ignored, the seeds would wander off it."""
    plain, *wandering = sampled_together(det_port, {"temperature": 0}, {"seed": 1}, {"seed": 2},
                                         *({"seed": s, **params} for s in (1, 2)))
    wandering, kept = wandering[:2], wandering[2:]
    assert any(text != plain for text in wandering)                  # it could fail
    assert kept == [plain, plain]


def test_typical_p_is_applied(det_port):
    """typical_p 0 keeps one token (the most typical, not always the most likely): the
    seed no longer matters."""
    one, two, typical_one, typical_two = sampled_together(
        det_port, {"seed": 1}, {"seed": 2}, {"seed": 1, "typical_p": 0.0},
        {"seed": 2, "typical_p": 0.0})
    assert one != two
    assert typical_one == typical_two


def test_a_tiny_top_n_sigma_keeps_only_the_best_token(det_port):
    plain, *kept = sampled_together(det_port, {"temperature": 0},
                                    *({"seed": s, "top_n_sigma": 0.001} for s in (1, 2)))
    assert kept == [plain, plain]


def test_the_samplers_list_decides_which_samplers_run(det_port):
    plain, *texts = sampled_together(
        det_port, {"temperature": 0},
        *({"seed": s, "top_k": 1, "samplers": ["top_k", "temperature"]} for s in (1, 2)),
        *({"seed": s, "top_k": 1, "samplers": ["temperature"]} for s in (1, 2)))
    listed, unlisted = texts[:2], texts[2:]
    assert listed == [plain, plain]                          # top_k 1 applied: greedy
    assert any(text != plain for text in unlisted)           # top_k left out: it wanders


def test_dynamic_temperature_changes_sampled_text(det_port):
    texts = sampled_together(
        det_port, *({"seed": s, "temperature": 0.6} for s in (1, 2, 3)),
        *({"seed": s, "temperature": 0.6, "dynatemp_range": 0.6, "dynatemp_exponent": 0.2}
          for s in (1, 2, 3)))
    base, dynamic = texts[:3], texts[3:]
    assert base != dynamic


REPEATING = "red green blue red green blue red green blue red green"


def test_dry_breaks_repetition_in_greedy_output(det_port):
    plain = greedy(det_port, REPEATING, 16)["choices"][0]["text"]
    off = greedy(det_port, REPEATING, 16, dry_multiplier=0.0)["choices"][0]["text"]
    dry = greedy(det_port, REPEATING, 16, dry_multiplier=3.0, dry_allowed_length=1,
                 dry_penalty_last_n=-1)["choices"][0]["text"]
    assert off == plain and dry != plain


def test_xtc_removes_the_top_choices(det_port):
    """At a low temperature the likeliest token nearly always wins; XTC at probability 1
    removes every choice above the threshold but the least likely of them."""
    texts = sampled_together(
        det_port, *({"seed": s, "temperature": 0.05} for s in (1, 2)),
        *({"seed": s, "temperature": 0.05, "xtc_probability": 1.0, "xtc_threshold": 0.01}
          for s in (1, 2)))
    cold, xtc = texts[:2], texts[2:]
    assert all(a != b for a, b in zip(cold, xtc))


def test_llama_cpp_fields_are_accepted_on_the_openai_endpoint(port):
    body = complete(port, prompt="Hi", max_tokens=2, n_probs=3, min_keep=1, n_keep=-1,
                    id_slot=0, return_tokens=True, timings_per_token=True,
                    post_sampling_probs=True, dry_sequence_breakers=["\n"],
                    samplers=["top_k", "typical_p", "temperature"])
    assert body["usage"]["completion_tokens"] == 2
    status, error = error_of(port, {"prompt": "Hi", "samplers": ["warp_drive"]})
    assert status == 400 and error["param"] == "samplers"
    status, error = error_of(port, {"prompt": "Hi", "dry_base": 0.5})
    assert status == 400 and error["param"] == "dry_base"


SPECULATED = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
              * 3 + "def add(a, b):\n")


def test_speculation_keeps_a_confident_copy_and_is_off_in_deterministic_mode(
        real_server, port, det_port):
    from workers.engine.drafting import TRAFFIC_WINDOW
    real_server.wait_idle()             # nothing runs, and then no request for the length of
    time.sleep(TRAFFIC_WINDOW)          # drafting's traffic window: the worker is quiet
    body = {"prompt": SPECULATED, "n_predict": 24, "temperature": 0, "cache_prompt": False}
    _, _, with_drafts = http_json(port, "POST", "/completion", body)
    _, _, without = http_json(port, "POST", "/completion", {**body, "speculative.n_max": 0})
    assert with_drafts["timings"]["draft_n"] > 0, with_drafts["timings"]   # drafts were made
    assert without["timings"]["draft_n"] == 0
    assert with_drafts["content"] == without["content"]
    status, _, native = http_json(det_port, "POST", "/completion",
                                  {"prompt": SPECULATED, "n_predict": 16, "temperature": 0})
    assert status == 200 and native["timings"]["draft_n"] == 0


def test_repeat_last_n_sets_the_penalty_window(det_port):
    prompt = "one two one two one two one two"
    plain = greedy(det_port, prompt, 16)["choices"][0]["text"]
    penalized = dict(repetition_penalty=1.8)
    assert greedy(det_port, prompt, 16, repeat_last_n=0, **penalized)["choices"][0]["text"] \
        == plain                                              # 0: no window, no penalty
    assert greedy(det_port, prompt, 16, repeat_last_n=64, **penalized)["choices"][0]["text"] \
        != plain


def test_penalties_change_greedy_output(port):
    prompt = "one two one two one two one two"
    plain = greedy(port, prompt, 12)["choices"][0]["text"]
    assert greedy(port, prompt, 12, repetition_penalty=1.8)["choices"][0]["text"] != plain
    assert greedy(port, prompt, 12, presence_penalty=2.0)["choices"][0]["text"] != plain
    assert greedy(port, prompt, 12, frequency_penalty=2.0)["choices"][0]["text"] != plain


def test_same_seed_same_text_under_concurrency(det_port):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 99}
    texts = []

    def run():
        texts.append(complete(det_port, **body)["choices"][0]["text"])

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(texts) == 4 and len(set(texts)) == 1


# -- 5. stop, 11. lengths ----------------------------------------------------------------
def test_many_stop_strings(port):
    exact = {"speculative.n_max": 0}     # the two texts agree token for token
    full = greedy(port, PROMPT, 12, **exact)["choices"][0]["text"]
    word = full.split()[2]
    stops = [f"never-{i}" for i in range(200)] + [word]
    body = greedy(port, PROMPT, 12, stop=stops, **exact)
    assert body["choices"][0]["text"] == full[:full.index(word)]
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("max_tokens", [None, -1])
def test_unlimited_max_tokens_runs_to_the_end_of_the_context(port, max_tokens):
    n_prompt = len(tokens_of(port, "Once upon a time"))
    body = complete(port, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
                    ignore_eos=True, nctx=n_prompt + 9)
    assert body["usage"]["completion_tokens"] == 9
    assert body["choices"][0]["finish_reason"] == "length"


def test_nctx_beyond_every_worker_is_400_naming_what_exists(port):
    status, error = error_of(port, {"prompt": "x", "nctx": 100000})
    assert status == 400 and error["param"] == "nctx" and "4096" in error["message"]


def test_prompt_longer_than_the_request_context_is_400(port):
    status, error = error_of(port, {"prompt": "word " * 50, "nctx": 20})
    assert status == 400 and error["code"] == "context_length_exceeded"


# -- 6. UTF-8 ----------------------------------------------------------------------------
def test_streamed_multibyte_text_is_never_broken(det_port):
    # Equal texts across two requests are promised in deterministic mode only (the
    # default mode may reuse the first request's cached prompt and flip a near-tie).
    body = {"prompt": "日本の首都は東京です。大阪は", "max_tokens": 24, "temperature": 0}
    plain = complete(det_port, **body)["choices"][0]["text"]
    stream = SSEStream(det_port, {**body, "stream": True})
    chunks = [json.loads(d)["choices"][0]["text"] for d in stream.events() if d != "[DONE]"]
    assert "".join(chunks) == plain
    assert any(ord(ch) > 0x3000 for ch in plain)            # it did produce Japanese
    assert not any("\ufffd" in c for c in chunks)


# -- 7. constrained output ---------------------------------------------------------------
def test_grammar_constrains_the_output(port):
    body = complete(port, prompt="Is the sky blue? Answer:", temperature=0.8, seed=3,
                    grammar='root ::= " yes" | " no"', max_tokens=10)
    assert body["choices"][0]["text"] in (" yes", " no")


def test_json_schema_output_parses_and_validates(port):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    body = complete(port, prompt="A person, as JSON:", json_schema=schema, temperature=0,
                    max_tokens=80)
    jsonschema.validate(json.loads(body["choices"][0]["text"]), schema)


@pytest.mark.parametrize("body, param", [
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": 'start ::= "a"'}, "grammar"),
    ({"json_schema": {"type": "no-such-type"}}, "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "no-such-type"}}}}, "response_format"),
])
def test_invalid_grammar_or_schema_is_400(port, body, param):
    status, error = error_of(port, {"prompt": "x", **body})
    assert status == 400 and error["param"] == param


# -- 8. FIM ------------------------------------------------------------------------------
def test_suffix_on_a_model_without_fim_tokens_is_400(port):
    status, error = error_of(port, {"prompt": "def f(", "suffix": "\n    return x"})
    assert status == 400 and error["code"] == "fim_unsupported"
    assert "fill-in-the-middle" in error["message"] and error["param"] == "suffix"


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    from tiny_gguf import write_tiny_fim_model
    return write_tiny_fim_model(tmp_path_factory.mktemp("fim") / "tiny-fim.gguf")


def test_fim_prompt_uses_the_models_fim_tokens(fim_model):
    from llama_cpp import Llama
    server = ServerProcess("--model", str(fim_model), "--nctx", "256", log_name="fim").start()
    try:
        prefix, suffix = "def f(x):\n    ", "\n    return y"
        body = complete(server.port, prompt=prefix, suffix=suffix, max_tokens=8,
                        temperature=0, **{"speculative.n_max": 0})
        from dispatcher.tools.reference import llama_loads_like_workers
        with llama_loads_like_workers():
            ref = Llama(str(fim_model), n_ctx=256, verbose=False,
                        n_threads=len(os.sched_getaffinity(0)))
        pre, suf, mid = (int(ref.metadata[f"tokenizer.ggml.{k}_token_id"])
                         for k in ("fim_pre", "fim_suf", "fim_mid"))
        layout = ([ref.token_bos(), pre] + ref.tokenize(prefix.encode(), add_bos=False)
                  + [suf] + ref.tokenize(suffix.encode(), add_bos=False) + [mid])
        expected = ref.create_completion(layout, max_tokens=8, temperature=0)
        assert body["usage"]["prompt_tokens"] == len(layout)
        # a random model emits lone byte tokens: we show them as U+FFFD where
        # llama-cpp-python drops them
        assert body["choices"][0]["text"].replace("\ufffd", "") == \
            expected["choices"][0]["text"]
        assert body["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
        ref.close()
    finally:
        assert server.stop() == 0


# -- 9. geniex, 10. SIE ------------------------------------------------------------------
def test_compute_and_ngl_select_workers(port):
    assert complete(port, prompt="x", max_tokens=1, compute="cpu", ngl=0)
    status, error = error_of(port, {"prompt": "x", "compute": "gpu"})
    assert status == 400 and error["param"] == "compute" and "cpu" in error["message"]
    status, error = error_of(port, {"prompt": "x", "ngl": 10})
    assert status == 400 and error["param"] == "ngl"


def test_machine_profile_header_selects_workers(port):
    status, _, _ = http_json(port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1},
                             headers={"X-SIE-MACHINE-PROFILE": "interactive"})
    assert status == 200
    status, error = error_of(port, {"prompt": "x"}, {"X-SIE-MACHINE-PROFILE": "batch"})
    assert status == 400 and error["code"] == "unknown_profile"
    assert "interactive" in error["message"]


# -- 12. unknown fields, 13. tokenize --------------------------------------------------------
def test_unknown_fields_are_named(port):
    status, error = error_of(port, {"prompt": "x", "temprature": 0.5})
    assert status == 400 and error["param"] == "temprature"
    assert "temprature" in error["message"]


def test_tokenize_and_detokenize_round_trip(port):
    ids = tokens_of(port, "Hello world", add_special=False)
    with_bos = tokens_of(port, "Hello world", add_special=True)
    assert with_bos[1:] == ids and len(with_bos) == len(ids) + 1
    status, _, pieces = http_json(port, "POST", "/tokenize",
                                  {"content": "Hello world", "with_pieces": True})
    assert "".join(p["piece"] for p in pieces["tokens"]) == "Hello world"
    assert [p["id"] for p in pieces["tokens"]] == ids
    status, _, body = http_json(port, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and body == {"content": "Hello world"}
    status, error = error_of(port, {"tokens": [10 ** 7]}, path="/detokenize")
    assert status == 400 and error["param"] == "tokens"
    status, error = error_of(port, {"content": 5}, path="/tokenize")
    assert status == 400 and error["param"] == "content"


# -- 14. fingerprint, openapi --------------------------------------------------------------
def test_system_fingerprint_is_stable_and_served_openapi_lists_every_path(port):
    a, b = greedy(port, PROMPT, 1), greedy(port, "x", 1)
    assert a["system_fingerprint"] == b["system_fingerprint"]
    assert a["system_fingerprint"].startswith("fp_")
    status, _, doc = http_json(port, "GET", "/openapi.json")
    assert status == 200 and set(doc["paths"]) == {
        "/v1/completions", "/v1/models", "/v1/models/{model}", "/health", "/tokenize",
        "/detokenize", "/openapi.json", "/completion", "/completions", "/infill",
        "/v1/fim/completions", "/v1/status", "/", "/props", "/models", "/v1/health",
        "/metrics"}


def test_openai_client_with_the_surface(real_server, model_id):
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0)
    result = client.completions.create(model=model_id, prompt=[PROMPT, PROMPT], n=2,
                                       max_tokens=3, temperature=0, logprobs=2)
    assert len(result.choices) == 4 and all(c.logprobs.tokens for c in result.choices)
    assert result.system_fingerprint.startswith("fp_")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt=PROMPT, best_of=2, stream=True)
