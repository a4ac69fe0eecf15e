"""A job's prompt as tokens: text, token ids or llama.cpp's mix; fill-in-the-middle and
/infill layouts (the model's FIM tokens or a server template); and /tokenize's answers."""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

from dispatcher.common import protocol as P
from workers.errors import InvalidInput


def token_text(piece: bytes) -> str:
    """A token's text for logprobs; bytes that are not UTF-8 on their own are shown as
    OpenAI does, `bytes:\\xe6\\x9d`."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def piece_of(piece: bytes) -> str | list[int]:
    """/tokenize's `piece`, as llama.cpp gives it: the text, or where the bytes are not
    UTF-8 on their own (a character split over tokens), the bytes as numbers."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


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


@contextmanager
def tenant_of(engine, body: P.WorkerJob):
    """The job's tokenizations as its tenant's (`Vocabulary.tenant`; an engine without
    kept tokenizations, the fake, has none)."""
    vocabulary = getattr(engine, "vocabulary", None)
    if vocabulary is None:
        yield
        return
    with vocabulary.tenant(body.tenant):
        yield


# The text /detokenize makes at most: the front end bounds the ids (--max-prompt-chars),
# but their text is as long as the vocabulary's pieces (a million of a 128-byte token:
# 128 MB made, sent and parsed again)
MAX_DETOKENIZED_BYTES = 16 << 20


def vocabulary_op(engine, body: P.WorkerJob) -> dict:
    """The answer to a /tokenize or /detokenize job, in llama.cpp's shape."""
    with tenant_of(engine, body):
        return _vocabulary_op(engine, body)


def _vocabulary_op(engine, body: P.WorkerJob) -> dict:
    gen = body.generation
    if body.op == "tokenize":
        tokens = engine.tokenize(gen.content or "", bool(gen.add_special),
                                 gen.parse_special is not False)
        return {"tokens": [{"id": t, "piece": piece_of(engine.piece(t, True))}
                           for t in tokens]
                if gen.with_pieces else tokens}
    if body.op == "detokenize":
        engine.check_tokens(gen.tokens or [], param="tokens")
        pieces, size = [], 0
        for t in gen.tokens or []:
            pieces.append(engine.piece(t, True))
            size += len(pieces[-1])
            if size > MAX_DETOKENIZED_BYTES:
                raise InvalidInput(f"the text of these tokens is over "
                                   f"{MAX_DETOKENIZED_BYTES:,} bytes", code="text_too_large",
                                   param="tokens")
        return {"content": b"".join(pieces).decode("utf-8", "replace")}
    raise InvalidInput(f"unknown operation {body.op!r}")


# A prompt is refused unread once even tokens SAFETY times as long as the vocabulary's
# longest could not fit it (a margin over the bound, which is exact only for runs of the
# longest token)
SAFETY = 2


def context_limit(engine, body: P.WorkerJob) -> int:
    """The tokens a job's prompt and answer may take: the worker's context, or less where
    the request's route asks for less."""
    return min(engine.n_ctx, body.route.n_ctx or engine.n_ctx)


def may_drop_extra(gen: P.Generation) -> bool:
    """Whether t_max_prompt_ms may leave the oldest extra chunks out of the prompt
    (warm-ups, n_predict 0 or 1, always fill the cache in full)."""
    return float(gen.t_max_prompt_ms or 0) > 0 and (gen.max_tokens is None or
                                                   gen.max_tokens > 1)


def fewest_tokens(engine, body: P.WorkerJob, limit: int) -> int:
    """At least how many tokens the job's prompt makes: its token ids, and the characters
    of its text (with a suffix, the suffix and the middle too; the extra chunks where
    they may not be left out) over SAFETY × the vocabulary's longest piece. Only the ids
    where its text could not reach `limit` anyway (the longest piece is read on first
    use) or the vocabulary gives no bound (Engine.longest_piece 0)."""
    prompt = body.prompt
    parts = [prompt] if isinstance(prompt, str) else list(prompt)
    texts = [p for p in parts if isinstance(p, str)]
    ids = len(parts) - len(texts)
    if body.infill:                      # (the rest is cut to fit: fitted_prompt)
        texts, ids = [body.infill.middle], 0
    elif body.suffix is not None:
        texts.append(body.suffix)
    chars = sum(len(t) for t in texts)
    if ids >= limit or ids + chars // SAFETY < limit:
        return ids                       # (past it already, or it could fit: tokenizing tells)
    longest = engine.longest_piece()
    return ids + chars // (SAFETY * longest) if longest else ids


