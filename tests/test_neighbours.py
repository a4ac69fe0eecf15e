"""Work one request can make the server do before its first token (or in its answer),
each class at the size the limits allow or at one that once took seconds of a worker's
or a front end's time (a tokenization, sampler chains or logprobs over several
choices), sent while another client's stream decodes on the same worker and front end:
the neighbour's largest gap between two tokens stays within a second of what it is
alone, measured in the same test (the whole stack, the bundled model, one worker; every
core, so `serial`).

Each class used to freeze the neighbour: a JSON schema converted in the generation
thread (15.8 s), a grammar of 4,000 parse stacks (165 s a token), a 1 Mi-character prompt
tokenized there (5.3 s), DRY sampler chains with 16 breakers for 8 choices (~8 s), 256
stop strings checked the slow way (28-52 ms a token), prompt logprobs of 512 rows a step
(1.3 s a step), large answers encoded on the front end's loop (seconds), inferred
sessions compared character by character in Python on the dispatcher's thread. And a
grammar the model fights, sampled (drawn from its alphabet: workers/engine/alphabet.py)."""
import json
import os
import pathlib
import threading
import time

import pytest

from conftest import ServerProcess, SSEStream, http_json

pytestmark = [pytest.mark.integration, pytest.mark.serial]

SOURCE = pathlib.Path(os.__file__).read_text()            # real code, on every machine
MEGA = (SOURCE * (1 + (1 << 20) // len(SOURCE)))[: (1 << 20) - 64]
CJK = [chr(0x4E00 + i) for i in range(8000)]

HEAVY = {
    "json_schema of 8,000 non-ASCII properties": ("/v1/completions", {
        "prompt": "x", "max_tokens": 1, "json_schema": {
            "type": "object", "properties": {f"a{c}": {} for c in CJK}}}),
    "json_schema pattern repeated 10^8 times": ("/v1/completions", {
        "prompt": "x", "max_tokens": 1, "json_schema": {
            "type": "string", "pattern": "^\\a\\a\\a\\a{100000002}$"}}),
    "grammar of 4,000 parse stacks": ("/v1/completions", {
        "prompt": "x", "max_tokens": 1, "grammar": "root ::= x x\nx ::= " + " | ".join(
            f'"{c}"' for c in CJK[:4000])}),
    "a 1 Mi-character prompt": ("/v1/completions", {"prompt": MEGA, "max_tokens": 1}),
    "the same as fill-in-the-middle, twice": ("/v1/completions", {
        "prompt": MEGA[:-300], "suffix": MEGA[-300:], "max_tokens": 1}),
    "DRY with 16 breakers, 4 choices": ("/v1/completions", {
        "prompt": "def f(x):", "max_tokens": 2, "n": 4, "dry_multiplier": 0.8,
        "dry_sequence_breakers": [f"b{i}" for i in range(16)]}),
    "stop strings at their limit": ("/v1/completions", {
        "prompt": "def f(x):", "max_tokens": 32, "ignore_eos": True,
        "stop": ["ab" + "x" * 506 + str(i).zfill(4) for i in range(32)]}),
    "n_probs 100 over 4 choices, not streamed": ("/completion", {
        "prompt": "def f(x):", "n_predict": 24, "n_probs": 100, "n_cmpl": 4}),
    "echo with logprobs over 300 tokens, 2 choices": ("/v1/completions", {
        "prompt": SOURCE[:1100], "max_tokens": 0, "echo": True, "logprobs": 5, "n": 2}),
    "/tokenize with pieces of 32 KiB (its limit)": ("/tokenize", {
        "content": MEGA[:1 << 15], "with_pieces": True}),
    "/tokenize of 1 Mi characters": ("/tokenize", {"content": MEGA[:1 << 20]}),
    "a fought grammar, sampled": ("/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8,
        "grammar": "root ::= [^e]*"}),
}


# The longest pause (s, over the stream's alone) each may cause, 1 s unless named here.
# A megabyte's tokenization takes a core of its own for 17-23 s beside the decoding
# (llama.cpp's tokenizer, the GIL released): on a 2-core machine its thread and the
# decode's two share the cores, the decode's threads wait at each node's barrier for one
# preempted, and the stream beside it paused 0.5-1.3 s on a 2-core Intel Xeon (the
# code before 7 December alike: 0.63 and 0.92 s); under 1 s on the EPYC before
# (failures-and-limits.md). Its gaps are still bounded: a stall, such as the GIL held
# through a tokenization, is the whole 17 s.
PAUSE = {"/tokenize of 1 Mi characters": 2.0}


@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--slots", "4", "--max-body", str(16 << 20),
                           "--fim-template", "<PRE> {prefix} <SUF>{suffix} <MID>",
                           log_name="neighbours").start()
    yield server
    assert server.stop() == 0


