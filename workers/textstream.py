"""Token bytes to text a client may see: whole UTF-8 characters, and never a stop string.

A stop string can span several tokens, so text that could still turn out to be the start
of one is held back until it is ruled out (then sent) or completed (then cut off).
"""
from __future__ import annotations

import codecs
import functools
from collections import deque


class StopAutomaton:
    """The stop strings as one Aho-Corasick automaton: fed a character at a time, its
    state is the longest end of the text so far that begins a stop string (what must be
    held back), and the stop strings that end there. A token costs its characters,
    whatever the stop strings (trying each stop at each place cost up to 2 ms a token
    with 256 stop strings of 64 characters)."""

    def __init__(self, stops: tuple[str, ...]):
        goto: list[dict[str, int]] = [{}]
        self.depth = [0]                    # characters of the state's prefix
        self.word: list[str | None] = [None]    # the stop string ending at a state
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = goto[node][ch] = len(goto)
                    goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.word.append(None)
                node = nxt
            self.word[node] = stop
        self.goto = goto
        self.fail = [0] * len(goto)         # the longest proper end that is a state too
        self.out = [-1] * len(goto)         # ... the longest that is a whole stop string
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = self.fail[node]
                while f and ch not in goto[f]:
                    f = self.fail[f]
                self.fail[child] = back = goto[f].get(ch, 0)
                self.out[child] = back if self.word[back] is not None else self.out[back]
                queue.append(child)

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)

    def ending(self, state: int):
        """The stop strings that end where `state` stands."""
        node = state if self.word[state] is not None else self.out[state]
        while node != -1:
            yield self.word[node]
            node = self.out[node]


KEPT_CHARS = 2048        # stop sets this small are kept (a set of 16,384 characters, the
                        # most a request may have, takes ~4 MB and ~5 ms to build)


def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of a set of stop strings: built once and shared where the set is
    small (an editor sends the same few on every keystroke), never changed."""
    if sum(map(len, stops)) <= KEPT_CHARS:
        return _kept_automaton(stops)
    return StopAutomaton(stops)


@functools.lru_cache(maxsize=64)
def _kept_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)


class TextAssembler:
    def __init__(self, stops: list[str] | None = None):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stops = tuple(sorted({s for s in (stops or []) if s}))
        self._automaton = stop_automaton(stops) if stops else None
        self._state = 0             # the automaton's, after every character fed
        self._held = ""
        self.stopped = False
        self.stop_word: str | None = None     # the stop string that ended the text
        self.text = ""              # the text decoded so far, held characters included
                                    # (for type-along adoption)

    @property
    def decoded(self) -> int:
        """Characters decoded so far, held ones included."""
        return len(self.text)

    def feed(self, data: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to send."""
        if self.stopped:
            return ""
        return self._release(self._decoder.decode(data), final=False)

    def take_over(self, other: "TextAssembler", skip: int) -> str:
        """Continue `other`'s text after its first `skip` characters (which the client
        typed): its undecoded bytes come along; returns what is safe to send now."""
        self._decoder.setstate(other._decoder.getstate())
        return self._release(other.text[skip:], final=False)

    def finish(self) -> str:
        """Generation ended without a stop string: flush everything still held."""
        if self.stopped:
            return ""
        return self._release(self._decoder.decode(b"", final=True), final=True)

    def _release(self, new: str, final: bool) -> str:
        """`new` decoded text: the held text and it, cut before the earliest stop string
        found in them (of several starting there, the least as strings compare), or sent
        but for the end that could still begin one (all of it when `final`)."""
        self.text += new
        held, automaton = self._held + new, self._automaton
        if automaton is None:
            self._held = ""
            return held
        state, found, base = self._state, None, len(self._held)
        for i, ch in enumerate(new):
            state = automaton.step(state, ch)
            for word in automaton.ending(state):
                at = (base + i + 1 - len(word), word)
                found = at if found is None or at < found else found
        self._state = state
        if found is not None:
            cut, self.stop_word = found
            self.stopped = True
            self._held = ""
            return held[:cut]
        if final:               # (nothing is held after it: the automaton starts again)
            self._state = 0
        keep = 0 if final else automaton.depth[state]   # (held always ends with it)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep]
