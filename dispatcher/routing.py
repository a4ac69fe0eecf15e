"""Which workers may run a job (model, context, compute kind, offload, profile, FIM), and
which of those should (the one most likely to hold the prompt's prefix in its KV cache).

Pure functions over the `info` a worker sends in READY, shared by the dispatcher (which
routes) and the front ends (which answer 400 early with what is available).
"""
from __future__ import annotations

import json

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


def prompt_key(job: dict) -> str:
    """The job's prompt as text laid out the way its tokens will be (FIM: prefix, then
    suffix), so that a common text prefix means a common token prefix, roughly."""
    prompt = job.get("prompt")
    key = prompt if isinstance(prompt, str) else json.dumps(prompt)
    if job.get("suffix") is not None:
        key = "\x00fim\x00" + key + "\x00suffix\x00" + job["suffix"]
    return key


# Prompts are compared by chained hashes of fixed blocks of their key (as paged prefix
# caches do), computed once per job: a job's routing costs a few set lookups per worker,
# however long its prompt. The first MAX_PREFIX_BLOCKS blocks weigh in (64 Ki characters:
# a longer shared prefix is worth 64 busy slots of difference already).
BLOCK_CHARS = 64
MAX_PREFIX_BLOCKS = 1024


def prefix_blocks(job: dict) -> tuple[int, ...]:
    """The chained hashes of the job's prompt key, block by block: block i's hash
    stands for the whole prefix up to and including it."""
    key = prompt_key(job)
    blocks, chained = [], 0
    for start in range(0, min(len(key), BLOCK_CHARS * MAX_PREFIX_BLOCKS), BLOCK_CHARS):
        chained = hash((chained, key[start:start + BLOCK_CHARS]))
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


def choose_worker(job: dict, free: list, blocks: tuple[int, ...] | None = None):
    """Which of the `free` workers (WorkerRecords with a free slot) should run `job`: among
    those that fit it, the one whose recent prompts share the longest prefix with it when
    that prefix is worth the load difference (`affinity_allowed`), otherwise the least
    loaded (most free slots, then least recently used). None if none fits."""
    candidates = [w for w in free if fits(job, w.info)]
    if not candidates:
        return None
    blocks = prefix_blocks(job) if blocks is None else blocks
    least_busy = min(len(w.running) for w in candidates)

    def affinity(worker) -> int:
        shared = worker.cached_prefix(blocks)
        return shared if affinity_allowed(shared, len(worker.running), least_busy) else 0

    return max(candidates, key=lambda w: (affinity(w), w.free_slots, -w.last_assigned))


REQUIREMENTS = ("nctx", "compute", "ngl", "profile", "suffix")


def fits(job: dict, info: dict) -> bool:
    return info.get("model") == job.get("model") and _unmet(job, info) is None


def _unmet(job: dict, info: dict) -> str | None:
    """The first requirement of `job` that the worker does not meet, by name."""
    route = job.get("route") or {}
    if route.get("nctx") and int(info.get("n_ctx") or 0) < route["nctx"]:
        return "nctx"
    if route.get("compute") and info.get("compute") != route["compute"]:
        return "compute"
    if route.get("ngl") is not None:
        ngl = int(info.get("n_gpu_layers") or 0)
        if (route["ngl"] == 0 and ngl != 0) or ngl < route["ngl"]:
            return "ngl"
    if route.get("profile") and info.get("profile") != route["profile"]:
        return "profile"
    if job.get("suffix") is not None and not info.get("fim"):
        return "suffix"
    return None


def explain_unfit(job: dict, infos: list[dict]) -> tuple[str, str, str]:
    """(param, code, message) saying why no worker of the job's model can run it and
    what is available instead."""
    model = job.get("model")
    candidates = [i for i in infos if i.get("model") == model]
    reasons = {_unmet(job, i) for i in candidates}
    name = next((n for n in REQUIREMENTS if n in reasons), "suffix")
    route = job.get("route") or {}
    values = lambda key: sorted({str(i.get(key)) for i in candidates})  # noqa: E731
    if name == "nctx":
        return "nctx", "context_length_unavailable", (
            f"no worker of '{model}' has a context of {route['nctx']} tokens; available: "
            + ", ".join(values("n_ctx")))
    if name == "compute":
        return "compute", "compute_unavailable", (
            f"no worker of '{model}' computes on '{route['compute']}'; served kinds: "
            + ", ".join(values("compute")))
    if name == "ngl":
        return "ngl", "ngl_unavailable", (
            f"no worker of '{model}' offloads {route['ngl']} layers; available: "
            + ", ".join(values("n_gpu_layers")))
    if name == "profile":
        profiles = [p for p in values("profile") if p != "None"]
        return "X-SIE-MACHINE-PROFILE", "unknown_profile", (
            f"unknown machine profile '{route['profile']}'; profiles: "
            + (", ".join(profiles) or "none configured"))
    return "suffix", "fim_unsupported", (
        f"the model '{model}' has no fill-in-the-middle tokens (fim_pre, fim_suf, fim_mid "
        "in its GGUF metadata), so 'suffix' cannot be used")
