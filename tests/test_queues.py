"""Request queue, worker registry and routing rules (unit)."""
import time

import msgspec

from dispatcher.common import protocol as P
from dispatcher.common.fit import explain_unfit, fits
from dispatcher.queues import QueuedJob, RequestQueue, WorkerRegistry


def wire_job(rid="x", model="m", route=None, **extra):
    return P.SubmittedJob(id=rid, model=model, route=P.Route(**(route or {})), **extra,
                          generation=msgspec.Raw(b"{}"))


def job(rid, model="m", **extra):
    return QueuedJob(rid, b"fe-000000000000", wire_job(rid, model, **extra))


def info(model="m", **extra):
    return P.WorkerInfo(**{"model": model, "n_ctx": 4096, "compute": "cpu",
                           "n_gpu_layers": 0, "profile": None, "fim": False, "slots": 1,
                           **extra})


def test_queue_keeps_arrival_order_and_counts_per_model_and_profile():
    q = RequestQueue()
    for rid, model in [("a", "m1"), ("b", "m2"), ("c", "m1")]:
        q.push(job(rid, model))
    q.push(job("d", "m1", route={"profile": "batch"}))
    assert [j.request_id for j in q] == ["a", "b", "c", "d"]
    assert q.depth(("m1", None)) == 2 and q.depth(("m1", "batch")) == 1
    q.take(next(iter(q)))
    assert [j.request_id for j in q] == ["b", "c", "d"]
    assert q.depth_by_model() == {"m2": 1, "m1": 2}


def test_jobs_past_their_deadline_leave_the_queue():
    q = RequestQueue()
    late, fine = job("late"), job("fine")
    late.deadline, fine.deadline = 5.0, 50.0
    q.push(late)
    q.push(fine)
    assert [j.request_id for j in q.past_deadline(10.0)] == ["late"]
    assert [j.request_id for j in q] == ["fine"]


def test_choose_weighs_the_cached_prefix_against_load():
    r = WorkerRegistry()
    a = r.add(b"a", info(slots=4), 0.0)
    b = r.add(b"b", info(slots=4), 0.0)
    long, header = "x" * 1100, "y" * 300
    a.remember(job("old", prompt=long + " first"))
    a.remember(job("old2", prompt=header + " first"))
    assert r.choose(job("h", prompt=header + " second")) is a       # idle both: cache wins
    a.running["busy"] = job("busy")
    assert r.choose(job("new", prompt=long + " second")) is a       # worth one slot ahead
    assert r.choose(job("h", prompt=header + " second")) is b       # 300 chars: not worth it
    assert r.choose(job("other", prompt="unrelated")) is b          # least loaded
    assert r.choose(job("short", prompt="x" * 200 + "!")) is b      # prefix too short
    a.running["busy2"] = job("busy2")
    assert r.choose(job("new", prompt=long + " second")) is b       # two ahead: load wins
    a.draining = True
    assert r.choose(job("new", prompt=long + " second")) is b       # a takes no work
    assert r.choose(job("m2", "other-model")) is None


def test_an_infill_is_drawn_to_the_worker_holding_its_ring_of_chunks():
    """llama.vim's /infill puts its ring of chunks first in the prompt, the same in its
    warm-ups and completions: routing saw only the prefix and suffix, so a warm-up (both
    empty) went to the least recently used worker, not the one its completions use."""
    ring = [{"filename": f"f{i}.py", "text": "def f():\n    return 1\n" * 20}
            for i in range(4)]
    r = WorkerRegistry()
    a = r.add(b"a", info(slots=4, fim=True), 0.0)
    b = r.add(b"b", info(slots=4, fim=True), 0.0)
    warm = job("warm", prompt=[""], suffix="", infill=P.Infill(extra=ring, middle=""))
    a.remember(warm)
    b.last_assigned = -1.0                              # (b: the least recently used)
    typed = job("typed", prompt=["def area(r):\n    "], suffix="\n",
                infill=P.Infill(extra=ring, middle="ret"))
    assert r.choose(typed) is a
    other = job("other", prompt=["x"], suffix="", infill=P.Infill(extra=[], middle=""))
    assert r.choose(other) is b


