"""What a decode step costs on this device, and which drafts pay in it.

`StepCosts`: the step times measured at start-up on the actual device for a few batch
shapes, kept current by the steps themselves. `plan`: a draft goes into a step when the
tokens it is expected to add (`speculation.Proposal.gain`) come at a better rate per
millisecond than the step already gives (its S sequences' tokens over its time), so
drafts run beside more sequences only where extra rows are cheap (a GPU) and when they
are long and likely.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from workers.engine.speculation import Proposal

SHAPES_EXTRA = (0, 4, 8, 16, 32, 64)   # draft rows measured beside the plain rows at start-up
OBSERVED_DOWN = 0.1     # how far (in log) one step faster than its shape's cost moves it
OBSERVED_UP = 0.03      # ... and one slower: the costs follow the fast steps (as the
                        # start-up's fastest runs do), not the average of noisy ones
OBSERVED_CLAMP = 2.0    # one step counts as at most this many times off


class StepCosts:
    """Milliseconds of one decode step by batch shape, measured at start-up: S sequences
    with one row each, plus D draft rows on one of them, for S in {1, 2, slots} and D in
    SHAPES_EXTRA; interpolated linearly between them (past the largest D along the last
    measured slope, past the most sequences by the per-sequence cost).

    Then kept current by the steps themselves (`observe`): a start-up measurement taken
    while the machine was busy (other workers loading, a build) is corrected by the real
    steps of the shapes that are run, so a draft that looked cheap and is not stops
    being chosen."""

    def __init__(self, sequences: tuple[int, ...], table: dict[tuple[int, int], float]):
        self.sequences = sequences
        self.table = table
        self.observed = 0               # steps that corrected the table

    @classmethod
    def measure(cls, timed_step, slots: int, repeats: int = 2) -> "StepCosts":
        """`timed_step(S, D)` decodes one batch of that shape and returns its seconds.
        Each shape's fastest run counts (a busy machine only adds to it), and a shape with
        more rows never counts as cheaper than one with fewer."""
        sequences = tuple(sorted({1, min(2, slots), max(1, slots)}))
        timed_step(sequences[-1], SHAPES_EXTRA[-1])          # warm-up
        costs = cls(sequences, {(s, d): 1000 * min(timed_step(s, d) for _ in range(repeats))
                                for s in sequences for d in SHAPES_EXTRA})
        for s in sequences:
            costs._order(s)
        return costs

    def _order(self, s: int) -> None:
        """A step of S sequences never costs less with more draft rows."""
        floor = 0.0
        for d in SHAPES_EXTRA:
            floor = self.table[s, d] = max(floor, self.table[s, d])

    @classmethod
    def assumed(cls) -> "StepCosts":
        """Figures measured on a 2-core AMD EPYC VM (bundled model), for tests."""
        return cls((1, 2, 8), {
            (1, 0): 12.5, (1, 4): 51.4, (1, 8): 56.9, (1, 16): 72.1, (1, 32): 126.4,
            (1, 64): 230.0,
            (2, 0): 24.9, (2, 4): 60.4, (2, 8): 68.0, (2, 16): 82.9, (2, 32): 137.3,
            (2, 64): 245.0,
            (8, 0): 42.0, (8, 4): 75.5, (8, 8): 85.5, (8, 16): 119.8, (8, 32): 148.3,
            (8, 64): 265.0})

    def _weights(self, sequences: int, extra: float) -> list[tuple[tuple[int, int], float]]:
        """The measured shapes around (sequences, extra) and their interpolation weights
        ([]: outside the measured range)."""
        def around(points, x):
            for lo, hi in zip(points, points[1:]):
                if lo <= x <= hi:
                    t = (x - lo) / (hi - lo)
                    return [(lo, 1 - t), (hi, t)]
            return [(points[0], 1.0)] if len(points) == 1 and x == points[0] else []
        rows, cols = around(self.sequences, sequences), around(SHAPES_EXTRA, extra)
        return [((s, d), ws * wd) for s, ws in rows for d, wd in cols
                if ws * wd > 0 and (s, d) in self.table]

    def observe(self, sequences: int, extra: int, ms: float) -> bool:
        """A real step of this shape took `ms`: move the shapes it lies between toward it,
        in log, each by its interpolation weight times OBSERVED_DOWN (faster) or
        OBSERVED_UP (slower), the ratio clamped to OBSERVED_CLAMP; then a row never
        costs less with more draft rows. False: a shape outside the measured range, left
        alone."""
        weights = self._weights(sequences, extra)
        predicted = self.cost(sequences, extra)
        if not weights or predicted <= 0 or ms <= 0:
            return False
        ratio = min(max(ms / predicted, 1 / OBSERVED_CLAMP), OBSERVED_CLAMP)
        rate = OBSERVED_DOWN if ratio < 1 else OBSERVED_UP
        for shape, weight in weights:
            self.table[shape] *= ratio ** (rate * weight)
        for s in {s for (s, _), _ in weights}:
            self._order(s)
        self.observed += 1
        return True

    def summary(self) -> dict[str, float]:
        return {f"{s}+{d}": round(ms, 1) for (s, d), ms in self.table.items()}

    @classmethod
    def load(cls, path: Path) -> "StepCosts | None":
        """Costs kept by `save` (None: none there, unreadable, or measured with other
        shapes than SHAPES_EXTRA: measure again)."""
        try:
            data = json.loads(path.read_text())
            kept = cls(tuple(data["sequences"]),
                       {(s, d): float(ms) for s, d, ms in data["table"]})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        shapes = {(s, d) for s in kept.sequences for d in SHAPES_EXTRA}
        return kept if set(kept.table) == shapes else None

    def save(self, path: Path) -> None:
        """Keep the costs for the next start (written whole or not at all)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}")
            partial.write_text(json.dumps({"sequences": self.sequences, "table": [
                [s, d, ms] for (s, d), ms in self.table.items()]}))
            os.replace(partial, path)
        except OSError:
            pass

    def _at(self, s: int, d: float) -> float:
        points = SHAPES_EXTRA
        for lo, hi in zip(points, points[1:]):
            if d <= hi or hi == points[-1]:
                a, b = self.table[s, lo], self.table[s, hi]
                return a + (b - a) * (d - lo) / (hi - lo)
        return self.table[s, points[0]]

    def cost(self, sequences: int, extra: float) -> float:
        known = self.sequences
        if sequences >= known[-1]:
            top = known[-1]
            return self._at(top, extra) + (sequences - top) * self._at(top, 0) / top
        for lo, hi in zip(known, known[1:]):
            if sequences <= hi:
                t = (max(sequences, lo) - lo) / (hi - lo)
                return (1 - t) * self._at(lo, extra) + t * self._at(hi, extra)
        return self._at(known[0], extra)


