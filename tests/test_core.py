"""The dispatcher's core, driven by messages and a fake clock: no sockets, no processes."""
import time

import msgspec
import pytest

from dispatcher.common import protocol as P
from dispatcher.common.config import Heartbeat
from dispatcher.common.process import flag_value
from dispatcher.core import DispatcherCore, Send

HEARTBEAT_EXPIRY = Heartbeat().expiry

FE = b"fe-000000000001"
FE2 = b"fe-000000000002"


def ready(core, name=b"w0", now=0.0, slots=2, model="m", **info):
    return core.worker_message(name, P.Message(P.READY, "", P.WorkerInfo(
        model=model, slots=slots, n_ctx=4096, compute="cpu", pid=1, **info)), now)


def wire_job(**fields):
    """A job as the dispatcher holds it: envelope fields, the rest its unparsed generation."""
    if "route" in fields:
        fields["route"] = P.Route(**fields["route"])
    envelope = set(P.Job.__struct_fields__)
    generation = {k: fields.pop(k) for k in list(fields) if k not in envelope}
    return P.SubmittedJob(**fields, generation=msgspec.Raw(msgspec.json.encode(generation)))


def submit(core, rid, now=0.0, fe=FE, **body):
    body = {"id": rid, "model": "m", "prompt": f"prompt of {rid}", **body}
    return core.frontend_message(fe, P.Message(P.SUBMIT, rid, wire_job(**body)), now)


def from_worker(core, cmd, rid, now=0.0, name=b"w0", **body):
    kind = P.BODIES[cmd]
    return core.worker_message(name, P.Message(cmd, rid, kind and msgspec.convert(body, kind)),
                               now)


def kinds(sends: list[Send]) -> list[tuple[str, str]]:
    return [(P.command_name(s.cmd), s.request_id) for s in sends if s.cmd != P.STATE]


def test_a_job_is_accepted_then_sent_to_a_free_worker():
    core = DispatcherCore()
    ready(core)
    assert kinds(submit(core, "a")) == [("ACCEPTED", "a"), ("REQUEST", "a")]
    request = next(s for s in submit(core, "b") if s.cmd == P.REQUEST)
    assert request.peer == b"w0" and request.body.topic == FE.decode()
    assert kinds(submit(core, "c")) == [("ACCEPTED", "c")]           # two slots: queued
    assert len(core.queue) == 1
    sends = from_worker(core, P.DONE, "a", attempt=1, last_seq=3)
    assert kinds(sends) == [("FINISHED", "a"), ("REQUEST", "c")]     # its slot, at once


def choose_fails_for(core, monkeypatch, parent: str) -> None:
    """The core's worker choice raises for the jobs of request `parent` (a routing bug
    one request meets)."""
    choose = core.registry.choose

    def faulty(job, leader=None):
        if job.parent == parent:
            raise RuntimeError("a routing bug one request meets")
        return choose(job, leader)

    monkeypatch.setattr(core.registry, "choose", faulty)


def test_a_queued_job_whose_dispatch_raises_is_answered_and_the_queue_goes_on(monkeypatch):
    """A fault in choosing a worker for one queued job (or sending it there) met every
    later dispatch: each SUBMIT's handling raised, every tick did, and the broker's loop
    stopped after TEND_FAULTS of them, every stream with it. That job is answered 500
    and taken out; the next goes to the slot."""
    core = DispatcherCore()
    ready(core, slots=1)
    submit(core, "a")
    assert kinds(submit(core, "bad")) == [("ACCEPTED", "bad")]       # queued
    choose_fails_for(core, monkeypatch, "bad")
    assert kinds(submit(core, "c")) == [("ACCEPTED", "c")]
    sends = from_worker(core, P.DONE, "a", attempt=1, last_seq=3)
    assert kinds(sends) == [("FINISHED", "a"), ("FAILED", "bad"), ("REQUEST", "c")]
    failed = next(s for s in sends if s.cmd == P.FAILED)
    assert (failed.peer, failed.body.status, failed.body.code) == (FE, 500, "dispatcher_fault")
    assert core.stats["loop_faults"] == 1 and len(core.queue) == 0
    assert [k for k in kinds(core.tick(1.0)) if k[0] != "HEARTBEAT"] == []
    assert set(core.registry.workers[b"w0"].running) == {"c"}
    # a request of several choices meeting it: answered whole, once, its other choices
    # failed with it (the front end fails a request whole at its first error)
    fan = DispatcherCore()
    ready(fan, slots=1)
    submit(fan, "busy")
    choices(fan, "f", 3)
    choose_fails_for(fan, monkeypatch, "f")
    sends = from_worker(fan, P.DONE, "busy", attempt=1, last_seq=3)
    assert sorted(k for k in kinds(sends) if k[0] == "FAILED") == \
        [("FAILED", "f.0.0"), ("FAILED", "f.0.1"), ("FAILED", "f.0.2")]
    assert fan.stats["loop_faults"] == 1 and len(fan.queue) == 0


def test_a_cancelled_jobs_slot_goes_to_the_next_job_with_the_cancel():
    """An editor closes a keystroke's request and sends the next at once: the queued job
    goes to the worker right behind the CANCEL (which frees the slot there first), not
    after the worker's DONE comes back."""
    core = DispatcherCore()
    ready(core, slots=1)
    submit(core, "a")
    assert kinds(submit(core, "b")) == [("ACCEPTED", "b")]            # queued
    sends = core.frontend_message(FE, P.Message(P.CANCEL, "a"), 0.0)
    assert kinds(sends) == [("CANCEL", "a"), ("REQUEST", "b")]
    assert [s.peer for s in sends if s.cmd != P.STATE] == [b"w0", b"w0"]   # one socket
    assert kinds(submit(core, "c")) == [("ACCEPTED", "c")]            # b holds it now
    sends = from_worker(core, P.DONE, "a", attempt=1, last_seq=0, cancelled=True)
    assert kinds(sends) == [("FINISHED", "a")]                        # nothing more free
    assert set(core.registry.workers[b"w0"].running) == {"b"} and len(core.queue) == 1


def test_a_cancelled_job_is_neither_adopted_nor_sent_again():
    """A keystroke's request the client closed is gone from its worker: the session's
    next request queues as any other (no adoption, which would put it on that worker
    beside the job already sent into the freed slot), and a worker that could not run
    it (it lacked the shared prompt) does not get it back."""
    core = DispatcherCore()
    ready(core, slots=1)
    submit(core, "a", session="s", parent="a", adopt_key="k")
    submit(core, "x")
    assert kinds(core.frontend_message(FE, P.Message(P.CANCEL, "a"), 0.0)) == \
        [("CANCEL", "a"), ("REQUEST", "x")]
    sends = submit(core, "b", session="s", parent="b", adopt_key="k")
    assert ("REQUEST", "b") not in kinds(sends) and len(core.queue) == 1
    assert core.registry.workers[b"w0"].busy == 1
    sends = from_worker(core, P.DONE, "x", attempt=1, last_seq=0, unshared=True)
    assert ("REQUEST", "x") in kinds(sends)          # x, not cancelled, goes again
    core2 = DispatcherCore()
    ready(core2, slots=1)
    submit(core2, "c")
    core2.frontend_message(FE, P.Message(P.CANCEL, "c"), 0.0)
    sends = from_worker(core2, P.DONE, "c", attempt=1, last_seq=0, unshared=True)
    assert ("REQUEST", "c") not in kinds(sends) and len(core2.queue) == 0
    assert core2.stats["requeued"] == 0


def test_admission_refuses_what_cannot_run():
    core = DispatcherCore(max_queue=1)
    assert submit(core, "x")[0].body.code == "no_worker_ready"
    ready(core, slots=1)
    assert submit(core, "y", model="other")[0].body.code == "model_not_found"
    submit(core, "a")                                  # runs
    submit(core, "b")                                  # queued
    rejected = submit(core, "c")[0]
    assert rejected.cmd == P.REJECTED and rejected.body.status == 429
    assert rejected.body.type == "rate_limit_error" and rejected.body.retry_after == 1
    sends = submit(core, "d", route={"n_ctx": 100000})
    assert sends[0].body.code == "context_length_unavailable"


def test_refusals_come_in_the_order_a_client_should_hear_them():
    """A stopping server says so before it says a model is unknown; an unknown model
    before a route no worker meets; a route no worker meets is 503 (retry) while the
    fleet is still short of its workers, 400 once all are there (dispatcher/refusals.py)."""
    from dispatcher import refusals
    infos = [P.WorkerInfo(model="m", slots=1, n_ctx=4096, compute="cpu", pid=1)]
    models = {"m": {"ready": 1}}
    job = wire_job(id="a", model="other", prompt="p", route={"n_ctx": 100000})
    assert refusals.admission("a", job, models, infos, True, False).code == "shutting_down"
    assert refusals.admission("", job, models, infos, True, False).code == "bad_job"
    assert refusals.admission("a", job, {}, infos, False, False).code == "no_worker_ready"
    assert refusals.admission("a", job, models, infos, False, False).code == \
        "model_not_found"
    job = msgspec.structs.replace(job, model="m")
    short = refusals.admission("a", job, models, infos, False, True)
    assert (short.status, short.code) == (503, "no_worker_ready") and short.retry_after
    whole = refusals.admission("a", job, models, infos, False, False)
    assert (whole.status, whole.code) == (400, "context_length_unavailable")
    fits = msgspec.structs.replace(job, route=P.Route(n_ctx=100))
    assert refusals.admission("a", fits, models, infos, False, False) is None
    assert refusals.admission("a", None, models, infos, True, False).code == "bad_job"


def test_a_route_no_registered_worker_meets_waits_for_the_fleet_to_be_whole():
    """While fewer workers are registered than the fleet runs, one still starting may meet
    the route: 503 (retry); once every worker is there and none meets it: 400."""
    class Fleet:
        def expected_workers(self, coming=False):
            return 2

        def configured_models(self):
            return None

        def loading_models(self):
            return set()

    core = DispatcherCore(fleet=Fleet())
    ready(core, b"w0")
    short = submit(core, "a", route={"n_ctx": 100000})[0].body
    assert (short.status, short.code) == (503, "no_worker_ready") and short.retry_after
    ready(core, b"w1")
    whole = submit(core, "b", route={"n_ctx": 100000})[0].body
    assert (whole.status, whole.code) == (400, "context_length_unavailable")


def test_a_worker_that_gave_up_is_not_waited_for():
    """A worker that cannot load its model (exit 78) is never respawned: a route only it
    might have met is a 400 naming what is there, not a 503 to retry for ever."""
    from types import SimpleNamespace

    from dispatcher.broker import SupervisedFleet
    children = {"w0": SimpleNamespace(kind="worker", gave_up=False, extra={"model": "m"}),
                "w1": SimpleNamespace(kind="worker", gave_up=True, extra={"model": "m"})}
    fleet = SupervisedFleet(SimpleNamespace(children=children))
    assert fleet.expected_workers(coming=True) == 1
    assert fleet.expected_workers() == 2          # (/health shows the failed one missing)
    core = DispatcherCore(fleet=fleet)
    ready(core, b"w0")
    refused = submit(core, "a", route={"n_ctx": 100000})[0].body
    assert (refused.status, refused.code) == (400, "context_length_unavailable")
    state = core.state()                 # (the front ends refuse it too, before queueing)
    assert (state.expected_workers, state.coming_workers) == (2, 1)
    children["w1"].gave_up = False                       # (one starting again)
    again = submit(core, "b", route={"n_ctx": 100000})[0].body
    assert (again.status, again.code) == (503, "no_worker_ready")


def test_a_request_is_admitted_as_one_unit():
    core = DispatcherCore(max_queue=1)
    ready(core, slots=1)
    submit(core, "busy")
    for c in range(5):                                 # five choices of one request
        sends = submit(core, f"r.0.{c}", parent="r", fanout=5)
        assert kinds(sends) == [("ACCEPTED", f"r.0.{c}")]
    assert core.queue.depth(("m", None)) == 1
    assert submit(core, "other")[0].body.code == "queue_full"


def test_a_new_request_of_a_session_supersedes_queued_and_running_ones():
    core = DispatcherCore()
    ready(core, slots=1)
    submit(core, "a", session="s", parent="a")        # running
    submit(core, "b", session="s", parent="b")        # supersedes a; queued
    sends = submit(core, "c", session="s", parent="c")
    failed = {s.request_id: s.body.code for s in sends if s.cmd == P.FAILED}
    assert failed == {"b": "superseded"}
    assert "b" not in [j.request_id for j in core.queue]
    assert core.stats["superseded"] == 2


