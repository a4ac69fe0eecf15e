"""No request can hurt a worker or another request: content checks, failures confined to
their request, poison pills not requeued, fan-out admitted as a unit, bounded windows,
routing that weighs cache against load. The whole stack on the bundled model."""
import json
import os
import random
import threading
import time

import pytest
import zmq

from conftest import ServerProcess, SSEStream, http_json, two_single_cores
from dispatcher.common.addresses import Endpoints
from dispatcher.common import protocol as P

pytestmark = pytest.mark.integration      # the real model

FAULTS = "admit:[[fail-admit]],token:[[fail-token]],finish:[[fail-finish]]"


@pytest.fixture(scope="module")
def two():
    """Two one-core workers of the real model, with failure hooks keyed by prompt markers."""
    first, second = two_single_cores()
    server = ServerProcess("--device", f"cpu:{first}", "--device", f"cpu:{second}",
                           workers=2, env={"COMPLETIONS_FAULT_RAISE": FAULTS},
                           log_name="hardening")
    server.start()
    yield server
    assert server.stop() == 0


def post(port, body, path="/v1/completions", headers=None, timeout=120):
    status, hdrs, payload = http_json(port, "POST", path, body, headers, timeout)
    return status, payload


def lives(server) -> dict:
    """Each worker's pid and restart count: unchanged means no worker died."""
    return {w["name"]: (w["pid"], w["restarts"]) for w in server.status()["workers"]}


def running_on(server) -> dict[str, list[str]]:
    return {w["name"]: w["running"] for w in server.status()["workers"]}


def worker_of(server, request_id: str) -> str:
    return next(n for n, ids in running_on(server).items() if request_id in ids)


# -- 1. content can never end a worker ------------------------------------------------------
SURROGATE = "a\ud800b"


