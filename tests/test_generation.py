"""The worker's generation loop in-process, on FakeEngine (a test double, not a model):
admission, streaming, cancel, failures confined to one request, shutdown."""
import json

import msgspec
import pytest

from dispatcher.common import protocol as P
from workers import inbox
from workers.fake_engine import SCRIPT, FakeEngine
from workers.generation import GenerationLoop
from workers.preparation import PREPARE_CHARS, worth_preparing
from workers.faults import FaultInjection


class RecordingPublisher:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def publish(self, topic: bytes, request_id: str, event: P.Event) -> None:
        """Each event as it goes on the wire."""
        self.events.append((request_id, json.loads(P.encode_event(topic, request_id,
                                                                   event)[2])))

    def tick(self) -> None:
        pass

    def flush(self) -> None:
        pass


def make_loop(faults: FaultInjection | None = None, n_ctx: int = 256) -> GenerationLoop:
    engine = FakeEngine("fake.gguf", n_ctx, 2, step_delay=0.0)
    notices: list[tuple[str, str, dict | None]] = []
    loop = GenerationLoop(engine, RecordingPublisher(),
                          lambda cmd, rid, body: notices.append((
                              P.command_name(cmd), rid,
                              None if body is None else msgspec.to_builtins(body))),
                          faults=faults)
    loop.notices = notices
    return loop


@pytest.fixture
def loop():
    return make_loop()


GENERATION = set(P.Generation.__struct_fields__)


def job(prompt="x", max_tokens=3, **extra):
    """A job as a worker reads it: envelope fields, the others its generation's."""
    fields = {"id": "j", "model": "m", "topic": "fe-000000000001", "attempt": 1,
              "prompt": prompt, "max_tokens": max_tokens, "stop": [], "sampling": {},
              **extra}
    generation = {k: fields.pop(k) for k in list(fields) if k in GENERATION}
    return msgspec.convert({**fields, "generation": generation}, P.WorkerJob)


def submit(loop, request_id, body):
    loop.inbox.put(inbox.NewJob(request_id, body))


def run(loop, steps=50):
    """What `GenerationLoop.run` does, a bounded number of times, without blocking."""
    for _ in range(steps):
        loop._read_inbox(block=False)
        loop._admit()
        if not loop.active and not loop.waiting:
            return
        loop._step()


def events_of(loop, request_id):
    return [e for rid, e in loop.publisher.events if rid == request_id]


def test_a_job_streams_start_text_and_end_in_sequence(loop):
    submit(loop, "a", job(max_tokens=4))
    run(loop)
    events = events_of(loop, "a")
    assert [e["e"] for e in events] == ["start", "text", "text", "text", "text", "end"]
    assert [e["s"] for e in events] == list(range(6))
    assert "".join(e.get("text", "") for e in events) == SCRIPT[:4].decode()
    assert events[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4}
    assert [n[0] for n in loop.notices] == ["STARTED", "FIRST", "DONE"]
    assert sorted(loop.free_slots) == [0, 1]


def test_cancel_frees_the_slot_and_spares_the_other_request(loop):
    submit(loop, "a", job(max_tokens=20))
    submit(loop, "b", job(max_tokens=5))
    loop._read_inbox(block=False)
    loop._admit()
    loop._step()
    loop.inbox.put(inbox.Cancel("a"))
    run(loop)
    done = {rid: body for cmd, rid, body in loop.notices if cmd == "DONE"}
    assert done["a"]["cancelled"] and done["b"]["finish_reason"] == "length"
    assert events_of(loop, "b")[-1]["e"] == "end"
    assert sorted(loop.free_slots) == [0, 1]


@pytest.mark.parametrize("phase", ["admit", "token", "finish"])
def test_a_failure_inside_one_request_ends_it_alone(phase):
    loop = make_loop(FaultInjection(raises={phase: "[boom]"}))
    submit(loop, "ok", job(max_tokens=6))
    submit(loop, "bad", job("[boom]", max_tokens=3))
    run(loop)
    error = events_of(loop, "bad")[-1]
    assert error["e"] == "error" and error["status"] == 500
    assert error["code"] == "generation_failed" and error["type"] == "server_error"
    assert events_of(loop, "ok")[-1]["e"] == "end"
    assert sorted(loop.free_slots) == [0, 1]


def test_a_slot_release_that_raises_still_ends_its_request(loop, monkeypatch):
    """Freeing a request's slot raising (llama.cpp's memory call) left its end unsaid:
    no DONE to the dispatcher, whose slot count then never came back, and the client
    waited for ever. The end is said whatever the release did."""
    real, calls = loop.engine.release, []

    def release(slot, keep_cache=True):
        calls.append(slot)
        if len(calls) == 1:
            raise RuntimeError("the memory call failed")
        return real(slot, keep_cache)
    monkeypatch.setattr(loop.engine, "release", release)
    submit(loop, "a", job(max_tokens=2))
    run(loop)
    assert [cmd for cmd, rid, _ in loop.notices if rid == "a"] == ["STARTED", "FIRST",
                                                                   "DONE"]
    assert events_of(loop, "a")[-1]["e"] == "end"
    assert sorted(loop.free_slots) == [0, 1] and not loop.active     # (the slot back)


def test_text_that_cannot_be_encoded_fails_its_request_not_the_loop(loop):
    submit(loop, "bad", job("a\ud800b"))
    loop.inbox.put(inbox.NewJob("tok", job(op="tokenize", content="\udfff")))
    submit(loop, "ok", job())
    run(loop)
    assert events_of(loop, "bad")[-1]["code"] == "generation_failed"
    assert events_of(loop, "tok")[-1]["code"] == "generation_failed"
    assert events_of(loop, "ok")[-1]["e"] == "end"


def test_a_prompt_that_cannot_fit_is_refused_without_being_tokenized(loop, monkeypatch):
    """A megabyte of text costs seconds of the worker's CPU to tokenize: the preparing
    thread (which long texts go to) refuses a prompt that cannot fit even at the
    vocabulary's longest pieces (here a token a byte, context 256) before tokenizing it;
    one that might fit is tokenized and measured."""
    tokenized = []
    real = loop.engine.tokenize
    monkeypatch.setattr(loop.engine, "tokenize",
                        lambda text, *a, **k: tokenized.append(len(text)) or real(text, *a, **k))
    for rid, prompt in (("long", "x" * 600), ("ids", [1] * 200 + ["y" * 120]),
                        ("fits", "z" * 300)):
        loop.preparer._work(rid, job(prompt))       # (what its thread runs)
    run(loop)
    for rid in ("long", "ids", "fits"):
        error = events_of(loop, rid)[-1]
        assert error["code"] == "context_length_exceeded" and error["status"] == 400, error
    assert "at least 300 tokens" in events_of(loop, "long")[-1]["message"]
    assert "at least 260 tokens" in events_of(loop, "ids")[-1]["message"]
    assert "has 301 tokens" in events_of(loop, "fits")[-1]["message"]
    assert tokenized == [300]
    assert worth_preparing(job("x" * PREPARE_CHARS))     # (long texts go to that thread)


