"""Which sequences get rows in a step: prompt pieces (a step that finishes a prompt takes
no piece of another; `prompt_first`: when it goes alone) and first line first (a sequence
deep in a long completion yields steps to those still short of their first line). Pure
policy over the engine's slots: the engine builds the batch from what this decides
(`workers.engine.llama`); which of those sequences draft, and how long, is
`workers.engine.drafting`'s."""
from __future__ import annotations

import time

from workers.engine.spans import bridged, spans_cost
from workers.engine.stepcosts import StepCosts

DEEP_AFTER = 16         # first line first: tokens after which a sequence past its first line
                        # may sit out a step for sequences still short of theirs
FIRST_LINE_MAX = 32     # ... and tokens after which one with no newline yet counts as past
                        # its first line (see first_line_first)
SIT_OUT_EXACT = 10      # first line first tries every subset of at most this many
SIT_OUT_SAVING = 0.1    # ... and has some sit out only for a step this much cheaper
SIT_OUT_RUN = 7         # ... and none more steps in a row than this (it runs one in 8 at
                        # worst while someone waits); without measured costs, one
SIT_OUT_SECONDS = 0.3   # ... nor once its steps sat out in a row have taken this long: a
                        # reader of its stream sees no longer pause (steps of a prompt's
                        # logprob rows take 150 ms and more: seven were over a second)
JOIN_ROWS = 16          # rows of whole prompts that may always join a step finishing one


def sat_out_enough(slot, run: int = SIT_OUT_RUN, now: float | None = None) -> bool:
    """Whether a generating sequence has sat out enough steps in a row to have a row in
    the next: `run` of them, or steps that took SIT_OUT_SECONDS together. Counted in
    steps alone, a sequence deep in a long completion sat out seven steps of a prompt's
    logprob rows beside it (150 ms each and their sampling): its stream paused for 1.1 s
    on a slower 2-core machine, for a request whose first token was seconds away."""
    if slot.sat_out >= run:
        return True
    now = time.monotonic() if now is None else now
    return slot.sat_out > 0 and now - slot.sat_out_since >= SIT_OUT_SECONDS


def sat(slot, out: bool, now: float) -> None:
    """A generating sequence sits out the coming step (`out`) or has its row in it."""
    if out and not slot.sat_out:
        slot.sat_out_since = now
    slot.sat_out = slot.sat_out + 1 if out else 0


