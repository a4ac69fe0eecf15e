"""Sampling set aside: a sequence whose sampler chain costs a good share of the device's
step is sampled on a thread of its own, beside the next step, which it sits out.

Some of llama.cpp's samplers sort the whole vocabulary for every token: typical_p and
XTC without a top_k before them, Mirostat (Gemma 3's 262,144 candidates: 25-40 ms a token
on this project's CPU, where the step itself is ~20 ms). Sampled where the others are,
on the generation thread between two steps, that time was every stream's: one request
with `typical_p` made every other stream of the worker half as fast, and on a GPU, whose
step takes a few milliseconds, several times slower. Set aside, the costly sequence pays
it alone: its row's logits are copied (the next step overwrites them), drawn from by its
own chain on the side thread (llama.cpp's `llama_sampler_sample`, over the copy: the same
token), while the step goes on without it; it joins the step after its draw is in.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from workers.engine.samplers import Candidates

# A sequence is sampled aside once its measured sampling takes more than this share of
# the device's measured step (an aside draw costs the sequence a step: worth it only where
# its sampling is about that long anyway; a greedy argmax or a host draw never is)
ASIDE_SHARE = 0.5
WAIT_SECONDS = 0.1      # a step with nothing else to decode waits this long for a draw


@dataclass
class Draw:
    """What the side thread made of one sequence's row."""
    token: int = -1
    logprob: float | None = None
    top: list | None = None
    seconds: float = 0.0
    error: Exception | None = None


def top_of(logits: np.ndarray, lse: float, k: int) -> list[tuple[int, float]]:
    """The `k` likeliest tokens of a logits row with their logprobs, likeliest first."""
    k = min(k, len(logits))
    if k <= 0:
        return []
    top = np.argpartition(logits, -k)[-k:]
    top = top[np.argsort(-logits[top])]
    return [(int(t), float(logits[t] - lse)) for t in top]


def log_sum_exp(logits: np.ndarray) -> float:
    peak = float(logits.max())
    return peak + float(np.log(np.exp(logits - peak).sum()))


class AsideDraws:
    """The side thread, its own candidate buffer, and the draws in flight by slot."""

    def __init__(self, lib, n_vocab: int, eog_tokens: list[int], banned: float):
        self.lib, self.n_vocab = lib, n_vocab
        self.eog_tokens, self.banned = eog_tokens, banned
        self.eog_set = frozenset(eog_tokens)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="sample")
        self._candidates: Candidates | None = None     # made on first use (3 MB)
        self.pending: dict[int, Future] = {}
        self.draws = 0                                 # made aside, in all

    @staticmethod
    def worth(sample_ms: float, step_ms: float) -> bool:
        return step_ms > 0 and sample_ms > ASIDE_SHARE * step_ms

    def submit(self, slot_id: int, chain, logits: np.ndarray, ban_ends: bool,
               top_k: int | None) -> None:
        """Draw the slot's next token from a copy of `logits` (its row, which the next
        step overwrites) with `chain` (the slot's: nothing else touches it meanwhile);
        `ban_ends`: no end-of-generation token (ignore_eos, min_tokens); `top_k`: report
        the top so many with their logprobs (None: no logprobs)."""
        if self._candidates is None:
            self._candidates = Candidates(self.lib, self.n_vocab)
        row = np.array(logits, dtype=np.float32, copy=True)
        self.pending[slot_id] = self.executor.submit(self._draw, chain, row, ban_ends, top_k)
        self.draws += 1

    def _draw(self, chain, logits: np.ndarray, ban_ends: bool, top_k: int | None) -> Draw:
        started = time.perf_counter()
        lse = top = None
        if top_k is not None:                   # (of the row as the model gave it)
            lse = log_sum_exp(logits)
            top = top_of(logits, lse, top_k)
        view = logits
        if ban_ends:
            view = logits.copy()
            view[self.eog_tokens] = self.banned
        token = chain.sample_row(view, self._candidates)
        if ban_ends:
            token = chain.ends_ok(token, view, self.eog_set.__contains__)
        return Draw(token, None if lse is None else float(logits[token] - lse), top,
                    time.perf_counter() - started)

    def ready(self, block: bool = False) -> dict[int, Draw]:
        """The draws done (`block`: waiting up to WAIT_SECONDS for one if none is)."""
        if block and self.pending and not any(f.done() for f in self.pending.values()):
            wait(list(self.pending.values()), timeout=WAIT_SECONDS,
                 return_when=FIRST_COMPLETED)
        done = {}
        for slot_id, future in list(self.pending.items()):
            if future.done():
                del self.pending[slot_id]
                try:
                    done[slot_id] = future.result()
                except Exception as exc:        # (the slot's own failure)
                    done[slot_id] = Draw(error=exc)
        return done

    def forget(self, slot_id: int) -> None:
        """The slot's sequence ends: its draw, if one is in flight, is waited for and
        dropped (its chain is about to be freed)."""
        future = self.pending.pop(slot_id, None)
        if future is not None:
            wait([future])

    def close(self) -> None:
        for slot_id in list(self.pending):
            self.forget(slot_id)
        self.executor.shutdown(wait=True)
