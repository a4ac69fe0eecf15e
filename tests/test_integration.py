"""The whole stack on the bundled Gemma 3 270M: `python -m dispatcher serve`, gunicorn,
the dispatcher and real llama-cpp-python workers, driven by the `openai` client and by
raw HTTP."""
import http.client
import json
import re
import threading
import time

import openai
import pytest

from conftest import ServerProcess, SSEStream, http_json

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is"
CODE_PROMPT = "def fibonacci(n):\n"
# A prompt decoded in full, not partly from a cached prefix: only then is the same
# request guaranteed the same numbers (see docs/design.md, Determinism).
# decoded in full, one token a step (no speculation): as llama-cpp-python decodes
NO_CACHE = {"cache_prompt": False, "speculative.n_max": 0}


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(reference_llm):
    return reference_llm


def test_plain_completion_with_the_openai_client(client, model_id, reference):
    result = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12,
                                       temperature=0)
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    assert result.model == model_id
    choice = result.choices[0]
    assert choice.index == 0 and choice.logprobs is None and choice.finish_reason == "length"
    assert choice.text.strip()
    n_prompt = len(reference.tokenize(PROMPT.encode()))
    assert (result.usage.prompt_tokens, result.usage.completion_tokens,
            result.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)


@pytest.mark.parametrize("prompt", [PROMPT, CODE_PROMPT])
def test_greedy_text_equals_llama_cpp_python_in_process(client, model_id, reference, prompt):
    ours = client.completions.create(model=model_id, prompt=prompt, max_tokens=24,
                                     temperature=0, extra_body=NO_CACHE).choices[0].text
    theirs = reference.create_completion(prompt, max_tokens=24, temperature=0)
    assert ours == theirs["choices"][0]["text"]


def test_other_servers_fields_through_the_openai_clients_extra_body(client, model_id):
    """What clients written for vLLM or Ollama send through the openai SDK's `extra_body`
    reaches the real model: guided_choice constrains the answer to its strings, Ollama's
    options.num_predict sets its length, a value asking for something else is a 400."""
    chosen = client.completions.create(
        model=model_id, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
        extra_body={"guided_choice": [" yes", " no"], "skip_special_tokens": True,
                    "use_beam_search": False})
    assert chosen.choices[0].text in (" yes", " no")
    sized = client.completions.create(
        model=model_id, prompt=CODE_PROMPT, temperature=0,
        extra_body={"options": {"num_predict": 7}, "keep_alive": "5m",
                    "ignore_eos": True})
    assert sized.usage.completion_tokens == 7
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model_id, prompt="x", max_tokens=1,
                                  extra_body={"stop_token_ids": [1]})
    assert refused.value.body["param"] == "stop_token_ids"


def test_streaming_with_the_openai_client_matches_the_plain_text(client, model_id):
    plain = client.completions.create(model=model_id, prompt=CODE_PROMPT, max_tokens=20,
                                      temperature=0, extra_body=NO_CACHE)
    chunks = list(client.completions.create(
        model=model_id, prompt=CODE_PROMPT, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_CACHE))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == plain.choices[0].text
    assert len(text_chunks) > 5                      # token by token, not one lump
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == plain.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_bytes_and_headers(real_server):
    stream = SSEStream(real_server.port, {"prompt": PROMPT, "max_tokens": 5,
                                          "temperature": 0, "stream": True})
    assert stream.status == 200
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert stream.headers["cache-control"] == "no-cache"
    assert stream.headers["x-accel-buffering"] == "no"
    payloads = list(stream.events())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(set(c) == {"id", "object", "created", "model", "choices",
                       "system_fingerprint"} for c in chunks)
    assert chunks[0]["system_fingerprint"].startswith("fp_")
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # every event is exactly "data: <one line>\n\n" and nothing follows [DONE]
    assert stream.raw.endswith(b"data: [DONE]\n\n")
    events = stream.raw.split(b"\n\n")
    assert events[-1] == b"" and all(e.startswith(b"data: ") for e in events[:-1])


