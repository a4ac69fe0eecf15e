"""llama-cpp-python's own `Llama`, loaded the way the workers load the model here: the
bench's in-process target (`--in-process`, the library's own speed) and the tests'
reference. With the engine layer (workers/engine/), the one place that imports
llama_cpp: the bench measures the library itself, in its own process, on purpose."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

from dispatcher.common.repacking import extra_buffers_work


@contextlib.contextmanager
def llama_loads_like_workers(model_path: str | os.PathLike | None = None):
    """For llama-cpp-python's own `Llama` in this process (the tests' reference, the
    bench's in-process target): load weights as workers do on this machine, without
    extra buffer types where they crash (`Llama` has no option for it)."""
    if extra_buffers_work(model_path):
        yield
        return
    import llama_cpp.llama_cpp as bindings        # the module `Llama` calls into
    original = bindings.llama_model_default_params

    def without_extra_buffers():
        params = original()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        bindings.llama_model_default_params = original


def reference_llama(model_path: str, n_ctx: int, n_threads: int, **kwargs):
    """llama-cpp-python's own `Llama`, loaded with the workers' settings (flash attention,
    a batch of 512, repacking as workers do here): the bench's in-process target and the
    tests' reference."""
    from llama_cpp import Llama
    with llama_loads_like_workers(model_path):
        return Llama(str(model_path), n_ctx=n_ctx, n_batch=512, flash_attn=True,
                     n_threads=n_threads, verbose=False, **kwargs)


@dataclass
class Stream:
    """One of `BatchedGreedy.round`'s streams, times in seconds from the round's start."""
    ttft: float | None = None
    decode_s: float = 0.0           # its first token to its last
    ids: list[int] = field(default_factory=list)    # the tokens written (an end not)
    finish_reason: str | None = None


def end_ban(llm):
    """A logits processor for `llm.create_completion` that bans the vocabulary's
    end-of-generation tokens (`ignore_eos`), in place on the scores: the library's
    `logit_bias` copies the whole vocabulary's row every token (~0.24 ms a step here)."""
    import llama_cpp
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    eog = [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab))
           if llama_cpp.llama_vocab_is_eog(vocab, t)]

    def ban(input_ids, scores):
        scores[eog] = -float("inf")
        return scores
    return llama_cpp.LogitsProcessorList([ban])


class BatchedGreedy:
    """A server with no work of its own: llama-cpp-python's batch API on `llm`'s weights,
    a context of `sequences` sequences shaped as the workers' (a KV stream each, a batch
    of 512, flash attention), each round's prompts prefilled together and then every
    sequence's greedy token decoded in one batch a step. No HTTP, no sampler chain, no
    text, no scheduling: the kernels' figure for concurrent streams on this library (the
    bench's in-process target at a concurrency level above 1, on the CPU as `llm` is).
    A server passes it by drafting, or where its schedule beats this plain one (a
    stream ending mid-round leaves a gap in the sequence ids, which llama.cpp decodes
    as two sub-batches; the workers' filler rows close such gaps)."""

    def __init__(self, llm, sequences: int, n_ctx: int, n_threads: int):
        import llama_cpp as lib
        import numpy
        self.lib, self.numpy, self.llm, self.sequences = lib, numpy, llm, sequences
        self.n_ctx = n_ctx
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx * sequences, sequences
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = n_threads
        params.kv_unified = False
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp refused a context of "
                               f"{sequences} sequences of {n_ctx} tokens")
        self.memory = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_model_get_vocab(llm.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.batch = lib.llama_batch_init(512, 0, 1)
        self.ignore_eos = False

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        for n, (seq, position, token, logits) in enumerate(rows):
            batch.token[n], batch.pos[n] = token, position
            batch.n_seq_id[n], batch.seq_id[n][0] = 1, seq
            batch.logits[n] = logits
        batch.n_tokens = len(rows)
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def round(self, prompts: list[str], max_tokens: int,
              ignore_eos: bool = False) -> list[Stream]:
        """Each prompt's stream, all started at once (tokenizing counted), the prompts
        with the fewest tokens prefilled first, as the workers order them; `ignore_eos`:
        each writes its max_tokens, an end of generation never chosen (as the servers'
        `ignore_eos`)."""
        self.ignore_eos = ignore_eos
        started = time.perf_counter()
        tokens = [self.llm.tokenize(p.encode(), add_bos=True, special=True) for p in prompts]
        if len(prompts) > self.sequences or max_tokens < 1 or \
                any(len(ids) + max_tokens > self.n_ctx for ids in tokens):
            raise ValueError(f"{len(prompts)} prompts for {self.sequences} sequences of "
                             f"{self.n_ctx} tokens, {max_tokens} tokens each")
        self.lib.llama_memory_clear(self.memory, True)
        streams = [Stream() for _ in prompts]
        rows = [(seq, pos, token, pos == len(tokens[seq]) - 1)
                for seq in sorted(range(len(tokens)), key=lambda seq: len(tokens[seq]))
                for pos, token in enumerate(tokens[seq])]
        live: set[int] = set()                   # the streams still writing
        for start in range(0, len(rows), 512):
            piece = rows[start:start + 512]
            self._decode(piece)
            for row, (seq, _, _, logits) in enumerate(piece):
                if logits:
                    self._take(streams[seq], seq, row, live, max_tokens, started)
        while live:
            order = sorted(live)
            self._decode([(seq, len(tokens[seq]) + len(streams[seq].ids) - 1,
                           streams[seq].ids[-1], True) for seq in order])
            for row, seq in enumerate(order):
                self._take(streams[seq], seq, row, live, max_tokens, started)
        return streams

    def _take(self, stream: Stream, seq: int, row: int, live: set[int], max_tokens: int,
              started: float) -> None:
        """The greedy token of the batch's `row` into `stream`; `seq` leaves `live`
        where the stream ends there (an end of generation: never sent, not counted)."""
        logits = self.numpy.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row),
                                               shape=(self.n_vocab,))
        token = int(self.numpy.argmax(logits))
        if self.ignore_eos and self.lib.llama_vocab_is_eog(self.vocab, token):
            logits = logits.copy()
            while self.lib.llama_vocab_is_eog(self.vocab, token):
                logits[token] = -self.numpy.inf
                token = int(self.numpy.argmax(logits))
        now = time.perf_counter() - started
        if self.lib.llama_vocab_is_eog(self.vocab, token):
            stream.finish_reason = "stop"
        else:
            stream.ids.append(token)
            if stream.ttft is None:
                stream.ttft = now
            stream.decode_s = now - stream.ttft
            if len(stream.ids) < max_tokens:
                live.add(seq)
                return
            stream.finish_reason = "length"
        live.discard(seq)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
