"""Speculative drafts from the sequence's own tokens, which one to try, and whether a
draft pays in this step at all.

The engine verifies a draft in the same `llama_decode` as every other sequence's token:
one row per draft position, each sampled with the sequence's own sampler chain in turn
and compared with the draft, so greedy output is what it would be without speculation
and sampled output has the same distribution; the first mismatch ends the accepted run
and the rejected positions leave the KV cache.

Five sources propose a draft for a sequence (its context: prompt and output so far):
- `copy`: keep copying from where the last draft's source left off, at the same distance
  back. An edit rewrites a block with a changed name or number now and then; the model's
  own token at a mismatch may be a substitution, so the copy goes on just after it (the
  distance stays), instead of waiting for a fresh match that every key containing the new
  token misses: as `resume`, a source of its own, since on first-seen edits the model had
  mostly left the copy there (its first token kept in 1 of 10 such drafts; rated as the
  copy that held, they cost 2-5% of the edits' speed on this CPU). Two drafts in a row
  rejected at their first token drop it.
- `long`: the latest earlier occurrence of the last LONG_KEY tokens (an index kept as the
  sequence grows): a long key names the function and the number it copies, and the
  latest occurrence is the newest version of it (what the model just wrote wins over
  the prompt's stale sibling).
- `short`: the latest earlier occurrence of the last 4, 3 or 2 tokens: what wins on
  fresh code that repeats itself locally.
- `history`: where one of the tenant's recent sequences went on after the last LONG_KEY
  tokens (`history.History`): an editor asks for nearly the same completion many times, so the
  previous answer is the likeliest draft; a copy started there goes on there while its
  drafts hold. Cut short, it is not taken up again at the same distance (the repeat
  wrote something else at a near-tie and mostly goes on differently: measured) but
  re-aligned by the last few tokens (`_resync`) or looked up again.
- `recycled`: what the model wrote after the context's last two tokens (or last one) the
  last time, in any of the tenant's sequences (`history.Recycler`): the one source that drafts
  code whose continuation is nowhere yet, from the model's own habits.

Each source keeps its own acceptance record in the sequence (accepted draft tokens
against drafts cut short), started from a prior by how strong its evidence is; the
source with the most expected accepted tokens is tried. A draft of length L with
per-token acceptance a is expected to add sum(a**i, i=1..L) tokens, scaled by how the
engine's recent drafts from that source fared against such expectations (`Calibration`:
the gain is `Proposal.gain`); a source that keeps fewer than a quarter of its tokens in
a sequence (or fewer than pay for their rows on the device, where that is less:
`Drafter.floor`) stops drafting there until its misses fade (`Record.below_floor`).
Whether a draft goes into the step, and how long, is `workers.engine.stepcosts`'s to
decide.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.history import History

DRAFT_MIN = 4           # the shortest draft offered where the device's costs are unknown
                        # (where known: StepCosts.shortest_draft, per device)
DRAFT_START = 16        # a sequence's drafts start at most this long and double while
                        # wholly accepted (a confident source that turns out wrong
                        # costs a 16-row step, not a 64-row one)
NGRAM = (4, 3, 2)       # the `short` suffix lengths tried, longest first
LONG_KEY = 12           # tokens in the `long` source's key
LOOKBACK = 8192         # tokens the `short` source searches for its suffix
HISTORY_PROMPT = 256    # `history`: a kept sequence's prompt's last tokens (the output's
                        # lead-in: a repeated request matches all of it, HISTORY_REPEAT)
HISTORY_REPEAT = 128    # `history`: a match this long (a request asked again, or the same
                        # text again) drafts past the allowance, rated on the match over
                        # HISTORY_PROMPT tokens: its whole answer goes in one or two steps
RESYNC = 16             # `history`: how far from where a recent sequence's copy stood the
                        # context's last NGRAM tokens are looked for again after a miss


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two sequences share from the start (a slot's cache and a prompt,
    a draft model's cache and a context), compared a slice at a time: at C speed, for
    caches of thousands of tokens compared every step of every slot."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n                    # a[:low] == b[:low]; a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def find_draft(context: list[int], limit: int, minimum: int = DRAFT_MIN) -> list[int]:
    """The tokens that followed the latest earlier occurrence of `context`'s last n tokens
    (n from NGRAM), at most `limit` of them; [] when nothing of `minimum` tokens is found."""
    start = find_source(context, limit, minimum)
    return [] if start is None else context[start:start + limit]


def find_source(context: list[int], limit: int, minimum: int = DRAFT_MIN) -> int | None:
    """Where `find_draft`'s draft starts in `context` (None: no draft)."""
    if limit < minimum:
        return None
    start = max(0, len(context) - LOOKBACK)
    for n in NGRAM:
        if len(context) <= n:
            continue
        key = context[-n:]
        first = key[0]
        for i in range(len(context) - n - 1, start - 1, -1):
            if context[i] == first and context[i:i + n] == key:
                if len(context) - (i + n) >= minimum:
                    return i + n
                break          # the latest match is too close to the end: try shorter n
    return None


