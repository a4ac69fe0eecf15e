"""One request inside a worker: its prompt tokens, its text so far, its logprobs."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from dispatcher.common import protocol as P
from workers.errors import InvalidInput
from workers.textstream import TextAssembler


def token_text(piece: bytes) -> str:
    """A token's text for logprobs; bytes that are not UTF-8 on their own are shown as
    OpenAI does, `bytes:\\xe6\\x9d`."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


# llama.cpp's separator before each extra chunk when the vocabulary has no FIM_SEP
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTemplate:
    """A fill-in-the-middle layout for models without FIM tokens (Tabby's idea), e.g.
    `<PRE> {prefix} <SUF>{suffix} <MID>`: the text around the placeholders is tokenized
    with special-token syntax parsed; the prefix and suffix are inserted as given."""
    pieces: tuple[str, ...]           # literal text and the two placeholders, in order

    @classmethod
    def parse(cls, template: str) -> "FimTemplate":
        try:
            template.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the FIM template is not valid Unicode text") from None
        pieces = tuple(p for p in re.split(r"(\{prefix\}|\{suffix\})", template) if p)
        if pieces.count("{prefix}") != 1 or pieces.count("{suffix}") != 1:
            raise ValueError("a FIM template has {prefix} and {suffix}, once each")
        return cls(pieces)

    def tokens(self, engine, prefix: list[int], suffix: list[int]) -> list[int]:
        out: list[int] = []
        for piece in self.pieces:
            out += prefix if piece == "{prefix}" else suffix if piece == "{suffix}" else \
                engine.tokenize(piece, add_special=False)
        return out


def vocabulary_op(engine, body: P.WorkerJob) -> dict:
    """The answer to a /tokenize or /detokenize job, in llama.cpp's shape."""
    gen = body.generation
    if body.op == "tokenize":
        tokens = engine.tokenize(gen.content or "", bool(gen.add_special))
        return {"tokens": [{"id": t, "piece": token_text(engine.piece(t))} for t in tokens]
                if gen.with_pieces else tokens}
    if body.op == "detokenize":
        engine.check_tokens(gen.tokens or [], param="tokens")
        data = b"".join(engine.piece(t) for t in gen.tokens or [])
        return {"content": data.decode("utf-8", "replace")}
    raise InvalidInput(f"unknown operation {body.op!r}")


def probs_entry(engine, token: int, piece: bytes, logprob, top) -> dict:
    """llama.cpp's `completion_probabilities` entry for one generated token."""
    def one(t: int, data: bytes, lp) -> dict:
        return {"id": t, "token": token_text(data), "bytes": list(data), "logprob": lp}
    return {**one(token, piece, logprob),
            "top_logprobs": [one(t, engine.piece(t), lp) for t, lp in top]}


def prompt_tokens(engine, prompt, suffix: str | None,
                  template: FimTemplate | None = None, extra: list | None = None,
                  middle: str = "") -> list[int]:
    """Tokens of a prompt given as text, token ids, or llama.cpp's mix of both.

    BOS is added (when the model wants one) only in front of text that starts the
    prompt; a prompt that starts with token ids is taken exactly as given. With a
    `suffix`, the prompt is the prefix of a fill-in-the-middle request (`infill_tokens`).
    """
    if suffix is not None:
        return infill_tokens(engine, prompt, suffix, template, extra or [], middle)
    return _tokens(engine, prompt, first_special=True)


