"""`LlamaEngine`: one model served to many sequences through llama-cpp-python's low-level
C API (not `Llama`), the engine the generation loop (`workers.generation`) drives.

One context holds `slots` sequences (one KV stream each). Each `step` builds one
`llama_batch`: a token for every generating slot (plus its speculative draft, chosen by
`workers.engine.drafting` from `workers.engine.speculation`'s proposals on the measured
`workers.engine.stepcosts`) and prompt pieces of the admitted ones, decodes it in a single
`llama_decode`, times it after `llama_synchronize`, then reads each slot's rows: samples
it and verifies its draft (`workers.engine.reading`, with `workers.engine.samplers` and
`workers.engine.draws`). The
vocabulary is `workers.engine.vocabulary`, the slots and what their caches hold (KV reuse
across requests) `workers.engine.slots`, the optional draft model
`workers.engine.draftmodel`. llama.cpp
releases the GIL, so the worker's IO thread heartbeats during a long decode. API facts
relied on (shared notes): exact-size piece buffers, `llama_sampler_sample` accepts the
token, `n_batch` is a hard assert, a grammar only accepts tokens its chain sampled.
Imported only after the worker has pinned itself (llama.cpp's backends start on import).
"""
from __future__ import annotations

import collections
import hashlib
import logging
import time

import llama_cpp

from dispatcher.common import protocol as P
from workers.errors import EngineError
from workers.engine.llamalog import RECENT, LlamaLog, set_llama_log
from workers.engine.loading import drops_positions, load_weights, make_context
from workers.engine.alphabet import TokenTexts
from workers.engine.aside import AsideDraws
from dispatcher.common.models import model_file_digest
from workers.engine.contextshape import ContextShape
from workers.engine.costprobe import device_step_costs, full_step_seconds
from workers.engine.draftmodel import DraftCosts, DraftModel
from workers.engine.drafting import DraftPlanner
from workers.engine.scheduling import Scheduler, prompt_first, sat, sat_out_enough
from workers.engine.spans import PAD_PROBE_EVERY, PROBE_AGAIN_BELOW, bridged, seq_runs
from workers.engine.history import Histories
from workers.engine.reading import BANNED, RowReading
from workers.engine.slots import COPY_AT_LEAST, Slot, SlotCaches
from workers.engine.speculation import DRAFT_MIN, FLOOR, Calibration, Drafter, common_prefix
from workers.engine.stepcosts import EACH, HostTime, StepCosts, draft_rows
from workers.engine.vocabulary import Vocabulary
from workers.engine.drysamplers import DryTemplates
from workers.engine.samplers import Candidates, SamplerChain
from workers.sampling import SamplingParams, TokenOut

log = logging.getLogger(__name__)

COSTS_LOG_EVERY = 5000  # steps that corrected the step costs between two logs of them
PROMPT_LOGPROB_CHUNK = 64   # prompt rows per step when every row's logits are kept (1 MiB each)
# ... fewer where this device's measured cost of a row with logits (its output layer over
# the whole vocabulary, draft rows measured at start-up) and the host's log-softmax and
# top candidates of it would make a step that much longer: a neighbour's next token waits
# for the step (64 rows took 1.4 s a step on 2 CPU cores; on a GPU they cost a few ms)
PROMPT_LOGPROB_STEP_MS = 150.0


def model_fingerprint(model_path: str, build: str) -> str:
    """Model file (models.model_file_digest) and build (llama-cpp-python's version), for
    `system_fingerprint`."""
    return "fp_" + hashlib.sha256(f"{model_file_digest(model_path)}:{build}".encode()
                                  ).hexdigest()[:12]


