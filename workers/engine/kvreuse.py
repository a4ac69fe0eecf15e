"""KV chunk reuse (llama.cpp's `--cache-reuse`): after the prefix a slot's cache shares
with a new prompt, chunks of at least `minimum` tokens that the cache holds further along
are shifted into place instead of prefilled again.

The editor case: the cursor moved or the user typed a few characters in the middle of a
file. The fill-in-the-middle prompt's prefix diverges at the cursor, but the file after
it (the suffix) is still in the cache, only at other positions; shifting those cells
(`llama_memory_seq_add`: RoPE makes a position shift exact up to rounding) costs nothing
next to prefilling hundreds of tokens. The plan is pure (tested alone); the engine
applies it.
"""
from __future__ import annotations

import numpy as np

from workers.engine.speculation import common_prefix


def chunk_moves(cache: list[int], tokens: list[int], start: int, minimum: int
                ) -> tuple[list[tuple[int, int, int]], int]:
    """Moves `(from_position, to_position, length)` that rebuild as much of `tokens`
    after `start` (the shared prefix) as `cache` holds in runs of at least `minimum`
    tokens, in order; and how many tokens of the prompt are then in place. Scans as
    llama.cpp's server does: a cache position that starts no long enough run is
    skipped."""
    if minimum <= 0 or start >= len(tokens) or start >= len(cache):
        return [], start
    c = np.asarray(cache, dtype=np.int64)
    t = np.asarray(tokens, dtype=np.int64)
    moves: list[tuple[int, int, int]] = []
    head_c = head_p = start
    while head_c < len(c) and head_p < len(t) and len(t) - head_p >= minimum:
        want = t[head_p:head_p + minimum]
        run = 0
        # candidate starts: where the cache has the prompt's next token (found once per
        # prompt position; each is checked on `minimum` tokens before a run is measured)
        for offset in np.flatnonzero(c[head_c:len(c) - minimum + 1] == want[0]):
            at = head_c + int(offset)
            if np.array_equal(c[at:at + minimum], want):
                span = min(len(c) - at, len(t) - head_p)
                differ = np.flatnonzero(c[at:at + span] != t[head_p:head_p + span])
                run = int(differ[0]) if len(differ) else span
                head_c = at
                break
        if not run:
            break                            # nothing further along starts this run
        moves.append((head_c, head_p, run))
        head_c += run
        head_p += run
    return moves, head_p


def reusable(cached: list[int], tokens: list[int], minimum: int) -> int:
    """How many of `tokens` a slot holding `cached` would not prefill: the shared prefix
    and, with chunk reuse on, the chunks shifted after it (the last token is always
    decoded)."""
    n_past = min(common_prefix(cached, tokens), max(len(tokens) - 1, 0))
    if minimum and n_past > 0:
        n_past = chunk_moves(cached, tokens[:-1], n_past, minimum)[1]
    return n_past


def shift_into_place(lib, memory, seq: int, cached: list[int], tokens: list[int],
                     n_past: int, minimum: int) -> tuple[list[int], int, int]:
    """Apply `chunk_moves` to sequence `seq` of a llama.cpp memory (`lib` is the
    llama_cpp module): returns the cache's tokens up to the last moved chunk, how many
    prompt tokens are in place, and how many were shifted. Cells past the returned
    tokens are stale: the caller removes them."""
    if not minimum or n_past == 0:
        return cached, n_past, 0
    moves, in_place = chunk_moves(cached, tokens[:len(tokens) - 1], n_past, minimum)
    if not moves:
        return cached, n_past, 0
    kept = cached[:n_past]
    for source, target, length in moves:
        # drop what lies between, then move the chunk down onto it
        if not lib.llama_memory_seq_rm(memory, seq, target, source):
            return [], 0, 0     # (a memory that cannot drop a part: the caller empties it)
        lib.llama_memory_seq_add(memory, seq, source, source + length, target - source)
        kept += cached[source:source + length]
    return kept, in_place, sum(length for _, _, length in moves)