def check_fits(engine, body: P.WorkerJob, template: FimTemplate | None = None) -> None:
    """context_length_exceeded for a prompt that cannot fit, before it is tokenized: a
    megabyte of text takes seconds of the worker's CPU to tokenize, beside the streams.
    The preparing thread asks, where long texts are tokenized (workers.preparation; a
    short one is tokenized on the loop in milliseconds and measured). A FIM job the
    model cannot lay out is left to `infill_tokens` (its own error)."""
    if body.suffix is not None and template is None and engine.fim_tokens is None:
        return
    limit = context_limit(engine, body)
    least = fewest_tokens(engine, body, limit)
    if least >= limit:
        raise InvalidInput(f"This model's maximum context length is {limit} tokens, but "
                           f"the prompt has at least {least} tokens.",
                           code="context_length_exceeded", param="prompt")


def prompt_tokens(engine, prompt, suffix: str | None,
                  template: FimTemplate | None = None, extra: list | None = None,
                  middle: str = "", parse_special: bool = True) -> list[int]:
    """Tokens of a prompt given as text, token ids, or llama.cpp's mix of both.

    BOS is added (when the model wants one) only in front of text that starts the
    prompt; a prompt that starts with token ids is taken exactly as given. With a
    `suffix`, the prompt is the prefix of a fill-in-the-middle request (`infill_tokens`),
    its texts tokenized as text; without, special-token syntax in it is parsed unless
    `parse_special` is false (Mistral's FIM route: code to complete, as with a suffix).
    """
    if suffix is not None:
        return infill_tokens(engine, prompt, suffix, template, extra or [], middle)
    return _tokens(engine, prompt, first_special=True, parse_special=parse_special)


def infill_tokens(engine, prefix, suffix: str, template: FimTemplate | None,
                  extra: list[dict], middle: str) -> list[int]:
    """[extra chunks] [BOS] PRE prefix SUF suffix MID middle, as llama.cpp's /infill lays
    it out (`InfillParts`)."""
    return InfillParts.of(engine, prefix, suffix, template, extra, middle).tokens(engine)


@dataclass
class Fitted:
    """A prompt's tokens, made to fit its context where it is an /infill's."""
    tokens: list[int]
    dropped: int = 0          # the oldest input_extra chunks left out
    cut: bool = False         # ... and the prefix's start or the suffix's end
    parts: "InfillParts | None" = None   # an /infill's, to leave out more chunks