def test_an_infill_is_made_to_fit_its_context_and_only_its_middle_is_bounded(monkeypatch):
    """/infill (llama.vim's ring of chunks grows past any context): the oldest chunks go
    first, then the prefix's start and the suffix's end, and the answer says so; only
    the `prompt` typed on the cursor's line (middle) can make it too long. A model that
    cannot lay FIM out is told so, not that it is long."""
    from workers.preparation import Preparer
    from workers.prompts import FimTemplate
    loop = make_loop()                                   # a 256-token context
    template = Preparer(loop.engine, FimTemplate.parse("<P>{prefix}<S>{suffix}<M>"),
                        loop.inbox)
    chunks = [{"filename": "old.py", "text": "y" * 150},
              {"filename": "new.py", "text": "z" * 40}]
    infill = {"extra": chunks, "middle": ""}
    template._work("chunks", job("p" * 60, suffix="s" * 10, infill=infill, max_tokens=16))
    template._work("ends", job("a" * 200 + "p" * 200, suffix="s" * 100 + "t" * 300,
                               infill=infill, max_tokens=16))
    template._work("middle", job("p", suffix="s", max_tokens=16,
                                 infill={"extra": [], "middle": "m" * 600}))
    loop.preparer._work("no-fim", job("x" * 600, suffix="s"))     # (no template, no tokens)
    made = {item.request_id: item.prepared for item in
            [loop.inbox.get_nowait() for _ in range(4)]}
    fitted = made["chunks"].fitted                      # the old chunk goes, the new stays
    assert made["chunks"].error is None and fitted.dropped == 1 and not fitted.cut
    text = bytes(t for t in fitted.tokens if t < 256)
    assert text.count(b"z" * 40) == 1 and b"y" not in text
    assert len(fitted.tokens) <= 256 - 16
    fitted = made["ends"].fitted                        # all chunks, then both ends
    assert fitted.dropped == 2 and fitted.cut and len(fitted.tokens) == 256 - 16
    text = bytes(t for t in fitted.tokens if t < 256)
    assert b"a" not in text and b"t" not in text        # the far ends went
    assert text.count(b"p") > 3 * text.count(b"s") > 0  # prefix 3/4, suffix 1/4
    assert made["middle"].error.code == "context_length_exceeded"
    tokenized = []                                       # a megabyte of prefix is not
    real = loop.engine.tokenize                          # tokenized to keep its end
    monkeypatch.setattr(loop.engine, "tokenize", lambda text, *a, **k: tokenized.append(
        len(text)) or real(text, *a, **k))
    template._work("huge", job("q" * 1_000_000, suffix="s" * 500_000, max_tokens=16,
                               infill={"extra": [], "middle": ""}))
    huge = loop.inbox.get_nowait().prepared.fitted
    assert huge.cut and len(huge.tokens) == 256 - 16
    assert max(tokenized) <= (256 - 16) * loop.engine.longest_piece()
    assert made["no-fim"].error.code == "fim_unsupported"
    loop2 = make_loop()                                  # the answer says what went
    loop2.fim_template = loop2.preparer.fim_template = template.fim_template
    submit(loop2, "r", job("a" * 200 + "p" * 200, suffix="s" * 400, infill=infill,
                           max_tokens=2))
    run(loop2)
    end = events_of(loop2, "r")[-1]
    assert end["e"] == "end" and end["dropped_chunks"] == 2 and end["truncated"] is True


def test_a_candidate_that_ends_at_once_is_scored_by_its_end_token(loop):
    """best_of keeps the candidates with the best mean logprob: one whose first token is
    the end of sequence is scored by that token's logprob, not 0 (which beat every real
    answer, so best_of returned an empty text whenever one candidate stopped at once)."""
    submit(loop, "empty", job("[eos=0] x", max_tokens=8, score=True))
    submit(loop, "some", job("[eos=2] x", max_tokens=8, score=True))
    run(loop)
    scores = {rid: events_of(loop, rid)[-1]["score"] for rid in ("empty", "some")}
    assert scores == {"empty": -0.5, "some": -0.5}, scores


def test_shutdown_hands_back_what_sent_no_text_and_fails_the_rest(loop):
    submit(loop, "talking", job(max_tokens=50))
    run(loop, steps=2)
    submit(loop, "silent", job(max_tokens=50))
    loop._read_inbox(block=False)
    loop._admit()                                      # started, no text yet
    loop.abort_all("stopping")
    done = {rid: body for cmd, rid, body in loop.notices if cmd == "DONE"}
    assert done["silent"]["released"] is True
    assert events_of(loop, "talking")[-1]["code"] == "worker_stopping"
    assert sorted(loop.free_slots) == [0, 1]


def test_a_worker_stopping_on_its_own_finishes_what_runs_and_hands_back_the_rest():
    """SIGTERM with nobody draining the worker first (systemd): the running request ends
    whole, the queued one and one sent meanwhile go back unstarted, the dispatcher is
    told it takes no more, and the loop returns once nothing runs."""
    import time
    from dispatcher.common.process import StopFlag
    loop = make_loop()
    loop.free_slots = [0]
    submit(loop, "running", job(max_tokens=8))
    run(loop, steps=2)
    submit(loop, "queued", job(max_tokens=8))
    loop._read_inbox(block=False)
    stopping = StopFlag()
    stopping.drain(30.0)
    assert not loop._left(stopping.drain_deadline)       # one still runs
    submit(loop, "later", job(max_tokens=8))
    loop.run(stopping)                                   # returns once "running" ended
    done = {rid: body for cmd, rid, body in loop.notices if cmd == "DONE"}
    assert done["queued"]["released"] is True and done["later"]["released"] is True
    assert not done["running"].get("released")
    end = events_of(loop, "running")[-1]
    assert end["e"] == "end" and end["usage"]["completion_tokens"] == 8
    beats = [body for cmd, rid, body in loop.notices if cmd == "HEARTBEAT"]
    assert beats and beats[0]["leaving"] is True
    ops = make_loop()                                    # a /tokenize on its thread:
    submit(ops, "t", job(op="tokenize", content="abc"))  # waited for, then answered
    ops._read_inbox(block=False)
    leaving = StopFlag()
    leaving.drain(30.0)
    ops.run(leaving)
    assert any(cmd == "DONE" and rid == "t" for cmd, rid, _ in ops.notices)
    again = StopFlag()                                   # a second signal: at once
    again.drain(30.0)
    again.drain(30.0)
    assert again.is_set()
    slow = make_loop()                                   # past the grace: run returns
    submit(slow, "long", job(max_tokens=10_000))
    run(slow, steps=2)
    late = StopFlag()
    late.drain(0.0)
    started = time.monotonic()
    slow.run(late)
    assert time.monotonic() - started < 5 and "long" in slow.active