def test_a_lost_worker_requeues_what_it_had_not_started_and_fails_the_rest():
    core = DispatcherCore()
    ready(core, b"w0", slots=3)
    for rid in ("started", "generating", "waiting"):
        submit(core, rid)
    from_worker(core, P.STARTED, "started", attempt=1)
    from_worker(core, P.FIRST, "generating")
    sends = core.worker_exited("w0", 1, "killed")
    failed = {s.request_id: s.body.code for s in sends if s.cmd == P.FAILED}
    assert failed == {"started": "worker_lost", "generating": "worker_lost"}
    assert [j.request_id for j in core.queue] == ["waiting"]
    assert core.stats["requeued"] == 1 and core.stats["failed"] == 2
    sends = ready(core, b"w1")
    request = next(s for s in sends if s.cmd == P.REQUEST)
    assert request.request_id == "waiting" and request.body.attempt == 2


def test_a_worker_that_says_ready_again_has_its_old_attempts_cancelled_not_the_new():
    """A worker reconnects under its name: a job handed to it after its reconnection and
    before its READY was read ran there for nobody (the dispatcher had requeued it, and
    may hand the next attempt to another worker). The old attempts are cancelled there
    by attempt, before the next attempt can come to the same worker."""
    core = DispatcherCore()
    ready(core, b"w0", slots=2)
    submit(core, "handed")
    submit(core, "started")
    from_worker(core, P.STARTED, "started", attempt=1)
    sends = ready(core, b"w0", slots=2)
    to_worker = [(P.command_name(s.cmd), s.request_id, s.body) for s in sends
                 if s.peer == b"w0" and s.cmd != P.STATE]
    cancels = {rid: body.attempt for cmd, rid, body in to_worker if cmd == "CANCEL"}
    assert cancels == {"handed": 1, "started": 1}
    request = [(rid, body.attempt) for cmd, rid, body in to_worker if cmd == "REQUEST"]
    assert request == [("handed", 2)]                      # the next attempt, here again
    assert [cmd for cmd, rid, _ in to_worker if rid == "handed"] == ["CANCEL", "REQUEST"]
    failed = {s.request_id for s in sends if s.cmd == P.FAILED}
    assert failed == {"started"}                           # (started: never a 2nd try)
    # the worker's answer to the cancel (the old attempt) leaves the new one in place
    from_worker(core, P.DONE, "handed", attempt=1, cancelled=True)
    assert core.registry.get(b"w0").running["handed"].attempt == 2


def test_a_lost_workers_unstarted_jobs_go_back_in_the_order_they_came():
    """Each requeued job went to the queue's front in turn: the last sent came out first,
    the oldest request waited behind the others."""
    core = DispatcherCore()
    ready(core, b"w0", slots=3)
    for rid in ("first", "second", "third"):
        submit(core, rid)
    submit(core, "queued")
    core.worker_exited("w0", 1, "killed")
    assert [j.request_id for j in core.queue] == ["first", "second", "third", "queued"]


def test_a_job_unstarted_on_two_workers_that_crashed_is_failed_not_sent_to_a_third():
    """A job's STARTED travels behind its prefill's first step, so a prompt that crashes
    a worker there looks unstarted: requeued, such a job goes where no other such job
    waits to start, and is failed when that worker crashes too before it started (a
    third, with every request running on it, is not risked on it); the jobs beside it
    at its first crash go on. A worker that exits without a crash counts nothing."""
    core = DispatcherCore()
    ready(core, b"w0", slots=2)
    submit(core, "poison")
    submit(core, "bystander")
    core.worker_exited("w0", 1, "process exited (-11)", crashed=True)
    assert {(j.request_id, j.attempt, j.crashes) for j in core.queue} == {
        ("poison", 2, 1), ("bystander", 2, 1)}
    sends = ready(core, b"w1", slots=2)           # (room for both: takes one of them)
    first = [s.request_id for s in sends if s.cmd == P.REQUEST]
    assert len(first) == 1 and len(core.queue) == 1
    sends = core.worker_exited("w1", 1, "process exited (-11)", crashed=True)
    failed = {s.request_id: s.body.code for s in sends if s.cmd == P.FAILED}
    assert failed == {first[0]: "worker_lost"}                # (attempt 2 of 3)
    other = ({"poison", "bystander"} - set(first)).pop()
    sends = ready(core, b"w2", slots=2)
    assert [s.request_id for s in sends if s.cmd == P.REQUEST] == [other]
    from_worker(core, P.STARTED, other, attempt=2, name=b"w2")
    submit(core, "stopped")
    core.worker_exited("w2", 1, "process exited (0)")                 # a stop: no crash
    assert [(j.request_id, j.crashes) for j in core.queue] == [("stopped", 0)]


def choices(core, parent, n, prompt="the same prompt", **body):
    """The n choices of one prompt of a request, as a front end submits them (the later
    ones name the first's prompt fields: same_as)."""
    sends = []
    for c in range(n):
        sends += submit(core, f"{parent}.0.{c}", parent=parent, fanout=n,
                        **({"prompt": prompt} if c == 0 else {"same_as": f"{parent}.0.0"}),
                        **body)
    return sends


def where(core, prefix):
    return {rid: name for name, record in core.registry.workers.items()
            for rid in record.running if rid.startswith(prefix)}


def test_the_choices_of_a_crashing_prompt_crash_two_workers_whatever_their_number():
    """The n choices of one prompt go where the first of them is until it has written
    its first token (that worker holds them to copy its prefill anyway); spread at once,
    the n choices of a prompt that crashes llama.cpp in its prefill crashed n workers,
    each failing every request it ran, and n more when requeued. Crashed twice, the
    request fails whole: its queued choices too, and the other workers never see it."""
    core = DispatcherCore()
    for name in (b"w0", b"w1", b"w2", b"w3"):
        ready(core, name, slots=4)
    submit(core, "bystander")
    choices(core, "r", 6)
    placed = where(core, "r.")
    assert len(placed) == 4 and len(set(placed.values())) == 1     # one worker, its 4 slots
    assert len(core.queue) == 2                                    # the rest wait for it
    first = placed["r.0.0"]
    sends = core.worker_exited(first.decode(), 1, "process exited (-11)", crashed=True)
    assert not [s for s in sends if s.cmd == P.FAILED]             # unstarted: requeued
    second = set(where(core, "r.").values())
    assert len(second) == 1 and first not in second and len(where(core, "r.")) == 4
    sends = core.worker_exited(second.pop().decode(), 1, "process exited (-11)",
                               crashed=True)
    failed = {s.request_id: s.body.code for s in sends if s.cmd == P.FAILED}
    assert failed == {f"r.0.{c}": "worker_lost" for c in range(6)}
    assert not where(core, "r.") and len(core.queue) == 0
    assert len(core.registry.workers) == 2                         # two of four crashed
    assert core.stats["failed"] == 6 + ("bystander" not in where(core, "bystander"))


def test_the_choices_of_a_prompt_spread_once_the_first_has_written_a_token():
    core = DispatcherCore()
    for name in (b"w0", b"w1"):
        ready(core, name, slots=2)
    choices(core, "r", 4, tokens=16)        # (short: a request may take every slot)
    placed = where(core, "r.")
    assert len(placed) == 2 and len(set(placed.values())) == 1 and len(core.queue) == 2
    worker = placed["r.0.0"]
    from_worker(core, P.STARTED, "r.0.0", attempt=1, name=worker)
    assert len(core.queue) == 2                                   # started: not yet
    sends = from_worker(core, P.FIRST, "r.0.0", attempt=1, name=worker)
    assert len([s for s in sends if s.cmd == P.REQUEST]) == 2 and len(core.queue) == 0
    assert len(set(where(core, "r.").values())) == 2
    # spread in one pass: written once, a prompt's choices take any free worker
    core = DispatcherCore()
    for name, slots in ((b"w0", 1), (b"w1", 1), (b"w2", 1), (b"w3", 1)):
        ready(core, name, slots=slots)
    choices(core, "r", 4, tokens=16)
    (worker,) = set(where(core, "r.").values())
    assert len(core.queue) == 3
    sends = from_worker(core, P.FIRST, "r.0.0", attempt=1, name=worker)
    assert len([s for s in sends if s.cmd == P.REQUEST]) == 3 and len(core.queue) == 0
    # a prompt whose choices wait for their first's worker keeps no other prompt of
    # its request waiting
    core = DispatcherCore()
    for name in (b"w0", b"w1"):
        ready(core, name, slots=2)
    sends = []
    for i in range(2):
        for c in range(3):
            sends += submit(core, f"p.{i}.{c}", parent="p", fanout=6, tokens=16,
                            **({"prompt": f"prompt {i}"} if c == 0 else
                               {"same_as": f"p.{i}.0"}))
    placed = where(core, "p.")
    assert {"p.0.0", "p.1.0"} <= set(placed) and placed["p.0.0"] != placed["p.1.0"]
    # the choices of other prompts of a request are not held (each prompt its own)
    core = DispatcherCore()
    for name in (b"w0", b"w1"):
        ready(core, name, slots=2)
    for i in range(2):
        submit(core, f"m.{i}.0", parent="m", fanout=2, prompt=f"prompt {i}")
    assert len(set(where(core, "m.").values())) == 2


def test_a_worker_unreachable_or_stuck_counts_a_crash_for_what_it_had_not_started():
    """A worker whose connection went without a word (a REQUEST or CANCEL to it bounced
    before the launcher reaped its exit) or whose step never returned (the watchdog) may
    have been killed by a job that had not said it started: counted, MAX_CRASHES."""
    core = DispatcherCore()
    ready(core, b"w0", slots=2)
    submit(core, "a")
    core.send_failed(Send("worker", b"w0", P.CANCEL, "x"), gone=False)   # (a full pipe)
    assert [(j.request_id, j.crashes) for j in core.queue] == [("a", 0)]
    ready(core, b"w0", slots=2)
    core.dispatch()
    core.send_failed(Send("worker", b"w0", P.CANCEL, "x"))
    assert [(j.request_id, j.crashes) for j in core.queue] == [("a", 1)]
    core.worker_exited("w0", 1, "process exited (-11)", crashed=True)   # (gone: nothing)
    assert [(j.request_id, j.crashes) for j in core.queue] == [("a", 1)]
    ready(core, b"w1", slots=2)
    sends = core.worker_message(b"w1", P.Message(P.DISCONNECT, "", P.Disconnect(
        reason="a step ran past 10s", code="worker_stuck")), 0.0)
    failed = {s.request_id: s.body.code for s in sends if s.cmd == P.FAILED}
    assert failed == {"a": "worker_stuck"}


def test_a_request_one_job_of_which_failed_with_its_worker_has_its_queued_jobs_failed():
    """The front end fails a request whole at its first error: its jobs still queued are
    failed with it at once, never sent on to a worker first."""
    core = DispatcherCore()
    ready(core, b"w0", slots=1)
    for i in range(3):
        submit(core, f"m.{i}.0", parent="m", fanout=3, prompt=f"prompt {i}")
    from_worker(core, P.STARTED, "m.0.0", attempt=1)
    assert len(core.queue) == 2
    sends = core.worker_exited("w0", 1, "process exited (-9)", crashed=True)
    failed = {s.request_id: s.body.code for s in sends if s.cmd == P.FAILED}
    assert failed == {"m.0.0": "worker_lost", "m.1.0": "worker_lost", "m.2.0": "worker_lost"}
    assert len(core.queue) == 0


def test_a_worker_lost_by_going_silent_has_none_of_its_jobs_requeued():
    """A worker whose heartbeats stopped (its generation thread held the GIL, so its IO
    thread could neither beat nor say the job it was busy with had started): that job
    may be what froze it, and is failed, never handed to the next worker to freeze."""
    core = DispatcherCore()
    ready(core, b"w0", slots=2, now=0.0)
    submit(core, "poison")
    sends = core.tick(HEARTBEAT_EXPIRY + 1.0)
    failed = {s.request_id: s.body.code for s in sends if s.cmd == P.FAILED}
    assert failed == {"poison": "worker_lost"}
    assert len(core.queue) == 0 and core.stats["requeued"] == 0


def test_a_stopping_worker_hands_back_what_it_had_not_started():
    core = DispatcherCore()
    ready(core, b"w0")
    ready(core, b"w1")
    submit(core, "a")
    worker = next(n for n, r in core.registry.workers.items() if "a" in r.running)
    sends = from_worker(core, P.DONE, "a", name=worker, attempt=1, released=True)
    request = next(s for s in sends if s.cmd == P.REQUEST)
    assert request.body.attempt == 2 and core.stats["completed"] == 0