@dataclass
class InfillParts:
    """An infill prompt's parts as tokens, as llama.cpp's format_infill makes them: with
    the vocabulary's FIM_REP the prompt opens with `FIM_REP myproject`; with its FIM_SEP
    each extra chunk is `FIM_SEP filename text` and `FIM_SEP filename` follows them (a
    repository), otherwise each is preceded by a snippet separator. On /infill
    (`framed`) the opening and the closing are there with no chunks too, as llama-server
    has them; a `suffix` on the other routes without chunks is the plain layout. A FIM
    template (the
    server's, for this model) takes the place of the FIM tokens. The code (prefix,
    suffix, chunks, file names) is text: `<|fim_middle|>` or `<eos>` in a file stays
    those characters, never a control token that would end or rearrange the layout
    (llama.cpp's format_infill, parse_special false); /infill's `prompt` (`middle`) is
    parsed, as llama.cpp parses it."""
    template: FimTemplate | None
    chunks: list[list[int]]   # each extra chunk with what precedes it, oldest first
    opening: list[int]        # FIM_REP project (where the vocabulary has FIM_REP)
    closing: list[int]        # FIM_SEP filename after the chunks (where it has FIM_SEP)
    prefix: list[int]
    suffix: list[int]
    middle: list[int]

    precut: bool = False      # the prefix's start or the suffix's end cut before tokenizing
    unread: int = 0           # the oldest chunks, never tokenized: they could not stay
    bare: int | None = None   # tokens without any chunk (`length`, once known)
    framed: bool = False      # the opening and closing even without chunks (/infill)

    @classmethod
    def of(cls, engine, prefix, suffix: str, template: FimTemplate | None,
           extra: list[dict], middle: str, max_chars: int = 0,
           budget: int = 0, framed: bool = False) -> "InfillParts":
        """`max_chars` (0: none): the prefix's last and the suffix's first so many
        characters only, where more could never fit (a megabyte of prefix is not
        tokenized to keep its last few thousand tokens). `budget` (0: none): the tokens
        the prompt may have; the chunks are read newest first, and the older ones past
        what could stay beside them (over `budget` tokens, or `max_chars` characters
        with them) are not tokenized at all (`unread`)."""
        precut = False
        if max_chars and isinstance(prefix, list) and len(prefix) == 1 and \
                isinstance(prefix[0], str):
            prefix = prefix[0]
        if max_chars and isinstance(prefix, str) and len(prefix) > max_chars:
            prefix, precut = prefix[-max_chars:], True
        if max_chars and len(suffix) > max_chars:
            suffix, precut = suffix[:max_chars], True
        if template is None and engine.fim_tokens is None:
            raise InvalidInput("this model has no fill-in-the-middle tokens (fim_pre, "
                               "fim_suf, fim_mid in its GGUF metadata) and no "
                               "--fim-template, so 'suffix' cannot be used",
                               code="fim_unsupported", param="suffix")
        text = lambda t: engine.tokenize(t, add_special=False, parse_special=False)  # noqa: E731
        rep, sep = (engine.fim_repo or (None, None)) if template is None else (None, None)
        chunks: list[list[int]] = []
        tokens = chars = 0
        for c in reversed(extra):             # the newest first: the oldest go first
            chars += chunk_chars(c, named=sep is not None)
            if budget and (tokens > budget or (max_chars and chars > max_chars)):
                break
            name = c.get("filename")          # (llama.cpp's: "tmp" where none is given)
            chunk = ([sep] + text((name if isinstance(name, str) else "tmp") + "\n")
                     if sep is not None else text(CHUNK_SEPARATOR)) \
                + text(str(c.get("text") or ""))
            tokens += len(chunk)
            chunks.append(chunk)
        unread = len(extra) - len(chunks)
        return cls(template, [[]] * unread + chunks[::-1],
                   [rep] + text("myproject\n") if rep is not None else [],
                   [sep] + text("filename\n") if sep is not None else [],
                   _tokens(engine, prefix, first_special=False, parse_special=False),
                   text(suffix),
                   engine.tokenize(middle, add_special=False) if middle else [], precut,
                   unread, framed=framed)

    def tokens(self, engine, dropped: int = 0) -> list[int]:
        """The prompt, the oldest `dropped` chunks left out (the unread ones always)."""
        kept = self.chunks[max(dropped, self.unread):]
        out = self.opening + [t for chunk in kept for t in chunk] + self.closing \
            if kept or self.framed else []
        if self.template is not None:
            body = self.template.tokens(engine, self.prefix, self.suffix)
        else:
            pre, suf, mid = engine.fim_tokens
            body = [pre] + self.prefix + [suf] + self.suffix + [mid]
        return out + engine.bos() + body + self.middle

    def length(self, engine, dropped: int = 0) -> int:
        """len(self.tokens(engine, dropped)), without making them (t_max_prompt_ms asks
        for every number of chunks left out)."""
        if self.bare is None:
            self.bare = len(self.tokens(engine, len(self.chunks)))
        kept = self.chunks[max(dropped, self.unread):]
        frame = 0 if self.framed else len(self.opening) + len(self.closing)
        return self.bare + (frame + sum(map(len, kept)) if kept else 0)

    def fit(self, engine, budget: int) -> Fitted:
        """At most `budget` tokens, as llama.cpp's /infill makes its prompt fit: the
        oldest chunks left out first, then the prefix's start and the suffix's end (the
        text nearest the cursor kept: the suffix a quarter of the room, the prefix the
        rest, either more where the other is shorter).
        Where even the rest is too long, as it is (the caller refuses it)."""
        tokens = self.tokens(engine, self.unread)
        total, dropped = len(tokens), self.unread
        while total > budget and dropped < len(self.chunks):
            total -= len(self.chunks[dropped])
            dropped += 1
            if dropped == len(self.chunks) and not self.framed:
                total -= len(self.opening) + len(self.closing)     # (framed: it stays)
        if total <= budget:
            return Fitted(self.tokens(engine, dropped) if dropped != self.unread else tokens,
                          dropped, self.precut, self)
        room = len(self.prefix) + len(self.suffix) - (total - budget)
        if room <= 0:
            return Fitted(self.tokens(engine, dropped), dropped, self.precut, self)
        suffix = min(len(self.suffix), max(room // 4, room - len(self.prefix)))
        prefix = room - suffix
        frame = (self.opening, self.closing) if self.framed else ([], [])
        cut = InfillParts(self.template, [], *frame, self.prefix[len(self.prefix) - prefix:],
                          self.suffix[:suffix], self.middle, framed=self.framed)
        return Fitted(cut.tokens(engine), dropped, cut=True)


def chunk_chars(chunk: dict, named: bool = True) -> int:
    """Characters an `input_extra` chunk brings to be tokenized: its text and, where the
    model names each chunk's file (FIM_SEP: `named`), its file name (a name of a megabyte
    was left out of every count and tokenized on the loop)."""
    name = chunk.get("filename") if named else None
    return len(str(chunk.get("text") or "")) + (len(name) if isinstance(name, str) else 0)


def generation_room(max_tokens: int | None, n_ctx: int) -> int:
    """What an /infill's prompt leaves of its context for the answer when it must be
    made to fit: its max_tokens, at most a quarter of the context (none asked: a
    quarter), at least one."""
    quarter = max(1, n_ctx // 4)
    return max(1, min(max_tokens, quarter)) if max_tokens is not None and max_tokens >= 0 \
        else quarter


def fitted_prompt(engine, body: P.WorkerJob, template: FimTemplate | None,
                  extra: list[dict]) -> Fitted:
    """A job's prompt tokens; an /infill's (`body.infill`) made to fit its context with
    room for the answer (`InfillParts.fit`), as llama-server does for llama.vim's ring
    of chunks: it grows until it is larger than the context."""
    with tenant_of(engine, body):
        return _fitted_prompt(engine, body, template, extra)


def _fitted_prompt(engine, body: P.WorkerJob, template: FimTemplate | None,
                   extra: list[dict]) -> Fitted:
    middle = body.infill.middle if body.infill else ""
    if body.infill is None:
        return Fitted(prompt_tokens(engine, body.prompt, body.suffix, template, extra,
                                    middle, body.generation.parse_special is not False))
    limit = context_limit(engine, body)
    budget = limit - generation_room(body.generation.max_tokens, limit)
    if budget < 1:                  # (0 read as no bound would tokenize every chunk)
        raise InvalidInput(f"A context of {limit} tokens leaves no room for a prompt "
                           "beside the answer.", code="context_length_exceeded",
                           param="prompt")
    # a token is at most the longest piece's bytes, so the prefix's last (and the
    # suffix's first) budget × that many characters hold every token that could stay
    longest = engine.longest_piece() if len(str(body.prompt)) + len(body.suffix or "") + \
        sum(chunk_chars(c) for c in extra) > budget * SAFETY else 0
    parts = InfillParts.of(engine, body.prompt, body.suffix or "", template, extra, middle,
                           max_chars=budget * longest, budget=budget, framed=True)
    return parts.fit(engine, budget)


def _tokens(engine, prompt, first_special: bool, parse_special: bool = True) -> list[int]:
    if isinstance(prompt, str):
        return engine.tokenize(prompt, first_special, parse_special)
    tokens: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            tokens += engine.tokenize(part, first_special and i == 0, parse_special)
        else:
            tokens.append(int(part))
    return tokens


def prompt_text(engine, prompt, tokens: list[int]) -> str:
    """What `echo` shows: the prompt as sent, or its tokens' text."""
    if isinstance(prompt, str):
        return prompt
    return b"".join(engine.piece(t) for t in tokens).decode("utf-8", "replace")
