"""A draft model: a small model of the served model's vocabulary, on the same device,
that drafts for it (llama.cpp's `-md`, its `--fim-qwen-7b-spec` presets).

It keeps a KV cache per slot of its own: before drafting, each sequence's cache is
brought level with the sequence's context (what the last verification rejected is
dropped, what the served model wrote since is decoded: `catch_up`), then every sequence
that drafts gets one row a decode, each the draft model's most likely next token, until
its draft is as long as the step's plan asked. Whether it drafts at all, and how long,
is the step costs' to say (`workers.engine.stepcosts.plan`), with what making the draft
costs counted: its decodes, measured here at start-up after the device has finished
(`DraftCosts`), and a share of the catch-up over the tokens the sequence has left.

Its vocabulary must be the served model's: checked at load as llama.cpp's server
checks it (same kind, same special tokens, the same text for every token that both
have, at most VOCAB_SIZE_SLACK tokens more or fewer); a mismatch refuses in one line.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from workers.errors import EngineError
from workers.engine.speculation import common_prefix

VOCAB_SIZE_SLACK = 128      # token counts may differ this much (padding), as llama.cpp's
VOCAB_CHECK_FROM = 5        # the first tokens (control ones) may differ in text
CATCH_UP_ROWS = 512         # context tokens a draft call decodes at most, all sequences
COST_REPEATS = 3            # each start-up shape's fastest of this many runs counts


def vocab_mismatch(lib, target, draft) -> str | None:
    """Why the draft vocabulary cannot draft for the target's (None: it can)."""
    if lib.llama_vocab_type(target) != lib.llama_vocab_type(draft):
        return "its vocabulary is of another kind"
    for name in ("bos", "eos"):
        get = getattr(lib, f"llama_vocab_{name}")
        if get(target) != get(draft):
            return f"its {name} token is {get(draft)}, the served model's {get(target)}"
    if lib.llama_vocab_get_add_bos(target) != lib.llama_vocab_get_add_bos(draft):
        return "it adds a bos token where the served model does not, or the other way"
    n_target, n_draft = lib.llama_vocab_n_tokens(target), lib.llama_vocab_n_tokens(draft)
    if abs(n_target - n_draft) > VOCAB_SIZE_SLACK:
        return f"its vocabulary has {n_draft} tokens, the served model's {n_target}"
    for token in range(VOCAB_CHECK_FROM, min(n_target, n_draft)):
        if lib.llama_vocab_get_text(target, token) != lib.llama_vocab_get_text(draft, token):
            text = lib.llama_vocab_get_text(draft, token)
            return (f"token {token} is {text!r} in it and "
                    f"{lib.llama_vocab_get_text(target, token)!r} in the served model")
    return None


@dataclass
class DraftCosts:
    """Milliseconds of the draft model's decodes on this device: one row for each of S
    sequences (`rows`, by S), and a catch-up token (`catch_up_ms`, a chunk's share)."""
    rows: dict[int, float]
    catch_up_ms: float

    def step_ms(self, sequences: int) -> float:
        """A decode of one row for each of `sequences` sequences (linear between the
        counts measured, by the largest's per-row cost past it)."""
        known = sorted(self.rows)
        if sequences <= known[0]:
            return self.rows[known[0]]
        for lo, hi in zip(known, known[1:]):
            if sequences <= hi:
                t = (sequences - lo) / (hi - lo)
                return (1 - t) * self.rows[lo] + t * self.rows[hi]
        return self.rows[known[-1]] * sequences / known[-1]

    def token_ms(self, sequences: int) -> float:
        """Making one draft token for each of `sequences` drafting together, per sequence."""
        return self.step_ms(sequences) / max(1, sequences)