def plan(costs: StepCosts, sequences: int, proposals: list[tuple[object, Proposal]],
         lengths: tuple[int, ...] = (4, 8, 16, 32, 64), stretch: float | None = None
         ) -> dict[object, int]:
    """How many draft tokens each proposal gets in a step of `sequences` generating
    sequences. Greedily: the proposal and length that give the step the best rate (its
    tokens, drafts' expected ones included, over its time), while that beats the rate
    without it. `stretch`: the step with its drafts may take at most (1 + stretch) times
    the plain step (others are waiting on the worker: a request that arrives during a
    long step waits for it). Empty: no drafts."""
    extra, tokens = 0, float(sequences)
    chosen: dict[object, int] = {}
    left = list(proposals)
    ceiling = None if stretch is None else (1 + stretch) * costs.cost(sequences, 0)
    while left:
        now = costs.cost(sequences, extra)
        if now <= 0:
            break
        best = (tokens / now, None, 0, 0.0)
        for key, proposal in left:
            size = len(proposal.tokens)
            for length in [n for n in lengths if n < size] + [size]:
                gain = proposal.gain(length)
                cost = costs.cost(sequences, extra + length)
                if ceiling is not None and cost > ceiling:
                    break
                rate = (tokens + gain) / cost
                if rate > best[0]:
                    best = (rate, key, length, gain)
        _, key, length, gain = best
        if key is None:
            break
        chosen[key] = length
        extra += length
        tokens += gain
        left = [(k, p) for k, p in left if k != key]
    return chosen