def matched(context: list[int], start: int, source: list[int] | None = None,
            window: int | None = None) -> int:
    """How many tokens before `start` in `source` (default: the context itself) equal
    those at the end of `context` (at most `window`, default MATCH_WINDOW): the length of
    the match a lookup found."""
    source = context if source is None else source
    window = MATCH_WINDOW if window is None else window
    n, k = len(context), 0
    while k < window and k < start and k < n and \
            source[start - 1 - k] == context[n - 1 - k]:
        k += 1
    return k


def expected_accepted(rate: float, length: int) -> float:
    """Draft tokens expected to survive verification: each is accepted with `rate` if all
    before it were."""
    if rate >= 1.0:
        return float(length)
    return rate * (1 - rate ** length) / (1 - rate)


@dataclass
class Record:
    """A source's acceptance in one sequence: accepted draft tokens and drafts cut short
    (the maximum-likelihood per-token acceptance of a geometric run is acc / (acc + cut)),
    started from a prior; and, measured only, the draft tokens it had verified and how
    many of them held (the floor: `below_floor`)."""
    accepted: float
    cut: float
    tried: float = 0.0      # (faded as `cut` is: a source off for a while is retried)
    kept: float = 0.0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.cut)

    def below_floor(self, floor: float | None = None) -> bool:
        """Its drafts in this sequence are mostly refused: FLOOR_AFTER tokens tried and
        fewer than `floor` of them kept (default FLOOR; it drafts no more in this sequence
        until the faded count of tokens tried falls below FLOOR_AFTER again: a few to ~35
        steps)."""
        floor = FLOOR if floor is None else floor
        return self.tried >= FLOOR_AFTER and self.kept < floor * self.tried


class Calibration:
    """How a source's expected accepted tokens (`Proposal.gain`, from its rate) compare
    with what verification then kept, over this engine's recent drafts of every sequence:
    a lookup's rate comes from how far back its match reaches, a guess that holds on some
    text and not on another. Each source's factor, realized over expected (both faded,
    from a prior of CALIBRATION_PRIOR tokens that agree), scales its gains, so the draft
    lengths and whether a draft goes in at all follow the acceptance measured here.
    Every step fades them too (`step`), drafted or not: a source whose factor has shut
    it out comes back toward the prior and is measured again, so one stretch of text
    where it failed does not switch it off for the worker's life."""

    def __init__(self) -> None:
        self.expected: dict[str, float] = {}
        self.realized: dict[str, float] = {}

    def step(self) -> None:
        """One decode step has passed."""
        for sums in (self.expected, self.realized):
            for source in sums:
                sums[source] *= CALIBRATION_STEP_FADE

    def factor(self, source: str) -> float:
        expected = self.expected.get(source, 0.0) + CALIBRATION_PRIOR
        realized = self.realized.get(source, 0.0) + CALIBRATION_PRIOR
        return min(CALIBRATION_MAX, realized / expected)

    def add(self, source: str, expected: float, realized: float) -> None:
        self.expected[source] = CALIBRATION_FADE * self.expected.get(source, 0.0) + expected
        self.realized[source] = CALIBRATION_FADE * self.realized.get(source, 0.0) + realized


