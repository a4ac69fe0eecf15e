"""Who gets rows in a step, beyond every generating sequence's one: prompt pieces (a
step that finishes a prompt takes no piece of another), first line first
(a sequence deep in a long completion yields steps to those still short of their first
line) and speculative drafts (which sequences draft, and how long, under the rules that
put a waiting user first). Pure policy over the engine's slots: the engine builds the
batch from what this decides (`workers.engine.llama`), the drafts come from
`workers.engine.speculation`."""
from __future__ import annotations

import logging
import time
from typing import Callable, Collection

from workers.engine.speculation import find_draft
from workers.errors import EngineError
from workers.engine.stepcosts import EACH, PLAIN_MAX, StepCosts, each_plan, plan, step_rate

log = logging.getLogger(__name__)

DEEP_AFTER = 16         # first line first: tokens after which a sequence past its first line
                        # may sit out a step for sequences still short of theirs
FIRST_LINE_MAX = 32     # ... and tokens after which one with no newline yet counts as past
                        # its first line (see first_line_first)
ARRIVAL_QUIET = 0.5     # s after another request arrives without drafts (see draft)
TRAFFIC_WINDOW = 2.0    # s after another request arrives that drafts are held short
TRAFFIC_STRETCH = 1.0   # ... to a step at most this much longer than the plain one
SIT_OUT_EXACT = 10      # first line first tries every subset of at most this many
SIT_OUT_SAVING = 0.1    # ... and has some sit out only for a step this much cheaper
SIT_OUT_RUN = 7         # ... and none more steps in a row than this (it runs one in 8 at
                        # worst while someone waits); without measured costs, one
SIT_OUT_SECONDS = 0.3   # ... nor once its steps sat out in a row have taken this long: a
                        # reader of its stream sees no longer pause (steps of a prompt's
                        # logprob rows take 150 ms and more: seven were over a second)
WAIT_STRETCH = 0.1      # while a user waits (a first line, a prompt, a new arrival), a step
                        # with drafts may take at most this much longer than the plain one
JOIN_ROWS = 16          # rows of whole prompts that may always join a step finishing one
BRIDGE_SAVING = 0.05    # free sequences' filler rows join runs only for a step this much
                        # cheaper (see bridged)
PAD_PROBE_EVERY = 32    # ... and one step in this many that fillers would pad a lone run
                        # goes without them, its own cost observed (see bridged), and
PROBE_AGAIN_BELOW = 0.9  # ... the next one too where that step took less than this share
                        # of its shape's cost (a start-up measured too high, corrected)
