"""Continuous batching, prefix-cache reuse, cache-aware routing, superseding and the
bench command, through the whole stack."""
import argparse
import json
import subprocess
import sys
import threading

import pytest

from conftest import ROOT, ServerProcess, SSEStream, http_json

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The planets of the solar system are"]
LONG = "# utility module for parsing configuration files and validating them\n"


def complete(port, body, headers=None):
    status, _, payload = http_json(port, "POST", "/v1/completions", body, headers=headers)
    return status, payload


@pytest.mark.integration
def test_batched_equals_unbatched_at_temperature_zero(det_server):
    """In the deterministic configuration, requests decoded together in one batch give
    exactly what each gives alone (tokens and logprobs)."""
    body = {"max_tokens": 24, "temperature": 0, "logprobs": 1}
    alone = [complete(det_server.port, {**body, "prompt": p})[1]["choices"][0]
             for p in PROMPTS]
    # (the streams run on past the 24 tokens compared, so that all four are still
    # running when the worker is asked, however long a loaded machine took to start them)
    streams = [SSEStream(det_server.port, {**body, "max_tokens": 400, "prompt": p,
                                           "stream": True}) for p in PROMPTS]
    busy = det_server.worker()["busy_slots"]                # every stream has started ...
    tokens, lps = [[] for _ in PROMPTS], [[] for _ in PROMPTS]
    for i, stream in enumerate(streams):
        for data in stream.events():
            if data == "[DONE]" or len(lps[i]) >= body["max_tokens"]:
                break
            logprobs = json.loads(data)["choices"][0]["logprobs"] or {}
            tokens[i] += logprobs.get("tokens", [])     # (a chunk may bring several)
            lps[i] += logprobs.get("token_logprobs", [])
        stream.close()
    texts = ["".join(each[:body["max_tokens"]]) for each in tokens]
    lps = [each[:body["max_tokens"]] for each in lps]
    assert busy == len(PROMPTS)                              # ... in one worker, together
    assert texts == [a["text"] for a in alone]
    assert lps == [a["logprobs"]["token_logprobs"] for a in alone]


@pytest.mark.integration
def test_a_prompt_extending_the_last_reuses_its_cached_prefix(real_server):
    port = real_server.port
    first = LONG + "def load(path):"
    _, a = complete(port, {"prompt": first, "max_tokens": 2, "temperature": 0})
    _, b = complete(port, {"prompt": first + "\n    with open(path) as f:", "max_tokens": 2,
                           "temperature": 0})
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        a["usage"]["prompt_tokens"] - 1
    _, c = complete(port, {"prompt": first, "max_tokens": 2, "temperature": 0,
                           "cache_prompt": False})
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0



@pytest.mark.integration
def test_chunks_further_along_in_the_cache_are_shifted_into_place_and_counted(real_server):
    """KV chunk reuse (--cache-reuse, 256 by default): llama.vim's ring of context chunks
    dropped its oldest; the two it kept are found further along in a slot's cache and
    shifted, not prefilled; `cached_tokens` and `/completion`'s `tokens_cached` count
    them."""
    port = real_server.port
    chunks = ["".join(f"def helper_{k}_{i}(value):\n    return value * {i} + {k}\n\n"
                      for i in range(12)) for k in range(4)]
    local = "def main():\n    total ="
    status, _, tokens = http_json(port, "POST", "/tokenize", {"content": chunks[1] + chunks[2]})
    kept = len(tokens["tokens"])
    assert status == 200 and kept > 256
    status, a = complete(port, {"prompt": chunks[0] + chunks[1] + chunks[2] + local,
                                "max_tokens": 2, "temperature": 0})
    assert status == 200
    status, b = complete(port, {"prompt": chunks[1] + chunks[2] + chunks[3] + local,
                                "max_tokens": 2, "temperature": 0})
    assert status == 200
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= kept - 2
    assert b["choices"][0]["finish_reason"] == "length"
    # llama.cpp's native endpoint reports the same count as tokens_cached
    status, _, c = http_json(port, "POST", "/completion", {
        "prompt": chunks[2] + chunks[3] + local, "n_predict": 1, "temperature": 0})
    assert status == 200
    assert c["tokens_cached"] >= len(http_json(port, "POST", "/tokenize", {
        "content": chunks[2] + chunks[3]})[2]["tokens"]) // 2