AFTER = 12          # tokens the neighbour still reads once the heavy request is answered
ALONE = 40          # tokens of a stream alone


def neighbour_gap(port: int, during=None) -> float:
    """The largest gap between two tokens of a greedy stream, with `during()` run once
    its first tokens are out; the stream is read until `during` has returned and AFTER
    more tokens came (then the client leaves), or for ALONE tokens without one."""
    stream = SSEStream(port, {"prompt": "Once upon a time", "max_tokens": 2000,
                              "ignore_eos": True, "temperature": 0, "stream": True,
                              "speculative.n_max": 0}, timeout=600)
    times = []
    worker, answered_at = None, None
    for data in stream.events():
        times.append(time.monotonic())
        assert data != "[DONE]", "the stream ended before the request beside it was answered"
        assert "error" not in json.loads(data), data
        if len(times) == 5 and during is not None:
            worker = threading.Thread(target=during)
            worker.start()
        if answered_at is None and (worker is None and during is None and
                                    len(times) >= ALONE or
                                    worker is not None and not worker.is_alive()):
            answered_at = len(times)
        if answered_at is not None and len(times) >= answered_at + AFTER:
            break
    stream.close()
    if worker is not None:
        worker.join(timeout=600)
    assert answered_at is not None and len(times) >= answered_at + AFTER
    return max(b - a for a, b in zip(times[5:], times[6:]))


def test_no_request_stalls_the_stream_beside_it(server):
    alone = max(neighbour_gap(server.port) for _ in range(2))
    answers, gaps = {}, {}
    for name, (path, body) in HEAVY.items():
        def send(path=path, body=body, name=name):
            started = time.monotonic()
            for _ in range(2 if "twice" in name else 1):
                status, _, payload = http_json(server.port, "POST", path, body,
                                               timeout=600)
            answers[name] = (status, time.monotonic() - started,
                             payload.get("error", {}).get("code")
                             if isinstance(payload, dict) else None)
        gaps[name] = neighbour_gap(server.port, send)
        if gaps[name] >= alone + PAUSE.get(name, 1.0):
            # once more: a stall this class makes comes again, a moment the machine took
            # the core elsewhere (CI's machines are shared) does not
            gaps[name] = min(gaps[name], neighbour_gap(server.port, send))
    report = {name: (round(gaps[name], 2), answers[name]) for name in HEAVY}
    print(f"\nalone {alone:.3f} s;", json.dumps(report))
    for name in HEAVY:
        assert answers[name][0] in (200, 400), report
        assert gaps[name] < alone + PAUSE.get(name, 1.0), (alone, report)
    assert all(answers[name][0] == 400 for name in list(HEAVY)[:5]), report
    assert all(answers[name][0] == 200 for name in list(HEAVY)[5:]), report


def test_a_grammar_whose_stacks_multiply_ends_its_request_not_the_stream_beside_it(server):
    """`r ::= "aaaaaaa" r "b" | "aaaaaaa" r "c" | "d"` doubles llama.cpp's parse stacks
    with every seven a's: too slowly for the check before it runs to see (48 characters
    fed: 64 stacks; one doubling with every "a", `r ::= "a" r "b" | ...`, is refused
    there), not for a long answer. The model is pushed to write a's, and once one
    token's stack work passes 0.1 s the request ends with grammar_too_costly; the stream
    beside it goes on."""
    _, _, tokens = http_json(server.port, "POST", "/tokenize", {"content": "a"})
    body = {"prompt": "a a a a a a a a", "max_tokens": 400, "temperature": 0,
            "grammar": 'root ::= r\nr ::= "aaaaaaa" r "b" | "aaaaaaa" r "c" | "d"',
            "logit_bias": {str(tokens["tokens"][-1]): 100}}
    answer = {}

    def send():
        answer["it"] = http_json(server.port, "POST", "/v1/completions", body, timeout=600)

    alone = neighbour_gap(server.port)
    gap = neighbour_gap(server.port, send)
    if gap >= alone + 1.0:          # (once more: a stall it makes comes again, noise not)
        gap = min(gap, neighbour_gap(server.port, send))
    status, _, payload = answer["it"]
    assert status == 400 and payload["error"]["code"] == "grammar_too_costly", payload
    print(f"\nalone {alone:.3f} s, beside the multiplying grammar {gap:.3f} s")
    assert gap < alone + 1.0, (alone, gap)