def test_stop_string_is_never_part_of_the_text(client, model_id, reference):
    full = reference.create_completion(PROMPT, max_tokens=24, temperature=0)
    full_text = full["choices"][0]["text"]
    stop = full_text.split()[3]                     # a word the model will produce
    expected = full_text[:full_text.index(stop)]
    plain = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24,
                                      temperature=0, stop=[stop, "zzzz"], extra_body=NO_CACHE)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
        stream=True, extra_body=NO_CACHE))
    assert plain.choices[0].text == streamed == expected
    assert plain.choices[0].finish_reason == "stop"
    assert stop not in streamed


def test_echo_returns_the_prompt_then_the_completion(client, model_id):
    plain = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6,
                                      temperature=0, extra_body=NO_CACHE)
    echoed = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6,
                                       temperature=0, echo=True, extra_body=NO_CACHE)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_same_seed_same_text(client, model_id):
    def sample(seed):
        return client.completions.create(model=model_id, prompt="Once upon a time",
                                         max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"top_k": 40, **NO_CACHE}
                                         ).choices[0].text
    assert sample(1234) == sample(1234)


def test_a_pydantic_models_schema_gives_text_the_model_validates(client, model_id):
    """What a Python client sends for structured output: pydantic's JSON schema (its
    root a `$ref` beside `$defs`, an enum by reference, `Any` as a schema of annotations
    alone, optional fields as anyOf with null). Each was a 400 from llama-cpp-python's
    converter ('#/$defs/Color', "Unrecognized schema"); the answer now parses back
    into the model."""
    from enum import Enum
    from typing import Any, Literal, Optional

    from pydantic import BaseModel, Field

    class Color(str, Enum):
        red = "red"
        blue = "blue"

    class Part(BaseModel):
        name: str = Field(max_length=12)
        color: Optional[Color] = None
        note: Any = None

    class Order(BaseModel):
        parts: list[Part] = Field(max_length=2)
        kind: Literal["a", "b"]
        urgent: bool

    for prompt in ("An order as JSON: ", "{"):
        answer = client.completions.create(
            model=model_id, prompt=prompt, max_tokens=200, temperature=0,
            extra_body={"json_schema": Order.model_json_schema(), **NO_CACHE})
        assert answer.choices[0].finish_reason == "stop"
        Order.model_validate_json(answer.choices[0].text)