def test_n_indent_ends_at_the_first_dedented_line_after_a_newline():
    from workers.active import EditorLimits
    limits = EditorLimits(n_indent=4)
    assert limits.cut("x = 1") == ("x = 1", False)          # the cursor's line: exempt
    assert limits.cut("\n    y = 2\n  ") == ("\n    y = 2\n  ", False)
    assert limits.cut("  z\n") == ("  z\n", False)          # 2 + 2 spaces: indented
    assert limits.cut("  w") == ("  ", True)                 # 2 spaces: dedented
    limits = EditorLimits(n_indent=1)
    assert limits.cut("a\n\tb\nc") == ("a\n\tb\n", True)     # a tab counts one
    # a blank line has no indentation: it ends the completion, as llama-server's
    # process_token (it went on into the next block)
    assert EditorLimits(n_indent=4).cut("    a = 1\n\n    b = 2\n") == ("    a = 1\n", True)
    assert EditorLimits(n_indent=4).cut("x\n  \n") == ("x\n  ", True)
    assert EditorLimits(n_indent=4).cut("x\n    \n") == ("x\n    \n", False)   # deep enough


def test_t_max_predict_ms_waits_for_a_newline():
    from workers.active import EditorLimits
    limits = EditorLimits(t_max_predict_ms=100)
    limits.generated(b"no newline yet")
    assert not limits.out_of_time(first_at=0.0, now=1.0)
    limits.generated(b"a\n")
    assert limits.out_of_time(first_at=0.0, now=1.0)
    assert not limits.out_of_time(first_at=0.0, now=0.05)


def test_the_worker_fills_in_a_prompt_sent_once():
    from collections import OrderedDict

    from workers.worker import DispatcherLink
    link = DispatcherLink.__new__(DispatcherLink)      # its bookkeeping alone, no sockets
    link.shared = OrderedDict()
    first = link._with_shared(job("p", id="r.0.0", suffix="s", share_as="r.0.0"))
    assert first.prompt == "p"
    later = link._with_shared(job(None, id="r.0.1", same_as="r.0.0"))
    assert later.prompt == "p" and later.suffix == "s" and later.same_as is None
    assert later.share_as == "r.0.0"      # (the prompt's id: preparation keeps its fit)
    for i in range(P.WORKER_SHARED):
        link._with_shared(job(str(i), id=f"s{i}", share_as=f"s{i}"))
    assert link._with_shared(job(None, id="r.0.2", same_as="r.0.0")) is None   # pushed out


def test_a_job_handed_over_after_a_reset_is_kept_while_the_reset_waits(loop):
    """The IO thread reconnects (Reset into the inbox), and the new connection hands over
    a job worth preparing before the generation loop reads the Reset (one long step):
    that job is the new connection's, held as started by the dispatcher, and must run;
    what was being prepared when the dispatcher forgot the worker is dropped."""
    dry = {"dry_multiplier": 0.8}                          # (prepared: a DRY sampler)
    assert loop.preparer.submit("old", job(id="old", sampling=dry))
    loop.inbox.put(inbox.Reset(loop.preparer.being_prepared()))
    assert loop.preparer.submit("new", job(id="new", sampling=dry))
    loop.preparer.thread.submit(lambda: None).result()       # both prepared by now
    run(loop)
    assert events_of(loop, "old") == []
    assert events_of(loop, "new")[-1]["e"] == "end"
    assert not loop.preparer.preparing and not loop.preparer.cancelled


def test_the_same_request_handed_over_again_before_the_reset_is_read_runs_once(loop):
    """The dispatcher took the reconnect for a worker lost and queued the job again
    (attempt 2), handing it back here before the loop read the Reset: attempt 1, on the
    preparing thread at the reset, is dropped, and attempt 2 runs in one slot. Before,
    both were admitted under one id and the first slot generated for nobody until the
    context filled, then stayed busy for the worker's life."""
    import threading
    dry = {"dry_multiplier": 0.8}                          # (prepared: a DRY sampler)
    busy = threading.Event()                 # the thread busy: both come back after the
    loop.preparer.thread.submit(busy.wait, 10)               # Reset, in order
    assert loop.preparer.submit("r", job(id="r", sampling=dry))
    loop.inbox.put(inbox.Reset(loop.preparer.being_prepared()))
    assert loop.preparer.submit("r", job(id="r", sampling=dry, attempt=2))
    busy.set()
    loop.preparer.thread.submit(lambda: None).result()       # both prepared by now
    run(loop)
    events = events_of(loop, "r")
    assert {e["a"] for e in events} == {2} and events[-1]["e"] == "end"
    assert [e["e"] for e in events].count("start") == 1
    assert sorted(loop.free_slots) == [0, 1] and not loop.active
    assert not loop.preparer.preparing and not loop.preparer.cancelled and \
        not loop.preparer.ready


def test_a_cancel_up_to_an_attempt_spares_the_later_one(loop):
    """The dispatcher cancels what a re-registered worker's old connection held by
    attempt (P.CancelUpTo): the job handed over there runs for nobody otherwise. The same
    request's next attempt, handed to this worker next, may already be on the preparing
    thread when the loop reads that cancel: it is not cancelled (a cancel by id alone
    took it, and the request waited for ever)."""
    dry = {"dry_multiplier": 0.8}                          # (prepared: a DRY sampler)
    submit(loop, "r", job(id="r", max_tokens=40))
    run(loop, steps=2)
    loop.inbox.put(inbox.Cancel("r", 0))                   # (an attempt before it: kept)
    run(loop, steps=1)
    assert loop.active["r"].attempt == 1
    loop.inbox.put(inbox.Cancel("r", 1))
    assert loop.preparer.submit("r", job(id="r", sampling=dry, max_tokens=3, attempt=2))
    loop.preparer.thread.submit(lambda: None).result()
    run(loop)
    events = events_of(loop, "r")
    assert [e["e"] for e in events if e.get("a", 1) == 2] == ["start", "text", "text", "text", "end"]
    assert [e["e"] for e in events if e.get("a", 1) == 1][-1] != "end"      # cancelled, no end
    done = [(body.get("attempt", 1), bool(body.get("cancelled")))
            for cmd, rid, body in loop.notices if cmd == "DONE"]
    assert done == [(1, True), (2, False)], done
    assert sorted(loop.free_slots) == [0, 1] and not loop.preparer.cancelled
    # one being prepared, then cancelled up to its attempt: dropped there
    assert loop.preparer.submit("s", job(id="s", sampling=dry, attempt=3))
    loop.cancel("s", 2)
    assert loop.preparer.preparing == {"s": 3}
    loop.cancel("s", 3)
    loop.preparer.thread.submit(lambda: None).result()
    run(loop)
    assert not events_of(loop, "s") and not loop.preparer.preparing
    assert ("DONE", "s") in [(cmd, rid) for cmd, rid, _ in loop.notices]


def test_two_attempts_on_the_preparing_thread_are_both_dropped_by_the_clients_cancel(loop):
    """Attempt 1 still on the preparing thread, attempt 2 behind it: the old
    registration's cancel (up to 1) leaves attempt 2's entry, and the client's cancel
    then takes it. Attempt 1 was dropped on arrival only because attempt 2's entry was
    there: with it gone, attempt 1 went on to a slot and ran for nobody."""
    import threading
    dry = {"dry_multiplier": 0.8}                          # (prepared: a DRY sampler)
    busy = threading.Event()
    loop.preparer.thread.submit(busy.wait, 10)
    assert loop.preparer.submit("r", job(id="r", sampling=dry, max_tokens=40))
    assert loop.preparer.submit("r", job(id="r", sampling=dry, max_tokens=40, attempt=2))
    loop.cancel("r", 1)
    assert loop.preparer.preparing == {"r": 2}
    loop.cancel("r")                                       # the client left
    busy.set()
    loop.preparer.thread.submit(lambda: None).result()       # both back by now
    run(loop)
    assert not events_of(loop, "r") and not loop.active
    assert [(body.get("attempt", 1), bool(body.get("cancelled")))
            for cmd, rid, body in loop.notices if cmd == "DONE"] == [(2, True)]
    assert not loop.preparer.preparing and not loop.preparer.cancelled
    assert not loop.preparer.ready and sorted(loop.free_slots) == [0, 1]


