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
never match: generation would fail midway), and the size limits below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MAX_GRAMMAR_CHARS = 256 * 1024      # the text (JSON-schema grammars run to tens of KB)
MAX_ELEMENTS = 500_000              # what llama.cpp allocates: 8 bytes each, ~16 with copies
MAX_RULES = 100_000                 # rules, those repetitions generate included
MAX_LEFT_DEPTH = 2_000              # nested calls of llama.cpp's left-recursion check
MAX_LEFT_CALLS = 100_000            # ... and calls in all
MAX_NESTING = 100                   # ( ) groups inside each other (this parser recurses too)
MAX_REPETITION = 2000               # llama.cpp's MAX_REPETITION_THRESHOLD
# Parse stacks llama.cpp may hold at once, and the character-class elements they test:
# each sampled token advances every stack (its de-duplication compares each new stack
# with the others: ~stacks³ work), and a rejected pick tests every token of the
# vocabulary against every stack's class (`root ::= x x`, x 4,000 one-character
# alternatives, took 165 s a token).
MAX_STACKS = 256
MAX_STACK_ELEMENTS = 1024

# element types (llama_gretype)
END, ALT, RULE_REF, CHAR, CHAR_NOT, CHAR_RNG_UPPER, CHAR_ALT, CHAR_ANY, TOKEN, TOKEN_NOT = \
    range(10)
UNBOUNDED = -1


class GrammarError(ValueError):
    """The grammar does not parse (llama.cpp's parser refuses it too)."""


class GrammarRefused(GrammarError):
    """llama.cpp would take the grammar, but it could never work (nothing could match, or
    llama.cpp would loop) or it would cost more than this server allows."""


class GrammarTooLarge(GrammarRefused):
    """The grammar would cost more than this server allows."""


@dataclass
class Grammar:
    rules: list[list[tuple[int, int]]]
    symbols: dict[str, int]
    elements: int
    tokens: list[tuple[int, str]]          # (id or -1, text) of each <token> reference

    @property
    def root(self) -> int:
        return self.symbols["root"]


def _is_word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


class _Parser:
    def __init__(self, src: str):
        self.src = src + "\x00"            # llama.cpp reads a C string
        self.symbols: dict[str, int] = {}
        self.rules: list[list[tuple[int, int]] | None] = []
        self.elements = 0
        self.tokens: list[tuple[int, str]] = []
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
                                  "its repetitions and groups generate included")
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
        first = len(rule)
        while src[pos] != "]":
            if src[pos] == "\x00":
                raise self.fail("unexpected end of input", pos)
            at = pos
            value, pos = self.char(pos)
            rule.append((CHAR_ALT if first < len(rule) else start_type, value))
            if src[pos] == "-" and src[pos + 1] != "]":
                if src[pos + 1] == "\x00":
                    raise self.fail("unexpected end of input", pos + 1)
                upper, pos = self.char(pos + 1)
                if upper < value:
                    raise self.fail("an empty character range (its end comes "
                                    "before its start)", at, GrammarRefused)
                rule.append((CHAR_RNG_UPPER, upper))
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

    def parse(self) -> Grammar:
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
        _check_left_recursion(rules, names)
        stacks, elements = stack_width(rules, self.symbols["root"], names)
        if stacks > MAX_STACKS or elements > MAX_STACK_ELEMENTS:
            raise GrammarTooLarge(
                f"the grammar can hold {_many(stacks)} parse stacks testing "
                f"{_many(elements)} character-class elements at one position; at most "
                f"{MAX_STACKS} stacks and {MAX_STACK_ELEMENTS} elements here (llama.cpp "
                "tests every candidate token against every stack: write a long "
                "alternation of single characters as one [...] class, and keep "
                "alternatives that share a beginning together, like \"a\" (\"b\" | \"c\"))")
        return Grammar(rules, self.symbols, self.elements, self.tokens)


def _ends(element: tuple[int, int]) -> bool:
    return element[0] in (END, ALT)


# -- parse stacks (what one sampled token costs llama.cpp) --------------------------------
LEAVES = (CHAR, CHAR_NOT, CHAR_ANY, TOKEN, TOKEN_NOT)
_CAP = 10 ** 9                      # counts past any budget stay here (no huge integers)


