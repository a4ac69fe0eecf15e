"""Prompt-lookup speculative decoding: drafts from the sequence's own tokens, and when to
draft at all.

A draft is what followed the latest earlier occurrence of the sequence's last few tokens
(code edits copy much of their prompt). The engine verifies a draft in the same
`llama_decode` as every other sequence's token: one row per draft position, each sampled
with the sequence's own sampler chain in turn and compared with the draft, so greedy
output is what it would be without speculation and sampled output has the same
distribution; the first mismatch ends the accepted run and the rejected positions leave
the KV cache.

When it pays, from measured step costs on the 2-core machine (shared notes,
speculation-costs.md): a single draft row costs 2.2x a plain step, 8 accepted drafts give
2x and 16 give 3x alone, but in a batch of 8 every draft row costs more than batching
already gains. So: drafts of at least DRAFT_MIN tokens only, only while at most
MAX_STREAMS sequences are generating, each sequence's draft length following its recent
acceptance (doubling on a full accept, shrinking to what was accepted), and a pause after
a draft was rejected outright that doubles with each outright rejection in a row (1, 2,
4, 8 steps) and ends with the next accepted token: an edit's copy misses at each changed
name or number and is right again just after it, sampled text keeps missing.
"""
from __future__ import annotations

from dataclasses import dataclass

DRAFT_MIN = 4           # shorter drafts cost more than they can save (2.2x for one row)
MAX_STREAMS = 2         # beyond this, draft rows cost more than batching gains
NGRAM = (4, 3, 2)       # the suffix lengths tried, longest first
LOOKBACK = 8192         # tokens searched for the suffix
PAUSE_STEPS = 8         # the longest pause after drafts rejected at once (1, 2, 4, 8)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two sequences share from the start (a slot's cache and a prompt)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def find_draft(context: list[int], limit: int, minimum: int = DRAFT_MIN) -> list[int]:
    """The tokens that followed the latest earlier occurrence of `context`'s last n tokens
    (n from NGRAM), at most `limit` of them; [] when nothing of `minimum` tokens is found."""
    if limit < minimum:
        return []
    start = max(0, len(context) - LOOKBACK)
    for n in NGRAM:
        if len(context) <= n:
            continue
        key = context[-n:]
        first = key[0]
        for i in range(len(context) - n - 1, start - 1, -1):
            if context[i] == first and context[i:i + n] == key:
                draft = context[i + n:i + n + limit]
                if len(draft) >= minimum:
                    return draft
                break          # the latest match is too close to the end: try shorter n
    return []


@dataclass
class DraftPolicy:
    """One sequence's drafting state."""
    max_len: int
    length: int = 0        # the next draft's length
    pause: int = 0         # steps left without drafting
    proposed: int = 0
    accepted: int = 0
    misses: int = 0        # drafts rejected outright in a row

    def __post_init__(self) -> None:
        self.length = self.max_len

    def wants(self, generating: int) -> int:
        """How long a draft to try now (0: none)."""
        if self.max_len < DRAFT_MIN or generating > MAX_STREAMS:
            return 0
        if self.pause > 0:
            self.pause -= 1
            return 0
        return max(DRAFT_MIN, self.length)

    def record(self, drafted: int, accepted: int) -> None:
        self.proposed += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.length = min(self.max_len, max(DRAFT_MIN, self.length * 2))
        else:
            self.length = max(DRAFT_MIN, accepted + 1)
        if accepted == 0:
            self.misses += 1
            self.pause = min(PAUSE_STEPS, 1 << (self.misses - 1))
        else:
            self.misses = 0
