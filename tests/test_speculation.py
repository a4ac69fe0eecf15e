"""The drafter's sources (workers/engine/speculation.py) and the step costs and per-step
plan (workers/engine/stepcosts.py), as units: token lists stand in for a sequence's
context, and step costs are given tables."""
import pytest

from workers.engine.speculation import (CALIBRATION_MAX, LONG_KEY, Calibration, Drafter,
                                       Proposal, find_draft, matched)
from workers.engine.stepcosts import EACH, SHAPES_EXTRA, StepCosts, each_plan, plan

# an "edit": the same block again with one token changed (a number), as a token list
BLOCK = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]


def block(number: int) -> list[int]:
    return [1, 2, 3, 100 + number] + BLOCK + [4, 5, 100 + number, 6, 7, 8, 9]


def drive(drafter: Drafter, context: list[int], truth: list[int], limit: int = 16):
    """Draft against `truth` (what the model writes next), accepting as verification
    would, for as many steps as the truth lasts; returns (steps, drafted, accepted)."""
    steps = drafted = accepted = 0
    context = list(context)
    i = 0
    while i < len(truth):
        steps += 1
        proposal = drafter.propose(context, limit)
        if proposal is None:
            context.append(truth[i])
            i += 1
            continue
        drafter.started(proposal, len(context))
        draft = proposal.tokens
        k = 0
        while k < len(draft) and i + k < len(truth) and draft[k] == truth[i + k]:
            k += 1
        drafter.record(len(draft), k)
        drafted += len(draft)
        accepted += k
        take = min(k + 1, len(truth) - i)        # the accepted run and the model's token
        context += truth[i:i + take]
        i += take
    return steps, drafted, accepted


def test_a_copy_goes_on_past_a_changed_number():
    """The prompt holds blocks 1..3; the model writes block 4. A lookup guesses block 3's
    number; after the model's own number the copy goes on at the same distance (a
    substitution), so the rest of the block comes in drafts, not a token a step."""
    context = block(1) + block(2) + block(3) + [1, 2, 3]
    truth = block(4)[3:]
    steps, drafted, accepted = drive(Drafter(16), context, truth)
    assert accepted >= len(truth) - 4 and steps <= 5


def test_a_copy_past_a_mismatch_is_rated_on_its_own_and_pays_only_where_rows_are_cheap():
    """The model writes block 4 where the lookups guess block 3's number: past that
    mismatch the copy goes on at the same distance as `resume`, rated by its own record
    (a prior of 1 kept in 3: on first-seen edits the model had mostly left the copy),
    not by the copy's that held (9 in 10). On a CPU-like table such a guess does not
    pay; on a GPU-like one it does, and once it holds the copy is `copy` again."""
    context = block(1) + block(2) + block(3) + [1, 2, 3]
    drafter = Drafter(16)
    first = drafter.propose(context, 16)
    assert first.tokens[0] == 103                       # block 3's number
    drafter.started(first, len(context))
    drafter.record(len(first.tokens), 0)                # the model wrote 104
    context.append(104)
    resumed = drafter.propose(context, 16)
    assert resumed.source == "resume" and resumed.tokens[:4] == BLOCK[:4]
    assert resumed.rate < 0.5
    cpu = StepCosts((1, 2, 8), StepCosts.assumed().table)
    gpu = StepCosts((1, 2), {(s, d): 10.0 + s + 0.05 * d for s in (1, 2)
                             for d in SHAPES_EXTRA})
    assert plan(cpu, 1, [(0, resumed)]) == {}
    assert plan(gpu, 1, [(0, resumed)]).get(0, 0) >= 1
    drafter.started(resumed, len(context))
    drafter.record(8, 8)                                # it held
    context += resumed.tokens[:8] + [BLOCK[8]]
    assert drafter.propose(context, 16).source == "copy"


def test_the_long_key_finds_the_newest_occurrence():
    old = list(range(200, 200 + LONG_KEY)) + [1, 1, 1, 1, 1, 1]
    new = list(range(200, 200 + LONG_KEY)) + [2, 2, 2, 2, 2, 2]
    context = old + [9] * 5 + new + [9] * 5 + list(range(200, 200 + LONG_KEY))
    drafter = Drafter(16)
    assert drafter._long(context) == len(old) + 5 + LONG_KEY     # the newer copy's text
    context += [2, 2, 2, 2, 2, 2, 9, 9, 9, 9, 9] + list(range(200, 200 + LONG_KEY))
    assert drafter._long(context) == len(context) - LONG_KEY - 11  # kept up to date


def test_matched_counts_how_far_back_a_match_reaches():
    context = [5, 1, 2, 3, 9, 7, 1, 2, 3]
    assert matched(context, 4) == 3 and matched(context, 1) == 0


def test_misses_lower_a_source_stop_it_below_the_floor_and_fade_back():
    drafter = Drafter(16)
    context = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2, 3, 4]
    first = drafter.propose(context, 16)
    assert first is not None
    drafter.started(first, len(context))
    drafter.record(len(first.tokens), 0)
    low = drafter.propose(context, 16)
    assert low.rate < first.rate
    for _ in range(3):
        drafter.started(low, len(context))
        drafter.record(len(low.tokens), 0)
    assert drafter.propose(context, 16) is None      # 64 tried, none kept: below the floor
    for _ in range(200):
        drafter.propose(context, 16)
    again = drafter.propose(context, 16)            # the misses faded
    assert again is not None and again.rate > low.rate


def test_a_source_that_keeps_a_quarter_of_its_tokens_stays():
    drafter = Drafter(16)
    context = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2, 3, 4]
    for _ in range(8):
        proposal = drafter.propose(context, 16)
        assert proposal is not None
        drafter.started(proposal, len(context))
        drafter.record(8, 2)                        # a quarter kept
    assert not drafter.records[proposal.source].below_floor()


def test_calibration_scales_a_sources_gains_by_what_verification_kept():
    """A lookup whose long match promised much and whose drafts were refused: its gains
    shrink for every sequence of the engine (so `plan` drafts it shorter or not at all);
    a source that kept what it promised is unchanged, and none is scaled up past the
    cap."""
    calibration = Calibration()
    context = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2, 3, 4]
    first = Drafter(16, calibration=calibration).propose(context, 16)
    assert first.scale == 1.0
    for _ in range(10):
        drafter = Drafter(16, calibration=calibration)    # other sequences
        proposal = drafter.propose(context, 16)
        drafter.started(proposal, len(context))
        drafter.record(len(proposal.tokens), 1)
    later = Drafter(16, calibration=calibration).propose(context, 16)
    assert later.source == first.source
    assert later.gain(16) < 0.4 * first.gain(16)
    assert later.expected(16) == first.expected(16)      # its own rate is as it was
    calibration.add("copy", 10.0, 10.0)
    assert calibration.factor("copy") == 1.0
    calibration.add("copy", 0.0, 1000.0)
    assert calibration.factor("copy") == CALIBRATION_MAX
    shut = later.source                  # steps fade it back: it is measured again
    for _ in range(2000):
        calibration.step()
    assert calibration.factor(shut) > 0.95


def sure(n: int = 16) -> Proposal:
    return Proposal("copy", 0, list(range(n)), 0.97)


