"""The engine's slots and what their KV caches hold: one sequence a slot (one KV stream
each), the tokens its cache holds after its sequence ended, which free slot a new prompt
goes to (`SlotCaches.best`), what of a prompt a slot's cache gives it (the shared prefix
and the chunks KV chunk reuse shifts into place, `workers.engine.kvreuse`), and copies
of a decoded prompt into a sibling choice's slot. The step that decodes the slots' rows
is `workers.engine.llama`'s."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection

from workers.engine.kvreuse import reusable, shift_into_place
from workers.engine.samplers import SamplerChain
from workers.engine.spans import bridged
from workers.engine.speculation import Drafter, common_prefix

SLOT_SIMILARITY = 0.1   # the share of a prompt a slot's cache must hold to be chosen for it
# The least prompt a sibling choice copies (copy_prefix) rather than prefills: a copy
# moves the whole KV stream (n_ctx × layers, twice with a full SWA cache), some tens of
# ms on a CPU at 4k, about what this many tokens take to prefill there
COPY_AT_LEAST = 128


@dataclass(eq=False)
class Slot:
    seq: int
    pending: list[int] = field(default_factory=list)   # prompt tokens still to decode
    prompt: list[int] = field(default_factory=list)
    n_past: int = 0                                     # tokens in this slot's KV cache
    next_token: int | None = None                       # sampled, to be decoded next step
    chain: SamplerChain | None = None                   # while in use
    row: int = -1                                       # batch row to sample from
    logprobs: int | None = None                         # top-k to report, None: none
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)  # (row, position)
    prompt_logprobs: list | None = None
    sampled: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    cached: list[int] = field(default_factory=list)     # the tokens in this slot's KV cache
    draft: list[int] = field(default_factory=list)      # speculative tokens in this step
    draft_rows: list[int] = field(default_factory=list)
    policy: Drafter | None = None                       # None: no speculation
    line_done: bool = False             # its output has a newline, or FIRST_LINE_MAX tokens
    sat_out: int = 0                    # first line first: steps sat out in a row
    sat_out_since: float = 0.0          # ... since when (time.monotonic())
    passed_over: bool = False                           # its prompt got no piece: last step
    budget: int | None = None                           # tokens it may generate
    sample_ms: float = 0.0              # its sampling's measured time a token (average)
    sampled_aside: bool = False         # ... more than the step's share: drawn aside

    @property
    def busy(self) -> bool:
        return self.chain is not None

    def timed_sampling(self, seconds: float) -> None:
        """One token's sampling took `seconds` (in place or aside): into its average."""
        self.sample_ms = 0.7 * self.sample_ms + 0.3 * 1000 * seconds


