"""What a tenant's earlier sequences leave behind for drafting (the `history` and
`recycled` sources of `workers.engine.speculation`): its recent sequences, indexed by
their keys, and the table of what the model wrote after each token and pair of tokens.
Kept per tenant (an API key, or everyone with a shared cache), the least recently used
forgotten first; each bounded by counts, never by time."""
from __future__ import annotations

from collections import OrderedDict

from workers.engine.speculation import DRAFT_MIN, HISTORY_PROMPT, LONG_KEY

HISTORY_SEQUENCES = 16  # `history`: recent sequences kept per tenant
HISTORY_TOKENS = 4096   # ... at most this many tokens of each
HISTORY_TENANTS = 64    # tenants whose history is kept, least recently used dropped
RECYCLED_ENTRIES = 65536    # `recycled`: successors kept per tenant, per table
# entries of every tenant's tables together (the index's keys and both recycled tables),
# the least recently used tenants dropped past it: a tenant's fill up to ~190,000 (28 MB,
# sixteen sequences of 4,096 tokens), 64 of them 1.8 GB a worker; an editor's answers
# (a few hundred tokens) leave ~10,000 each, so a hundred such fit in this (~150 MB)
HISTORY_ENTRIES = 1 << 20


class History:
    """Recent sequences of one tenant (an API key's, or everyone's with a shared cache),
    for the `history` source: an editor asks for nearly the same completion again and
    again as the user types, so the previous answer is the likeliest draft. Keeps the
    last HISTORY_SEQUENCES sequences (each the tail of its prompt and its output, at most
    HISTORY_TOKENS), indexed by LONG_KEY-token keys, the newest occurrence winning."""

    def __init__(self) -> None:
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()
        self.index: dict[tuple, tuple[int, int]] = {}
        self.counter = 0
        self.recycler = Recycler()      # the tenant's `recycled` source

    def add(self, tokens: list[int], output_from: int) -> None:
        """A finished (or cancelled) sequence: `tokens` is its prompt and output, the
        output starting at `output_from`."""
        if len(tokens) - output_from < DRAFT_MIN:
            return
        start = max(0, output_from - LONG_KEY - HISTORY_PROMPT)
        kept = tokens[start:][-HISTORY_TOKENS:]
        self.counter += 1
        self.sequences[self.counter] = kept
        for i in range(LONG_KEY, len(kept)):
            self.index[tuple(kept[i - LONG_KEY:i])] = (self.counter, i)
        while len(self.sequences) > HISTORY_SEQUENCES:
            old_id, old = self.sequences.popitem(last=False)
            for i in range(LONG_KEY, len(old)):
                key = tuple(old[i - LONG_KEY:i])
                if self.index.get(key, (None,))[0] == old_id:
                    del self.index[key]

    def entries(self) -> int:
        """What it holds, in table entries (its memory: ~150 bytes each)."""
        return len(self.index) + len(self.recycler.after_one) + len(self.recycler.after_two)

    def lookup(self, context: list[int]) -> tuple[list[int], int] | None:
        """(tokens, position) where an earlier sequence went on after the context's last
        LONG_KEY tokens."""
        if len(context) < LONG_KEY:
            return None
        found = self.index.get(tuple(context[-LONG_KEY:]))
        if found is None or found[0] not in self.sequences:
            return None
        tokens = self.sequences[found[0]]
        return (tokens, found[1]) if found[1] < len(tokens) else None


class Recycler:
    """The `recycled` source: what the model itself wrote after a token (and after a pair
    of tokens) the last time, in this tenant's sequences. Token Recycling's table of the
    model's top candidates per token (Luo et al., ACL 2025), in its linear form: the top
    candidate at a verified position is the token the model wrote there, so the table
    costs no pass over the logits; chained from the context's last tokens it drafts code
    the tenant never sent before, in the model's own habits (`):` then a newline and the
    indentation, `self.` then the attribute it used last). Whether such a draft pays is
    the step costs' to say: on a CPU, where a row costs a good part of a step, rarely;
    where extra rows are nearly free, most steps."""

    def __init__(self) -> None:
        self.after_one: dict[int, int] = {}
        self.after_two: dict[tuple[int, int], int] = {}

    def learn(self, context: list[int], start: int) -> None:
        """The model's tokens context[start:] (each after the tokens before it)."""
        one, two = self.after_one, self.after_two
        for i in range(max(start, 2), len(context)):
            one.pop(context[i - 1], None)          # (re-inserted: the newest last)
            one[context[i - 1]] = context[i]
            key = (context[i - 2], context[i - 1])
            two.pop(key, None)
            two[key] = context[i]
        for table in (one, two):
            if len(table) > RECYCLED_ENTRIES:      # the oldest go, half the room left
                for key in list(table)[:len(table) - RECYCLED_ENTRIES // 2]:
                    del table[key]

    def chain(self, context: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens, each what the model wrote after the two before it (or,
        unseen, after the one before it)."""
        if len(context) < 2:
            return []
        a, b = context[-2], context[-1]
        out: list[int] = []
        while len(out) < limit:
            token = self.after_two.get((a, b))
            if token is None:
                token = self.after_one.get(b)
                if token is None:
                    break
            out.append(token)
            a, b = b, token
        return out


class Histories:
    """Each tenant's History, the least recently used forgotten first."""

    def __init__(self) -> None:
        self.tenants: OrderedDict[str, History] = OrderedDict()

    def of(self, tenant: str) -> History:
        history = self.tenants.pop(tenant, None) or History()
        self.tenants[tenant] = history
        while len(self.tenants) > HISTORY_TENANTS or \
                len(self.tenants) > 1 and self.entries() > HISTORY_ENTRIES:
            self.tenants.popitem(last=False)
        return history

    def entries(self) -> int:
        return sum(history.entries() for history in self.tenants.values())
