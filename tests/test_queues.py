"""Request queue and worker registry (unit)."""
from dispatcher.queues import Job, RequestQueue, WorkerRegistry


def job(rid, model="m"):
    return Job(rid, b"fe-000000000000", {"model": model})


def test_queue_is_fifo_per_model():
    q = RequestQueue()
    for rid, model in [("a", "m1"), ("b", "m2"), ("c", "m1")]:
        q.push(job(rid, model))
    assert q.take_for("m1").request_id == "a"
    assert q.take_for("m1").request_id == "c"
    assert q.take_for("m1") is None
    assert q.depth_by_model() == {"m2": 1}


def test_requeued_job_goes_first():
    q = RequestQueue()
    q.push(job("a"))
    q.push(job("b"), front=True)
    assert q.take_for("m").request_id == "b"


def test_remove_is_idempotent():
    q = RequestQueue()
    q.push(job("a"))
    assert q.remove("a").request_id == "a"
    assert q.remove("a") is None


def test_expire_only_old_jobs_of_given_models():
    q = RequestQueue()
    old, new, other = job("old"), job("new"), job("other", "m2")
    old.enqueued_at, other.enqueued_at = 0.0, 0.0
    for j in (old, new, other):
        q.push(j)
    assert [j.request_id for j in q.expire(10.0, {"m"})] == ["old"]
    assert len(q) == 2


def test_registry_picks_most_free_slots_then_least_recently_used():
    r = WorkerRegistry()
    a = r.add(b"a", {"model": "m", "slots": 2}, 0.0)
    b = r.add(b"b", {"model": "m", "slots": 2}, 0.0)
    r.add(b"c", {"model": "other", "slots": 4}, 0.0)
    a.last_assigned, b.last_assigned = 5.0, 1.0
    assert r.pick("m") is b
    b.running["x"] = job("x")
    assert r.pick("m") is a
    a.running["y"] = job("y")              # both have one free slot: b was used last now
    a.last_assigned, b.last_assigned = 1.0, 5.0
    assert r.pick("m") is a
    a.running["w"], b.running["z"] = job("w"), job("z")
    assert r.pick("m") is None
    assert r.pick("nope") is None


def test_registry_expiry_and_models_summary():
    r = WorkerRegistry()
    r.add(b"a", {"model": "m", "slots": 1, "n_ctx": 2048}, now=0.0)
    r.add(b"b", {"model": "m", "slots": 3, "n_ctx": 4096}, now=100.0)
    assert [w.name for w in r.expired(50.0)] == ["a"]
    assert r.models() == {"m": {"ready": 2, "n_ctx": 4096, "slots": 4}}