@pytest.fixture(scope="module")
def two_fake_workers():
    server = ServerProcess("--engine", "fake", "--device", "cpu", "--device", "cpu",
                           "--slots", "3", workers=2, log_name="routing").start()
    yield server
    assert server.stop() == 0


def running_on(server) -> dict[str, list[str]]:
    return {w["name"]: w["running"] for w in server.status()["workers"]}


def start_slow(server, prompt, tokens=1000, headers=None):
    stream = SSEStream(server.port, {"prompt": prompt, "max_tokens": tokens,
                                     "stream": True})
    assert stream.status == 200
    return stream


def worker_of(server, request_id) -> str:
    return next(name for name, ids in running_on(server).items() if request_id in ids)


def test_routing_prefers_the_cached_prefix_then_the_least_loaded(two_fake_workers):
    server = two_fake_workers
    slow = "[slow=0.1] "
    source = LONG * 16                   # > 1,024 characters: worth one busy slot more
    x = start_slow(server, slow + source + "def a():")
    w_x = worker_of(server, x.headers["x-request-id"])
    u1 = start_slow(server, slow + "unrelated one")
    w_u1 = worker_of(server, u1.headers["x-request-id"])
    assert w_u1 != w_x                                # more free slots there
    u2 = start_slow(server, slow + "unrelated two")
    assert worker_of(server, u2.headers["x-request-id"]) == w_x   # least recently used
    # now w_x has 1 free slot and the other 2; the long shared prefix still wins
    x2 = start_slow(server, slow + source + "def b():")
    assert worker_of(server, x2.headers["x-request-id"]) == w_x
    u3 = start_slow(server, slow + "unrelated three")
    assert worker_of(server, u3.headers["x-request-id"]) == w_u1  # least loaded again
    for stream in (x, u1, u2, x2, u3):
        stream.close()
    # (their cancels counted before the next test, which counts one of its own)
    server.wait_for(lambda: not any(running_on(server).values()), timeout=30,
                    what="the closed streams' cancels")


def test_a_new_request_of_a_session_supersedes_the_running_one(two_fake_workers):
    server = two_fake_workers
    headers = {"X-Session-Id": "editor-1"}
    old = SSEStream(server.port, {"prompt": "[slow=0.1] def f(", "max_tokens": 200,
                                  "stream": True}, timeout=30, headers=headers)
    assert json.loads(old.next_data())["choices"][0]["text"]
    before = sum(w["cancelled"] for w in server.status()["workers"])
    status, new = complete(server.port, {"prompt": "def f(x", "max_tokens": 5}, headers)
    assert status == 200 and new["choices"][0]["finish_reason"] == "length"
    rest = list(old.events())
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "superseded" and rest[-1] == "[DONE]"
    server.wait_for(lambda: sum(w["cancelled"] for w in server.status()["workers"])
                    == before + 1, timeout=10, what="the worker to drop the old request")


