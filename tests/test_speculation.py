"""The drafter's sources and the per-step plan (workers/engine/speculation.py), as units:
token lists stand in for a sequence's context, and step costs are given tables."""
from workers.engine.speculation import (LONG_KEY, Drafter, Proposal, StepCosts, find_draft,
                                        matched, plan)

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


def test_misses_lower_a_source_and_fade_back():
    drafter = Drafter(16)
    context = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2, 3, 4]
    first = drafter.propose(context, 16)
    assert first is not None
    for _ in range(4):
        drafter.started(first, len(context))
        drafter.record(len(first.tokens), 0)
    low = drafter.propose(context, 16).rate
    assert low < first.rate
    for _ in range(200):
        drafter.propose(context, 16)
    assert drafter.propose(context, 16).rate > low


def sure(n: int = 16) -> Proposal:
    return Proposal("copy", 0, list(range(n)), 0.97)


def test_plan_drafts_alone_on_a_cpu_but_not_beside_seven_others():
    cpu = StepCosts.assumed()
    assert plan(cpu, 1, [("a", sure())]) == {"a": 16}
    assert plan(cpu, 8, [(i, sure()) for i in range(8)]) == {}


def test_plan_drafts_beside_many_sequences_where_rows_are_cheap():
    """A device where extra rows cost little (a GPU): drafts for all eight."""
    gpu = StepCosts((1, 8), {(1, d): 10.0 + 0.05 * d for d in (0, 4, 8, 16, 32)} |
                    {(8, d): 11.0 + 0.05 * d for d in (0, 4, 8, 16, 32)})
    chosen = plan(gpu, 8, [(i, sure()) for i in range(8)])
    assert sorted(chosen) == list(range(8)) and all(n >= 8 for n in chosen.values())


def test_plan_skips_unlikely_drafts():
    cpu = StepCosts.assumed()
    assert plan(cpu, 1, [("a", Proposal("short", 0, list(range(16)), 0.5))]) == {}


def test_step_costs_interpolate_and_extrapolate():
    costs = StepCosts.assumed()
    assert costs.cost(1, 0) < costs.cost(1, 4) < costs.cost(1, 32) < costs.cost(1, 40)
    assert costs.cost(1, 0) < costs.cost(4, 0) < costs.cost(8, 0) < costs.cost(12, 0)


def test_step_costs_measured_never_fall_with_more_rows():
    times = iter([0.05, 0.012, 0.012, 0.05, 0.05, 0.04, 0.04, 0.08, 0.08, 0.1, 0.1] +
                 [0.02] * 40)
    costs = StepCosts.measure(lambda s, d: next(times), 1)
    row = [costs.table[1, d] for d in (0, 4, 8, 16, 32)]
    assert row == sorted(row) and row[0] == 12.0


def test_find_draft_is_the_latest_occurrence():
    assert find_draft([1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 7, 8, 9, 0, 1, 2, 3], 4) == [7, 8, 9, 0]


def test_an_earlier_sequence_of_the_tenant_is_drafted_from():
    """The same request again (an editor asking for nearly the same completion): its
    answer comes from the earlier one's output in drafts, not token by token."""
    from workers.engine.speculation import History
    prompt = list(range(500, 540))
    output = list(range(600, 700))
    history = History()
    history.add(prompt + output, len(prompt))
    drafter = Drafter(16, history=history)
    steps, drafted, accepted = drive(drafter, prompt, output)
    assert accepted >= len(output) - 8 and steps <= 12
    assert drive(Drafter(16), prompt, output)[2] == 0      # without it: nothing to copy


def test_history_keeps_recent_sequences_only():
    from workers.engine import speculation
    from workers.engine.speculation import History
    history = History()
    for n in range(speculation.HISTORY_SEQUENCES + 4):
        history.add([n] * 3 + list(range(1000 + 100 * n, 1040 + 100 * n)), 3)
    assert len(history.sequences) == speculation.HISTORY_SEQUENCES
    assert history.lookup(list(range(1000, 1000 + LONG_KEY))) is None      # the oldest
    assert history.lookup(list(range(1000 + 100 * 19, 1000 + 100 * 19 + LONG_KEY)))
    live = set(history.sequences)
    assert all(seq in live for seq, _ in history.index.values())