def test_a_key_sending_many_prompts_forgets_its_own_in_routings_view():
    """A worker's recent prompts (2 × slots) as routing sees them: a key sending many
    pushed another key's out while its cache was still in the worker, and that key's
    next keystroke went elsewhere, prefilled from scratch. Past the bound the tenant
    with the most forgets its oldest; with one tenant, the oldest goes, as before."""
    r = WorkerRegistry()
    a = r.add(b"a", info(slots=2), 0.0)
    text = "def area(r):\n    return 3.14159 * r * r\n" * 8
    mine = job("mine", prompt=[text], tenant="kv")
    a.remember(mine)
    for i in range(20):
        a.remember(job(f"f{i}", prompt=[f"{i} " + "x" * 400], tenant="kf"))
    assert a.cached_prefix(job("next", prompt=[text + "  "], tenant="kv").blocks) > 0
    assert len(a.recent) == 4 and sum(1 for t, _ in a.recent if t == "kv") == 1
    alone = r.add(b"b", info(slots=2), 0.0)
    for i in range(5):
        alone.remember(job(f"s{i}", prompt=[f"{i} " + "y" * 400]))
    assert alone.cached_prefix(job("s0", prompt=["0 " + "y" * 400]).blocks) == 0
    assert alone.cached_prefix(job("s4", prompt=["4 " + "y" * 400]).blocks) > 0


def test_a_request_counts_once_in_the_queue_and_cannot_starve_others():
    q = RequestQueue()
    for c in range(5):
        q.push(job(f"big.0.{c}", parent="big"))
    q.push(job("small"))
    assert q.depth(("m", None)) == 2                 # two requests, six jobs
    order = [j.request_id for j in q.in_fair_order({"big": 3})]
    assert order[0] == "small"                       # fewest running jobs first
    assert order[1:] == [f"big.0.{c}" for c in range(5)]   # then oldest first


def test_a_job_only_goes_to_workers_that_fit_it():
    r = WorkerRegistry()
    r.add(b"small", info(), 0.0)
    big = r.add(b"big", info(n_ctx=16384), 0.0)
    assert r.choose(job("j", route={"n_ctx": 8192})) is big


def test_requeued_job_goes_first():
    q = RequestQueue()
    q.push(job("a"))
    q.push(job("b"), front=True)
    assert next(iter(q)).request_id == "b"


def test_remove_is_idempotent():
    q = RequestQueue()
    q.push(job("a"))
    assert q.remove("a").request_id == "a"
    assert q.remove("a") is None


def test_expire_jobs_no_worker_has_fitted_for_the_timeout():
    """Counted from when no worker could run the job, not from when it was queued: a job
    requeued when its model's last worker went (queued long before) waits its while."""
    q = RequestQueue()
    first, later, served = job("first", "gone"), job("later", "gone"), job("served")
    for j in (first, served):
        j.enqueued_at = 0.0
        q.push(j)
    assert q.expire(100.0, 10.0, [info()]) == []          # no worker for "gone" from now
    q.push(later)
    assert q.expire(109.0, 10.0, [info()]) == []
    assert [j.request_id for j in q.expire(110.0, 10.0, [info()])] == ["first"]
    assert [j.request_id for j in q.expire(120.0, 10.0, [info()])] == ["later"]
    assert [j.request_id for j in q] == ["served"]
    back = job("back", "gone")
    q.push(back)
    q.expire(200.0, 10.0, [info()])
    q.expire(205.0, 10.0, [info(), info(model="gone")])   # a worker of its model came
    assert q.expire(211.0, 10.0, [info()]) == []          # ... and went: counted afresh


def test_registry_orders_by_free_slots_then_least_recently_used():
    r = WorkerRegistry()
    a = r.add(b"a", info(slots=2), 0.0)
    b = r.add(b"b", info(slots=2), 0.0)
    a.last_assigned, b.last_assigned = 5.0, 1.0
    assert r.with_free_slots() == [b, a]
    b.running["x"] = job("x")
    assert r.with_free_slots() == [a, b]
    a.running["y"], a.running["z"], b.running["w"] = job("y"), job("z"), job("w")
    assert r.with_free_slots() == []