def test_response_format_asks_for_json_as_vllm_takes_it(client, model_id):
    """OpenAI's `response_format` on /v1/completions, as vLLM takes it (llama-server
    ignores it there: its answer was unconstrained text): json_schema's schema, or any
    JSON object; `text` is no constraint."""
    import json
    import jsonschema
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    answer = client.completions.create(
        model=model_id, prompt="A person as JSON:", max_tokens=80, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": schema, "strict": True}}, **NO_CACHE})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].text), schema)
    answer = client.completions.create(
        model=model_id, prompt="A person as JSON:", max_tokens=60, temperature=0,
        extra_body={"response_format": {"type": "json_object"}, **NO_CACHE})
    text = answer.choices[0].text
    assert text.startswith("{") and (answer.choices[0].finish_reason == "length" or
                                     isinstance(json.loads(text), dict)), text
    plain = client.completions.create(model=model_id, prompt="A person as JSON:",
                                      max_tokens=8, temperature=0, extra_body=NO_CACHE)
    text = client.completions.create(
        model=model_id, prompt="A person as JSON:", max_tokens=8, temperature=0,
        extra_body={"response_format": {"type": "text"}, **NO_CACHE}).choices[0].text
    assert text == plain.choices[0].text


def test_patterns_and_backslashes_in_a_schema_give_json_valid_against_it(client, model_id):
    """JSON Schema's own pattern example (`\\d`) and enum strings with a backslash and a
    quote: a 400 before (the grammar did not parse); a dot, a negated class and a
    class of printable characters or line breaks, which let a quote, a raw backslash or
    a raw line break into the string. Now the answer is JSON that `jsonschema`
    validates against the schema."""
    schema = {"type": "object", "properties": {
        "phone": {"type": "string", "pattern": "^\\d{3}-\\d{4}$"},
        "dir": {"enum": ["C:\\temp", "say \"hi\""]},
        "host": {"type": "string", "pattern": "^(?:www\\.)?[a-z]{1,8}\\.com$"},
        "mail": {"type": "string", "pattern": "^[^@]{1,12}@[^@]{1,12}$"},
        "note": {"type": "string", "pattern": "^.{1,12}$"},
        "said": {"type": "string", "pattern": "^say \"[a-z]{1,5}\"$"},
        "text": {"type": "string", "pattern": "^[ -~\\n]{1,12}$"}},
        "required": ["phone", "dir", "host", "mail", "note", "said", "text"]}
    assert_answers_valid(client, model_id, schema, "A contact as JSON: ", 200)


def assert_answers_valid(client, model_id, schema, prompt, max_tokens):
    """Greedy answers to `prompt` and to "{" end and are JSON valid against `schema`."""
    import json
    import jsonschema
    for text in (prompt, "{"):
        answer = client.completions.create(
            model=model_id, prompt=text, max_tokens=max_tokens, temperature=0,
            extra_body={"json_schema": schema, **NO_CACHE})
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].text), schema)


def test_long_length_and_item_bounds_in_a_schema_are_served(client, model_id):
    """`maxLength: 300` (pydantic's `Field(max_length=300)`) and `maxItems: 150` were a
    400: the converter's grammar nested a group for each repetition, past 100 deep."""
    import json
    import jsonschema
    schema = {"type": "object", "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 300},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 150}}, "required": ["title", "tags"]}
    answer = client.completions.create(
        model=model_id, prompt="A short book record as JSON: ", max_tokens=120,
        temperature=0, extra_body={"json_schema": schema, **NO_CACHE})
    if answer.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(answer.choices[0].text), schema)
    else:                         # (cut by max_tokens: a prefix of such JSON)
        assert answer.choices[0].text.startswith('{"title":')


def test_integer_bounds_and_lists_of_types_hold_in_the_answer(client, model_id):
    """An OpenAI strict-mode schema: integer bounds (the converter left them out) and
    `"type": [..., "null"]` beside `enum` and `properties` (it kept the types bare)."""
    schema = {"type": "object", "additionalProperties": False, "required": [
        "year", "rating", "colour", "owner", "confidence"], "properties": {
        "year": {"type": "integer", "minimum": 1990, "maximum": 2030},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "rating": {"type": ["integer", "null"], "minimum": 1, "maximum": 5},
        "colour": {"type": ["string", "null"], "enum": ["red", "green", None]},
        "owner": {"type": ["object", "null"], "additionalProperties": False,
                  "required": ["age"], "properties": {
                      "age": {"type": "integer", "exclusiveMinimum": 17, "maximum": 99}}}}}
    assert_answers_valid(client, model_id, schema, "A car as JSON: ", 80)


def test_penalties_and_truncation_samplers_are_accepted(client, model_id):
    result = client.completions.create(
        model=model_id, prompt=CODE_PROMPT, max_tokens=8, temperature=0.7, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, seed=7,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    assert result.usage.completion_tokens <= 8 and result.choices[0].finish_reason


def test_errors_use_the_openai_envelope(client, model_id, real_server):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_id, prompt="x", temperature=3)
    assert info.value.body["param"] == "temperature"
    status, _, body = http_json(real_server.port, "POST", "/v1/completions",
                                {"model": model_id, "prompt": "hello " * 5000})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, _, body = http_json(real_server.port, "POST", "/v1/completions",
                                {"prompt": "x", "stream": True, "max_tokens": "5"})
    assert status == 400 and body["error"]["param"] == "max_tokens"


