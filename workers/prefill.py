"""How fast this worker prefills, and what that means for llama.cpp's `t_max_prompt_ms`
(declared upstream, never implemented there): which of an infill's oldest extra chunks
to leave out so that the prefill fits the budget."""
from __future__ import annotations

from collections import deque


class PrefillMeter:
    """The worker's prefill rate in prompt tokens per ms, as fast as it has lately shown
    itself to be: the best of the last `WINDOW` prefills of at least `MIN_TOKENS`
    uncached tokens, the worker's first such prefill left out (cold: weights paged in,
    buffers allocated). None until one was measured: nothing is left out before.

    A prefill measured beside other work (prompts sharing a step, streams decoding) looks
    slower than the worker is; the best of several ignores such moments, so a brief load
    or a cold start never costs the next requests their context. The estimate falls only
    when every prefill of a window was slow."""

    WINDOW = 8
    MIN_TOKENS = 32

    def __init__(self, engine):
        self.engine = engine
        self.recent: deque[float] = deque(maxlen=self.WINDOW)
        self.cold = True

    @property
    def rate(self) -> float | None:
        return max(self.recent) if self.recent else None

    def measure(self, tokens: int, ms: float) -> None:
        if tokens < self.MIN_TOKENS or ms <= 0:
            return
        if self.cold:
            self.cold = False
            return
        self.recent.append(tokens / ms)

    def estimate_ms(self, tokens: list[int], free_slots: list[int], reuse: bool) -> float:
        """How long prefilling `tokens` would take here now: what no free slot holds, at
        the measured rate (0 until a prefill has been measured)."""
        if not self.rate:
            return 0.0
        cached = self.engine.cached_prefix(tokens, free_slots) if reuse else 0
        return (len(tokens) - cached) / self.rate

    def chunks_over_budget(self, tokens_for, chunks: int, budget: float,
                           free_slots: list[int], reuse: bool, length_for=None) -> int:
        """How many of the oldest `chunks` extra chunks to leave out so that the prefill
        fits `budget` ms (`tokens_for(k)`: the prompt without the oldest k): none where
        the whole prompt fits as cached; else the fewest whose whole prompt fits
        uncached (leaving a chunk out loses the cached prefix after it: the chunks come
        first); where none does, all only if that is cheaper than keeping them all (a
        keystroke after llama.vim's warm-up cached the ring left it all out, and
        prefilled seconds more). The cache is read once: a look per k over every slot
        stalled the streams for a fifth of a second; `length_for(k)`, where given, is
        len(tokens_for(k)) without making the tokens (a list of the whole context for
        each of 256 chunks took the loop ~50 ms)."""
        if not self.rate:
            return 0
        length_for = length_for or (lambda k: len(tokens_for(k)))
        kept = self.estimate_ms(tokens_for(0), free_slots, reuse)
        if kept <= budget:
            return 0
        for k in range(1, chunks + 1):
            if length_for(k) / self.rate <= budget:
                return k
        return chunks if length_for(chunks) / self.rate < kept else 0