ALIKE_PROBE_EVERY = 16  # one step in this many where drafts alike would raise the step's
                        # rate, but by less than the margin, takes them (see _drafts_alike)


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
    """One engine's scheduling state: the recent arrivals."""

    def __init__(self) -> None:
        # (when, slot, whether another sequence was running then) of recent arrivals
        self.arrivals: list[tuple[float, int, bool]] = []
        self.alike_asked = 0    # steps that weighed drafts alike (ALIKE_PROBE_EVERY)
        # first line first's choice by shape of the batch (_cheapest_out)
        self._sit_out: dict[tuple, tuple] = {}

    def arrived(self, slot: int, others_running: bool) -> None:
        self.arrivals.append((time.monotonic(), slot, others_running))

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

    def draft(self, slots: list, generating: list, prefilling: list, n_ctx: int,
              n_batch: int, step_costs: StepCosts | None, model=None,
              fillable: frozenset[int] = frozenset()) -> None:
        """Sets each generating sequence's `draft` for this step: its best proposal, where
        it pays (stepcosts.plan, on the step costs). While another sequence is prefilling
        or short of its first line (`line_done`), or within ARRIVAL_QUIET s of another
        request's arrival, a step with drafts may take at most 1 + WAIT_STRETCH times the
        plain step (a draft lengthens the step a new keystroke waits behind: on a CPU,
        where a draft row costs more than half a plain step, that is no draft, as
        measured on the typing trace; on a GPU, where rows are nearly free, drafts run
        beside the waiting users). Under traffic (another sequence in the worker, or
        another request's arrival in the last TRAFFIC_WINDOW s) a source drafts on what
        it proved in the sequence (not on a lookup's match length) and a step with
        drafts may take at most 1 + TRAFFIC_STRETCH times the plain step: on a CPU, where
        a draft row costs several plain steps, that is no draft; on a GPU, where rows are
        cheap, the drafts stay. An arrival counts as traffic when it came while another
        sequence was running: one client sending requests one after another keeps its
        drafts.

        `model` (a `workers.engine.draftmodel.DraftModel`): a sequence may draft with it
        instead of its best lookup, where the step's plan with the draft model's drafts
        (their making counted) gives a better rate than without; its tokens are made
        once the lengths are chosen (`_model_drafts`). `fillable`: the free sequences
        that may take filler rows (`bridged`), beside the busy ones without rows."""
        proposals, alike, stretch = self._proposals(slots, generating, prefilling, n_ctx)
        if step_costs is None:
            return
        by_seq = dict(proposals)
        chosen = plan(step_costs, len(generating), proposals, stretch=stretch) \
            if proposals else {}
        if model is not None:
            by_seq, chosen = self._with_model(model, generating, by_seq, chosen, n_ctx,
                                              step_costs, stretch)
        if not chosen and not proposals:
            return
        if alike and len(generating) * (1 + EACH[-1]) <= n_batch and \
                not any(by_seq[q].source == "model" for q in chosen) and \
                self._drafts_alike(generating, proposals, by_seq, chosen, step_costs,
                                   stretch, fillable | {s.seq for s in slots if s.busy
                                                        and s not in generating}):
            return
        rows = n_batch - len(generating)
        made = self._model_drafts(model, slots, by_seq, chosen)
        for seq, length in chosen.items():
            slot, proposal = slots[seq], by_seq[seq]
            length = min(length, rows, len(made.get(seq, proposal.tokens)))
            if length >= 1:
                if seq in made:
                    proposal.tokens = made[seq]
                slot.draft = proposal.tokens[:length]
                slot.policy.started(proposal, len(slot.cached) + 1)
                rows -= length

    def _proposals(self, slots: list, generating: list, prefilling: list,
                   n_ctx: int) -> tuple[list, bool, float | None]:
        """Each generating sequence's best proposal (its `draft` cleared), whether all may
        draft alike, and how much longer than the plain step a step with drafts may be
        (None: no limit; see `draft`)."""
        proposals = []
        waiting = [s for s in generating if not s.line_done] + prefilling
        now = time.monotonic()
        self.arrivals = [a for a in self.arrivals if now - a[0] < TRAFFIC_WINDOW]
        busy = {s.seq for s in slots if s.busy}
        traffic = len(busy) > 1 or any(concurrent and s not in busy
                                       for _, s, concurrent in self.arrivals)
        alike = len(generating) >= 2        # all may draft alike (each_plan)
        someone_waits = False
        for slot in generating:
            slot.draft = []
            if any(other is not slot for other in waiting) or \
                    any(s != slot.seq and now - t < ARRIVAL_QUIET for t, s, _ in self.arrivals):
                someone_waits = True
            room = n_ctx - slot.n_past - 2
            if slot.budget is not None:     # a draft past the end is rows for nothing,
                room = min(room, slot.budget - slot.sampled - 1)    # never pays
            # (a sequence sampled aside checks no draft: each row would be its dear draw)
            if slot.policy is not None and not slot.sampled_aside and \
                    room >= slot.policy.min_len:                             # a shorter one
                proposal = slot.policy.propose(slot.cached + [slot.next_token], room,
                                               proven=traffic)
                if proposal is not None:
                    proposals.append((slot.seq, proposal))
                if slot.policy.max_len < EACH[-1]:      # its request asked for fewer
                    alike = False
            else:
                alike = False
        stretch = WAIT_STRETCH if someone_waits else TRAFFIC_STRETCH if traffic else None
        return proposals, alike, stretch

    def _drafts_alike(self, generating: list, proposals: list, by_seq: dict, chosen: dict,
                      step_costs: StepCosts, stretch: float | None,
                      fillable: frozenset[int] = frozenset()) -> bool:
        """Drafts of one length on every sequence (each_plan: one batch, not one per
        count of rows), where that beats the plan's drafts; True if they were set. The
        runs of sequence ids are joined with filler rows where that is cheaper
        (`bridged`, a filler taking as many rows as each sequence).

        One step in ALIKE_PROBE_EVERY of those that weigh them, one row on each goes in
        where it would raise the step's rate at all, short of the margin (each_plan's
        `probe`): a shape that never runs is never measured again, nor is the sources'
        acceptance beside each other, so a start-up that put it just past the margin
        (the start-up measures at 1,024 cached tokens; an editor's eight openings are a
        few hundred) kept it out for good. Probed, its cost and acceptance are the steps'
        own, and the margin decides again on them: eight first-seen openings at once,
        in-process, a fresh engine on such a kept table, 146.8-177.2 tok/s against
        134.5-166.8 without the probe over six sets of files, each set faster (one row on
        each from 1.39 plain steps, as measured at start-up, to the 1.27-1.36 the steps
        measured; docs/design.md)."""
        self.alike_asked += 1
        seqs = sorted(s.seq for s in generating)
        runs = seq_runs(seqs)

        def layout(k: int) -> list[int]:
            cost_of = step_costs.plain_cost if k == 0 else \
                (lambda n: step_costs.each_cost(n, k))
            return [last - first + 1 for first, last in bridged(seqs, fillable, cost_of)]
        plain = sum(step_costs.plain_cost(r) for r in layout(0))
        drafted = sum(chosen.values())
        one_rate = (len(generating) + sum(by_seq[q].gain(n) for q, n in chosen.items())) \
            / (plain + step_costs.cost(len(generating), drafted) -
               step_costs.cost(len(generating), 0))
        lookups = dict(proposals)       # (a draft model's proposal has no tokens yet)
        k, rate = each_plan(step_costs, runs, list(lookups.values()), stretch, layout,
                            probe=self.alike_asked % ALIKE_PROBE_EVERY == 0)
        if not k or rate <= one_rate:
            return False
        for slot in generating:
            proposal = lookups.get(slot.seq)
            context = slot.cached + [slot.next_token]
            if proposal is not None:
                slot.draft = proposal.tokens[:k]
                slot.policy.started(proposal, len(context))
            guess = find_draft(context, k - len(slot.draft), 1)
            slot.draft = (slot.draft + guess + [context[-1]] * k)[:k]
        return True

    @staticmethod
    def _with_model(model, generating: list, by_seq: dict, chosen: dict, n_ctx: int,
                    step_costs: StepCosts, stretch: float | None) -> tuple[dict, dict]:
        """The proposals and the plan with the draft model's drafts where its draft is
        likelier than the sequence's lookup, if that plan's rate (making included) beats
        the lookups' alone; else those unchanged."""
        able = [s for s in generating if s.policy is not None and not s.sampled_aside]
        if not able:
            return by_seq, chosen
        mixed = dict(by_seq)
        for slot in able:
            context = slot.cached + [slot.next_token]
            left = (n_ctx - slot.n_past - 2) if slot.budget is None else \
                min(n_ctx - slot.n_past - 2, slot.budget - slot.sampled - 1)
            # a long catch-up (a new prompt) is paid once: its share of each step of the
            # sequence's drafts to come
            steps_left = max(1.0, left / (1 + slot.policy.allowance))
            fixed = max(0, model.behind(slot.seq, context) - 2) * \
                model.costs.catch_up_ms / steps_left
            proposal = slot.policy.model_proposal(left, model.costs.token_ms(len(able)), fixed)
            if proposal is None:
                continue
            lookup = by_seq.get(slot.seq)
            room = len(proposal.tokens)
            if lookup is None or lookup.gain(room) < proposal.gain(room):
                mixed[slot.seq] = proposal
        drafting = [q for q, p in mixed.items() if p.source == "model"]
        if not drafting:
            return by_seq, chosen
        n = len(generating)
        # each token's making is the draft model's decode shared by those drafting with
        # it: planned as if all did, then again at the count the plan chose (fewer
        # sharing it: each pays more), until that count holds
        for _ in range(3):
            for q in drafting:
                mixed[q].make_ms = model.costs.token_ms(len(drafting))
            with_model = plan(step_costs, n, list(mixed.items()), stretch=stretch)
            chosen_model = [q for q in with_model if mixed[q].source == "model"]
            if not chosen_model or len(chosen_model) == len(drafting):
                break
            for q in drafting:              # the ones not chosen go back to their lookups
                if q not in chosen_model:
                    if q in by_seq:
                        mixed[q] = by_seq[q]
                    else:
                        del mixed[q]
            drafting = chosen_model
        if any(mixed[q].source == "model" for q in with_model) and \
                step_rate(step_costs, n, mixed, with_model) > \
                step_rate(step_costs, n, by_seq, chosen):
            return mixed, with_model
        return by_seq, chosen

    @staticmethod
    def _model_drafts(model, slots: list, by_seq: dict, chosen: dict) -> dict[int, list[int]]:
        """The draft model's tokens for the chosen proposals that it makes, each as long
        as the plan chose, made together (one decode a token for all of them)."""
        wants = {seq: (slots[seq].cached + [slots[seq].next_token], length)
                 for seq, length in chosen.items() if by_seq[seq].source == "model"}
        if not wants or model is None:
            return {}
        try:
            return model.draft(wants)
        except EngineError as exc:          # (drafting is optional: the step goes on)
            log.warning("the draft model failed, no drafts from it this step: %s", exc)
            model.forget()
            return {seq: [] for seq in wants}


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