def test_pick_for_slotless_work_takes_the_least_busy_fitting_worker():
    r = WorkerRegistry()
    a = r.add(b"a", info(), 0.0)
    r.add(b"b", info("other"), 0.0)
    a.running["x"] = job("x")
    assert r.pick(wire_job()) is a                         # busy, but the only fit
    c = r.add(b"c", info(), 0.0)
    assert r.pick(wire_job()) is c
    assert r.pick(wire_job(model="none")) is None


def test_registry_expiry_and_models_summary():
    r = WorkerRegistry()
    r.add(b"a", info(slots=1, n_ctx=2048), now=0.0)
    r.add(b"b", info(slots=3, fim=True), now=100.0)
    assert [w.name for w in r.expired(50.0)] == ["a"]
    assert r.models() == {"m": {"ready": 2, "n_ctx": 4096, "slots": 4, "fim": True}}


def test_routing_requirements():
    gpu = info(compute="gpu", n_gpu_layers=999, profile="fast", n_ctx=8192, fim=True)
    cpu = info()
    assert fits("m", P.Route(n_ctx=8192), gpu)
    assert not fits("m", P.Route(n_ctx=8192), cpu)
    assert fits("m", P.Route(compute="cpu"), cpu)
    assert not fits("m", P.Route(compute="cpu"), gpu)
    assert fits("m", P.Route(n_gpu_layers=0), cpu)
    assert not fits("m", P.Route(n_gpu_layers=0), gpu)
    assert fits("m", P.Route(n_gpu_layers=20), gpu)
    assert fits("m", P.Route(profile="fast"), gpu)
    assert not fits("m", P.Route(profile="fast"), cpu)
    assert fits("m", P.Route(fim=True), gpu)                # a suffix
    assert not fits("m", P.Route(fim=True), cpu)
    assert not fits("other", P.Route(), cpu)


def test_unfit_requests_are_explained_with_what_is_available():
    workers = [info(n_ctx=2048), info(n_ctx=4096, profile="fast")]
    param, code, message = explain_unfit("m", P.Route(n_ctx=9000), workers)
    assert (param, code) == ("nctx", "context_length_unavailable")
    assert "2048" in message and "4096" in message
    param, code, message = explain_unfit("m", P.Route(compute="npu"), workers)
    assert code == "compute_unavailable" and "cpu" in message
    param, code, message = explain_unfit("m", P.Route(profile="slow"), workers)
    assert param == "X-SIE-MACHINE-PROFILE" and "fast" in message
    param, code, _ = explain_unfit("m", P.Route(fim=True), workers)
    assert (param, code) == ("suffix", "fim_unsupported")
    # two requirements, each met by some worker, both by none: said so (the message
    # named one and listed values that met it: "no context of 8192; available 8192")
    workers = [info(n_ctx=8192), info(n_ctx=4096, compute="gpu")]
    param, code, message = explain_unfit("m", P.Route(n_ctx=8192, compute="gpu"), workers)
    assert (param, code) == ("nctx", "route_unavailable")
    assert "nctx, compute at once" in message and "nctx 4096, compute gpu" in message
    # one met by none alone is the one named
    param, code, _ = explain_unfit("m", P.Route(n_ctx=9000, compute="gpu"), workers)
    assert (param, code) == ("nctx", "context_length_unavailable")
    # a large fleet: each kind of worker once, and at most a few of them
    fleet = [info(n_ctx=8192)] * 30 + [info(n_ctx=512 * k, compute="gpu") for k in range(1, 12)]
    _, code, message = explain_unfit("m", P.Route(n_ctx=8192, compute="gpu"), fleet)
    assert code == "route_unavailable" and message.endswith("; and 4 more")
    assert len(message) < 500


def test_a_tenant_is_drawn_only_to_the_cache_of_its_own_prompts():
    r = WorkerRegistry()
    a = r.add(b"a", info(slots=4), 0.0)
    b = r.add(b"b", info(slots=4), 0.0)
    text = "x" * 2000
    a.remember(job("old", prompt=text, tenant="key-1"))
    b.last_assigned = -1.0                                # b first when nothing else counts
    assert r.choose(job("same", prompt=text + "!", tenant="key-1")) is a
    assert r.choose(job("other", prompt=text + "!", tenant="key-2")) is b