def test_a_job_cancelled_while_it_waits_for_the_preparing_thread_is_never_prepared(
        loop, monkeypatch):
    """An editor's keystrokes with long prompts: each job superseded by the next while it
    waited for the preparing thread was still tokenized in turn, only the last wanted,
    and the lag grew with every key."""
    import threading
    dry = {"dry_multiplier": 0.8}                          # (prepared: a DRY sampler)
    prepared, real = [], loop.preparer._prepare
    monkeypatch.setattr(loop.preparer, "_prepare",
                        lambda rid, body: (prepared.append(rid), real(rid, body)))
    busy = threading.Event()
    loop.preparer.thread.submit(busy.wait, 10)
    for rid in ("k1", "k2", "k3"):
        assert loop.preparer.submit(rid, job(id=rid, sampling=dry, max_tokens=3))
    loop.cancel("k1")
    loop.cancel("k2")
    busy.set()
    loop.preparer.thread.submit(lambda: None).result()
    run(loop)
    assert prepared == ["k3"]
    assert not events_of(loop, "k1") and events_of(loop, "k3")[-1]["e"] == "end"
    assert not loop.preparer.on_thread and not loop.preparer.cancelled
    assert sorted(loop.free_slots) == [0, 1]


def test_jobs_handed_over_during_a_shutdown_go_back_released():
    """The IO thread hands jobs over until the link stops, after `abort_all` handed the
    others back: the preparing thread's shutdown dropped those (their STARTED sent) and
    the inbox's were never read, so the dispatcher failed them as lost with the worker
    instead of queueing them again."""
    import threading
    from collections import Counter
    loop = make_loop()
    dry = {"dry_multiplier": 0.8}                          # (prepared: a DRY sampler)
    busy, again = threading.Event(), threading.Event()
    thread = loop.preparer.thread
    thread.submit(busy.wait, 10)
    assert loop.preparer.submit("before", job(id="before", sampling=dry))
    loop.abort_all("the worker is shutting down")          # ("before" handed back)
    busy.set()
    thread.submit(lambda: None).result()                   # ("before" prepared, back)
    assert loop.preparer.submit("prepared", job(id="prepared", sampling=dry))
    thread.submit(lambda: None).result()                   # (prepared, in the inbox)
    thread.submit(again.wait, 10)
    assert loop.preparer.submit("late", job(id="late", sampling=dry))
    submit(loop, "unread", job(id="unread"))
    thread.shutdown(wait=False, cancel_futures=True)       # ("late" dropped unprepared)
    again.set()
    loop.preparer.shutdown()
    loop.release_unread()
    done = [(rid, body) for cmd, rid, body in loop.notices if cmd == "DONE"]
    assert Counter(rid for rid, _ in done) == {"before": 1, "prepared": 1, "late": 1,
                                                "unread": 1}, done
    assert all(body.get("released") for _, body in done), done
    assert not loop.preparer.ready and loop.inbox.empty()
    loop.vocabulary_thread.shutdown()


def test_an_earlier_attempt_of_a_running_request_never_takes_a_second_slot(loop):
    """However two attempts of one request reach the queue, one slot runs it: the later
    attempt (the dispatcher's) replaces an earlier one running, an earlier one arriving
    after a later is dropped."""
    submit(loop, "r", job(id="r", max_tokens=40))
    run(loop, steps=2)
    submit(loop, "r", job(id="r", max_tokens=3, attempt=2))
    submit(loop, "r", job(id="r", max_tokens=3, attempt=1))
    run(loop)
    assert sorted(loop.free_slots) == [0, 1] and not loop.active
    ends = [e for e in events_of(loop, "r") if e["e"] == "end"]
    assert [e["a"] for e in ends] == [2]


def test_an_adopted_generation_goes_on_under_the_new_requests_budget(loop):
    """The request that takes over a generation (the user typed what it suggested) sets
    what the sequence may still generate: it kept the old request's, so its drafts
    stopped short of the old end (a warm-up's 0 also left its prefill last in line)."""
    submit(loop, "old", job("Once", max_tokens=40))
    run(loop, steps=6)
    typed = SCRIPT[:3].decode()
    assert loop.active["old"].assembler.text.startswith(typed)
    submit(loop, "new", job("Once" + typed, max_tokens=10, id="new", adopt="old"))
    loop._read_inbox(block=False)
    new = loop.active["new"]
    assert loop.engine.budgets == {new.slot: 10 - new.generated}
    assert loop.engine.least == {new.slot: -new.generated}          # (no min_tokens)


def test_an_adopted_generation_may_not_end_before_the_new_requests_min_tokens(loop):
    """min_tokens counts the new request's own tokens: the slot's count ran on from the
    old request's, so an adopted generation could end that many tokens short."""
    sampling = {"min_tokens": 8}
    submit(loop, "old", job("Once", max_tokens=40, sampling=sampling))
    run(loop, steps=6)
    typed = SCRIPT[:3].decode()
    submit(loop, "new", job("Once" + typed, max_tokens=10, id="new", adopt="old",
                            sampling=sampling))
    loop._read_inbox(block=False)
    new = loop.active["new"]
    assert 0 < new.generated < 8
    assert loop.engine.least == {new.slot: 8 - new.generated}
    run(loop)
    assert events_of(loop, "new")[-1]["e"] == "end"


def test_a_long_superseding_request_is_tokenized_on_the_preparing_thread(monkeypatch):
    """A session's new request that cannot take over the generation it supersedes (the
    user typed something else: the common case) was tokenized on the generation thread,
    every stream of the worker frozen meanwhile (100 KB of code: 0.15 s a keystroke). It
    goes to the preparing thread as any long job, then first into the queue."""
    import threading
    loop = make_loop(n_ctx=2 * PREPARE_CHARS)
    where = []
    real = loop.engine.tokenize
    monkeypatch.setattr(loop.engine, "tokenize", lambda text, *a, **k: (
        where.append(threading.current_thread().name), real(text, *a, **k))[1])
    submit(loop, "old", job("Once", max_tokens=40))
    submit(loop, "other", job("Twice", max_tokens=40, id="other"))
    run(loop, steps=3)
    where.clear()
    long = "Once upon " + "x" * PREPARE_CHARS             # (not what "old" wrote)
    submit(loop, "new", job(long, max_tokens=4, id="new", adopt="old"))
    loop._read_inbox(block=False)
    assert "new" not in loop.active and "old" not in loop.active    # (old: cancelled)
    assert any(n[:2] == ("DONE", "old") and n[2]["cancelled"] for n in loop.notices)
    assert ("STARTED", "new", {}) in loop.notices    # (as the IO thread says of such jobs)
    loop.preparer.thread.submit(lambda: None).result()       # (prepared by now)
    loop._read_inbox(block=False)
    assert loop.waiting[0][0] == "new"                       # (first in line)
    run(loop)
    assert where and all(name.startswith("prepare") for name in where), where
    new = events_of(loop, "new")
    assert [e["e"] for e in new].count("start") == 1 and new[-1]["e"] == "end"
    assert sorted(loop.free_slots) == [0, 1] and not loop.preparer.ready