# Priors (pseudo-counts): a copy that ran before is likely to go on, one that goes on
# past a mismatch (`resume`) seldom (the first token after one was kept in 1 of 10 such
# drafts on first-seen edits: the model had left the copy); a lookup's own evidence is
# how far back its match reaches (`matched`), counted per proposal.
PRIORS = {"copy": (9.0, 1.0), "resume": (1.0, 2.0), "long": (1.0, 1.0), "short": (1.0, 1.0),
          "history": (1.0, 1.0), "recycled": (1.0, 2.0), "model": (3.0, 1.0)}
PRIOR_CUT = 1.0
FADE = 0.98             # per step: a source's misses of ~35 steps ago count half
MATCH_WINDOW = 64       # how far back a lookup's match is measured
CUT_WEIGHT = 8          # a lookup's miss counts against it as much as 8 matched tokens
FLOOR = 0.25            # a source keeping fewer of its draft tokens than this in a
FLOOR_AFTER = 16        # sequence, once it has tried this many, drafts no more there
FLOOR_LEAST = 0.01      # ... or than what pays on the device, where less (Drafter.floor),
                        # but never less than this: one kept in a hundred
CALIBRATION_PRIOR = 8.0     # tokens: a source's gains count as expected until measured
CALIBRATION_FADE = 0.97     # per draft: a source's drafts of ~25 drafts ago count half
CALIBRATION_STEP_FADE = 0.995   # ... and per step: of ~140 steps ago, half
CALIBRATION_MAX = 1.25      # its gains are never scaled up past this


@dataclass
class Proposal:
    source: str
    start: int          # where the draft starts in the context
    tokens: list[int]
    rate: float
    sources: list[str] = field(default_factory=list)   # all that proposed this text
    origin: list[int] | None = field(default=None, repr=False)  # the tokens it copies
    external: bool = False          # ... a recent sequence's, not the context's
    scale: float = 1.0              # its source's calibration (Calibration.factor)
    # `model`: its tokens are made once the step's plan has chosen its length, each
    # costing `make_ms` (the draft model's decodes), plus `make_fixed` once (a share of
    # bringing the draft model's cache level with the context); others cost nothing
    make_ms: float = 0.0
    make_fixed: float = 0.0

    def make_cost(self, length: int) -> float:
        """Milliseconds making its first `length` tokens adds to the step."""
        return self.make_fixed + self.make_ms * length if self.make_ms else 0.0

    def expected(self, length: int) -> float:
        """Draft tokens its rate expects to survive of the first `length`."""
        return expected_accepted(self.rate, min(length, len(self.tokens)))

    def gain(self, length: int) -> float:
        """... as this engine's measured acceptance of its source corrects that."""
        return self.scale * self.expected(length)