def test_one_model_id_is_one_model_file():
    """A worker registering another file under a served id is refused; the same file,
    another id, the worker itself re-registering, or a worker that says no digest
    (an older one) are not."""
    r = WorkerRegistry()
    r.add(b"a", P.WorkerInfo(model="code", model_path="/m/a.gguf", model_digest="aaaa"), 0.0)
    refusal = r.refusal(b"b", P.WorkerInfo(model="code", model_path="/m/b.gguf",
                                           model_digest="bbbb"))
    assert refusal.startswith("its model file /m/b.gguf differs from /m/a.gguf that worker")
    assert r.refusal(b"b", P.WorkerInfo(model="code", model_path="/n/a.gguf",
                                        model_digest="aaaa")) is None
    assert r.refusal(b"b", P.WorkerInfo(model="other", model_digest="bbbb")) is None
    assert r.refusal(b"a", P.WorkerInfo(model="code", model_digest="bbbb")) is None
    assert r.refusal(b"b", P.WorkerInfo(model="code")) is None


def assign(registry, jobs: int) -> list[str]:
    """Route `jobs` distinct prompts one after another, none finishing: who took each."""
    taken = []
    for i in range(jobs):
        j = job(f"j{i}", prompt=f"prompt {i}")
        worker = registry.choose(j)
        if worker is None:
            break
        worker.running[j.request_id] = j
        worker.last_assigned = i + 1
        taken.append(worker.name)
    return taken


def test_workers_on_unlike_devices_get_work_by_their_measured_speed():
    """A GPU worker whose sequences run at 300 tok/s falling to 150 at 16, and a CPU
    worker at 30 falling to 8: every job goes to the GPU until its slots are full, then
    the CPU takes what is left, where an equal share would have sent the CPU every
    other one. Two GPUs of one kind alternate (within 10%: load decides)."""
    gpu_rates = [300.0 - 10 * n for n in range(16)]
    r = WorkerRegistry()
    r.add(b"gpu", info(slots=16, rates=gpu_rates, compute="gpu"), 0.0)
    r.add(b"cpu", info(slots=4, rates=[30.0, 20.0, 12.0, 8.0]), 0.0)
    assert assign(r, 20) == ["gpu"] * 16 + ["cpu"] * 4
    twins = WorkerRegistry()
    twins.add(b"g0", info(slots=16, rates=gpu_rates, compute="gpu"), 0.0)
    twins.add(b"g1", info(slots=16, rates=[0.7 * x for x in gpu_rates], compute="gpu"), 0.0)
    assert assign(twins, 6) == ["g0", "g1"] * 3
    older = WorkerRegistry()          # a card a third as fast: it takes work once the
    older.add(b"new", info(slots=4, rates=[300.0, 200.0, 120.0, 90.0], compute="gpu"),
              0.0)                    # newer one's sequences would run about as fast
    older.add(b"old", info(slots=4, rates=[100.0, 90.0, 80.0, 70.0], compute="gpu"), 0.0)
    assert assign(older, 8) == ["new"] * 3 + ["old", "old", "new", "old", "old"]


def test_a_cpus_uneven_costs_do_not_pile_work_onto_the_busier_worker():
    """On this CPU 8 sequences cost less a step than 5-7, so the rate with 8 is higher
    than with 6: counted as measured, a worker at 7 would look faster than one at 5.
    A busier worker never counts as faster, and CPU workers are alike however their
    start-up figures differ (measured on a busy shared CPU: here one of them 3 times
    slower): two such workers share alike, as before."""
    from workers.engine.stepcosts import StepCosts
    rates = StepCosts.assumed().rates(8)
    assert rates[7] > rates[5]                            # the uneven costs
    r = WorkerRegistry()
    r.add(b"a", info(slots=8, rates=rates), 0.0)
    r.add(b"b", info(slots=8, rates=[x / 3 for x in rates]), 0.0)
    taken = assign(r, 16)
    assert taken.count("a") == taken.count("b") == 8
    assert all(taken[i] != taken[i + 1] for i in range(0, 16, 2))


