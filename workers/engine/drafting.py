"""Which generating sequences draft in a step, and how long: each one's best proposal
(`workers.engine.speculation`), or the draft model's (`workers.engine.draftmodel`), where
it pays on the measured step costs (`workers.engine.stepcosts`), under the rules that put
a waiting user first (a first line, a prompt, a new arrival) and hold drafts short under
traffic. Pure policy over the engine's slots, as `workers.engine.scheduling` is for who
gets rows at all."""
from __future__ import annotations

import logging
import time

from workers.engine.spans import bridged, seq_runs
from workers.engine.speculation import find_draft
from workers.engine.stepcosts import EACH, StepCosts, each_plan, plan, step_rate
from workers.errors import EngineError

log = logging.getLogger(__name__)

ARRIVAL_QUIET = 0.5     # s after another request arrives without drafts (see draft)
TRAFFIC_WINDOW = 2.0    # s after another request arrives that drafts are held short
TRAFFIC_STRETCH = 1.0   # ... to a step at most this much longer than the plain one
WAIT_STRETCH = 0.1      # while a user waits (a first line, a prompt, a new arrival), a step
                        # with drafts may take at most this much longer than the plain one
ALIKE_PROBE_EVERY = 16  # one step in this many where drafts alike would raise the step's
                        # rate, but by less than the margin, takes them (see _drafts_alike)


class DraftPlanner:
    """One engine's drafting state: the recent arrivals, and how often drafts alike
    were weighed."""

    def __init__(self) -> None:
        # (when, slot, whether another sequence was running then) of recent arrivals
        self.arrivals: list[tuple[float, int, bool]] = []
        self.alike_asked = 0    # steps that weighed drafts alike (ALIKE_PROBE_EVERY)

    def arrived(self, slot: int, others_running: bool) -> None:
        self.arrivals.append((time.monotonic(), slot, others_running))

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
                try:
                    proposal = slot.policy.propose(slot.cached + [slot.next_token], room,
                                                   proven=traffic)
                except Exception:
                    # a draft source's fault is that sequence's drafts, not the step of
                    # every sequence (which failed them all): it drafts no more
                    log.exception("seq %d: drafting failed; it goes on without drafts",
                                  slot.seq)
                    slot.policy, proposal = None, None
                    alike = False
                    continue
                if proposal is not None:
                    proposals.append((slot.seq, proposal))
                if slot.policy.max_len < EACH[-1] or room < EACH[-1]:
                    alike = False       # (its request asked for fewer, or ends sooner)
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