def test_a_worker_stopping_on_its_own_takes_no_more_and_its_hand_backs_are_no_failed_tries():
    """A worker's heartbeat says it is leaving (SIGTERM under systemd): it is drained.
    Jobs it hands back unstarted go elsewhere and do not count as failed tries: a job
    handed back by two stopping workers in a rolling restart is still requeued when the
    third crashes before starting it. A tokenize goes to a worker that is not leaving."""
    core = DispatcherCore()
    for name in (b"w0", b"w1", b"w2"):
        ready(core, name, slots=1)
    from_worker(core, P.HEARTBEAT, "", name=b"w0", leaving=True)
    assert core.registry.workers[b"w0"].draining
    submit(core, "x")
    for name in (b"w1", b"w2"):
        worker = next(n for n, r in core.registry.workers.items() if "x" in r.running)
        assert worker == name
        job = core.registry.workers[worker].running["x"]
        from_worker(core, P.DONE, "x", name=worker, attempt=job.attempt, released=True)
        if name == b"w1":
            ready(core, b"w1", slots=1)           # (its successor, under the same name)
    worker = next(n for n, r in core.registry.workers.items() if "x" in r.running)
    assert core.registry.workers[worker].running["x"].attempt == 3
    ready(core, b"w3", slots=1)
    sends = core.worker_message(worker, P.Message(P.DISCONNECT, "", P.Disconnect(
        reason="crashed")), 0.0)
    assert "x" not in {s.request_id for s in sends if s.cmd == P.FAILED}
    core.tick(0.1)
    assert "x" in core.registry.workers[b"w3"].running
    op = core.registry.pick(wire_job(id="t", model="m", prompt="", op="tokenize"))
    assert op is not None and not op.draining


def test_a_worker_that_stopped_as_asked_is_no_loss():
    """A planned stop (systemctl restart) says so on leaving: no loss is logged or
    recorded for it; one that still ran requests is a loss as before."""
    core = DispatcherCore()
    ready(core, b"w0")
    ready(core, b"w1")
    core.worker_message(b"w0", P.Message(P.DISCONNECT, "", P.Disconnect(
        reason="stopped", code=P.STOPPED)), 0.0)
    assert b"w0" not in core.registry.workers and "w0" not in core.losses
    submit(core, "a")
    core.worker_message(b"w1", P.Message(P.DISCONNECT, "", P.Disconnect(
        reason="stopped", code=P.STOPPED)), 0.0)
    assert "w1" in core.losses


def test_a_request_whose_first_choice_was_served_keeps_its_place_for_the_rest():
    """n: 2 with a queue deadline, one slot, two keys: when choice 0 finished, the slot
    went to the other key in its turn, and the next tick 504'd choice 1 (its request
    had nothing running any more), after choice 0's text had been streamed."""
    core = DispatcherCore(key_slot_share=0.75)
    ready(core, slots=1)
    submit(core, "A.0.0", parent="A", api_key="ka", timeout=5.0, now=0.0, fanout=2)
    submit(core, "A.0.1", parent="A", api_key="ka", timeout=5.0, now=0.0, fanout=2)
    submit(core, "B", parent="B", api_key="kb", timeout=50.0, now=1.0)
    from_worker(core, P.HEARTBEAT, "", now=5.9)
    core.frontend_message(FE, P.Message(P.PING, "", P.Ping()), 5.9)
    assert ("REQUEST", "B") in kinds(from_worker(core, P.DONE, "A.0.0", now=6.0,
                                                 attempt=1, last_seq=1))
    assert not [s for s in core.tick(6.1) if s.cmd == P.REJECTED]
    assert "A.0.1" in {j.request_id for j in core.queue}


def test_one_keys_many_fan_outs_never_push_out_another_keys_half_served_request():
    """The requests a choice of which was served are remembered per key: past the bound
    the key remembered for the most forgets its oldest (one list let a key's 10,000
    cheap fan-outs push out another key's half-served request, whose choices left in the
    queue were then 504'd), and each is forgotten after its time."""
    from dispatcher.admission import ServedRequests
    served = ServedRequests(keep_for=100.0, most=4)
    served.served("victim", "kv", 0.0)
    for i in range(50):
        served.served(f"f{i}", "kf", 1.0 + i)
    assert "victim" in served and "f49" in served and "f0" not in served
    assert len(served) == 4
    served.served("late", "kf", 100.5)                # victim's time is up
    assert "victim" not in served and len(served) <= 4
    assert sum(len(v) for v in served.by_key.values()) == len(served)


def test_a_front_end_taken_for_gone_is_told_its_queued_requests_were_dropped():
    """A front end that stalled past its heartbeats may be alive: its queued requests
    are refused to it (503 frontend_silent), not dropped unsaid (it waited for ever)."""
    core = DispatcherCore()
    ready(core, slots=1)
    submit(core, "a", now=0.0)
    submit(core, "b", now=0.0)                        # queued
    from_worker(core, P.HEARTBEAT, "", now=HEARTBEAT_EXPIRY + 0.5)
    sends = core.tick(HEARTBEAT_EXPIRY + 1.0)
    refused = {s.request_id: s.body.code for s in sends if s.cmd == P.REJECTED}
    assert refused == {"b": "frontend_silent"}
    assert ("CANCEL", "a") in kinds(sends)
    # the running one is told too (it ended later as a 502 `stream_incomplete`, or, its
    # worker gone before its DONE, never: the front end's stream waited for the client)
    failed = {s.request_id: s.body.code for s in sends if s.cmd == P.FAILED}
    assert failed == {"a": "frontend_silent"}
    from dispatcher.core import Send                 # a refusal it could not take is
    core.send_failed(Send("frontend", FE, P.REJECTED, "b"))   # counted (and logged)
    assert core.stats["frontend_undelivered"] == 1


def test_workers_and_front_ends_expire_without_heartbeats():
    core = DispatcherCore()
    ready(core, now=0.0, slots=1)
    submit(core, "a", now=0.0)                        # sent to the worker
    submit(core, "b", now=0.0)                        # queued
    assert kinds(core.tick(HEARTBEAT_EXPIRY - 0.1)) == [("HEARTBEAT", "")]
    from_worker(core, P.HEARTBEAT, "", now=HEARTBEAT_EXPIRY - 0.1)
    assert len(core.registry) == 1
    assert core.registry.workers[b"w0"].heartbeats == 1      # (bench --profile waits on it)
    core.frontend_message(FE, P.Message(P.PING, "", P.Ping()), 2 * HEARTBEAT_EXPIRY - 0.1)
    sends = core.tick(2 * HEARTBEAT_EXPIRY)
    assert len(core.registry) == 0 and ("DISCONNECT", "") in kinds(sends)
    # a silent worker could not say whether it had started a: failed, never requeued
    assert ("FAILED", "a") in kinds(sends) and core.stats["requeued"] == 0
    assert [j.request_id for j in core.queue] == ["b"]  # never sent: kept for later
    core.tick(3 * HEARTBEAT_EXPIRY)
    assert core.frontends == {} and len(core.queue) == 0   # its front end went quiet


def test_a_queued_job_past_its_deadline_gets_a_504():
    core = DispatcherCore()
    ready(core, slots=1)
    submit(core, "a")
    submit(core, "late", now=1.0, timeout=2.0)
    assert kinds(core.tick(2.9)) == [("HEARTBEAT", "")]
    sends = core.tick(3.1)
    assert [(s.request_id, s.body.status) for s in sends if s.cmd == P.REJECTED] == \
        [("late", 504)]


def test_a_graceful_stop_waits_for_work_in_flight():
    core = DispatcherCore()
    ready(core)
    submit(core, "a")
    core.drain(30.0, now=1.0)
    assert submit(core, "b", now=1.0)[0].body.code == "shutting_down"
    core.tick(2.0)
    assert not core.stopped
    from_worker(core, P.DONE, "a", now=2.0, attempt=1)
    core.tick(2.1)
    assert core.stopped


def test_a_graceful_stop_answers_what_is_left_when_its_grace_ends():
    """Past --stop-grace, every request still queued or running gets its 503 (a stream
    that started, an error event) and the worker drops the running ones: nothing waits
    on a dispatcher that stopped reading."""
    core = DispatcherCore()
    ready(core, slots=1)
    submit(core, "a")
    submit(core, "b")                                       # queued behind it
    core.drain(1.0, now=0.5)
    assert not core.stopped and not [s for s in core.tick(1.0) if s.cmd == P.REJECTED]
    sends = core.tick(1.6)
    assert core.stopped
    assert [(P.command_name(s.cmd), s.request_id, s.body.code) for s in sends
            if s.cmd in (P.REJECTED, P.FAILED)] == [("REJECTED", "b", "shutting_down"),
                                                     ("FAILED", "a", "shutting_down")]
    assert [(s.peer, s.request_id) for s in sends if s.cmd == P.CANCEL] == [(b"w0", "a")]
    assert len(core.queue) == 0


def test_a_graceful_stop_tells_no_cancelled_request_again():
    """A request its client cancelled (or a newer keystroke superseded) was told: the
    grace's end does not fail it a second time, only drops it at the worker."""
    core = DispatcherCore()
    ready(core, slots=2)
    submit(core, "a")
    submit(core, "gone")
    core.cancel("gone")
    core.drain(1.0, now=0.5)
    sends = core.tick(1.6)
    assert [s.request_id for s in sends if s.cmd == P.FAILED] == ["a"]
    assert {s.request_id for s in sends if s.cmd == P.CANCEL} == {"a", "gone"}


def test_an_undeliverable_request_requeues_it_on_another_worker():
    core = DispatcherCore()
    ready(core, b"w0")
    request = next(s for s in submit(core, "a") if s.cmd == P.REQUEST)
    ready(core, b"w1")
    sends = core.send_failed(request)
    retried = next(s for s in sends if s.cmd == P.REQUEST)
    assert retried.peer != request.peer and retried.body.attempt == 2


def test_superseding_follows_the_clients_order_not_the_arrival_here():
    core = DispatcherCore()
    ready(core, slots=4)
    submit(core, "newer", session="s", parent="newer", session_order=20)
    sends = submit(core, "older", session="s", parent="older", session_order=10)
    assert [(P.command_name(s.cmd), s.request_id, s.body.code) for s in sends] == \
        [("REJECTED", "older", "superseded")]                # it lost the race: never runs
    assert "newer" in core.registry.get(b"w0").running      # and the newer one goes on
    from_worker(core, P.DONE, "newer", attempt=1)
    late = submit(core, "oldest", session="s", parent="oldest", session_order=5)
    assert late[0].body.code == "superseded"             # even once the newer one ended
    sends = submit(core, "newest", session="s", parent="newest", session_order=30)
    assert ("REQUEST", "newest") in kinds(sends)


def test_a_cancelled_job_is_not_requeued_when_its_worker_is_lost():
    core = DispatcherCore()
    ready(core, b"w0")
    submit(core, "gone")
    core.frontend_message(FE, P.Message(P.CANCEL, "gone"), 0.0)   # cancel sent
    core.worker_exited("w0", 1, "killed")                             # ... then lost
    assert len(core.queue) == 0 and core.stats["requeued"] == 0


def test_a_session_request_with_the_same_adopt_key_goes_to_the_running_ones_worker():
    """Type-along adoption: the old request is told it is superseded, not cancelled in
    its worker; the new one bypasses the queue to that worker, marked `adopt`."""
    core = DispatcherCore()
    ready(core, b"w0", slots=1)
    ready(core, b"w1", slots=1)
    submit(core, "a", session="s", parent="a", adopt_key="k")
    worker_a = core.registry.workers[b"w0"] if "a" in core.registry.workers[b"w0"].running \
        else core.registry.workers[b"w1"]
    sends = submit(core, "b", session="s", parent="b", adopt_key="k")
    assert kinds(sends) == [("FAILED", "a"), ("ACCEPTED", "b"), ("REQUEST", "b")]
    request = sends[-1]
    assert request.peer == worker_a.identity and request.body.adopt == "a"
    assert set(worker_a.running) == {"a", "b"} and not len(core.queue)
    # the worker adopted: a's DONE says so; b runs on in a's slot
    from_worker(core, P.DONE, "a", name=worker_a.identity, attempt=1, last_seq=2,
                cancelled=True, adopted_by="b")
    assert core.stats["adopted"] == 1 and set(worker_a.running) == {"b"}


