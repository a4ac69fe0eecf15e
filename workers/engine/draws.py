"""A sampled token drawn over the logits row here, where llama.cpp's chain would first copy
the whole vocabulary.

`llama_sampler_sample` builds a candidate array of every token (262,144 for Gemma 3)
for each row before its samplers look at it, and top-p sorts what it is given: measured
in-process on this project's 2-core CPU with the bundled model, 2.9 ms a row at
temperature 0.8 alone and 3.8 ms with top-p 0.95, against 0.24 ms for a greedy row. That
is host work paid per sampled row, beside the device's step: one sampled stream's
sampling was a fifth of its step here, and on a GPU, where a step of sixteen rows takes
a few milliseconds, sixteen such draws would take longer than the step.

For the chains OpenAI-style clients send (top-k, top-p, min-p and temperature, in any
order, nothing that depends on the sequence's history, no grammar: `host_drawable`)
`HostDraw` makes the same cuts and the draw with one pass over the whole vocabulary
(the tokens within FLOOR nats of the likeliest; the rest hold under 10**-12 of the
mass), then over those alone: top-k by partition, top-p by sorting them, min-p as
llama.cpp's logit threshold, temperature as a scale; then one seeded draw from what is
left. The distribution is llama.cpp's (the
kept set and its weights, to float rounding: tests/test_engine.py compares them with
llama.cpp's own samplers); the random stream is numpy's, seeded from the request's seed,
so a seed still repeats a text, though not llama.cpp's text for that seed.
"""
from __future__ import annotations

import math

import numpy as np

from workers.sampling import SamplingParams

# Samplers whose settings do nothing (as llama.cpp's chain leaves them out), by name
IDLE = {"penalties": lambda p: not p.penalized, "dry": lambda p: p.dry_multiplier <= 0,
        "top_n_sigma": lambda p: p.top_n_sigma < 0, "typ_p": lambda p: p.typical_p >= 1.0,
        "xtc": lambda p: p.xtc_probability <= 0.0}
CUTS = ("top_k", "top_p", "min_p", "temperature")
# Tokens less likely than e**-FLOOR times the likeliest, at every scale the chain weighs
# them, are left out before anything else: together under 10**-12 of the mass for a
# vocabulary of 262,144 (far below float32's rounding in llama.cpp's own sums), and the
# whole-vocabulary passes are then one comparison and no exp
FLOOR = 40.0
TOP_P_START = 1e-4          # top-p: the first weight threshold (relative to the likeliest),
TOP_P_LOWER = 1e-3          # ... lowered by this much while the tokens above hold too
                            # little of the mass it needs
BLOCK = 512                 # the draw's inverse CDF: tokens summed a block at a time


def host_drawable(p: SamplingParams) -> bool:
    """Whether `HostDraw` makes this chain's draw: a draw (not greedy, not Mirostat or
    dynamic temperature), with no logit bias or grammar, no sampler at work but top-k,
    top-p, min-p and temperature, and not top-k first (llama.cpp's own top-k shrinks the
    array before anything else looks at it, as cheaply as a partition here)."""
    if p.greedy or p.mirostat or p.dynatemp_range > 0 or p.logit_bias or \
            p.grammar is not None:
        return False
    active = [name for name in p.order if not (name in IDLE and IDLE[name](p))]
    working = [name for name in active if name != "top_k" or p.top_k > 0]
    return all(name in CUTS for name in active) and bool(working) and \
        working[0] != "top_k"


class HostDraw:
    def __init__(self, p: SamplingParams):
        self.order = p.order
        self.top_k, self.top_p, self.min_p = p.top_k, p.top_p, p.min_p
        self.temperature = p.temperature
        # a request's seed repeats its text; without one, a draw of its own (llama.cpp's
        # LLAMA_DEFAULT_SEED means "random": numpy's fixed seed of that value would not)
        self.rng = np.random.default_rng(None if p.seed is None else p.seed32)
        # the smallest scale a token's weight is taken at (top-p before the temperature
        # weighs at 1), so that FLOOR holds at each
        scales, scale = [], 1.0
        for name in self.order:
            if name == "top_p" and self.top_p < 1.0:
                scales.append(scale)
            elif name == "temperature":         # (named twice: applied twice, as llama.cpp)
                scale /= self.temperature
        self.floor = FLOOR / min(scales + [scale])

    def kept(self, logits: np.ndarray) -> tuple[np.ndarray, float]:
        """The tokens the chain's cuts leave and the scale on their logits (1 /
        temperature) when the draw is made."""
        if not np.isfinite(logits.max()):      # a NaN (or +inf) logit: as a -inf one
            logits = np.nan_to_num(logits, nan=-np.inf, posinf=np.finfo(np.float32).max)
        ids, scale = np.flatnonzero(logits >= logits.max() - self.floor), 1.0
        for name in self.order:
            if name == "top_k" and 0 < self.top_k < len(ids):
                ids = ids[np.argpartition(logits[ids], -self.top_k)[-self.top_k:]]
            elif name == "top_p" and self.top_p < 1.0:
                ids = nucleus(logits, ids, scale, self.top_p)
            elif name == "min_p" and self.min_p > 0.0:
                values = logits[ids]
                ids = ids[(values - values.max()) * scale >= math.log(self.min_p)]
            elif name == "temperature":
                scale /= self.temperature
        return ids, scale

    def draw(self, logits: np.ndarray) -> int:
        if not np.isfinite(logits.max()):
            logits = np.nan_to_num(logits, nan=-np.inf, posinf=np.finfo(np.float32).max)
        ids, scale = self.kept(logits)
        values = logits[ids]
        weights = np.exp((values - values.max()) * np.float32(scale))
        # inverse CDF a block at a time: the block's sums, then the one block's own
        starts = np.arange(0, len(weights), BLOCK)
        sums = np.cumsum(np.add.reduceat(weights, starts, dtype=np.float64))
        target = self.rng.random() * sums[-1]
        block = min(int(np.searchsorted(sums, target, side="right")), len(sums) - 1)
        before = sums[block - 1] if block else 0.0
        inside = np.cumsum(weights[starts[block]:starts[block] + BLOCK], dtype=np.float64)
        i = min(int(np.searchsorted(inside, target - before, side="right")), len(inside) - 1)
        return int(ids[starts[block] + i])


def nucleus(logits: np.ndarray, ids: np.ndarray, scale: float, p: float) -> np.ndarray:
    """top-p over the tokens `ids` at logits × `scale`: the likeliest until their
    probability reaches `p`, at least one (llama.cpp's rule). Sorted are only the tokens
    above a weight threshold, lowered until they hold that mass: every token below it is
    less likely than each above, so the cut is the one a sort of all would find."""
    values = logits[ids]
    weights = np.exp((values - values.max()) * np.float32(scale))
    need = p * weights.sum(dtype=np.float64)
    threshold = TOP_P_START
    while True:
        above = np.flatnonzero(weights >= threshold)
        if threshold <= 0.0 or weights[above].sum(dtype=np.float64) >= need:
            break
        threshold = threshold * TOP_P_LOWER if threshold > 1e-30 else 0.0
    ranked = above[np.argsort(-weights[above], kind="stable")]
    cum = np.cumsum(weights[ranked], dtype=np.float64)
    n = min(int(np.searchsorted(cum, need, side="left")) + 1, len(ranked))
    return ids[ranked[:n]]