@dataclass
class Drafter:
    """One sequence's drafting state."""
    max_len: int
    records: dict[str, Record] = field(default_factory=dict)
    distance: int | None = None     # `copy`: how far back the copied text lies
    resumed: bool = False           # ... and it goes on past a mismatch (`resume`)
    misses: int = 0                 # drafts in a row rejected at their first token
    index: dict[tuple, int] = field(default_factory=dict)   # `long`: key -> next position
    indexed: int = 0                # context positions [LONG_KEY, indexed) are in `index`
    proposed: int = 0
    accepted: int = 0
    tried: Proposal | None = None   # the draft in this step
    tried_at: int = 0               # the context's length when it was drafted
    history: History | None = None  # `history`: the tenant's recent sequences
    # `copy` from a recent sequence instead of the context: (its tokens, the position
    # aligned with the context's end at length `at`, at)
    copied: tuple[list[int], int, int] | None = None
    # the recent sequence copied last, kept past misses (same layout): where to look for
    # the context's last tokens again after the model wrote something else (`_resync`)
    recent: tuple[list[int], int, int] | None = None
    drafts_from_history: bool = True    # False: the history only records this one
    allowance: int = DRAFT_START    # the longest draft now: doubles while drafts hold
    # True (a wide draw, SamplingParams.wide): lookups rate by the sequence's own record
    # only; that the text repeats says little of whether such a draw repeats it
    proven_only: bool = False
    calibration: Calibration | None = None  # the engine's, shared by its sequences
    output_from: int | None = None  # `recycled`: where the model's tokens start (the
    learned: int = 0                # prompt's length), and how far they are learned
    min_len: int = DRAFT_MIN        # the shortest draft offered (StepCosts.shortest_draft)
    # the share of its draft tokens a source must keep in the sequence to go on drafting
    # there (StepCosts.floor_share: where rows are nearly free, a draft pays keeping far
    # less than a quarter); a draft model's, whose tokens cost decodes to make, FLOOR
    floor: float = FLOOR

    def __post_init__(self) -> None:
        self.records = {name: Record(*prior) for name, prior in PRIORS.items()}

    def propose(self, context: list[int], limit: int, proven: bool = False
                ) -> Proposal | None:
        """The draft with the most expected accepted tokens, at most `limit` long.
        `proven`: rate each source by its own record in this sequence only, not by how far
        back a lookup's match reaches (others share the step: a guess costs them too)."""
        room = min(limit, self.max_len)
        limit = min(room, self.allowance)
        if room < self.min_len:
            return None
        n = len(context)
        best, found = None, []
        for record in self.records.values():    # old misses fade: a source gets retried
            record.cut = max(PRIOR_CUT, record.cut * FADE)
            record.tried *= FADE
            record.kept *= FADE
        candidates = [("resume" if self.resumed else "copy", context, self._copy_start(n)),
                      ("long", context, self._long(context)),
                      ("short", context, find_source(context, limit, self.min_len))]
        if self.copied is not None:
            tokens, at, when = self.copied
            candidates[0] = ("copy", tokens, at + n - when)
        if self.history is not None and self.drafts_from_history:
            earlier = self.history.lookup(context) or self._resync(context)
            if earlier is not None:
                candidates.append(("history", *earlier))
        if self.learn(context):
            recycled = self.history.recycler.chain(context, limit)
            if recycled:
                candidates.append(("recycled", recycled, 0))
        for source, tokens, start in candidates:
            if start is None or len(tokens) - start < self.min_len or \
                    (tokens is context and n - start < self.min_len):
                continue
            record = self.records[source]
            if record.below_floor(self.floor):
                continue
            rate, length = record.rate, limit
            if source not in ("copy", "resume", "recycled") and \
                    not (proven or self.proven_only):
                # a longer match is a likelier continuation,
                m = matched(context, start, tokens,     # but the source's misses weigh more
                            HISTORY_PROMPT if source == "history" else None)
                if source == "history" and m >= HISTORY_REPEAT:
                    length = room   # a long text asked again: no need to work up to it
                rate = (record.accepted + m) / (record.accepted + m + 1 +
                                                CUT_WEIGHT * (record.cut - PRIOR_CUT))
            proposal = Proposal(source, start, tokens[start:start + length], rate,
                                origin=tokens, external=tokens is not context,
                                scale=self.calibration.factor(source)
                                if self.calibration is not None else 1.0)
            found.append(proposal)
            if best is None or proposal.gain(room) > best.gain(room):
                best = proposal
        if best is not None:            # the sources that found the same text share its fate
            best.sources = [p.source for p in found
                            if p.start == best.start and p.origin is best.origin]
        return best

    def model_proposal(self, limit: int, make_ms: float, make_fixed: float
                       ) -> Proposal | None:
        """A draft model's draft of at most `limit` tokens, yet to be made (`Proposal`'s
        make costs): rated by the source's record in this sequence, None where it is
        below the floor or there is no room for `min_len` tokens. Call after `propose`
        (which fades the records) in the same step."""
        room = min(limit, self.max_len)
        record = self.records["model"]
        if room < self.min_len or record.below_floor():
            return None
        return Proposal("model", 0, [0] * min(room, self.allowance), record.rate,
                        scale=self.calibration.factor("model")
                        if self.calibration is not None else 1.0,
                        make_ms=make_ms, make_fixed=make_fixed)

    def learn(self, context: list[int]) -> bool:
        """The tenant's `recycled` table learns the model's tokens written since the last
        call (False: this sequence has no such table)."""
        if self.history is None or self.output_from is None or \
                not self.drafts_from_history:   # (a sampled answer is one draw of many)
            return False
        self.history.recycler.learn(context, max(self.output_from, self.learned))
        self.learned = len(context)
        return True

    def _resync(self, context: list[int]) -> tuple[list[int], int] | None:
        """Where the recent sequence copied last goes on, found again near where its copy
        stood by the context's last 4, 3 or 2 tokens: the model inserted or dropped a
        token ("lists.\n" for "lists\n"), which a copy at the same distance never gets
        past and a LONG_KEY key finds only LONG_KEY tokens later. Only within RESYNC
        tokens of that copy's last draft (further on, a short key matches by chance)."""
        if self.recent is None or len(context) - self.recent[2] > RESYNC:
            return None
        tokens, at, when = self.recent
        guess = at + len(context) - when
        for size in NGRAM:
            key = context[-size:]
            for offset in sorted(range(-RESYNC, RESYNC + 1), key=abs):
                p = guess + offset
                if size <= p < len(tokens) and tokens[p - size:p] == key:
                    return tokens, p
        return None

    def _copy_start(self, n: int) -> int | None:
        return None if self.distance is None or self.distance > n else n - self.distance

    def _long(self, context: list[int]) -> int | None:
        """The latest earlier occurrence of the last LONG_KEY tokens. The index holds the
        key ending at every position before the last (the key at the end is not its own
        match; it goes in next step, overwriting older occurrences: the newest wins)."""
        n = len(context)
        if n <= LONG_KEY:
            return None
        # after a rejected draft the context is shorter: entries past it are stale (checked
        # below), those before it still hold
        first = max(LONG_KEY, n - LOOKBACK, min(self.indexed, n - 1))
        index = self.index
        for i in range(first, n):
            index[tuple(context[i - LONG_KEY:i])] = i
        self.indexed = n
        key = tuple(context[n - LONG_KEY:])
        start = index.get(key)
        if start is None or start >= n or tuple(context[start - LONG_KEY:start]) != key:
            return None
        return start

    def started(self, proposal: Proposal, context_len: int) -> None:
        self.tried, self.tried_at = proposal, context_len

    def record(self, drafted: int, accepted: int) -> None:
        """The verification of the draft in this step: `accepted` of `drafted` survived."""
        proposal, self.tried = self.tried, None
        self.proposed += drafted
        self.accepted += accepted
        if proposal is None:        # a guess that filled drafts alike: no source's, and
            return                  # no reason to shorten the sources' drafts
        if accepted < drafted:
            self.allowance = DRAFT_START
        elif 4 * drafted >= 3 * self.allowance:  # (a short draft that held proves less;
            self.allowance = min(2 * self.allowance, self.max_len)  # plan may take 15 of 16)
        sources = proposal.sources or [proposal.source]
        for source in sources:
            record = self.records[source]
            record.accepted += accepted
            record.cut += accepted < drafted
            record.tried += drafted
            record.kept += accepted
        if self.calibration is not None:     # (its own tokens: not a guess padding them)
            own = min(drafted, len(proposal.tokens))
            self.calibration.add(proposal.source, proposal.expected(own), min(accepted, own))
        # The context's own text after the draft's source goes on at the same distance (a
        # mismatch is a substitution); a source rejected outright twice in a row is
        # dropped. A recent sequence's text goes on only while its drafts hold: cut
        # short, the model went another way (a near-tie flipped), and `_resync` finds
        # the place again by the last few tokens if it comes back to that text. (A
        # one-token substitution then costs the two steps until the last two tokens
        # match again: measured, fewer wasted draft steps than resuming blindly.)
        if proposal.source in ("recycled", "model"):    # (no text it copies: nothing to
            return                                      # go on from)
        self.misses = self.misses + 1 if accepted == 0 else 0
        self.distance = self.copied = None
        if proposal.external:
            self.recent = (proposal.origin, proposal.start, self.tried_at)
        if self.misses >= 2:
            return
        if not proposal.external:
            self.distance = self.tried_at - proposal.start
            # (a mismatch in its own text: a guess padding drafts alike is not the copy)
            self.resumed = accepted < min(drafted, len(proposal.tokens))
        elif accepted == drafted:
            self.copied = (proposal.origin, proposal.start, self.tried_at)