def test_workers_without_measured_rates_share_by_load_as_before():
    r = WorkerRegistry()
    r.add(b"a", info(slots=4), 0.0)
    r.add(b"b", info(slots=4, rates=[100.0] * 4), 0.0)     # one measured, one not
    assert sorted(assign(r, 8)) == ["a"] * 4 + ["b"] * 4


def test_a_worker_registers_the_rates_of_the_step_costs_it_measured(tmp_path):
    """READY carries each sequence's tokens a second at 1..slots sequences, from the
    step costs the worker measured on its device (none measured: none sent)."""
    from types import SimpleNamespace
    from dispatcher.common.devices import parse_device
    from workers.engine.stepcosts import StepCosts
    from workers.pinning import Placement
    from workers.worker import worker_info
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    engine = SimpleNamespace(n_layer=4, n_ctx=1024, n_slots=8, fingerprint="fp", name="llama",
                             layers_offloaded=0, layers_total=5,
                             step_costs=StepCosts.assumed())
    placement = Placement("cpu", "cpu", (0,), 1, 0, {})
    ready = worker_info(engine, parse_device("cpu"), placement, "m", model, False, False)
    assert ready.rates == StepCosts.assumed().rates(8) and ready.rates[0] == 77.52
    engine.step_costs = None
    assert worker_info(engine, parse_device("cpu"), placement, "m", model, False,
                       False).rates == []


def test_a_slower_workers_cache_does_not_draw_work_from_a_faster_one():
    """A session's file is cached on the CPU worker; the GPU worker is idle and far
    faster: the next keystroke goes to the GPU. Between equals the cache still wins."""
    r = WorkerRegistry()
    gpu = r.add(b"gpu", info(slots=16, rates=[300.0] * 16, compute="gpu"), 0.0)
    cpu = r.add(b"cpu", info(slots=4, rates=[30.0] * 4), 0.0)
    long = "x" * 2000
    cpu.remember(job("old", prompt=long + " first"))
    assert r.choose(job("next", prompt=long + " second")) is gpu
    cpu.info.rates = [300.0] * 4
    assert r.choose(job("next", prompt=long + " second")) is cpu


def test_a_typing_session_stays_on_the_worker_that_got_its_last_keystroke():
    """Each keystroke's prompt is the last one's and a character more: two workers hold
    as many whole blocks of it once one keystroke went elsewhere (its worker was busy),
    and the tie went to the least recently used, the one holding the keystroke before
    last: the session went back and forth for ever, prefilling two keystrokes' text."""
    r = WorkerRegistry()
    a = r.add(b"a", info(slots=1), 0.0)
    b = r.add(b"b", info(slots=1), 0.0)
    prompt = "def f(x):\n    return x\n" * 60 + "pri"

    def keystroke(name):
        queued = job(name, prompt=prompt)
        worker = r.choose(queued)
        worker.last_assigned = time.monotonic()
        worker.remember(queued)
        return worker.identity
    assert keystroke("k0") == b"a"
    a.running["other"] = job("other", prompt="unrelated " * 50)    # a busy a moment
    prompt += "n"
    assert keystroke("k1") == b"b"
    del a.running["other"]
    went = []
    for i, typed in enumerate("t(x)\nprint(y)\n"):
        prompt += typed
        went.append(keystroke(f"k{i + 2}"))
    assert set(went) == {b"b"}, went


def test_a_prefix_every_worker_holds_still_spreads_the_work():
    """Recency breaks ties of share only after the load: with a long header every worker
    holds, requests that differ after it went all to the worker given one last."""
    r = WorkerRegistry()
    a = r.add(b"a", info(slots=4), 0.0)
    b = r.add(b"b", info(slots=4), 0.0)
    line = "# Copyright the authors. Licensed under the terms below.\n"
    header = (line.rstrip("\n").ljust(63) + "\n") * 100        # (whole 64-char blocks)
    for worker in (a, b):
        worker.remember(job(f"warm-{worker.identity.decode()}", prompt=header + "x = 1\n"))
    went = []
    for i in range(6):
        queued = job(f"r{i}", prompt=header + f"def f{i}(): pass\n")
        worker = r.choose(queued)
        worker.running[queued.request_id] = queued
        worker.last_assigned = time.monotonic()
        worker.remember(queued)
        went.append(worker.identity)
    assert went.count(b"a") == went.count(b"b") == 3, went