def _many(count: int) -> str:
    return "unboundedly many" if count >= _CAP else f"{count:,}"


def _alternatives(rule: list) -> list[tuple[int, int]]:
    """(start, end) of each alternative of a rule (end: its ALT or END element)."""
    spans, start = [], 0
    for i, element in enumerate(rule):
        if _ends(element):
            spans.append((start, i))
            start = i + 1
    return spans


def _nullable(rules: list) -> list[bool]:
    """Which rules can match the empty string, through any chain of references (llama.cpp's
    own check sees only a directly empty alternative). Linear: each alternative made only
    of references counts those not yet known empty."""
    n = len(rules)
    empty = [False] * n
    waiting: list[list[tuple[int, int]]] = [[] for _ in range(n)]   # rule -> (alt, rule)
    left: dict[tuple[int, int], int] = {}
    ready = []
    for r, rule in enumerate(rules):
        for a, (start, end) in enumerate(_alternatives(rule)):
            part = rule[start:end]
            if all(kind == RULE_REF for kind, _ in part):
                left[(r, a)] = len(part)
                for _, ref in part:
                    waiting[ref].append((r, a))
                if not part:
                    ready.append(r)
    while ready:
        r = ready.pop()
        if empty[r]:
            continue
        empty[r] = True
        for key in waiting[r]:
            left[key] -= 1
            if left[key] == 0:
                ready.append(key[0])
    return empty


def _class_length(rule: list, i: int) -> int:
    j = i + 1
    while j < len(rule) and rule[j][0] in (CHAR_ALT, CHAR_RNG_UPPER):
        j += 1
    return j - i


def _suffixes(rule: list, start: int, end: int, first: list, empty: list):
    """For each position j of one alternative, right to left: (stacks, elements) that
    expanding from j gives, and whether everything from j on may match nothing."""
    stacks, elements, rest_empty = 0, 0, True
    out = {}
    j = end
    out[j] = (0, 0, True)
    while j > start:
        j -= 1
        kind, value = rule[j]
        if kind in (CHAR_ALT, CHAR_RNG_UPPER):
            continue
        if kind == RULE_REF:
            s, e = first[value]
            if empty[value]:
                stacks, elements = min(s + stacks, _CAP), min(e + elements, _CAP)
            else:
                stacks, elements, rest_empty = s, e, False
        else:
            stacks, elements, rest_empty = 1, _class_length(rule, j), False
        out[j] = (stacks, elements, rest_empty)
    return out


def _start_width(rule: list, start: int, end: int, first: list,
                 empty: list) -> tuple[int, int]:
    """(stacks, elements) that expanding one alternative from its start gives."""
    stacks = elements = 0
    j = start
    while j < end:
        kind, value = rule[j]
        if kind != RULE_REF:
            return min(stacks + 1, _CAP), min(elements + _class_length(rule, j), _CAP)
        stacks, elements = min(stacks + first[value][0], _CAP), \
            min(elements + first[value][1], _CAP)
        if not empty[value]:
            break
        j += 1
    return stacks, elements


def _firsts(rules: list, empty: list, names: dict) -> list[tuple[int, int]]:
    """(stacks, elements) that expanding each rule at its start gives (llama.cpp's
    advance_stack: one stack per leaf reached through leftmost references), in post-order
    without recursion. A cycle here is left recursion through rules that may be empty,
    which llama.cpp's own check misses and then loops on."""
    n = len(rules)
    first: list = [None] * n
    state = [0] * n                  # 0 new, 1 in progress, 2 done

    def leftmost(r: int) -> list[int]:
        refs = []
        rule = rules[r]
        for start, end in _alternatives(rule):
            for j in range(start, end):
                kind, value = rule[j]
                if kind != RULE_REF:
                    break
                refs.append(value)
                if not empty[value]:
                    break
        return refs

    for top in range(n):
        if state[top]:
            continue
        stack = [(top, iter(leftmost(top)))]
        state[top] = 1
        while stack:
            r, refs = stack[-1]
            for ref in refs:
                if state[ref] == 1:
                    raise GrammarRefused(
                        f"left recursion through rules that may be empty ('{names.get(ref, ref)}'"
                        " can begin with itself), on which llama.cpp would loop")
                if state[ref] == 0:
                    state[ref] = 1
                    stack.append((ref, iter(leftmost(ref))))
                    break
            else:
                rule = rules[r]
                stacks = elements = 0
                for start, end in _alternatives(rule):
                    s, e = _start_width(rule, start, end, first, empty)
                    stacks, elements = min(stacks + s, _CAP), min(elements + e, _CAP)
                first[r] = (stacks, elements)
                state[r] = 2
                stack.pop()
    return first