def test_plan_drafts_alone_on_a_cpu_but_not_beside_seven_others():
    cpu = StepCosts.assumed()
    assert plan(cpu, 1, [("a", sure())]) == {"a": 15}      # 16 outputs: cheaper than 17
    likely = Proposal("long", 0, list(range(16)), 0.8)
    assert plan(cpu, 1, [("a", likely)])
    assert plan(cpu, 8, [(i, likely) for i in range(8)]) == {}


def test_plan_chooses_the_draft_lengths_that_cost_least():
    """On the CPU's measured costs one sequence's 7 draft rows (8 outputs) cost less than
    4 or 8 (5 or 9 outputs): a sure 10-token proposal drafts 7; where rows cost by their
    number (a GPU), all 10."""
    cpu = StepCosts.assumed()
    assert cpu.cost(1, 7) < cpu.cost(1, 4) < cpu.cost(1, 8)
    assert plan(cpu, 1, [("a", sure(10))]) == {"a": 7}
    gpu = StepCosts((1,), {(1, d): 10.0 + 0.05 * d for d in SHAPES_EXTRA})
    assert plan(gpu, 1, [("a", sure(10))]) == {"a": 10}


def test_plan_drafts_beside_many_sequences_where_rows_are_cheap():
    """A device where extra rows cost little (a GPU): drafts for all eight."""
    gpu = StepCosts((1, 8), {(1, d): 10.0 + 0.05 * d for d in SHAPES_EXTRA} |
                    {(8, d): 11.0 + 0.05 * d for d in SHAPES_EXTRA})
    chosen = plan(gpu, 8, [(i, sure()) for i in range(8)])
    assert sorted(chosen) == list(range(8)) and all(n >= 8 for n in chosen.values())


def test_plan_drafts_several_sequences_at_one_length():
    """Rows of sequences with equal counts are one batch in llama.cpp, each other count a
    batch of its own: drafts on several sequences all take the first one's length, and a
    proposal too short for it stays out; with one proposal nothing changes."""
    gpu = StepCosts((1, 8), {(1, d): 10.0 + 0.05 * d for d in SHAPES_EXTRA} |
                    {(8, d): 11.0 + 0.05 * d for d in SHAPES_EXTRA})
    sizes = {0: 20, 1: 9, 2: 20, 3: 5}
    chosen = plan(gpu, 8, [(q, sure(n)) for q, n in sizes.items()])
    assert len(chosen) >= 2 and len(set(chosen.values())) == 1
    assert all(n <= sizes[q] for q, n in chosen.items())
    assert plan(gpu, 8, [(3, sure(5))]) == {3: 5}
    # one long likely draft does not shut the others out: all eight at their length
    # give the step more than the long one alone
    chosen = plan(gpu, 8, [(0, Proposal("history", 0, list(range(63)), 0.99))] +
                  [(q, sure(16)) for q in range(1, 8)])
    assert sorted(chosen) == list(range(8)) and set(chosen.values()) == {16}


def test_plan_skips_unlikely_drafts():
    cpu = StepCosts.assumed()
    assert plan(cpu, 1, [("a", Proposal("short", 0, list(range(16)), 0.5))]) == {}


def test_under_traffic_a_draft_step_is_held_to_a_stretch_of_the_plain_one():
    """Others wait on the worker: on the CPU a draft row costs about a plain step, so a
    sure draft that pays alone is held to one row; where rows are cheap it stays."""
    cpu = StepCosts.assumed()
    held = plan(cpu, 1, [("a", sure())], stretch=1.0)
    assert sum(held.values()) <= 1 and cpu.cost(1, sum(held.values())) <= 2 * cpu.cost(1, 0)
    assert plan(cpu, 1, [("a", sure())], stretch=None) == {"a": 15}
    assert plan(cpu, 1, [("a", sure(64))], stretch=5.0) == {"a": 15}   # 68 ms <= 77
    gpu = StepCosts((1, 8), {(1, d): 10.0 + 0.05 * d for d in SHAPES_EXTRA} |
                    {(8, d): 11.0 + 0.05 * d for d in SHAPES_EXTRA})
    chosen = plan(gpu, 8, [(i, sure()) for i in range(8)], stretch=1.0)
    assert sorted(chosen) == list(range(8))
    assert gpu.cost(8, sum(chosen.values())) <= 2 * gpu.cost(8, 0)


def test_steps_correct_start_up_costs_measured_on_a_busy_machine():
    """Start-up figures that made drafts look cheap: the steps that run them pull the
    shape toward what it really takes, and plan stops choosing the draft; a shape
    outside the measured range is left alone."""
    wrong = StepCosts.assumed()
    for d in SHAPES_EXTRA[1:]:
        wrong.table[1, d] = wrong.table[1, 0] * 1.2        # drafts "nearly free"
    likely = [("a", Proposal("long", 0, list(range(16)), 0.7))]
    truth = StepCosts.assumed()
    assert plan(wrong, 1, likely) and plan(truth, 1, likely) == {}
    steps = 0
    while plan(wrong, 1, likely) and steps < 200:    # the engine's loop: run, observe
        length = plan(wrong, 1, likely)["a"]
        wrong.observe(1, length, truth.cost(1, length))
        steps += 1
    assert 0 < steps < 200
    for _ in range(150):                         # slower steps move it up slowly
        wrong.observe(1, 16, truth.cost(1, 16))
    assert abs(wrong.cost(1, 16) - truth.cost(1, 16)) < 0.05 * truth.cost(1, 16)
    before = dict(wrong.table)
    for _ in range(20):
        wrong.observe(3, 6, 1000.0)              # between measured shapes: the corners
    assert wrong.table[2, 4] > before[2, 4] and wrong.table[8, 7] > before[8, 7]
    assert wrong.table[1, 0] == before[1, 0]
    assert not wrong.observe(1, 500, 9.0) and wrong.observed == steps + 170


def test_one_stalled_step_moves_the_costs_little_and_drafts_never_look_cheaper():
    """A step that stalled (1 s against 12.9 ms) counts as twice off at most, and slow
    plain steps never leave a draft shape cheaper than the plain one."""
    from workers.engine.stepcosts import OBSERVED_CLAMP, OBSERVED_UP
    costs = StepCosts.assumed()
    costs.observe(1, 0, 1000.0)
    assert costs.table[1, 0] <= 12.9 * OBSERVED_CLAMP ** OBSERVED_UP + 1e-9
    gpu = StepCosts((1,), {(1, d): 10.0 + 0.01 * d for d in SHAPES_EXTRA})
    for _ in range(200):
        gpu.observe(1, 0, 11.0)
    row = [gpu.table[1, d] for d in SHAPES_EXTRA]
    assert row == sorted(row) and row[0] > 10.5
    assert plan(gpu, 1, [("a", Proposal("short", 0, list(range(16)), 0.0))]) == {}


def test_step_costs_interpolate_and_extrapolate():
    costs = StepCosts.assumed()
    assert costs.cost(1, 0) < costs.cost(1, 4) < costs.cost(1, 32) < costs.cost(1, 40)
    assert costs.cost(1, 0) < costs.cost(4, 0) < costs.cost(8, 0) < costs.cost(12, 0)


