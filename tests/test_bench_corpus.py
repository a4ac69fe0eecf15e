"""The bench's first-seen prompts (dispatcher/tools/bench_corpus.py): real source files, a
different one for every request, the same on every target (unit: a recording target in
place of a server)."""
import argparse
import ast
import json
import threading

import pytest

from dispatcher.tools import bench
from dispatcher.tools.bench_corpus import (Corpus, CorpusError, edit, function_start,
                                           opening, source_files, standard_library)
from dispatcher.tools.bench_targets import Sample


def test_the_corpus_is_the_standard_library_without_tests_or_codec_tables():
    files = list(source_files(standard_library()))
    assert len(files) > 300
    names = {f.relative_to(standard_library()).parts[0] for f in files}
    assert "json" in names and "test" not in names and "encodings" not in names
    assert not any("site-packages" in f.parts for f in files)


def test_each_part_gets_files_of_its_own_the_same_each_time_it_asks():
    corpus = Corpus(seed=11)
    a, b = corpus.files_for("x8", 8), corpus.files_for("edit", 6)
    assert corpus.files_for("x8", 8) == a and corpus.files_for("x8", 3) == a[:3]
    assert len(set(a + b)) == 14
    assert Corpus(seed=11).files_for("x8", 8) == a              # a seed repeats a run
    assert Corpus(seed=12).files_for("x8", 8) != a              # a new one does not