def test_a_queued_request_superseded_never_runs_and_siblings_are_kept():
    server = ServerProcess("--engine", "fake", "--slots", "1", log_name="supersede").start()
    try:
        # the blocker holds the only slot until it is closed, whatever the machine's speed
        blocker = start_slow(server, "[slow=0.05]", tokens=2000)
        headers = {"X-Session-Id": "editor-2"}
        results = {}

        def send(name, body):
            results[name] = complete(server.port, body, headers)

        first = threading.Thread(target=send, args=("first", {"prompt": "v1",
                                                               "max_tokens": 3}))
        first.start()
        server.wait_for(lambda: sum(server.status()["queue"].values()) == 1,
                        what="the first request to queue")
        second = threading.Thread(target=send, args=("second", {"prompt": "v2",
                                                                 "max_tokens": 3, "n": 2}))
        second.start()
        first.join(timeout=30)
        assert results["first"][0] == 409
        assert results["first"][1]["error"]["code"] == "superseded"
        assert server.status()["stats"]["superseded"] == 1
        blocker.close()                                          # the slot frees up
        second.join(timeout=30)
        status, body = results["second"]
        assert status == 200 and len(body["choices"]) == 2      # siblings both ran
        server.wait_for(lambda: sum(w["completed"] for w in server.status()["workers"]) == 2
                        and sum(w["cancelled"] for w in server.status()["workers"]) == 1,
                        timeout=10, what="the siblings done, the blocker cancelled")
    finally:
        assert server.stop() == 0