def test_text_biases_are_tokenized_on_the_preparing_thread_not_the_loop(loop, monkeypatch):
    """llama.cpp's `[["text", bias]]` form: 1,024 texts of 256 characters were tokenized
    on the generation thread as each job was admitted (seconds, `n` times over), every
    stream of the worker frozen meanwhile. Much of it goes to the preparing thread, and
    the loop uses what it made."""
    import threading
    from dispatcher.common.fields import TEXT_BIAS
    where = []
    real = loop.engine.tokenize
    monkeypatch.setattr(loop.engine, "tokenize", lambda text, *a, **k: (
        where.append(threading.current_thread().name), real(text, *a, **k))[1])
    bias = {TEXT_BIAS + "ab" * 64: -5.0 for _ in range(1)}
    bias.update({f"{TEXT_BIAS}{i:03d}" + "c" * 200: -5.0 for i in range(32)})
    long = job("x", sampling={"logit_bias": bias})
    assert worth_preparing(long) and not worth_preparing(
        job("x", sampling={"logit_bias": {TEXT_BIAS + "ab": -5.0}}))
    assert loop.preparer.submit("b", long)
    loop.preparer.thread.shutdown(wait=True)             # (its work done)
    made = len(where)
    assert made >= 33 and all(name.startswith("prepare") for name in where)
    run(loop)
    assert events_of(loop, "b")[-1]["e"] == "end", events_of(loop, "b")
    assert len(where) == made                  # the loop tokenized none of it again


@pytest.mark.parametrize("rep, sep", [(300, 301), (None, 301), (300, None)])
def test_infill_fim_rep_and_sep_each_do_their_part_as_in_llama_cpp(rep, sep):
    """llama.cpp's format_infill: FIM_REP opens with the project, FIM_SEP names each
    chunk's file and closes the chunks; a vocabulary with only one of them uses it (it
    took both or neither); a chunk without FIM_SEP follows the snippet separator."""
    from workers.prompts import CHUNK_SEPARATOR, InfillParts
    engine = make_loop().engine
    engine.fim_tokens, engine.fim_repo = (290, 291, 292), (rep, sep)
    text = lambda t: engine.tokenize(t, add_special=False)  # noqa: E731
    parts = InfillParts.of(engine, "pre", "suf", None, [{"filename": "a.py", "text": "x"}],
                           "", framed=True)
    opening = [rep] + text("myproject\n") if rep else []
    chunk = ([sep] + text("a.py\n") if sep else text(CHUNK_SEPARATOR)) + text("x")
    closing = [sep] + text("filename\n") if sep else []
    body = engine.bos() + [290] + text("pre") + [291] + text("suf") + [292]
    assert parts.tokens(engine) == opening + chunk + closing + body
    assert parts.tokens(engine, dropped=1) == opening + closing + body    # (framed)
    assert parts.length(engine, 1) == len(parts.tokens(engine, 1))
    assert parts.length(engine, 0) == len(parts.tokens(engine, 0))
    # made to fit, the frame stays where it is framed, and the fit is within the budget
    # (below the frame and the FIM tokens nothing fits: left whole for the caller to refuse)
    least = len(opening + closing + engine.bos()) + 3
    for budget in range(least - 2, len(parts.tokens(engine)) + 1):
        fitted = parts.fit(engine, budget)
        assert len(fitted.tokens) <= budget or budget <= least, (budget, fitted)
        assert fitted.tokens[:len(opening)] == opening
        assert closing == [] or closing[0] in fitted.tokens
    # a chunk's empty file name stays empty, as llama.cpp has it; a missing one is "tmp"
    if sep:
        named = InfillParts.of(engine, "p", "s", None, [{"filename": "", "text": "x"},
                                                        {"text": "y"}], "")
        assert named.chunks == [[sep] + text("\n") + text("x"),
                                [sep] + text("tmp\n") + text("y")]


@pytest.mark.parametrize("seed", range(12))
def test_infill_chunks_that_could_never_stay_are_not_tokenized_and_change_nothing(seed):
    """llama.vim's ring, or a client's 8 MB of input_extra: every chunk was tokenized,
    for every choice of the request, on the preparing thread every long or constrained
    job of the worker waits on. The newest are read first, and those that could not stay
    beside them never are; the prompt is the one made from all of them, token for token,
    and so is its length for every number of chunks left out (t_max_prompt_ms)."""
    import random
    from workers.prompts import FimTemplate, InfillParts, fitted_prompt
    rng = random.Random(seed)
    loop = make_loop()                                    # a 256-token context
    template = FimTemplate.parse("<P>{prefix}<S>{suffix}<M>")
    chunks = [{"filename": f"f{i}.py", "text": f"{i:03d}" + chr(97 + i % 26) * rng.choice(
        [5, 30, 90, 400, 3000])} for i in range(rng.randint(1, 40))]
    body = job("p" * rng.randint(1, 300), suffix="s" * rng.randint(0, 200), max_tokens=16,
               infill={"extra": chunks, "middle": ""})
    read = []
    real = loop.engine.tokenize
    loop.engine.tokenize = lambda text, *a, **k: read.append(text) or real(text, *a, **k)
    fitted = fitted_prompt(loop.engine, body, template, chunks)
    by_fit = list(read)                                # (what making it read)
    whole = InfillParts.of(loop.engine, body.prompt, body.suffix, template, chunks, "")
    expected = whole.fit(loop.engine, 256 - 16)
    assert (fitted.tokens, fitted.dropped, fitted.cut) == \
        (expected.tokens, expected.dropped, expected.cut)
    unread = [c["text"] for c in chunks[:fitted.parts.unread if fitted.parts else 0]]
    assert unread == [] or not any(text in by_fit for text in unread)
    if fitted.parts is not None:
        for k in range(len(chunks) + 1):
            assert fitted.parts.length(loop.engine, k) == \
                len(fitted.parts.tokens(loop.engine, k)) == \
                len(whole.tokens(loop.engine, max(k, fitted.parts.unread)))


