"""The start-up measurement of `StepCosts` on the engine's own device: one decode per
batch shape, timed after llama.cpp has finished it, each sequence after a cached context
of an editor's size; kept in the cache directory per model, build, devices, offload,
engine shape and CPU (`table_key`).

Called by `LlamaEngine` at load in a worker (drafts on or off) or wherever drafts are
on; llama.cpp is reached through the engine's `lib` (llama.py stays the only module
that imports llama_cpp)."""
from __future__ import annotations

import hashlib
import logging
import os
import time

from dispatcher.common.models import cache_dir
from workers.engine.backends import backend_devices
from dispatcher.common.repacking import cpu_identity
from workers.engine.stepcosts import SHAPES_EXTRA, StepCosts
from workers.errors import EngineError

log = logging.getLogger(__name__)

UNCONTENDED = 0.6       # CPU busy share of the measuring threads below which the
                        # start-up step costs are used but not kept (a busy machine)
PROBE_VERSION = 3       # part of the kept tables' key: a changed probe measures again
                        # (3: the full step is measured and kept with the table)
PREFIX = 8              # cached tokens of full_step_seconds' measured sequence
CONTEXT = 1024          # cached tokens each measured sequence decodes after: an editor's
                        # prompt is a few hundred to several thousand tokens
CONTEXT_BUDGET = 1.0    # s of prefilling that context at most (a GPU needs milliseconds; a
                        # slow CPU stops short of it, and its attention matters least)
CONTEXT_CHUNK = 128     # prompt rows a prefilling decode of the context
FULL_STEP_ROWS = 64     # prompt rows of full_step_seconds' measured chunk (~0.4 s on 2 cores)
MEASURE_BUDGET = 10.0   # s of measuring after which no further round of the shapes starts
                        # (one thread of a 2-core CPU takes ~20 s a round, ~45 s busy)


def table_key(engine, slots: int, n_threads: int, n_gpu_layers: int, repacked: bool) -> str:
    """Everything a step's cost depends on: the model and llama.cpp's version
    (fingerprint), the build's backends, the devices it sees (name and memory), the layers
    it offloaded, the engine's shape (context, slots, KV cache type, batch sizes, threads,
    repacking), the CPU, and this probe's version."""
    devices = [(d.name, d.description, d.total) for d in backend_devices()]
    return hashlib.sha256(repr((
        PROBE_VERSION, engine.fingerprint, engine.lib.llama_print_system_info(), devices,
        engine.layers_offloaded, n_gpu_layers, engine.n_ctx, slots, engine.kv_type,
        engine.n_batch, engine.n_ubatch, n_threads, repacked, cpu_identity())).encode()
    ).hexdigest()[:16]


def device_step_costs(engine, slots: int, n_threads: int, n_gpu_layers: int,
                      repacked: bool) -> StepCosts:
    """Measured once per everything `table_key` names, for as many sequences as the
    engine has, each after a cached context of an editor's size; then kept in the cache
    directory (delete `step-costs-*.json` there to measure again)."""
    path = cache_dir() / f"step-costs-{table_key(engine, slots, n_threads, n_gpu_layers, repacked)}.json"
    kept = StepCosts.load(path)
    if kept is not None:
        return kept
    cpu, started = time.process_time(), time.perf_counter()
    context = cache_context(engine, slots)
    try:
        costs = StepCosts.measure(
            lambda sequences, extra, each=False: timed_shape(engine, sequences, extra, each,
                                                             cached=context),
            slots, budget=MEASURE_BUDGET)
    finally:
        for s in range(slots):
            engine.lib.llama_memory_seq_rm(engine.memory, s, -1, -1)
    costs.full_step_s = full_step_seconds(engine)     # (kept with the table: the watchdog's)
    usable = max(1, min(n_threads, len(os.sched_getaffinity(0))))
    share = (time.process_time() - cpu) / max(1e-9, (time.perf_counter() - started)
                                              * usable)
    # On the CPU, threads that got less than their cores were measured on a busy
    # machine: those figures serve this run (the steps correct them, StepCosts.observe)
    # but are not kept for the next. A GPU's decode leaves the CPU idle: always kept.
    on_gpu = n_gpu_layers != 0 and engine.lib.llama_supports_gpu_offload()
    if on_gpu or share >= UNCONTENDED:
        costs.save(path)
    else:
        log.warning("step costs measured on a busy machine (its threads ran %.0f%% of "
                    "the time): used and corrected by the steps, not kept", 100 * share)
    log.info("step costs at %d cached tokens (ms by sequences, draft rows): %s", context,
             costs.summary())
    return costs