def test_bench_reports_every_workload(two_fake_workers):
    out = subprocess.run(
        [sys.executable, "-m", "dispatcher", "bench", "--url", two_fake_workers.url,
         "--concurrency", "1,2", "--requests", "2", "--max-tokens", "8",
         "--fim-keystrokes", "4", "--keystroke-interval", "0.05", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    # (the fake engine has no FIM tokens: the replay's prefix grows alone, named so)
    fim_name = "keystrokes (prefix only: suffix refused) (warm state)"
    # (a server without keys: its parts share what it learns, the first-seen rows say so)
    assert set(rows) == {"stream x1 (warm state)", "stream x2 (warm state)",
                         "extend prompt (warm)", fim_name}
    for name in ("stream x1 (warm state)", "stream x2 (warm state)", "extend prompt (warm)"):
        row = rows[name]
        assert row["ok"] == row["requests"] and row["errors"] == row["truncated"] == 0
        assert row["ttft_p50_ms"] > 0 and row["aggregate_tok_s"] > 0
    fim = rows[fim_name]
    assert fim["ok"] >= 1 and fim["superseded"] >= 1 and fim["errors"] == 0
    table = subprocess.run(
        [sys.executable, "-m", "dispatcher", "bench", "--url", two_fake_workers.url,
         "--concurrency", "1", "--requests", "1", "--max-tokens", "4", "--no-fim",
         "--runs", "2", "--profile"],
        cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    assert "TTFT p50 ms" in table and "stream x1" in table
    assert "medians over 2 runs" in table
    profile = table[table.index("step profile"):]       # the fake engine's steps counted
    assert "| x1 " in profile and "| extension " in profile


def test_bench_runs_each_part_on_every_target_round_by_round(monkeypatch):
    """A machine whose speed drifts must shift every target's figure of a part alike:
    the bench runs the first part on each target, then the second...; within the
    streams at one concurrency and the single-stream workloads, a round (a request, or
    a round of concurrent streams) on each target in turn, the first target rotating."""
    from dispatcher.tools import bench
    from dispatcher.tools.bench_targets import Level
    calls = []

    class Target:
        def __init__(self, url, model, api_key=None):
            self.name = url

    def whole(part):
        def run_part(target, *args, **kwargs):
            calls.append((part, target.name))
            return Level(part, 1)
        return run_part

    def in_rounds(part, count):
        def rounds(target, *args, **kwargs):
            for i in range(count):
                calls.append((f"{part}{i}", target.name))
                yield
            return Level(f"{part} on {target.name}", 1)
        return rounds

    class InProcess:                  # llama-cpp-python in the bench: fewer parts
        def __init__(self, path, n_ctx, threads):
            self.name = "in-process"

    from dispatcher.common import models
    monkeypatch.setattr(models, "resolve_model_path", lambda path: "model.gguf")
    monkeypatch.setattr(bench, "HttpTarget", Target)
    monkeypatch.setattr(bench, "InProcessTarget", InProcess)
    monkeypatch.setattr(bench, "level_rounds", in_rounds("level", 2))
    monkeypatch.setattr(bench, "run_extension", whole("extension"))
    monkeypatch.setattr(bench, "single_rounds", in_rounds("single", 3))
    monkeypatch.setattr(bench, "run_typing", whole("typing"))
    monkeypatch.setattr(bench, "table", lambda rows, runs=False: "\n".join(
        f"{row['target']} {row['name']}" for row in rows))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--url", "a", "--url", "b", "--concurrency", "1,8",
                              "--no-fim", "--workloads", "edit,fresh,typing"])
    assert bench.run(args) == 0
    ab, ba = ("a", "b"), ("b", "a")
    # each part's first round starts one target later than the part before it (a part
    # that runs whole, typing, goes first on each target in turn, by part and by run)
    two = [(name, t) for name, order in (
        ("level0", ab), ("level1", ba),                               # x1
        ("level0", ba), ("level1", ab),                               # x8
        ("extension", ab),
        ("single0", ba), ("single1", ab), ("single2", ba),            # edit
        ("single0", ab), ("single1", ba), ("single2", ab),            # fresh
        ("typing", ba)) for t in order]
    assert calls == two
    calls.clear()            # the in-process target has no typing: it runs each part
    args.in_process = "bundled"          # it has beside the others' same part
    assert bench.run(args) == 0
    def three(turn):        # the first turns; every other pass the others go the other way
        targets = ("a", "b", "in-process")
        first = turn % 3
        others = list(targets[first + 1:] + targets[:first])
        if turn // 3 % 2:
            others.reverse()
        return (targets[first], *others)
    assert three(0) == ("a", "b", "in-process") and three(3) == ("a", "in-process", "b")
    assert calls == [(name, t) for name, turn in (
        ("level0", 0), ("level1", 1), ("level0", 1), ("level1", 2), ("extension", 2),
        ("single0", 3), ("single1", 4), ("single2", 5),
        ("single0", 4), ("single1", 5), ("single2", 6)) for t in three(turn)] + \
        [("typing", "b"), ("typing", "a")]
    calls.clear()
    args.in_process, args.runs = None, 2  # everything again: each part's order turned
    assert bench.run(args) == 0
    swap = {"a": "b", "b": "a"}
    assert calls == two + [(name, swap[t]) for name, t in two]


def test_constrained_and_hostile_parts_report_every_run(monkeypatch, capsys):
    """With --runs 2, the constrained neighbours' slowdowns are the median of the runs
    with their range, and the hostile part's lines are printed for each run (once only
    the last run's were)."""
    from dispatcher.tools import bench
    from dispatcher.tools.bench_targets import Level
    runs = iter(range(1, 10))

    class Target:
        def __init__(self, url, model, api_key=None):
            self.name = url

    def constrained(target, *args):
        itl = {"plain + plain": 10.0, "plain + json_schema": 10.0 * (1 + next(runs))}
        return [Level(name, 2, itl_ms=ms) for name, ms in itl.items()] + \
            [Level(f"{name} beside", 1, ok=1) for name in ("plain", "json_schema")]

    hostile = iter(["first", "second"])
    monkeypatch.setattr(bench, "HttpTarget", Target)
    def level(*args, **kwargs):
        return Level("stream x1", 1)
        yield                                         # (a part run in rounds)

    monkeypatch.setattr(bench, "level_rounds", level)
    monkeypatch.setattr(bench, "run_extension", lambda *a, **k: Level("extension", 1))
    monkeypatch.setattr(bench, "run_constrained", constrained)
    monkeypatch.setattr(bench, "run_hostile", lambda *a: [f"  the {next(hostile)} run"])
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--url", "a", "--concurrency", "1", "--no-fim", "--runs", "2",
                              "--constrained", "--hostile"])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "beside a json_schema stream = 2.50x beside a plain one (2.00-3.00 over 2 runs)" \
        in out, out
    assert "a (run 1):\n  the first run" in out and "a (run 2):\n  the second run" in out


