"""GBNF grammars checked before llama.cpp sees them: the same syntax as its parser
(llama-grammar.cpp, llama-cpp-python 0.3.36), and bounds on what it would build.

llama.cpp parses a grammar into rules of elements, expanding every repetition into
copies (`"a…"{2000}` copies the whole literal 2000 times: a 50 KB grammar became 1.6 GB),
then walks the leftmost rule references recursively to detect left recursion (a chain of
75,000 `r{i} ::= r{i+1}` rules overflowed the worker's stack). Its parser also prints a
grammar it rejects, whole, to the worker's log. `check` builds the same rules within
budgets and answers with a message instead: a grammar it accepts, llama.cpp parses, and
one llama.cpp would reject is refused here, before any worker is involved
(tests/test_grammar.py checks both against llama.cpp itself).

Stricter than llama.cpp, on purpose: NUL characters (llama.cpp stops reading there),
code points above U+10FFFF, empty character ranges such as `[\\U0010FFFF-\\x00]` (they can
never match: generation would fail midway), and the size limits below. The rules it
builds are `grammar_rules`' (with the errors); what they would cost llama.cpp (its
left-recursion check, its parse stacks) is checked by `grammar_cost`.
"""
from __future__ import annotations

from typing import Callable

from dispatcher.common.grammar_cost import (  # noqa: F401  (stack_width, MAX_LEFT_DEPTH:
    MAX_LEFT_DEPTH, check_costs, stack_width)  # the callers use them here)
from dispatcher.common.grammar_growth import check_growth
from dispatcher.common.grammar_rules import (  # noqa: F401  (names the callers use here)
    ALT, CHAR, CHAR_ALT, CHAR_ANY, CHAR_NOT, CHAR_RNG_UPPER, END, RULE_REF, TOKEN,
    TOKEN_NOT, UNBOUNDED, Grammar, GrammarError, GrammarRefused, GrammarTooLarge)

MAX_GRAMMAR_CHARS = 256 * 1024      # the text (JSON-schema grammars run to tens of KB)
MAX_ELEMENTS = 500_000              # what llama.cpp allocates: 8 bytes each, ~16 with copies
MAX_RULES = 32_768                  # rules, those repetitions generate included: the
                                    # checks take ~20 us a rule, and each grammar is
                                    # checked three times (front end; the worker's tokens
                                    # and alphabet): 49 x `"a"{0,2000}` (596 characters,
                                    # 98,001 rules) took 2.7 s a check
MAX_NESTING = 100                   # ( ) groups inside each other (this parser recurses too)
MAX_REPETITION = 2000               # llama.cpp's MAX_REPETITION_THRESHOLD


def _is_word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


class _Parser:
    def __init__(self, src: str):
        self.src = src + "\x00"            # llama.cpp reads a C string
        self.symbols: dict[str, int] = {}
        self.rules: list[list[tuple[int, int]] | None] = []
        self.elements = 0
        self.tokens: list[tuple[int, str]] = []
        self.wanted: list[tuple[int, str]] = []     # ... of those, the ones asked for
        self.nesting = 0

    # -- helpers -------------------------------------------------------------------------
    def fail(self, message: str, pos: int | None = None,
             kind: type = GrammarError) -> GrammarError:
        if pos is None:
            return kind(message)
        line = self.src.count("\n", 0, pos) + 1
        column = pos - (self.src.rfind("\n", 0, pos) + 1) + 1
        near = self.src[pos:pos + 16].split("\n")[0].replace("\x00", "")
        return kind(f"{message} at line {line}, column {column}"
                            + (f" (near {near!r})" if near else " (at the end)"))

    def charge(self, n: int) -> None:
        self.elements += n
        if self.elements > MAX_ELEMENTS:
            raise GrammarTooLarge(f"the grammar expands to more than {MAX_ELEMENTS} "
                                  "elements (repetitions are copies of what they repeat)")

    def symbol_id(self, name: str) -> int:
        return self.symbols.setdefault(name, len(self.symbols))

    def generate_id(self, base: str) -> int:
        next_id = len(self.symbols)
        self.symbols[f"{base}_{next_id}"] = next_id
        if next_id >= MAX_RULES:
            raise GrammarTooLarge(f"the grammar has more than {MAX_RULES} rules, those "
                                  "its repetitions and groups generate included (a "
                                  "repetition {m,n} makes one rule a count)")
        return next_id

    def add_rule(self, rule_id: int, rule: list) -> None:
        if len(self.rules) <= rule_id:
            self.rules.extend([None] * (rule_id + 1 - len(self.rules)))
        self.rules[rule_id] = rule

    def space(self, pos: int, newline_ok: bool) -> int:
        src = self.src
        while src[pos] in " \t#" or (newline_ok and src[pos] in "\r\n"):
            if src[pos] == "#":
                while src[pos] not in "\x00\r\n":
                    pos += 1
            else:
                pos += 1
        return pos

    def name(self, pos: int) -> int:
        end = pos
        while _is_word(self.src[end]):
            end += 1
        if end == pos:
            raise self.fail("expecting name", pos)
        return end

    def integer(self, pos: int) -> int:
        end = pos
        while "0" <= self.src[end] <= "9":
            end += 1
        if end == pos:
            raise self.fail("expecting integer", pos)
        if end - pos > 20:              # llama.cpp's stoul/stoull refuse it too
            raise self.fail("a number too long", pos)
        return end

    def hex(self, pos: int, size: int) -> tuple[int, int]:
        digits = self.src[pos:pos + size]
        if len(digits) != size or any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise self.fail(f"expecting {size} hex digits", pos)
        return int(digits, 16), pos + size

    def char(self, pos: int) -> tuple[int, int]:
        src = self.src
        if src[pos] == "\\":
            kind = src[pos + 1]
            if kind in "xuU":
                value, end = self.hex(pos + 2, {"x": 2, "u": 4, "U": 8}[kind])
            elif kind in "trn":
                value, end = ord({"t": "\t", "r": "\r", "n": "\n"}[kind]), pos + 2
            elif kind in '\\"[]-':
                value, end = ord(kind), pos + 2
            else:
                raise self.fail("unknown escape", pos)
        elif src[pos] != "\x00":
            value, end = ord(src[pos]), pos + 1
        else:
            raise self.fail("unexpected end of input", pos)
        if value > 0x10FFFF:
            raise self.fail("a character above U+10FFFF (not Unicode)", pos, GrammarRefused)
        return value, end

    def token(self, pos: int) -> tuple[int, int]:
        src = self.src
        if src[pos] != "<":
            raise self.fail("expecting '<'", pos)
        start, pos = pos, pos + 1
        if src[pos] == "[":
            end = self.integer(pos + 1)
            value = int(src[pos + 1:end])
            if value > 0xFFFFFFFF:
                raise self.fail("token id too big", pos + 1)
            if src[end] != "]":
                raise self.fail("expecting ']'", end)
            if src[end + 1] != ">":
                raise self.fail("expecting '>'", end + 1)
            self.tokens.append((value, ""))
            return value, end + 2
        while src[pos] not in "\x00>":
            pos += 1
        if src[pos] != ">":
            raise self.fail("expecting '>'", pos)
        self.tokens.append((-1, src[start:pos + 1]))   # its id: the worker's vocabulary
        return -1, pos + 1

    # -- the grammar ---------------------------------------------------------------------
    def alternates(self, pos: int, rule_name: str, rule_id: int, nested: bool) -> int:
        rule: list[tuple[int, int]] = []
        pos = self.sequence(pos, rule_name, rule, nested)
        while self.src[pos] == "|":
            rule.append((ALT, 0))
            pos = self.space(pos + 1, True)
            pos = self.sequence(pos, rule_name, rule, nested)
        rule.append((END, 0))
        self.charge(len(rule))
        self.add_rule(rule_id, rule)
        return pos

    def sequence(self, pos: int, rule_name: str, rule: list, nested: bool) -> int:
        """One alternative: its items appended to `rule` (a repetition operator repeats
        the item before it), as llama.cpp's parse_sequence."""
        src = self.src
        last_start = len(rule)      # where the last item starts in `rule`
        prev_rules = 1              # the rules that item made (a repetition multiplies them)
        while True:
            c = src[pos]
            if c in '"[<!.(' or _is_word(c):
                last_start, prev_rules = len(rule), 1
                if c == '"':
                    pos = self._literal(pos, rule, nested)
                elif c == "[":
                    pos = self._char_class(pos, rule, nested)
                elif c in "<!":
                    kind, at = (TOKEN_NOT, pos + 1) if c == "!" else (TOKEN, pos)
                    value, pos = self.token(at)
                    rule.append((kind, value))
                    if kind == TOKEN:
                        self.wanted.append(self.tokens[-1])
                    pos = self.space(pos, nested)
                elif c == ".":
                    rule.append((CHAR_ANY, 0))
                    pos = self.space(pos + 1, nested)
                elif c == "(":
                    pos, prev_rules = self._group(pos, rule_name, rule, nested)
                else:
                    end = self.name(pos)
                    rule.append((RULE_REF, self.symbol_id(src[pos:end])))
                    pos = self.space(end, nested)
            elif c in "*+?":
                pos = self.space(pos + 1, nested)
                low, high = {"*": (0, UNBOUNDED), "+": (1, UNBOUNDED), "?": (0, 1)}[c]
                prev_rules = self._repeat(rule, last_start, prev_rules, rule_name, low, high,
                                          pos)
            elif c == "{":
                pos, low, high = self._braces(pos, nested)
                prev_rules = self._repeat(rule, last_start, prev_rules, rule_name, low, high,
                                          pos)
            else:
                return pos

    def _literal(self, pos: int, rule: list, nested: bool) -> int:
        """A "string": a CHAR element per character."""
        src = self.src
        pos += 1
        while src[pos] != '"':
            if src[pos] == "\x00":
                raise self.fail("unexpected end of input", pos)
            value, pos = self.char(pos)
            rule.append((CHAR, value))
        return self.space(pos + 1, nested)

    def _char_class(self, pos: int, rule: list, nested: bool) -> int:
        """A [character class] (or [^negated] one), its ranges checked."""
        src = self.src
        pos += 1
        start_type = CHAR
        if src[pos] == "^":
            pos += 1
            start_type = CHAR_NOT
        first, opened = len(rule), pos
        ranges = []
        while src[pos] != "]":
            if src[pos] == "\x00":
                raise self.fail("unexpected end of input", pos)
            at = pos
            value, pos = self.char(pos)
            rule.append((CHAR_ALT if first < len(rule) else start_type, value))
            upper = value
            if src[pos] == "-" and src[pos + 1] != "]":
                if src[pos + 1] == "\x00":
                    raise self.fail("unexpected end of input", pos + 1)
                upper, pos = self.char(pos + 1)
                if upper < value:
                    raise self.fail("an empty character range (its end comes "
                                    "before its start)", at, GrammarRefused)
                rule.append((CHAR_RNG_UPPER, upper))
            ranges.append((value, upper))
        if start_type == CHAR_NOT and _covers_unicode(ranges):
            # (nothing but NUL is left, which no token's text holds: llama.cpp let a
            # partial UTF-8 sequence's bytes through, and the answer was not UTF-8)
            raise self.fail("a negated class that leaves no character", opened - 1,
                            GrammarRefused)
        return self.space(pos + 1, nested)

    def _group(self, pos: int, rule_name: str, rule: list, nested: bool) -> tuple[int, int]:
        """A (group): a rule of its own, referred to; returns the position after it and
        the rules it made."""
        self.nesting += 1
        if self.nesting > MAX_NESTING:
            raise GrammarTooLarge(f"the grammar nests groups more than {MAX_NESTING} deep")
        pos = self.space(pos + 1, True)
        before = len(self.symbols)
        sub_id = self.generate_id(rule_name)
        pos = self.alternates(pos, rule_name, sub_id, True)
        self.nesting -= 1
        rule.append((RULE_REF, sub_id))
        if self.src[pos] != ")":
            raise self.fail("expecting ')'", pos)
        return self.space(pos + 1, nested), max(1, len(self.symbols) - before)

    def _braces(self, pos: int, nested: bool) -> tuple[int, int, int]:
        """A {m}, {m,} or {m,n} repetition: (position after it, m, n or UNBOUNDED), its
        counts bounded as llama.cpp bounds them."""
        src = self.src
        pos = self.space(pos + 1, nested)
        if not "0" <= src[pos] <= "9":
            raise self.fail("expecting an int", pos)
        end = self.integer(pos)
        low = int(src[pos:end])
        pos = self.space(end, nested)
        high = UNBOUNDED
        if src[pos] == "}":
            high = low
            pos = self.space(pos + 1, nested)
        elif src[pos] == ",":
            pos = self.space(pos + 1, nested)
            if "0" <= src[pos] <= "9":
                end = self.integer(pos)
                high = int(src[pos:end])
                pos = self.space(end, nested)
            if src[pos] != "}":
                raise self.fail("expecting '}'", pos)
            pos = self.space(pos + 1, nested)
        else:
            raise self.fail("expecting ','", pos)
        if low >= 2 ** 64 or (high != UNBOUNDED and high >= 2 ** 64):
            raise self.fail("a repetition count too big", pos)
        if low > MAX_REPETITION:
            raise self.fail(f"more than {MAX_REPETITION} repetitions", pos)
        if high != UNBOUNDED and high > MAX_REPETITION:
            high = UNBOUNDED            # as llama.cpp: {m,n} with n > 2000 is {m,}
        if high != UNBOUNDED and high < low:
            # llama.cpp's unsigned count of optional copies would wrap around
            raise self.fail("a repetition whose maximum is below its minimum", pos,
                            GrammarRefused)
        return pos, low, high

    def _repeat(self, rule: list, last_start: int, prev_rules: int, rule_name: str,
                low: int, high: int, pos: int) -> int:
        """The last item repeated low..high times (llama.cpp's handle_repetitions: low
        copies, then rules for the optional ones); returns the rules it now stands for."""
        if last_start == len(rule):
            raise self.fail("expecting preceding item to */+/?/{", pos)
        prev = rule[last_start:]
        total = high if high != UNBOUNDED and high > 0 else low if low > 0 else 1
        if prev_rules * total > MAX_REPETITION:
            raise self.fail("repetitions of repetitions exceed llama.cpp's limit of "
                            f"{MAX_REPETITION} rules", pos)
        if low == 0:
            del rule[last_start:]
        else:
            self.charge(len(prev) * (low - 1))
            for _ in range(low - 1):
                rule.extend(prev)
        last_rec = 0
        n_opt = 1 if high == UNBOUNDED else high - low
        for i in range(n_opt):
            rec_id = self.generate_id(rule_name)
            rec = list(prev)
            if i > 0 or high == UNBOUNDED:
                rec.append((RULE_REF, rec_id if high == UNBOUNDED else last_rec))
            rec += [(ALT, 0), (END, 0)]
            self.charge(len(rec))
            self.add_rule(rec_id, rec)
            last_rec = rec_id
        if n_opt > 0:
            rule.append((RULE_REF, last_rec))
        return prev_rules * total

    def rule(self, pos: int) -> int:
        end = self.name(pos)
        name = self.src[pos:end]
        rule_id = self.symbol_id(name)
        pos = self.space(end, False)
        if self.src[pos:pos + 3] != "::=":
            raise self.fail("expecting ::=", pos)
        pos = self.space(pos + 3, True)
        pos = self.alternates(pos, name, rule_id, False)
        if self.src[pos] == "\r":
            pos += 2 if self.src[pos + 1] == "\n" else 1
        elif self.src[pos] == "\n":
            pos += 1
        elif self.src[pos] != "\x00":
            raise self.fail("expecting newline or end", pos)
        return self.space(pos, True)

    def parse(self, growth: bool = True) -> Grammar:
        pos = self.space(0, True)
        while self.src[pos] != "\x00":
            pos = self.rule(pos)
        if not any(self.rules):
            raise GrammarError("the grammar has no rules")
        names = {i: n for n, i in self.symbols.items()}
        for rule_id, rule in enumerate(self.rules):
            if not rule:
                raise GrammarError(f"undefined rule '{names.get(rule_id, rule_id)}'")
            for kind, value in rule:
                if kind == RULE_REF and (value >= len(self.rules) or not self.rules[value]):
                    raise GrammarError(f"undefined rule '{names.get(value, value)}'")
        if "root" not in self.symbols:
            raise GrammarError("the grammar has no 'root' rule")
        rules = [r or [] for r in self.rules]
        check_costs(rules, self.symbols["root"], names)
        if growth:
            check_growth(rules, self.symbols["root"])
        return Grammar(rules, self.symbols, self.elements, self.tokens)


def check(grammar: str, n_vocab: int | None = None,
          token_of: Callable[[str], int | None] | None = None,
          ends: Callable[[int], bool] | None = None, growth: bool = True) -> Grammar:
    """The grammar as llama.cpp would build it, or GrammarError / GrammarTooLarge saying
    why not. With `n_vocab`, token references `<[id]>` must name a token; with
    `token_of`, each `<text>` must be exactly one token (llama.cpp's rule); with `ends`
    (whether a token id ends generation), none asked for may be one. `growth` false
    leaves out the probe of stacks that multiply as text comes (`grammar_growth`): a
    worker's checks, of grammars a front end probed before any job carried them (a
    76 KB schema's grammar takes it a second, twice a worker, the GIL held)."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarTooLarge(f"the grammar has {len(grammar)} characters; at most "
                              f"{MAX_GRAMMAR_CHARS}")
    if "\x00" in grammar:
        raise GrammarRefused("the grammar contains a NUL character")
    parser = _Parser(grammar)
    parsed = parser.parse(growth)
    _check_no_nul(parsed)
    for value, text in parsed.tokens:
        if text and token_of is not None and token_of(text) is None:
            raise GrammarError(f"{text[:40]!r} is not one token of this model")
        if not text and n_vocab is not None and value >= n_vocab:
            raise GrammarRefused(f"token <[{value}]> is outside the vocabulary "
                               f"(0..{n_vocab - 1})")
    for value, text in parser.wanted if ends is not None else ():
        token = token_of(text) if text and token_of is not None else value
        if token is not None and token >= 0 and ends(token):
            # llama.cpp lets an end-of-generation token through only where the grammar
            # is complete, so one it asks for can never come: generation failed midway
            raise GrammarRefused(f"token {text[:40] or f'<[{value}]>'} ends generation; "
                                 "a grammar cannot ask for it (generation ends where the "
                                 "grammar is complete)")
    return parsed


def _unwritable(low: int, high: int) -> bool:
    """Code points no token's text holds as such: NUL (llama.cpp reads a text up to it)
    and the UTF-16 surrogates (no UTF-8 text holds one: only bytes that are not UTF-8)."""
    return low == high == 0 or 0xD800 <= low <= high <= 0xDFFF


def _check_no_nul(parsed: Grammar) -> None:
    """Refuse a character no token can write asked for as such (`"\\x00"`, `[\\x00]`,
    `"\\uD83D\\uDE00"`, `[\\uD800-\\uDFFF]`): no token matches it, and generation
    fails midway, or a surrogate is met by bytes that are not UTF-8. A class with other
    characters (`[\\x00-\\x1f]`) or a negated one is fine."""
    for rule in parsed.rules:
        for i, (kind, value) in enumerate(rule):
            if kind != CHAR or not (value == 0 or 0xD800 <= value <= 0xDFFF):
                continue
            end, ranges = i + 1, []   # the class's other alternatives and range ends
            while end < len(rule) and rule[end][0] in (CHAR_ALT, CHAR_RNG_UPPER):
                end += 1
            for j in range(i, end):
                if rule[j][0] == CHAR_RNG_UPPER:
                    ranges[-1] = (ranges[-1][0], rule[j][1])
                else:
                    ranges.append((rule[j][1], rule[j][1]))
            if all(_unwritable(low, high) for low, high in ranges):
                what = "a NUL character (\\x00)" if ranges[0][0] == 0 else \
                    f"the surrogate U+{ranges[0][0]:04X} (write the character itself)"
                raise GrammarRefused(f"the grammar asks for {what}, which no token's text "
                                     "can hold")


def _covers_unicode(ranges: list[tuple[int, int]]) -> bool:
    """Whether the code point ranges cover every character but NUL (U+0001-U+10FFFF)."""
    reach = 1
    for low, high in sorted(ranges):
        if low > reach:
            return False
        reach = max(reach, high + 1)
    return reach > 0x10FFFF
