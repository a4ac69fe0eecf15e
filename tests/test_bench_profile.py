"""`bench --profile`: the step counters exported on /metrics, read back and turned into
figures per step (the exporter and the parser are the real ones; the counters given)."""
from prometheus_client import CollectorRegistry, generate_latest

from app.metrics import SnapshotCollector
from dispatcher.tools.bench_profile import parse_totals, profile_row, markdown_table


def exported(steps: dict | None) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector({"workers": [
        {"worker": "w0-cpu", "device": "cpu", "model": "m", "up": 1, "slots": 8,
         "busy": 0, "restarts": 0, "steps": steps},
        {"worker": "w1-cpu", "device": "cpu", "model": "m", "up": 1, "slots": 8,
         "busy": 0, "restarts": 0, "steps": steps}]}))
    return generate_latest(registry).decode()


def totals(**kw) -> dict:
    base = dict(steps=0, token_rows=0, draft_rows=0, prompt_rows=0, batches=0, sat_out=0,
                accepted=0, plan_seconds=0.0, decode_seconds=0.0, sample_seconds=0.0)
    return {**base, **kw}


def test_the_profile_is_the_difference_per_step_summed_over_workers():
    before = parse_totals(exported(totals(steps=10, token_rows=10, decode_seconds=1.0)))
    after = parse_totals(exported(totals(
        steps=60, token_rows=410, draft_rows=100, prompt_rows=500, batches=75, sat_out=25,
        accepted=40, plan_seconds=0.05, decode_seconds=5.0, sample_seconds=0.1,
        sources={"copy": [80, 38], "recycled": [20, 2]})))
    assert set(after) == {("w0-cpu", "cpu"), ("w1-cpu", "cpu")}      # two workers
    assert after["w0-cpu", "cpu"]["steps"] == 60
    row = profile_row("t", "x8", before, after)
    assert row["steps"] == 100
    assert row["token rows/step"] == 8.0 and row["draft rows/step"] == 2.0
    assert row["accepted %"] == 40.0 and row["prompt rows/step"] == 10.0
    assert row["batches/step"] == 1.5 and row["sat out/step"] == 0.5
    assert row["tokens/step"] == 8.8                    # a token per row, the drafts kept
    assert row["plan ms"] == 1.0 and row["decode ms"] == 80.0 and row["sample ms"] == 2.0
    assert row["decode ms/row"] == round(8000 / 2000, 2)
    assert row["drafts by source (accepted/drafted)"] == "copy 76/160 recycled 4/40"
    assert "| decode ms |" in markdown_table([row])


def test_a_worker_restarted_during_a_part_counts_from_zero():
    from dispatcher.tools.bench_profile import difference
    before = {("w0", "cpu"): totals(steps=500, token_rows=4000),
              ("w1", "cpu"): totals(steps=100, token_rows=800)}
    after = {("w0", "cpu"): totals(steps=20, token_rows=160),        # restarted
             ("w1", "cpu"): totals(steps=150, token_rows=1200)}
    d = difference(before, after)
    assert d["steps"] == 70 and d["token_rows"] == 560
    assert difference(before, {("w1", "cpu"): after["w1", "cpu"]})["steps"] == 50  # one gone


def test_a_server_without_step_counters_has_no_profile():
    assert parse_totals(exported(None)) == {}
    assert parse_totals("not prometheus {{{") is None
    assert profile_row("t", "x8", None, {"steps": 3}) is None
    assert profile_row("t", "x8", {}, {}) is None


def test_a_fresh_servers_first_part_is_profiled_from_zero():
    """Before a fresh worker's first heartbeat its counters are not exported yet: the
    first part of the bench counts them from zero (it was once left without a profile). Two workers, 40 steps each."""
    after = parse_totals(exported(totals(steps=40, token_rows=40, decode_seconds=0.4)))
    row = profile_row("t", "x1", parse_totals(exported(None)), after)
    assert row is not None and row["steps"] == 80 and row["decode ms"] == 10.0
    same = {("w0", "cpu"): totals(steps=5)}
    assert profile_row("t", "x1", same, same) is None             # no step in the part


class MetricsTarget:
    """A target whose /metrics is the exporter's text of the next snapshot each read."""

    def __init__(self, snapshots):
        self.snapshots, self.reads = list(snapshots), 0

    def get_root(self, path):
        self.reads += 1
        workers = self.snapshots[min(self.reads, len(self.snapshots)) - 1]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector({"workers": workers}))
        return 200, generate_latest(registry)


def worker(beats, steps, name="w0-cpu"):
    return {"worker": name, "device": "cpu", "model": "m", "up": 1, "slots": 8, "busy": 0,
            "restarts": 0, "steps": totals(steps=steps), "heartbeats": beats}


def test_the_profile_is_read_once_every_worker_has_sent_two_heartbeats_since():
    from dispatcher.tools.bench_profile import settled
    # w0 beats every read and w1 every other one; the last steps arrive with w0's first
    target = MetricsTarget([[worker(10, 50), worker(4, 7, "w1-cpu")],
                            [worker(11, 60), worker(4, 7, "w1-cpu")],
                            [worker(12, 60), worker(5, 7, "w1-cpu")],
                            [worker(13, 60), worker(5, 7, "w1-cpu")],
                            [worker(14, 60), worker(6, 9, "w1-cpu")],
                            [worker(15, 60), worker(6, 9, "w1-cpu")]])
    found = settled(target, settle=60.0, poll=0.0)
    assert target.reads == 5
    assert found["w0-cpu", "cpu"]["steps"] == 60 and found["w1-cpu", "cpu"]["steps"] == 9


def test_without_heartbeat_counts_the_profile_waits_for_the_steps_to_stop():
    from dispatcher.tools.bench_profile import settled
    plain = [dict(worker(0, n), heartbeats=None) for n in (50, 55, 60, 60, 60)]
    target = MetricsTarget([[w] for w in plain])
    assert "heartbeats" not in parse_totals(target.get_root("/metrics")[1].decode())[
        "w0-cpu", "cpu"]
    found = settled(target, settle=0.0)
    assert found["w0-cpu", "cpu"]["steps"] == 60 and target.reads == 4


def test_a_restarted_worker_or_one_gone_is_not_waited_for_in_vain():
    from dispatcher.tools.bench_profile import heartbeats_since
    start = {("w0", "cpu"): totals(steps=500, heartbeats=40),
             ("w1", "cpu"): totals(steps=80, heartbeats=30)}
    # w0 restarted (its counts began again), w1 gone, w2 came up during the part
    assert not heartbeats_since(start, {("w0", "cpu"): totals(steps=3, heartbeats=1)})
    assert heartbeats_since(start, {("w0", "cpu"): totals(steps=3, heartbeats=2)})
    assert not heartbeats_since(start, {("w0", "cpu"): totals(steps=510, heartbeats=41),
                                        ("w2", "cpu"): totals(steps=9, heartbeats=5)})
    assert heartbeats_since(start, {("w0", "cpu"): totals(steps=510, heartbeats=42),
                                    ("w2", "cpu"): totals(steps=9, heartbeats=2)})
    assert not heartbeats_since(start, {("w0", "cpu"): totals(steps=510, heartbeats=42),
                                        ("w2", "cpu"): totals(steps=9, heartbeats=1)})