def test_each_run_of_the_bench_takes_files_of_its_own():
    from dispatcher.tools.bench import RunFiles, medians
    from dispatcher.tools.bench_corpus import Corpus
    corpus = Corpus(seed=5)
    first = corpus.files_for("x8", 4)
    second = RunFiles(corpus, 1).files_for("x8", 4)
    assert not set(first) & set(second)
    assert RunFiles(corpus, 1).files_for("x8", 4) == second      # the same when asked again
    rows = [{"target": "t", "name": "edit", "stream_tok_s": v, "ttft_p50_ms": None}
            for v in (30.0, 10.0, 20.0)]
    for row in rows:
        row["errors"], row["truncated"] = 0, 0
    rows[0]["truncated"] = 1                                 # (a failed stream, told)
    assert medians(rows) == [{"target": "t", "workload": "edit", "runs": 3, "failed": 1,
                              "stream_tok_s": "20.0 (10.0-30.0)"}]


def test_bench_figures_of_a_part_in_rounds_are_timed_over_its_own_rounds(monkeypatch):
    """Other targets' rounds run between one target's: a part's aggregate rate counts
    only the time of its own requests (a fake clock: each request takes 1 s, each other
    target's round 100 s)."""
    from dispatcher.tools import bench
    from dispatcher.tools.bench_targets import Sample
    clock = [0.0]
    lock = threading.Lock()

    class Clock:
        @staticmethod
        def perf_counter():
            return clock[0]

    class Target:
        name = "fake engine"

        def complete(self, prompt, max_tokens, **kwargs):
            with lock:
                clock[0] += 1.0
            return Sample(ok=True, ttft=0.01, tokens=max_tokens, decode_s=0.5)

    monkeypatch.setattr(bench, "time", Clock)

    def between(rounds):             # another target's round after each of this one's
        while True:
            try:
                next(rounds)
            except StopIteration as done:
                return done.value
            clock[0] += 100.0

    level = between(bench.single_rounds(Target(), "edit", ["p", "q"], 2, 10, 0.0))
    assert level.requests == 4 and level.wall_s == 4.0 and level.aggregate_tok_s == 10.0
    level = between(bench.level_rounds(Target(), 4, [f"p{i}" for i in range(6)], 8))
    assert level.requests == 6 and level.tokens == 48
    assert level.wall_s == 6.0       # rounds of 4 and 2 streams, the fake's 1 s apiece


