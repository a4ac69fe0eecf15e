"""How fast this worker prefills, and what that means for llama.cpp's `t_max_prompt_ms`
(declared upstream, never implemented there): which of an infill's oldest extra chunks
to leave out so that the prefill fits the budget."""
from __future__ import annotations


class PrefillMeter:
    """The worker's prefill rate in prompt tokens per ms: a moving average over the
    requests it prefilled (None until one of at least 16 uncached tokens was measured)."""

    def __init__(self, engine):
        self.engine = engine
        self.rate: float | None = None

    def measure(self, tokens: int, ms: float) -> None:
        if tokens >= 16 and ms > 0:
            rate = tokens / ms
            self.rate = rate if self.rate is None else 0.7 * self.rate + 0.3 * rate

    def estimate_ms(self, tokens: list[int], free_slots: list[int], reuse: bool) -> float:
        """How long prefilling `tokens` would take here now: what no free slot holds, at
        the measured rate (0 until a prefill has been measured)."""
        if not self.rate:
            return 0.0
        cached = self.engine.cached_prefix(tokens, free_slots) if reuse else 0
        return (len(tokens) - cached) / self.rate

    def chunks_over_budget(self, tokens: list[int], extra: list[dict], budget: float,
                           free_slots: list[int], reuse: bool) -> int:
        """How many of the oldest extra chunks to leave out so that the prefill fits
        `budget` ms. Each chunk is tokenized once: the cost is linear in the chunks."""
        if not self.rate or self.estimate_ms(tokens, free_slots, reuse) <= budget:
            return 0
        total = len(tokens)         # once the first chunk goes, the cached prefix goes too
        for dropped, chunk in enumerate(extra, start=1):
            total -= len(self.engine.tokenize(
                str(chunk.get("filename") or "") + "\n" + str(chunk.get("text") or ""),
                add_special=False)) + 1
            if total / self.rate <= budget:
                return dropped
        return len(extra)
