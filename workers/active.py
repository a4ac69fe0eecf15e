"""One request inside a worker: its slot, its text so far, its logprobs and the editor
limits that may end it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from dispatcher.common import protocol as P
from workers.prompts import token_text
from workers.textstream import TextAssembler


def probs_entry(engine, token: int, piece: bytes, logprob, top) -> dict:
    """llama.cpp's `completion_probabilities` entry for one generated token."""
    def one(t: int, data: bytes, lp) -> dict:
        return {"id": t, "token": token_text(data), "bytes": list(data), "logprob": lp}
    return {**one(token, piece, logprob),
            "top_logprobs": [one(t, engine.piece(t), lp) for t, lp in top]}


@dataclass
class LogprobLedger:
    """Token logprobs waiting for their text to go out, in OpenAI's legacy shape.

    A token's entry is released with the chunk that carries (the start of) its text, so
    text held back for a possible stop string keeps its logprobs back too, and tokens
    inside a stop string are never reported.
    """
    k: int
    pending: list[tuple[int, str, float | None, dict | None]] = field(default_factory=list)

    def add(self, offset: int, text: str, logprob: float | None, top: dict | None) -> None:
        self.pending.append((offset, text, logprob, top))

    def release(self, upto: int | None) -> dict | None:
        """Entries whose text starts before character `upto` (None: all)."""
        n = len(self.pending) if upto is None else \
            next((i for i, e in enumerate(self.pending) if e[0] >= upto), len(self.pending))
        if n == 0:
            return None
        out, self.pending = self.pending[:n], self.pending[n:]
        return {"tokens": [e[1] for e in out], "token_logprobs": [e[2] for e in out],
                "top_logprobs": [e[3] for e in out], "text_offset": [e[0] for e in out]}


@dataclass
class Active:
    """One request admitted into a slot."""
    request_id: str
    topic: bytes
    attempt: int
    slot: int
    max_tokens: int | None
    n_ctx: int                      # this request's context limit
    prompt_tokens: int
    assembler: TextAssembler
    echo_text: str | None = None    # sent before the completion
    echo_pending: bool = False      # echo waits for the prompt's logprobs
    prompt_ids: list[int] | None = None
    ledger: LogprobLedger | None = None
    score: bool = False             # sum logprobs, for best_of
    limits: "EditorLimits | None" = None   # n_indent, t_max_predict_ms
    n_probs: int = 0                # llama.cpp's completion_probabilities, per token
    return_tokens: bool = False     # llama.cpp's `tokens`: the generated ids
    timings_per_token: bool = False  # llama.cpp's: each text event says its timings
    ids: list = field(default_factory=list)             # ... all of them (an adopter's)
    pending_ids: list = field(default_factory=list)     # ... waiting for their text
    pending_probs: list = field(default_factory=list)
    dropped_chunks: int = 0         # extra context left out: to fit, or t_max_prompt_ms
    truncated: bool = False         # an /infill's prefix or suffix cut to fit the context,
                                    # or the answer ended by the context's end
    cached: int = 0                 # prompt tokens reused from the slot's KV cache
    seq: int = 0
    generated: int = 0
    logprob_sum: float = 0.0
    eos_scored: int = 0             # the end token's logprob is in logprob_sum (best_of)
    text_sent: bool = False
    chars_out: int = 0              # characters sent so far (echo included)
    started: float = field(default_factory=time.monotonic)
    prompt: object = None           # as the job gave it (for fault injection)
    source: tuple | None = None     # (prompt, suffix, infill) as given: siblings share it
    tenant: str | None = None
    first_at: float | None = None   # when the first token was sampled (prefill done)
    offsets: list = field(default_factory=list)   # characters decoded after each token

    def usage(self, completion_tokens: int | None = None) -> P.Usage:
        return P.Usage(prompt_tokens=self.prompt_tokens,
                       completion_tokens=self.generated if completion_tokens is None
                       else completion_tokens)

    def timings(self) -> dict:
        """llama.cpp's `timings` so far: the prompt's milliseconds (to the first token) and
        the generation's since."""
        now = time.monotonic()
        first = self.first_at or now
        return {"prompt_ms": round((first - self.started) * 1000, 3),
                "predicted_ms": round((now - first) * 1000, 3)}

    def done(self, **fields) -> P.Done:
        """Its DONE body: this attempt, its last event's number, and `fields`."""
        return P.Done(attempt=self.attempt, last_seq=self.seq - 1, **fields)


@dataclass
class EditorLimits:
    """llama.cpp's editor stops, applied to the text as it is released:

    `n_indent`: after the first newline, a line indented less than this ends the
    completion where its indentation ends (that line's text is not sent), a blank line
    too (its indentation is none);
    `t_max_predict_ms`: a completion running longer than this (since its first token)
    ends with a token that has a newline, so at a line's end (as llama-server's
    `process_token`, the server llama-cpp-python 0.3.36 vendors).
    """
    n_indent: int = 0
    t_max_predict_ms: float = 0.0
    newline: bool = False           # the latest generated token had a newline (`generated`)
    at_line_start: bool = False
    indent: int = 0

    @classmethod
    def of(cls, gen: P.Generation) -> "EditorLimits | None":
        """The job's limits; None when it sets neither."""
        if not gen.n_indent and not gen.t_max_predict_ms:
            return None
        return cls(int(gen.n_indent or 0), float(gen.t_max_predict_ms or 0))

    def generated(self, piece: bytes) -> None:
        """A generated token's bytes (a newline byte is never part of another
        character): as llama.cpp, the time limit looks at the newline the model wrote,
        whether or not a stop string holds it back yet."""
        self.newline = b"\n" in piece

    def cut(self, text: str) -> tuple[str, bool]:
        """(the part of `text` to send, whether the completion ends here)."""
        if self.n_indent <= 0:
            return text, False
        for i, ch in enumerate(text):
            if self.at_line_start:
                if ch in " \t":
                    self.indent += 1
                    continue
                self.at_line_start = False      # its first other character: a newline
                if self.indent < self.n_indent:     # too (a blank line), as llama.cpp
                    return text[:i], True
            if ch == "\n":
                self.at_line_start, self.indent = True, 0
        return text, False

    def out_of_time(self, first_at: float | None, now: float) -> bool:
        """Whether the latest token (`generated`), one with a newline, is the last."""
        return self.t_max_predict_ms > 0 and self.newline and first_at is not None \
            and (now - first_at) * 1000 > self.t_max_predict_ms