def test_an_infill_chunks_file_name_counts_as_text_and_a_context_of_no_room_is_refused():
    """A chunk's `filename` was in no count of the worker's: a name of a megabyte left
    the job on the generation loop (every stream waited while it was tokenized) and
    past the bound on what could ever fit. A context (`nctx`) leaving no room for a
    prompt beside the answer made that bound 0, read as none: every chunk tokenized,
    then refused."""
    from workers.errors import InvalidInput
    from workers.preparation import worth_preparing
    from workers.prompts import fitted_prompt
    loop = make_loop()                                    # a 256-token context
    engine = loop.engine                                  # (a model with FIM_SEP names
    engine.fim_tokens, engine.fim_repo = (290, 291, 292), (300, 301)   # each chunk's file)
    named = [{"filename": "n" * 100_000, "text": "x"}, {"filename": "new.py", "text": "y"}]
    body = job("p", suffix="s", max_tokens=16, infill={"extra": named, "middle": ""})
    assert worth_preparing(body)
    read = []
    real = engine.tokenize
    engine.tokenize = lambda text, *a, **k: read.append(len(text)) or real(text, *a, **k)
    fitted = fitted_prompt(engine, body, None, named)
    assert fitted.parts.unread == 1 and max(read) < 1000      # the long name never read
    read.clear()
    tiny = job("p" * 1000, suffix="s" * 1000, max_tokens=16, route={"n_ctx": 1},
               infill={"extra": [{"filename": "f", "text": "z" * 50_000}], "middle": ""})
    with pytest.raises(InvalidInput) as refused:
        fitted_prompt(engine, tiny, None, tiny.infill.extra)
    assert refused.value.code == "context_length_exceeded" and read == []


def test_the_job_says_whether_the_penalties_take_the_prompt(loop, monkeypatch):
    seen = []
    real = loop.engine.add
    monkeypatch.setattr(loop.engine, "add", lambda *a, **k: (
        seen.append(k.get("penalize_prompt")), real(*a, **k))[1])
    submit(loop, "native", job("x", id="native", penalize_prompt=True))
    submit(loop, "openai", job("y", id="openai"))
    run(loop)
    assert seen == [True, False]


def test_keys_take_turns_on_the_preparing_thread():
    """One key's jobs slow to prepare (DRY settings each new, large grammars) filled the
    preparing thread's one queue, and another key's editor request waited behind all
    of them: the keys now take turns, each key's jobs in their order."""
    import threading
    loop = make_loop(n_ctx=2 * PREPARE_CHARS)
    held, started, order = threading.Event(), threading.Event(), []
    loop.preparer.thread.submit(lambda: (started.set(), held.wait(10)), key="flood")
    assert started.wait(10)                                      # (one under way)
    real = loop.preparer._prepare
    loop.preparer._prepare = lambda rid, body: (order.append(rid), real(rid, body))[1]
    for i in range(5):
        assert loop.preparer.submit(f"f{i}", job("x" * PREPARE_CHARS, id=f"f{i}",
                                                  api_key="flood"))
    assert loop.preparer.submit("mine", job("y" * PREPARE_CHARS, id="mine", api_key="me"))
    assert loop.preparer.submit("mine2", job("z" * PREPARE_CHARS, id="mine2",
                                              api_key="me"))
    held.set()
    loop.preparer.thread.submit(lambda: None, key="flood").result()
    loop.preparer.thread.submit(lambda: None, key="me").result()
    assert order[:5] == ["f0", "mine", "f1", "mine2", "f2"], order
    assert [r for r in order if r.startswith("f")] == [f"f{i}" for i in range(5)]
    loop.preparer.shutdown()
    # a stopping worker's job is not taken for preparing (it was never prepared, and
    # the dispatcher, told it had started, failed it): the loop takes it as it is
    assert not loop.preparer.submit("late", job("x" * PREPARE_CHARS, id="late"))
    assert "late" not in loop.preparer.preparing and \
        not any(rid == "late" for rid, _ in loop.preparer.on_thread)


def test_the_choices_of_one_prompt_are_fitted_once_on_the_preparing_thread(monkeypatch):
    """An /infill's n choices each tokenized its prefix, suffix and chunks again (the
    vocabulary keeps four long texts: with more, each choice missed them all), seconds
    each. The choices of one prompt (its id: `share_as`, kept when `same_as` is filled
    in) are fitted once, each given its own copy; another prompt, or the same prompt's
    fields under another answer's room, are fitted anew."""
    loop = make_loop(n_ctx=2 * PREPARE_CHARS)
    texts = []
    real = loop.engine.tokenize
    monkeypatch.setattr(loop.engine, "tokenize", lambda text, *a, **k: (
        texts.append(text), real(text, *a, **k))[1])
    from collections import OrderedDict

    from workers.worker import DispatcherLink
    link = DispatcherLink.__new__(DispatcherLink)      # (as the IO thread fills them in)
    link.shared = OrderedDict()
    prompt = "x" * PREPARE_CHARS
    bodies = [link._with_shared(job(prompt, id="r.0.0", share_as="r.0.0"))] + [
        link._with_shared(job(None, id=f"r.0.{c}", same_as="r.0.0")) for c in (1, 2)]
    bodies.append(job(prompt, id="r.0.3", share_as="r.0.0", max_tokens=9))
    bodies.append(job("y" * PREPARE_CHARS, id="s.0.0", share_as="s.0.0"))
    for body in bodies:
        assert loop.preparer.submit(body.id, body)
    loop.preparer.thread.submit(lambda: None).result()
    fitted = {}
    while len(fitted) < len(bodies):
        item = loop.inbox.get(timeout=10)
        fitted[item.request_id] = item.prepared.fitted
    assert texts.count(prompt) == 2 and texts.count("y" * PREPARE_CHARS) == 1
    assert fitted["r.0.0"].tokens == fitted["r.0.1"].tokens == fitted["r.0.2"].tokens
    assert fitted["r.0.1"].tokens is not fitted["r.0.2"].tokens     # (each its own)
    loop.preparer.shutdown()


def test_a_key_without_a_slot_of_its_own_takes_one_of_the_key_holding_the_most():
    """A key whose own (or empty) slots are all busy takes a free slot of another key's:
    of the key holding the most slots (the least cached of any went first, so a key
    keeping long prompts in its slots kept them and the other keys evicted each
    other's caches at every keystroke)."""
    loop = make_loop()
    loop.free_slots = [2, 1]                        # b's slot and one of the hog's three
    loop.slot_tenant = {0: "hog", 1: "hog", 2: "b", 3: "hog"}
    assert loop._slot_for([1, 2, 3], "d", reuse=True) == (1, False)
    assert loop._slot_for([1, 2, 3], "b", reuse=True) == (2, True)     # its own
    loop.slot_tenant = {0: "b", 1: "hog", 2: "b", 3: "hog"}             # a tie: any
    assert loop._slot_for([1, 2, 3], "d", reuse=True)[0] in (1, 2)


def test_a_huge_prompt_being_prepared_keeps_no_other_job_waiting():
    """A prompt of a MiB is seconds of tokenizing on the preparing thread, and every
    job of a few KB (most editors' requests) prepared behind it waited as long: huge
    ones have a thread of their own."""
    import threading
    from workers.preparation import BIG_PREPARE_CHARS
    loop = make_loop(n_ctx=2 * PREPARE_CHARS)
    held = threading.Event()
    loop.preparer.big_thread.submit(held.wait, 10)          # (a huge one, still going)
    assert loop.preparer.submit("huge", job("x" * BIG_PREPARE_CHARS, id="huge"))
    assert loop.preparer.submit("small", job("y" * PREPARE_CHARS, id="small"))
    loop.preparer.thread.submit(lambda: None).result()      # (the small one is ready)
    run(loop)
    assert events_of(loop, "small") and events_of(loop, "small")[-1]["e"] == "end"
    assert not events_of(loop, "huge")                      # (still being prepared)
    held.set()
    loop.preparer.big_thread.submit(lambda: None).result()
    run(loop)
    assert events_of(loop, "huge")[-1]["e"] in ("end", "error")
    loop.preparer.shutdown()


def test_the_watchdog_sees_how_long_a_job_has_been_in_preparation(monkeypatch):
    """A tokenizer or sampler call that never returns held its job (and every job of its
    size behind it) for ever, unwatched: the preparing threads' longest job is measured
    for the IO thread's watchdog, which gives the worker up past its bound."""
    import threading
    import time
    loop = make_loop(n_ctx=2 * PREPARE_CHARS)
    held, entered = threading.Event(), threading.Event()
    real = loop.engine.tokenize
    monkeypatch.setattr(loop.engine, "tokenize", lambda *a, **k: (
        entered.set(), held.wait(10), real(*a, **k))[2])
    assert loop.watch.longest(time.monotonic()) == 0.0
    assert loop.preparer.submit("slow", job("x" * PREPARE_CHARS, id="slow"))
    assert entered.wait(10)
    time.sleep(0.2)
    assert loop.watch.longest(time.monotonic()) >= 0.2
    assert loop.watch.longest(time.monotonic() + 400) > 400     # (what it would be)
    held.set()
    loop.preparer.thread.submit(lambda: None).result()
    assert loop.watch.longest(time.monotonic()) == 0.0
    # a /tokenize on the vocabulary thread, the same
    held.clear()
    entered.clear()
    submit(loop, "tok", job(op="tokenize", content="x" * 10, id="tok"))
    loop._read_inbox(block=False)
    assert entered.wait(10)
    time.sleep(0.2)
    assert loop.watch.longest(time.monotonic()) >= 0.2
    held.set()
    loop.vocabulary_thread.submit(lambda: None).result()
    assert loop.watch.longest(time.monotonic()) == 0.0
    loop.preparer.shutdown()


def tokenize_held_at_first(loop, monkeypatch):
    """The loop's engine tokenizes the text "first" only once `held` is set (`entered`
    says it began); `order`: the texts tokenized, in turn."""
    import threading
    held, entered, order = threading.Event(), threading.Event(), []
    real = loop.engine.tokenize

    def tokenize(text, *a, **k):
        order.append(text)
        if text == "first":
            entered.set()
            held.wait(10)
        return real(text, *a, **k)

    monkeypatch.setattr(loop.engine, "tokenize", tokenize)
    return held, entered, order


def test_tokenize_jobs_take_the_keys_in_turn_and_one_not_started_is_cancelled(monkeypatch):
    """/tokenize and /detokenize ran one FIFO on the vocabulary thread, never cancelled:
    a key's texts of a megabyte (17-23 s of a core each) whose clients had left kept
    another key's small /tokenize waiting behind all of them. The keys take turns, and
    a cancel drops one its thread has not started (DONE, cancelled, at once)."""
    loop = make_loop()
    held, entered, order = tokenize_held_at_first(loop, monkeypatch)
    for rid, key, text in (("a1", "A", "first"), ("a2", "A", "second"),
                           ("a3", "A", "third"), ("b1", "B", "other key's")):
        submit(loop, rid, job(op="tokenize", content=text, id=rid, api_key=key))
    loop._read_inbox(block=False)
    assert entered.wait(10) and loop.ops_running == 4
    loop.inbox.put(inbox.Cancel("a2"))
    loop.inbox.put(inbox.Cancel("a1"))                 # (running: it runs to its end)
    loop._read_inbox(block=False)
    assert [(cmd, rid) for cmd, rid, _ in loop.notices] == [("DONE", "a2")]
    assert loop.notices[0][2]["cancelled"] and loop.ops_running == 3
    held.set()
    loop.vocabulary_thread.submit(lambda: None, key="A").result()
    loop.vocabulary_thread.submit(lambda: None, key="B").result()
    loop._read_inbox(block=False)
    assert order == ["first", "other key's", "third"]   # B's before A's next
    assert sorted(rid for rid, e in loop.publisher.events if e["e"] == "end") == \
        ["a1", "a3", "b1"]
    assert loop.ops_running == 0 and not loop.ops
    loop.vocabulary_thread.shutdown()
    loop.preparer.shutdown()


def test_a_reset_drops_the_old_connections_tokenize_jobs_not_started(monkeypatch):
    """The dispatcher forgot this worker (it restarted): the old connection's /tokenize
    jobs queued on the vocabulary thread ran for nobody, a megabyte's for 20 s, the new
    connection's waiting behind them. Dropped at the Reset, unanswered (nobody holds
    them); the one running ends as it does."""
    loop = make_loop()
    held, entered, order = tokenize_held_at_first(loop, monkeypatch)
    for rid, text in (("a1", "first"), ("a2", "second")):
        submit(loop, rid, job(op="tokenize", content=text, id=rid, api_key="A"))
    loop._read_inbox(block=False)
    assert entered.wait(10) and loop.ops_running == 2
    loop.inbox.put(inbox.Reset(frozenset()))
    loop._read_inbox(block=False)
    assert list(loop.ops) == ["a1"] and loop.ops_running == 1 and not loop.notices
    held.set()
    loop.vocabulary_thread.submit(lambda: None, key="A").result()
    loop._read_inbox(block=False)
    assert order == ["first"] and loop.ops_running == 0
    loop.vocabulary_thread.shutdown()
    loop.preparer.shutdown()


def test_a_tokenize_job_the_vocabulary_thread_cannot_take_is_answered(monkeypatch):
    """Its thread could not start: the job was counted and never answered, holding one
    of the worker's /tokenize places in the dispatcher for good, and a stop waited out
    its whole grace for it."""
    loop = make_loop()

    def refuse(*a, **k):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(loop.vocabulary_thread, "submit", refuse)
    submit(loop, "t", job(op="tokenize", content="x", id="t"))
    loop._read_inbox(block=False)
    assert loop.ops_running == 0 and not loop.ops
    (cmd, rid, body), = loop.notices
    assert (cmd, rid, body["error"]) == ("DONE", "t", "generation_failed")
    assert events_of(loop, "t")[-1]["e"] == "error"
    loop.preparer.shutdown()


