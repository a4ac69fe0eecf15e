"""Which of the workers that may run a job (`dispatcher.common.fit`) should: the one most
likely to hold the prompt's prefix in its KV cache, against load.
"""
from __future__ import annotations

import json

from dispatcher.common import protocol as P
from dispatcher.common.fit import fits

# Cache affinity against load. A worker that recently ran a prompt sharing at least
# MIN_SHARED_PREFIX characters with this one (~64 tokens of code) is preferred only if it
# is at most one busy slot ahead of the least busy candidate per AFFINITY_CHARS_PER_SLOT
# shared characters (~256 tokens: about what one extra sequence in a batch costs in decode
# speed over a completion). A short shared licence header never piles a team onto one
# device; a long cached file still draws its next keystroke to the worker that holds it.
MIN_SHARED_PREFIX = 256
AFFINITY_CHARS_PER_SLOT = 1024


def affinity_allowed(shared: int, busy: int, least_busy: int) -> bool:
    return shared >= MIN_SHARED_PREFIX and \
        busy - least_busy <= shared // AFFINITY_CHARS_PER_SLOT


def routed_text(job: P.Job) -> str:
    """The job's prompt as text laid out the way its tokens will be (FIM: prefix, then
    suffix), so that a common text prefix means a common token prefix, roughly; under its
    tenant's name, so that a key is drawn only to the cache of its own prompts."""
    prompt = job.prompt
    # (of a list, only as many items as can make the characters that are weighed: each
    # writes 3 at least, "1, "; a million token ids took the dispatcher's thread 0.2 s)
    if isinstance(prompt, list):
        prompt = prompt[:BLOCK_CHARS * MAX_PREFIX_BLOCKS // 3 + 1]
    text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    if job.suffix is not None:
        text = "\x00fim\x00" + text + "\x00suffix\x00" + job.suffix
    infill = getattr(job, "infill", None)
    if infill is not None:
        # /infill's chunks come first in its tokens (llama.vim's ring, the same in every
        # request and warm-up of a user): a warm-up is drawn to the worker its
        # completions go to, and they to the one it filled; the typed line comes last
        text = "".join(f"\x00chunk\x00{c.get('filename') or ''}\x00{c.get('text') or ''}"
                       for c in infill.extra) + text + "\x00middle\x00" + infill.middle
    if job.tenant is not None:
        text = "\x00tenant\x00" + job.tenant + "\x00" + text
    return text


# Prompts are compared by chained hashes of fixed blocks of their key (as paged prefix
# caches do), computed once per job: a job's routing costs a few set lookups per worker,
# however long its prompt. The first MAX_PREFIX_BLOCKS blocks weigh in (64 Ki characters:
# a longer shared prefix is worth 64 busy slots of difference already).
BLOCK_CHARS = 64
MAX_PREFIX_BLOCKS = 1024


def prefix_blocks(job: P.Job) -> tuple[int, ...]:
    """The chained hashes of the job's routed text, block by block: block i's hash
    stands for the whole prefix up to and including it."""
    text = routed_text(job)
    blocks, chained = [], 0
    for start in range(0, min(len(text), BLOCK_CHARS * MAX_PREFIX_BLOCKS), BLOCK_CHARS):
        chained = hash((chained, text[start:start + BLOCK_CHARS]))
        blocks.append(chained)
    return tuple(blocks)


def shared_blocks(blocks: tuple[int, ...], held) -> int:
    """How many leading blocks of `blocks` some prompt behind `held` (a set or counter of
    block hashes) shares: where one block is held, all before it are (chained hashes),
    so a binary search finds the end."""
    low, high = 0, len(blocks)          # blocks[:low] held; blocks[high:] not
    while low < high:
        middle = (low + high + 1) // 2
        if blocks[middle - 1] in held:
            low = middle
        else:
            high = middle - 1
    return low


# Speed against load: workers of one model on unlike devices (a GPU and a CPU, a much
# slower card) are told apart by the rate each sequence would get there with the job
# added, from the step costs each measured on its device at start-up. Workers alike are
# not: those of the fastest's compute kind, CPU workers always (measured on a shared,
# busy CPU their figures differ by noise), others within SLOWER_CLASS of its speed; load
# and cache decide among those, as for any equal workers. A worker not alike joins them
# while it would give a sequence at least (1 - RATE_MARGIN) of what they would.
RATE_MARGIN = 0.1
SLOWER_CLASS = 2.0


def expected_rate(info: P.WorkerInfo, busy: int) -> float | None:
    """Tokens a second each sequence would get on the worker with one more sequence than
    `busy` (None: it measured none). Never more than with fewer sequences: on a CPU whose
    costs are not monotonic (8 rows cheaper than 7) a busier worker does not count as
    faster."""
    rates = info.rates
    if not rates:
        return None
    return min(rates[:min(busy + 1, len(rates))])


def fastest(candidates: list) -> set:
    """ids of the candidates that may take the job on speed: those alike the fastest
    device, and any other whose expected rate comes within RATE_MARGIN of theirs;
    every one where some worker measured no rates (nothing to compare)."""
    if any(not w.info.rates for w in candidates):
        return {id(w) for w in candidates}
    best = max(candidates, key=lambda w: w.info.rates[0])

    def alike(w) -> bool:
        return w.info.compute == best.info.compute and (
            w.info.compute == "cpu" or w.info.rates[0] * SLOWER_CLASS >= best.info.rates[0])
    top = [w for w in candidates if alike(w)]
    bar = (1 - RATE_MARGIN) * max(expected_rate(w.info, w.busy) for w in top)
    return {id(w) for w in top} | {id(w) for w in candidates
                                   if expected_rate(w.info, w.busy) >= bar}


def choose_worker(job: P.Job, free: list, blocks: tuple[int, ...] | None = None):
    """Which of the `free` workers (WorkerRecords with a free slot) should run `job`: among
    those that fit it, the fastest for it whose recent prompts share the longest prefix
    with it when that prefix is worth the load difference (`affinity_allowed`; a slower
    worker's cache does not draw work from a faster one), otherwise one of the
    fastest for it (`fastest`: a worker on a slower device takes work only while the
    faster ones, busier, would give a sequence no more than it does), the least loaded
    among those (most free slots, then least recently used). None if none fits."""
    candidates = [w for w in free if fits(job.model, job.route, w.info)]
    if not candidates:
        return None
    blocks = prefix_blocks(job) if blocks is None else blocks
    least_busy = min(w.busy for w in candidates)
    fast = fastest(candidates)

    def affinity(worker) -> int:        # (a slower worker's cache does not draw work
        if id(worker) not in fast:      # from a faster one)
            return 0
        shared = worker.cached_prefix(blocks)
        return shared if affinity_allowed(shared, worker.busy, least_busy) else 0

    def rank(worker) -> tuple:
        shared = affinity(worker)
        # among equal shares and loads, the one that got such a prompt last: a typing
        # session sent once to another worker went back and forth between the two for
        # ever (each next keystroke to the one holding the keystroke before last, the
        # least recently used), prefilling two keystrokes' text each time; after the
        # load, so a prefix every worker holds (a shared header) still spreads the work
        return (shared, id(worker) in fast, worker.free_slots,
                worker.held_since(blocks, shared) if shared else 0.0, -worker.last_assigned)

    return max(candidates, key=rank)