class LlamaEngine(RowReading):
    name = "llama"

    def __init__(self, model_path: str, n_ctx: int, slots: int, n_threads: int,
                 n_gpu_layers: int, verbose: bool = False, deterministic: bool = False,
                 prefill_chunk: int = 0, draft_max: int = 0, cache_reuse: int = 0,
                 log_content: bool = False, step_costs: StepCosts | None = None,
                 shape: ContextShape = ContextShape(), draft_model: str | None = None,
                 draft_costs: DraftCosts | None = None, measure_costs: bool = False):
        if shape.n_batch < slots:       # (llama_batch_init's arrays hold n_batch rows)
            raise EngineError(f"--batch {shape.n_batch} is below the slots ({slots}): a "
                              "step holds a row for each generating sequence")
        self.lib = llama_cpp
        self.log = set_llama_log(LlamaLog(verbose, log_content))   # held while loaded
        self.log.recent = collections.deque(maxlen=RECENT)
        self.deterministic = deterministic
        try:
            weights = load_weights(llama_cpp, model_path, n_gpu_layers, deterministic, self.log)
            context = make_context(llama_cpp, weights.model, n_ctx, slots, n_threads, shape,
                                   self.log)
        finally:
            self.log.recent = None
        self.model, self.vocab, self.n_vocab, self.n_layer = (
            weights.model, weights.vocab, weights.n_vocab, weights.n_layer)
        self.layers_offloaded, self.layers_total = weights.layers_offloaded, weights.layers_total
        repacking = weights.repacking
        self.ctx, self.memory, self.batch = context.ctx, context.memory, context.batch
        self.n_ctx, self.n_ctx_train = context.n_ctx, context.n_ctx_train
        self.n_batch, self.n_ubatch, self.kv_type = context.n_batch, context.n_ubatch, shape.kv_type
        # prompt tokens decoded per step, all prompts together (0: as many as fit)
        self.prefill_chunk = prefill_chunk if prefill_chunk > 0 else self.n_batch
        # prompt-lookup speculation; 0: off. Never in deterministic mode: verification rows
        # decoded beside the token's row change logprobs in their last bits (measured)
        drops = drops_positions(llama_cpp, self.model)
        self.drops_positions = drops     # (filler rows are removed after their step too)
        measure = self._drafts_and_costs(slots, draft_max, measure_costs)
        self.copy_at_least = COPY_AT_LEAST
        self.totals = P.StepTotals()     # the step profile (bench --profile, /metrics)
        self.padded = 0                  # steps whose lone run fillers padded (_fillers)
        self.probing = False             # ... this step would have been: it is observed
        self.probe_again = False         # ... and came out cheaper than its cost said
        self.held: frozenset[int] = frozenset()  # sequences held back from the last step
                                                # for a prompt's first token (_generating)
        self.host = HostTime()           # the host's time between two decodes
        self.histories = Histories()     # recent sequences per tenant: a draft source
        self.calibration = Calibration()  # each source's measured acceptance, all sequences
        self.scheduler = Scheduler()     # first line first, prompt pieces (scheduling.py)
        self.draft_planner = DraftPlanner()  # who drafts, and how long (drafting.py)
        # KV chunk reuse (workers/engine/kvreuse.py) needs position shifts; never in
        # deterministic mode (shifted keys differ from prefilled ones in their last bits).
        # A sibling choice may copy a decoded prompt (copy_prefix): a memory that can
        # drop positions, and no deterministic mode.
        # (a recurrent or hybrid model's memory says it can shift, but its state cannot
        # drop the text between two chunks: no chunk reuse there)
        self.caches = SlotCaches(
            llama_cpp, self.memory, slots,
            cache_reuse if not deterministic and drops and
            llama_cpp.llama_memory_can_shift(self.memory) else 0,
            copies=drops and not deterministic, n_swa=llama_cpp.llama_model_n_swa(self.model))
        self.slots = self.caches.slots
        self._read_vocabulary()
        # costly sampling goes beside the next step (workers/engine/aside.py), judged
        # against the device's measured step (an average of the decodes' times)
        self.aside = AsideDraws(llama_cpp, self.n_vocab, self.eog_tokens, BANNED)
        self.step_ms = 0.0
        self.fingerprint = model_fingerprint(model_path, llama_cpp.__version__)
        self.logprob_row_ms = 0.0       # the host's log-softmax and top-k of a row, measured
        self.logprob_device_ms = 0.0    # ... and a row's share of steps that had such rows
        # whether a draft pays in a step: this device's step times by batch shape,
        # measured here and kept current by the steps (given ones stay as given)
        self.learn_costs = step_costs is None
        self.step_costs = step_costs or (device_step_costs(
            self, slots, n_threads, n_gpu_layers, repacking) if measure else None)
        self.draft_model = self._draft_model(draft_model, n_ctx, slots, n_threads,
                                             n_gpu_layers, shape, repacking, draft_costs)

    def _drafts_and_costs(self, slots: int, draft_max: int, measure_costs: bool) -> bool:
        """Sets `draft_max` (0 in deterministic mode, on a memory that cannot drop
        positions, or where the batch cannot hold the shapes measuring step costs takes);
        whether to measure the device's step costs. They decide the drafts and the
        schedule beside them (prompt first, sit-outs, filler rows, routing): measured
        with drafts off too where asked (a worker always asks), never in deterministic
        mode."""
        able = self.drops_positions and not self.deterministic
        self.draft_max = draft_max if able else 0
        wanted = bool(self.draft_max or measure_costs and able)
        if wanted and self.n_batch < draft_rows(slots):
            log.warning("drafts off: --batch %d is below the %d rows measuring the step "
                        "costs takes with %d slots (prompt first, filler rows and routing "
                        "by cost off too)", self.n_batch, draft_rows(slots), slots)
            self.draft_max = 0
            return False
        return wanted

    def _read_vocabulary(self) -> None:
        """The vocabulary's special tokens (end of generation, FIM, BOS), the tokenizer,
        and the candidate buffers every slot's sampling shares."""
        self.candidates = Candidates(llama_cpp, self.n_vocab)
        # a filler row's token (`_fillers`): any will do, its row is removed after the step
        self.filler_token = max(0, llama_cpp.llama_vocab_bos(self.vocab))
        self.candidates.dry = DryTemplates(llama_cpp, self.vocab)
        self.eog_tokens = [t for t in range(self.n_vocab)
                           if llama_cpp.llama_vocab_is_eog(self.vocab, t)]
        fim = (llama_cpp.llama_vocab_fim_pre(self.vocab), llama_cpp.llama_vocab_fim_suf(self.vocab),
               llama_cpp.llama_vocab_fim_mid(self.vocab))
        self.fim_tokens = fim if all(t >= 0 for t in fim) else None
        repo = tuple(t if t >= 0 else None for t in (
            llama_cpp.llama_vocab_fim_rep(self.vocab), llama_cpp.llama_vocab_fim_sep(self.vocab)))
        self.fim_repo = repo if repo != (None, None) else None   # repo-level FIM
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.vocabulary = Vocabulary(llama_cpp, self.vocab, self.n_vocab, self.add_bos)
        eog = frozenset(self.eog_tokens)
        self.candidates.texts = TokenTexts(        # a fought grammar's tokens (alphabet.py)
            self.n_vocab, lambda t: self.vocabulary.piece(t, special=True), eog.__contains__)

    def _draft_model(self, path: str | None, n_ctx: int, slots: int, n_threads: int,
                     n_gpu_layers: int, shape: ContextShape, repacking: bool,
                     costs: DraftCosts | None) -> DraftModel | None:
        """A small model of this vocabulary drafting beside the lookups (draftmodel.py),
        where one is given and speculation is on."""
        if not path:
            return None
        if not self.draft_max:
            log.warning("--draft-model %s unused: speculation is off (--draft-max 0, "
                        "deterministic, or a recurrent or hybrid served model)", path)
            return None
        try:
            model = DraftModel(llama_cpp, path, self.vocab, n_ctx, slots, n_threads,
                               n_gpu_layers, shape, repacking, costs)
        except EngineError:
            self.draft_model = None
            self.close()
            raise
        log.info("draft model %s: a decode of 1 row %.2f ms, of %d rows %.2f ms, a "
                 "catch-up token %.3f ms", path, model.costs.step_ms(1), slots,
                 model.costs.step_ms(slots), model.costs.catch_up_ms)
        return model

    def after_load(self) -> None:
        """What is made beside serving once the worker is up: nothing yet. (The
        vocabulary's texts for grammars' alphabets are made when the first grammar asks,
        which waits for them on the preparing thread, alphabet.py: made here, at every
        start, they slowed a respawned worker's first seconds for everyone.)"""

    def full_step_seconds(self) -> float:
        """One decode of a full batch on this device (the watchdog's --step-timeout
        auto): measured with the step costs where they were measured on this device (now,
        or at an earlier start and kept), otherwise now."""
        measured = self.step_costs.full_step_s if self.learn_costs and self.step_costs \
            else None
        return measured if measured is not None else full_step_seconds(self)

    # -- the vocabulary (workers.engine.vocabulary), as the Engine protocol names it ----
    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        return self.vocabulary.tokenize(text, add_special, parse_special)

    def bos(self) -> list[int]:
        return self.vocabulary.bos()

    def piece(self, token: int, special: bool = False) -> bytes:
        return self.vocabulary.piece(token, special)

    def is_eog(self, token: int) -> bool:
        return self.vocabulary.is_eog(token)

    def longest_piece(self) -> int:
        return self.vocabulary.longest_piece()

    def check_tokens(self, tokens: list[int], param: str = "prompt") -> None:
        self.vocabulary.check_tokens(tokens, param)

    # -- sequences ---------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def copies(self) -> bool:
        """Whether a sibling choice may copy a decoded prompt (`copy_prefix`)."""
        return self.caches.copies

    def cached_prefix(self, tokens: list[int], free: list[int]) -> int:
        """The most of `tokens` that the free slot `best_slot` would choose holds."""
        return self.caches.cached_prefix(tokens, free)

    def best_slot(self, tokens: list[int], free: list[int]) -> int:
        """The free slot to start `tokens` in (`SlotCaches.best`: the one whose cache
        holds most of them, then one that adds no sub-batch to the steps)."""
        fillable = self._free_seqs()
        return self.caches.best(tokens, free, fillable,
                                self.step_costs.plain_cost if fillable else None)

    def prefill_left(self, slot_id: int) -> int:
        """Prompt tokens the busy slot has still to decode (0: free, or decoded)."""
        slot = self.slots[slot_id]
        return len(slot.pending) if slot.busy else 0

    def set_budget(self, slot_id: int, left: int | None, least: int = 0) -> None:
        """The busy slot may generate `left` more tokens (None: no limit) and must
        generate `least` more before it may end (min_tokens): its drafts, its prefill
        priority (a warm-up's, budget 0, goes last) and its ban on ending follow the
        request that now owns its generation (an adoption), not the one that started it."""
        slot = self.slots[slot_id]
        slot.budget = None if left is None else slot.sampled + max(0, left)
        slot.min_tokens = slot.sampled + max(0, least)

    def copy_prefix(self, src: int, dst: int, tokens: list[int]) -> int:
        """Into free slot `dst`'s cache, the start of `tokens` that slot `src` holds
        (`SlotCaches.copy_prefix`: a sibling choice decodes only its last prompt token);
        returns the tokens now cached there."""
        n = self.caches.copy_prefix(src, dst, tokens)
        if n and self.draft_model is not None:  # (its cache of the slot was the last
            self.draft_model.forget(dst)        # tenant's, and no longer this text's)
        return n

    def add(self, slot_id: int, tokens: list[int], sampling: SamplingParams,
            logprobs: int | None = None, prompt_logprobs: bool = False,
            reuse: bool = True, draft_max: int | None = None,
            history: str | None = None, budget: int | None = None,
            chain: SamplerChain | None = None, penalize_prompt: bool = False) -> int:
        """Start a sequence in a free slot; its prompt is decoded by the coming steps.
        Returns how many prompt tokens were already in the slot's KV cache (reused).
        `history` names whose recent sequences may be drafted from (a tenant; None:
        none), and where this one's goes when it ends; `budget`, the tokens it may
        generate, keeps drafts from running past its end. `chain`: the sampler chain
        made ahead for `sampling` (`sampler_chain`), which the slot takes."""
        slot = self.slots[slot_id]
        if slot.busy:
            raise EngineError(f"slot {slot_id} is busy")
        self.check_tokens(tokens)
        made = chain is None                # (freed here if this start fails: its own)
        chain = chain or self.sampler_chain(sampling, history)
        try:
            chain.accept_prompt(tokens, penalties=penalize_prompt)
            # At least the last prompt token is decoded again: its logits start
            # generation. Prompt logprobs need every prompt row's logits, so nothing is
            # reused then. Decoding a prompt in other pieces changes its numbers:
            # deterministic mode never reuses a cached prefix.
            if reuse and not prompt_logprobs and not self.deterministic:
                n_past = self.caches.reuse(slot, tokens, min(
                    common_prefix(slot.cached, tokens), len(tokens) - 1))
            else:
                n_past = 0
                self.caches.forget(slot)
            if not reuse and self.draft_model is not None:
                # (its cache is the slot's last tenant's: how far it had to catch up,
                # whether its drafts went in, told whether that tenant's prompt began as
                # this one)
                self.draft_model.forget(slot_id)
            policy = self._drafter(sampling, draft_max, history, len(tokens))
        except BaseException:
            if made:
                chain.free()
            raise
        # (the chain last: a slot holding it is busy, and a start that failed with the
        # slot holding a chain its caller then freed had the next step sample from it)
        slot.pending, slot.prompt, slot.n_past = list(tokens[n_past:]), list(tokens), n_past
        slot.next_token, slot.row, slot.chain, slot.sampled = None, -1, chain, 0
        slot.line_done, slot.sat_out, slot.budget = False, 0, budget
        slot.sample_ms, slot.sampled_aside = 0.0, False
        slot.passed_over = False
        slot.policy = policy
        slot.logprobs = logprobs
        slot.prompt_logprobs = [] if prompt_logprobs else None
        slot.min_tokens, slot.ignore_eos = sampling.min_tokens, sampling.ignore_eos
        self.draft_planner.arrived(slot_id, any(s.busy for s in self.slots if s is not slot))
        return n_past

    def _drafter(self, sampling: SamplingParams, draft_max: int | None,
                 history: str | None, prompt_tokens: int) -> Drafter | None:
        """A new sequence's drafting policy (None: it drafts nothing)."""
        limit = self.draft_max if draft_max is None else min(draft_max, self.draft_max)
        if not limit:
            return None
        costs = self.step_costs
        policy = Drafter(limit, proven_only=sampling.wide, calibration=self.calibration,
                         min_len=costs.shortest_draft() if costs else DRAFT_MIN,
                         floor=costs.floor_share(limit) if costs else FLOOR)
        if history is not None:
            policy.history = self.histories.of(history)
            policy.output_from = prompt_tokens
            # a sampled answer is one draw: the next is unlikely to repeat it
            policy.drafts_from_history = sampling.greedy
        return policy

    def _logprob_rows(self) -> int:
        """Prompt rows with logprobs a step may take, all such prompts together: as many
        as add at most PROMPT_LOGPROB_STEP_MS to it, by the measured cost of a row with
        logits on this device and of its log-softmax here (PROMPT_LOGPROB_CHUNK at most)."""
        costs, top = self.step_costs, PROMPT_LOGPROB_CHUNK
        device = self.logprob_device_ms or (0.0 if costs is None else
                                            max(0.0, costs.cost(1, top) - costs.plain_cost(1)) / top)
        per_row = device + self.logprob_row_ms
        if per_row <= 0:
            return top
        return max(1, min(top, int(PROMPT_LOGPROB_STEP_MS / per_row)))

    def sampler_chain(self, sampling: SamplingParams, tenant: str | None = None
                      ) -> SamplerChain:
        """A sequence's samplers for `sampling` (any thread: llama.cpp builds them from the
        vocabulary alone, the GIL released); what it keeps for later chains, `tenant`'s."""
        return SamplerChain(llama_cpp, self.vocab, self.n_vocab, self.n_ctx, sampling,
                            self.candidates, tenant)

    def clear_caches(self) -> None:
        """Forget every idle slot's cached prefix (after a failed decode, say)."""
        self.caches.forget_idle()
        if self.draft_model is not None:
            self.draft_model.forget()

    def release(self, slot_id: int, keep_cache: bool = True) -> None:
        """End the slot's sequence; the slot is free at once. Its KV cache stays for
        the next prompt that shares a prefix with it, unless `keep_cache` is False."""
        slot = self.slots[slot_id]
        self.aside.forget(slot_id)          # (a draw in flight uses its chain)
        # (the slot free first: whatever raises below, no step samples a freed chain)
        chain, slot.chain = slot.chain, None
        slot.pending, slot.n_past, slot.next_token, slot.row = [], 0, None, -1
        slot.prompt_rows, slot.prompt_logprobs = [], None
        slot.draft, slot.draft_rows = [], []     # (a step that failed leaves its drafts)
        try:
            if chain is not None:
                chain.free()
            if slot.policy is not None and slot.policy.history is not None:
                history, slot.policy.history = slot.policy.history, None   # (once a sequence)
                history.add(slot.cached, len(slot.prompt))
                slot.policy.learn(slot.cached)   # (the model's tokens since its last draft)
        finally:
            if not keep_cache:
                self.caches.forget(slot)
            if not any(s.busy for s in self.slots):
                self.host.idle()

    # -- decoding ----------------------------------------------------------------------
    def step(self) -> dict[int, TokenOut]:
        """One decode for every busy slot; returns what each slot that finished its
        prompt or is generating sampled.

        Rows go in slot order (ascending sequence ids keep llama.cpp's per-stream batch
        split to few micro-batches). Every generating slot gets its row first; prompt
        chunks share the room left in `n_batch`. In deterministic mode a prompt chunk is
        decoded in a batch of its own, so batch composition never changes the numbers.
        """
        drawn = self._drawn_aside()
        if drawn:               # their tokens go out first; the next step decodes them
            return drawn
        if self.aside.pending and not any(s.busy and (s.pending or s.next_token is not None)
                                          for s in self.slots):
            return self._drawn_aside(block=True)   # nothing else to decode: wait for one
        planning = time.perf_counter()
        generating, grant, planning = self._plan(planning)
        fillers = self._fillers(generating, grant)
        n, logprob_rows = self._fill_batch(generating, grant, fillers)
        if n == 0:              # nothing to decode but draws made aside: wait for one
            return self._drawn_aside(block=bool(self.aside.pending))
        self.batch.n_tokens = n
        started = time.perf_counter()
        try:
            rc = llama_cpp.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise EngineError(f"llama_decode returned {rc}")
            llama_cpp.llama_synchronize(self.ctx)     # (a GPU's decode returns before its end)
        finally:
            for seq, (start, _) in fillers.items():   # (their caches as they were)
                llama_cpp.llama_memory_seq_rm(self.memory, seq, start, -1)
        decoded = time.perf_counter()
        self.host.decoded(started, decoded, any(
            s.busy and (s.pending or s.next_token is not None or s.row >= 0)
            for s in self.slots))
        self._count_step(generating, grant, started - planning, decoded - started, fillers)
        ms = 1000 * (decoded - started)
        self.step_ms = 0.9 * self.step_ms + 0.1 * ms if self.step_ms else ms
        if logprob_rows:        # (every row's share of the step: an upper bound of one's)
            each = 1000 * (time.perf_counter() - started) / n
            self.logprob_device_ms = 0.8 * self.logprob_device_ms + 0.2 * each \
                if self.logprob_device_ms else each
        self._observe_costs(generating, grant, 1000 * (decoded - started), fillers)
        out = self._sample_all()
        self.totals.sample_seconds += time.perf_counter() - decoded
        return out

    def _plan(self, planning: float) -> tuple[list, dict[int, int], float]:
        """Who gets rows in this step (`workers.engine.scheduling`): the generating slots
        (each with its draft, `workers.engine.drafting`) and the prompt rows granted by
        slot; and when planning began, moved on by the draft model's time (the plan's time
        is the host's alone).
        A step that would finish a waiting prompt beside them decodes the prompt alone
        where that pays (`prompt_first`); the next is then theirs, without prompt rows."""
        held, self.held = self.held, frozenset()
        fillable = self._free_seqs()     # (the free slots a filler row may go in)
        # Prefill priority: the prompts with the least left to decode first (the next
        # keystroke of a session, mostly cached) take the room before cold ones; a
        # warm-up (nothing to generate nor score: llama.vim's ring updates, whose answers
        # nobody reads) only takes what the prompts someone waits on leave.
        prefilling = sorted((s for s in self.slots if s.busy and s.pending),
                            key=lambda s: (s.budget == 0 and s.prompt_logprobs is None,
                                           len(s.pending)))
        if self.deterministic and prefilling:
            generating, prefilling = [], prefilling[:1]
        else:
            generating = self._generating(prefilling, fillable, held)
        self.calibration.step()
        drafting = self.draft_model.seconds if self.draft_model is not None else 0.0
        self.draft_planner.draft(self.slots, generating, prefilling, self.n_ctx, self.n_batch,
                                 self.step_costs, self.draft_model, fillable)
        if self.draft_model is not None:
            drafting = self.draft_model.seconds - drafting
            self.totals.draft_seconds += drafting
            planning += drafting
        self.host.drafted = drafting
        # Every generating slot has its rows; prompts share at most `prefill_chunk` more,
        # so a long prompt holds the running streams back by one chunk a step at most.
        rows = sum(1 + len(s.draft) for s in generating)
        room = min(self.n_batch - rows, self.prefill_chunk)
        if held and generating:         # (theirs: a prompt passed over keeps its pace)
            prefilling = [s for s in prefilling if s.passed_over][:1]
        return generating, self.scheduler.prefill(prefilling, room, self._logprob_rows(),
                                                  rows), planning

    def _generating(self, prefilling: list, fillable: frozenset[int],
                    held: frozenset[int]) -> list:
        """The generating slots with rows in this step: first line first's choice, or
        none where the prompt first in line goes before them (`_prompt_first`; not while
        one of them has sat out enough, `sat_out_enough`). Those are then `held`, counted as
        sitting out, and the next step is theirs: none of them sits out there, and no
        prompt rows go beside them but the piece of one passed over."""
        running = [s for s in self.slots if s.busy and s.next_token is not None]
        if held:
            chosen = {s.seq for s in self.scheduler.first_line_first(
                running, [], self.step_costs, 0, fillable)}
            for slot in running:
                if slot.seq in held:
                    slot.sat_out = 0
            return [s for s in running if s.seq in chosen or s.seq in held]
        before = {s.seq: (s.sat_out, s.sat_out_since) for s in running}
        generating = self.scheduler.first_line_first(
            running, prefilling, self.step_costs, self._prompt_rows_at_least(
                prefilling, min(self.n_batch - len(running), self.prefill_chunk)),
            fillable)
        if not self._prompt_first(generating, prefilling):
            return generating
        for slot in generating:         # (the runs they had sat out before this step)
            slot.sat_out, slot.sat_out_since = before[slot.seq]
        now = time.monotonic()
        hold = not any(sat_out_enough(s, now=now) for s in generating)
        for slot in generating:
            sat(slot, hold, now)
        if not hold:
            return generating
        self.held = frozenset(s.seq for s in generating)
        return []

    def _prompt_first(self, generating: list, prefilling: list) -> bool:
        """Whether the first prompt in line, one a user waits on, finishes in this step's
        room and goes alone before the generating sequences (`prompt_first`)."""
        if not generating or not prefilling or self.step_costs is None:
            return False
        first = prefilling[0]
        if first.budget == 0 and first.prompt_logprobs is None:
            return False                # (a warm-up: nobody reads its tokens)
        room = min(self.n_batch, self.prefill_chunk)
        if self._prompt_rows_at_least(prefilling, room) < len(first.pending):
            return False
        return prompt_first(len(generating), len(first.pending), self.step_costs,
                            self.host.ms)

    def _prompt_rows_at_least(self, prefilling: list, room: int) -> int:
        """The prompt rows this step will take at least: the first prompt's piece (it
        is never passed over, `Scheduler.prefill`), before drafts take any room."""
        if not prefilling or room <= 0:
            return 0
        first = prefilling[0]
        take = min(room, len(first.pending))
        if first.prompt_logprobs is not None:
            take = min(take, self._logprob_rows())
        return take

    def _free_seqs(self) -> frozenset[int]:
        """The free slots whose caches have room for a filler row beside every
        sequence's drafts (`_fillers`); none in deterministic mode or without costs."""
        if self.deterministic or self.step_costs is None or not self.drops_positions:
            return frozenset()
        return frozenset(s.seq for s in self.slots
                         if not s.busy and len(s.cached) + 1 + EACH[-1] < self.n_ctx)

    def _fillers(self, generating: list, grant: dict[int, int]) -> dict[int, tuple[int, int]]:
        """The slots without rows in this step that get filler rows ({seq: (first
        position, rows)}): llama.cpp decodes each run of consecutive sequence ids as a
        batch of its own, so a free sequence between runs takes as many rows as each
        generating one (at the end of its cache, removed after the decode) where one
        batch of the whole span costs less on the measured step costs
        (`spans.bridged`); so does one beside a lone run where more rows cost less
        (seven padded to eight), except beside a prompt piece and on the steps that
        observe the lone run's own cost (the first, one in PAD_PROBE_EVERY, and the next
        while one comes out under PROBE_AGAIN_BELOW of its cost). Nothing where the step
        costs are not measured, in deterministic mode, where the model's memory cannot
        drop positions (a recurrent one), or where the batch has no room for them."""
        if self.deterministic or self.step_costs is None or not generating or \
                not self.drops_positions:
            return {}
        counts = {1 + len(s.draft) for s in generating}
        rows = counts.pop() if len(counts) == 1 else 1
        costs = self.step_costs
        cost_of = costs.plain_cost if rows == 1 else (lambda n: costs.each_cost(n, rows - 1))
        present = {s.seq for s in generating} | set(grant)
        free: dict[int, int] = {}
        for slot in self.slots:
            if slot.seq in present:
                continue
            start = llama_cpp.llama_memory_seq_pos_max(self.memory, slot.seq) + 1
            if start + rows < self.n_ctx and len(slot.cached) + rows < self.n_ctx:
                free[slot.seq] = start
        if not free:
            return {}
        spans = bridged(sorted(present), free.keys(), cost_of)
        fill = {q: (free[q], rows) for first, last in spans for q in range(first, last + 1)
                if q not in present}
        used = sum(1 + len(s.draft) for s in generating) + sum(grant.values())
        if not fill or used + rows * len(fill) > self.n_batch:
            return {}
        if len(seq_runs(sorted(present))) == 1:
            if grant:           # (a prompt piece's rows make the step: its count of
                return {}       # sequences is not what it costs)
            self.padded += 1    # (the first, and now and then, not: so that its own
            if self.probe_again or self.padded % PAD_PROBE_EVERY == 1:  # cost is observed)
                self.probing = True
                return {}
        return fill

    def _fill_batch(self, generating: list, grant: dict[int, int],
                    fillers: dict[int, tuple[int, int]] | None = None) -> tuple[int, int]:
        """The batch's rows, in slot order: each generating slot's token and draft, each
        granted prompt piece, each filler (`_fillers`: rows of a token at the end of
        a free slot's cache, with logits as the step costs were measured; its state
        untouched). Returns (rows, prompt rows with logprobs)."""
        batch, n, logprob_rows = self.batch, 0, 0
        fillers = fillers or {}

        def put(seq: int, position: int, token: int, logits: bool) -> int:
            nonlocal n
            batch.token[n] = token
            batch.pos[n] = position
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq
            batch.logits[n] = logits
            n += 1
            return n - 1

        def add_row(slot: Slot, token: int, logits: bool) -> int:
            slot.n_past += 1
            slot.cached.append(token)
            return put(slot.seq, slot.n_past - 1, token, logits)

        for slot in self.slots:
            if slot in generating:
                slot.row = add_row(slot, slot.next_token, True)
                slot.next_token = None
                slot.draft_rows = [add_row(slot, token, True) for token in slot.draft]
            elif slot.seq in grant:
                take = grant[slot.seq]
                if slot.prompt_logprobs is not None:
                    logprob_rows += take
                chunk, slot.pending = slot.pending[:take], slot.pending[take:]
                slot.prompt_rows = []
                for i, token in enumerate(chunk):
                    last = not slot.pending and i == len(chunk) - 1
                    position = slot.n_past
                    row = add_row(slot, token, last or slot.prompt_logprobs is not None)
                    if slot.prompt_logprobs is not None and not last:
                        slot.prompt_rows.append((row, position))
                    if last:
                        slot.row = row
            elif slot.seq in fillers:
                start, rows = fillers[slot.seq]
                for i in range(rows):
                    put(slot.seq, start + i, self.filler_token, True)
        return n, logprob_rows

    def _observe_costs(self, generating: list, grant: dict[int, int], ms: float,
                       fillers: dict[int, tuple[int, int]] | None = None) -> None:
        """A step of a measured shape (no prompt rows, one run of consecutive sequences,
        fillers counted, drafts on one of them or alike on all) keeps the step costs
        current."""
        fillers = fillers or {}
        probing, self.probing = self.probing, False
        if not (self.learn_costs and self.step_costs is not None and not grant and
                generating and len(seq_runs(sorted({s.seq for s in generating} |
                                                   set(fillers)))) == 1):
            return
        drafts = [len(s.draft) for s in generating] + [rows - 1 for _, rows in fillers.values()]
        each = len(drafts) > 1 and min(drafts) > 0 and len(set(drafts)) == 1
        measured = each or sum(1 for d in drafts if d) <= 1
        if not (measured and self.step_costs.observe(
                len(drafts), drafts[0] if each else sum(drafts), ms, each)):
            return
        if probing:             # (a lone run left unpadded: cheaper than its cost said?)
            self.probe_again = self.step_costs.last_ratio < PROBE_AGAIN_BELOW
        if self.step_costs.observed % COSTS_LOG_EVERY == 0:
            log.info("step costs now (ms by sequences, draft rows): %s",
                     self.step_costs.summary())

    def _count_step(self, generating: list, grant: dict[int, int], plan: float,
                    decode: float, fillers: dict[int, tuple[int, int]] | None = None) -> None:
        """The step profile's counters (protocol.StepTotals)."""
        totals = self.totals
        totals.steps += 1
        totals.token_rows += len(generating)
        totals.draft_rows += sum(len(s.draft) for s in generating)
        totals.prompt_rows += sum(grant.values())
        totals.filler_rows += sum(rows for _, rows in (fillers or {}).values())
        totals.batches += len(seq_runs(sorted({s.seq for s in generating} | set(grant) |
                                              set(fillers or {}))))
        totals.sat_out += sum(1 for s in self.slots if s.busy and s.sat_out)
        totals.plan_seconds += plan
        totals.decode_seconds += decode

    def draft_stats(self, slot_id: int) -> tuple[int, int]:
        """(drafted, accepted) tokens of the slot's current sequence."""
        policy = self.slots[slot_id].policy
        return (policy.proposed, policy.accepted) if policy else (0, 0)

    def close(self) -> None:
        self.aside.close()
        self.candidates.texts.close()
        for slot_id in range(len(self.slots)):
            self.release(slot_id, keep_cache=False)
        self.candidates.dry.close()
        if getattr(self, "draft_model", None) is not None:
            self.draft_model.close()
            self.draft_model = None
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)