def test_a_corpus_without_enough_files_says_so(tmp_path):
    (tmp_path / "small.py").write_text("x = 1\n")
    with pytest.raises(CorpusError, match="not enough"):
        Corpus(tmp_path, seed=1).files_for("x1", 1)
    with pytest.raises(CorpusError, match="not a directory"):
        Corpus(tmp_path / "nowhere", seed=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no Python source"):
        Corpus(tmp_path / "empty", seed=1)


def test_bench_names_a_bad_corpus_in_one_line(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT
    out = subprocess.run([sys.executable, "-m", "dispatcher", "bench", "--url",
                          "http://127.0.0.1:9", "--corpus", str(tmp_path / "nowhere")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "--corpus" in out.stderr and "not a directory" in out.stderr


SOURCE = "import os\n\n" + "".join(f"X{i} = {i}\n" for i in range(30)) + '''

def walk(root, depth=0):
    """Every file under root."""
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path):
            found += walk(path, depth + 1)
        else:
            found.append(path)
    return found
'''


def test_an_edit_prompt_is_the_function_then_its_first_line_renamed():
    prompt = edit(SOURCE)
    assert prompt.endswith("\ndef walk_v2(root, depth=0):\n")
    assert "        else:\n            found.append(path)\n    return found\n" in prompt
    ast.parse(prompt + "    pass\n")                          # real code, cut at a line


def test_a_fresh_prompt_stops_where_the_body_begins():
    prompt = function_start(SOURCE)
    assert prompt.endswith('    """Every file under root."""\n')
    assert "found = []" not in prompt
    assert opening(SOURCE, 25) == "import os\n\nX0 = 0\nX1 = 1\n"


class Recorder:
    """A target that answers at once and keeps every prompt it was sent."""
    sent: list = []
    extras: list = []
    keys: list = []
    enforced = False            # whether the server refuses a request without a key
    lock = threading.Lock()

    def __init__(self, url, model=None, api_key=None):
        self.name = url
        self.api_key = api_key

    def keys_enforced(self):
        return self.enforced

    def complete(self, prompt, max_tokens, suffix=None, session=None, timeout=600,
                 extra=None, seq=None, abort=None):
        with self.lock:
            self.sent.append((self.name, prompt))
            self.extras.append((prompt, extra))
            self.keys.append((self.name, self.api_key))
        return Sample(ok=True, ttft=0.01, tokens=max_tokens, decode_s=0.01,
                      finish_reason="length", first_line=0.01)


def test_no_target_is_sent_a_first_seen_prompt_twice_and_each_gets_the_same(monkeypatch,
                                                                              capsys):
    monkeypatch.setattr(bench, "HttpTarget", Recorder)
    Recorder.sent = []
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--url", "a", "--url", "b", "--concurrency", "1,4",
                              "--no-fim", "--max-tokens", "4", "--workloads",
                              "edit,fresh,sampled,typing", "--bursts", "1",
                              "--burst-len", "1", "--keystroke-gap", "0",
                              "--seed", "3"])
    assert bench.run(args) == 0
    assert "seed 3" in capsys.readouterr().err
    for target in ("a", "b"):
        prompts = [p for name, p in Recorder.sent if name == target]
        assert len(prompts) == len(set(prompts)) > 30, "a prompt sent twice"
    assert sorted(p for n, p in Recorder.sent if n == "a") == \
        sorted(p for n, p in Recorder.sent if n == "b")
    # every throughput request asks the same work of any server: its whole max_tokens
    # (no end token), from the whole distribution (servers' sampler defaults differ)
    measured = [extra for prompt, extra in Recorder.extras if extra is not None]
    assert len(measured) > 30 and all(
        {k: extra.get(k) for k in bench.SAME_WORK} == bench.SAME_WORK for extra in measured)
    assert {extra.get("temperature") for extra in measured} >= {0.0, 1.0}
    Recorder.extras = []
    Recorder.sent = []
    args = parser.parse_args(["--url", "a", "--concurrency", "1", "--requests", "3",
                              "--no-fim", "--workloads", "repeat", "--json"])
    assert bench.run(args) == 0
    rows = {row["name"] for row in __import__("json").loads(capsys.readouterr().out)}
    # (one tenant for every part: the first-seen row says its state was warm)
    assert rows == {"stream x1 (warm state)", "extend prompt (warm)", "repeat (warm)"}
    repeated = [p for _, p in Recorder.sent]
    assert len(repeated) - len(set(repeated)) == 2            # one prompt, three times


def test_every_prompt_fits_a_4096_token_context_byte_for_byte():
    """(The fake engine counts a byte a token: the bench's tests run on it.)"""
    corpus = Corpus(seed=5)
    for text in corpus.files_for("all", 150):
        for made in (edit(text), function_start(text), opening(text, 1600)):
            assert 0 < len(made.encode()) <= 3700


def test_a_part_may_ask_for_files_of_a_least_size():
    from dispatcher.tools.bench import COLD_CHARS, RunFiles
    corpus = Corpus(seed=9)
    cold = corpus.files_for("cold", 6, COLD_CHARS)
    assert len(cold) == 6 and all(len(text) >= COLD_CHARS for text in cold)
    assert not set(cold) & set(corpus.files_for("fresh", 6))          # no file twice
    later = RunFiles(corpus, 1).files_for("cold", 6, COLD_CHARS)
    assert all(len(text) >= COLD_CHARS for text in later) and not set(later) & set(cold)


def test_the_in_process_round_decodes_each_stream_as_its_own(reference_llm, monkeypatch):
    """`--in-process` at a concurrency above 1 is `reference.BatchedGreedy`: the prompts
    prefilled together, then one batch a step of each stream's greedy token, nothing
    else (the kernels' figure). A row read for the wrong sequence or position writes
    another prompt's text or repeats one; a round's cache left behind shifts the next;
    a stream that ends mid-round must leave the others reading their own rows."""
    import llama_cpp

    from dispatcher.tools.reference import BatchedGreedy
    prompts = ["1, 2, 3, 4, 5, 6,", "Monday, Tuesday, Wednesday,", "a b c d e f g",
               "def add(a, b):\n    return"]
    llm = reference_llm.llm
    batched = BatchedGreedy(llm, 4, 256, 2)
    try:
        streams = batched.round(prompts, 6)
        reversed_round = batched.round(prompts[::-1], 6)
        for wrong in ((prompts + ["x"], 6), (prompts, 0), (prompts, 256)):
            with pytest.raises(ValueError):
                batched.round(*wrong)
        ids = [s.ids for s in streams]
        end = ids[1][2]                   # Wednesday's third token, as if it ended there
        assert end not in ids[1][:2] and not any(end in ids[i] for i in (0, 2, 3))
        is_eog = llama_cpp.llama_vocab_is_eog
        monkeypatch.setattr(llama_cpp, "llama_vocab_is_eog",
                            lambda vocab, token: token == end or is_eog(vocab, token))
        ended = batched.round(prompts, 6)
        kept_on = batched.round(prompts, 6, ignore_eos=True)    # as the servers are asked
    finally:
        batched.close()
    texts = [llm.detokenize(s.ids).decode() for s in streams]
    assert texts[0].startswith(" 7, 8") and texts[1].startswith(" Thursday, Friday")
    assert texts[2].startswith(" h i j") and texts[3].startswith(" a + b")
    assert texts == [reference_llm.create_completion(p, max_tokens=6, temperature=0)
                     ["choices"][0]["text"] for p in prompts]
    assert [llm.detokenize(s.ids).decode() for s in reversed_round] == texts[::-1]
    assert all(len(s.ids) == 6 and s.finish_reason == "length" and 0 < s.ttft and
               0 < s.decode_s for s in streams)
    assert [s.ids for s in ended] == [ids[0], ids[1][:2], ids[2], ids[3]]
    assert [s.finish_reason for s in ended] == ["length", "stop", "length", "length"]
    assert all(len(s.ids) == 6 and s.finish_reason == "length" for s in kept_on)
    assert end not in kept_on[1].ids and kept_on[1].ids[:2] == ids[1][:2]


def test_a_one_line_answer_ends_its_first_line_and_an_empty_one_is_told():
    """An answer with no newline is one line, shown whole: its first line ends with it
    (it was left out of the first-line figures). A stream cut by an error counts once,
    as truncated. An answer with no text is in no TTFT or first-line figure, so the
    typing level counts it (`empty`)."""
    from dispatcher.tools.bench_targets import HttpTarget, summarize
    one_line = Sample()
    HttpTarget._read_stream([b'data: {"choices": [{"text": "x = 1"}]}\n',
                             b'data: {"choices": [{"text": "", "finish_reason": "stop"}]}\n',
                             b'data: [DONE]\n'], one_line, 0.0)
    assert one_line.ok and one_line.first_line is not None and one_line.first_line > 0
    cut = Sample(error="OSError: reset", truncated=True, ttft=0.1)
    level = summarize("x", 1, [cut, Sample(error="HTTP 500: no")], 1.0)
    assert level.truncated == 1 and level.errors == 1


def test_typing_counts_answers_with_nothing_to_show(monkeypatch):
    answers = iter([Sample(ok=True, ttft=0.1, tokens=3, first_line=0.2),
                    Sample(ok=True, tokens=0, finish_reason="stop")] * 2)

    class Target:
        def complete(self, prompt, max_tokens, **kw):
            return next(answers)
    level = bench.run_typing(Target(), 2, 1, 1, 0.0, 8, 1, files=["a = 1\n" * 400] * 2)
    assert level.unanswered == 0 and level.empty == 1 and level.ok == 2


def test_each_part_of_each_run_sends_a_key_of_its_own(monkeypatch):
    """With several --api-key, each part of each run sends the next key, the same on
    every target: a server that keeps what it learns per key (this one with API keys: a
    key's recent answers, its recycled table) starts every part cold."""
    monkeypatch.setattr(bench, "HttpTarget", Recorder)
    Recorder.keys = []
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    keys = [f"k{i}" for i in range(20)]
    args = parser.parse_args(["--url", "a", "--url", "b", "--concurrency", "1",
                              "--no-fim", "--max-tokens", "4", "--workloads",
                              "edit,fresh", "--requests", "2", "--runs", "2",
                              "--seed", "3"] + [x for k in keys for x in ("--api-key", k)])
    assert bench.run(args) == 0
    for target in ("a", "b"):
        sent = [key for name, key in Recorder.keys if name == target]
        parts = [k for i, k in enumerate(sent) if i == 0 or sent[i - 1] != k]
        # x1, extension, edit, fresh; two runs: eight parts, eight keys, in order
        assert parts == keys[:8], parts


@pytest.mark.parametrize("enforced, count", [(True, 20), (False, 20), (True, 5)])
def test_first_seen_rows_are_named_warm_unless_each_part_started_cold(
        monkeypatch, capsys, enforced, count):
    """A first-seen row is cold only where its part had a key no part had sent before,
    on a server that keeps what it learns per key (it refuses a request without a key);
    else its name says `(warm state)`: the recycled table and the history taught by
    the parts before it (the issue's figures were measured so, and read as cold)."""
    monkeypatch.setattr(bench, "HttpTarget", Recorder)
    monkeypatch.setattr(Recorder, "enforced", enforced)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    keys = [f"k{i}" for i in range(count)]
    args = parser.parse_args(["--url", "a", "--concurrency", "1", "--no-fim",
                              "--max-tokens", "4", "--workloads", "edit,fresh",
                              "--requests", "2", "--runs", "2", "--seed", "3", "--json"]
                             + [x for k in keys for x in ("--api-key", k)])
    assert bench.run(args) == 0
    captured = capsys.readouterr()
    names = [(row["run"], row["name"]) for row in json.loads(captured.out)]
    if not enforced:            # (a server that ignores keys: every part shares its state)
        assert names == [(r, n) for r in (1, 2) for n in (
            "stream x1 (warm state)", "extend prompt (warm)", "edit (warm state)",
            "fresh (warm state)")]
        assert "a: its first-seen rows are named '(warm state)'" in captured.err
    elif count == 20:
        assert names == [(r, n) for r in (1, 2) for n in (
            "stream x1", "extend prompt (warm)", "edit", "fresh")]
    else:                       # five keys for eight parts: the last three reuse one
        assert names == [(1, "stream x1"), (1, "extend prompt (warm)"), (1, "edit"),
                         (1, "fresh"), (2, "stream x1"), (2, "extend prompt (warm)"),
                         (2, "edit (warm state)"), (2, "fresh (warm state)")]
        assert "run 2: parts edit, extension, fresh met a key sent before" in captured.err


def test_no_target_always_runs_right_after_the_same_one(monkeypatch):
    """Round by round the first target turns, and every other pass the others follow
    it the other way round: with a fixed cyclic order each target ran right after the
    same neighbour every round, and whatever that neighbour left running (a server
    still decoding a closed stream) fell on the same target's figures."""
    monkeypatch.setattr(bench, "HttpTarget", Recorder)
    Recorder.sent = []
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--url", "a", "--url", "b", "--url", "c", "--concurrency",
                              "1", "--no-fim", "--max-tokens", "4", "--workloads", "edit",
                              "--requests", "6", "--seed", "3"])
    assert bench.run(args) == 0
    order = [name for name, _ in Recorder.sent][:18]      # x1: six rounds of three
    rounds = [order[i:i + 3] for i in range(0, 18, 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    after = {(r[i - 1], r[i]) for r in rounds for i in (1, 2)}
    assert after == {(x, y) for x in "abc" for y in "abc" if x != y}
    assert sorted(r[0] for r in rounds) == ["a", "a", "b", "b", "c", "c"]