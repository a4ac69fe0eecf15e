"""One request inside a worker: its prompt tokens, its text so far, its logprobs."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from workers.errors import InvalidInput
from workers.textstream import TextAssembler


def token_text(piece: bytes) -> str:
    """A token's text for logprobs; bytes that are not UTF-8 on their own are shown as
    OpenAI does, `bytes:\\xe6\\x9d`."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def prompt_tokens(engine, prompt, suffix: str | None) -> list[int]:
    """Tokens of a prompt given as text, token ids, or llama.cpp's mix of both.

    BOS is added (when the model wants one) only in front of text that starts the
    prompt; a prompt that starts with token ids is taken exactly as given. With a
    `suffix`, the prompt is the prefix of a fill-in-the-middle request, laid out with
    the model's own FIM tokens: [BOS] PRE prefix SUF suffix MID.
    """
    if suffix is not None:
        if engine.fim_tokens is None:
            raise InvalidInput("this model has no fill-in-the-middle tokens (fim_pre, "
                               "fim_suf, fim_mid in its GGUF metadata), so 'suffix' cannot "
                               "be used", code="fim_unsupported", param="suffix")
        pre, suf, mid = engine.fim_tokens
        return (engine.bos() + [pre] + _tokens(engine, prompt, first_special=False)
                + [suf] + engine.tokenize(suffix, add_special=False) + [mid])
    return _tokens(engine, prompt, first_special=True)


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
    cached: int = 0                 # prompt tokens reused from the slot's KV cache
    seq: int = 0
    generated: int = 0
    logprob_sum: float = 0.0
    text_sent: bool = False
    chars_out: int = 0              # characters sent so far (echo included)
    started: float = field(default_factory=time.monotonic)
    prompt: object = None           # as the job gave it (for fault injection)
