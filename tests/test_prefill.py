"""The prefill-rate estimate behind `t_max_prompt_ms` (workers/prefill.py), on a fake
engine whose tokenizer is one token per character and which caches nothing."""
from workers.prefill import PrefillMeter


class FakeEngine:
    """One token per character; no slot holds a cached prefix."""

    def tokenize(self, text: str, add_special: bool = False,
                 parse_special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def cached_prefix(self, tokens, free_slots) -> int:
        return 0


CHUNKS = 4                          # 100 tokens each, before 100 more


def tokens_for(k: int) -> list[int]:
    """The prompt without its oldest k chunks."""
    return list(range(100 * k, 500))


def dropped(meter: PrefillMeter, budget_ms: float) -> int:
    return meter.chunks_over_budget(tokens_for, CHUNKS, budget_ms, [0], reuse=True)


def test_nothing_is_left_out_before_a_rate_was_measured():
    meter = PrefillMeter(FakeEngine())
    assert meter.rate is None and dropped(meter, 1) == 0


def test_the_first_cold_prefill_is_not_taken_as_the_rate():
    meter = PrefillMeter(FakeEngine())
    meter.measure(500, 5000.0)          # cold: 0.1 token/ms
    assert meter.rate is None and dropped(meter, 100) == 0
    meter.measure(500, 50.0)            # warm: 10 tokens/ms; 500 tokens take 50 ms
    assert meter.rate == 10.0
    assert dropped(meter, 100) == 0
    assert dropped(meter, 30) == 2      # 300 tokens are left: 30 ms


def test_a_briefly_loaded_prefill_does_not_lower_the_estimate():
    meter = PrefillMeter(FakeEngine())
    meter.measure(500, 1.0)             # cold
    meter.measure(500, 50.0)            # 10 tokens/ms
    meter.measure(500, 500.0)           # beside other work: 1 token/ms
    assert meter.rate == 10.0 and dropped(meter, 60) == 0


def test_the_estimate_falls_when_a_whole_window_was_slow():
    meter = PrefillMeter(FakeEngine())
    meter.measure(500, 1.0)
    meter.measure(500, 50.0)
    for _ in range(PrefillMeter.WINDOW):
        meter.measure(500, 250.0)       # the machine is slower now: 2 tokens/ms
    assert meter.rate == 2.0
    assert dropped(meter, 60) == 4      # 100 tokens left: 50 ms


def test_short_prefills_are_not_measured():
    meter = PrefillMeter(FakeEngine())
    meter.measure(500, 1.0)
    meter.measure(PrefillMeter.MIN_TOKENS - 1, 1000.0)
    assert meter.rate is None


class CachingEngine(FakeEngine):
    """A slot holds the chunks' 400 tokens (a warm-up filled them)."""

    def cached_prefix(self, tokens, free_slots) -> int:
        held = list(range(400))
        n = 0
        while n < min(len(tokens), len(held)) and tokens[n] == held[n]:
            n += 1
        return n


def test_chunks_a_warm_up_cached_are_kept_when_leaving_them_out_costs_more():
    """llama.vim's warm-up cached the ring; a keystroke's new prefix and suffix alone
    miss the budget. Leaving chunks out loses the cached prefix after them, so it would
    prefill more, not less: none are left out (all were, and took seconds more)."""
    meter = PrefillMeter(CachingEngine())
    for ms in (5000.0, 500.0):          # (the first, cold, is not counted): 1 token/ms,
        meter.measure(500, ms)          # the 100 uncached tokens take 100 ms
    assert meter.rate == 1.0
    assert meter.chunks_over_budget(tokens_for, CHUNKS, 50, [0], reuse=True) == 0
    assert meter.chunks_over_budget(tokens_for, CHUNKS, 100, [0], reuse=True) == 0
    cold = PrefillMeter(FakeEngine())   # nothing cached: the fewest that fit, or the
    for ms in (5000.0, 500.0):          # cheapest (all) where none does
        cold.measure(500, ms)
    assert cold.chunks_over_budget(tokens_for, CHUNKS, 250, [0], reuse=True) == 3
    assert cold.chunks_over_budget(tokens_for, CHUNKS, 50, [0], reuse=True) == 4
