"""What editor plugins and browser clients need to connect unchanged: llama.cpp's native
`/completion` and `/infill`, FIM templates, model aliases, `GET /v1/models/{id}`, CORS.
The whole stack on the bundled model; request bodies modelled on what llama.vim,
Continue's llama.cpp provider and Tabby send (their public sources), each answer read
the way that client reads it."""
import http.client
import json
import time

import openai
import pytest

from conftest import ServerProcess, http_json

pytestmark = pytest.mark.integration      # the real model

ORIGIN = "https://editor.example"
TEMPLATE = "<PRE> {prefix} <SUF>{suffix} <MID>"      # CodeLlama's, as Tabby configures it


@pytest.fixture(scope="module")
def editor_server():
    server = ServerProcess("--model-alias", "gpt-3.5-turbo", "--model-alias", "codellama",
                           "--cors-origin", ORIGIN, "--api-key", "sk-editor",
                           "--fim-template", TEMPLATE, log_name="editors").start()
    yield server
    assert server.stop() == 0


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-editor", max_retries=0)


def test_hard_coded_model_names_resolve_through_aliases(editor_server):
    api = client(editor_server)
    for name in ("gpt-3.5-turbo", "codellama"):
        answer = api.completions.create(model=name, prompt="def add(a, b):", max_tokens=3,
                                        temperature=0)
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert caught.value.body["code"] == "model_not_found"


def test_models_can_be_retrieved_by_id_or_alias(editor_server):
    api = client(editor_server)
    listed = api.models.list().data
    assert len(listed) == 1
    model_id = listed[0].id
    assert sorted(listed[0].aliases) == ["codellama", "gpt-3.5-turbo"]
    assert api.models.retrieve(model_id).id == model_id
    assert api.models.retrieve("codellama").id == model_id
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("no-such-model")


def preflight(port, origin, method="POST", headers="authorization, content-type"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("OPTIONS", "/v1/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": headers})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}


def test_cors_preflights_are_answered_for_allowed_origins_only(editor_server):
    status, headers = preflight(editor_server.port, ORIGIN)
    assert status == 204                                  # no API key needed for it
    assert headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"]
    assert "Origin" in headers["vary"]
    status, headers = preflight(editor_server.port, "https://evil.example")
    assert status == 204 and "access-control-allow-origin" not in headers


