"""Token bytes to text a client may see: whole UTF-8 characters, and never a stop string.

A stop string can span several tokens, so text that could still turn out to be the start
of one is held back until it is ruled out (then sent) or completed (then cut off).
"""
from __future__ import annotations

import codecs


class TextAssembler:
    def __init__(self, stops: list[str] | None = None):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = [s for s in (stops or []) if s]
        self._held = ""
        self.stopped = False
        self.stop_word: str | None = None     # the stop string that ended the text
        self.decoded = 0            # characters decoded so far, held ones included
        self.text = ""              # ... and the text itself (for type-along adoption)

    def feed(self, data: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to send."""
        if self.stopped:
            return ""
        text = self._decoder.decode(data)
        self.decoded += len(text)
        self.text += text
        self._held += text
        return self._release(final=False)

    def take_over(self, other: "TextAssembler", skip: int) -> str:
        """Continue `other`'s text after its first `skip` characters (which the client
        typed): its undecoded bytes come along; returns what is safe to send now."""
        self._decoder.setstate(other._decoder.getstate())
        text = other.text[skip:]
        self.decoded += len(text)
        self.text += text
        self._held += text
        return self._release(final=False)

    def finish(self) -> str:
        """Generation ended without a stop string: flush everything still held."""
        if self.stopped:
            return ""
        text = self._decoder.decode(b"", final=True)
        self.decoded += len(text)
        self.text += text
        self._held += text
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        found = [(i, s) for s in self._stops if (i := held.find(s)) >= 0]
        if found:
            cut, self.stop_word = min(found)
            self.stopped = True
            self._held = ""
            return held[:cut]
        keep = 0 if final else self._partial_stop_suffix(held)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep]

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper prefix of a stop string.
        Only the places where a stop's first character occurs can begin one, found at C
        speed (trying every length took 28 ms a token with 256 stops of 512 characters)."""
        best, size = 0, len(text)
        for stop in self._stops:
            first = stop[0]
            at = text.find(first, size - min(len(stop) - 1, size))
            while 0 <= at < size - best:
                if stop.startswith(text[at:]):
                    best = size - at
                    break
                at = text.find(first, at + 1)
        return best
