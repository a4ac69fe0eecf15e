"""Reading a decoded step's rows (`RowReading`, the engine's half that reads): each busy
slot's prompt logprobs, its token sampled, its draft verified against the samples (the
rejected positions dropped from its KV cache), a dear draw handed to the side thread and
taken up when drawn, and what a token taken does to the slot. The other half, which plans
the step and decodes it, is `workers.engine.llama.LlamaEngine`, which is one of these."""
from __future__ import annotations

import time

import llama_cpp
import numpy as np

from workers.engine.aside import log_sum_exp, top_of
from workers.engine.scheduling import FIRST_LINE_MAX, SIT_OUT_RUN
from workers.engine.slots import Slot
from workers.errors import EngineError
from workers.sampling import TokenOut

BANNED = -1e30           # a logit no token wins with, yet finite: a grammar stays satisfiable


class RowReading:
    """The engine's reading of a step's rows, from its context (`ctx`, `memory`), slots,
    vocabulary (`n_vocab`, `eog_tokens`, `is_eog`, `piece`), side thread (`aside`) and
    counters (`totals`, `logprob_row_ms`): a part of `LlamaEngine`, which has them."""

    def _sample_all(self) -> dict[int, TokenOut]:
        """Each busy slot's rows read: its prompt logprobs, then its token sampled (and its
        draft verified). One sequence's failure is its own (an error TokenOut)."""
        out: dict[int, TokenOut] = {}
        for slot_id, slot in enumerate(self.slots):
            if not slot.busy:
                continue
            try:
                if slot.prompt_rows:
                    self._prompt_logprobs(slot)
                if slot.row >= 0 and slot.draft:
                    out[slot_id] = self._verify(slot)
                elif slot.row >= 0 and not self._set_aside(slot_id, slot):
                    out[slot_id] = self._sample(slot)
            except Exception as exc:      # one sequence's sampling failed, not the step
                slot.row, slot.prompt_rows = -1, []
                out[slot_id] = TokenOut(-1, error=exc)
        return out

    def _prompt_logprobs(self, slot: Slot) -> None:
        started = time.perf_counter()
        for row, position in slot.prompt_rows:
            following = slot.prompt[position + 1]
            lse, logits = self._row(row)
            slot.prompt_logprobs.append((following, float(logits[following] - lse),
                                         top_of(logits, lse, slot.logprobs or 0)))
        each = 1000 * (time.perf_counter() - started) / len(slot.prompt_rows)
        self.logprob_row_ms = 0.8 * self.logprob_row_ms + 0.2 * each \
            if self.logprob_row_ms else each
        slot.prompt_rows = []

    def _verify(self, slot: Slot) -> list[TokenOut]:
        """Sample the token row, then each draft row while the sample equals the draft;
        keep the accepted positions in the KV cache, drop the rest."""
        draft, rows = slot.draft, [slot.row] + slot.draft_rows
        slot.draft, slot.draft_rows = [], []
        start = slot.n_past - len(draft)          # position of the first draft token
        outs: list[TokenOut] = []
        failed = None
        try:
            for i, row in enumerate(rows):
                slot.row = row
                outs.append(self._sample(slot))
                if i == len(draft) or outs[-1].token != draft[i] or \
                        self.is_eog(outs[-1].token):
                    break
        except Exception as exc:
            if not outs:
                raise
            # (the tokens sampled before it stand: plain decoding would have sent them
            # in the steps before the one that failed)
            failed, slot.row = exc, -1
        # draft tokens confirmed by a sample; the last sample is decoded next step (after
        # a failure, a confirmed draft token: its KV entry goes like a rejected one's)
        accepted = len(outs) - 1
        keep = start + accepted
        if keep < slot.n_past:
            if not llama_cpp.llama_memory_seq_rm(self.memory, slot.seq, keep, -1):
                raise EngineError("the KV cache could not drop a rejected draft")
            del slot.cached[keep:]
            slot.n_past = keep
        if failed is not None:
            accepted = len(outs)          # (every sample matched its draft token: counted)
        tried = slot.policy.tried           # (a guess filling drafts alike: no source's)
        own = min(len(draft), len(tried.tokens)) if tried else 0
        for source, drafted, kept in ((tried.source if tried else "", own, min(accepted, own)),
                                      ("guess", len(draft) - own, max(0, accepted - own))):
            if drafted:
                counts = self.totals.sources.setdefault(source, [0, 0])
                counts[0] += drafted
                counts[1] += kept
        slot.policy.record(len(draft), accepted)
        self.totals.accepted += accepted
        return outs if failed is None else outs + [TokenOut(-1, error=failed)]

    def _row(self, row: int) -> tuple[float, np.ndarray]:
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, row)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return log_sum_exp(logits), logits

    def _set_aside(self, slot_id: int, slot: Slot) -> bool:
        """Hand the slot's row to the side thread (True) where its sampling is dear
        beside the device's step (aside.py); it sits out until its token is drawn."""
        if self.deterministic or not slot.chain.drawn_by_llama or \
                not self.aside.worth(slot.sample_ms, self.step_ms):
            return False
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, slot.row),
                                       shape=(self.n_vocab,))
        self.aside.submit(slot_id, slot.chain, logits,
                          slot.ignore_eos or slot.sampled < slot.min_tokens, slot.logprobs)
        # (it sits out the step its draw is made beside: first line first does not ask
        # it to sit out the next one too)
        slot.row, slot.next_token, slot.sampled_aside = -1, None, True
        slot.sat_out = SIT_OUT_RUN
        return True

    def _drawn_aside(self, block: bool = False) -> dict[int, TokenOut]:
        """The tokens the side thread has drawn, each its slot's next."""
        out: dict[int, TokenOut] = {}
        for slot_id, draw in self.aside.ready(block).items():
            slot = self.slots[slot_id]
            if not slot.busy:
                continue
            if draw.error is not None:
                out[slot_id] = TokenOut(-1, error=draw.error)
                continue
            slot.timed_sampling(draw.seconds)
            try:
                out[slot_id] = self._took(slot, draw.token, draw.logprob, draw.top)
            except Exception as exc:      # (its own failure, as in _sample_all)
                out[slot_id] = TokenOut(-1, error=exc)
        return out

    def _sample(self, slot: Slot) -> TokenOut:
        # (timed from here: its logprobs' passes over the vocabulary are its sampling's
        # cost too, which decides whether it is drawn aside, beside the next step)
        started = time.perf_counter()
        lse = logits = top = None
        if slot.logprobs is not None:
            lse, logits = self._row(slot.row)
            top = top_of(logits, lse, slot.logprobs)
        if slot.ignore_eos or slot.sampled < slot.min_tokens:
            if logits is None:
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, slot.row),
                                               shape=(self.n_vocab,))
            saved = logits[self.eog_tokens].copy()
            logits[self.eog_tokens] = BANNED
        else:
            saved = None
        if logits is None and slot.chain.wants_logits:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, slot.row),
                                           shape=(self.n_vocab,))
        token = slot.chain.sample(self.ctx, slot.row, logits)
        if saved is not None:           # (ignore_eos, min_tokens: ends banned)
            token = slot.chain.ends_ok(token, logits, self.is_eog)
            logits[self.eog_tokens] = saved
        slot.timed_sampling(time.perf_counter() - started)
        slot.row, slot.sampled_aside = -1, False
        return self._took(slot, token, None if lse is None else float(logits[token] - lse),
                          top)

    def _took(self, slot: Slot, token: int, logprob: float | None,
              top: list | None) -> TokenOut:
        """The slot's sampled `token` (with its logprob and the top ones, where asked):
        decoded next step."""
        slot.next_token = token
        slot.sampled += 1
        if not slot.line_done and (slot.sampled >= FIRST_LINE_MAX or
                                   b"\n" in self.piece(token)):
            slot.line_done = True           # (first line first: a line that long is out)
        result = TokenOut(token)
        if logprob is not None:
            result.logprob, result.top = logprob, top
        if slot.prompt_logprobs is not None:
            result.prompt, slot.prompt_logprobs = slot.prompt_logprobs, None
        return result
