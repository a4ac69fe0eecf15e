"""What a decode step costs on this device, and which drafts pay in it.

`StepCosts`: the step times measured at start-up on the actual device for a few batch
shapes, kept current by the steps themselves. `plan`: a draft goes into a step when the
tokens it is expected to add (`speculation.Proposal.gain`) come at a better rate per
millisecond than the step already gives (its S sequences' tokens over its time), so
drafts run beside more sequences only where extra rows are cheap (a GPU) and when they
are long and likely.
"""
from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path
from typing import Callable

from workers.engine.speculation import FLOOR, FLOOR_LEAST, Proposal

# Draft rows measured beside the plain rows at start-up: both sides of each multiple of 4,
# since on a CPU with repacked weights a batch's output rows cost by their count modulo 4
# (llama.cpp multiplies four rows at a time and each one left over alone, reading the
# whole output matrix again): one sequence with 7 draft rows (8 outputs) costs less than
# with 4 (5 outputs). Those are also the draft lengths `plan` chooses from.
SHAPES_EXTRA = (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64)
PLAIN_MAX = 16          # plain steps (one row per sequence) measured for each count up to this
EACH = (1, 2)           # draft rows given to every generating sequence alike, measured for
                        # each count of sequences from 2 to PLAIN_MAX: llama.cpp decodes
                        # sequences with equal rows in one batch, unequal ones in several
OBSERVED_DOWN = 0.1     # how far (in log) one step faster than its shape's cost moves it
OBSERVED_UP = 0.03      # ... and one slower: the costs follow the fast steps (as the
                        # start-up's fastest runs do), not the average of noisy ones
OBSERVED_CLAMP = 2.0    # one step counts as at most this many times off
DRAFT_MARGIN = 0.1      # drafts go in only where they are expected to raise the step's
                        # rate by this much: a gain within the noise of the costs and of
                        # the acceptance measured is not worth a step that may be slower
OBSERVED_SPREAD = 0.5   # a step with drafts moves the other draft shapes of its row this much
                        # of what it moves its own (a busy start-up slowed them all)


# A 2-core AMD EPYC VM with repacked weights, the bundled model, 8 slots (StepCosts.assumed,
# for tests): one sequence's drafts cost least at 3, 7, 15, ... rows (4, 8, 16 outputs),
# beside others at 4, 8, 16 (llama.cpp decodes them in a batch of their own); 8 plain
# sequences cost less than 5, 6 or 7.
ASSUMED: dict[tuple[int, int], float] = {
    (1, 0): 12.9, (1, 1): 25.4, (1, 2): 32.6, (1, 3): 37.4, (1, 4): 56.0, (1, 7): 46.3,
    (1, 8): 64.8, (1, 15): 68.1, (1, 16): 74.9, (1, 31): 104.2, (1, 32): 112.4, (1, 63): 184.7,
    (1, 64): 209.9,
    (2, 0): 26.5, (2, 1): 47.0, (2, 2): 58.0, (2, 3): 58.6, (2, 4): 61.7, (2, 7): 96.0,
    (2, 8): 85.3, (2, 15): 111.5, (2, 16): 80.9, (2, 31): 154.5, (2, 32): 126.1, (2, 63): 239.4,
    (2, 64): 228.2,
    (3, 0): 34.7, (4, 0): 37.1, (5, 0): 56.8, (6, 0): 58.7, (7, 0): 62.4,
    (8, 0): 46.3, (8, 1): 57.7, (8, 2): 70.9, (8, 3): 80.1, (8, 4): 84.1, (8, 7): 109.3,
    (8, 8): 93.2, (8, 15): 126.6, (8, 16): 98.2, (8, 31): 182.8, (8, 32): 150.9, (8, 63): 246.5,
    (8, 64): 243.6,
}
# ... and with 1 or 2 draft rows on each of S sequences: 8 with one each (16 outputs, one
# batch) cost 1.2-1.35 times the plain step, one draft beside 7 others more
ASSUMED_EACH: dict[tuple[int, int], float] = {
    (2, 1): 34.5, (2, 2): 55.1, (3, 1): 57.4, (3, 2): 62.2, (4, 1): 44.0, (4, 2): 54.9,
    (5, 1): 62.3, (5, 2): 80.3, (6, 1): 54.7, (6, 2): 80.2, (7, 1): 78.0, (7, 2): 90.3,
    (8, 1): 57.2, (8, 2): 80.9,
}