def test_a_superseding_request_being_prepared_keeps_the_slot_its_old_one_freed():
    """Its session's prompt is cached in the slot the old request freed: while the new
    one is prepared, a job waiting for a slot takes another (or waits), never that one
    (it took it, and the keystroke then prefilled its whole prompt again elsewhere)."""
    loop = make_loop(n_ctx=4 * PREPARE_CHARS)
    base = "Once upon " + "x" * PREPARE_CHARS
    submit(loop, "old", job(base, max_tokens=40, id="old"))
    loop.preparer.thread.submit(lambda: None).result()
    run(loop, steps=1)
    submit(loop, "other", job("Twice", max_tokens=40, id="other"))
    submit(loop, "waiting", job("Thrice", max_tokens=40, id="waiting"))
    run(loop, steps=3)
    assert loop.waiting[0][0] == "waiting"
    old_slot = loop.active["old"].slot
    submit(loop, "new", job(base + " y", max_tokens=4, id="new", adopt="old"))
    loop._read_inbox(block=False)
    loop._admit()
    assert "waiting" not in loop.active and loop.held == {"new": old_slot}
    loop.preparer.thread.submit(lambda: None).result()
    loop._read_inbox(block=False)
    loop._admit()
    assert loop.active["new"].slot == old_slot and not loop.held
    run(loop)
    assert events_of(loop, "waiting")[-1]["e"] == "end"
    # cancelled while prepared: the slot is free again for the others at once
    submit(loop, "a", job(base, max_tokens=40, id="a"))
    loop.preparer.thread.submit(lambda: None).result()
    run(loop, steps=1)
    submit(loop, "b", job(base + " z", max_tokens=4, id="b", adopt="a"))
    loop._read_inbox(block=False)
    assert list(loop.held) == ["b"]
    loop.cancel("b")
    assert not loop.held and sorted(loop.free_slots) == [0, 1]
    loop.preparer.thread.submit(lambda: None).result()
    run(loop)
    assert not events_of(loop, "b") and sorted(loop.free_slots) == [0, 1]


def test_a_superseding_job_read_before_a_reset_never_runs_after_it():
    """The dispatcher forgot this worker (Reset): what its old connection handed over is
    dropped, a superseding job the loop handed the preparing thread too (the Reset's
    snapshot, taken on the IO thread, could not know of it)."""
    loop = make_loop(n_ctx=2 * PREPARE_CHARS)
    submit(loop, "old", job("Once", max_tokens=40))
    run(loop, steps=3)
    submit(loop, "new", job("Once upon " + "x" * PREPARE_CHARS, max_tokens=4, id="new",
                            adopt="old"))
    loop.inbox.put(inbox.Reset(loop.preparer.being_prepared()))
    loop._read_inbox(block=False)                   # the job, then the Reset
    loop.preparer.thread.submit(lambda: None).result()
    run(loop)
    assert not events_of(loop, "new") and not loop.active and not loop.held
    assert sorted(loop.free_slots) == [0, 1] and not loop.preparer.superseding


def test_an_answer_ended_by_the_context_says_it_was_truncated(loop):
    """llama-server sets `truncated` when generation stops because the context is full
    (llama.vim asks for the field to warn of it); a limit of max_tokens is not that."""
    submit(loop, "full", job("x" * 250, max_tokens=None))       # 251 tokens of 256
    submit(loop, "short", job("x" * 10, max_tokens=3))
    run(loop, 100)
    full, short = events_of(loop, "full")[-1], events_of(loop, "short")[-1]
    assert full["e"] == "end" and full["stop_type"] == "limit" and full["truncated"] is True
    assert full["usage"]["completion_tokens"] == 256 - 251
    assert short["e"] == "end" and short["stop_type"] == "limit" and \
        not short.get("truncated")       # (a default is left out of the wire)


def test_an_adopted_generation_carries_the_token_ids_it_takes_over(loop):
    """llama.cpp's streamed chunks carry their token ids: the request that takes over a
    generation sends the ids of the tokens after what was typed, then its own, one for
    each token it counts (adoption was refused to such requests before)."""
    submit(loop, "old", job("Once", max_tokens=40, return_tokens=True))
    run(loop, steps=6)
    old = loop.active["old"]
    typed = SCRIPT[:3].decode()
    assert old.assembler.text.startswith(typed) and old.generated > 3
    submit(loop, "new", job("Once" + typed, max_tokens=10, id="new", adopt="old",
                            return_tokens=True))
    loop._read_inbox(block=False)
    assert "old" not in loop.active and loop.active["new"].generated == old.generated - 3
    run(loop)
    events = events_of(loop, "new")
    ids = [i for e in events if e["e"] == "text" for i in e.get("ids") or []]
    text = "".join(e["text"] for e in events if e["e"] == "text")
    assert events[-1]["e"] == "end" and events[-1]["usage"]["completion_tokens"] == 10
    assert len(ids) == 10 and bytes(ids).decode() == text == SCRIPT[3:13].decode()


def test_timings_per_token_puts_the_timings_so_far_in_every_text_event(loop):
    """llama.cpp's `timings_per_token`: each streamed chunk says its timings (the
    prompt's milliseconds, the generation's so far); without it text events carry none."""
    submit(loop, "t", job("Once", max_tokens=4, timings_per_token=True))
    submit(loop, "plain", job("Once", max_tokens=4, id="plain"))
    run(loop)
    texts = [e for e in events_of(loop, "t") if e["e"] == "text"]
    assert texts and all(set(e["timings"]) == {"prompt_ms", "predicted_ms"} for e in texts)
    spent = [e["timings"]["predicted_ms"] for e in texts]
    assert spent == sorted(spent) and all(e["timings"]["prompt_ms"] >= 0 for e in texts)
    assert not any("timings" in e for e in events_of(loop, "plain") if e["e"] == "text")


def test_the_ids_of_a_stop_strings_tokens_go_with_the_end(loop):
    """llama-server's `tokens` holds every token it sampled, a stop string's too: their
    ids, whose text never goes out, come with the end event (they were dropped, and an
    answer stopped at its first token had no ids at all)."""
    submit(loop, "s", job("x", max_tokens=40, stop=["ick"], return_tokens=True))
    run(loop)
    events = events_of(loop, "s")
    sent = [i for e in events if e["e"] == "text" for i in e.get("ids") or []]
    end = events[-1]
    assert end["e"] == "end" and end["stop_type"] == "word"
    assert bytes(sent) == b"The qu" and bytes(end["ids"]) == b"ick"
    submit(loop, "t", job("x", max_tokens=40, stop=["T"], return_tokens=True))
    run(loop)
    events = events_of(loop, "t")
    assert [e["e"] for e in events] == ["start", "end"] and events[-1]["ids"] == [ord("T")]


def test_detokenized_text_is_bounded_in_bytes_not_only_in_ids(monkeypatch):
    """The front end bounds /detokenize's ids, but their text is as long as the
    vocabulary's pieces (a million of a 128-byte token: 128 MB made, sent and parsed
    again): past MAX_DETOKENIZED_BYTES the job is a 400 naming `tokens`."""
    from workers import prompts
    from workers.errors import InvalidInput
    monkeypatch.setattr(prompts, "MAX_DETOKENIZED_BYTES", 8)    # (the fake: a byte a token)
    engine = FakeEngine("fake.gguf", 64, 1, step_delay=0.0)

    def detokenize(tokens):
        return prompts.vocabulary_op(engine, msgspec.convert(
            {"id": "j", "model": "m", "op": "detokenize", "generation": {"tokens": tokens}},
            P.WorkerJob))

    assert detokenize(list(b"12345678")) == {"content": "12345678"}
    with pytest.raises(InvalidInput) as info:
        detokenize(list(b"123456789"))
    assert (info.value.code, info.value.param) == ("text_too_large", "tokens")
