"""The inference engine: the only module that imports llama_cpp.

It uses llama-cpp-python's low-level C API rather than `Llama`: one context whose KV
cache holds `slots` sequences (unified pool), one `llama_batch` per step, one sampler
chain per sequence. `step()` decodes one token for every generating slot plus prompt
chunks of the admitted ones in a single `llama_decode`, then samples each slot from its
own batch row. Calls into llama.cpp release the GIL, so the worker's IO thread keeps
heartbeating during a long decode. See shared notes (llama-cpp-python batching) for the
API facts this relies on: exact-size pieces (the wrapper's 32-byte buffer drops long
pieces), `llama_sampler_sample` already accepting the token, `n_batch` being a hard
assert.
"""
from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass, field

import llama_cpp

from workers.errors import EngineError
from workers.sampling import SamplingParams

log = logging.getLogger(__name__)


_VERBOSE = False
_GGML_LOG_ERROR = 4      # ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5


@llama_cpp.llama_log_callback
def _log_to_stderr(level: int, text: bytes, user_data) -> None:
    """llama.cpp's own log: errors always, the rest only when verbose."""
    if _VERBOSE or level == _GGML_LOG_ERROR:
        sys.stderr.write(text.decode("utf-8", "replace"))


@dataclass
class _Slot:
    seq: int
    pending: list[int] = field(default_factory=list)   # prompt tokens still to decode
    n_past: int = 0                                     # tokens in this slot's KV cache
    next_token: int | None = None                       # sampled, to be decoded next step
    chain: object = None                                # llama_sampler* while in use
    row: int = -1                                       # batch row to sample from

    @property
    def busy(self) -> bool:
        return self.chain is not None


class LlamaEngine:
    name = "llama"

    def __init__(self, model_path: str, n_ctx: int, slots: int, n_threads: int,
                 n_gpu_layers: int, verbose: bool = False):
        global _VERBOSE
        _VERBOSE = verbose
        llama_cpp.llama_log_set(_log_to_stderr, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        self.model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise EngineError(f"llama.cpp could not load {model_path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx * slots
        cparams.n_seq_max = slots
        cparams.n_batch = cparams.n_ubatch = 512
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.kv_unified = True        # one pool; any seq order in a batch is cheap
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as Llama()
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise EngineError(f"llama.cpp could not create a context of {n_ctx * slots} tokens")
        self.n_ctx = n_ctx
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.model)
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.slots = [_Slot(seq) for seq in range(slots)]
        self._piece_buf = ctypes.create_string_buffer(256)

    # -- vocabulary --------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """The prompt verbatim, with the model's BOS, special-token syntax parsed."""
        data = text.encode("utf-8")
        size = len(data) + 8
        buf = (llama_cpp.llama_token * size)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, size, True, True)
        if n < 0:
            size = -n
            buf = (llama_cpp.llama_token * size)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, size, True, True)
        if n < 0:
            raise EngineError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The exact bytes of one token (may be part of a UTF-8 character)."""
        buf = self._piece_buf
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:max(n, 0)]

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    # -- sequences ---------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return len(self.slots)

    def add(self, slot_id: int, tokens: list[int], sampling: SamplingParams) -> None:
        """Start a sequence in a free slot; its prompt is decoded by the coming steps."""
        slot = self.slots[slot_id]
        if slot.busy:
            raise EngineError(f"slot {slot_id} is busy")
        llama_cpp.llama_memory_seq_rm(self.memory, slot.seq, -1, -1)
        slot.pending, slot.n_past, slot.next_token, slot.row = list(tokens), 0, None, -1
        slot.chain = self._sampler_chain(sampling)

    def release(self, slot_id: int) -> None:
        """End the slot's sequence; the slot is free at once."""
        slot = self.slots[slot_id]
        if slot.chain is not None:
            llama_cpp.llama_sampler_free(slot.chain)
        llama_cpp.llama_memory_seq_rm(self.memory, slot.seq, -1, -1)
        slot.chain, slot.pending, slot.n_past, slot.next_token, slot.row = None, [], 0, None, -1

    def _sampler_chain(self, p: SamplingParams):
        chain = llama_cpp.llama_sampler_chain_init(
            llama_cpp.llama_sampler_chain_default_params())
        add = lambda sampler: llama_cpp.llama_sampler_chain_add(chain, sampler)  # noqa: E731
        if p.penalized:
            add(llama_cpp.llama_sampler_init_penalties(
                self.n_vocab, -1, p.repetition_penalty, p.frequency_penalty,
                p.presence_penalty))
        if p.greedy:
            add(llama_cpp.llama_sampler_init_greedy())
            return chain
        if p.top_k > 0:
            add(llama_cpp.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            add(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            add(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
        add(llama_cpp.llama_sampler_init_temp(p.temperature))
        add(llama_cpp.llama_sampler_init_dist(p.seed32))
        return chain

    # -- decoding ----------------------------------------------------------------------
    def step(self) -> dict[int, int]:
        """One decode for every busy slot; returns {slot: sampled token} for those that
        finished their prompt or are generating."""
        batch = self.batch
        n = 0

        def add_row(slot: _Slot, token: int, logits: bool) -> int:
            nonlocal n
            batch.token[n] = token
            batch.pos[n] = slot.n_past
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = slot.seq
            batch.logits[n] = logits
            slot.n_past += 1
            n += 1
            return n - 1

        for slot in self.slots:                    # generating slots: one token each
            if slot.busy and slot.next_token is not None:
                slot.row = add_row(slot, slot.next_token, True)
                slot.next_token = None
        for slot in self.slots:                    # then prompt chunks, in the room left
            if slot.busy and slot.pending and n < self.n_batch:
                chunk = slot.pending[:self.n_batch - n]
                slot.pending = slot.pending[len(chunk):]
                for i, token in enumerate(chunk):
                    last = not slot.pending and i == len(chunk) - 1
                    row = add_row(slot, token, last)
                    if last:
                        slot.row = row
        if n == 0:
            return {}
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc}")
        sampled: dict[int, int] = {}
        for slot_id, slot in enumerate(self.slots):
            if slot.busy and slot.row >= 0:
                token = llama_cpp.llama_sampler_sample(slot.chain, self.ctx, slot.row)
                slot.row = -1
                slot.next_token = token
                sampled[slot_id] = token
        return sampled

    def close(self) -> None:
        for slot_id in range(len(self.slots)):
            self.release(slot_id)
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)