def test_a_different_adopt_key_or_none_cancels_as_before():
    core = DispatcherCore()
    ready(core, slots=2)
    submit(core, "a", session="s", parent="a", adopt_key="k")
    sends = submit(core, "b", session="s", parent="b", adopt_key="other")
    assert ("CANCEL", "a") in kinds(sends)
    assert all(getattr(s.body, "adopt", None) is None for s in sends)
    sends = submit(core, "c", session="s", parent="c")            # no key: no adoption
    assert ("CANCEL", "b") in kinds(sends)


def test_no_adoption_onto_a_draining_worker():
    core = DispatcherCore()
    ready(core, slots=2)
    submit(core, "a", session="s", parent="a", adopt_key="k")
    core.registry.workers[b"w0"].draining = True          # restart/reload under way
    sends = submit(core, "b", session="s", parent="b", adopt_key="k")
    assert ("CANCEL", "a") in kinds(sends)
    assert ("REQUEST", "b") not in kinds(sends) and len(core.queue) == 1


def test_tokenize_jobs_are_bounded_per_worker():
    from dispatcher.common.config import MAX_OPS_PER_WORKER
    core = DispatcherCore()
    ready(core, slots=1)
    for i in range(MAX_OPS_PER_WORKER):
        assert kinds(submit(core, f"t{i}", op="tokenize", content="x")) == [
            ("ACCEPTED", f"t{i}"), ("REQUEST", f"t{i}")]
    busy = submit(core, "over", op="tokenize", content="x")[0]
    assert busy.cmd == P.REJECTED and busy.body.status == 429
    assert busy.body.code == "tokenizer_busy" and busy.body.retry_after == 1
    from_worker(core, P.DONE, "t0", attempt=1, last_seq=0)
    assert kinds(submit(core, "again", op="tokenize", content="x")) == [
        ("ACCEPTED", "again"), ("REQUEST", "again")]


def test_with_several_keys_one_keys_tokenize_jobs_take_half_a_workers_at_most():
    """Four 1 MiB /tokenize jobs of one key (17-23 s of a core each) took every place:
    another key's was refused, or waited behind them. With several keys, one key's take
    half a worker's places; with one key or none, all of them."""
    from dispatcher.common.config import MAX_OPS_PER_WORKER
    core = DispatcherCore(key_slot_share=0.75)
    ready(core, slots=1)
    half = MAX_OPS_PER_WORKER // 2
    for i in range(half):
        assert ("REQUEST", f"a{i}") in kinds(submit(core, f"a{i}", op="tokenize",
                                                    content="x", api_key="ka"))
    busy = submit(core, "a-over", op="tokenize", content="x", api_key="ka")[0]
    assert busy.body.code == "tokenizer_busy" and "this API key" in busy.body.message
    for i in range(MAX_OPS_PER_WORKER - half):
        assert ("REQUEST", f"b{i}") in kinds(submit(core, f"b{i}", op="tokenize",
                                                    content="x", api_key="kb"))
    busy = submit(core, "c", op="tokenize", content="x", api_key="kc")[0]
    assert busy.body.code == "tokenizer_busy" and "every worker" in busy.body.message


def test_a_stuck_worker_fails_its_started_requests_as_stuck_and_is_remembered():
    core = DispatcherCore()
    ready(core, slots=2)
    submit(core, "started")
    submit(core, "waiting")
    from_worker(core, P.STARTED, "started", attempt=1)
    sends = from_worker(core, P.DISCONNECT, "", reason="stuck: one step ran 301s",
                        code="worker_stuck")
    failed = {s.request_id: s.body.code for s in sends if s.cmd == P.FAILED}
    assert failed == {"started": "worker_stuck"}
    assert [j.request_id for j in core.queue] == ["waiting"]        # not started: requeued
    assert core.losses["w0"]["code"] == "worker_stuck"
    assert "301s" in core.losses["w0"]["reason"]
    # the metric counts the request that ended stuck, not the one requeued (which a
    # second worker may complete: counted twice, once as stuck)
    assert sum(n for (outcome, worker, _), n in core.metrics.outcomes.items()
               if (outcome, worker) == ("stuck", "w0")) == 1


def test_a_prompt_crosses_each_hop_once():
    from collections import OrderedDict

    from workers.worker import DispatcherLink
    link = DispatcherLink.__new__(DispatcherLink)      # the worker's side, no sockets
    link.shared = OrderedDict()

    def at_worker(request):                             # as the worker reads it
        body = P.decode(P.encode(P.REQUEST, request.request_id, request.body)).body
        return link._with_shared(body)
    core = DispatcherCore()
    ready(core, b"w0", slots=4)
    big = "x" * 100_000
    sends = submit(core, "r.0.0", prompt=big, parent="r", fanout=3)
    first = next(s for s in sends if s.cmd == P.REQUEST)
    assert first.body.prompt is big and first.body.share_as == "r.0.0"
    assert at_worker(first).prompt == big
    for c in (1, 2):                              # the front end names the first job
        sends = core.frontend_message(FE, P.Message(P.SUBMIT, f"r.0.{c}", wire_job(**{
            "id": f"r.0.{c}", "model": "m", "parent": "r", "fanout": 3,
            "same_as": "r.0.0"})), 0.0)
        request = next(s for s in sends if s.cmd == P.REQUEST)
        assert request.body.prompt is None and request.body.same_as == "r.0.0"
        assert request.body.share_as is None    # (its fields are the first's: kept so)
        job = core.registry.get(b"w0").running[f"r.0.{c}"]
        assert job.body.prompt is big          # whole in the dispatcher, not copied
        whole = at_worker(request)             # ... and at the worker, named by the first
        assert whole.prompt == big and whole.share_as == "r.0.0" and whole.same_as is None
    assert "r" not in core.units.shared                 # the request is all here: forgotten


def test_a_request_of_several_prompts_leaves_nothing_behind_once_all_are_here():
    """Its last job, the first of its own prompt, had opened a unit again and left its
    prompt for jobs that never come (60 s, beside no queue limit)."""
    core = DispatcherCore()
    ready(core, b"w0", slots=4)
    for p in range(3):
        submit(core, f"r.{p}.0", prompt=f"prompt {p} " * 1000, parent="r", fanout=3)
    assert "r" not in core.units.pending and "r" not in core.units.shared
    for p in range(2):
        submit(core, f"s.{p}.0", prompt="one", parent="s", fanout=4)
        core.frontend_message(FE, P.Message(P.SUBMIT, f"s.{p}.1", wire_job(**{
            "id": f"s.{p}.1", "model": "m", "parent": "s", "fanout": 4,
            "same_as": f"s.{p}.0"})), 0.0)
    assert "s" not in core.units.pending and "s" not in core.units.shared


def test_a_worker_that_was_not_sent_the_prompt_gets_it_whole():
    core = DispatcherCore()
    ready(core, b"w0", slots=1)
    ready(core, b"w1", slots=1)
    sends = submit(core, "r.0.0", prompt="shared prompt", parent="r", fanout=2, tokens=16)
    first = next(s for s in sends if s.cmd == P.REQUEST)
    from_worker(core, P.FIRST, "r.0.0", attempt=1, name=first.peer)   # (may spread now)
    sends = core.frontend_message(FE, P.Message(P.SUBMIT, "r.0.1", wire_job(**{
        "id": "r.0.1", "model": "m", "parent": "r", "fanout": 2, "same_as": "r.0.0",
        "tokens": 16})), 0.0)
    request = next(s for s in sends if s.cmd == P.REQUEST)
    assert request.peer != first.peer                # one slot each: the other worker
    assert request.body.prompt == "shared prompt" and request.body.share_as == "r.0.0"


def test_same_as_naming_nothing_is_refused():
    core = DispatcherCore()
    ready(core)
    sends = core.frontend_message(FE, P.Message(P.SUBMIT, "x.0.1", wire_job(**{
        "id": "x.0.1", "model": "m", "parent": "x", "fanout": 2, "same_as": "x.0.0"})), 0.0)
    assert sends[0].cmd == P.REJECTED and sends[0].body.code == "bad_job"


def test_a_job_whose_prompt_the_worker_lacks_is_sent_again_whole():
    core = DispatcherCore()
    ready(core, b"w0", slots=4)
    submit(core, "r.0.0", prompt="shared", parent="r", fanout=2)
    sends = core.frontend_message(FE, P.Message(P.SUBMIT, "r.0.1", wire_job(**{
        "id": "r.0.1", "model": "m", "parent": "r", "fanout": 2, "same_as": "r.0.0"})), 0.0)
    assert next(s for s in sends if s.cmd == P.REQUEST).body.same_as == "r.0.0"
    sends = from_worker(core, P.DONE, "r.0.1", attempt=1, last_seq=-1, unshared=True)
    again = next(s for s in sends if s.cmd == P.REQUEST)
    assert again.request_id == "r.0.1" and again.body.prompt == "shared"
    assert again.body.same_as is None and again.body.attempt == 1
    assert not any(s.cmd in (P.FAILED, P.FINISHED) for s in sends)   # the client sees nothing


def test_a_refused_request_leaves_no_prompt_behind():
    core = DispatcherCore(max_queue=1)
    ready(core, slots=1)
    submit(core, "busy")
    submit(core, "queued")
    refused = submit(core, "r.0.0", prompt="x" * 1000, parent="r", fanout=2)
    assert refused[0].cmd == P.REJECTED and "r" not in core.units.shared


def test_the_session_table_is_bounded_least_recently_used_first(monkeypatch):
    from dispatcher import admission
    monkeypatch.setattr(admission, "MAX_SESSIONS", 3)
    core = DispatcherCore()
    ready(core, slots=8)
    for i in range(5):
        submit(core, f"r{i}", session=f"s{i}", parent=f"r{i}")
    submit(core, "again", session="s2", parent="again")         # s2 used again
    submit(core, "new", session="s5", parent="new")
    assert list(core.sessions.newest[None]) == ["s4", "s2", "s5"]
    assert core.sessions.remembered == 3


def test_a_key_opening_session_after_session_forgets_its_own(monkeypatch):
    """One key's flood of new sessions pushes out its own least recently used ones
    (those without open jobs first), never another key's open session: a global list
    forgot it, and that session's late older request then ended the newer one."""
    from dispatcher import admission
    monkeypatch.setattr(admission, "MAX_SESSIONS", 8)
    core = DispatcherCore()
    ready(core, slots=4)
    submit(core, "mine-new", session="victim", parent="mine-new", api_key="kv",
           session_seq=True, session_order=5)
    for i in range(40):
        submit(core, f"f{i}", session=f"flood{i}", parent=f"f{i}", api_key="kf",
               session_seq=True, session_order=1)
        from_worker(core, P.DONE, f"f{i}", attempt=1, last_seq=1) \
            if i % 2 else core.frontend_message(FE, P.Message(P.CANCEL, f"f{i}"), 0.0)
    assert core.sessions.remembered == 8 and len(core.sessions.newest["kv"]) == 1
    late = submit(core, "mine-old", session="victim", parent="mine-old", api_key="kv",
                  session_seq=True, session_order=4)             # the older one, late
    assert late[0].cmd == P.REJECTED and "superseded" in late[0].body.code
    assert "mine-new" in core.registry.workers[b"w0"].running


def test_a_key_over_its_share_of_the_queue_is_refused_while_others_are_admitted():
    core = DispatcherCore(max_queue=4, max_queue_per_key=2)
    ready(core, slots=1)
    submit(core, "a0", api_key="k1", parent="a0")                   # runs
    submit(core, "a1", api_key="k1", parent="a1")                   # queued
    submit(core, "a2", api_key="k1", parent="a2")                   # queued: its share
    refused = submit(core, "a3", api_key="k1", parent="a3")[0]
    assert refused.cmd == P.REJECTED and refused.body.code == "key_queue_full"
    assert refused.body.status == 429 and refused.body.retry_after == 1
    assert kinds(submit(core, "b0", api_key="k2", parent="b0")) == [("ACCEPTED", "b0")]
    sends = from_worker(core, P.DONE, "a0", attempt=1, last_seq=1)
    assert ("REQUEST", "b0") in kinds(sends)        # keys take turns: k1 just had one
    sends = from_worker(core, P.DONE, "b0", attempt=1, last_seq=1)
    assert ("REQUEST", "a1") in kinds(sends)        # then k1 again


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.permutations(range(6)), st.lists(st.integers(0, 5), max_size=3),
       st.booleans())