HOST_GAPS = 15          # gaps between decodes whose median is the host's time (HostTime)


class HostTime:
    """The host's milliseconds between two decodes (planning, sampling, the worker's
    messages; not a draft model's decodes, `drafted` seconds): the median of the last
    HOST_GAPS gaps after a decode that some sequence still needed (the worker went on
    at once; one it waited out idle is one of many in the median); not yet known
    (infinite) before half as many. What holding generating sequences back a step
    costs each of them (`scheduling.prompt_first`)."""

    def __init__(self) -> None:
        self.gaps: collections.deque = collections.deque(maxlen=HOST_GAPS)
        self.since: float | None = None     # the last decode's end, if the next counts
        self.drafted = 0.0                  # s of the draft model's decodes since then

    @property
    def ms(self) -> float:
        gaps = sorted(self.gaps)
        return gaps[len(gaps) // 2] if len(gaps) >= HOST_GAPS // 2 else float("inf")

    def decoded(self, started: float, ended: float, goes_on: bool) -> None:
        """A decode ran from `started` to `ended`; `goes_on`: a sequence still needs
        the next (so the gap to it is the host's)."""
        if self.since is not None:
            self.gaps.append(1000 * (started - self.since - self.drafted))
        self.since = ended if goes_on else None

    def idle(self) -> None:
        """No sequence left: the worker may wait for the next request."""
        self.since = None


def draft_rows(slots: int) -> int:
    """The most rows one measured step of `slots` sequences with drafts holds (the batch
    must: llama.cpp's batch arrays are that long and written unchecked)."""
    sequences, _ = StepCosts.shapes(slots)
    return max(sequences[-1] + SHAPES_EXTRA[-1], max(slots, 2) * (1 + EACH[-1]))


class StepCosts:
    """Milliseconds of one decode step by batch shape, measured at start-up: a plain step
    (one row a sequence) of every count of sequences up to the slots (PLAIN_MAX at most),
    and S sequences plus D draft rows on one of them, for S in {1, 2, slots} and D in
    SHAPES_EXTRA. A plain step costs its own figure; a step with drafts costs the plain
    one plus what the draft rows add, interpolated linearly between the measured S and D
    (past the largest D along the last measured slope, past the most sequences by the
    per-sequence cost). Costs need not grow with the rows (see SHAPES_EXTRA); a step
    with drafts never counts as cheaper than the plain one.

    Then kept current by the steps themselves (`observe`): a start-up measurement taken
    while the machine was busy (other workers loading, a build) is corrected by the real
    steps of the shapes that are run, so a draft that looked cheap and is not stops
    being chosen."""

    def __init__(self, sequences: tuple[int, ...], table: dict[tuple[int, int], float],
                 each: dict[tuple[int, int], float] | None = None,
                 full_step_s: float | None = None):
        self.sequences = sequences      # the counts of sequences measured with drafts
        self.table = table
        self.plain = sorted(s for s, d in table if d == 0)
        self.each = each or {}          # (S, k): S sequences with k draft rows each
        self.observed = 0               # steps that corrected the table
        self.last_ratio = 1.0           # ... the last one's time over its shape's cost then
        # seconds of a full batch's prompt chunk, measured with the table (the watchdog's
        # --step-timeout auto, costprobe.full_step_seconds); None: not measured
        self.full_step_s = full_step_s

    @staticmethod
    def shapes(slots: int) -> tuple[tuple[int, ...], set[tuple[int, int]]]:
        """The counts of sequences measured with drafts, and every (S, D) measured."""
        sequences = tuple(sorted({1, min(2, slots), min(8, slots), max(1, slots)}))
        return sequences, ({(s, d) for s in sequences for d in SHAPES_EXTRA} |
                           {(s, 0) for s in StepCosts.counts(slots)})

    @staticmethod
    def counts(slots: int) -> list[int]:
        """The sequence counts measured plainly: each up to PLAIN_MAX, then the powers of
        two and `slots` itself, so no configured count is extrapolated."""
        return sorted({*range(1, min(slots, PLAIN_MAX) + 1), max(1, slots),
                       *(1 << k for k in range(5, max(slots, 1).bit_length())
                         if 1 << k < slots)})

    @staticmethod
    def each_shapes(slots: int) -> set[tuple[int, int]]:
        """Every (S, k) measured with k draft rows on each of S sequences."""
        return {(s, k) for s in StepCosts.counts(slots) if s >= 2 for k in EACH}

    @classmethod
    def measure(cls, timed_step, slots: int, repeats: int = 2, budget: float | None = None,
                clock=time.perf_counter) -> "StepCosts":
        """`timed_step(S, D, each)` decodes one batch of that shape (D draft rows on the
        first sequence, or with `each` on every one) and returns its seconds. Each shape's
        fastest run counts (a busy machine only adds to it); the repeats go round all the
        shapes, so a slow moment does not fall on one shape twice. Past `budget` seconds
        no further round starts (a slow device, or a busy machine, measures every shape
        once: the steps correct the figures, `observe`)."""
        started = clock()
        sequences, shapes = cls.shapes(slots)
        timed_step(sequences[-1], SHAPES_EXTRA[-1], False)           # warm-up
        table: dict[tuple[int, int], float] = {}
        each: dict[tuple[int, int], float] = {}
        for round_ in range(repeats + 1):       # (one more round for the alike shapes,
            if round_ and budget is not None and clock() - started > budget:
                break
            for into, alike, todo in ((table, False, shapes), (each, True,   # fewer and
                                                               cls.each_shapes(slots))):
                if round_ == repeats and not alike:                  # noisier for it)
                    continue
                for shape in sorted(todo):
                    ms = 1000 * timed_step(*shape, alike)
                    into[shape] = min(ms, into.get(shape, ms))
        costs = cls(sequences, table, each)
        for s in sequences:
            costs._floor(s)
        return costs

    def _floor(self, s: int) -> None:
        """A step of S sequences with drafts never costs less than without."""
        for d in SHAPES_EXTRA[1:]:
            self.table[s, d] = max(self.table[s, 0], self.table[s, d])

    @classmethod
    def assumed(cls) -> "StepCosts":
        """Figures measured on a 2-core AMD EPYC VM with repacked weights (bundled model,
        8 slots), for tests."""
        return cls((1, 2, 8), dict(ASSUMED), dict(ASSUMED_EACH))

    def _weights(self, sequences: int, extra: float) -> list[tuple[tuple[int, int], float]]:
        """The measured shapes around (sequences, extra) and their interpolation weights
        ([]: outside the measured range)."""
        def around(points, x):
            for lo, hi in zip(points, points[1:]):
                if lo <= x <= hi:
                    t = (x - lo) / (hi - lo)
                    return [(lo, 1 - t), (hi, t)]
            return [(points[0], 1.0)] if len(points) == 1 and x == points[0] else []
        if extra == 0:                  # a plain step: between the plain steps measured
            if (sequences, 0) in self.table:
                return [((sequences, 0), 1.0)]
            return [((s, 0), w) for s, w in around(self.plain, sequences) if w > 0]
        rows, cols = around(self.sequences, sequences), around(SHAPES_EXTRA, extra)
        return [((s, d), ws * wd) for s, ws in rows for d, wd in cols
                if ws * wd > 0 and (s, d) in self.table]

    def observe(self, sequences: int, extra: int, ms: float, each: bool = False) -> bool:
        """A real step of this shape took `ms`: move the shapes it lies between toward it,
        in log, each by its interpolation weight times OBSERVED_DOWN (faster) or
        OBSERVED_UP (slower), the ratio clamped to OBSERVED_CLAMP, and the other draft
        shapes of the same rows by OBSERVED_SPREAD of that; a plain step moves the draft
        shapes of its rows (drafts alike included) as much as itself: their ratio to it,
        measured together at start-up, stands until a step with them runs (what made the
        plain step cheaper, shorter contexts than the probe's or a quieter machine, makes
        them cheaper too; moving the plain shape alone made every draft beside it look
        dearer step by step, one row on each of eight sequences from 1.39 to 1.6-1.8
        plain steps here, and kept such drafts out for good). Then a step with drafts
        never costs less than without. False: a shape outside the measured range, left
        alone."""
        if each:                # `extra` draft rows on each sequence: that shape alone
            predicted = self.each.get((sequences, extra), 0.0)
            if predicted <= 0 or ms <= 0:
                return False
            self.last_ratio = ms / predicted
            ratio = min(max(ms / predicted, 1 / OBSERVED_CLAMP), OBSERVED_CLAMP)
            self.each[sequences, extra] = predicted * ratio ** (
                OBSERVED_DOWN if ratio < 1 else OBSERVED_UP)
            self.observed += 1
            return True
        weights = self._weights(sequences, extra)
        predicted = self.cost(sequences, extra)
        if not weights or predicted <= 0 or ms <= 0:
            return False
        self.last_ratio = ms / predicted
        ratio = min(max(ms / predicted, 1 / OBSERVED_CLAMP), OBSERVED_CLAMP)
        rate = OBSERVED_DOWN if ratio < 1 else OBSERVED_UP
        for shape, weight in weights:
            self.table[shape] *= ratio ** (rate * weight)
        spread = OBSERVED_SPREAD if extra > 0 else 1.0
        for s in {s for (s, _), _ in weights}:     # the other draft shapes of those rows
            factor = ratio ** (rate * spread * sum(w for (r, _), w in weights if r == s))
            for d in SHAPES_EXTRA[1:]:
                if (s, d) in self.table and all(shape != (s, d) for shape, _ in weights):
                    self.table[s, d] *= factor
            if extra == 0:
                for shape in [shape for shape in self.each if shape[0] == s]:
                    self.each[shape] = max(self.each[shape] * factor, self.plain_cost(s))
        for s in {s for (s, _), _ in weights} & set(self.sequences):
            self._floor(s)
        self.observed += 1
        return True

    def summary(self) -> dict[str, float]:
        return {f"{s}+{d}": round(ms, 1) for (s, d), ms in self.table.items()} | {
            f"{s}x{k + 1}": round(ms, 1) for (s, k), ms in self.each.items()}

    @classmethod
    def load(cls, path: Path) -> "StepCosts | None":
        """Costs kept by `save` (None: none there, unreadable, or measured with other
        shapes than SHAPES_EXTRA: measure again)."""
        try:
            data = json.loads(path.read_text())
            kept = cls(tuple(data["sequences"]),
                       {(s, d): float(ms) for s, d, ms in data["table"]},
                       {(s, k): float(ms) for s, k, ms in data["each"]},
                       float(data["full_step_s"]) if data.get("full_step_s") else None)
            sequences, shapes = cls.shapes(kept.sequences[-1])
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None
        return kept if (sequences, set(kept.table), set(kept.each)) == (
            kept.sequences, shapes, cls.each_shapes(sequences[-1])) else None

    def save(self, path: Path) -> None:
        """Keep the costs for the next start (written whole or not at all)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}")
            partial.write_text(json.dumps({
                "sequences": self.sequences,
                "table": [[s, d, ms] for (s, d), ms in self.table.items()],
                "each": [[s, k, ms] for (s, k), ms in self.each.items()],
                "full_step_s": self.full_step_s}))
            os.replace(partial, path)
        except OSError:
            pass

    def _at(self, s: int, d: float) -> float:
        """Linear between the measured draft rows; past the largest, along the slope from
        the one half its size (two points of the same count modulo 4)."""
        points = SHAPES_EXTRA
        top = points[-1]
        if d > top:
            half = max(p for p in points if p <= top // 2)
            slope = max(0.0, (self.table[s, top] - self.table[s, half]) / (top - half))
            return self.table[s, top] + slope * (d - top)
        for lo, hi in zip(points, points[1:]):
            if d <= hi:
                a, b = self.table[s, lo], self.table[s, hi]
                return a + (b - a) * (d - lo) / (hi - lo)
        return self.table[s, points[0]]

    def plain_cost(self, sequences: int) -> float:
        """A step of one row for each of `sequences` sequences (none: nothing)."""
        if sequences <= 0:
            return 0.0
        if (sequences, 0) in self.table:
            return self.table[sequences, 0]
        known = self.plain
        if sequences >= known[-1]:
            return self.table[known[-1], 0] * sequences / known[-1]
        for lo, hi in zip(known, known[1:]):
            if sequences <= hi:
                t = (max(sequences, lo) - lo) / (hi - lo)
                return (1 - t) * self.table[lo, 0] + t * self.table[hi, 0]
        return self.table[known[0], 0]

    def rates(self, slots: int) -> list[float]:
        """Tokens a second each sequence gets in plain steps of 1, 2, ... `slots`
        sequences (what the dispatcher routes by: `dispatcher.routing.expected_rate`)."""
        return [round(1000.0 / cost, 2) if (cost := self.plain_cost(n)) > 0 else 0.0
                for n in range(1, slots + 1)]

    def cost(self, sequences: int, extra: float) -> float:
        plain = self.plain_cost(sequences)
        if extra <= 0:
            return plain
        known = self.sequences
        if sequences >= known[-1]:
            return plain + self._at(known[-1], extra) - self.table[known[-1], 0]
        for lo, hi in zip(known, known[1:]):
            if sequences <= hi:
                t = (max(sequences, lo) - lo) / (hi - lo)
                return plain + (1 - t) * (self._at(lo, extra) - self.table[lo, 0]) + \
                    t * (self._at(hi, extra) - self.table[hi, 0])
        return plain + self._at(known[0], extra) - self.table[known[0], 0]


    def shortest_draft(self, margin: float = DRAFT_MARGIN) -> int:
        """The fewest draft tokens that could pay on this device: the shortest draft whose
        step, were every token kept, gives a lone sequence (1 + margin) times its plain
        rate. Shorter ones never pay whatever their acceptance, so lookups need not offer
        them (a CPU: 2-4 tokens; a GPU, where a row is nearly free: 1). None pays at all:
        the longest measured draft (`plan` then chooses none)."""
        plain = self.cost(1, 0)
        for length in range(1, SHAPES_EXTRA[-1] + 1):
            if (1 + length) * plain >= (1 + margin) * self.cost(1, length):
                return length
        return SHAPES_EXTRA[-1]

    def floor_share(self, longest: int = SHAPES_EXTRA[-1]) -> float:
        """The share of a source's draft tokens kept in a sequence below which it drafts
        no more there (`speculation.Drafter.floor`): the least share a lone sequence's
        draft of at most `longest` tokens (its `--draft-max`) must keep to pay for its
        rows, over the measured lengths, at most FLOOR and at least FLOOR_LEAST. A CPU's
        rows cost ~0.2 of a plain step each even 63 at a time: about a fifth (a quarter
        where drafts are held to 16 or fewer). Where rows are nearly free (a GPU), a
        source keeping a few tokens of its 64-token drafts still pays, and a fixed
        quarter stopped it (first-seen answers replayed on a GPU-like table: eight
        streams 1.2x faster than without drafts under the quarter, 1.5x under the
        device's share; docs/design.md)."""
        plain = self.cost(1, 0)
        lengths = [n for n in SHAPES_EXTRA[1:] if n <= longest]
        if plain <= 0 or not lengths:
            return FLOOR
        share = min((self.cost(1, n) - plain) / (n * plain) for n in lengths)
        return min(FLOOR, max(FLOOR_LEAST, share))

    def each_cost(self, sequences: int, rows: int) -> float:
        """A step of `sequences` sequences with `rows` draft rows on each (one sequence:
        its draft shape; a count not measured: the nearest measured one below, scaled by
        the plain steps; none measured: every draft row on one sequence)."""
        if sequences <= 1:
            return self.cost(1, rows)
        if (sequences, rows) in self.each:
            return self.each[sequences, rows]
        below = [s for s, k in self.each if k == rows and s < sequences]
        if not below:
            return self.cost(sequences, sequences * rows)
        s = max(below)
        return self.each[s, rows] * self.plain_cost(sequences) / self.plain_cost(s)

def plan(costs: StepCosts, sequences: int, proposals: list[tuple[object, Proposal]],
         lengths: tuple[int, ...] = SHAPES_EXTRA[1:], stretch: float | None = None
         ) -> dict[object, int]:
    """How many draft tokens each proposal gets in a step of `sequences` generating
    sequences: the drafts that give the step the best rate (its tokens, drafts' expected
    ones included, over its time), if that beats the rate without them. Drafts on
    several sequences are all of one length: llama.cpp decodes the rows of sequences
    with equal counts in one batch, and each further length in a batch of its own (8
    sequences with drafts of 3 and 3 cost what one of 6 does; of 15 and 4, ~40 ms more
    than one of 19: measured). So for each length (a measured one, or a proposal's
    whole), the proposals at least that long join, likeliest first, while each raises
    the rate; the best length wins. `stretch`: the step with its drafts may take at most
    (1 + stretch) times the plain step (others are waiting on the worker: a request that
    arrives during a long step waits for it). A draft model's proposal also costs the
    decodes that make its tokens (`Proposal.make_cost`), counted in the step's time.
    Empty: no drafts."""
    plain = costs.cost(sequences, 0)
    if plain <= 0:
        return {}
    ceiling = None if stretch is None else (1 + stretch) * plain
    best_rate, best = sequences / plain, {}
    candidates = {n for _, p in proposals
                  for n in [m for m in lengths if m < len(p.tokens)] + [len(p.tokens)]}
    for length in sorted(candidates):
        able = sorted(((p.gain(length), -p.make_cost(length), i, key)
                       for i, (key, p) in enumerate(proposals)
                       if len(p.tokens) >= length), reverse=True)
        chosen: dict[object, int] = {}
        tokens, rate, making = float(sequences), sequences / plain, 0.0
        for gain, make, _, key in able:     # (make: minus what making the draft costs)
            cost = costs.cost(sequences, length * (len(chosen) + 1)) + making - make
            if ceiling is not None and cost > ceiling:
                continue                    # (a longer draft may cost less: SHAPES_EXTRA;
                                            # one made for free may still fit)
            if (tokens + gain) / cost <= rate:
                continue
            chosen[key] = length
            tokens += gain
            making -= make
            rate = tokens / cost
        if chosen and rate > best_rate and rate > (1 + DRAFT_MARGIN) * sequences / plain:
            best_rate, best = rate, chosen
    return best


def step_rate(costs: StepCosts, sequences: int, proposals: dict[object, Proposal],
              chosen: dict[object, int]) -> float:
    """Tokens a millisecond a step of `sequences` sequences is expected to give with the
    `chosen` drafts (key -> length) of `proposals`, making them included."""
    plain = costs.cost(sequences, 0)
    if plain <= 0:
        return 0.0
    gain = sum(proposals[k].gain(n) for k, n in chosen.items())
    step = costs.cost(sequences, sum(chosen.values())) + \
        sum(proposals[k].make_cost(n) for k, n in chosen.items())
    return (sequences + gain) / step


def each_plan(costs: StepCosts, runs: list[int], proposals: list[Proposal],
              stretch: float | None = None, layout: Callable[[int], list[int]] | None = None,
              probe: bool = False) -> tuple[int, float]:
    """How many draft rows every generating sequence gets alike (k in EACH, 0: none) and
    the rate (tokens a millisecond) that gives the step: the plain step's when no k beats
    it. `runs`: the lengths of the runs of consecutive sequence ids (each is a batch of its
    own in llama.cpp); `proposals`: the sequences' drafts (a sequence without one carries
    a guess, counted as adding nothing). On a CPU with repacked weights eight sequences
    with one draft row each (16 outputs) cost ~1.25 times the plain step: likely drafts
    on most of them pay, where a draft on one alone (a batch of its own) does not.
    `layout(k)`: the batches' sizes with k draft rows each (runs joined by filler rows:
    `spans.bridged`); without it, the runs. `probe`: where no k clears the margin,
    one row each if that raises the rate at all (its cost and acceptance measured by
    the step: `drafting.DraftPlanner._drafts_alike`)."""
    sequences = sum(runs)
    plain = sum(costs.plain_cost(r) for r in (layout(0) if layout else runs))
    best = (0, sequences / plain if plain > 0 else 0.0)
    if sequences < 2 or plain <= 0:
        return best
    for k in EACH:
        step = sum(costs.each_cost(r, k) for r in (layout(k) if layout else runs))
        if stretch is not None and step > (1 + stretch) * plain:
            continue
        rate = (sequences + sum(p.gain(k) for p in proposals)) / step
        margin = 0.0 if probe and k == EACH[0] else DRAFT_MARGIN
        if rate > best[1] and rate > (1 + margin) * sequences / plain:
            best = (k, rate)
    return best