def test_step_costs_measured_keep_the_fastest_run_and_a_cheaper_longer_draft():
    """Each shape's fastest of its runs counts (one ran while the machine was busy); a
    longer draft that costs less (7 rows, 8 outputs, against 4) stays cheaper; no draft
    shape counts as cheaper than the plain step."""
    runs: dict = {}

    def timed(s, d, each):
        assert not each                     # one slot: nothing to measure alike
        runs[s, d] = runs.get((s, d), 0) + 1
        busy = 10 if runs[s, d] == 1 and d == 16 else 1           # its first run was slow
        return busy * {0: 0.012, 1: 0.010, 4: 0.05, 7: 0.045}.get(d, 0.02 + 0.001 * d)
    costs = StepCosts.measure(timed, 1)
    assert set(costs.table) == {(1, d) for d in SHAPES_EXTRA}
    assert abs(costs.table[1, 16] - 36.0) < 1e-6                   # not 360
    assert costs.table[1, 7] < costs.table[1, 4]
    assert costs.table[1, 1] == 12.0                               # not below the plain 12


def test_first_line_first_sits_out_only_what_makes_the_step_cheaper(monkeypatch):
    """On the CPU's costs 8 plain rows cost less than 5, 6 or 7: with two deep sequences
    beside six others (one still short of its first line) none sits out, since that
    would lengthen the step; with seven deep ones all seven do (one row), the deepest
    first when fewer pay; none sits out more than SIT_OUT_RUN steps in a row; without
    costs every one that may does."""
    from types import SimpleNamespace

    from workers.engine import scheduling
    from workers.engine.scheduling import DEEP_AFTER, SIT_OUT_RUN, Scheduler
    monkeypatch.setattr(scheduling, "time", SimpleNamespace(monotonic=lambda: 100.0))

    def slots(deep: int, total: int = 8):
        return [SimpleNamespace(seq=i, line_done=i < deep or i == total - 1, sat_out=0,
                                sampled=DEEP_AFTER + (100 - i if i < deep else 0))
                for i in range(total - 1)] + [SimpleNamespace(
                    seq=total - 1, line_done=False, sat_out=0, sampled=1)]
    cpu = StepCosts.assumed()
    assert cpu.plain_cost(8) < cpu.plain_cost(6) and cpu.plain_cost(4) < cpu.plain_cost(8)
    two = slots(2)
    assert Scheduler().first_line_first(two, [], cpu) == two
    seven = slots(7)
    first = Scheduler().first_line_first(seven, [], cpu)
    assert [s.seq for s in first] == [7]
    for _ in range(SIT_OUT_RUN - 1):                  # (what they sat out is on the slots)
        assert [s.seq for s in Scheduler().first_line_first(seven, [], cpu)] == [7]
    assert Scheduler().first_line_first(seven, [], cpu) == seven     # then a step in
    assert [s.seq for s in Scheduler().first_line_first(seven, [], cpu)] == [7]
    five = slots(5, total=6)                        # 6 rows cost more than 4 or 1
    ran = [s.seq for s in Scheduler().first_line_first(five, [], cpu)]
    assert len(ran) < 6 and cpu.plain_cost(len(ran)) < cpu.plain_cost(6)
    assert 5 in ran and all(s.sat_out for s in five if s.seq not in ran)
    none = slots(2)
    assert [s.seq for s in Scheduler().first_line_first(none, [], None)] == [2, 3, 4, 5, 6, 7]
    assert Scheduler().first_line_first(none, [], None) == none    # no costs: one in a row