def test_the_last_request_sent_is_answered_in_every_interleaving(arrival, closed, seq):
    """Six requests of one session, numbered in the order sent (X-Session-Seq, or the
    arrival stamp), reach the dispatcher in any order; the client closes some older
    ones; the last one sent is never failed or refused as superseded."""
    core = DispatcherCore()
    ready(core, slots=2)
    last, refused = 5, set()
    for step, i in enumerate(arrival):
        sends = submit(core, f"r{i}", now=step * 0.01, session="s", parent=f"r{i}",
                       session_order=100 + i, session_seq=seq)
        refused |= {s.request_id for s in sends if s.cmd in (P.REJECTED, P.FAILED)}
        for c in closed:
            if c != last:
                core.frontend_message(FE, P.Message(P.CANCEL, f"r{c}"), step * 0.01)
    assert f"r{last}" not in refused


def test_a_client_counting_from_zero_again_starts_a_new_epoch():
    core = DispatcherCore()
    ready(core, slots=2)
    for i in range(30, 41):
        submit(core, f"old{i}", session="s", parent=f"old{i}", session_order=i,
               session_seq=True)
    sends = submit(core, "late", session="s", parent="late", session_order=35,
                   session_seq=True)
    assert sends[0].cmd == P.REJECTED and sends[0].body.code == "superseded"   # late
    sends = submit(core, "again", session="s", parent="again", session_order=0,
                   session_seq=True)                # the editor restarted: counts from 0
    assert ("ACCEPTED", "again") in kinds(sends)
    assert {s.request_id for s in sends if s.cmd == P.FAILED} == {"old40"}
    assert ("ACCEPTED", "next") in kinds(submit(core, "next", session="s", parent="next",
                                                session_order=1, session_seq=True))


def test_after_a_pause_a_lower_seq_is_a_new_epoch_but_arrival_stamps_never_go_back():
    core = DispatcherCore()
    ready(core, slots=2)
    submit(core, "a", session="s", parent="a", session_order=7, session_seq=True)
    from_worker(core, P.DONE, "a", attempt=1, last_seq=1)
    sends = submit(core, "b", now=3.0, session="s", parent="b", session_order=3,
                   session_seq=True)
    assert kinds(sends)[0] == ("ACCEPTED", "b")
    submit(core, "c", session="t", parent="c", session_order=7)
    from_worker(core, P.DONE, "c", attempt=1, last_seq=1)
    sends = submit(core, "d", now=3.0, session="t", parent="d", session_order=3)
    assert sends[0].cmd == P.REJECTED                      # (stamps: d was sent before c)


def test_a_wall_clock_stepped_back_does_not_refuse_a_sessions_requests():
    """Arrival stamps are the front end's wall clock: after it steps back two minutes,
    the session's next request is newer (it supersedes the open one), not refused as
    older for two minutes; a stamp a minute older (a slow body) is still a late request."""
    core = DispatcherCore()
    ready(core, slots=2)
    s = 10 ** 9
    submit(core, "a", session="u", parent="a", session_order=1_000 * s)
    assert submit(core, "late", now=0.1, session="u", parent="late",
                  session_order=940 * s)[0].cmd == P.REJECTED
    sends = submit(core, "b", now=0.2, session="u", parent="b", session_order=880 * s)
    assert ("ACCEPTED", "b") in kinds(sends)
    assert {x.request_id for x in sends if x.cmd == P.FAILED} == {"a"}   # superseded
    assert ("ACCEPTED", "c") in kinds(submit(core, "c", now=0.3, session="u", parent="c",
                                             session_order=881 * s))


# -- sessions inferred for editors' FIM requests without X-Session-Id ----------------------
FILE = "def handler(request):\n    value = request.get('field')\n    return respond(val"


def keystroke(core, rid, text, now=0.0, client="c1", order=None, **body):
    body.setdefault("suffix", "ue)\n")
    return submit(core, rid, now=now, prompt=text, client=client,
                  parent=rid, session_order=order if order is not None else int(now * 1e9),
                  **body)


def failed(sends, code="superseded") -> set[str]:
    return {s.request_id for s in sends
            if s.cmd in (P.FAILED, P.REJECTED) and s.body.code == code}


def test_a_keystroke_without_a_session_header_supersedes_the_one_before():
    core = DispatcherCore()
    ready(core, slots=2)
    keystroke(core, "k1", FILE, now=0.0)
    sends = keystroke(core, "k2", FILE + "u", now=0.1)
    assert failed(sends) == {"k1"} and ("ACCEPTED", "k2") in kinds(sends)
    sends = keystroke(core, "k3", FILE[:-2], now=0.2)          # deleting is a keystroke too
    assert failed(sends) == {"k2"}


def test_an_older_keystroke_arriving_late_is_superseded_itself():
    core = DispatcherCore()
    ready(core, slots=2)
    keystroke(core, "new", FILE + "ue", now=0.1, order=200)
    sends = keystroke(core, "old", FILE + "u", now=0.11, order=100)
    assert failed(sends) == {"old"}
    assert ("ACCEPTED", "again") in kinds(keystroke(core, "again", FILE + "ue)", now=0.2,
                                                    order=300))


@pytest.mark.parametrize("second", [
    dict(client="c2"),                                   # another key or address
    dict(text="class Other:\n    pass\n" + FILE),        # another place in the file
    dict(text=FILE + "u", now=5.0),                      # after the window
    dict(text=FILE),                                     # the same text again
    dict(text=FILE + "u", model="other"),                # another model
    dict(text=FILE + "u", suffix=None),                  # not a FIM request
    dict(text=FILE + "u", fanout=2),                     # several jobs
    dict(text=FILE + "u", session="explicit"),           # it names its own session
    dict(text=FILE + "u", suffix="ue)\n\nother()\n"),      # the text after the cursor differs
    dict(text=FILE + "ue)\n    # and a comment"),         # more than a few keystrokes
    dict(text="", suffix=""),                            # a warm-up with no text at all
])
def test_what_never_joins_an_inferred_session(second):
    core = DispatcherCore(known_models={"m": {}, "other": {}})
    ready(core, slots=4)
    ready(core, name=b"w1", model="other", slots=4)
    keystroke(core, "k1", FILE, now=0.0)
    args = {"client": "c1", "now": 0.1, "text": FILE, **second}
    text, now = args.pop("text"), args.pop("now")
    if args.get("suffix", "x") is None:
        args.pop("suffix")
        sends = submit(core, "k2", now=now, prompt=text, parent="k2",
                       session_order=int(now * 1e9), **args)
    else:
        sends = keystroke(core, "k2", text, now=now, **args)
    assert not failed(sends) and not failed(sends, "bad_job")


def test_an_infill_keystroke_is_matched_on_its_line_at_one_place():
    """llama.vim's /infill: the lines above in `prompt` (input_prefix), the cursor's line
    in `middle`. Typing on the line joins the session; the same line under other lines
    above (another place), or an update of its ring buffer (all empty), never does."""
    core = DispatcherCore()
    ready(core, slots=4)
    above = "import math\n\ndef mul(a, b):\n"

    def infill(rid, middle, prompt=above, suffix="\n\nprint(mul(2, 3))\n", now=0.0):
        return submit(core, rid, now=now, prompt=prompt, suffix=suffix, client="c1",
                      parent=rid, session_order=int(now * 1e9),
                      infill=P.Infill(middle=middle))

    infill("typed", "    r")
    assert not failed(infill("ring", "", prompt="", suffix="", now=0.05))
    assert not failed(infill("elsewhere", "    r", prompt=above + "    pass\n", now=0.1))
    assert failed(infill("next", "    re", now=0.2)) == {"typed"}
    assert "ring" in core.registry.workers[b"w0"].running


def test_matching_a_keystroke_compares_long_texts_at_c_speed():
    import time
    from dispatcher.admission import same_cursor
    text = "x" * (1 << 20)
    started = time.perf_counter()
    for _ in range(20):
        assert same_cursor(text, text + "y") and not same_cursor(text, "y" + text)
    assert time.perf_counter() - started < 2.0       # a Python loop took ~0.1 s each


def test_inferring_sessions_can_be_turned_off():
    core = DispatcherCore(infer_sessions=False)
    ready(core, slots=2)
    keystroke(core, "k1", FILE, now=0.0)
    assert not failed(keystroke(core, "k2", FILE + "u", now=0.1))


def test_the_newest_keystroke_is_answered_in_every_interleaving_without_a_header():
    """Issue 24's guarantee for inferred sessions: five keystrokes of one user, stamped in
    the order typed, reach the dispatcher in every order; the last one typed is never
    refused or failed as superseded."""
    import itertools
    for arrival in itertools.permutations(range(5)):
        core = DispatcherCore()
        ready(core, slots=2)
        refused = set()
        for step, i in enumerate(arrival):
            refused |= failed(keystroke(core, f"k{i}", FILE + "x" * i, now=step * 0.01,
                                        order=1000 + i))
        assert "k4" not in refused, arrival


def test_inferred_sessions_keep_bounded_text(monkeypatch):
    from dispatcher import admission
    monkeypatch.setattr(admission, "MAX_TEXT", 10_000)
    inferred = admission.InferredSessions()
    for i in range(50):
        body = wire_job(id=f"j{i}", model="m", prompt=f"{i} " + "x" * 1000, suffix="",
                        client=f"c{i}", session_order=i)
        inferred.session_for(body, 0.0)
    places = [v for key in inferred.keys.values() for v in key.values()]
    assert inferred.bytes <= 10_000 and len(places) == inferred.places <= 10
    assert inferred.bytes == sum(admission.held(e.text) for v in places for e in v)


def test_inferred_sessions_count_the_bytes_their_texts_take():
    """The bound is on memory: a text of four-byte characters counts four times its
    characters (counted in characters, MAX_TEXT's 32 Mi held 128 MiB of emoji)."""
    from dispatcher import admission
    inferred = admission.InferredSessions()
    for i, text in enumerate(("x" * 1000, "\U0001F600" * 1000)):
        inferred.session_for(wire_job(id=f"j{i}", model="m", prompt=text, suffix="",
                                      client=f"c{i}", session_order=i), 0.0)
    assert 5000 <= inferred.bytes < 5200                     # (and two headers)
    assert inferred.bytes == sum(inferred.key_bytes.values())


def _inferred_keystroke(inferred, api_key, client, text, when, order):
    body = wire_job(id=f"{client}-{order}", model="m", prompt=text, suffix="\n",
                    client=client, api_key=api_key, session_order=order)
    return inferred.session_for(body, when)


@pytest.mark.parametrize("flood", ["places", "text"])
def test_one_key_flooding_inferred_sessions_evicts_its_own_places(monkeypatch, flood):
    """A key sending many clients (or long texts) within the window fills the inferred
    sessions' bounds; another key's place stays, so its next keystroke still ends its
    stale one (a global LRU dropped it: both then ran)."""
    from dispatcher import admission
    monkeypatch.setattr(admission, "MAX_CLIENTS", 8)
    monkeypatch.setattr(admission, "MAX_TEXT", 40_000)
    inferred = admission.InferredSessions()
    mine = _inferred_keystroke(inferred, "victim", "v", "def f(x):\n    return x", 0.0, 1)
    size = 10_000 if flood == "text" else 100
    for i in range(200):
        _inferred_keystroke(inferred, "flood", f"c{i}", f"{i} " + "y" * size, 0.001 * i, 2 + i)
    assert _inferred_keystroke(inferred, "victim", "v", "def f(x):\n    return x +",
                               0.5, 500) == mine
    places = [v for key in inferred.keys.values() for v in key.values()]
    assert inferred.places == len(places) <= 8 and inferred.bytes <= 40_000
    assert inferred.bytes == sum(admission.held(e.text) for v in places for e in v)
    assert inferred.bytes == sum(inferred.key_bytes.values())
    # the flooding key's newest place is kept; its oldest went
    assert _inferred_keystroke(inferred, "flood", "c199", "199 " + "y" * size + "z",
                               0.6, 600).startswith("~c199:")
    assert ("c0", "m") not in {p[:2] for p in inferred.keys["flood"]}


def test_inferred_sessions_of_one_key_keep_the_least_recently_seen_rule(monkeypatch):
    """With one key (or none), eviction is least recently seen first, as before."""
    from dispatcher import admission
    monkeypatch.setattr(admission, "MAX_CLIENTS", 3)
    inferred = admission.InferredSessions()
    first = _inferred_keystroke(inferred, None, "a", "def a():\n    pass", 0.0, 1)
    _inferred_keystroke(inferred, None, "b", "def b():\n    pass", 0.1, 2)
    _inferred_keystroke(inferred, None, "c", "def c():\n    pass", 0.2, 3)
    assert _inferred_keystroke(inferred, None, "a", "def a():\n    passx", 0.3, 4) == first
    _inferred_keystroke(inferred, None, "d", "def d():\n    pass", 0.4, 5)   # b goes
    assert {p[0] for p in inferred.keys[None]} == {"a", "c", "d"}
    assert inferred.places == 3