def test_the_default_watchdog_limit_is_derived_from_the_devices_full_batch(real_server):
    """--step-timeout auto (the default): the worker times one full-batch decode after
    loading and sets its watchdog from it (never the old fixed 300 s, never under 10 s)."""
    line = real_server.wait_for(lambda: next(
        (x for x in real_server.log_path.read_text().splitlines()
         if "watchdog: a step may take" in x), None), what="the watchdog's line")
    limit, batch_ms = re.search(r"take ([0-9.]+)s .* took ([0-9]+) ms", line).groups()
    slots = real_server.worker()["slots"]
    assert float(limit) == pytest.approx(max(10.0, 20 * int(batch_ms) / 1000 + 1.0 * slots),
                                         abs=0.2)
    assert 0 < int(batch_ms) < 20_000


def test_models_and_health(real_server, model_id):
    status, _, body = http_json(real_server.port, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [model_id] == ["gemma-3-270m-q4_k_m"]
    status, _, body = http_json(real_server.port, "GET", "/health")
    assert status == 200 and body == {"status": "ok", "workers_ready": 1, "workers_expected": 1}
    status, _, props = http_json(real_server.port, "GET", "/props")    # (llama-server's)
    assert status == 200 and props["model_alias"] == model_id and props["total_slots"] >= 1
    assert props["default_generation_settings"]["n_ctx"] == body_n_ctx(real_server, model_id)


def body_n_ctx(server, model_id) -> int:
    _, _, model = http_json(server.port, "GET", "/v1/models/" + model_id)
    return model["meta"]["n_ctx"]


def test_model_may_be_omitted_when_one_is_served(real_server, model_id):
    status, _, body = http_json(real_server.port, "POST", "/v1/completions",
                                {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and body["model"] == model_id


def test_disconnect_cancels_generation(real_server):
    stream = SSEStream(real_server.port, {"prompt": "List every number from 1 to 1000: 1, 2,",
                                          "max_tokens": 1500, "temperature": 0,
                                          "ignore_eos": True, "stream": True})
    read = sum(1 for _, _ in zip(range(5), stream.events()))
    stream.close()
    worker = real_server.wait_cancelled()
    generated = worker["last_done"]["usage"]["completion_tokens"]
    # 5 chunks read; more were in flight (a step may bring several drafted tokens of the
    # count, and the close takes a few steps to arrive, longer on a loaded machine); far
    # from the 1,500 it writes uncancelled (within one token: tests/test_plumbing.py)
    assert read == 5 and generated < 500, generated
    status, _, body = http_json(real_server.port, "POST", "/v1/completions",
                                {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


def test_disconnect_during_the_prefill_stops_the_prefill(real_server):
    # ~3,700 prompt tokens: seconds of prefill here, decoded 512 tokens a step
    prompt = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(220))
    for stream in (False, True):
        conn = http.client.HTTPConnection("127.0.0.1", real_server.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": prompt, "max_tokens": 50, "cache_prompt": False,
             "stream": stream}).encode(), headers={"Content-Type": "application/json"})
        real_server.wait_for(lambda: (w := real_server.worker())["started"]
                             and not w["generating"], timeout=30,
                             what="the request to be prefilling")
        # (started as it arrived: its tokens are made on the preparing thread first, tens
        # of ms; the prefill then takes seconds here)
        time.sleep(0.5)
        running = real_server.worker()["running"]
        conn.close()                                 # the client leaves mid-prefill
        worker = real_server.wait_for(
            lambda: (w := real_server.wait_cancelled())["last_done"]["id"] in running and w,
            what="this request's cancel")
        assert worker["last_done"]["usage"]["completion_tokens"] == 0, worker["last_done"]
        assert worker["last_done"]["usage"]["prompt_tokens"] > 3000


@pytest.mark.serial
def test_two_workers_serve_two_streams_in_parallel(all_cores):
    server = ServerProcess("--device", "cpu:0", "--device", "cpu:1", workers=2,
                           log_name="two-real").start()
    try:
        spans, texts = {}, {}

        def run(i):
            stream = SSEStream(server.port, {"prompt": CODE_PROMPT, "max_tokens": 48,
                                             "temperature": 0, "stream": True,
                                             "speculative.n_max": 0})
            chunks = []
            for data in stream.events():
                if not chunks:
                    first = time.monotonic()
                chunks.append(data)
            spans[i] = (first, time.monotonic())
            texts[i] = "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        # both streams were producing tokens at the same time ...
        assert max(s[0] for s in spans.values()) < min(s[1] for s in spans.values())
        # ... on two different workers, each pinned to its own core
        def one_each():
            workers = server.status()["workers"]
            return workers if sorted(w["completed"] for w in workers) == [1, 1] else None

        workers = server.wait_for(one_each, timeout=10, what="one request done by each worker")
        assert sorted(tuple(w["placement"]["cores"]) for w in workers) == [(0,), (1,)]
        assert texts[0] == texts[1] and texts[0]
    finally:
        assert server.stop() == 0


def test_the_bench_measures_the_real_stack(real_server):
    """`python -m dispatcher bench` against the whole stack on the bundled model: a figure
    for every part asked for (a stream, the editor workloads, the typing trace), every
    request answered."""
    import subprocess
    import sys
    from conftest import ROOT
    out = subprocess.run(
        [sys.executable, "-m", "dispatcher", "bench", "--url", real_server.url,
         "--concurrency", "1", "--requests", "1", "--max-tokens", "8", "--no-fim",
         "--fim-keystrokes", "0", "--workloads", "edit,fresh,typing", "--sessions", "2",
         "--bursts", "1", "--burst-len", "2", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    # (a server without keys: its parts share what it learns, the first-seen rows say so)
    first_seen = ["stream x1 (warm state)", "edit (warm state)", "fresh (warm state)"]
    assert set(first_seen) <= set(rows), sorted(rows)
    typing = [row for name, row in rows.items() if name.startswith("typing")]
    assert typing, sorted(rows)
    for row in [rows[name] for name in first_seen]:
        assert row["ok"] == row["requests"] >= 1 and row["errors"] == row["truncated"] == 0
        assert row["ttft_p50_ms"] > 0 and row["aggregate_tok_s"] > 0, row
    assert typing[0]["errors"] == 0 and typing[0]["unanswered"] == 0, typing[0]


def test_an_echoed_prompt_with_control_tokens_lines_its_logprobs_up_with_its_text(
        client, model_id):
    """A prompt naming control tokens (a chat turn, `<start_of_turn>`) is echoed as
    sent: each token's text and offset is where it stands in that text (they read "" at
    0, and the text after them stood at offsets of another string); every entry's top
    logprobs hold the token itself, as a generated token's do."""
    prompt = "<start_of_turn>user\nhi<end_of_turn>\n"
    for stream in (False, True):
        answer = client.completions.create(model=model_id, prompt=prompt, max_tokens=3,
                                           temperature=0, echo=True, logprobs=1,
                                           stream=stream, extra_body=NO_CACHE)
        chunks = list(answer) if stream else [answer]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks if c.choices[0].logprobs
                  for t in c.choices[0].logprobs.tokens]
        offsets = [o for c in chunks if c.choices[0].logprobs
                   for o in c.choices[0].logprobs.text_offset]
        tops = [t for c in chunks if c.choices[0].logprobs
                for t in c.choices[0].logprobs.top_logprobs]
        assert text.startswith(prompt) and "".join(tokens) == text
        assert tokens[1:3] == ["<start_of_turn>", "user"]
        assert all(text.startswith(t, o) for t, o in zip(tokens, offsets))
        assert all(t in top for t, top in zip(tokens[1:], tops[1:]))