def infill_tokens(engine, prefix, suffix: str, template: FimTemplate | None,
                  extra: list[dict], middle: str) -> list[int]:
    """[extra chunks] [BOS] PRE prefix SUF suffix MID middle, as llama.cpp's /infill lays
    it out: with the vocabulary's FIM_REP/FIM_SEP the extra chunks are a repository
    (`FIM_REP project FIM_SEP filename text ... FIM_SEP filename`), otherwise each is
    preceded by a snippet separator. A FIM template (the server's, for this model) takes
    the place of the FIM tokens."""
    if template is None and engine.fim_tokens is None:
        raise InvalidInput("this model has no fill-in-the-middle tokens (fim_pre, fim_suf, "
                           "fim_mid in its GGUF metadata) and no --fim-template, so "
                           "'suffix' cannot be used", code="fim_unsupported", param="suffix")
    text = lambda t: engine.tokenize(t, add_special=False)   # noqa: E731
    repo = getattr(engine, "fim_repo", None) if template is None else None
    chunks: list[int] = []
    if extra:
        if repo is not None:
            chunks += [repo[0]] + text("myproject\n")
        for chunk in extra:
            if repo is not None:
                chunks += [repo[1]] + text(str(chunk.get("filename") or "tmp") + "\n")
            else:
                chunks += text(CHUNK_SEPARATOR)
            chunks += text(str(chunk.get("text") or ""))
        if repo is not None:
            chunks += [repo[1]] + text("filename\n")
    prefix_tokens = _tokens(engine, prefix, first_special=False)
    if template is not None:
        body = template.tokens(engine, prefix_tokens, text(suffix))
    else:
        pre, suf, mid = engine.fim_tokens
        body = [pre] + prefix_tokens + [suf] + text(suffix) + [mid]
    return chunks + engine.bos() + body + (text(middle) if middle else [])


def _tokens(engine, prompt, first_special: bool) -> list[int]:
    if isinstance(prompt, str):
        return engine.tokenize(prompt, add_special=first_special)
    tokens: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            tokens += engine.tokenize(part, add_special=first_special and i == 0)
        else:
            tokens.append(int(part))
    return tokens


def prompt_text(engine, prompt, tokens: list[int]) -> str:
    """What `echo` shows: the prompt as sent, or its tokens' text."""
    if isinstance(prompt, str):
        return prompt
    return b"".join(engine.piece(t) for t in tokens).decode("utf-8", "replace")


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
    pending_ids: list = field(default_factory=list)     # ... waiting for their text
    pending_probs: list = field(default_factory=list)
    dropped_chunks: int = 0         # extra context left out to meet t_max_prompt_ms
    cached: int = 0                 # prompt tokens reused from the slot's KV cache
    seq: int = 0
    generated: int = 0
    logprob_sum: float = 0.0
    text_sent: bool = False
    chars_out: int = 0              # characters sent so far (echo included)
    started: float = field(default_factory=time.monotonic)
    prompt: object = None           # as the job gave it (for fault injection)
    first_at: float | None = None   # when the first token was sampled (prefill done)
    offsets: list = field(default_factory=list)   # characters decoded after each token

    def usage(self, completion_tokens: int | None = None) -> P.Usage:
        return P.Usage(prompt_tokens=self.prompt_tokens,
                       completion_tokens=self.generated if completion_tokens is None
                       else completion_tokens)

    def done(self, **fields) -> P.Done:
        """Its DONE body: this attempt, its last event's number, and `fields`."""
        return P.Done(attempt=self.attempt, last_seq=self.seq - 1, **fields)


@dataclass
class EditorLimits:
    """llama.cpp's editor stops, applied to the text as it is released:

    `n_indent`: after the first newline, a line whose first visible character is indented
    less than this ends the completion there (that line's text is not sent);
    `t_max_predict_ms`: once a newline has been generated, a completion running longer
    than this (since its first token) ends at the next token.
    """
    n_indent: int = 0
    t_max_predict_ms: float = 0.0
    seen_newline: bool = False
    at_line_start: bool = False
    indent: int = 0

    @classmethod
    def of(cls, gen: P.Generation) -> "EditorLimits | None":
        """The job's limits; None when it sets neither."""
        if not gen.n_indent and not gen.t_max_predict_ms:
            return None
        return cls(int(gen.n_indent or 0), float(gen.t_max_predict_ms or 0))

    def cut(self, text: str) -> tuple[str, bool]:
        """(the part of `text` to send, whether the completion ends here)."""
        if self.n_indent <= 0:
            if "\n" in text:
                self.seen_newline = True
            return text, False
        for i, ch in enumerate(text):
            if ch == "\n":
                self.seen_newline, self.at_line_start, self.indent = True, True, 0
            elif self.at_line_start and ch in " \t":
                self.indent += 1
            elif self.at_line_start:
                self.at_line_start = False
                if self.indent < self.n_indent:
                    return text[:i], True
        return text, False

    def out_of_time(self, first_at: float | None, now: float) -> bool:
        return self.t_max_predict_ms > 0 and self.seen_newline and first_at is not None \
            and (now - first_at) * 1000 > self.t_max_predict_ms