class Scheduler:
    """One engine's first-line-first state: its choices by shape of the batch."""

    def __init__(self) -> None:
        # first line first's choice by shape of the batch (_cheapest_out)
        self._sit_out: dict[tuple, tuple] = {}

    def first_line_first(self, generating: list, prefilling: list,
                         costs: StepCosts | None = None, prompt_rows: int = 0,
                         fillable: frozenset[int] = frozenset()) -> list:
        """A user waits for a suggestion's first line: while some sequence is still short
        of its first line (or still prefilling), sequences deep in a long completion
        (past their first line and DEEP_AFTER tokens) sit out a step, so that it is
        shorter for those waiting; none more than SIT_OUT_RUN steps in a row (without
        measured costs, one: there nobody knows that the step is cheaper for it), nor
        past SIT_OUT_SECONDS of them (`sat_out_enough`). A
        waiting first line of a dozen tokens so pays for a full step about once where
        it paid every other step: on the typing trace (eight users, four seeds, two runs
        each) first line p50 305-808 ms against 504-1,366 with one in a row, 453-1,053
        with two, 324-1,003 with four (design.md). Which sit out is what
        makes the step cheapest on the measured costs, counting each run of consecutive
        sequence ids in the batch as a decode of its own (llama.cpp with a KV stream per
        sequence: four rows of sequences 0, 2, 4, 6 took 88 ms here, of 0-3 37 ms, all
        eight 55 ms), the deepest first among equals, and none where nothing is cheaper:
        a deep sequence sitting out between two others splits the step it was meant to
        shorten, and none where the step would be less than SIT_OUT_SAVING cheaper (on a
        device where rows are nearly free, nobody sits out). The step's cost counts the
        `prompt_rows` it takes at least (a prompt piece's rows beyond its first are a
        sub-batch of their own; the engine's estimate is made before drafts take room,
        which while a prompt waits they seldom do): beside a piece of a hundred rows or
        more, the few rows sitting out would save the waiting prompt too little of its
        step to cost each of them a token. Without costs,
        every one that may sits out. A first line ends at its newline or after
        FIRST_LINE_MAX tokens (the engine's `line_done`): 32 tokens are 100-130
        characters of code, past what style guides allow a line (79-120); a longer one
        is prose or a line nobody waits on the end of, and eight streams beside one that
        never wrote a newline sat out every other step of its life (93 steps for 64
        tokens each, 20% longer than without, measured). Runs are joined with filler
        rows where that is cheaper (`bridged`: `fillable`, the free sequences, and
        those sitting out), so sitting out between others saves nothing. Returns the
        sequences that get a row in this step."""
        waiting = bool(prefilling) or any(not s.line_done for s in generating)
        run = SIT_OUT_RUN if costs is not None else 1
        now = time.monotonic()
        may = sorted((s for s in generating if waiting and not sat_out_enough(s, run, now)
                      and s.line_done and s.sampled >= DEEP_AFTER), key=lambda s: -s.sampled)
        sitting = {s.seq for s in may}
        if costs is not None and may:
            sitting = set(self._cheapest_out(
                tuple(s.seq for s in generating), tuple(s.seq for s in may),
                tuple(s.seq for s in prefilling), costs, prompt_rows, fillable))
        for slot in generating:
            sat(slot, slot.seq in sitting, now)
        return [s for s in generating if s.seq not in sitting]

    def _cheapest_out(self, generating: tuple, may: tuple, prefilling: tuple,
                      costs: StepCosts, prompt_rows: int = 0,
                      fillable: frozenset[int] = frozenset()) -> tuple:
        """The sequences of `may` (deepest first) whose sitting out makes the step's
        plain rows cheapest, runs counted; fewest, then deepest, among equals; none where
        the step, its `prompt_rows` included, would be less than SIT_OUT_SAVING cheaper.
        Every subset is tried (eight sequences: 256), once per shape of the batch (the
        prompt piece adds the same to every subset: it only moves the threshold)."""
        key = (generating, may, prefilling, id(costs), fillable)
        if key not in self._sit_out:
            if len(self._sit_out) > 4096:
                self._sit_out.clear()
            self._sit_out[key] = self._cheapest_subset(generating, may, prefilling, costs,
                                                       fillable)
        best, cost, everyone = self._sit_out[key]
        # (the prompt's first row is in its run: its other rows are what they add)
        piece = costs.cost(1, prompt_rows - 1) - costs.plain_cost(1) if prompt_rows > 1 \
            else 0.0
        if cost + piece > (1 - SIT_OUT_SAVING) * (everyone + piece):
            return ()                 # a saving this small is not worth a stream's step
        return best

    @staticmethod
    def _cheapest_subset(generating: tuple, may: tuple, prefilling: tuple,
                         costs: StepCosts, fillable: frozenset[int] = frozenset()
                         ) -> tuple[tuple, float, float]:
        """The subset of `may` whose sitting out makes the plain rows cheapest (see
        `_cheapest_out`), what they then cost, and what they cost with everyone in."""
        best, best_rank = (), None
        subsets = range(1 << len(may)) if len(may) <= SIT_OUT_EXACT else \
            [(1 << k) - 1 for k in range(len(may) + 1)]       # (the k deepest)
        present = set(generating) | set(prefilling)
        everyone = spans_cost(bridged(sorted(present), fillable, costs.plain_cost),
                              costs.plain_cost)
        for mask in subsets:
            out = [(i, q) for i, q in enumerate(may) if mask >> i & 1]
            seqs = sorted(present - {q for _, q in out})
            cost = spans_cost(bridged(seqs, fillable | {q for _, q in out},
                                      costs.plain_cost), costs.plain_cost)
            rank = (round(cost, 3), len(out), sum(i for i, _ in out))
            if best_rank is None or rank < best_rank:
                best, best_rank = tuple(q for _, q in out), rank
        return best, best_rank[0], everyone

    @staticmethod
    def prefill(prefilling: list, room: int, logprob_chunk: int, rows: int = 0
                ) -> dict[int, int]:
        """How many prompt rows each prefilling sequence gets in `room` ({seq: rows}),
        `prefilling` in priority order (fewest left first), beside `rows` already in the
        step (the generating sequences' and their drafts'). A step that finishes a prompt
        takes no piece of another: its rows would delay that prompt's first token and
        give none of their own (see design.md). Nor a whole prompt larger than the step
        was when the first prompt finished there (or JOIN_ROWS): it would delay that
        token as much and gain only the next step's fixed cost. The first prompt passed
        over so gets its piece the next step, so a stream of short prompts finishing
        every step halves the pace of the long prompt first in line at worst; those
        behind it wait their turn in priority order, fewest left first, as they would
        for the room anyway (eight equal cold prompts: one first token a step, not two
        every other step). Prompts keeping their prompt logprobs go `logprob_chunk` rows
        a step together (each such row's log-softmax and top candidates take ~2.6 ms over
        a 262k vocabulary, and its logits 1 MiB: eight scoring choices of 512 rows a step
        each made a neighbour wait seconds for its token)."""
        grant: dict[int, int] = {}
        logprob_room = logprob_chunk
        base = None                   # the step's rows when the first prompt finished
        joined = 0                    # rows of whole prompts beside it since
        flagged = False
        for slot in prefilling:
            if room <= 0:
                break
            take = min(room, len(slot.pending))
            if slot.prompt_logprobs is not None:
                take = min(take, logprob_room)
                if take <= 0:
                    continue
            whole = take == len(slot.pending)
            if base is not None and not slot.passed_over and \
                    not (whole and joined + take <= max(base, JOIN_ROWS)):
                if not flagged:
                    slot.passed_over = flagged = True
                continue                # (a shorter one may still fit)
            slot.passed_over = False
            grant[slot.seq] = take
            if slot.prompt_logprobs is not None:
                logprob_room -= take
            room -= take
            rows += take
            if base is not None:
                joined += take
            elif whole:
                base = rows
        return grant


def prompt_first(sequences: int, piece: int, costs: StepCosts | None, host_ms: float
                 ) -> bool:
    """Whether a step that finishes a waiting prompt (`piece` rows left) decodes it
    alone, the `sequences` generating beside it in the next step (and no prompt rows
    there). llama.cpp decodes a batch whose sequences have unequal rows as sub-batches
    of equal rows (with a KV stream per sequence), so a prompt piece of two rows or
    more beside one-row sequences is two decodes already: measured in-process, seven
    rows and a 3-row piece 67.9 ms together, 55.1 + 13.2 apart; with a 230-row piece
    287.8 against 55.3 + 229.8. Apart, prompt first, the prompt's first token comes the
    generating rows' decode sooner and theirs one host round (plan, sampling, the
    worker's messages) later: so where that round on every generating sequence costs
    less than their decode (`host_ms`: stepcosts.HostTime; their plain step's measured
    cost). A
    one-row piece joins their sub-batch (eight rows 39 ms against seven 55 + one 13):
    never apart. On a GPU, whose plain step is a few milliseconds, the host's round on
    several sequences outweighs it: together. Without measured costs, together."""
    if costs is None or sequences <= 0 or piece < 2:
        return False
    return sequences * host_ms < costs.plain_cost(sequences)