def test_cors_answers_echo_allowed_origins_only(editor_server):
    auth = {"Authorization": "Bearer sk-editor"}
    status, headers, _ = http_json(editor_server.port, "POST", "/v1/completions",
                                   {"prompt": "x", "max_tokens": 1},
                                   headers={**auth, "Origin": ORIGIN})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "X-Request-Id" in headers["Access-Control-Expose-Headers"]
    status, headers, _ = http_json(editor_server.port, "POST", "/v1/completions",
                                   {"prompt": "x", "max_tokens": 1},
                                   headers={**auth, "Origin": "https://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = http_json(editor_server.port, "POST", "/v1/completions",
                                   {"prompt": "x"}, headers={"Origin": ORIGIN})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == ORIGIN  # readable
    # /metrics answered without a key (this host's client, --status-access loopback) is
    # not for a page of another origin to read: every key's usage is there
    status, headers, _ = http_json(editor_server.port, "GET", "/metrics",
                                   headers={"Origin": ORIGIN})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = http_json(editor_server.port, "GET", "/metrics",
                                   headers={**auth, "Origin": ORIGIN})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN


def test_no_cors_headers_without_configured_origins(real_server):
    status, headers = preflight(real_server.port, ORIGIN)
    assert "access-control-allow-origin" not in headers
    status, headers, _ = http_json(real_server.port, "GET", "/v1/models",
                                   headers={"Origin": ORIGIN})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_aliases_come_from_the_config_file_too(tmp_path):
    from conftest import ROOT
    import subprocess
    import sys
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nid = "m"\naliases = ["starcoder", "m"]\n')
    result = subprocess.run([sys.executable, "-m", "dispatcher", "check-config", "--config",
                             str(config)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and "alias 'm'" in result.stdout
    config.write_text('[[models]]\nid = "m"\naliases = ["starcoder"]\n'
                      'fim_template = "<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"\n')
    result = subprocess.run([sys.executable, "-m", "dispatcher", "check-config", "--config",
                             str(config), "--json"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    model = json.loads(result.stdout)["models"][0]
    assert model["aliases"] == ["starcoder"] and model["fim_template"].startswith("<fim_")
    config.write_text('[[models]]\nid = "m"\nfim_template = "{prefix} only"\n')
    result = subprocess.run([sys.executable, "-m", "dispatcher", "check-config", "--config",
                             str(config)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and "{suffix}" in result.stdout


AUTH = {"Authorization": "Bearer sk-editor"}


def post_raw(port, path, body, headers=None):
    """POST as curl does in the editor plugins; returns (status, raw body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", **AUTH, **(headers or {})})
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    return response.status, raw


def data_events(raw: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n")
            if line.startswith(b"data: ")]


def test_continue_llama_cpp_provider_streams_content(editor_server):
    # what Continue's core (core/llm/llms/LlamaCpp.ts) posts, its `model` included
    body = {"model": "codellama", "prompt": "def fib(n):", "stream": True, "n_predict": 12,
            "temperature": 0.01,
            "top_k": 40, "top_p": 0.95, "min_p": 0.05, "frequency_penalty": 0,
            "presence_penalty": 0, "mirostat": 0, "stop": ["\n\n\n"],
            "typical_p": 1, "cache_prompt": True}
    status, raw = post_raw(editor_server.port, "/completion", body)
    assert status == 200
    events = data_events(raw)
    text = "".join(e.get("content", "") for e in events)      # all Continue reads
    assert text and b"[DONE]" not in raw
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] <= 12
    assert all(e["stop"] is False for e in events[:-1])
    # each partial counts as llama-server's: the prompt's tokens, and those made so far
    partials = events[:-1]
    counts = [e["tokens_predicted"] for e in partials]
    assert counts == sorted(counts) and 0 < counts[-1] <= events[-1]["tokens_predicted"]
    assert {e["tokens_evaluated"] for e in partials} == {events[-1]["tokens_evaluated"]}
    # and their tokens' ids, as llama-server's chunks carry them, unasked
    ids = [i for e in partials for i in e["tokens"]]
    assert all(e["tokens"] for e in partials) and len(ids) == counts[-1]
    assert not any("timings" in e for e in partials)
    # llama.cpp's timings_per_token: each chunk with its timings so far
    status, raw = post_raw(editor_server.port, "/completion", {**body,
                                                               "timings_per_token": True})
    partials = data_events(raw)[:-1]
    assert status == 200 and partials
    assert all(e["timings"]["predicted_n"] == e["tokens_predicted"] and
               e["timings"]["prompt_n"] + e["timings"]["cache_n"] == e["tokens_evaluated"]
               for e in partials)


def test_tabby_completion_payload_and_unknown_fields(editor_server):
    body = {"seed": 0, "prompt": "<PRE> def add(a, b): <SUF>\n <MID>", "n_predict": 8,
            "temperature": 0.1, "stream": False, "penalty_last_n": 0,
            "presence_penalty": 0.0, "id_slot": -1, "samplers": ["top_k", "dry"],
            "dry_multiplier": 0.0}
    for path in ("/completion", "/completions"):
        status, raw = post_raw(editor_server.port, path, body)
        assert status == 200, raw
        answer = json.loads(raw)
        assert isinstance(answer["content"], str) and answer["stop"] is True
        assert answer["stop_type"] in ("eos", "word", "limit")
        assert answer["tokens_predicted"] <= 8 and answer["tokens_evaluated"] > 0
        timings = answer["timings"]
        assert timings["predicted_n"] == answer["tokens_predicted"]
        assert timings["prompt_n"] + timings["cache_n"] == answer["tokens_evaluated"]


def test_a_stop_word_is_reported_as_llama_cpp_does(editor_server):
    status, raw = post_raw(editor_server.port, "/completion", {
        "prompt": "1, 2, 3, 4,", "n_predict": 20, "temperature": 0, "stop": ["7"]})
    answer = json.loads(raw)
    assert status == 200 and answer["stop_type"] == "word"
    assert answer["stopping_word"] == "7" and "7" not in answer["content"]


def tokens_of(port, text: str) -> list[int]:
    status, raw = post_raw(port, "/tokenize", {"content": text})
    return json.loads(raw)["tokens"]


def test_llama_vim_infill_lays_out_the_context_with_the_template(editor_server):
    port = editor_server.port
    body = {"input_prefix": "def area(r):\n    ", "input_suffix": "\n\nprint(area(2))\n",
            "input_extra": [{"text": "PI = 3.14159\n", "time": 12.5, "filename": "consts.py"}],
            "prompt": "return", "n_predict": 16, "stop": [], "n_indent": 4, "top_k": 40,
            "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_predict_ms": 1000,      # no prefill budget: the
            "response_fields": ["content", "timings/prompt_n",   # layout, whatever the
                                "timings/predicted_n", "tokens_cached",  # machine's speed
                                "truncated", "tokens_evaluated"]}
    status, raw = post_raw(port, "/infill", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert set(answer) == set(body["response_fields"])          # flat, as llama.cpp
    assert isinstance(answer["content"], str) and answer["truncated"] is False
    # [snippet separator, chunk] BOS "<PRE> " prefix " <SUF>" suffix " <MID>" prompt
    pieces = ["\n\n--- snippet ---\n\n", "PI = 3.14159\n", "<PRE> ", body["input_prefix"],
              " <SUF>", body["input_suffix"], " <MID>", body["prompt"]]
    expected = sum(len(tokens_of(port, p)) for p in pieces) + 1   # + BOS
    assert answer["tokens_evaluated"] == expected
    # streamed, the last event (the summary) keeps only response_fields too
    status, raw = post_raw(port, "/infill", {**body, "stream": True})
    assert status == 200, raw
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ")]
    assert set(events[-1]) == set(body["response_fields"]), events[-1]


def test_llama_vim_warm_up_fills_the_cache_without_generating(editor_server):
    port = editor_server.port
    extra = [{"text": "x = 1\n" * 40, "time": 1.0, "filename": "big.py"}]
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra,
            "prompt": "", "n_predict": 0, "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1}
    status, raw = post_raw(port, "/infill", warm)
    answer = json.loads(raw)
    assert status == 200 and answer["tokens_predicted"] == 0 and answer["content"] == ""
    status, raw = post_raw(port, "/infill", {**warm, "n_predict": 4, "input_prefix": "y",
                                             "t_max_prompt_ms": 500})
    answer = json.loads(raw)
    assert status == 200 and answer["tokens_cached"] >= 40          # the chunk was there


def test_llama_vims_ring_of_chunks_larger_than_the_context_is_served(editor_server):
    """llama.vim keeps up to 16 chunks of 64 lines and sends them all, warm-ups too:
    once they pass the context (4,096 tokens a slot here) the oldest are left out, as
    llama-server does, and the request is answered (it was a 400, so suggestions
    stopped)."""
    import inspect
    import textwrap
    port = editor_server.port
    lines = (inspect.getsource(textwrap) + inspect.getsource(inspect)).splitlines()
    extra = [{"filename": f"ring{i}.py", "text": "\n".join(lines[i * 64:(i + 1) * 64]),
              "time": float(i)} for i in range(10)]
    body = {"input_prefix": "def area(r):\n    ", "input_suffix": "\n", "prompt": "return",
            "input_extra": extra, "n_predict": 16, "t_max_predict_ms": 1000,
            "samplers": ["top_k", "top_p", "infill"], "top_k": 40, "cache_prompt": True}
    for n_predict in (0, 16):                          # a warm-up, then a completion
        status, raw = post_raw(port, "/infill", {**body, "n_predict": n_predict})
        assert status == 200, raw[:300]
        answer = json.loads(raw)
        assert 0 < answer["input_extra_dropped"] < 10 and answer["truncated"] is False
        assert answer["tokens_evaluated"] <= 4096 - max(1, n_predict)
    # (the prefix's and suffix's cut: tests/test_generation.py, without a 4k prefill)


def test_n_cmpl_choices_prefill_their_prompt_once(editor_server):
    """llama.vscode asks `n_cmpl: 3` of every prompt: the choices prefilled the same
    prompt three times side by side. One prefills it; the others wait for it and copy
    its cache (llama_memory_seq_cp), decoding only the last prompt token, as
    llama-server copies a parent's state to its children."""
    import inspect
    import textwrap
    prompt = inspect.getsource(textwrap)[:3000]
    status, raw = post_raw(editor_server.port, "/completion", {
        "prompt": prompt, "n_cmpl": 3, "n_predict": 4, "temperature": 0,
        "cache_prompt": True, "response_fields": ["timings/cache_n", "tokens_evaluated",
                                                  "tokens_cached", "tokens_predicted",
                                                  "content"]})
    assert status == 200, raw[:300]
    answers = json.loads(raw)
    assert len(answers) == 3
    evaluated = answers[0]["tokens_evaluated"]
    cached = sorted(a["timings/cache_n"] for a in answers)      # (the prefix reused)
    # what the slot holds after it, as llama-server's: prompt and answer (llama.vim
    # shows it, and warns of a full context by it)
    assert all(a["tokens_cached"] == evaluated + a["tokens_predicted"] for a in answers)
    assert cached[1:] == [evaluated - 1, evaluated - 1], answers   # copies of the first
    assert cached[0] < evaluated - 1


def test_infill_without_fim_tokens_or_template_is_501(real_server):
    status, raw = post_raw(real_server.port, "/infill", {"input_prefix": "def f(",
                                                         "input_suffix": ")"})
    error = json.loads(raw)["error"]
    assert status == 501 and error["type"] == "not_supported_error"


CODE = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"


def complete_native(port, **body):
    # decoded in full each time: the same greedy text run after run (docs/design.md, Determinism)
    status, raw = post_raw(port, "/completion", {"prompt": CODE, "temperature": 0,
                                                 "cache_prompt": False, **body})
    assert status == 200, raw
    return json.loads(raw)


def test_n_indent_ends_the_completion_at_a_dedented_line(editor_server):
    port = editor_server.port
    free = complete_native(port, n_predict=80, ignore_eos=True)["content"]
    lines = free.split("\n")[1:]
    assert any(line.strip() and not line.startswith("        ") for line in lines)
    cut = complete_native(port, n_predict=80, ignore_eos=True, n_indent=8)
    assert cut["stop_type"] == "limit" and cut["tokens_predicted"] < 80
    for line in cut["content"].split("\n")[1:]:
        assert not line.strip() or line.startswith("        "), cut["content"]


def test_t_max_predict_ms_stops_after_a_newline_once_time_is_up(editor_server):
    port = editor_server.port
    free = complete_native(port, n_predict=60, ignore_eos=True)
    assert free["tokens_predicted"] == 60 and "\n" in free["content"]
    timed = complete_native(port, n_predict=60, ignore_eos=True, t_max_predict_ms=1)
    assert timed["stop_type"] == "limit" and timed["tokens_predicted"] < 60
    assert "\n" in timed["content"]


def test_t_max_prompt_ms_leaves_out_the_oldest_extra_chunks(editor_server):
    port = editor_server.port
    for _ in range(2):              # the worker's first prefill is left out: it is cold
        complete_native(port, n_predict=2, prompt="warm up the measured prefill rate " * 8)
    extra = [{"filename": f"f{i}.py", "text": f"def helper_{i}(v):\n    return v * {i}\n" * 6}
             for i in range(8)]
    base = {"input_prefix": "def main():\n    ", "input_suffix": "\n", "input_extra": extra,
            "n_predict": 4, "temperature": 0}
    status, raw = post_raw(port, "/infill", base)
    whole = json.loads(raw)
    assert status == 200 and whole["input_extra_dropped"] == 0
    status, raw = post_raw(port, "/infill", {**base, "cache_prompt": False,
                                             "t_max_prompt_ms": 5})
    budget = json.loads(raw)
    assert status == 200 and budget["input_extra_dropped"] > 0
    assert budget["tokens_evaluated"] < whole["tokens_evaluated"]


def test_n_probs_and_return_tokens_in_llama_cpp_shape(editor_server):
    port = editor_server.port
    answer = complete_native(port, n_predict=6, ignore_eos=True, n_probs=3,
                             return_tokens=True)
    assert len(answer["tokens"]) == answer["tokens_predicted"] == 6
    status, raw = post_raw(port, "/detokenize", {"tokens": answer["tokens"]})
    assert json.loads(raw)["content"] == answer["content"]
    probs = answer["completion_probabilities"]
    assert [p["id"] for p in probs] == answer["tokens"]
    for p in probs:
        top = p["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == p["id"]           # greedy: the best
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top),
                                                     reverse=True)
        assert bytes(p["bytes"]).decode("utf-8", "replace") and p["logprob"] <= 0
    status, raw = post_raw(port, "/completion", {"prompt": CODE, "temperature": 0,
                                                 "n_predict": 3, "n_probs": 2,
                                                 "stream": True})
    events = data_events(raw)
    streamed = [p for e in events[:-1] for p in e["completion_probabilities"]]
    assert len(streamed) == 3 and all(len(p["top_logprobs"]) == 2 for p in streamed)


@pytest.fixture(scope="module")
def repo_model_server(tmp_path_factory):
    from tiny_gguf import write_tiny_fim_model
    path = write_tiny_fim_model(tmp_path_factory.mktemp("repo") / "tiny-repo.gguf",
                                repo=True)
    server = ServerProcess("--model", str(path), "--nctx", "512", log_name="repo").start()
    yield server
    assert server.stop() == 0


def test_infill_with_fim_rep_and_sep_lays_out_a_repository(repo_model_server):
    port = repo_model_server.port
    extra = [{"filename": "a.py", "text": "x = 1\n"}, {"filename": "b.py", "text": "y = 2\n"}]
    body = {"input_prefix": "def f(", "input_suffix": "):\n", "input_extra": extra,
            "prompt": "x", "n_predict": 2, "temperature": 0}
    status, raw = post_raw(port, "/infill", body)
    assert status == 200, raw
    pieces = ["myproject\n", "a.py\n", "x = 1\n", "b.py\n", "y = 2\n", "filename\n",
              "def f(", "):\n", "x"]
    specials = 8            # REP, SEP × 3, BOS, PRE, SUF, MID
    expected = specials + sum(len(tokens_of(port, p)) for p in pieces)
    assert json.loads(raw)["tokens_evaluated"] == expected
    # no chunks: the opening and the closing all the same, as llama-server lays it out
    status, raw = post_raw(port, "/infill", {**body, "input_extra": []})
    pieces = ["myproject\n", "filename\n", "def f(", "):\n", "x"]
    expected = 6 + sum(len(tokens_of(port, p)) for p in pieces)  # REP, SEP, BOS, PRE, SUF, MID
    assert status == 200 and json.loads(raw)["tokens_evaluated"] == expected
    # an empty file name stays empty, as llama.cpp has it (it became "tmp")
    status, raw = post_raw(port, "/infill", {**body, "input_extra": [
        {"filename": "", "text": "x = 1\n"}]})
    pieces = ["myproject\n", "\n", "x = 1\n", "filename\n", "def f(", "):\n", "x"]
    expected = 7 + sum(len(tokens_of(port, p)) for p in pieces)  # (one more SEP)
    assert status == 200 and json.loads(raw)["tokens_evaluated"] == expected
    # ... where a suffix on OpenAI's route is the plain layout
    answer = http_json(port, "POST", "/v1/completions", {
        "prompt": "def f(", "suffix": "):\n", "max_tokens": 1, "temperature": 0})[2]
    assert answer["usage"]["prompt_tokens"] == 4 + sum(
        len(tokens_of(port, p)) for p in ["def f(", "):\n"])          # BOS, PRE, SUF, MID


def test_continue_openai_provider_fills_in_the_middle_through_the_template(editor_server):
    api = client(editor_server)
    stream = api.completions.create(model="gpt-3.5-turbo", prompt="def square(x):\n    ",
                                    suffix="\n\nprint(square(3))\n", max_tokens=8,
                                    temperature=0, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[-1].finish_reason in ("stop", "length")
    plain = api.completions.create(model="gpt-3.5-turbo", prompt="def square(x):\n    ",
                                   suffix="\n\nprint(square(3))\n", max_tokens=8,
                                   temperature=0)
    expected = len(tokens_of(editor_server.port, "<PRE> ")) + \
        len(tokens_of(editor_server.port, "def square(x):\n    ")) + \
        len(tokens_of(editor_server.port, " <SUF>")) + \
        len(tokens_of(editor_server.port, "\n\nprint(square(3))\n")) + \
        len(tokens_of(editor_server.port, " <MID>")) + 1
    assert plain.usage.prompt_tokens == expected


def test_llama_vscode_infill_payload(editor_server):
    body = {"id_slot": 0, "input_prefix": "import os\n\ndef list_py(path):\n    ",
            "input_suffix": "\n", "input_extra": [], "prompt": "return [",
            "n_predict": 12, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 500}
    status, raw = post_raw(editor_server.port, "/infill", body)
    answer = json.loads(raw)
    assert status == 200 and isinstance(answer["content"], str)
    assert answer["tokens_predicted"] <= 12 and \
        answer["timings"]["predicted_n"] == answer["tokens_predicted"]
    assert answer["tokens_predicted"] >= 1 or not answer["content"]   # (an EOS at once)


def test_speculative_drafts_are_counted_in_the_timings(editor_server):
    from workers.engine.drafting import TRAFFIC_WINDOW
    editor_server.wait_idle()           # nothing runs, and then no request for the length of
    time.sleep(TRAFFIC_WINDOW)          # drafting's traffic window: the worker is quiet
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n" * 3
    answer = complete_native(editor_server.port, prompt=code + "def add(a, b):\n",
                             n_predict=32, ignore_eos=True)
    timings = answer["timings"]
    assert timings["draft_n"] > 0 and 0 < timings["draft_n_accepted"] <= timings["draft_n"]
    none = complete_native(editor_server.port, prompt=code + "def add(a, b):\n",
                           n_predict=32, ignore_eos=True, **{"speculative.n_max": 0})
    assert none["timings"]["draft_n"] == 0


def test_tokenize_and_detokenize_give_special_tokens_as_llama_server_does(editor_server):
    """llama.vscode's /tokenize body (`parse_special` and its other fields), a control
    token's piece shown by its text, and /detokenize giving that text back; with
    `parse_special: false` the same text is plain characters."""
    auth = {"Authorization": "Bearer sk-editor"}
    status, _, body = http_json(editor_server.port, "POST", "/tokenize", {
        "content": "<start_of_turn>hi", "add_special": False, "parse_special": True,
        "with_pieces": True}, headers=auth)
    assert status == 200, body
    first = body["tokens"][0]
    assert first["piece"] == "<start_of_turn>"
    status, _, text = http_json(editor_server.port, "POST", "/detokenize",
                                {"tokens": [first["id"]]}, headers=auth)
    assert status == 200 and text["content"] == "<start_of_turn>"
    status, _, plain = http_json(editor_server.port, "POST", "/tokenize", {
        "content": "<start_of_turn>hi", "parse_special": False}, headers=auth)
    assert status == 200 and first["id"] not in plain["tokens"]
    assert len(plain["tokens"]) > len(body["tokens"])
    # a character split over byte tokens: each piece is its bytes as numbers, as
    # llama.cpp gives them (not text a client would splice in)
    status, _, split = http_json(editor_server.port, "POST", "/tokenize", {
        "content": "\U0001d518", "with_pieces": True}, headers=auth)
    assert status == 200 and len(split["tokens"]) > 1, split
    assert all(isinstance(t["piece"], list) for t in split["tokens"]), split
    assert bytes(b for t in split["tokens"] for b in t["piece"]).decode() == "\U0001d518"


def test_return_tokens_counts_every_token_sampled_a_stop_strings_too(editor_server):
    """llama-server's `tokens` with `return_tokens` holds every token it sampled, the
    ones of a stop string too, so their count is `tokens_predicted` (the stop string's
    were left out, and an answer stopped at its first token had none)."""
    body = {"prompt": "def fib(n):", "n_predict": 12, "temperature": 0,
            "return_tokens": True}
    status, raw = post_raw(editor_server.port, "/completion", body)
    whole = json.loads(raw)
    assert status == 200 and len(whole["tokens"]) == whole["tokens_predicted"] == 12
    first = whole["content"].strip()[:1]            # a stop at the first visible character
    status, raw = post_raw(editor_server.port, "/completion", {**body, "stop": [first]})
    stopped = json.loads(raw)
    assert status == 200 and stopped["stop_type"] == "word"
    assert len(stopped["tokens"]) == stopped["tokens_predicted"] >= 1
    assert stopped["tokens"] == whole["tokens"][:len(stopped["tokens"])]