def _strong_components(n: int, edges: list[list[tuple[int, int]]]) -> list[list[int]]:
    """Tarjan's components of the graph, sources first (topological order), iterative."""
    index, low, on, order, comps = [None] * n, [0] * n, [False] * n, [], []
    counter = 0
    for root in range(n):
        if index[root] is not None:
            continue
        work = [(root, 0)]
        while work:
            v, k = work.pop()
            if k == 0:
                index[v] = low[v] = counter
                counter += 1
                order.append(v)
                on[v] = True
            if k < len(edges[v]):
                work.append((v, k + 1))
                w = edges[v][k][0]
                if index[w] is None:
                    work.append((w, 0))
                elif on[w]:
                    low[v] = min(low[v], index[w])
                continue
            for w, _ in edges[v]:
                if on[w] and index[w] > index[v]:
                    low[v] = min(low[v], low[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = order.pop()
                    on[w] = False
                    comp.append(w)
                    if w == v:
                        break
                comps.append(comp)
    comps.reverse()
    return comps


def stack_width(rules: list, root: int, names: dict) -> tuple[int, int]:
    """The most parse stacks llama.cpp can hold at one position of this grammar, and the
    most character-class elements they test together (both capped at _CAP: unbounded).

    At a leaf (a character class at position i of rule r) that accepts, the stack goes on
    with what follows it in r and, where all of that may be empty, with what follows r
    where it was referenced (`up`): `up[r]` is the most stacks a finished r gives, the
    longest path over the references that end their alternative's non-empty part. A
    cycle of such references that adds stacks on the way (`r ::= "a" r y`, y optional)
    grows with the nesting: unbounded."""
    n = len(rules)
    empty = _nullable(rules)
    first = _firsts(rules, empty, names)
    reach, todo = [False] * n, [root]
    reach[root] = True
    while todo:
        for kind, value in rules[todo.pop()]:
            if kind == RULE_REF and not reach[value]:
                reach[value] = True
                todo.append(value)
    suffix = {}
    base = [(0, 0)] * n                           # up[] from references not at an end
    tails: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # u -> (r, (s, e))
    weights: dict[tuple[int, int], tuple[int, int]] = {}
    for u in range(n):
        if not reach[u]:
            continue
        rule = rules[u]
        for start, end in _alternatives(rule):
            after = _suffixes(rule, start, end, first, empty)
            suffix[(u, start)] = after
            for j in range(start, end):
                kind, value = rule[j]
                if kind != RULE_REF:
                    continue
                s, e, rest_empty = after[j + 1]
                if rest_empty:
                    tails[u].append((value, 0))
                    old = weights.get((u, value), (0, 0))
                    weights[(u, value)] = (max(old[0], s), max(old[1], e))
                else:
                    base[value] = (max(base[value][0], s), max(base[value][1], e))
    up = list(base)
    up[root] = (max(up[root][0], 1), up[root][1])        # the end of the text
    for comp in _strong_components(n, tails):
        members = set(comp)
        s_in = max(up[v][0] for v in comp)
        e_in = max(up[v][1] for v in comp)
        grows = False
        for u in comp:
            for r, _ in tails[u]:
                if r in members and weights[(u, r)] != (0, 0):
                    grows = True
        if grows and s_in + e_in > 0 and any(reach[v] for v in comp):
            s_in = e_in = _CAP
        for v in comp:
            up[v] = (s_in, e_in)
        for u in comp:
            for r, _ in tails[u]:
                if r not in members:
                    w = weights[(u, r)]
                    up[r] = (max(up[r][0], min(up[u][0] + w[0], _CAP)),
                             max(up[r][1], min(up[u][1] + w[1], _CAP)))
    stacks = first[root][0] + (1 if empty[root] else 0)
    elements = first[root][1]
    for (u, start), after in suffix.items():
        rule = rules[u]
        for j in range(start, len(rule)):
            kind = rule[j][0]
            if _ends(rule[j]):
                break
            if kind not in LEAVES:
                continue
            k = j + _class_length(rule, j)
            s, e, rest_empty = after.get(k, (0, 0, True))
            if rest_empty:
                s, e = min(s + up[u][0], _CAP), min(e + up[u][1], _CAP)
            stacks, elements = max(stacks, s), max(elements, e)
    return stacks, elements


def _check_left_recursion(rules: list, names: dict) -> None:
    """llama.cpp's llama_grammar_detect_left_recursion (same visiting order, same verdict)
    without recursion, bounding how deep its recursion would go and how often it would
    be called: it does not remember rules it has cleared while inside a descent, so rules
    that each begin with two references to the next take it 2^n calls."""
    n = len(rules)
    visited, in_progress, may_be_empty = [False] * n, [False] * n, [False] * n
    calls = 0

    def enter(index: int) -> list:
        nonlocal calls
        if in_progress[index]:
            raise GrammarError("left recursion (a rule that can begin with itself: "
                               f"'{names.get(index, index)}'), which llama.cpp does not "
                               "support")
        calls += 1
        if calls > MAX_LEFT_CALLS:
            raise GrammarTooLarge("the grammar's rules begin with each other in too many "
                                  f"ways (over {MAX_LEFT_CALLS} paths for llama.cpp's "
                                  "left-recursion check)")
        in_progress[index] = True
        at_start = True                 # may the rule produce the empty string?
        for element in rules[index]:
            if _ends(element):
                if at_start:
                    may_be_empty[index] = True
                    break
                at_start = True
            else:
                at_start = False
        return [index, 0, True, None]   # rule, position, recurse flag, child entered

    for first in range(n):
        if visited[first]:
            continue
        stack = [enter(first)]
        while stack:
            frame = stack[-1]
            index, i, recurse, child = frame
            rule = rules[index]
            if child is not None:           # back from the rule at position i
                if not may_be_empty[child]:
                    recurse = False
                i += 1
            while i < len(rule):
                kind, value = rule[i]
                if kind == RULE_REF and recurse:
                    break
                recurse = _ends(rule[i])
                i += 1
            if i < len(rule):
                frame[:] = [index, i, recurse, rule[i][1]]
                if len(stack) >= MAX_LEFT_DEPTH:
                    raise GrammarTooLarge(f"rules begin with other rules more than "
                                          f"{MAX_LEFT_DEPTH} deep (llama.cpp checks them "
                                          "recursively)")
                stack.append(enter(rule[i][1]))
                continue
            in_progress[index] = False
            visited[index] = True
            stack.pop()


def check(grammar: str, n_vocab: int | None = None,
          token_of: Callable[[str], int | None] | None = None) -> Grammar:
    """The grammar as llama.cpp would build it, or GrammarError / GrammarTooLarge saying
    why not. With `n_vocab`, token references `<[id]>` must name a token; with
    `token_of`, each `<text>` must be exactly one token (llama.cpp's rule)."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarTooLarge(f"the grammar has {len(grammar)} characters; at most "
                              f"{MAX_GRAMMAR_CHARS}")
    if "\x00" in grammar:
        raise GrammarRefused("the grammar contains a NUL character")
    parsed = _Parser(grammar).parse()
    for value, text in parsed.tokens:
        if text and token_of is not None and token_of(text) is None:
            raise GrammarError(f"{text[:40]!r} is not one token of this model")
        if not text and n_vocab is not None and value >= n_vocab:
            raise GrammarRefused(f"token <[{value}]> is outside the vocabulary "
                               f"(0..{n_vocab - 1})")
    return parsed