class DraftModel:
    """The draft model's weights, context and per-slot caches (see the module)."""

    def __init__(self, lib, path: str, target_vocab, n_ctx: int, slots: int,
                 n_threads: int, n_gpu_layers: int, shape, use_extra_bufts: bool,
                 costs: DraftCosts | None = None):
        self.lib = lib
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        mparams.use_extra_bufts = use_extra_bufts
        self.model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise EngineError(f"llama.cpp could not load the draft model {path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        problem = vocab_mismatch(lib, target_vocab, self.vocab)
        if lib.llama_model_is_recurrent(self.model) or lib.llama_model_is_hybrid(self.model):
            problem = ("it is a recurrent or hybrid model, whose memory cannot drop the "
                       "draft tokens the served model refuses")
        if problem:
            lib.llama_model_free(self.model)
            raise EngineError(f"the draft model {path} cannot draft for the served model: "
                              f"{problem}")
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        # its greedy pick among the tokens the served model has too (it may have up to
        # VOCAB_SIZE_SLACK more: a token the served model lacks fails its whole decode)
        self.n_shared = min(self.n_vocab, lib.llama_vocab_n_tokens(target_vocab))
        cparams = shape.context_params(lib, n_ctx, slots, n_threads)
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise EngineError(f"llama.cpp could not create the draft model's context of "
                              f"{n_ctx * slots} tokens")
        self.n_ctx = n_ctx
        self.n_batch = lib.llama_n_batch(self.ctx)
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self.cached: list[list[int]] = [[] for _ in range(slots)]
        self.seconds = 0.0          # spent drafting, catch-up included (the step profile)
        try:
            self.costs = costs or self.measure(slots)
        except EngineError:
            self.close()
            raise

    # -- start-up --------------------------------------------------------------------
    def measure(self, slots: int) -> DraftCosts:
        """Time a catch-up chunk and one-row-a-sequence decodes for 1, 2, 4, ... slots
        sequences, each after llama_synchronize (a GPU's decode returns before its end);
        the caches are emptied after."""
        chunk = [VOCAB_CHECK_FROM + i % 64 for i in range(min(64, self.n_batch))]
        catch = []
        for _ in range(COST_REPEATS):
            self._clear()
            catch.append(self._timed([(0, t, p, False) for p, t in enumerate(chunk)]))
        for seq in range(1, slots):        # every slot holds the chunk as its context
            self.lib.llama_memory_seq_cp(self.memory, 0, seq, -1, -1)
        counts = sorted({1, slots} | {1 << k for k in range(1, slots.bit_length())
                                      if 1 << k < slots})
        rows: dict[int, float] = {}
        position = len(chunk)
        for _ in range(COST_REPEATS):
            for count in counts:
                ms = self._timed([(seq, chunk[0], position, True) for seq in range(count)])
                rows[count] = min(ms, rows.get(count, ms))
                for seq in range(count):
                    self.lib.llama_memory_seq_rm(self.memory, seq, position, -1)
        self._clear()
        return DraftCosts(rows, min(catch) / len(chunk))

    def _timed(self, rows: list[tuple[int, int, int, bool]]) -> float:
        """Decode (seq, token, position, logits) rows; milliseconds to the device's end."""
        started = time.perf_counter()
        self._decode(rows)
        return 1000 * (time.perf_counter() - started)

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)
        for cached in self.cached:
            cached.clear()

    # -- drafting ----------------------------------------------------------------------
    def behind(self, seq: int, context: list[int]) -> int:
        """Context tokens the sequence's cache lacks (a catch-up would decode them)."""
        return len(context) - min(common_prefix(self.cached[seq], context), len(context) - 1)

    def draft(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """{seq: (context, length)}: up to `length` greedy tokens after each context. A
        sequence whose catch-up does not fit in this call's CATCH_UP_ROWS gets what fits
        and no draft yet (the next call goes on from there)."""
        started = time.perf_counter()
        try:
            rows: list[tuple[int, int, int, bool]] = []
            ready: dict[int, int] = {}          # seq -> its logits row in the last decode
            room = min(CATCH_UP_ROWS, self.n_batch)
            for seq, (context, _) in sorted(wants.items()):
                cached = self.cached[seq]
                keep = min(common_prefix(cached, context), len(context) - 1)
                if keep < len(cached):
                    self.lib.llama_memory_seq_rm(self.memory, seq, keep, -1)
                    del cached[keep:]
                todo = context[keep:keep + room]
                if todo and max(todo) >= self.n_vocab:
                    # a prompt's token id past this vocabulary (a draft model up to 128
                    # tokens smaller): its decode fails, which cleared every sequence's
                    # cache, step after step; this sequence gets no draft of it instead
                    del cached[keep:]
                    continue
                room -= len(todo)
                for i, token in enumerate(todo):
                    last = keep + i == len(context) - 1
                    rows.append((seq, token, keep + i, last))
                    if last:
                        ready[seq] = len(rows) - 1
                cached.extend(todo)
                if room <= 0:
                    break
            out: dict[int, list[int]] = {seq: [] for seq in wants}
            if not rows:
                return out
            self._decode(rows)
            while ready:
                rows = []
                for seq, row in sorted(ready.items()):
                    token = self._greedy(row)
                    out[seq].append(token)
                    if len(out[seq]) < wants[seq][1] and \
                            len(self.cached[seq]) < self.n_ctx - 1:
                        rows.append((seq, token, len(self.cached[seq]), True))
                        self.cached[seq].append(token)
                ready = {seq: i for i, (seq, _, _, _) in enumerate(rows)}
                if rows:
                    self._decode(rows)
            return out
        finally:
            self.seconds += time.perf_counter() - started

    def _greedy(self, row: int) -> int:
        ptr = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))[:self.n_shared]))

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        for n, (seq, token, position, logits) in enumerate(rows):
            batch.token[n] = token
            batch.pos[n] = position
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq
            batch.logits[n] = logits
        batch.n_tokens = len(rows)
        rc = self.lib.llama_decode(self.ctx, batch)
        if rc != 0:
            self._clear()
            raise EngineError(f"the draft model's llama_decode returned {rc}")
        self.lib.llama_synchronize(self.ctx)

    def forget(self, seq: int | None = None) -> None:
        """Drop a sequence's cache (None: every one)."""
        for s in range(len(self.cached)) if seq is None else [seq]:
            self.lib.llama_memory_seq_rm(self.memory, s, -1, -1)
            self.cached[s].clear()

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)