def cache_context(engine, slots: int) -> int:
    """Prefill one sequence with up to CONTEXT tokens (as many as CONTEXT_BUDGET s
    allow, and room for the measured rows), copy it to every slot, and return its length."""
    lib, batch = engine.lib, engine.batch
    token = engine.bos()[0] if engine.bos() else 0
    limit = max(PREFIX, min(CONTEXT, engine.n_ctx - SHAPES_EXTRA[-1] - 2))
    started, cached = time.perf_counter(), 0
    while cached < limit and (cached < PREFIX or
                              time.perf_counter() - started < CONTEXT_BUDGET):
        rows = min(CONTEXT_CHUNK, engine.n_batch, limit - cached)
        for n in range(rows):
            batch.token[n], batch.pos[n] = token, cached + n
            batch.n_seq_id[n], batch.seq_id[n][0] = 1, 0
            batch.logits[n] = n == rows - 1
        batch.n_tokens = rows
        if lib.llama_decode(engine.ctx, batch) != 0:
            raise EngineError("llama_decode failed while measuring step costs")
        lib.llama_synchronize(engine.ctx)
        cached += rows
    for s in range(1, slots):
        lib.llama_memory_seq_cp(engine.memory, 0, s, -1, -1)
    return cached


def full_step_seconds(engine) -> float:
    """Seconds of the largest step a worker makes, a prompt's chunk filling the batch
    (its last row's logits only), the faster of two, for --step-timeout auto. Measured on
    a chunk of FULL_STEP_ROWS and scaled to the batch by its rows: a CPU's cost grows so,
    a GPU's less (this overstates it); other slots' rows in such a step are within the
    factor and the per-slot allowance (config.derived_step_timeout)."""
    rows = max(1, min(FULL_STEP_ROWS, engine.n_batch, engine.n_ctx - PREFIX - 1))
    seconds = min(timed_shape(engine, 1, rows - 1, chunk=True) for _ in range(2))
    return seconds * engine.n_batch / rows


def timed_shape(engine, sequences: int, extra: int, each: bool = False,
                chunk: bool = False, cached: int = 0) -> float:
    """Seconds of one decode of `sequences` rows (one a sequence) plus `extra` draft rows
    on the first (`each`: on every one; `chunk`: rows of a prompt, only the last one's
    logits asked), each sequence after the `cached` tokens it already holds (0: after a
    short prefix of its own, made here). Leaves the caches as they were."""
    lib, batch = engine.lib, engine.batch
    token = engine.bos()[0] if engine.bos() else 0
    prefix = cached or PREFIX

    def fill(rows, last=None, every=None):
        for n, (seq, pos) in enumerate(rows):
            batch.token[n], batch.pos[n] = token, pos
            batch.n_seq_id[n], batch.seq_id[n][0] = 1, seq
            batch.logits[n] = (pos == every) if every is not None else (
                last is None or seq != 0 or pos == last)
        batch.n_tokens = len(rows)

    try:       # (the untimed prefixes ask one row of logits each: a vocabulary's row is dear)
        if not cached:
            fill([(s, p) for s in range(sequences) for p in range(PREFIX)], every=PREFIX - 1)
            if lib.llama_decode(engine.ctx, batch) != 0:
                raise EngineError("llama_decode failed while measuring step costs")
        fill([(s, prefix + j) for s in range(sequences)
              for j in range(1 + (extra if s == 0 or each else 0))],
             prefix + extra if chunk else None)
        lib.llama_synchronize(engine.ctx)    # (nothing of the prefix still running)
        started = time.perf_counter()
        rc = lib.llama_decode(engine.ctx, batch)
        lib.llama_synchronize(engine.ctx)    # a GPU's decode returns before it is done
        elapsed = time.perf_counter() - started
        if rc != 0:
            raise EngineError("llama_decode failed while measuring step costs")
        return elapsed
    finally:
        for s in range(sequences):
            lib.llama_memory_seq_rm(engine.memory, s, prefix if cached else -1, -1)