def test_one_key_never_holds_every_slot_while_keys_share_them():
    """One key's request of 16 choices on a 16-slot worker: it runs 12 of them (its
    share, the rest queued in turn), so another key's request is served at once, not
    after the first key's generations end."""
    core = DispatcherCore(key_slot_share=0.75)
    ready(core, slots=16)
    for c in range(16):
        submit(core, f"a.0.{c}", parent="a", fanout=16, api_key="ka")
    running = core.registry.workers[b"w0"].running
    assert sum(1 for j in running.values() if j.body.api_key == "ka") == 12
    sends = submit(core, "b", api_key="kb")
    assert ("REQUEST", "b") in kinds(sends)
    sends = from_worker(core, P.DONE, "a.0.0", attempt=1, last_seq=3)
    assert sum(1 for s in sends if s.cmd == P.REQUEST) == 1       # a's next, in its turn
    alone = DispatcherCore()                                     # one key (or none): all
    ready(alone, slots=16)
    for c in range(16):
        submit(alone, f"a.0.{c}", parent="a", fanout=16, api_key="ka", tokens=64)
    assert len(alone.registry.workers[b"w0"].running) == 16


def test_a_key_alone_fills_the_slots_with_brief_jobs_and_another_waits_for_one():
    """Held to its share (3/4) with nobody else waiting, eight users of one key on an
    8-slot worker found two slots idle: two keystrokes waited for whole completions
    (the keyed bench's TTFT p95 5.2 s against 1.1 s). Brief jobs (at most BRIEF_TOKENS to
    write) of a key whose jobs alone wait take them; long ones still stop at the share;
    another key's request runs at the first brief job's end, before the first key's
    next (its turn)."""
    core = DispatcherCore(key_slot_share=0.75, max_queue=64)
    ready(core, slots=8)
    for i in range(8):
        submit(core, f"a{i}", parent=f"a{i}", api_key="ka", tokens=128)
    running = core.registry.workers[b"w0"].running
    assert len(running) == 8
    assert kinds(submit(core, "b0", parent="b0", api_key="kb", tokens=128)) == \
        [("ACCEPTED", "b0")]                            # no slot: it waits for one
    submit(core, "a8", parent="a8", api_key="ka", tokens=128)
    sends = from_worker(core, P.DONE, "a0", attempt=1, last_seq=3)
    assert [k for k in kinds(sends) if k[0] == "REQUEST"] == [("REQUEST", "b0")]
    sends = from_worker(core, P.DONE, "a1", attempt=1, last_seq=3)
    assert [k for k in kinds(sends) if k[0] == "REQUEST"] == [("REQUEST", "a8")]
    for tokens, prompt_work in ((1024, 0), (128, 3000)):    # long to write, or to prefill
        long_ = DispatcherCore(key_slot_share=0.75, max_queue=64)
        ready(long_, slots=8)
        for i in range(8):
            submit(long_, f"a{i}", parent=f"a{i}", api_key="ka", tokens=tokens,
                   prompt_work=prompt_work)
        assert len(long_.registry.workers[b"w0"].running) == 6
        assert ("REQUEST", "b0") in kinds(submit(long_, "b0", parent="b0", api_key="kb"))


@pytest.mark.parametrize("key", [None, "ka"])
def test_a_request_of_long_choices_never_holds_every_slot(key):
    """Without keys too: 16 choices without a token limit (or 16 x 512 tokens) on a
    16-slot worker run 12 at a time, so a later request starts at once; 16 x 256 tokens
    (4,096 together, slots freed soon) fill all 16; one request alone is never held."""
    for tokens, at_once in ((None, 12), (512, 12), (256, 16)):
        core = DispatcherCore()
        ready(core, slots=16)
        for c in range(16):
            submit(core, f"a.0.{c}", parent="a", fanout=16, api_key=key, tokens=tokens)
        running = core.registry.workers[b"w0"].running
        assert len(running) == at_once, tokens
        sends = submit(core, "b", parent="b", api_key=key, tokens=None)
        assert (("REQUEST", "b") in kinds(sends)) == (at_once < 16), tokens
        if at_once < 16:
            sends = from_worker(core, P.DONE, "a.0.0", attempt=1, last_seq=3)
            assert sum(1 for s in sends if s.cmd == P.REQUEST) == 1     # a's next, in turn
    single = DispatcherCore()
    ready(single, slots=1)
    assert ("REQUEST", "c.0.0") in kinds(submit(single, "c.0.0", parent="c", fanout=2,
                                                 api_key=key))


def test_a_request_of_long_prompts_never_holds_every_slot():
    """Eight 3,000-token prompts with max_tokens 1 (or one prompt's logprobs echoed by
    each of eight choices) held all eight slots: a keystroke waited 15-25 s for a slot.
    Their prefill counts as their work; eight short prompts still fill every slot."""
    from app.jobs import prompt_work
    long_prompts = {"prompt": ["x" * 12_000] * 8, "max_tokens": 1}
    echoed = {"prompt": ["x" * 4_000], "echo": True, "logprobs": 0}
    short = {"prompt": ["x" * 400] * 8}
    for req, candidates, at_once in ((long_prompts, 1, 6), (echoed, 8, 6), (short, 1, 8)):
        work = prompt_work(req, candidates)
        core = DispatcherCore()
        ready(core, slots=8)
        for c in range(8):
            submit(core, f"a.0.{c}", parent="a", fanout=8, tokens=1, prompt_work=work)
        assert len(core.registry.workers[b"w0"].running) == at_once, (work, req)
        assert (("REQUEST", "b") in kinds(submit(core, "b", parent="b"))) == (at_once < 8)
    assert prompt_work(echoed, 8) == 8 * 1000 and prompt_work(long_prompts, 1) == 24_000
    assert prompt_work({"prompt": [[1, 2, "abcd"]], "suffix": "s" * 40}, 3) == 3 + 10
    # an /infill's chunks and text at the cursor are prefilled too (a megabyte of
    # chunks beside an empty prefix was rated brief)
    infill = P.Infill(extra=[{"filename": "a.py", "text": "x" * 4000}] * 3, middle="y" * 40)
    assert prompt_work({"prompt": [""], "suffix": "s" * 40}, 2, infill) == 10 + 3010


def test_a_huge_session_seq_never_locks_out_requests_ordered_by_arrival():
    """One request of a session with X-Session-Seq 2**63-1, then the same session's
    requests without the header (ordered by arrival, stamps far below it): each is newer
    by arriving later, never refused as older, at once or later."""
    core = DispatcherCore()
    ready(core, slots=4)
    submit(core, "far", session="s", parent="far", session_order=2 ** 63 - 1,
           session_seq=True)
    for i, now in enumerate((0.0, 3.0, 13.0, 43.0)):
        sends = submit(core, f"plain{i}", now=now, session="s", parent=f"plain{i}",
                       session_order=int((1e9 + now) * 1e9))
        assert not failed(sends, "superseded") - {f"plain{i - 1}", "far"}, sends
        assert ("ACCEPTED", f"plain{i}") in kinds(sends)


def test_choices_held_back_by_their_own_request_are_not_timed_out_in_the_queue():
    """A queue deadline (--queue-timeout, X-Request-Timeout) is for requests that never
    started: the choices of a long request waiting for its own share of the slots are
    not failed 504 while one of theirs runs; a request with none running is."""
    core = DispatcherCore()
    ready(core, slots=4)
    for c in range(4):
        submit(core, f"a.0.{c}", parent="a", fanout=4, tokens=None, timeout=5.0)
    assert len(core.registry.workers[b"w0"].running) == 3
    submit(core, "b", parent="b", tokens=None, timeout=5.0)       # the fourth slot
    submit(core, "c", parent="c", tokens=8, timeout=5.0)          # no slot: waits
    core.expire_deadlines(time.monotonic() + 10.0)        # (deadlines: the real clock)
    assert failed(core._take(), "queue_timeout") == {"c"}
    assert [j.request_id for j in core.queue._jobs] == ["a.0.3"]


def test_a_keys_share_of_one_models_slots_is_counted_on_that_model_alone():
    """With keys as tenants each key runs at most its share of a model's slots: a key's
    request running on one model (a chat) takes nothing from its share of another (its
    editor's completions), which it may fill at once; on the same model it waits."""
    core = DispatcherCore(key_slot_share=0.75)
    ready(core, name=b"w0", model="chat", slots=1)
    ready(core, name=b"w1", model="fim", slots=2)
    assert ("REQUEST", "a") in kinds(submit(core, "a", model="chat", api_key="k1"))
    assert ("REQUEST", "b") in kinds(submit(core, "b", model="fim", api_key="k1"))
    # its share of fim's two slots is one: the next waits, another key's goes
    assert kinds(submit(core, "c", model="fim", api_key="k1")) == [("ACCEPTED", "c")]
    assert ("REQUEST", "d") in kinds(submit(core, "d", model="fim", api_key="k2"))


def test_work_for_workers_the_operator_drained_is_refused_in_time_not_queued_forever():
    """`drain` on every worker of a model: its new requests were accepted and never
    placed nor refused (the queue filled, clients hung). Now they wait NO_WORKER_TIMEOUT
    for a `resume`, as for a worker not there yet, and get a 503 saying why; a worker
    drained for a restart (on its way back) keeps them queued."""
    from dispatcher.core import NO_WORKER_TIMEOUT
    from dispatcher.operations import Operations
    core = DispatcherCore()
    ready(core, b"w0")
    ops = Operations(core)
    assert ops.handle({"cmd": "drain", "worker": "w0"})["ok"]
    assert kinds(submit(core, "a")) == [("ACCEPTED", "a")]

    def wait(until):
        sends, t = [], 0.0
        while t < until:
            t += 1.0
            from_worker(core, P.HEARTBEAT, "", now=t)
            core.frontend_message(FE, P.Message(P.PING, "", P.Ping()), t)
            sends += core.tick(t)
        return sends
    refused = [s for s in wait(NO_WORKER_TIMEOUT + 2) if s.cmd == P.REJECTED]
    assert [s.request_id for s in refused] == ["a"]
    assert refused[0].body.status == 503 and refused[0].body.code == "no_worker_ready"
    assert "drained" in refused[0].body.message and len(core.queue) == 0
    assert ops.handle({"cmd": "resume", "worker": "w0"})["ok"]
    assert ("REQUEST", "b") in kinds(submit(core, "b", now=40.0))

    restarting = DispatcherCore()
    ready(restarting, b"w0")
    restarting.registry.workers[b"w0"].draining = True       # as `restart` leaves it
    submit(restarting, "c")
    core = restarting
    assert not [s for s in wait(NO_WORKER_TIMEOUT + 2) if s.cmd == P.REJECTED]
    assert [j.request_id for j in restarting.queue] == ["c"]


def test_a_drain_holds_across_the_worker_registering_again_and_resume_waits_a_restart():
    """`drain` lived on the registry's record: a worker respawned or reconnected came
    back taking work. And `resume` of a worker waiting to restart said ok while the
    restart went ahead at its deadline, aborting what it had taken meanwhile: it is
    refused, saying so (a reload has renamed its model already)."""
    from dispatcher.operations import Operations
    from dispatcher.supervisor import Child, Supervisor
    core = DispatcherCore()
    ready(core, b"w0")
    supervisor = Supervisor()
    supervisor.children["w0"] = Child("w0", ["python", "-m", "workers"], {},
                                      extra={"model": "m"})
    ops = Operations(core, supervisor)
    assert ops.handle({"cmd": "drain", "worker": "w0"})["ok"]
    ready(core, b"w0", now=1.0)                            # registers again
    assert core.registry.workers[b"w0"].draining
    assert kinds(submit(core, "a", now=1.0)) == [("ACCEPTED", "a")]     # not sent to it
    assert ops.handle({"cmd": "resume", "worker": "w0"})["ok"]
    assert ("REQUEST", "b") in kinds(submit(core, "b", now=2.0))
    ready(core, b"w0", now=3.0)
    assert not core.registry.workers[b"w0"].draining
    assert ops.handle({"cmd": "drain", "worker": "w0"})["ok"]
    assert ops.handle({"cmd": "restart", "worker": "w0", "grace": 60})["ok"]
    assert ops.pending and "w0" not in core.paused                       # (coming back:
    refused = ops.handle({"cmd": "resume", "worker": "w0"})            # its work waits)
    assert "waiting to restart" in refused["error"] and ops.pending


