"""A model's vocabulary, held by `LlamaEngine`: tokenizing, pieces, token checks, JSON
schemas as grammars.

It calls llama.cpp through the `llama_cpp` module the engine hands over, so that nothing
imports llama-cpp-python before the worker is pinned.
"""
from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager

from dispatcher.common.tenantlru import TenantLRU
from workers.errors import EngineError, InvalidInput


# Long texts whose tokens are kept: the n choices of one request each bring the same
# prompt, and a rejected copy (over the context) must not cost a full tokenization each.
LONG_TEXT = 4096
KEPT_TOKENIZATIONS = 4


class Vocabulary:
    """A model's vocabulary through llama.cpp: the engine's tokenizer (`engine.vocabulary`),
    also used from the /tokenize thread beside the generation loop."""

    def __init__(self, lib, vocab, n_vocab: int, add_bos: bool):
        self.lib, self.vocab, self.n_vocab, self.add_bos = lib, vocab, n_vocab, add_bos
        self._kept_tokens = TenantLRU(KEPT_TOKENIZATIONS)   # the last long texts' tokens
        self._tenant = threading.local()                    # whose texts this thread's are
        self._piece_local = threading.local()               # a piece buffer per thread
        self._longest: int | None = None                    # longest_piece, once read

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        """Text verbatim, special-token syntax parsed (unless `parse_special` is false:
        /tokenize's option); BOS added if asked and the model wants one."""
        if len(text) < LONG_TEXT:
            return self._tokenize(text, add_special, parse_special)
        kept = self._kept_tokens
        # (a tenant's own: a kept text of another key's answered sooner, an oracle of
        # its prompts through /tokenize or a refusal's time)
        tenant, key = getattr(self._tenant, "name", None), (text, add_special, parse_special)
        tokens = kept.get(tenant, key)
        if tokens is not None:
            return list(tokens)
        tokens = self._tokenize(text, add_special, parse_special)
        kept.put(tenant, key, tokens)
        return list(tokens)

    @contextmanager
    def tenant(self, name: str | None):
        """This thread's tokenizations within are `name`'s (the job's tenant): the long
        texts kept are reused by the same tenant only."""
        before = getattr(self._tenant, "name", None)
        self._tenant.name = name
        try:
            yield
        finally:
            self._tenant.name = before

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 8
        buf = (self.lib.llama_token * size)()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, size, add_special,
                                     parse_special)
        if n < 0:
            size = -n
            buf = (self.lib.llama_token * size)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, size, add_special,
                                         parse_special)
        if n < 0:
            raise EngineError("tokenization failed")
        return list(buf[:n])

    def bos(self) -> list[int]:
        return [self.lib.llama_vocab_bos(self.vocab)] if self.add_bos else []

    def piece(self, token: int, special: bool = False) -> bytes:
        """The exact bytes of one token (may be part of a UTF-8 character); a control
        token's text only with `special` (/tokenize's pieces, /detokenize: as
        llama-server gives them), never in generated text."""
        local = self._piece_local
        buf = getattr(local, "buf", None)
        if buf is None:                   # one buffer a thread: /tokenize has its own
            buf = local.buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:max(n, 0)]

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def longest_piece(self) -> int:
        """At least the most bytes one token's text has (a control token's included): a
        text of C characters makes at least C / this many tokens, each character of the
        input being at least one byte of the pieces it becomes. Read as the longest of
        the tokens' stored texts, which are never shorter than their pieces (SPM's `▁`
        for a space, byte tokens' `<0x0A>`, byte-level BPE's mapped bytes). 0 where the
        vocabulary gives no such bound: its kind normalizes text away (WPM and UGM drop
        whitespace and join unknown words) or a token strips the whitespace beside it
        (LSTRIP, RSTRIP). Read the first time it is asked (~0.3 s), then kept."""
        if self._longest is None:           # (two threads asking at once read it twice)
            lib, vocab, tokens = self.lib, self.vocab, range(self.n_vocab)
            strips = lib.LLAMA_TOKEN_ATTR_LSTRIP | lib.LLAMA_TOKEN_ATTR_RSTRIP
            bounded = lib.llama_vocab_type(vocab) in (
                lib.LLAMA_VOCAB_TYPE_SPM, lib.LLAMA_VOCAB_TYPE_BPE, lib.LLAMA_VOCAB_TYPE_RWKV)
            if bounded and not any(lib.llama_vocab_get_attr(vocab, t) & strips
                                   for t in tokens):
                self._longest = max(len(lib.llama_vocab_get_text(vocab, t) or b"")
                                    for t in tokens) or 1
            else:
                self._longest = 0
        return self._longest

    def check_tokens(self, tokens: list[int], param: str = "prompt") -> None:
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise InvalidInput(f"token ids {bad[:5]} are outside the vocabulary "
                               f"(0..{self.n_vocab - 1})", param=param)