def test_a_run_of_steps_sat_out_ends_at_the_first_step_a_third_of_a_second_on(monkeypatch):
    """Seven steps sat out are ~0.1-0.4 s where steps are a keystroke's, but a prompt's
    logprob rows make steps of 150 ms and more: a stream beside one paused 1.1 s. A run
    sat out also ends at the first step planned SIT_OUT_SECONDS or more after it began
    (so it lasts at most that and one step), whichever comes first, and a new one
    starts its own count."""
    from types import SimpleNamespace

    from workers.engine import scheduling
    from workers.engine.scheduling import DEEP_AFTER, SIT_OUT_RUN, SIT_OUT_SECONDS, Scheduler
    clock = [100.0]
    monkeypatch.setattr(scheduling, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    seven = [SimpleNamespace(seq=i, line_done=True, sat_out=0, sampled=DEEP_AFTER + 100)
             for i in range(7)] + [SimpleNamespace(seq=7, line_done=False, sat_out=0,
                                                   sampled=1)]
    cpu = StepCosts.assumed()

    def ran() -> list[int]:
        return [s.seq for s in Scheduler().first_line_first(seven, [], cpu)]
    step = SIT_OUT_SECONDS / 2.5                      # long steps: two and a half fit
    runs = []
    for _ in range(12):
        runs.append(len(ran()))
        clock[0] += step
    assert runs == [1, 1, 1, 8, 1, 1, 1, 8, 1, 1, 1, 8], runs
    clock[0] += 10
    runs = []
    for _ in range(2 * (SIT_OUT_RUN + 1)):            # short steps: the count ends it
        runs.append(len(ran()))
        clock[0] += 0.001
    assert runs == ([1] * SIT_OUT_RUN + [8]) * 2, runs


def test_first_line_first_counts_each_run_of_sequence_ids_as_a_decode():
    """llama.cpp decodes each run of consecutive sequence ids on its own: deep sequences
    sitting out between others would split the step into runs that together cost more
    than all eight rows; deep ones at the end sit out together, leaving one run."""
    from types import SimpleNamespace

    from workers.engine.scheduling import DEEP_AFTER, Scheduler
    from workers.engine.spans import seq_runs

    def batch(deep: list[int], waiting: int):
        return [SimpleNamespace(seq=i, line_done=i != waiting, sat_out=0,
                                sampled=DEEP_AFTER + 10 * i if i in deep else 3)
                for i in range(8)]
    cpu = StepCosts.assumed()
    spread = batch([1, 2, 5, 6], waiting=7)
    assert Scheduler().first_line_first(spread, [], cpu) == spread      # none sits out
    assert sum(cpu.plain_cost(r) for r in seq_runs([0, 3, 4, 7])) > cpu.plain_cost(8)
    tail = batch([4, 5, 6, 7], waiting=0)
    ran = Scheduler().first_line_first(tail, [], cpu)
    assert [s.seq for s in ran] == [0, 1, 2, 3]
    assert cpu.plain_cost(4) < cpu.plain_cost(8)


def test_step_costs_measure_every_shape_once_when_a_round_ran_past_the_budget():
    """A slow device, or a busy machine: past the budget no further round starts, but
    every shape was measured (a fake clock: each decode takes a second)."""
    now = [0.0]
    calls: dict = {}

    def timed(s, d, each):
        now[0] += 1.0
        calls[s, d, each] = calls.get((s, d, each), 0) + 1
        return 0.01 + 0.001 * (s + d)
    costs = StepCosts.measure(timed, 8, budget=5.0, clock=lambda: now[0])
    shapes = StepCosts.shapes(8)[1]
    assert set(costs.table) == shapes and set(costs.each) == StepCosts.each_shapes(8)
    warm_up = (8, SHAPES_EXTRA[-1], False)
    assert all(n == 1 for key, n in calls.items() if key != warm_up)
    calls.clear()
    StepCosts.measure(timed, 8, budget=None, clock=lambda: now[0])
    assert calls[1, 0, False] == 2 and calls[2, 1, True] == 3      # all the rounds


def test_every_configured_count_of_sequences_is_measured_not_extrapolated():
    counts = StepCosts.counts(64)
    assert counts[:16] == list(range(1, 17)) and counts[16:] == [32, 64]
    assert StepCosts.counts(40)[-2:] == [32, 40] and StepCosts.counts(1) == [1]
    sequences, shapes = StepCosts.shapes(64)
    assert sequences == (1, 2, 8, 64) and (64, 0) in shapes and (64, 64) in shapes
    assert (64, 2) in StepCosts.each_shapes(64)


def test_drafts_alike_on_every_sequence_where_one_batch_pays():
    """Eight sequences with one draft row each are one batch of 16 outputs (57 ms against
    46 plain on the CPU's costs): likely drafts on most of them pay, unlikely ones do not,
    and a draft on one alone beside seven others does not either (a batch of its own);
    runs of sequences with a gap between them cost a batch each."""
    from workers.engine.spans import seq_runs
    cpu = StepCosts.assumed()
    likely = [Proposal("history", 0, list(range(16)), 0.8)] * 8
    k, rate = each_plan(cpu, [8], likely)
    assert k == 1 and rate > 8 / cpu.plain_cost(8)
    assert plan(cpu, 8, [(0, likely[0])]) == {}
    assert each_plan(cpu, [8], [Proposal("short", 0, list(range(16)), 0.2)] * 8)[0] == 0
    assert each_plan(cpu, [8], likely[:2])[0] == 0          # six carry only a guess
    assert each_plan(cpu, [8], likely, stretch=0.1)[0] == 0  # 57 ms > 1.1 x 46
    assert seq_runs([0, 1, 2, 4, 5, 7]) == [3, 2, 1]
    _, apart = each_plan(cpu, [4, 4], likely)
    assert apart < rate                                     # two batches of four
    assert StepCosts((1, 2, 8), dict(cpu.table)).each_cost(8, 1) == cpu.cost(8, 8)


def test_plain_steps_correct_only_the_plain_shapes_around_them(tmp_path):
    """With more slots than plain counts measured, a plain step of 18 sequences moves the
    plain figures it lies between (16 and 20), not the 2-sequence one; no sequences cost
    nothing; a kept table without sequences is measured again, not a crash."""
    costs = StepCosts.measure(lambda s, d, each: 0.001 * (10 + s + d), 20)
    before = dict(costs.table)
    for _ in range(50):
        assert costs.observe(18, 0, 10.0)
    assert costs.table[2, 0] == before[2, 0]
    assert costs.table[16, 0] < before[16, 0] and costs.table[20, 0] < before[20, 0]
    assert costs.plain_cost(0) == 0.0
    broken = tmp_path / "step-costs.json"
    broken.write_text('{"sequences": [], "table": [], "each": []}')
    assert StepCosts.load(broken) is None
    costs.save(tmp_path / "kept.json")
    assert StepCosts.load(tmp_path / "kept.json").each == costs.each


def test_a_plain_step_moves_the_drafts_beside_it_as_much_as_itself():
    """Plain steps of eight sequences a fifth cheaper than the start-up measured (its
    contexts longer than an editor's openings): the drafts of eight rows, on one or on
    each, keep their measured ratio to the plain step, so the plan weighs them as at
    start-up (moving the plain shape alone made one row on each look 1.6-1.8 plain
    steps and kept it out), and never below the plain step; other counts' shapes do not
    move, nor does a step with drafts move the drafts alike."""
    costs = StepCosts.assumed()
    before_table, before_each = dict(costs.table), dict(costs.each)
    for _ in range(40):
        assert costs.observe(8, 0, 0.8 * before_table[8, 0])
    assert costs.table[8, 0] < 0.85 * before_table[8, 0]
    shrunk = costs.table[8, 0] / before_table[8, 0]
    for d in SHAPES_EXTRA[1:]:
        assert costs.table[8, d] == pytest.approx(shrunk * before_table[8, d])
    for k in (1, 2):
        assert costs.each[8, k] == pytest.approx(shrunk * before_each[8, k])
        assert costs.each[7, k] == before_each[7, k]
    assert costs.table[2, 4] == before_table[2, 4] and costs.table[1, 0] == before_table[1, 0]
    alike = dict(costs.each)
    for _ in range(5):
        assert costs.observe(8, 3, 0.5 * costs.cost(8, 3))
    assert costs.each == alike
    costs.each[8, 1] = 1.01 * costs.table[8, 0]      # one row each, nearly free
    for _ in range(10):
        costs.observe(8, 0, 0.5 * costs.table[8, 0])
    assert costs.each[8, 1] >= costs.plain_cost(8)


def test_drafts_alike_just_short_of_the_margin_are_probed_one_step_in_sixteen():
    """One row on each of eight sequences that would raise the step's rate by less than
    the margin: each_plan's probe takes it, the plain plan does not; one that would
    lower the rate never goes in. The draft planner probes one step in ALIKE_PROBE_EVERY of
    those that weigh drafts alike, so the shape's cost and the sources' acceptance are
    measured by real steps, not left at the start-up's figure for good."""
    from types import SimpleNamespace

    from workers.engine.drafting import ALIKE_PROBE_EVERY, DraftPlanner
    cpu = StepCosts.assumed()
    plain = 8 / cpu.plain_cost(8)
    # a rate per proposal whose gains lift the step's rate by ~5%: past 1, short of 1.1
    rate = (1.05 * plain * cpu.each_cost(8, 1) - 8) / 8
    near = [Proposal("short", 0, list(range(16)), rate)] * 8
    assert each_plan(cpu, [8], near) == (0, plain)
    k, probed = each_plan(cpu, [8], near, probe=True)
    assert k == 1 and plain < probed < 1.1 * plain
    assert each_plan(cpu, [8], [Proposal("short", 0, list(range(16)), 0.05)] * 8,
                     probe=True)[0] == 0
    planner, drafted = DraftPlanner(), 0
    for _ in range(3 * ALIKE_PROBE_EVERY):
        generating = [SimpleNamespace(seq=i, cached=[1, 2, 3], next_token=4, draft=[],
                                      policy=Drafter(16)) for i in range(8)]
        by_seq = {s.seq: near[0] for s in generating}
        probed = planner._drafts_alike(generating, list(by_seq.items()), by_seq, {},
                                       cpu, None)
        assert [len(s.draft) for s in generating] == [1 if probed else 0] * 8
        drafted += probed
    assert drafted == 3


def test_a_guess_that_fills_drafts_alike_leaves_the_allowance():
    """A sequence without a proposal carries a guess in a step of drafts alike; its miss
    is no source's and does not shorten the drafts its sources earned."""
    drafter = Drafter(64)
    drafter.allowance = 64
    drafter.record(1, 0)                      # a guess (nothing started), rejected
    assert drafter.allowance == 64 and drafter.proposed == 1


def test_find_draft_is_the_latest_occurrence():
    assert find_draft([1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 7, 8, 9, 0, 1, 2, 3], 4) == [7, 8, 9, 0]


def test_an_earlier_sequence_of_the_tenant_is_drafted_from():
    """The same request again (an editor asking for nearly the same completion): its
    answer comes from the earlier one's output in drafts, not token by token."""
    from workers.engine.history import History
    prompt = list(range(500, 540))
    output = list(range(600, 700))
    history = History()
    history.add(prompt + output, len(prompt))
    drafter = Drafter(16, history=history)
    steps, drafted, accepted = drive(drafter, prompt, output)
    assert accepted >= len(output) - 8 and steps <= 12
    assert drive(Drafter(16), prompt, output)[2] == 0      # without it: nothing to copy


def test_a_long_text_asked_again_drafts_its_answer_past_the_allowance():
    """The same long prompt again (an edit asked for twice): the earlier answer matches
    over HISTORY_REPEAT tokens or more, so its first draft may run to the limit instead
    of working up from DRAFT_START; a short prompt asked again works up as before (its
    repeat flips at near-ties more often)."""
    from workers.engine.history import History
    from workers.engine.speculation import DRAFT_START, HISTORY_REPEAT
    output = list(range(2000, 2100))
    for prompt_len, first in ((HISTORY_REPEAT + 20, 64), (40, DRAFT_START)):
        prompt = list(range(1000, 1000 + prompt_len))
        history = History()
        history.add(prompt + output, len(prompt))
        proposal = Drafter(64, history=history).propose(prompt, 64)
        assert proposal.source == "history" and proposal.tokens == output[:first]
    long_prompt = list(range(1000, 1000 + HISTORY_REPEAT + 20))
    history = History()
    history.add(long_prompt + output, len(long_prompt))
    steps, drafted, accepted = drive(Drafter(64, history=history), long_prompt, output, 64)
    assert accepted >= len(output) - 4 and steps <= 3


def test_a_copy_of_an_earlier_answer_finds_its_place_again_after_an_inserted_token(
        monkeypatch):
    """The model writes the earlier answer again with one token more ("lists." for
    "lists"): the copy finds its place by the last few tokens near where it stood and
    goes on within a step or two, instead of waiting for a LONG_KEY key to match."""
    from workers.engine import speculation
    from workers.engine.history import History
    prompt = list(range(500, 540))
    output = list(range(600, 700))
    now = output[:30] + [999] + output[30:]
    history = History()
    history.add(prompt + output, len(prompt))
    resynced = drive(Drafter(16, history=history), prompt, now)
    monkeypatch.setattr(speculation, "RESYNC", -1)          # no place searched for
    stuck = drive(Drafter(16, history=history), prompt, now)
    assert resynced[2] >= len(output) - 8
    assert resynced[2] > stuck[2] + 4 and resynced[0] < stuck[0]


def test_a_copy_of_an_earlier_answer_cut_short_is_not_taken_up_again_blindly():
    """The repeat went another way at a near-tie and goes on with new text: the earlier
    answer is not drafted again at the same distance (each such draft a wasted step);
    only the draft that was cut is lost."""
    from workers.engine.history import History
    prompt = list(range(500, 540))
    output = list(range(600, 700))
    now = output[:30] + list(range(800, 870))
    history = History()
    history.add(prompt + output, len(prompt))
    steps, drafted, accepted = drive(Drafter(16, history=history), prompt, now)
    assert accepted >= 30 - 2
    assert drafted - accepted <= 16


def test_a_copy_of_an_earlier_answer_goes_on_after_one_substituted_token(monkeypatch):
    """One token of the earlier answer replaced: the cut copy is not resumed blindly, but
    found again by the last tokens a couple of steps later (not LONG_KEY tokens later)."""
    from workers.engine import speculation
    from workers.engine.history import History
    prompt = list(range(500, 540))
    output = list(range(600, 700))
    now = output[:30] + [999] + output[31:]
    history = History()
    history.add(prompt + output, len(prompt))
    steps, drafted, accepted = drive(Drafter(16, history=history), prompt, now)
    assert accepted >= len(now) - 8 and steps <= 10
    monkeypatch.setattr(speculation, "RESYNC", -1)          # no place searched for
    assert drive(Drafter(16, history=history), prompt, now)[0] > steps + 4


def test_under_traffic_a_lookup_drafts_on_its_record_not_its_match_length():
    """Others share the step (or the sequence is sampled): a lookup's long match is no
    proof; its own record is."""
    context = list(range(100, 140)) + list(range(100, 120))
    assert Drafter(16).propose(context, 16).rate > 0.9
    assert Drafter(16).propose(context, 16, proven=True).rate == 0.5
    assert Drafter(16, proven_only=True).propose(context, 16).rate == 0.5   # a wide draw


def test_a_wide_draw_is_one_from_the_whole_distribution():
    from workers.sampling import SamplingParams
    assert SamplingParams(temperature=1.0).wide                    # OpenAI's defaults
    assert not SamplingParams(temperature=0.0).wide
    assert not SamplingParams(temperature=0.2).wide
    assert not SamplingParams(temperature=1.0, top_p=0.9).wide
    # llama.vim: top-k 40, top-p 0.9 and infill; its chain has no temperature sampler
    assert not SamplingParams(temperature=0.8, top_k=40, top_p=0.9,
                              samplers=("top_k", "top_p", "infill")).wide
    assert SamplingParams(temperature=0.2, samplers=("infill",)).wide


def test_drafts_start_short_and_double_while_wholly_accepted():
    """A confident source that turns out wrong costs a DRAFT_START-row step, not a
    64-row one: lengths go 16, 32, 64 while each draft holds (also when the plan took one
    less, the cheaper step), and back to 16 after a draft cut short."""
    from workers.engine.speculation import DRAFT_START
    context = list(range(100, 240)) * 2 + list(range(100, 120))
    drafter = Drafter(64)
    lengths = []
    for accepted_all in (True, True, True, False, True):
        proposal = drafter.propose(context, 64)
        lengths.append(len(proposal.tokens))
        drafter.started(proposal, len(context))
        kept = len(proposal.tokens) if accepted_all else 2
        drafter.record(len(proposal.tokens), kept)
        context = context + proposal.tokens[:kept] + ([proposal.tokens[kept]]
                                                       if kept < len(proposal.tokens) else [])
    assert lengths == [DRAFT_START, 2 * DRAFT_START, 64, 64, DRAFT_START]
    short = Drafter(64)
    short.started(Proposal("short", 0, [1, 2, 3, 4], 0.9), 10)
    short.record(4, 4)                       # a short draft that held: no longer allowance
    assert short.allowance == DRAFT_START
    cheaper = Drafter(64)                    # plan drafted 15 of 16 (16 outputs cost less)
    cheaper.started(Proposal("copy", 0, list(range(16)), 0.9), 10)
    cheaper.record(DRAFT_START - 1, DRAFT_START - 1)
    assert cheaper.allowance == 2 * DRAFT_START


def test_history_keeps_recent_sequences_only():
    from workers.engine.history import HISTORY_SEQUENCES, History
    history = History()
    for n in range(HISTORY_SEQUENCES + 4):
        history.add([n] * 3 + list(range(1000 + 100 * n, 1040 + 100 * n)), 3)
    assert len(history.sequences) == HISTORY_SEQUENCES
    assert history.lookup(list(range(1000, 1000 + LONG_KEY))) is None      # the oldest
    assert history.lookup(list(range(1000 + 100 * 19, 1000 + 100 * 19 + LONG_KEY)))
    live = set(history.sequences)
    assert all(seq in live for seq, _ in history.index.values())


def test_plan_leaves_out_drafts_within_the_margin_of_the_plain_rate():
    """Where extra rows are nearly free (a GPU), a draft goes in when it is likely
    enough to raise the step's rate by DRAFT_MARGIN, not for a gain within the noise."""
    from workers.engine.stepcosts import DRAFT_MARGIN
    flat = StepCosts((1, 2), {(s, d): 10.0 + s + 0.01 * d for s in (1, 2)
                              for d in SHAPES_EXTRA})
    unlikely = Proposal("short", 0, [7], 0.05)
    assert (1 + unlikely.gain(1)) / flat.cost(1, 1) > 1 / flat.cost(1, 0)  # above plain,
    assert (1 + unlikely.gain(1)) / flat.cost(1, 1) < (1 + DRAFT_MARGIN) / flat.cost(1, 0)
    assert plan(flat, 1, [("a", unlikely)]) == {}                          # ... not by 10%
    assert plan(flat, 1, [("a", Proposal("short", 0, [7, 8, 9, 10], 0.5))])
    assert each_plan(flat, [2], [unlikely, unlikely])[0] == 0


def test_the_recycled_table_learns_the_models_tokens_not_the_prompt():
    from workers.engine.history import Recycler
    recycler = Recycler()
    prompt = [1, 2, 3, 4]
    context = prompt + [5, 6, 7, 5, 6, 8]          # the model wrote 5 6 7 5 6 8
    recycler.learn(context, len(prompt))
    assert 1 not in recycler.after_one and (1, 2) not in recycler.after_two   # prompt
    assert recycler.after_one[4] == 5          # (the model's first token, after the prompt)
    assert recycler.after_two[(5, 6)] == 8     # the newest successor wins
    assert recycler.chain([9, 9, 5, 6], 3) == [8]              # ... and 8 had none
    assert recycler.chain([9, 4], 4) == [5, 6, 8]               # one-token key, then pairs
    assert recycler.chain([9], 4) == []


def test_the_recycled_table_is_bounded():
    from workers.engine.history import RECYCLED_ENTRIES, Recycler
    recycler = Recycler()
    context = list(range(3 * RECYCLED_ENTRIES))
    recycler.learn(context, 0)
    assert len(recycler.after_one) <= RECYCLED_ENTRIES
    assert len(recycler.after_two) <= RECYCLED_ENTRIES
    assert recycler.after_one[context[-2]] == context[-1]       # the newest kept


def test_a_tenants_earlier_answers_draft_first_seen_text_by_the_recycled_table():
    """Text that appears nowhere in the context or the tenant's history as a run of
    tokens, yet every pair of tokens in it followed the model's own pairs before: only
    the recycled source has it. Another tenant's sequences teach it nothing."""
    from workers.engine.history import Histories
    histories = Histories()
    written = [100, 101, 102, 103, 104, 105, 106, 107]
    for piece in (written[:5], [60] + written[3:]):     # two answers, each a piece
        earlier = Drafter(16)
        earlier.history, earlier.output_from = histories.of("a"), 3
        earlier.learn([1, 2, 3] + piece)
    drafter = Drafter(16)
    drafter.history, drafter.output_from = histories.of("a"), 4
    context = [7, 8, 9, 100, 101]
    proposal = drafter.propose(context, 16)
    assert proposal is not None and proposal.source == "recycled"
    assert proposal.tokens == written[2:]
    other = Drafter(16)
    other.history, other.output_from = histories.of("b"), 4
    assert other.propose(context, 16) is None


# -- the rules decided on measured costs: a CPU-like and a GPU-like table ----------------
def gpu_like() -> StepCosts:
    """A step's cost barely grows with rows (a GPU's, for a small model)."""
    counts = (1, 2, 8)
    return StepCosts(counts, {(s, d): 10.0 + 0.05 * s + 0.02 * d for s in counts
                              for d in SHAPES_EXTRA} |
                     {(s, 0): 10.0 + 0.05 * s for s in range(1, 9)})


def test_sit_outs_only_where_the_measured_step_is_a_tenth_cheaper():
    """Seven deep sequences beside one waiting for its first line: on the CPU's costs
    (one row 13 ms, eight 46) they sit out; where rows are nearly free nobody does,
    since the step would be under 10% cheaper."""
    from types import SimpleNamespace

    from workers.engine.scheduling import DEEP_AFTER, Scheduler

    def seven_deep():
        return [SimpleNamespace(seq=i, line_done=i < 7, sat_out=0,
                                sampled=DEEP_AFTER + 100 - i if i < 7 else 1)
                for i in range(8)]
    assert [s.seq for s in Scheduler().first_line_first(seven_deep(), [],
                                                        StepCosts.assumed())] == [7]
    batch = seven_deep()
    assert Scheduler().first_line_first(batch, [], gpu_like()) == batch


def test_sit_outs_count_the_prompt_piece_the_step_takes():
    """Seven deep sequences beside a prompt being prefilled: beside a keystroke's few new
    rows they sit out (the step is several times cheaper for it), beside a cold prompt's
    512-row piece nobody does, since the step would be barely cheaper and seven streams
    would each lose a step of half a second; where rows are nearly free, nobody either."""
    from types import SimpleNamespace

    from workers.engine.scheduling import DEEP_AFTER, Scheduler

    def seven_deep():
        return [SimpleNamespace(seq=i, line_done=True, sat_out=0,
                                sampled=DEEP_AFTER + 100 - i) for i in range(7)]
    prompt = [SimpleNamespace(seq=7)]
    cpu = StepCosts.assumed()
    assert Scheduler().first_line_first(seven_deep(), prompt, cpu, prompt_rows=8) == []
    batch = seven_deep()
    assert Scheduler().first_line_first(batch, prompt, cpu, prompt_rows=512) == batch
    assert not any(s.sat_out for s in batch)
    saving = 1 - (cpu.cost(1, 511)) / (cpu.plain_cost(8) + cpu.cost(1, 511) - cpu.plain_cost(1))
    assert 0 < saving < 0.1
    batch = seven_deep()
    assert Scheduler().first_line_first(batch, prompt, gpu_like(), prompt_rows=8) == batch


def test_a_finishing_prompt_goes_before_the_generating_rows_where_their_decode_outweighs_the_host():
    """Prompt first: a prompt piece of two rows or more is a sub-batch of its own beside
    one-row sequences, so decoding it alone first gives its first token their decode
    sooner and costs them one host round. On the CPU's costs (seven rows 62 ms) and a
    host of 2 ms a round it goes first; a one-row piece never (it shares their
    sub-batch); where the host's round on each of them outweighs their decode (a GPU's
    10 ms step beside seven sequences, or a host of 10 ms beside eight on the CPU), or
    without measured costs, together."""
    from workers.engine.scheduling import prompt_first

    cpu, gpu = StepCosts.assumed(), gpu_like()
    assert prompt_first(7, 12, cpu, 2.0) and prompt_first(7, 230, cpu, 2.0)
    assert prompt_first(1, 2, cpu, 2.0)
    assert not prompt_first(7, 1, cpu, 2.0)
    assert not prompt_first(8, 12, cpu, 10.0)
    assert not prompt_first(0, 12, cpu, 2.0)
    assert not prompt_first(7, 12, None, 0.5)
    assert not prompt_first(7, 12, gpu, 2.0)
    assert prompt_first(2, 12, gpu, 2.0)


def test_the_hosts_time_between_decodes_counts_only_gaps_the_worker_went_straight_on():
    """HostTime: a gap counts after a decode some sequence still needed, less the draft
    model's decodes; none after an idle wait; unknown (infinite) before HOST_GAPS // 2,
    then the median."""
    from workers.engine.stepcosts import HOST_GAPS, HostTime

    host, t = HostTime(), 0.0
    for gap in [0.002] * (HOST_GAPS // 2 - 1):
        host.decoded(t, t + 0.05, goes_on=True)
        t += 0.05 + gap
    assert host.ms == float("inf")
    host.decoded(t, t + 0.05, goes_on=False)        # the last sequence ended there
    t += 30.0                                       # ... and the worker waited idle
    host.decoded(t, t + 0.05, goes_on=True)
    assert host.ms == float("inf")                  # (the idle wait not counted)
    t += 0.05 + 0.003
    host.drafted = 0.010
    host.decoded(t + 0.010, t + 0.06, goes_on=True)  # (a draft model decoded 10 ms)
    host.idle()
    host.decoded(t + 99.0, t + 99.05, goes_on=True)
    assert len(host.gaps) == HOST_GAPS // 2
    assert host.ms == pytest.approx(2.0)
    assert max(host.gaps) == pytest.approx(3.0)


def test_drafts_run_beside_a_waiting_user_only_where_rows_are_nearly_free():
    """One sequence with a confident proposal, another still short of its first line:
    on the CPU's costs (a draft row about a plain step) it drafts nothing, since the
    waiting user's step would grow past 1 + WAIT_STRETCH; on a GPU-like table it drafts."""
    from types import SimpleNamespace

    from workers.engine.drafting import DraftPlanner
    from workers.engine.speculation import Proposal

    class Confident:
        max_len, min_len = 64, 4

        def propose(self, context, room, proven=False):
            return Proposal("copy", 0, list(range(100, 116)), rate=0.95)

        def started(self, proposal, at):
            pass

    def drafted(costs):
        slots = [SimpleNamespace(seq=0, busy=True, line_done=True, n_past=100, budget=None,
                                 sampled=40, policy=Confident(), cached=[1] * 100,
                                 next_token=2, draft=None, sampled_aside=False),
                 SimpleNamespace(seq=1, busy=True, line_done=False, n_past=50, budget=None,
                                 sampled=2, policy=None, cached=[1] * 50, next_token=3,
                                 draft=None, sampled_aside=False)]
        DraftPlanner().draft(slots, slots, [], 4096, 512, costs)
        return len(slots[0].draft)
    assert drafted(StepCosts.assumed()) == 0
    assert drafted(gpu_like()) > 0


def test_the_shortest_draft_offered_is_decided_on_the_measured_costs():
    """Where a draft row costs about a plain step (the CPU table) a draft needs 2 tokens
    kept to pay, and a lookup that can offer only one offers nothing; where rows are
    nearly free (GPU-like) one token pays and is offered; where rows cost so much that no
    draft pays, none is offered short of the longest measured."""
    cpu, gpu = StepCosts.assumed(), gpu_like()
    assert cpu.shortest_draft() == 2 and gpu.shortest_draft() == 1
    dear = StepCosts((1,), {(1, d): 10.0 + 20.0 * d for d in SHAPES_EXTRA})
    assert dear.shortest_draft() == SHAPES_EXTRA[-1]
    context = [3, 1, 4, 1, 5, 7, 7, 7, 7, 7]    # the latest match leaves one token: 7
    assert Drafter(16, min_len=cpu.shortest_draft()).propose(context, 16) is None
    one = Drafter(16, min_len=gpu.shortest_draft()).propose(context, 16)
    assert one is not None and one.tokens == [7]


def test_the_floor_is_the_share_a_draft_must_keep_to_pay_on_the_device():
    """Where a draft row costs ~0.2 of a plain step even 63 at a time (the CPU table) a
    source must keep about a fifth of its tokens (a quarter where its drafts are held to
    16 tokens: shorter ones need more kept); where rows are nearly free (GPU-like) one in
    a hundred, so a source keeping 2 tokens of each 32-token draft goes on (it pays
    there) where the quarter had stopped it; where rows cost more than they could ever
    give, or nothing is known, the quarter; where rows seem to cost nothing, one in a
    hundred still. A source keeping nothing stops on every device."""
    from workers.engine.speculation import FLOOR, FLOOR_LEAST
    cpu, gpu = StepCosts.assumed(), gpu_like()
    assert 0.2 < cpu.floor_share() < FLOOR
    assert cpu.floor_share(16) == FLOOR == cpu.floor_share(0)
    assert gpu.floor_share() == FLOOR_LEAST == gpu.floor_share(3)
    dear = StepCosts((1,), {(1, d): 10.0 + 20.0 * d for d in SHAPES_EXTRA})
    assert dear.floor_share() == FLOOR
    unknown = StepCosts((1,), {(1, d): 0.0 for d in SHAPES_EXTRA})
    assert unknown.floor_share() == FLOOR
    odd = StepCosts((1,), {(1, d): 10.0 - 0.01 * d for d in SHAPES_EXTRA})
    assert odd.floor_share() == FLOOR_LEAST
    context = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2, 3, 4]

    def after(floor, kept):
        drafter = Drafter(32, floor=floor)
        for _ in range(4):
            proposal = drafter.propose(context, 32)
            if proposal is None:
                return None
            drafter.started(proposal, len(context))
            drafter.record(32, kept)
        return drafter.propose(context, 32)
    assert after(gpu.floor_share(), 2) is not None      # 2 of 32 kept: pays there
    assert after(cpu.floor_share(), 2) is None
    assert after(FLOOR, 2) is None
    assert after(gpu.floor_share(), 0) is None


def test_a_sequence_sampled_aside_gets_no_draft_from_the_draft_model_either():
    """Its drafts would be verified where it is sampled in place, one dear draw a row:
    the lookups skipped it, and the draft model's drafts must too."""
    from types import SimpleNamespace

    import pytest

    from workers.engine.drafting import DraftPlanner

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the draft model was asked for {name}")
    slot = SimpleNamespace(seq=0, policy=SimpleNamespace(allowance=4), sampled_aside=True,
                           cached=[1], next_token=2, n_past=1, budget=None, sampled=0)
    assert DraftPlanner._with_model(Untouchable(), [slot], {}, {}, 4096,
                                    StepCosts.assumed(), None) == ({}, {})
    slot.sampled_aside = False
    with pytest.raises(AssertionError, match="draft model"):
        DraftPlanner._with_model(Untouchable(), [slot], {}, {}, 4096, StepCosts.assumed(),
                                 None)


def test_every_tenants_history_together_is_bounded_by_entries(monkeypatch):
    """A tenant's history fills up to ~190,000 entries (28 MB); 64 tenants kept were
    1.8 GB a worker. Past HISTORY_ENTRIES in all when a tenant's sequence starts, the
    least recently used tenants go (the one asking is kept, however full)."""
    from workers.engine import history as H
    monkeypatch.setattr(H, "HISTORY_ENTRIES", 2000)
    histories = H.Histories()
    for name in ("a", "b", "c", "d"):
        histories.of(name).add(list(range(1000, 2000)), 500)   # 756 index entries each
    assert list(histories.tenants) == ["b", "c", "d"]           # ("a" went at "d")
    histories.of("b")                                           # (used: now the newest)
    assert list(histories.tenants) == ["d", "b"] and histories.entries() <= 2000
    histories.of("e").add(list(range(3000, 6000)), 100)        # 2,988 alone
    histories.of("f")
    assert list(histories.tenants) == ["f"]
    histories.of("f").add(list(range(3000, 6000)), 100)
    assert list(histories.of("f").lookup(list(range(3000, 3012)))[0][:2]) == [3000, 3001]


def test_free_sequences_join_runs_where_one_batch_costs_less():
    """llama.cpp decodes each run of consecutive sequence ids as a batch of its own:
    free slots between runs take filler rows where one batch of the span is cheaper on
    the measured costs. On the CPU's (eight rows cost less than five, six or seven; one
    13 ms) rows of 0, 1, 3, 5, 6, 7 go as one batch of eight (46 ms, not 74), three lone
    rows stay three batches (39 ms, not 62 for five); on a GPU's (rows nearly free) any
    gap is filled. A lone run is padded where that is cheaper too (seven rows 62 ms, eight
    46), not where it is not (four rows, or a GPU's costs), nor past a slot that cannot
    take a row."""
    from workers.engine.spans import bridged, spans_cost
    cpu = StepCosts.assumed()
    gpu = gpu_like()
    assert bridged([0, 1, 3, 5, 6, 7], {2, 4}, cpu.plain_cost) == [(0, 7)]
    assert spans_cost([(0, 7)], cpu.plain_cost) < 0.7 * spans_cost(
        [(0, 1), (3, 3), (5, 7)], cpu.plain_cost)
    assert bridged([1, 3, 5, 7], {0, 2, 4, 6}, cpu.plain_cost) == [(0, 7)]
    assert bridged([3, 5, 7], {0, 1, 2, 4, 6}, cpu.plain_cost) == [(3, 3), (5, 5), (7, 7)]
    assert bridged([0, 1, 3, 5, 6, 7], set(), cpu.plain_cost) == [(0, 1), (3, 3), (5, 7)]
    # 0-3 and 5-7 would cost 72 ms against 74: under 5% less, not worth the fillers
    assert bridged([0, 1, 3, 5, 6, 7], {2}, cpu.plain_cost) == [(0, 1), (3, 3), (5, 7)]
    # spans never touch (llama.cpp would decode 0 and 1-4 as one batch of five, 57 ms,
    # where 0 alone and 1-4 were counted 13 + 37)
    assert bridged([0, 1, 3, 4], {2}, cpu.plain_cost) == [(0, 1), (3, 4)]
    assert bridged(list(range(7)), {7}, cpu.plain_cost) == [(0, 7)]     # a lone run
    assert bridged(list(range(1, 8)), {0}, cpu.plain_cost) == [(0, 7)]
    assert bridged(list(range(5)), {5, 6, 7}, cpu.plain_cost) == [(0, 7)]
    assert bridged(list(range(4)), {4, 5, 6, 7}, cpu.plain_cost) == [(0, 3)]
    assert bridged(list(range(7)), set(), cpu.plain_cost) == [(0, 6)]
    assert bridged(list(range(7)), {7}, gpu.plain_cost) == [(0, 6)]
    assert bridged([0, 7], set(range(1, 7)), gpu.plain_cost) == [(0, 7)]
    assert bridged([0, 7], {1, 2, 3, 4, 5}, gpu.plain_cost) == [(0, 0), (7, 7)]  # 6 busy
    assert bridged([2], {0, 1, 3}, gpu.plain_cost) == [(2, 2)]
    assert bridged([], {0, 1}, gpu.plain_cost) == []


def test_drafts_alike_across_a_gap_cost_one_batch_with_fillers():
    """Seven sequences with a free slot among them (0-2 and 4-7): drafts alike cost two
    batches (57 + 44 ms for one row each on the CPU's costs); with the free slot filling
    the gap, one batch of eight (57 ms), and the step's rate is better."""
    from workers.engine.spans import bridged
    cpu = StepCosts.assumed()
    likely = [Proposal("history", 0, list(range(16)), 0.8)] * 7
    seqs = [0, 1, 2, 4, 5, 6, 7]

    def layout(k):
        cost_of = cpu.plain_cost if k == 0 else (lambda n: cpu.each_cost(n, k))
        return [b - a + 1 for a, b in bridged(seqs, {3}, cost_of)]
    assert layout(1) == [8] and layout(0) == [8]
    _, apart = each_plan(cpu, [3, 4], likely)
    k, rate = each_plan(cpu, [3, 4], likely, layout=layout)
    assert k >= 1 and rate > 1.2 * apart


def test_a_sequence_near_its_budget_keeps_a_step_from_drafts_alike():
    """Drafts alike give every sequence the same rows: one with fewer tokens left to its
    max_tokens than that would decode rows past its end, for nothing (its own drafts
    stop short of it), so such a step has no drafts alike. (Where the measured costs
    let a draft be one token long, as on a GPU: a longer shortest draft keeps such a
    sequence out already.)"""
    from types import SimpleNamespace

    from workers.engine.drafting import DraftPlanner

    def slot(i):
        return SimpleNamespace(seq=i, cached=[1, 2, 3], next_token=4, draft=[], busy=True,
                               line_done=True, n_past=4, budget=None, sampled=10,
                               sampled_aside=False, policy=Drafter(16, min_len=1))
    planner, generating = DraftPlanner(), [slot(i) for i in range(8)]
    assert planner._proposals(generating, generating, [], 4096)[1]
    generating[3].budget = 10 + 1 + EACH[-1]          # room for EACH[-1] rows: alike
    assert planner._proposals(generating, generating, [], 4096)[1]
    generating[3].budget -= 1                          # one row fewer: not alike
    assert not planner._proposals(generating, generating, [], 4096)[1]


def test_a_sample_that_fails_midway_through_a_draft_keeps_the_tokens_before_it(monkeypatch):
    """Verifying a draft samples its rows in turn; one that fails (a grammar past its
    cost, a ban that leaves nothing) at the third row must not take the two samples
    before it with it: plain decoding would have sent them in earlier steps. They come
    back, then the error; the KV cache keeps only the confirmed positions. (A stand-in
    engine around LlamaEngine._verify: no model.)"""
    from types import SimpleNamespace

    import workers.engine.llama as llama_module
    from dispatcher.common.protocol import StepTotals
    from workers.sampling import TokenOut

    removed = []
    monkeypatch.setattr(llama_module.llama_cpp, "llama_memory_seq_rm",
                        lambda memory, seq, keep, end: removed.append((seq, keep)) or True)
    samples = iter([TokenOut(7), TokenOut(8)])

    def sample(slot):
        token = next(samples, None)
        if token is None:
            raise ValueError("the grammar allows no token here")
        slot.row = -1
        return token

    engine = SimpleNamespace(_sample=sample, is_eog=lambda t: False, memory=None,
                             totals=StepTotals())
    policy = SimpleNamespace(tried=None, record=lambda drafted, accepted: None)
    slot = SimpleNamespace(draft=[7, 8, 9, 10], draft_rows=[1, 2, 3, 4], row=0, seq=3,
                           n_past=14, cached=list(range(14)), policy=policy)
    outs = llama_module.LlamaEngine._verify(engine, slot)
    assert [o.token for o in outs[:2]] == [7, 8] and outs[2].token == -1
    assert isinstance(outs[2].error, ValueError) and slot.row == -1
    # draft 7 confirmed (position 10); 8 is the next token to decode: positions 11- go
    assert removed == [(3, 11)] and slot.n_past == 11 and len(slot.cached) == 11
    assert engine.totals.accepted == 2                   # both samples matched their drafts