@pytest.mark.parametrize("body, path, param", [
    ({"prompt": SURROGATE}, "/v1/completions", "prompt"),
    ({"prompt": ["fine", SURROGATE]}, "/v1/completions", "prompt"),
    ({"prompt": [1, 2, SURROGATE]}, "/v1/completions", "prompt"),
    ({"prompt": "x", "suffix": SURROGATE}, "/v1/completions", "suffix"),
    ({"prompt": "x", "grammar": 'root ::= "' + SURROGATE + '"'}, "/v1/completions", "grammar"),
    ({"prompt": "x", "json_schema": {"type": "string", "enum": [SURROGATE]}},
     "/v1/completions", "json_schema"),
    ({"prompt": "x", "json_schema": {SURROGATE: 1}}, "/v1/completions", "json_schema"),
    ({"prompt": "x", "stop": [SURROGATE]}, "/v1/completions", "stop"),
    ({"content": SURROGATE}, "/tokenize", "content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(two, body, path, param):
    raw = json.dumps(body).encode()                  # json escapes it: \ud800
    assert b"\\ud800" in raw
    status, payload = post(two.port, raw, path)
    assert status == 400, payload
    assert payload["error"]["param"] == param and payload["error"]["code"] == "invalid_unicode"
    assert "surrogate" in payload["error"]["message"]


class RawFrontEnd:
    """A front end's two sockets, to hand the dispatcher jobs no HTTP front end would
    let through (as a buggy or hostile peer on the dispatcher's network could)."""

    def __init__(self, server):
        endpoints = Endpoints.from_base(server.dispatcher)
        self.id = P.new_frontend_id()
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.id)
        self.sub.connect(endpoints.tokens_out)
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, self.id)
        self.dealer.connect(endpoints.frontend)
        # no wait for the subscription: the worker waits for it before publishing

    def run(self, job: dict) -> dict:
        """The job's last stream event (end or error), or the dispatcher's refusal as an
        error event. The job is sent as raw JSON (json.dumps: lone surrogates escaped), as
        a hostile peer could."""
        self.dealer.send_multipart([P.PROTO, P.SUBMIT, job["id"].encode(),
                                    json.dumps(job).encode()])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.dealer.poll(0):
                msg = P.decode(self.dealer.recv_multipart())
                if msg.cmd in (P.REJECTED, P.FAILED):
                    return {"e": P.EV_ERROR, **P.to_dict(msg.body)}
            if self.sub.poll(100):
                frames = self.sub.recv_multipart()
                event = json.loads(frames[2])
                if frames[1].decode() == job["id"] and event["e"] in (P.EV_END, P.EV_ERROR):
                    return event
        raise AssertionError("no answer from the worker")

    def close(self):
        self.sub.close(0)
        self.dealer.close(0)
        self.context.term()


def test_content_that_breaks_a_worker_fails_only_its_own_request(two, model_id):
    before = lives(two)
    raw = RawFrontEnd(two)
    try:
        generation = {"max_tokens": 3, "stop": [], "sampling": {}, "cache_prompt": True}
        base = {"model": model_id, "route": {}, "generation": generation}
        for job in ({**base, "prompt": SURROGATE},
                    {**base, "prompt": "x", "suffix": None,
                     "generation": {**generation, "sampling": {"grammar": SURROGATE}}},
                    {"model": model_id, "op": "tokenize", "generation": {"content": SURROGATE}},
                    {"model": model_id, "op": "detokenize", "generation": {"tokens": ["x"]}}):
            event = raw.run({**job, "id": P.new_request_id()})
            assert event["e"] == P.EV_ERROR and event["status"] in (400, 500), event
            # refused at the socket that decodes it (bad_job), or failed by the worker
            assert event["code"] in ("generation_failed", "invalid_value", "bad_job"), event
    finally:
        raw.close()
    status, body = post(two.port, {"prompt": "Hello", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert lives(two) == before


def test_a_message_nested_too_deeply_is_refused_not_the_end_of_the_dispatcher(two, model_id):
    """msgspec raises RecursionError (not a DecodeError) past ~1,000 levels of JSON, even
    in a field it skips: a peer's SUBMIT or READY that deep once ended the broker's loop,
    and `serve` stopped every worker and front end with it."""
    before = lives(two)
    deep = "[" * 3000 + "]" * 3000
    raw = RawFrontEnd(two)
    try:
        job = {"id": P.new_request_id(), "model": model_id, "route": {}, "prompt": "x",
               "generation": {"max_tokens": 3}, "unknown": None}
        frames = [P.PROTO, P.SUBMIT, job["id"].encode(),
                  json.dumps(job).replace("null", deep).encode()]
        raw.dealer.send_multipart(frames)
        assert raw.dealer.poll(10_000), "the dispatcher did not answer"
        msg = P.decode(raw.dealer.recv_multipart())
        assert msg.cmd == P.REJECTED and msg.body.code == "bad_job", msg
        assert "nested too deeply" in msg.body.message
        # nested less deep than msgspec's limit, but deeper than json.dumps goes from the
        # loop's stack: a prompt that deep (routing's json.dumps) ended the loop; a front
        # end's metrics label (absorb's str()) is sent at depths round the same edge
        shallower = "[" * 950 + "]" * 950
        job = {**job, "id": P.new_request_id(), "prompt": None}
        raw.dealer.send_multipart([P.PROTO, P.SUBMIT, job["id"].encode(),
                                   json.dumps(job).replace("null", shallower).encode()])
        assert raw.dealer.poll(10_000), "the dispatcher did not answer"
        msg = P.decode(raw.dealer.recv_multipart())
        assert msg.cmd == P.REJECTED and msg.body.code == "bad_job", msg
        for depth in range(940, 1000, 3):   # (where it fails moves with the stack)
            label = "[" * depth + "]" * depth
            raw.dealer.send_multipart([P.PROTO, P.PING, b"", (
                '{"metrics": {"requests": [[%s, "200", 1]]}}' % label).encode()])
        worker = raw.context.socket(zmq.DEALER)      # a worker's socket takes anyone
        worker.connect(Endpoints.from_base(two.dispatcher).worker)
        worker.send_multipart([P.PROTO, P.READY, b"",
                               ('{"model": "m", "placement": {"a": %s}}' % deep).encode()])
        worker.send_multipart([P.PROTO, P.HEARTBEAT, b"", ('{"x": %s}' % deep).encode()])
        worker.close(0)
    finally:
        raw.close()
    status, body = post(two.port, {"prompt": "Hello", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert lives(two) == before


@pytest.mark.parametrize("phase", ["admit", "token", "finish"])
def test_a_failure_inside_one_request_ends_it_alone(two, phase):
    before = lives(two)
    neighbours = [SSEStream(two.port, {"prompt": f"Count to ten {i}:", "max_tokens": 40,
                                       "temperature": 0, "ignore_eos": True,
                                       "stream": True}) for i in range(2)]
    for stream in neighbours:
        assert stream.next_data() is not None        # both workers are generating
    status, body = post(two.port, {"prompt": f"[[fail-{phase}]] x", "max_tokens": 5})
    assert status == 500, body
    assert body["error"]["code"] == "generation_failed"
    assert body["error"]["message"].startswith("generation failed")
    stream = SSEStream(two.port, {"prompt": f"[[fail-{phase}]] y", "max_tokens": 5,
                                  "stream": True})
    if phase == "admit":
        assert stream.status == 500
    else:
        events = list(stream.events())
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "generation_failed"
    for stream in neighbours:
        events = list(stream.events())
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert lives(two) == before
    status, body = post(two.port, {"prompt": "Hello", "max_tokens": 2})
    assert status == 200


# -- 2. fan-out is admitted as a unit ----------------------------------------------------------
def test_the_documented_choice_limit_is_served_on_an_idle_default_server(real_server):
    port = real_server.port
    status, body = post(port, {"prompt": "Hi", "n": 128, "max_tokens": 2, "temperature": 1,
                               "seed": 1})
    assert status == 200, body
    assert sorted(c["index"] for c in body["choices"]) == list(range(128))
    stream = SSEStream(port, {"prompt": ["A", "B"], "n": 64, "max_tokens": 2,
                              "stream": True, "seed": 2})
    assert stream.status == 200
    finished = {}
    for data in stream.events():
        if data != "[DONE]":
            for choice in json.loads(data)["choices"]:
                if choice["finish_reason"]:
                    finished[choice["index"]] = choice["finish_reason"]
    assert sorted(finished) == list(range(128))
    status, body = post(port, {"prompt": ["A", "B"], "n": 65, "max_tokens": 1})
    assert status == 400 and "128" in body["error"]["message"]   # never a 429


def test_one_request_cannot_keep_a_single_one_behind_all_its_choices(real_server):
    port = real_server.port
    done: dict[str, float] = {}

    def big():
        # (choices long enough to keep some queued until the small one comes, however
        # slow the machine between the queue being seen and its request)
        status, _ = post(port, {"prompt": "List:", "n": 40, "max_tokens": 32,
                                "ignore_eos": True})
        done["big"] = time.monotonic() if status == 200 else -1

    thread = threading.Thread(target=big)
    thread.start()
    real_server.wait_for(lambda: real_server.status()["queue"], what="a queue")
    status, _ = post(port, {"prompt": "Hi", "max_tokens": 2})
    done["small"] = time.monotonic()
    thread.join(timeout=300)
    assert status == 200 and done["big"] > 0
    assert done["small"] < done["big"]


def test_a_request_of_unlimited_choices_on_every_slot_never_keeps_another_waiting(
        real_server):
    """Issue 40's case without API keys: as many choices as the worker has slots, no
    token limit, the end of text ignored (they would run to the context's end): its
    choices take 3/4 of the slots, and a 4-token request beside them is answered at once,
    not when a choice ends."""
    port = real_server.port
    slots = real_server.worker()["slots"]
    hog = SSEStream(port, {"prompt": "List:", "n": slots, "max_tokens": None,
                           "ignore_eos": True, "stream": True, "temperature": 1,
                           "seed": 3}, timeout=600)
    try:
        assert hog.status == 200
        share = max(1, int(slots * 0.75))
        real_server.wait_for(lambda: len(real_server.worker()["generating"]) >= share,
                             timeout=120, what="the long choices running")
        assert len(real_server.worker()["running"]) == share
        started = time.monotonic()
        status, body = post(port, {"prompt": "Hi", "max_tokens": 4}, timeout=120)
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        print(f"\nbeside {slots} unlimited choices: answered in "
              f"{time.monotonic() - started:.1f} s")
    finally:
        hog.close()
    real_server.wait_for(lambda: not real_server.worker()["running"], timeout=60,
                         what="the long choices cancelled")


def test_a_fanned_out_request_takes_one_place_in_the_queue():
    server = ServerProcess("--engine", "fake", "--slots", "1", "--max-queue", "1",
                           log_name="units").start()
    try:
        blocker = SSEStream(server.port, {"prompt": "[slow=0.2] x", "max_tokens": 200,
                                          "stream": True})
        assert blocker.status == 200
        results = {}
        thread = threading.Thread(target=lambda: results.update(n=post(
            server.port, {"prompt": "y", "n": 5, "max_tokens": 2})))
        thread.start()
        server.wait_for(lambda: sum(server.status()["queue"].values()) == 5,
                        what="five jobs of one request queued")
        status, body = post(server.port, {"prompt": "z", "max_tokens": 2})
        assert status == 429 and body["error"]["code"] == "queue_full"    # the queue: 1
        blocker.close()
        thread.join(timeout=60)
        status, body = results["n"]
        assert status == 200 and len(body["choices"]) == 5
    finally:
        assert server.stop() == 0


# -- 3. client numbers are bounded by what the model can use ---------------------------------
def _peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_huge_penalty_window_costs_no_memory(two):
    before = {w["name"]: _peak_rss_kb(w["pid"]) for w in two.status()["workers"]}
    for _ in range(2):
        status, body = post(two.port, {"prompt": "one two one two", "max_tokens": 4,
                                       "repeat_last_n": 2 ** 31 - 1,
                                       "repetition_penalty": 1.3, "top_k": 2 ** 31 - 1,
                                       "min_tokens": 2 ** 31 - 1, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
    after = {w["name"]: _peak_rss_kb(w["pid"]) for w in two.status()["workers"]}
    # a window of 2^31 tokens, allocated, would be 8 GiB; the context is 4096 tokens
    assert all(after[n] - before[n] < 64 * 1024 for n in before), (before, after)


# -- 4. routing balances load against cache benefit ---------------------------------------
HEADER = "# Copyright 2026 Example Corp. Licensed under the Apache License 2.0.\n" \
         "# See LICENSE\n"


def test_streams_sharing_a_short_header_spread_over_idle_workers(two):
    assert 64 < len(HEADER) < 256
    streams = []
    for i in range(4):
        stream = SSEStream(two.port, {"prompt": HEADER + f"def f{i}():", "max_tokens": 200,
                                      "ignore_eos": True, "temperature": 0, "stream": True})
        assert stream.next_data() is not None
        streams.append(stream)
    counts = [len(ids) for ids in running_on(two).values()]
    for stream in streams:
        stream.close()
    assert sorted(counts) == [2, 2]
    two.wait_for(lambda: all(not ids for ids in running_on(two).values()), what="idle")


def test_a_long_cached_prefix_still_draws_its_request(two):
    source = "".join(f"def helper_{i}(value):\n    return value * {i}\n\n" for i in range(40))
    assert len(source) > 1100
    first = SSEStream(two.port, {"prompt": source + "def a():", "max_tokens": 200,
                                 "ignore_eos": True, "temperature": 0, "stream": True})
    assert first.next_data() is not None
    home = worker_of(two, first.headers["x-request-id"])
    second = SSEStream(two.port, {"prompt": source + "def b():", "max_tokens": 200,
                                  "ignore_eos": True, "temperature": 0, "stream": True})
    assert second.next_data() is not None
    try:
        assert worker_of(two, second.headers["x-request-id"]) == home   # one slot ahead
    finally:
        first.close()
        second.close()
    two.wait_for(lambda: all(not ids for ids in running_on(two).values()), what="idle")


# -- 8. valid but odd content reaches the workers and never restarts one -------------------
SPECIAL = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<unk>",
           "<start_of_image>", "[multimodal]", "<mask>"]
ODD_CHARS = ["\x00", "\ufffe", "\uffff", "\ufdd0", "\U0010ffff", "\u202e", "\u0301",
             "\U0001f600", "\t", "\r\n", "\\", "\"", "é", "東京", "\u200b"]


def odd_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.3:
            parts.append(rng.choice(SPECIAL))
        elif kind < 0.7:
            parts.append(rng.choice(ODD_CHARS))
        else:
            parts.append("".join(chr(rng.choice([rng.randint(32, 0xd7ff),
                                                 rng.randint(0xe000, 0x10ffff)]))
                                 for _ in range(rng.randint(1, 6))))
    return "".join(parts)


def odd_grammar(rng: random.Random) -> str:
    pieces = [json.dumps(odd_text(rng)), "[a-z]", "[^\\x00]", "\"x\"*", "(\"a\" | \"b\")+",
              "[\\u0100-\\uffff]", "\"\\u00e9\""]
    body = " ".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))
    return f"root ::= {body}" if rng.random() < 0.8 else body       # some do not parse


def odd_schema(rng: random.Random) -> dict:
    return rng.choice([
        {"type": "string", "enum": [odd_text(rng), odd_text(rng)]},
        {"type": "object", "properties": {odd_text(rng): {"type": "integer"}}},
        {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}, "maxItems": 2},
        {"type": "string", "minLength": 2, "maxLength": 3},
        {"type": "integer", "minimum": -5, "maximum": 5},
        {"$ref": "#/definitions/nowhere"},
        {"type": "nonsense"},
    ])


def odd_request(rng: random.Random, n_vocab: int) -> dict:
    body = {"max_tokens": rng.randint(0, 4), "temperature": rng.choice([0, 0.7, 2])}
    kind = rng.randrange(7)
    if kind == 0:
        body["prompt"] = odd_text(rng)
    elif kind == 1:                    # token ids at the vocabulary's edges
        body["prompt"] = [rng.choice([0, 1, 2, 3, n_vocab - 2, n_vocab - 1, n_vocab,
                                      n_vocab + 1, 2 ** 31 - 1]) for _ in range(4)]
    elif kind == 2:
        body["prompt"] = [odd_text(rng), rng.randint(0, n_vocab - 1), odd_text(rng)]
    elif kind == 3:
        body.update(prompt=odd_text(rng), grammar=odd_grammar(rng))
    elif kind == 4:
        body.update(prompt=odd_text(rng), json_schema=odd_schema(rng))
    elif kind == 5:                    # windows and counts at their largest
        body.update(prompt=odd_text(rng), repeat_last_n=2 ** 31 - 1, top_k=2 ** 31 - 1,
                    repetition_penalty=10.0, presence_penalty=2.0, frequency_penalty=-2.0,
                    mirostat=rng.choice([0, 1, 2]), mirostat_tau=100.0, min_tokens=2 ** 31 - 1,
                    logit_bias={str(n_vocab - 1): 100, "0": -100}, logprobs=5,
                    echo=rng.random() < 0.5, stop=[odd_text(rng) for _ in range(8)])
    else:
        body.update(prompt=odd_text(rng), echo=True, logprobs=rng.choice([None, 0, 5]),
                    n=rng.randint(1, 3), stream=rng.random() < 0.5, seed=rng.randint(0, 9))
    return body


def test_odd_but_valid_content_never_restarts_a_worker(two):
    rng = random.Random(int(os.environ.get("HARDENING_SEED", "20261129")))
    _, vocab = post(two.port, {"content": "<eos>", "add_special": False}, "/tokenize")
    status, body = post(two.port, {"tokens": [0]}, "/detokenize")
    assert status == 200
    n_vocab = 262144                     # Gemma 3's vocabulary
    status, _ = post(two.port, {"tokens": [n_vocab - 1]}, "/detokenize")
    assert status == 200
    status, _ = post(two.port, {"tokens": [n_vocab]}, "/detokenize")
    assert status == 400
    before = lives(two)
    outcomes: dict[int, int] = {}
    for _ in range(36):
        body = odd_request(rng, n_vocab)
        status, payload = post(two.port, json.dumps(body).encode())
        outcomes[status] = outcomes.get(status, 0) + 1
        assert status in (200, 400), (body, payload)
        if status == 400:
            assert payload["error"]["message"]
        for text in (odd_text(rng), "".join(SPECIAL)):
            status, payload = post(two.port, {"content": text, "with_pieces": True},
                                   "/tokenize")
            assert status == 200, (text, payload)
    assert outcomes.get(200, 0) > 12 and vocab
    assert lives(two) == before


def rule_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + \
        f'r{n} ::= "x"\n'


# each reproduced as crashing, wedging or bloating a worker before it was bounded
COSTLY = [
    ({"grammar": rule_chain(75_000)}, "grammar"),                   # SIGSEGV
    ({"grammar": rule_chain(5_000)}, "grammar"),                    # within the size limit
    ({"grammar": 'root ::= "' + "a" * 50_000 + '"{2000}'}, "grammar"),   # +1.6 GB
    ({"grammar": "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} | r{i + 1}\n"
                                           for i in range(40)) + 'r40 ::= "x"\n'},
     "grammar"),                                                    # 2^40 steps
    ({"grammar": 'root ::= "a"{3,1}'}, "grammar"),                  # an endless loop
    ({"grammar": "root ::= [\\U0010FFFF-\\x00]"}, "grammar"),        # was a 500
    ({"grammar": "root ::= <[999999]>"}, "grammar"),                # was a 500 (worker)
    ({"grammar": 'root ::= "a\\x00"'}, "grammar"),                   # was a 500: no token
    ({"grammar": "root ::= [\\u0000]"}, "grammar"),                   # holds a NUL
    ({"grammar": 'root ::= "a" <eos>'}, "grammar"),                 # was a 500 (worker):
    ({"grammar": "root ::= <[106]>"}, "grammar"),                   # an end token is never
    ({"samplers": ["infill"], "top_k": 40}, "samplers"),            # minutes a token
    ({"samplers": ["top_k", "infill"]}, "samplers"),                # top_k 0: the same
    ({"samplers": ["top_k", "infill"], "top_k": 100_000}, "samplers"),
]


def worker_rss_mb(server) -> float:
    total = 0
    for worker in server.status()["workers"]:
        with open(f"/proc/{worker['pid']}/status") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return total / 1024


def test_costly_grammars_and_sampler_orders_are_400s_beside_a_stream(two):
    before = lives(two)
    rss_before = worker_rss_mb(two)
    stream = SSEStream(two.port, {"prompt": "Once upon a time", "max_tokens": 60,
                                  "temperature": 0, "ignore_eos": True, "stream": True})
    first = stream.next_data()
    for extra, param in COSTLY:
        status, payload = post(two.port, {"prompt": "Say something.", "max_tokens": 4,
                                          **extra})
        assert status == 400, (list(extra), payload)
        assert payload["error"]["param"] == param, payload
    events = [first] + list(stream.events())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert lives(two) == before
    # one of these grew a worker by 1.6 GB before it was bounded
    assert worker_rss_mb(two) - rss_before < 300, (rss_before, worker_rss_mb(two))
    # a grammar at the limits is served
    status, payload = post(two.port, {"prompt": "Say yes:", "max_tokens": 3,
                                      "grammar": rule_chain(1_000).replace('"x"', '"yes"')})
    assert status == 200 and payload["choices"][0]["text"] == "yes"


def test_tokenize_and_detokenize_take_the_limits_of_a_prompt(two):
    big = "x " * 600_000                              # over --max-prompt-chars (1 Mi)
    status, payload = post(two.port, {"content": big, "with_pieces": True}, "/tokenize")
    assert status == 413 and payload["error"]["param"] == "content"
    status, payload = post(two.port, {"tokens": [1] * 1_100_000}, "/detokenize")
    assert status == 413 and payload["error"]["param"] == "tokens"
    status, payload = post(two.port, {"content": "x " * 1000, "with_pieces": True},
                           "/tokenize")
    assert status == 200 and len(payload["tokens"]) >= 1000


def test_heavy_bodies_are_bounded_and_parsed_off_the_loop(two):
    before = lives(two)
    stream = SSEStream(two.port, {"prompt": "Once upon a time", "max_tokens": 120,
                                  "temperature": 0, "ignore_eos": True, "stream": True})
    first = stream.next_data()
    # millions of empty lists in a field llama.cpp's routes ignore: refused before parsing
    hostile = b'{"prompt": "x", "n_predict": 1, "junk": [' + b"[]," * 2_000_000 + b"[]]}"
    status, payload = post(two.port, hostile, "/completion")
    assert status == 400 and "arrays and objects" in payload["error"]["message"]
    # a million-character prompt in 128 choices: each copy is over the context; the
    # worker tokenizes it once, and the request fails as a whole
    status, payload = post(two.port, {"prompt": "x" * 1_000_000, "n": 128, "max_tokens": 1})
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded"
    # a valid body that takes the front end a while (about a million token ids to check)
    heavy = {"prompt": [[1] * 15_000 for _ in range(64)], "max_tokens": 1}
    for _ in range(2):
        status, payload = post(two.port, heavy)
        assert status == 400 and payload["error"]["code"] == "context_length_exceeded"
    events = [first] + list(stream.events())        # the stream beside them went on
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert lives(two) == before


# -- 6. the command line refuses what it cannot do ------------------------------------------
def run_cli(*args, timeout=60, env=None):
    import subprocess
    import sys

    from conftest import ROOT
    return subprocess.run([sys.executable, "-m", "dispatcher", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_a_second_dispatcher_on_a_live_address_is_refused_and_harms_nothing(real_server):
    server = real_server
    ipc_dir = server.dispatcher[len("ipc://"):]
    for command in ("broker", "serve"):
        extra = ("--engine", "fake", "--frontends", "0") if command == "serve" else ()
        result = run_cli(command, "--port", str(server.port), *extra)
        assert result.returncode != 0
        assert "already running" in result.stderr and len(result.stderr) < 300
    assert os.path.isdir(ipc_dir)
    assert server.status()["workers"][0]["state"] in ("idle", "busy")   # still answers
    status, _ = post(server.port, {"prompt": "x", "max_tokens": 2})
    assert status == 200


def test_a_file_that_is_not_gguf_is_refused_at_once(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("not a model\n" * 10)
    for command in ("serve", "check-config"):
        result = run_cli(command, "--model", str(bad), "--port", "1")
        assert result.returncode != 0
        assert str(bad) in result.stderr + result.stdout
        assert "not a GGUF model file" in result.stderr + result.stdout
        assert "Traceback" not in result.stderr


def test_serve_exits_when_no_worker_can_load_the_model(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(4096))       # the magic, then garbage
    started = time.monotonic()
    result = run_cli("serve", "--model", str(broken), "--frontends", "0", "--port",
                     str(ServerProcess().port), timeout=120)
    assert result.returncode != 0
    assert "no worker can load the model" in result.stderr
    assert result.stderr.count("Traceback") == 0
    assert time.monotonic() - started < 60


def test_core_ranges_beyond_the_machine_are_refused_at_once():
    for spec in ("cpu:0-20000000", "cpu:0-5000", f"cpu:{os.cpu_count()}"):
        started = time.monotonic()
        result = run_cli("check-config", "--device", spec)
        assert result.returncode != 0 and time.monotonic() - started < 20
        assert len(result.stdout + result.stderr) < 600, result.stdout + result.stderr


def test_boolean_flags_work_bare():
    from dispatcher.cli import main  # noqa: F401  (the parser is built in main)
    result = run_cli("check-config", "--deterministic", "--json")
    assert result.returncode == 0, result.stderr
    result = run_cli("check-config", "--deterministic", "false", "--json")
    assert result.returncode == 0, result.stderr
    result = run_cli("check-config", "--deterministic", "maybe")
    assert result.returncode != 0 and "true or false" in result.stderr


def odd_files(tmp_path) -> dict[str, str]:
    files = {"not-utf8.toml": b"\xff\xfe[server]\n", "models-5.toml": b"models = 5\n",
             "server-array.toml": b"[[server]]\nport = 1\n",
             "workers-strings.toml": b'workers = ["cpu"]\n', "binary.toml": os.urandom(64),
             "not-toml.toml": b"[server\n"}
    out = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        out[name] = str(tmp_path / name)
    out["directory"] = str(tmp_path)
    return out


GARBAGE = [
    ("status", "--dispatcher", "foo"), ("drain", "x", "--dispatcher", "tcp://127.0.0.1:99999"),
    ("resume", "x", "--dispatcher", "tcp://nohost"), ("status", "--port", "x"),
    ("restart", "x", "--grace", "nan"), ("restart", "x", "--grace", "inf"),
    ("reload", "x", "--grace", "-1"), ("reload", "x", "--model", "/etc/hostname"),
    ("reload", "x", "--model", "/no/such/model.gguf"),
    ("serve", "--queue-timeout", "inf"), ("serve", "--stop-grace", "nan"),
    ("serve", "--slots", "1e3"), ("serve", "--device", "tpu:0"), ("serve", "--nctx", "0"),
    ("broker", "--dispatcher", "ipc://"), ("check-config", "--max-queue", "-1"),
    ("selftest", "--timeout", "nan"), ("soak", "--duration", "inf"), ("soak", "--rate", "x"),
    ("bench", "--keystroke-gap", "nan"), ("no-such-command",), (),
]


@pytest.mark.parametrize("args", GARBAGE, ids=" ".join)
def test_garbage_on_the_command_line_is_one_line_and_a_failure(args):
    result = run_cli(*args, "--port", "1") if args and args[0] in ("serve", "broker") \
        else run_cli(*args)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode != 0 and "Traceback" not in output, output
    assert len(output.splitlines()) == 1, output


def test_odd_config_files_are_problems_not_tracebacks(tmp_path):
    for name, path in odd_files(tmp_path).items():
        for command in ("check-config", "status", "serve"):
            result = run_cli(command, "--config", path, "--port", "1")
            output = result.stdout + result.stderr
            assert result.returncode != 0 and "Traceback" not in output, (name, output)
            assert path in output, (name, output)


# -- 7. HTTP details ----------------------------------------------------------------------
def test_wrong_method_gets_allow_and_a_code(two):
    status, headers, body = http_json(two.port, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] and "POST" in headers["Allow"]
    assert body["error"]["code"] == "method_not_allowed"
    status, headers, body = http_json(two.port, "DELETE", "/v1/models")
    assert status == 405 and "GET" in headers["Allow"]


def test_session_ids_are_scoped_by_api_key():
    server = ServerProcess("--engine", "fake", "--api-key", "key-a", "--api-key", "key-b",
                           log_name="sessions").start()
    try:
        def stream(key, max_tokens=16):
            return SSEStream(server.port, {"prompt": "[slow=0.05] x",
                                           "max_tokens": max_tokens,
                                           "stream": True}, timeout=30,
                             headers={"X-Session-Id": "same", "Authorization": f"Bearer {key}"})

        a = stream("key-a")
        assert a.next_data() is not None
        b = stream("key-b")                          # same session id, other key
        events = list(b.events())
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        events = list(a.events())                    # not superseded by key b
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        a2, a3 = stream("key-a", max_tokens=400), None    # still running when a3 comes
        assert a2.next_data() is not None
        a3 = stream("key-a")                         # same key: supersedes a2
        events = list(a2.events())
        assert json.loads(events[-2])["error"]["code"] == "superseded"
        list(a3.events())
    finally:
        assert server.stop() == 0


def test_a_malformed_control_request_gets_an_error_not_a_dead_dispatcher(real_server):
    from dispatcher.tools.ctl import control_request
    for request in ({"cmd": ["status"]}, {"cmd": "drain", "worker": ["w"]},
                    {"cmd": "restart", "worker": "x", "grace": [1]}):
        reply = control_request(real_server.dispatcher, request)
        assert "error" in reply
    assert real_server.status()["workers"]


@pytest.mark.parametrize("make", ["open to others", "another user's", "a link"])
def test_an_ipc_directory_another_user_could_use_is_refused(tmp_path, make):
    """The default ipc directory (/tmp/completions-PORT) made first by someone else, or
    left writable to others: whoever can write into it can move a socket aside and bind
    their own, so serve refuses it with one line naming it, and binds nothing there."""
    import tempfile

    from conftest import free_port
    port = free_port()
    path = os.path.join(tempfile.gettempdir(), f"completions-{port}")
    if make == "a link":
        os.symlink(tmp_path, path)
    else:
        os.mkdir(path)
        os.chmod(path, 0o777 if make == "open to others" else 0o700)
        if make == "another user's":
            os.chown(path, 65534, 65534)
    try:
        out = run_cli("serve", "--engine", "fake", "--port", str(port), "--frontends", "0")
        assert out.returncode != 0
        line = out.stderr.strip().splitlines()[-1]
        assert line.startswith(f"refusing the ipc directory {path}"), out.stderr[-500:]
        assert not os.path.islink(path) and os.listdir(path) == [] if make != "a link" \
            else os.listdir(tmp_path) == []
    finally:
        if os.path.islink(path):
            os.unlink(path)
        else:
            os.rmdir(path)