class SlotCaches:
    """The slots of one context and their KV caches (`lib`: llama_cpp, `memory`: the
    context's). `cache_reuse`: KV chunk reuse's least chunk (0: off); `copies`: whether a
    sibling choice may copy a decoded prompt (a memory that can drop positions, no
    deterministic mode)."""

    def __init__(self, lib, memory, count: int, cache_reuse: int, copies: bool,
                 n_swa: int = 0) -> None:
        self.lib, self.memory = lib, memory
        self.n_swa = n_swa              # the model's sliding window (0: none)
        self.slots = [Slot(seq) for seq in range(count)]
        self.cache_reuse = cache_reuse
        self.copies = copies
        self.tokens_shifted = 0         # cached tokens KV chunk reuse moved into place

    def worth(self, slot_id: int, tokens: list[int]) -> int:
        """What of `tokens` the slot's cache gives, where that is at least
        SLOT_SIMILARITY of them (0 otherwise)."""
        held = reusable(self.slots[slot_id].cached, tokens, self.cache_reuse)
        return held if held >= SLOT_SIMILARITY * len(tokens) else 0

    def cached_prefix(self, tokens: list[int], free: list[int]) -> int:
        """The most of `tokens` that the free slot `best` would choose holds."""
        return max((self.worth(i, tokens) for i in free), default=0)

    def best(self, tokens: list[int], free: list[int], fillable: Collection[int] = (),
             plain_cost: Callable[[int], float] | None = None) -> int:
        """The free slot whose cache holds the most of `tokens` (the shared prefix, plus
        the chunks KV chunk reuse would shift into place), counted only where that is at
        least SLOT_SIMILARITY of the prompt; otherwise, and on ties, the one with the least
        cached, so long caches survive. (Two editors' files that differ from their first
        line share a few tokens: taking the slot whose cache holds the other's file for
        those would throw away what that editor's next keystroke reuses. llama-server's
        slot similarity rule, 0.1 too.)

        Among slots equally worth taking, one that keeps the busy slots one run of
        consecutive ids comes first: llama.cpp decodes a step of per-sequence KV caches as
        one sub-batch per such run, each a pass over the weights, so scattered slots
        split every step of the request's life (`joins_run`). Where free slots' filler
        rows may join the runs (`fillable`, on the measured `plain_cost` of a step), a
        slot whose gap a filler would close adds no batch either, and then the least
        cached of those comes first (a cached prompt beside the busy slots survives:
        under load a repeated prompt had found its cache 4 times in 39). On a CPU, where
        a filler seldom pays, that is still mostly the slot beside the busy ones."""
        if not fillable or plain_cost is None:
            return max(free, key=lambda i: (self.worth(i, tokens), self.joins_run(i),
                                            -len(self.slots[i].cached)))
        fillable = frozenset(fillable)
        busy = sorted(s.seq for s in self.slots if s.busy)
        batches = len(bridged(busy, fillable, plain_cost))

        def adds_none(i: int) -> bool:
            return self.joins_run(i) or \
                len(bridged(sorted(busy + [i]), fillable - {i}, plain_cost)) <= batches
        return max(free, key=lambda i: (self.worth(i, tokens), adds_none(i),
                                        -len(self.slots[i].cached), self.joins_run(i)))

    def joins_run(self, slot_id: int) -> int:
        """1 if taking this slot adds no run of consecutive busy slots: none is busy, or
        a neighbour is; 0 if it starts a run of its own."""
        busy = [s.busy for s in self.slots]
        if not any(busy):
            return 1
        return int((slot_id > 0 and busy[slot_id - 1]) or
                   (slot_id + 1 < len(busy) and busy[slot_id + 1]))

    def copy_prefix(self, src: int, dst: int, tokens: list[int]) -> int:
        """Into free slot `dst`'s cache, the start of `tokens` that slot `src` holds,
        its prompt decoded (llama_memory_seq_cp): a sibling choice of one prompt (`n`,
        llama.vscode's `n_cmpl`) then decodes only its last token instead of the whole
        prompt again, as llama-server copies a parent's state to its children. Returns
        the tokens now cached in `dst` (0: nothing copied; never in deterministic mode,
        where a prefix decoded in other pieces changes the numbers)."""
        source, target = self.slots[src], self.slots[dst]
        # (a source with its last prompt token left holds all a copy takes)
        if target.busy or len(source.pending) > 1 or not self.copies:
            return 0
        n = min(common_prefix(source.cached, tokens), len(tokens) - 1)
        if n < COPY_AT_LEAST or n <= reusable(target.cached, tokens, self.cache_reuse):
            return 0                     # (short: as cheap to prefill; or held already)
        # one KV stream per slot: llama.cpp copies a sequence across streams whole (the
        # buffer, at its next update; a part of one is refused with an abort), so the
        # whole of it, then what follows the shared prefix is dropped
        self.lib.llama_memory_seq_rm(self.memory, target.seq, -1, -1)
        self.lib.llama_memory_seq_cp(self.memory, source.seq, target.seq, -1, -1)
        if not self.lib.llama_memory_seq_rm(self.memory, target.seq, n, -1):
            self.forget(target)
            return 0
        target.cached = list(tokens[:n])
        return n

    def reuse(self, slot: Slot, tokens: list[int], n_past: int) -> int:
        """Keep what the slot's cache gives `tokens`: its first `n_past` tokens (their
        shared prefix), and chunks that the prompt repeats further along shifted into
        place (workers/engine/kvreuse.py); every cell past them is dropped. Returns the
        tokens kept (0: the cache is emptied)."""
        slot.cached, in_place, shifted = shift_into_place(
            self.lib, self.memory, slot.seq, slot.cached, tokens, n_past, self.cache_reuse)
        self.tokens_shifted += shifted
        ok = in_place > 0 and \
            self.lib.llama_memory_seq_rm(self.memory, slot.seq, in_place, -1) and \
            self.lib.llama_memory_seq_pos_max(self.memory, slot.seq) == in_place - 1 and \
            self._window_held(slot, in_place)
        if not ok:
            self.forget(slot)
            return 0
        del slot.cached[in_place:]
        return in_place

    def _window_held(self, slot: Slot, in_place: int) -> bool:
        """Whether a sliding-window model's cache still holds the window the token at
        `in_place` attends to. llama.cpp overwrites a cell that is out of its sequence's
        window when a decode needs room (a chunk shift leaves a gap the next prompt
        outgrows) and then drops every window cell below it: the positions are gone from
        the window layers though the sequence's last position looks right. A prefix kept
        over such a hole gave other text than the same prompt decoded afresh (the
        bundled Gemma 3, its window 512). llama-server's check."""
        return not self.n_swa or self.lib.llama_memory_seq_pos_min(
            self.memory, slot.seq) <= max(0, in_place - self.n_swa)

    def forget(self, slot: Slot) -> None:
        """Empty the slot's cache."""
        self.lib.llama_memory_seq_rm(self.memory, slot.seq, -1, -1)
        slot.cached = []

    def forget_idle(self) -> None:
        """Empty every idle slot's cache."""
        for slot in self.slots:
            if not slot.busy:
                self.forget(slot)