def test_a_restart_waits_for_the_workers_tokenize_requests_too():
    """A restart went ahead once no generation ran, with a /tokenize still on the worker:
    the worker's stop dropped its answer, a 503 `worker_lost` and a loss in `status`."""
    from dispatcher.operations import Operations
    from dispatcher.supervisor import Child, Supervisor
    core = DispatcherCore()
    ready(core, b"w0")
    restarted = []
    supervisor = Supervisor()
    supervisor.restart = lambda name, argv=None: restarted.append(name)
    supervisor.children["w0"] = Child("w0", ["python", "-m", "workers"], {},
                                      extra={"model": "m"})
    ops = Operations(core, supervisor)
    submit(core, "t", op="tokenize", content="x")
    assert ops.handle({"cmd": "restart", "worker": "w0", "grace": 60})["ok"]
    ops.tick(1.0)
    assert not restarted and ops.pending
    from_worker(core, P.DONE, "t", attempt=1, last_seq=0)
    ops.tick(2.0)
    assert restarted == ["w0"] and not ops.pending


def test_a_restart_refused_for_its_grace_changes_nothing_and_a_new_id_alone_is_applied():
    """`restart`/`reload` over the control socket: a bad grace is refused before the
    worker is drained or its model renamed; `--model-id` without `--model` is applied
    (it was dropped, and the command said it was done)."""
    from dispatcher.operations import Operations
    from dispatcher.supervisor import Child, Supervisor
    core = DispatcherCore()
    ready(core, name=b"w0")
    supervisor = Supervisor()
    supervisor.children["w0"] = Child("w0", ["python", "-m", "workers", "--model-id", "m"],
                                      {}, extra={"model": "m"})
    ops = Operations(core, supervisor)
    assert "control" in ops.handle({"cmd": "reload", "worker": "w0",
                                    "model_id": "a\x00b"})["error"]  # (exec refuses it)
    for grace in ("soon", -1, float("nan")):
        assert "grace" in ops.handle({"cmd": "restart", "worker": "w0", "grace": grace})["error"]
        assert not core.registry.workers[b"w0"].draining
        assert supervisor.children["w0"].extra["model"] == "m" and not ops.pending
    answer = ops.handle({"cmd": "reload", "worker": "w0", "model_id": "renamed", "grace": 5})
    assert answer["ok"] and answer["model"] == "renamed"
    argv = ops.pending["w0"]["argv"]
    assert flag_value(argv, "--model-id") == "renamed"


def test_a_sessions_newest_request_takes_the_queue_place_of_the_one_it_ends():
    """The queue bounds were checked before superseding: with the key's share or the
    lane full, an editor's newest keystroke got 429 and the stale one it should have
    replaced stayed queued and ran. The places of the queued requests it ends count as
    free; one that ends nothing queued is refused as before."""
    from dispatcher.common import config
    core = DispatcherCore(max_queue=64, max_queue_per_key=config.queue_share(64, None, 100))
    ready(core, slots=1)
    submit(core, "busy", api_key="other", parent="busy")           # (holds the slot)
    submit(core, "k1", api_key="ka", session="s", parent="k1", session_order=1,
           session_seq=True)
    newest = submit(core, "k2", api_key="ka", session="s", parent="k2", session_order=2,
                    session_seq=True)
    assert ("FAILED", "k1") in kinds(newest) and ("ACCEPTED", "k2") in kinds(newest)
    assert [j.request_id for j in core.queue] == ["k2"]
    refused = submit(core, "k3", api_key="ka", parent="k3")          # (no session)
    assert refused[0].body.code == "key_queue_full"
    core = DispatcherCore(max_queue=2)                                # the lane's bound
    ready(core, slots=1)
    submit(core, "busy", parent="busy")
    submit(core, "x", parent="x")
    submit(core, "k1", session="s", parent="k1", session_order=1, session_seq=True)
    newest = submit(core, "k2", session="s", parent="k2", session_order=2, session_seq=True)
    assert ("ACCEPTED", "k2") in kinds(newest)
    assert [j.request_id for j in core.queue] == ["x", "k2"]
    assert submit(core, "y", parent="y")[0].body.code == "queue_full"
    core = DispatcherCore(max_queue=64, max_queue_per_key=1)        # an inferred session
    ready(core, slots=1)
    submit(core, "busy", api_key="other", parent="busy")
    typed = "def f(x):\n    return " + "a" * 40
    submit(core, "t1", api_key="ka", parent="t1", client="c1", prompt=typed, suffix="\n",
           session_order=1)
    newest = submit(core, "t2", api_key="ka", parent="t2", client="c1", prompt=typed + "b",
                    suffix="\n", session_order=2)
    assert ("ACCEPTED", "t2") in kinds(newest) and [j.request_id for j in core.queue] == ["t2"]


def test_a_request_sent_back_to_the_queue_keeps_its_deadline():
    """A request of one job whose worker was lost before it started goes back to the
    queue, and its deadline (X-Request-Timeout, --queue-timeout) still holds: it was
    exempt for an hour, as if a choice of it had been served. A hand-over's too."""
    core = DispatcherCore(queue_timeout=5.0)
    ready(core, name=b"w0", slots=1)
    ready(core, name=b"w1", slots=1)
    submit(core, "long", parent="long", now=0.0)
    submit(core, "a", parent="a", now=0.0)
    where = {rid: w for w, r in core.registry.workers.items() for rid in r.running}
    core.worker_exited(where["a"].decode(), 1, "process exited (-9)")
    assert [j.request_id for j in core.queue] == ["a"]
    for w in list(core.registry.workers):
        from_worker(core, P.HEARTBEAT, "", now=6.0, name=w)
    core.frontend_message(FE, P.Message(P.PING, "", P.Ping()), 6.0)
    refused = [s for s in core.tick(6.0) if s.cmd == P.REJECTED]
    assert [(s.request_id, s.body.code) for s in refused] == [("a", "queue_timeout")]


def test_queued_requests_wait_for_a_worker_loading_their_model():
    """A reload drains the model's only worker, then starts one that loads it: queued
    requests were refused 503 30 s after the old one left, however long the model takes
    to load (minutes, a large one on a GPU). While a worker is loading their model they
    wait (the fleet bounds that by the load it measured); then 30 s as before."""
    class Fleet:
        loading = {"m"}

        def expected_workers(self, coming=False):
            return 1

        def configured_models(self):
            return {"m"}

        def loading_models(self):
            return self.loading

    fleet = Fleet()
    core = DispatcherCore(fleet=fleet)
    ready(core, slots=1)
    submit(core, "busy", now=0.0)
    submit(core, "a", now=0.0)
    core.worker_exited("w0", 1, "restarted")          # (its busy request lost, "a" queued)
    for now in (1.0, 40.0, 100.0):
        core.frontend_message(FE, P.Message(P.PING, "", P.Ping()), now)
        assert not [s for s in core.tick(now) if s.cmd == P.REJECTED]
    core.frontend_message(FE, P.Message(P.PING, "", P.Ping()), 100.0)
    assert not [s for s in core.tick(100.0) if s.cmd == P.REJECTED]
    assert sorted(j.request_id for j in core.queue) == ["a", "busy"]   # (busy: unstarted)
    fleet.loading = set()                               # (its load took too long)
    core.frontend_message(FE, P.Message(P.PING, "", P.Ping()), 101.0)
    core.tick(101.0)
    core.frontend_message(FE, P.Message(P.PING, "", P.Ping()), 131.5)
    refused = [s for s in core.tick(131.5) if s.cmd == P.REJECTED]
    assert sorted((s.request_id, s.body.code) for s in refused) == [
        ("a", "no_worker_ready"), ("busy", "no_worker_ready")]


def test_the_fleet_says_which_models_are_loading_for_as_long_as_a_load_takes():
    import time
    from types import SimpleNamespace

    from dispatcher.broker import SupervisedFleet
    now = time.monotonic()
    child = lambda **k: SimpleNamespace(**{"kind": "worker", "gave_up": False,  # noqa: E731
                                           "process": object(), "ready_at": None,
                                           "started_at": now - 5, "load_seconds": None,
                                           "died_loading": 0,
                                           "extra": {"model": k.pop("model")}, **k})
    children = {"a": child(model="loading"), "b": child(model="ready", ready_at=now),
                "c": child(model="failed", gave_up=True),
                "d": child(model="respawning", process=None),
                "e": child(model="stuck", load_seconds=1.0),     # (three loads' time past)
                "f": child(model="slow", load_seconds=100.0),
                "g": child(model="crash-loop", died_loading=2),   # (no load to wait for)
                "h": child(model="killed-once", died_loading=1)}  # (its retry is waited for)
    fleet = SupervisedFleet(SimpleNamespace(children=children))
    assert fleet.loading_models() == {"loading", "slow", "killed-once"}


def test_a_worker_that_dies_loading_is_not_waited_for_and_its_load_is_its_first_ready():
    """A worker crash-looping in its load (an OOM kill, a loader's segfault: not exit 78)
    started a new load window at each respawn: its model's queued requests waited for
    ever. And a live worker says READY again on each reconnection: its uptime became its
    measured load."""
    from dispatcher.supervisor import Child, Supervisor

    class Process:
        def __init__(self, code=None):
            self.pid, self.returncode = 7, code

        def poll(self):
            return self.returncode

        def send_signal(self, signum):
            pass
    supervisor = Supervisor()
    child = Child("w0", ["w"], {}, process=Process())
    supervisor.children["w0"] = child
    child.process.returncode = -9                        # (killed in its load)
    supervisor.poll()
    assert child.died_loading == 1 and child.process is None
    import time
    child.process, child.started_at, child.ready_at = Process(), time.monotonic() - 5, None
    supervisor.mark_healthy("w0")                        # (a later start that loaded)
    assert child.died_loading == 0 and child.load_seconds is not None
    first = child.load_seconds
    child.ready_at -= 3600                                # (an hour later, READY again)
    supervisor.mark_healthy("w0")
    assert child.load_seconds == first
    child.died_loading = 2
    supervisor.restart("w0")                              # (an operator's: a new try)
    assert child.died_loading == 0


def test_a_reload_keeps_the_id_given_to_the_model_and_refuses_one_served_otherwise(tmp_path):
    """`reload --model FILE` named the model after the file: a model served as `coder`
    became `coder-q8` (404s for every client). An id given stays; one that was the
    file's own name follows the new file's. An id another worker serves from another
    file is refused by the command (its process was refused at READY, and stayed failed,
    after the reload said ok)."""
    from types import SimpleNamespace

    from dispatcher.common.models import model_file_digest
    from dispatcher.operations import Operations
    new, other = tmp_path / "coder-q8.gguf", tmp_path / "other.gguf"
    new.write_bytes(b"GGUF" + b"new" * 100)
    other.write_bytes(b"GGUF" + b"old" * 100)
    restarted = []
    children = {name: SimpleNamespace(kind="worker", argv=["w", "--model", path,
                                                           "--model-id", served],
                                      extra={"model": served})
                for name, path, served in (("w0", "/m/coder-q4.gguf", "coder"),
                                           ("w2", "/m/gemma.gguf", "gemma"))}
    supervisor = SimpleNamespace(children=children,
                                 restart=lambda name, argv: restarted.append(argv))
    core = DispatcherCore()
    ops = Operations(core, supervisor)
    assert ops.restart({"worker": "w0", "model": str(new)})["model"] == "coder"
    assert ops.restart({"worker": "w2", "model": str(new)})["model"] == "coder-q8"
    ready(core, name=b"w1", model="coder", model_digest=model_file_digest(other),
          model_path=str(other))
    refused = ops.restart({"worker": "w0", "model": str(new)})
    assert "w1" in refused["error"] and "another file" in refused["error"]
    assert ops.restart({"worker": "w0", "model": str(other)})["model"] == "coder"
    # an id that is another model's alias: requests for it went to that model
    core.known_models["gemma"] = {"n_ctx": 0, "aliases": ["gpt"]}
    refused = ops.restart({"worker": "w2", "model": str(new), "model_id": "gpt"})
    assert "alias of the model 'gemma'" in refused["error"]
    assert "empty model id" in ops.restart({"worker": "w2", "model_id": " "})["error"]


