"""The decodes llama.cpp splits a step's batch into, and the filler rows that join them.
With a KV stream per sequence it decodes each run of consecutive sequence ids as a batch
of its own, each paying the weights' pass again: `seq_runs` counts the runs, `bridged`
joins them (and pads a lone run) with rows of free sequences where that is cheaper on the
measured costs, `spans_cost` prices the result. Used by first line first and the drafts
(`workers.engine.scheduling`, `workers.engine.drafting`), the engine's batch
(`workers.engine.llama`) and the choice of a free slot (`workers.engine.slots`)."""
from __future__ import annotations

from typing import Callable, Collection

from workers.engine.stepcosts import PLAIN_MAX

BRIDGE_SAVING = 0.05    # free sequences' filler rows join runs only for a step this much
                        # cheaper (see bridged)
PAD_PROBE_EVERY = 32    # ... and one step in this many that fillers would pad a lone run
                        # goes without them, its own cost observed (see bridged), and
PROBE_AGAIN_BELOW = 0.9  # ... the next one too where that step took less than this share
                        # of its shape's cost (a start-up measured too high, corrected)


def bridged(seqs: list[int], fillable: Collection[int], cost_of: Callable[[int], float]
            ) -> list[tuple[int, int]]:
    """The batches llama.cpp decodes `seqs` (sorted, distinct sequence ids with rows in
    a step) in, as (first, last) spans of ids. With a KV stream per sequence it decodes
    each run of consecutive ids as a batch of its own, each paying the weights' pass
    again; so free sequences (`fillable`: ids with no rows in the step whose caches can
    take rows past their end) may be given filler rows, removed after the step, that
    join runs into one span, where the spans cost at least BRIDGE_SAVING less by
    `cost_of(n)` (a batch of n sequences' rows) than the runs alone. Measured on the
    2-core EPYC, rows of sequences 0, 1, 3, 5, 6, 7: 70-77 ms as three batches, 47-51 ms
    as one of all eight (two filler rows). A span may also take free ids beside the runs,
    a lone run too: there a batch's rows go through the weights four at a time and the
    rows left over one by one, so five, six or seven rows cost more than eight (56, 62 and
    66 ms against 51 in this machine's start-up measurement), and 0-6 take a filler in 7.
    (The engine leaves one such padded step in PAD_PROBE_EVERY as it is, so the lone
    run's own cost stays observed, `StepCosts.observe`, and the next one too while such
    a step comes out under PROBE_AGAIN_BELOW of its cost: one measured too high on a
    busy start-up is corrected, not avoided for ever.) A span is at most PLAIN_MAX ids long
    (the plain steps measured); past BRIDGE_EXACT ids runs are only joined, not padded."""
    runs: list[tuple[int, int]] = []
    for seq in seqs:
        if runs and seq == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], seq)
        else:
            runs.append((seq, seq))
    present, free = set(seqs), set(fillable) - set(seqs)
    if not runs or not free:
        return runs
    top = max(max(seqs), max(free)) + 1
    price = tuple([0.0] + [cost_of(n) for n in range(1, top + 1)])
    key = (tuple(seqs), frozenset(free), price)
    if key not in _BRIDGED:
        if len(_BRIDGED) > BRIDGED_KEPT:
            _BRIDGED.clear()
        spans = _cheapest_spans(runs, present, free, top, price) if top <= BRIDGE_EXACT \
            else _merged_spans(runs, free, price)
        _BRIDGED[key] = runs if spans_cost(spans, price.__getitem__) > \
            (1 - BRIDGE_SAVING) * spans_cost(runs, price.__getitem__) else spans
    return _BRIDGED[key]


_BRIDGED: dict[tuple, list[tuple[int, int]]] = {}   # bridged's answers by shape and costs
BRIDGED_KEPT = 8192     # ... at most this many
BRIDGE_EXACT = 16       # ids up to which bridged tries every span; past them it joins
                        # neighbouring runs one by one (a step's planning stays short)


def _merged_spans(runs: list[tuple[int, int]], free: set[int], price: tuple
                  ) -> list[tuple[int, int]]:
    """Runs joined left to right with the next one wherever the gap between them is
    free and the joined span costs less than the two apart (`price[n]`)."""
    spans = [runs[0]]
    for first, last in runs[1:]:
        start, end = spans[-1]
        if last - start < PLAIN_MAX and all(q in free for q in range(end + 1, first)) and \
                price[last - start + 1] < price[end - start + 1] + price[last - first + 1]:
            spans[-1] = (start, last)
        else:
            spans.append((first, last))
    return spans


def _cheapest_spans(runs: list[tuple[int, int]], present: set[int], free: set[int],
                    top: int, price: tuple) -> list[tuple[int, int]]:
    """Every way of covering the runs with spans over free ids (at most PLAIN_MAX ids
    each, two spans never touching: llama.cpp would decode them as one), the cheapest
    by `price[n]`, fewest filler ids among equals."""
    # best[i]: (cost, filler ids) of the cheapest spans covering the ids in seqs below i
    # and not i - 1 (so a span may start at i); ended[i]: the same with a span ending at
    # i - 1, and where it began (came)
    best: list[tuple[float, int] | None] = [(0.0, 0)] + [None] * top
    ended: list[tuple[float, int] | None] = [None] * (top + 1)
    came: list[int] = [0] * (top + 1)
    skipped_from: list[bool] = [False] * (top + 1)   # best[i + 1] came from ended[i]

    def better(a: tuple[float, int], b: tuple[float, int] | None) -> bool:
        return b is None or (round(a[0], 6), a[1]) < (round(b[0], 6), b[1])
    for i in range(top):
        if i not in present:                    # i left out: from either state
            for state, after_span in ((best[i], False), (ended[i], True)):
                if state is not None and better(state, best[i + 1]):
                    best[i + 1], skipped_from[i + 1] = state, after_span
        if best[i] is None:
            continue
        fillers, covers = 0, False
        for j in range(i, min(top, i + PLAIN_MAX)):
            if j not in present and j not in free:
                break
            fillers += j not in present
            covers = covers or j in present
            total = (best[i][0] + price[j - i + 1], best[i][1] + fillers)
            if covers and better(total, ended[j + 1]):
                ended[j + 1], came[j + 1] = total, i
    ends = [(state, e, True) for e in range(runs[-1][1] + 1, top + 1)
            for state in [ended[e]] if state is not None] + \
        [(state, e, False) for e in range(runs[-1][1] + 1, top + 1)
         for state in [best[e]] if state is not None]
    _, end, in_span = min(ends, key=lambda x: (round(x[0][0], 6), x[0][1]))
    spans: list[tuple[int, int]] = []
    while end > 0:
        if in_span:
            start = came[end]
            spans.append((start, end - 1))
            end, in_span = start, False
        else:
            end, in_span = end - 1, skipped_from[end]
    spans.reverse()
    return spans


def spans_cost(spans: list[tuple[int, int]], cost_of: Callable[[int], float]) -> float:
    """What a step's batches (`bridged`'s spans) cost by `cost_of(n)`."""
    return sum(cost_of(last - first + 1) for first, last in spans)


def seq_runs(seqs: list[int]) -> list[int]:
    """The lengths of the runs of consecutive ids in sorted `seqs`: llama.cpp (KV cache per
    sequence) decodes each run in a batch of its own."""
    runs: list[int] = []
    for i, seq in enumerate(seqs):
        if i and seq == seqs[i - 1] + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs
