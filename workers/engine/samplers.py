"""llama.cpp's sampler chain for one request, built from its `SamplingParams` with the
`llama_cpp` module the engine hands it (so nothing here imports llama.cpp before the worker
is pinned), the shared candidate buffers, and the grammar check before a chain is made."""
from __future__ import annotations

import ctypes
import time

import numpy as np

from dispatcher.common import grammar as gbnf
from dispatcher.common.tenantlru import TenantLRU
from workers.engine.draws import HostDraw, host_drawable
from workers.errors import EngineError, InvalidInput
from workers.sampling import SamplingParams


def check_grammar(grammar: str, n_vocab: int, token_of=None,
                  verdicts: TenantLRU | None = None, ends=None,
                  tenant: str | None = None) -> None:
    """A 400 for a grammar llama.cpp would refuse or could not use (dispatcher.common.grammar).
    `verdicts` keeps the answers for recent texts, each `tenant`'s own: the n choices of
    one request, or an editor's same grammar, are checked once (a text another key had
    sent answered sooner: an oracle of its grammars)."""
    problem = verdicts.get(tenant, grammar, False) if verdicts is not None else False
    if problem is False:
        try:
            # (its stacks' growth was probed by the front end, before any job carried it)
            gbnf.check(grammar, n_vocab, token_of, ends, growth=False)
            problem = None
        except gbnf.GrammarError as exc:
            problem = str(exc)
        if verdicts is not None:
            verdicts.put(tenant, grammar, problem)
    if problem is not None:
        raise InvalidInput(f"the grammar cannot be used: {problem}", param="grammar")


KEPT_VERDICTS = 64
# One token's check against the grammar past this, or growing so fast that the next
# one's would be, ends the request (within the static budgets a check takes microseconds,
# a thousand times less; the stacks of an ambiguous grammar double with each character).
# Timed as this thread's CPU time: a busy host, or another thread holding the GIL (the
# vocabulary's texts being made, alphabet.py), never counts as the grammar's work.
GRAMMAR_CHECK_SECONDS = 0.1


def one_token(lib, vocab, text: str) -> int | None:
    """The id of `text` if it is exactly one token (special-token syntax parsed), as
    llama.cpp's grammar parser requires of a `<text>` reference."""
    data = text.encode("utf-8")
    buf = (lib.llama_token * 2)()
    n = lib.llama_tokenize(vocab, data, len(data), buf, 2, False, True)
    return int(buf[0]) if n == 1 else None


class Candidates:
    """Buffers for a whole-vocabulary `llama_token_data_array` (id, logit, p), reused by
    every slot of an engine, a one-token array for grammar checks, and what the engine's
    chains share (grammar verdicts, the vocabulary's texts, DRY samplers to clone)."""

    def __init__(self, lib, n_vocab: int):
        self.lib, self.n_vocab = lib, n_vocab
        self.data = np.zeros(n_vocab, dtype=np.dtype(
            [("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True))
        assert self.data.dtype.itemsize == ctypes.sizeof(lib.llama_token_data)
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.pointer = self.data.ctypes.data_as(ctypes.POINTER(lib.llama_token_data))
        self.array = lib.llama_token_data_array()
        self.one = (lib.llama_token_data * 1)()
        self.grammar_verdicts = TenantLRU(KEPT_VERDICTS)     # see check_grammar
        self.texts = None          # the vocabulary's TokenTexts (alphabet.py), the engine's
        self.dry = None            # its DryTemplates, the engine's
        self.one_array = lib.llama_token_data_array(
            ctypes.cast(self.one, ctypes.POINTER(lib.llama_token_data)), 1, -1, False)

    def whole(self, logits):
        """The whole vocabulary over `logits` (p = 0, nothing selected)."""
        self.data["id"] = self.ids
        self.data["logit"] = logits
        self.data["p"] = 0.0
        array = self.array
        array.data, array.size, array.selected, array.sorted = \
            self.pointer, self.n_vocab, -1, False
        return ctypes.byref(array)

    def top(self, logits, n: int):
        """The `n` highest of `logits` (unsorted), as a candidate array."""
        return self.subset(logits, np.argpartition(logits, -n)[-n:])

    def subset(self, logits, ids):
        """The tokens `ids` over `logits`, in that order, as a candidate array."""
        n = len(ids)
        data = self.data[:n]
        data["id"] = ids
        data["logit"] = logits[ids]
        data["p"] = 0.0
        array = self.array
        array.data, array.size, array.selected, array.sorted = self.pointer, n, -1, False
        return ctypes.byref(array)

    def single(self, token: int):
        one = self.one_array
        one.data[0].id, one.data[0].logit, one.data[0].p = token, 1.0, 0.0
        one.size, one.selected, one.sorted = 1, -1, False
        return ctypes.byref(one)


# The temperature Mirostat gets at least (a positive one below it: near-greedy, as asked)
MIROSTAT_MIN_TEMPERATURE = 1e-4

# Candidates a refused pick is first sought among (see SamplerChain._refused_pick).
TOP_CANDIDATES = 256


# Draws again before applying a grammar to the whole vocabulary (see plain_draw): through
# the chain, or at once here where the chain is a temperature alone.
REDRAWS = 3
DRAWS = 32


def plain_draw(p: SamplingParams) -> bool:
    """Whether the chain draws from the whole distribution, each token's chance its own
    (penalties, biases and DRY change a token's logit by its own history, temperature
    scales all alike), with no cut that depends on which tokens it is given (top-k, -p,
    min-p, typical, XTC, top-n-sigma, dynamic temperature, Mirostat): then a draw the
    grammar allows, drawn again until one is, is exactly a draw from the allowed tokens
    (llama.cpp's default chain with this server's OpenAI defaults is one)."""
    if p.greedy or p.mirostat or p.dynatemp_range > 0:
        return False
    cuts = {"top_n_sigma": p.top_n_sigma >= 0, "top_k": p.top_k > 0,
            "typ_p": p.typical_p < 1.0, "top_p": p.top_p < 1.0, "min_p": p.min_p > 0.0,
            "xtc": p.xtc_probability > 0.0, "infill": True}
    return not any(cuts.get(name, False) for name in p.order)


def top_first(p: SamplingParams, bare_greedy: bool) -> int:
    """How many of the most likely tokens the chain keeps before anything else looks at
    the distribution: 1 for a bare greedy chain, K when its first active sampler is
    top-k (K <= TOP_CANDIDATES); 0 when the pick depends on more (penalties, biases or
    DRY change the order first, top-p or typical-p weigh the whole distribution,
    Mirostat estimates from it)."""
    if bare_greedy:
        return 1
    if p.greedy or p.mirostat or p.penalized or p.logit_bias or p.dry_multiplier:
        return 0
    if "infill" in p.order:     # (it may answer an end token none of its candidates is)
        return 0
    for name in p.order:
        if name == "top_k" and p.top_k > 0:
            return p.top_k if p.top_k <= TOP_CANDIDATES else 0
        active = {"top_n_sigma": p.top_n_sigma >= 0, "typ_p": p.typical_p < 1.0,
                  "top_p": p.top_p < 1.0, "min_p": p.min_p > 0.0,
                  "xtc": p.xtc_probability > 0.0, "temperature": True,
                  "infill": True}.get(name, False)
        if active:
            return 0
    return 0


# the engine's ban on the end tokens (reading.BANNED, -1e30: finite, so a grammar that can
# only end there still may) as the logits row shows it
ENDS_BANNED_BELOW = -1e29


class SamplerChain:
    """One sequence's samplers, built from its `SamplingParams`: penalties → logit bias →
    greedy | mirostat | top-k, typical, top-p, min-p, temperature, dist (llama.cpp's common
    sampler order), and the grammar sampler kept out of the chain.

    `lib` is llama-cpp-python's module, handed over by the engine (the one importer of
    llama_cpp, after the worker is pinned). The grammar is checked against the token the
    chain picks and applied to the whole vocabulary only when it rejects that token, as
    llama.cpp's own `common_sampler_sample` does: the output is exactly what the grammar
    allows, and a grammar stream costs about what a plain one does while the model follows
    it by itself (applying it to all candidates every step made a plain stream beside it
    5× slower). A token the grammar rejects is never accepted into it (that throws inside
    llama.cpp).
    """

    def __init__(self, lib, vocab, n_vocab: int, n_ctx: int, p: SamplingParams,
                 candidates: Candidates, tenant: str | None = None):
        # (`tenant`: whose the work kept for later chains is, the grammar's mask and check
        # and the DRY scan: another key's kept work answers no key sooner)
        self.lib, self.candidates, self.tenant = lib, candidates, tenant
        self.grammar = None
        bare_greedy = p.greedy and not p.penalized and not p.logit_bias and \
            not p.dry_multiplier
        self.plain_greedy = bare_greedy and p.grammar is None   # argmax is the whole chain
        self.bare_greedy = bare_greedy                  # ... apart from a grammar
        self.top_first = top_first(p, bare_greedy)      # see sample
        self.redraws = REDRAWS if plain_draw(p) else 0
        # the chain's cuts and draw made over the logits row (draws.py), where they can be
        self.host = HostDraw(p) if host_drawable(p) else None
        # ... and where the chain is a temperature alone, the draws are made here at once
        self.temperature = None
        if self.redraws and not (p.penalized or p.logit_bias or p.dry_multiplier):
            self.temperature = p.temperature if "temperature" in p.order else 1.0
            self.rng = np.random.default_rng(None if p.seed is None else p.seed32)
        # the tokens the grammar could ever accept, where that is a useful cut (a grammar
        # the model fights: alphabet.py): drawn from and checked alone, the same outcome
        self.allowed = None
        self.biased = bool(p.logit_bias)    # (see _refused_pick: llama.cpp's bias by index)
        # the tokens logit_bias bans (-100, false: -inf), kept out of the argmaxes made
        # over rows the chain's bias never saw (the infill sampler's ways out, below)
        self.banned = np.array([t for t, b in p.logit_bias.items() if b == float("-inf")],
                               dtype=np.int64)
        # llama.cpp's `infill` sampler answers an end token when no other is likely
        # enough, whatever it was given (banned ends too): see _refused_pick, ends_ok
        self.infill = "infill" in p.order
        if p.grammar is not None and candidates.texts is not None:
            try:
                self.allowed = candidates.texts.allowed_ids(p.grammar, tenant)
            except gbnf.GrammarError:
                pass                     # (llama.cpp's parse below says so, if it does)
        self.check_seconds = 0.0                        # the last token's stack work
        self.stack_seconds = 0.0                        # ... this token's, so far
        # the samplers that remember the last tokens (penalties, DRY), with how many
        self.penalty_memory = self.dry_memory = None
        self.prompt_seen = False
        samplers: list = []
        self.chain = None
        try:
            self._build(lib, vocab, n_vocab, n_ctx, p, samplers)
            if not all(samplers):
                raise EngineError("llama.cpp could not create a sampler")
            self.chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
            if not self.chain:
                raise EngineError("llama.cpp could not create a sampler chain")
        except BaseException:         # nothing half-built is left behind
            self._free_all([sampler for sampler in samplers if sampler])
            if self.grammar:
                lib.llama_sampler_free(self.grammar)
                self.grammar = None
            raise
        for sampler in samplers:
            lib.llama_sampler_chain_add(self.chain, sampler)   # the chain owns it now

    def _build(self, lib, vocab, n_vocab: int, n_ctx: int, p: SamplingParams,
               samplers: list) -> None:
        """Create the grammar sampler and the chain's samplers (appended to `samplers`)."""
        if p.logit_bias:
            bad = [t for t in p.logit_bias if not 0 <= t < n_vocab]
            if bad:
                raise InvalidInput(f"token ids {bad[:5]} are outside the vocabulary "
                                   f"(0..{n_vocab - 1})", param="logit_bias")
            biases = (lib.llama_logit_bias * len(p.logit_bias))(
                *[lib.llama_logit_bias(t, b) for t, b in p.logit_bias.items()])
            samplers.append(lib.llama_sampler_init_logit_bias(
                n_vocab, len(p.logit_bias), biases))
        if p.grammar is not None:
            if "<" in p.grammar:
                # token references (`<[id]>`, `<text>`) are checked against this vocabulary
                # (the front end checked the rest), so llama.cpp never logs a refusal
                check_grammar(p.grammar, n_vocab, lambda text: one_token(lib, vocab, text),
                              self.candidates.grammar_verdicts,
                              lambda token: bool(lib.llama_vocab_is_eog(vocab, token)),
                              self.tenant)
            self.grammar = lib.llama_sampler_init_grammar(vocab, p.grammar.encode(), b"root")
            if not self.grammar:
                raise InvalidInput("the grammar does not parse (GBNF with a 'root' rule)",
                                   param="grammar")
        # llama.cpp's common sampler: the listed samplers in order (each only when its
        # settings turn it on), then greedy, Mirostat, or temperature and a seeded draw.
        # Windows are ring buffers: never more than a sequence can hold.
        window = lambda n: n_ctx if n < 0 else min(n, n_ctx)     # noqa: E731
        for name in p.order:
            if name == "penalties" and p.penalized:
                samplers.append(lib.llama_sampler_init_penalties(
                    n_vocab, window(p.repeat_last_n), p.repetition_penalty,
                    p.frequency_penalty, p.presence_penalty))
                self.penalty_memory = (samplers[-1], window(p.repeat_last_n))
            elif name == "dry" and p.dry_multiplier > 0:
                samplers.append(self.candidates.dry.sampler(
                    p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                    window(p.dry_penalty_last_n), tuple(p.dry_sequence_breakers),
                    self.tenant))
                self.dry_memory = (samplers[-1], window(p.dry_penalty_last_n))
            elif p.greedy or p.mirostat:
                continue                          # truncation: none before these
            elif name == "top_n_sigma" and p.top_n_sigma >= 0:
                samplers.append(lib.llama_sampler_init_top_n_sigma(p.top_n_sigma))
            elif name == "top_k" and p.top_k > 0:
                samplers.append(lib.llama_sampler_init_top_k(p.top_k))
            elif name == "typ_p" and p.typical_p < 1.0:
                samplers.append(lib.llama_sampler_init_typical(p.typical_p, 1))
            elif name == "top_p" and p.top_p < 1.0:
                samplers.append(lib.llama_sampler_init_top_p(p.top_p, 1))
            elif name == "min_p" and p.min_p > 0.0:
                samplers.append(lib.llama_sampler_init_min_p(p.min_p, 1))
            elif name == "xtc" and p.xtc_probability > 0.0:
                samplers.append(lib.llama_sampler_init_xtc(
                    p.xtc_probability, p.xtc_threshold, 1, p.seed32))
            elif name == "temperature":
                samplers.append(lib.llama_sampler_init_temp_ext(
                    p.temperature, p.dynatemp_range, p.dynatemp_exponent)
                    if p.dynatemp_range > 0 else lib.llama_sampler_init_temp(p.temperature))
            elif name == "infill":
                samplers.append(lib.llama_sampler_init_infill(vocab))
        if p.greedy:
            samplers.append(lib.llama_sampler_init_greedy())
        elif p.mirostat:
            # (below MIROSTAT_MIN_TEMPERATURE llama.cpp's Mirostat drew nonsense: at 1e-9,
            # "option overloading promoc"; at 1e-6 the greedy text, as asked)
            samplers.append(lib.llama_sampler_init_temp(
                max(p.temperature, MIROSTAT_MIN_TEMPERATURE)))
            if p.mirostat == 1:
                samplers.append(lib.llama_sampler_init_mirostat(
                    n_vocab, p.seed32, p.mirostat_tau, p.mirostat_eta, 100))
            else:
                samplers.append(lib.llama_sampler_init_mirostat_v2(
                    p.seed32, p.mirostat_tau, p.mirostat_eta))
        else:                # (a `samplers` list without temperature: as llama.cpp, none)
            samplers.append(lib.llama_sampler_init_dist(p.seed32))

    def accept_prompt(self, tokens: list[int], penalties: bool = False) -> None:
        """The prompt's last tokens, once, into DRY (the sequences of the context a
        continuation would repeat: it saw only the output's) and, with `penalties`, into
        the penalties (llama-server's: its slots take the whole prompt into their
        samplers before the first token; OpenAI's penalties count the output alone).
        The grammar takes none: it reads the output alone."""
        if self.prompt_seen or self.chain is None:
            return
        self.prompt_seen = True
        accept = self.lib.llama_sampler_accept
        for kept in (self.dry_memory, self.penalty_memory if penalties else None):
            if kept is not None:
                sampler, window = kept
                for token in tokens[-window:] if window > 0 else ():
                    accept(sampler, token)

    def _free_all(self, samplers) -> None:
        for sampler in samplers:
            self.lib.llama_sampler_free(sampler)

    @property
    def wants_logits(self) -> bool:
        """Whether `sample` needs the logits row as an array (else it reads the context)."""
        return self.plain_greedy or self.grammar is not None or self.host is not None

    def sample(self, ctx, row: int, logits) -> int:
        """The next token from batch row `row` (`logits`: that row, possibly with banned
        tokens, when `wants_logits`), accepted into the samplers' state."""
        if self.plain_greedy:
            # argmax is all a bare greedy chain does; numpy skips copying 262k candidates
            return int(logits.argmax())
        if self.host is not None:      # (its samplers keep no state: nothing to accept)
            return self.host.draw(logits)
        if self.grammar is None:
            return self.lib.llama_sampler_sample(self.chain, ctx, row)   # accepts too
        lib, candidates = self.lib, self.candidates
        if self.bare_greedy:          # the chain is an argmax: no candidate array needed
            token = int(logits.argmax())
        elif self.temperature is not None and self.allowed is not None:
            token = -1                # drawn at once from the grammar's tokens alone
        else:
            token = self._pick(candidates.whole(logits))
        if token < 0 or not self._fine(token, logits):
            token = self._refused_pick(logits)
        started = time.thread_time()
        lib.llama_sampler_accept(self.grammar, token)
        self._check_cost(self.stack_seconds + time.thread_time() - started,
                         lambda: self._timed_check(token))
        self.stack_seconds = 0.0
        lib.llama_sampler_accept(self.chain, token)
        return token

    def _refused_pick(self, logits) -> int:
        """The pick once the grammar refused the chain's: over the TOP_CANDIDATES most
        likely tokens when that gives what the whole vocabulary would (the chain starts
        by keeping the `top_first` best, and that many of them pass the grammar: every
        token outside them was less likely than each), else over the whole vocabulary.
        A grammar the model fights (prose with no letter e) refuses the pick at most
        tokens, and llama.cpp tests every candidate's text against every parse stack."""
        lib, candidates, ids = self.lib, self.candidates, self.allowed
        if self.temperature is not None:
            z = (logits if ids is None else logits[ids]).astype(np.float64) / self.temperature
            weights = np.exp(z - z.max())
            cdf = np.cumsum(weights)
            draws = np.searchsorted(cdf, self.rng.random(DRAWS) * cdf[-1], side="right")
            for token in np.minimum(draws, len(cdf) - 1):
                token = int(token if ids is None else ids[token])
                if self._fine(token, logits):
                    return token
        for _ in range(self.redraws if self.temperature is None else 0):
            # a draw from the whole distribution (no cut that depends on which tokens
            # are in it): one the grammar allows is a draw from the allowed ones alone
            token = self._pick(candidates.whole(logits))
            if self._fine(token, logits):
                return token
        n = TOP_CANDIDATES if self.top_first else 0
        if 0 < n < candidates.n_vocab:
            array = candidates.top(logits, n)
            lib.llama_sampler_apply(self.grammar, array)
            kept = candidates.data["logit"][:n]
            if int(np.isfinite(kept).sum()) >= self.top_first:
                if self.bare_greedy:
                    return int(candidates.data["id"][int(kept.argmax())])
                return self._pick(array)
        # every token outside the grammar's alphabet would be refused: left out
        array = candidates.whole(logits) if ids is None else candidates.subset(logits, ids)
        lib.llama_sampler_apply(self.grammar, array)
        size = candidates.array.size
        allowed = candidates.data["logit"][:size]
        likeliest = None                    # (the infill sampler's way out, below)
        if self.infill and size:
            unbanned = allowed
            if self.banned.size:
                unbanned = np.where(np.isin(candidates.data["id"][:size], self.banned),
                                    -np.inf, allowed)
            best = int(unbanned.argmax())
            if np.isfinite(unbanned[best]):
                likeliest = int(candidates.data["id"][best])
        if ids is not None and self.biased:
            # llama.cpp's logit bias finds a token by its index where the array is the
            # whole vocabulary in order, else searches the array for each bias (an
            # alphabet of 183,221 tokens and 8,000 biases: 0.3 s a token, every stream
            # of the worker waiting): the chain goes over the whole vocabulary, the
            # grammar's verdict on its alphabet kept and every other token refused
            masked = np.full(candidates.n_vocab, -np.inf, dtype=np.float32)
            masked[candidates.data["id"][:size]] = allowed
            array = candidates.whole(masked)
        token = self._pick(array)
        chosen = candidates.array
        if chosen.data[chosen.selected].logit == float("-inf"):
            # every token the grammar left is banned (logit_bias false): the chain's pick
            # among them all at -inf was a banned token, emitted
            raise InvalidInput("the grammar allows no token here but ones logit_bias bans",
                               param="logit_bias")     # (the request's own: a 400)
        if not self._fine(token, logits):
            # llama.cpp's `infill` sampler answers an end token when no other is likely
            # enough, whatever the grammar left (accepted, it aborts the process): the
            # likeliest token the grammar allows instead
            if likeliest is not None and self._allows(likeliest):
                return likeliest
            raise EngineError("the grammar allows no token here")
        return token

    def _fine(self, token: int, logits) -> bool:
        """Whether the grammar allows `token` and it is not an end token the infill
        sampler answered though the ends are banned (ignore_eos, min_tokens: a grammar
        that may end there, but need not, ended the request); where the grammar can
        only end, _refused_pick's likeliest allowed token is that end."""
        if self.infill and logits[token] < ENDS_BANNED_BELOW:
            return False
        return self._allows(token)

    def ends_ok(self, token: int, logits, is_eog) -> int:
        """The token drawn with the end tokens banned (`logits`: that row, banned): one
        the `infill` sampler put in their place gives way to the likeliest other token
        (a request that may not end yet, ignore_eos or min_tokens, ended); a grammar's
        chain has its own way (_refused_pick)."""
        if self.infill and self.grammar is None and is_eog(token):
            if self.banned.size:                # (nor a token logit_bias bans)
                logits = logits.copy()
                logits[self.banned] = -np.inf
            return int(np.argmax(logits))
        return token

    def _allows(self, token: int) -> bool:
        one = self.candidates.single(token)
        started = time.thread_time()
        self.lib.llama_sampler_apply(self.grammar, one)
        self.stack_seconds += time.thread_time() - started
        return self.candidates.one[0].logit != float("-inf")

    def _check_cost(self, spent: float, probe) -> None:
        """Checking and accepting one token (`spent`) cost llama.cpp the advance of every
        parse stack, whatever the vocabulary: microseconds for a grammar within the
        static budgets. Parse stacks that multiply as the text goes on (an ambiguous
        recursive grammar: `r ::= "aaaaaaa" r "b" | "aaaaaaa" r "c"` doubles them at
        every seven a's, too slowly for `grammar_growth.check_growth` to see before it
        runs), make it grow token after token: the request ends
        once a check passes GRAMMAR_CHECK_SECONDS, or grows so fast that the next one
        would. A dear check after a cheap one (a slow moment: a preempted CPU, a page
        fault; or stacks that jumped within one long token) is told apart by `probe()`,
        one more check at the new state, which costs what its stacks cost: cheap, it was
        the moment (unless past four times the limit); dear, the rule above holds."""
        limit = GRAMMAR_CHECK_SECONDS
        before, self.check_seconds = self.check_seconds, spent
        if spent <= limit / 8:
            return
        if spent <= 4 * limit and before <= limit / 64:
            again = probe()
            if again <= limit / 64:
                self.check_seconds = again          # a slow moment, not the grammar
                return
        growth = spent / before if before > 0 else 1.0
        if spent <= limit and spent * growth <= limit:
            return                                  # dear, but not growing past it
        raise InvalidInput(f"checking one token against the grammar took {spent:.2f} s "
                           f"(at most {limit:g} s here): its parse stacks multiply as "
                           "the text goes on (alternatives that begin alike and nest)",
                           code="grammar_too_costly", param="grammar")

    def _timed_check(self, token: int) -> float:
        """Seconds (this thread's CPU) of one check of `token` at the grammar's state."""
        started = time.thread_time()
        self._allows(token)
        return time.thread_time() - started

    @property
    def drawn_by_llama(self) -> bool:
        """Whether `sample` is llama.cpp's own draw over the context's row (no argmax, host
        draw or grammar): what `sample_row` does over a copy of it, on any thread."""
        return not self.plain_greedy and self.host is None and self.grammar is None

    def sample_row(self, logits, candidates: "Candidates") -> int:
        """`llama_sampler_sample` over a copy of the row (`logits`) in `candidates` (the
        caller's buffer): the chain applied to the whole vocabulary, its pick accepted."""
        lib = self.lib
        lib.llama_sampler_apply(self.chain, candidates.whole(logits))
        array = candidates.array
        if not 0 <= array.selected < array.size:
            raise EngineError("the sampler chain selected no token")
        token = int(array.data[array.selected].id)
        lib.llama_sampler_accept(self.chain, token)
        return token

    def _pick(self, array_ref) -> int:
        self.lib.llama_sampler_apply(self.chain, array_ref)
        array = self.candidates.array
        if not 0 <= array.selected < array.size:
            raise EngineError("the sampler chain selected no token")
        return int(array.data[array.selected].id)

    def free(self) -> None:
        self.lib.llama_sampler_free(self.chain)
        if self.grammar is not None:
            self.lib.llama_sampler_free(self.grammar)
            self.grammar = None