def test_a_request_the_client_sent_earlier_never_supersedes_a_later_one(two_fake_workers):
    server = two_fake_workers
    port = server.port
    newer = {"X-Session-Id": "order-1", "X-Session-Seq": "2"}
    older = {"X-Session-Id": "order-1", "X-Session-Seq": "1"}
    results = {}
    thread = threading.Thread(target=lambda: results.update(newer=complete(
        port, {"prompt": "[slow=0.05] newer", "max_tokens": 20}, newer)))
    thread.start()
    server.wait_for(lambda: any(w["running"] for w in server.status()["workers"]),
                    what="the newer request running")
    status, body = complete(port, {"prompt": "older", "max_tokens": 2}, older)
    assert status == 409 and body["error"]["code"] == "superseded"     # it lost the race
    thread.join(timeout=60)
    status, body = results["newer"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    status, _ = complete(port, {"prompt": "late", "max_tokens": 2},
                         {"X-Session-Id": "order-1", "X-Session-Seq": "1"})
    assert status == 409                                              # even afterwards
    status, _ = complete(port, {"prompt": "next", "max_tokens": 2},
                         {"X-Session-Id": "order-1", "X-Session-Seq": "3"})
    assert status == 200
    status, body = complete(port, {"prompt": "x"}, {"X-Session-Id": "order-2",
                                                    "X-Session-Seq": "soon"})
    assert status == 400 and body["error"]["param"] == "X-Session-Seq"


def test_bench_editor_workloads(two_fake_workers):
    out = subprocess.run(
        [sys.executable, "-m", "dispatcher", "bench", "--url", two_fake_workers.url,
         "--concurrency", "1", "--requests", "1", "--max-tokens", "4", "--no-fim",
         "--workloads", "edit,fresh,fresh1,sampled,repeat,typing,cold", "--sessions", "2",
         "--bursts", "1", "--burst-len", "3", "--keystroke-gap", "0.05", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    # (the cold request below is refused: a bench with a failed request says so, 1)
    assert out.returncode == 1 and "1 request(s) failed" in out.stderr, out.stderr
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    for name, requests in (("edit (warm state)", 1), ("fresh (warm state)", 1),
                           ("fresh1 (warm state)", 1), ("sampled (warm state)", 1),
                           ("repeat (warm)", 1)):
        assert rows[name]["ok"] == rows[name]["requests"] == requests   # --requests 1
        assert rows[name]["errors"] == 0
    # cold: a file's first 12,000 characters, past the fake engine's context (a token
    # a byte, 4,096): sent whole, refused
    cold = rows["cold (warm state)"]
    assert cold["requests"] == 1 and cold["errors"] == 1
    assert "context length" in cold["error_samples"][0]
    typing = rows["typing (plugin-like) (warm state)"]     # stale requests closed at once, no header
    assert typing["requests"] == 2 and typing["ok"] == 2 and typing["errors"] == 0
    assert typing["unanswered"] == 0 and 0 <= typing["closed"] <= 4
    assert typing["first_line_p95_ms"] is None or \
        typing["first_line_p95_ms"] >= typing["first_line_p50_ms"]


@pytest.mark.integration
def test_a_running_stream_keeps_getting_tokens_while_a_3000_token_prompt_is_prefilled(
        real_server):
    """Chunked prefill on the real stack: a 3,000-token prompt is decoded a chunk (512
    tokens) a step beside a running stream, so the stream's tokens keep coming during
    the prefill (counted in tokens, not seconds: a slow machine cannot fail it)."""
    import time
    port = real_server.port
    running = SSEStream(port, {"prompt": "Once upon a time", "max_tokens": 600,
                               "temperature": 0, "ignore_eos": True, "stream": True})
    assert running.status == 200
    arrivals: list[float] = []

    def read():
        try:
            for data in running.events():
                if data == "[DONE]":
                    return
                arrivals.append(time.monotonic())
        except (OSError, ValueError, AttributeError):   # closed under it at the end
            return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while len(arrivals) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    long_prompt = "def helper_%d(value):\n    return value * %d\n\n"
    text = "".join(long_prompt % (i, i) for i in range(200))
    status, _, tokens = http_json(port, "POST", "/tokenize", {"content": text})
    assert status == 200 and len(tokens["tokens"]) >= 3000
    sent = time.monotonic()
    cold = SSEStream(port, {"prompt": text, "max_tokens": 1, "temperature": 0,
                            "cache_prompt": False, "stream": True},
                     timeout=600)              # (headers come with the first token)
    assert cold.status == 200
    assert cold.next_data() is not None          # its first token: the prefill is done
    first = time.monotonic()
    during = sum(1 for t in arrivals if sent <= t <= first)
    running.close()
    cold.close()
    reader.join(timeout=10)
    # six chunks of 512: the stream decoded a token beside each (one stall would give 0,
    # or 1 where a reader's timestamp lags its token)
    assert during >= 3, f"{during} tokens of the running stream during the prefill"


def test_a_neighbour_that_never_streamed_gets_no_slowdown_and_json_keeps_the_checks(
        monkeypatch, capsys):
    """A server that refuses json_schema neighbours (no grammars) got a slowdown ratio
    beside a stream of 400s; --json dropped the constrained and hostile results."""
    from dispatcher.tools import bench
    from dispatcher.tools.bench_checks import constrained_slowdowns
    rows = [{"target": "t", "name": name, "itl_ms": 10.0, "ok": ok}
            for name, ok in (("plain + plain", 1), ("plain + json_schema", 1),
                             ("plain beside", 3), ("json_schema beside", 0))]
    assert constrained_slowdowns(rows) == {}
    rows[-1]["ok"] = 2
    assert constrained_slowdowns(rows) == {"t": {"json_schema": [1.0]}}
    from dispatcher.tools.bench_targets import Level

    class Target:
        def __init__(self, url, model, api_key=None):
            self.name = url

    def level(*args, **kwargs):
        return Level("stream x1", 1)
        yield                                         # (a part run in rounds)
    monkeypatch.setattr(bench, "HttpTarget", Target)
    monkeypatch.setattr(bench, "level_rounds", level)
    monkeypatch.setattr(bench, "run_extension", lambda *a, **k: Level("extension", 1))
    monkeypatch.setattr(bench, "run_hostile", lambda *a: ["  a line"])
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--url", "a", "--concurrency", "1", "--no-fim", "--hostile",
                              "--json"])
    assert bench.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hostile"] == ["a:", "  a line"]
    assert [r["name"] for r in out["rows"]] == ["stream x1 (warm state)", "extension"]
    # a refused neighbour is no neighbour, not a failed bench; a failed plain request is
    from types import SimpleNamespace
    args = SimpleNamespace(json=True, profile=False, constrained=True, hostile=False, runs=1)
    row = {"target": "t", "ok": 1, "itl_ms": 10.0, "errors": 0, "truncated": 0,
           "error_samples": []}
    refused = [{**row, "name": "plain + plain"}, {**row, "name": "plain beside"},
               {**row, "name": "json_schema beside", "ok": 0, "errors": 5}]
    assert bench.report(args, refused, [], []) == 0
    refused[0]["errors"] = 1
    assert bench.report(args, refused, [], []) == 1
    capsys.readouterr()


def test_the_benchs_percentiles_and_urls():
    """p50 is the median (the nearest rank rounded half to even gave the lower or the
    upper middle value by turns: [100, 200] was 100); an https URL is spoken to as
    https, on 443 by default (it went in clear to port 80, the key with it); a URL
    without a scheme is refused in one line (it was a TypeError)."""
    import http.client

    from dispatcher.tools.bench_targets import HttpTarget, percentile
    assert percentile([100, 200], 0.5) == 150 and percentile([3, 1, 2], 0.5) == 2
    assert percentile([1, 2, 3, 4], 0.5) == 2.5 and percentile([5], 0.95) == 5
    assert percentile(list(range(24)), 0.95) == pytest.approx(21.85)
    assert percentile([], 0.5) is None
    secure = HttpTarget("https://example.invalid/v1", "m")
    assert secure.connection is http.client.HTTPSConnection and secure.port == 443
    plain = HttpTarget("http://127.0.0.1:9/v1", "m")
    assert plain.connection is http.client.HTTPConnection and plain.port == 9
    with pytest.raises(SystemExit, match="http:// or https://"):
        HttpTarget("127.0.0.1:8080", "m")


def test_the_fim_replays_first_keystroke_is_not_its_probes_prompt():
    """The FIM probe sent the first keystroke's prompt: that keystroke was the probe's
    again, all cached, in a part not labelled warm. A stream error in a server's own
    shape (a string) is an error, not a crash of the bench."""
    from dispatcher.tools.bench import run_fim_replay
    from dispatcher.tools.bench_targets import Sample
    sent = []

    class Target:
        def complete(self, prompt, max_tokens, suffix=None, session=None, **kw):
            sent.append((prompt, suffix))
            return Sample(ok=True, ttft=0.01)
    text = "".join(f"line {i} of a file\n" for i in range(100))
    run_fim_replay(Target(), 3, 4, 1, 0.0, text)
    probe, keystrokes = sent[0], sent[1:]
    assert len(keystrokes) == 3 and probe not in keystrokes
    assert all(k[0].startswith(probe[0]) for k in keystrokes)
    from dispatcher.tools.bench_targets import HttpTarget
    sample = Sample()
    HttpTarget._read_stream([b'data: {"error": "model overloaded"}\n'], sample, 0.0)
    assert sample.error == "model overloaded" and not sample.ok
