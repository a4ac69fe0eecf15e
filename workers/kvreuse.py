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
    while head_c < len(c) and head_p < len(t):
        found = np.flatnonzero(c[head_c:] == t[head_p])      # next candidate start
        if not len(found):
            break
        head_c += int(found[0])
        span = min(len(c) - head_c, len(t) - head_p)
        if span < minimum:
            break
        differ = np.flatnonzero(c[head_c:head_c + span] != t[head_p:head_p + span])
        run = int(differ[0]) if len(differ) else span
        if run >= minimum:
            moves.append((head_c, head_p, run))
            head_c += run
            head_p += run
        else:
            head_c += 1
    return moves, head_p