def test_a_dispatch_pass_asks_once_for_the_choices_of_a_request_that_must_wait(monkeypatch):
    """64 requests of 128 choices queued, a free slot none of them may take (an idle
    worker of another model): each pass asked for a worker for all 8,192 choices (18 ms
    a message). Choices of one request wait alike: one question a request."""
    core = DispatcherCore(max_queue=64)
    ready(core, name=b"w0", slots=2, model="m")
    submit(core, "busy0", parent="busy0")
    submit(core, "busy1", parent="busy1")
    for r in range(4):
        for c in range(32):
            submit(core, f"r{r}.0.{c}", parent=f"r{r}", fanout=32)
    ready(core, name=b"w1", slots=2, model="other")
    asked = []
    real = core.registry.choose
    monkeypatch.setattr(core.registry, "choose", lambda job, only=None: (
        asked.append(job.parent), real(job, only))[1])
    core.dispatch()
    assert sorted(asked) == ["r0", "r1", "r2", "r3"] and len(core.queue) == 128
    from_worker(core, P.DONE, "busy0", attempt=1, last_seq=1)      # (a slot of w0 free)
    assert len(core.queue) == 127


def test_the_dispatcher_reads_a_sockets_messages_for_a_bounded_time(monkeypatch):
    """A burst of costly messages was read 1,000 at a time before the heartbeats and the
    tick: a pass past the heartbeats' expiry dropped every worker as silent. (A fake
    clock: each message takes 10 ms of it.)"""
    from types import SimpleNamespace

    from dispatcher import broker
    clock, handled = [100.0], []
    monkeypatch.setattr(broker, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    class Endless:
        def recv_multipart(self, flags, copy=True):
            return [b"x"]

    def handle(frames):
        handled.append(1)
        clock[0] += 0.01
    broker.Broker._read(SimpleNamespace(keys=None, backend=None), Endless(), handle)
    assert broker.READ_BUDGET / 0.01 - 2 <= len(handled) <= broker.READ_BUDGET / 0.01 + 2


def test_a_worker_an_operator_reloaded_never_stops_the_server_when_it_fails():
    """Every worker of a model failing at start-up stops `serve` (it must not pretend to
    serve it). A worker that failed at start, or was still loading, then reloaded to
    another model that fails too: that stopped the whole server, cutting the other
    workers' streams. An operated worker stays down as failed instead."""
    from types import SimpleNamespace

    from dispatcher.broker import Broker
    stopped = []
    child = lambda model, **k: SimpleNamespace(  # noqa: E731
        kind="worker", gave_up=True, ever_ready=False, extra={"model": model, **k})
    children = {"w0": child("good", operated=True), "w1": SimpleNamespace(
        kind="worker", gave_up=False, ever_ready=True, extra={"model": "other"})}
    broker = SimpleNamespace(supervisor=SimpleNamespace(children=children),
                             stop=lambda: stopped.append(1), exit_code=0)
    Broker._check_models_loadable(broker)
    assert not stopped
    children["w0"] = child("good")                      # (as at start-up)
    Broker._check_models_loadable(broker)
    assert stopped and broker.exit_code == 1


def test_a_keys_share_is_of_the_slots_that_take_its_work():
    """A key's share (3/4) was taken of every slot of the model: with one of two 8-slot
    workers drained for a rolling restart, one key took all 8 slots that still served;
    with a 2-slot `interactive` worker beside a 16-slot `batch` one, both interactive
    slots. And its turn counted its jobs on every model: a key busy on one model waited
    on another behind a second key's whole backlog."""
    from dispatcher.operations import Operations
    core = DispatcherCore(key_slot_share=0.75)
    ready(core, name=b"w0", slots=8)
    ready(core, name=b"w1", slots=8)
    Operations(core).handle({"cmd": "drain", "worker": "w1"})
    for i in range(10):
        submit(core, f"x{i}", parent=f"x{i}", api_key="kx")
    assert len(core.registry.workers[b"w0"].running) == 6
    assert ("REQUEST", "y0") in kinds(submit(core, "y0", parent="y0", api_key="ky"))
    core = DispatcherCore(key_slot_share=0.75)
    ready(core, name=b"wi", slots=2, profile="interactive")
    ready(core, name=b"wb", slots=16, profile="batch")
    for i in range(3):
        submit(core, f"x{i}", parent=f"x{i}", api_key="kx", route={"profile": "interactive"})
    assert len(core.registry.workers[b"wi"].running) == 1
    assert ("REQUEST", "y0") in kinds(submit(core, "y0", parent="y0", api_key="ky",
                                             route={"profile": "interactive"}))
    core = DispatcherCore(max_queue=64, key_slot_share=0.75)            # turns per model
    ready(core, name=b"wa", slots=4, model="A")
    ready(core, name=b"wb", slots=1, model="B")
    for i in range(3):
        submit(core, f"xa{i}", parent=f"xa{i}", api_key="kx", model="A")
    submit(core, "yb0", parent="yb0", api_key="ky", model="B")
    submit(core, "xb0", parent="xb0", api_key="kx", model="B", now=0.1)
    for i in range(1, 4):
        submit(core, f"yb{i}", parent=f"yb{i}", api_key="ky", model="B", now=0.2)
    order = []
    for _ in range(4):
        done = next(iter(core.registry.workers[b"wb"].running))
        sends = from_worker(core, P.DONE, done, name=b"wb", attempt=1, last_seq=1)
        order += [rid for cmd, rid in kinds(sends) if cmd == "REQUEST"]
    assert order == ["xb0", "yb1", "yb2", "yb3"]


def test_a_keys_jobs_on_other_workers_take_nothing_from_its_share_here():
    """Its share is of the slots that take a job (f0cce09), and so are the jobs counted
    against it: 12 of a key's jobs on a `batch` worker kept its first `interactive` one
    off an idle 2-slot worker."""
    core = DispatcherCore(key_slot_share=0.75, max_queue=64)
    ready(core, name=b"wi", slots=2, profile="interactive")
    ready(core, name=b"wb", slots=16, profile="batch")
    for i in range(12):
        submit(core, f"b{i}", parent=f"b{i}", api_key="kx", route={"profile": "batch"})
    sends = submit(core, "i0", parent="i0", api_key="kx", route={"profile": "interactive"})
    assert ("REQUEST", "i0") in kinds(sends)


def test_a_refused_keystroke_leaves_its_inferred_session_as_it_was():
    """A keystroke refused for a full queue changed its inferred session's text: its
    retry, the same text, matched nothing, started a session of its own and waited
    behind the stale request it should have ended."""
    core = DispatcherCore(max_queue=1)
    ready(core, slots=1)
    typed = "def f(x):\n    return " + "a" * 40
    submit(core, "t1", parent="t1", client="c1", prompt=typed, suffix="\n", session_order=1)
    submit(core, "other", parent="other", now=0.1)
    refused = submit(core, "t2", parent="t2", client="c1", prompt=typed + "b", suffix="\n",
                     session_order=2, now=0.2)
    assert refused[0].body.code == "queue_full"
    core.cancel("other")
    retry = submit(core, "t2b", parent="t2b", client="c1", prompt=typed + "b", suffix="\n",
                   session_order=3, now=1.2)
    assert ("FAILED", "t1") in kinds(retry) and ("CANCEL", "t1") in kinds(retry)


def test_reloads_not_done_yet_count_for_the_id_rule_and_the_file_check(tmp_path):
    """A second reload before the first has run kept the first's id with its own file
    (correcting a mistaken reload served the new file under the wrong name); a rename
    alone, and reloads waiting to run, escaped the check of one id, one file."""
    from types import SimpleNamespace

    from dispatcher.common.models import model_file_digest
    from dispatcher.operations import Operations
    q4, q8, wrong = (tmp_path / n for n in ("coder-q4.gguf", "coder-q8.gguf", "wrong.gguf"))
    for path, fill in ((q4, b"q4"), (q8, b"q8"), (wrong, b"ww")):
        path.write_bytes(b"GGUF" + fill * 200)

    def operations(core):
        children = {name: SimpleNamespace(kind="worker", extra={"model": "coder-q4"},
                                          argv=["w", "--model", str(q4), "--model-id",
                                                "coder-q4"]) for name in ("w0", "w1")}
        return Operations(core, SimpleNamespace(children=children,
                                                restart=lambda name, argv: None))
    ops = operations(DispatcherCore())
    assert ops.restart({"worker": "w0", "model": str(wrong)})["model"] == "wrong"
    assert ops.restart({"worker": "w0", "model": str(q8)})["model"] == "coder-q8"
    argv = ops.pending["w0"]["argv"]
    assert flag_value(argv, "--model-id") == "coder-q8"
    core = DispatcherCore()
    ops = operations(core)
    ready(core, name=b"w1", model="coder-q4", model_digest=model_file_digest(q4),
          model_path=str(q4))
    assert ops.restart({"worker": "w0", "model": str(wrong), "model_id": "x"})["ok"]
    assert "w1" in ops.restart({"worker": "w0", "model_id": "coder-q4"})["error"]
    assert ops.restart({"worker": "w1", "model": str(q8), "model_id": "coder"})["ok"]
    assert "w1" in ops.restart({"worker": "w0", "model": str(wrong),
                                "model_id": "coder"})["error"]


def test_the_file_check_sees_registered_pending_and_loading_workers_alike(tmp_path):
    """A worker's pending rename hid its registration (it still serves its id until it
    restarts), and a reloaded worker still loading was in neither list: a clashing
    reload said ok, and its process was refused when it registered."""
    from types import SimpleNamespace

    from dispatcher.common.models import model_file_digest
    from dispatcher.operations import Operations
    a, b, b2 = (tmp_path / n for n in ("a.gguf", "b.gguf", "b2.gguf"))
    for path, fill in ((a, b"a"), (b, b"b"), (b2, b"c")):
        path.write_bytes(b"GGUF" + fill * 300)
    core = DispatcherCore()
    children = {"A": SimpleNamespace(kind="worker", name="A", extra={"model": "m"},
                                     argv=["w", "--model", str(a), "--model-id", "m"],
                                     process=None, ready_at=None, gave_up=False),
                "B": SimpleNamespace(kind="worker", name="B", extra={"model": "x"},
                                     argv=["w", "--model", str(b), "--model-id", "x"],
                                     process=None, ready_at=None, gave_up=False)}
    ops = Operations(core, SimpleNamespace(children=children, restart=lambda n, argv: None))
    ready(core, name=b"A", model="m", model_digest=model_file_digest(a), model_path=str(a),
          slots=1)
    ready(core, name=b"B", model="x", model_digest=model_file_digest(b), model_path=str(b),
          slots=1)
    submit(core, "long", model="m")                          # (A busy: its rename waits)
    assert ops.restart({"worker": "A", "model_id": "n", "grace": 300})["ok"]
    assert "worker A" in ops.restart({"worker": "B", "model": str(b2), "model_id": "m",
                                      "grace": 300})["error"]
    core = DispatcherCore()                                  # A loading b2 as `y`
    ops = Operations(core, SimpleNamespace(children=children, restart=lambda n, argv: None))
    children["A"].argv = ["w", "--model", str(b2), "--model-id", "y"]
    children["A"].process = object()
    ready(core, name=b"B", model="x", model_digest=model_file_digest(b), model_path=str(b))
    assert "worker A" in ops.restart({"worker": "B", "model_id": "y"})["error"]
    children["A"].process, children["A"].respawn_at = None, 5.0   # crashed, coming back
    assert "worker A" in ops.restart({"worker": "B", "model_id": "y"})["error"]


def test_a_ping_learns_which_of_its_quiet_requests_the_dispatcher_holds_no_more():
    """A front end's quiet requests (accepted, nothing heard for a while): the STATE
    answering its PING names those neither queued nor on a worker, whose end was lost
    on the way (a FINISHED or FAILED dropped with the worker's last event); a running
    one, a queued one, a tokenize on a worker are held, a finished one is not."""
    core = DispatcherCore()
    ready(core, slots=1)
    submit(core, "over")
    submit(core, "running")
    submit(core, "queued")
    submit(core, "tok", op="tokenize", content="x")
    from_worker(core, P.DONE, "over", attempt=1, last_seq=1)   # "running" takes its slot
    quiet = ["running", "queued", "over", "tok", "never-known"]

    def answer(ping):
        (state,) = [s for s in core.frontend_message(FE, P.Message(P.PING, "", ping), 1.0)
                    if s.cmd == P.STATE]
        return state.body.unheld
    assert answer(P.Ping(quiet=quiet)) == ["over", "never-known"]
    assert answer(P.Ping()) == []                       # (asked nothing: told nothing)
    assert answer(P.Ping(quiet=[f"r{i}" for i in range(1000)])) == \
        [f"r{i}" for i in range(P.MAX_QUIET)]
    assert core.broadcast_state() is None and all(
        not s.body.unheld for s in core._take() if s.cmd == P.STATE)
