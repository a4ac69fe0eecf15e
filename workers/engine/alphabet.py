"""The tokens a grammar could ever accept, from the characters its classes and literals
can match: a superset of what it allows at any point (a token is accepted only if every
one of its characters is matched by some character element of the grammar).

A grammar the model fights (`root ::= [^e]*` over prose) refuses most of the model's
picks; llama.cpp then tests every token of the vocabulary against every parse stack
(tens of milliseconds a token for 262,144 tokens). Drawing from, and applying the
grammar to, only the tokens of its alphabet gives the same distribution (every other
token would be refused anyway) at a fraction of the cost; `SamplerChain` uses it.

Kept out of the mask, so always candidates: tokens whose text is not whole UTF-8 (a
character split across tokens), end-of-generation tokens (a grammar accepts them where it
may end) and tokens with no text. The token texts are llama.cpp's grammar's own (control
tokens' text included)."""
from __future__ import annotations

import threading

import numpy as np

from dispatcher.common import grammar as gbnf
from dispatcher.common.tenantlru import TenantLRU

MAX_CODE_POINT = 0x10FFFF
# A mask keeping more than this share of the vocabulary saves too little to be used.
USEFUL_SHARE = 0.9
KEPT_MASKS = 32


def grammar_ranges(parsed: gbnf.Grammar) -> tuple[list[tuple[int, int]], set[int]] | None:
    """The code point ranges (merged, sorted) any character element of the grammar can
    match, and the token ids it names (`<[id]>`); None when it can match any character
    or token (`.`, `!<…>`)."""
    ranges: list[tuple[int, int]] = []
    tokens: set[int] = set()
    for rule in parsed.rules:
        i = 0
        while i < len(rule):
            kind, value = rule[i]
            if kind in (gbnf.CHAR_ANY, gbnf.TOKEN_NOT) or (kind == gbnf.TOKEN and value < 0):
                return None             # (`<text>`: an id only the worker's vocabulary knows)
            if kind == gbnf.TOKEN:
                tokens.add(value)
            if kind not in (gbnf.CHAR, gbnf.CHAR_NOT):
                i += 1
                continue
            part = [[value, value]]
            i += 1
            while i < len(rule) and rule[i][0] in (gbnf.CHAR_ALT, gbnf.CHAR_RNG_UPPER):
                if rule[i][0] == gbnf.CHAR_RNG_UPPER:
                    part[-1][1] = rule[i][1]
                else:
                    part.append([rule[i][1], rule[i][1]])
                i += 1
            merged = _merge([(lo, hi) for lo, hi in part])
            ranges.extend(_complement(merged) if kind == gbnf.CHAR_NOT else merged)
    return _merge(ranges), tokens


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = max(start, hi + 1)
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return out


PRINTABLE_ASCII = (0x20, 0x7E)


def _covers(ranges: list[tuple[int, int]], span: tuple[int, int]) -> bool:
    return any(lo <= span[0] and span[1] <= hi for lo, hi in ranges)


class TokenTexts:
    """Every token's text as code points, made once per vocabulary on a thread of its own
    (when the first grammar asks: about 2 s for 262,144 tokens on
    one core of this machine, through llama-cpp-python's calls). A grammar that asks
    before they are made waits for them (on the preparing thread): whether a chain has
    a mask never depends on timing, so the same seed gives the same text."""

    def __init__(self, n_vocab: int, piece, is_eog):
        self.n_vocab, self._piece, self._is_eog = n_vocab, piece, is_eog
        self._lock = threading.Lock()
        self._built = threading.Event()
        self._builder: threading.Thread | None = None
        self._masks = TenantLRU(KEPT_MASKS)       # (tenant, grammar text) -> ids or None
        self._stop = threading.Event()
        self.points = None                             # made: the texts

    def close(self) -> None:
        """Stop a build under way (before the vocabulary it reads is freed)."""
        self._stop.set()
        builder = self._builder
        if builder is not None:
            builder.join()

    def start(self) -> None:
        """Start making the texts (once)."""
        with self._lock:
            if self._builder is None and not self._stop.is_set():
                self._builder = threading.Thread(target=self._build, daemon=True,
                                                 name="token-texts")
                self._builder.start()

    def build(self) -> None:
        """Make the texts now (and wait for them)."""
        self.start()
        if self._builder is not None:
            self._built.wait()

    def _build(self) -> None:
        try:
            self._make()
        finally:
            self._built.set()               # (stopped or failed: no grammar has a mask)

    def _make(self) -> None:
        points: list[int] = []
        starts = np.zeros(self.n_vocab, dtype=np.int64)
        lengths = np.zeros(self.n_vocab, dtype=np.int64)
        always = np.zeros(self.n_vocab, dtype=bool)
        for token in range(self.n_vocab):
            if self._stop.is_set():          # the engine is closing: its vocabulary goes
                return
            starts[token] = len(points)
            try:
                # (llama.cpp's grammar reads a token's text up to a NUL)
                text = self._piece(token).split(b"\0", 1)[0].decode("utf-8")
            except UnicodeDecodeError:
                always[token] = True
                continue
            if not text or self._is_eog(token):
                always[token] = True
                continue
            points.extend(map(ord, text))
            lengths[token] = len(text)
        self.starts, self.lengths, self.always = starts, lengths, always
        self.points = np.array(points, dtype=np.int32)

    def allowed_ids(self, grammar: str, tenant: str | None = None) -> np.ndarray | None:
        """The sorted ids of the tokens `grammar` could ever accept, or None where that is
        more than USEFUL_SHARE of the vocabulary (or every token); waits for the texts
        (asking starts them). Kept per `tenant` (a grammar another key had sent answered
        sooner: an oracle of its grammars)."""
        self.build()
        with self._lock:
            if (tenant, grammar) in self._masks:
                return self._masks.get(tenant, grammar)
            if self.points is None:
                return None                  # the engine is closing
            ids = self._allowed(grammar)
            self._masks.put(tenant, grammar, ids)
            return ids

    def _allowed(self, grammar: str) -> np.ndarray | None:
        found = grammar_ranges(gbnf.check(grammar, growth=False))   # (its rules alone)
        if found is None:
            return None
        ranges, tokens = found
        if _covers(ranges, PRINTABLE_ASCII):
            return None            # (JSON's strings: nearly every token; not worth a pass)
        if not ranges:
            inside = np.zeros(len(self.points), dtype=bool)
        else:
            lows = np.array([lo for lo, _ in ranges], dtype=np.int32)
            highs = np.array([hi for _, hi in ranges], dtype=np.int32)
            at = np.searchsorted(lows, self.points, side="right") - 1
            inside = (at >= 0) & (self.points <= highs[np.maximum(at, 0)])
        # a token is in when none of its code points is outside
        outside = np.concatenate(([0], np.cumsum(~inside)))
        ends = self.starts + self.lengths
        keep = (outside[ends] - outside[self.starts] == 0) | self.always
        keep[[t for t in tokens if 0 <= t < self.n_vocab]] = True
        if keep.sum() > USEFUL_SHARE * self.n_vocab:
            return None
        return np.flatnonzero(keep).astype(np.int32)
