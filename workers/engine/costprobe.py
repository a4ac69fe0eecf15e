"""The start-up measurement of `StepCosts` on the engine's own device: one decode per
batch shape, kept in the cache directory per model, build, engine shape and CPU.

Called by `LlamaEngine` at load when drafts are on; llama.cpp is reached through the
engine's `lib` (llama.py stays the only module that imports llama_cpp)."""
from __future__ import annotations

import hashlib
import logging
import os
import time

from dispatcher.common.models import cache_dir
from workers.engine.repacking import cpu_identity
from workers.engine.stepcosts import StepCosts
from workers.errors import EngineError

log = logging.getLogger(__name__)

UNCONTENDED = 0.6       # CPU busy share of the measuring threads below which the
                        # start-up step costs are used but not kept (a busy machine)
MAX_SLOTS = 32          # sequences measured at most (the costs past it are extrapolated)
PREFIX = 8              # cached tokens each measured sequence decodes after
FULL_STEP_ROWS = 64     # prompt rows of full_step_seconds' measured chunk (~0.4 s on 2 cores)
MEASURE_BUDGET = 10.0   # s of measuring after which no further round of the shapes starts
                        # (one thread of a 2-core CPU takes ~20 s a round, ~45 s busy)


def device_step_costs(engine, slots: int, n_threads: int, n_gpu_layers: int,
                      repacked: bool) -> StepCosts:
    """Measured once per model, build, shape of the engine and CPU, then kept in the
    cache directory (delete `step-costs-*.json` there to measure again)."""
    key = hashlib.sha256(f"{engine.fingerprint}:{slots}:{n_threads}:{n_gpu_layers}:"
                         f"{repacked}:{cpu_identity()}".encode()).hexdigest()[:16]
    path = cache_dir() / f"step-costs-{key}.json"
    kept = StepCosts.load(path)
    if kept is not None:
        return kept
    cpu, started = time.process_time(), time.perf_counter()
    costs = StepCosts.measure(
        lambda sequences, extra, each=False: timed_shape(engine, sequences, extra, each),
        min(slots, MAX_SLOTS), budget=MEASURE_BUDGET)
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
    log.info("step costs (ms by sequences, draft rows): %s", costs.summary())
    return costs


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
                chunk: bool = False) -> float:
    """Seconds of one decode of `sequences` rows (one a sequence, each after a short
    prefix) plus `extra` draft rows on the first (`each`: on every one; `chunk`: rows
    of a prompt, only the last one's logits asked). Leaves the slots' caches empty."""
    lib, batch = engine.lib, engine.batch
    token = engine.bos()[0] if engine.bos() else 0

    def fill(rows, last=None, every=None):
        for n, (seq, pos) in enumerate(rows):
            batch.token[n], batch.pos[n] = token, pos
            batch.n_seq_id[n], batch.seq_id[n][0] = 1, seq
            batch.logits[n] = (pos == every) if every is not None else (
                last is None or seq != 0 or pos == last)
        batch.n_tokens = len(rows)

    try:       # (the untimed prefixes ask one row of logits each: a vocabulary's row is dear)
        fill([(s, p) for s in range(sequences) for p in range(PREFIX)], every=PREFIX - 1)
        if lib.llama_decode(engine.ctx, batch) != 0:
            raise EngineError("llama_decode failed while measuring step costs")
        fill([(s, PREFIX + j) for s in range(sequences)
              for j in range(1 + (extra if s == 0 or each else 0))],
             PREFIX + extra if chunk else None)
        started = time.perf_counter()
        rc = lib.llama_decode(engine.ctx, batch)
        lib.llama_synchronize(engine.ctx)    # a GPU's decode returns before it is done
        elapsed = time.perf_counter() - started
        if rc != 0:
            raise EngineError("llama_decode failed while measuring step costs")
        return elapsed
    finally:
        for s in range(sequences):
            lib.llama_memory_seq_rm(engine.memory, s, -1, -1)
