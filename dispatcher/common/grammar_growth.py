"""How many parse stacks llama.cpp holds as text comes, probed before it sees a grammar.

`grammar_cost.stack_width` bounds what one position of the rules expands into; not the
stacks that several alternatives keep alive together, which multiply where they go on
into the same rule. `check_growth` feeds the stacks, simulated as llama.cpp's
advance_stack and accept make them, the text that keeps the most alive.
"""
from __future__ import annotations

from dispatcher.common.grammar_cost import MAX_STACKS, reachable, strong_components
from dispatcher.common.grammar_rules import (
    CHAR_ALT, CHAR_ANY, CHAR_NOT, CHAR_RNG_UPPER, RULE_REF, TOKEN, TOKEN_NOT,
    GrammarTooLarge, alternatives, ends)

# The growth probe (`check_growth`): symbols it feeds the grammar's stacks, and the
# elementary steps (a stack advanced, a class tested) it may take before it gives up
GROWTH_SYMBOLS = 48
GROWTH_WORK = 2_000_000             # stack elements built or tested, in all
GROWTH_BEAM = 16                    # ... following the inputs that keep the most alive
RULE_BEAM, RULE_SYMBOLS = 4, 24     # ... and from the start of each rule
MAX_CODE_POINT = 0x10FFFF
# Stacks a probed input may keep alive: twice what the count over the rules allows, which
# sees one place of them (an object of 150 optional properties holds 298 after its
# opening quote, and was served before the probe), where stacks that multiply pass any
# bound within a few characters more
PROBED_STACKS = 2 * MAX_STACKS


def _leaf(rule: list, i: int) -> tuple[int, object, int]:
    """(kind, what it matches, the position after it) of the leaf at rule[i]: a
    character class's (low, high) ranges, a token's id."""
    kind, value = rule[i]
    if kind in (CHAR_ANY, TOKEN, TOKEN_NOT):
        return kind, value, i + 1
    ranges, j = [], i
    while True:
        low = high = rule[j][1]
        j += 1
        if j < len(rule) and rule[j][0] == CHAR_RNG_UPPER:
            high = rule[j][1]
            j += 1
        ranges.append((low, high))
        if j >= len(rule) or rule[j][0] != CHAR_ALT:
            return kind, tuple(ranges), j


def _matches(leaf: tuple, symbol: int) -> bool:
    """Whether the leaf takes `symbol`: a character (>= 0), or a token (-1 - its id).
    llama.cpp advances a token element by the token's id alone, a character one by
    its text alone."""
    kind, value = leaf[0], leaf[1]
    if kind == TOKEN:
        return symbol == -1 - value
    if kind == TOKEN_NOT:
        return symbol < 0 and symbol != -1 - value
    if symbol < 0:
        return False
    if kind == CHAR_ANY:
        return True
    inside = any(low <= symbol <= high for low, high in value)
    return inside != (kind == CHAR_NOT)


def _symbols(classes: tuple) -> tuple[list[tuple[int, tuple]], int]:
    """(symbol, the classes that take it) for every set of the classes that some symbol
    is taken by exactly (the code points cut where any class's range begins or ends,
    tokens by the ids named), and the tests that took."""
    cuts, ids = {0}, set()
    for kind, value in classes:
        if kind in (TOKEN, TOKEN_NOT):
            ids.add(value)
        elif kind != CHAR_ANY:
            for low, high in value:
                cuts.update((low, high + 1))
    symbols = [c for c in cuts if c <= MAX_CODE_POINT]
    symbols += [-1 - i for i in ids] + ([-2 - max(ids)] if ids else [])
    chosen, tests = {}, 0
    for symbol in symbols:
        taken = tuple(k for k, leaf in enumerate(classes) if _matches(leaf, symbol))
        tests += len(classes)
        if taken:
            chosen.setdefault(taken, symbol)
    return [(symbol, taken) for taken, symbol in chosen.items()], tests


def check_growth(rules: list, root: int) -> None:
    """GrammarTooLarge where llama.cpp would hold more than PROBED_STACKS parse stacks at
    once within GROWTH_SYMBOLS characters (or tokens) of text, fed as it would be: a
    beam of the GROWTH_BEAM inputs whose stacks grew last and most, each with one symbol
    for every set of the stacks' tops that some symbol is taken by; from the grammar's
    start, and (RULE_BEAM, RULE_SYMBOLS) from the start of every rule it reaches that
    nests in itself or whose alternatives begin alike (with nothing under it: a fixed
    prefix, `root ::= "b"{60} a`, hid `a` from a probe from the start alone).
    `a ::= [ -~] a "A" | [ -~] a "B" | ...` (k alternatives) multiplies the stacks by k
    at every character, within one token's accept (64 of them: 4,096 stacks at the
    second character of " The", 3.7 s; the third, hours), which no guard after the
    accept can stop. Every refusal is such an input, found; a probe, not a proof
    (stacks a search this narrow never follows pass it, left to the guard at
    generation); one past GROWTH_WORK steps refuses the grammar as too costly to check."""
    stacks = _Stacks(rules)
    reach = reachable(rules, root)
    # the start's probe at full strength; narrower and shorter, that of every rule that
    # can begin a multiplication: one that nests in itself, or whose alternatives begin
    # alike (a probe of each of a large schema's hundreds of rules passed the budget)
    edges = [[(value, 0) for kind, value in rule if kind == RULE_REF] for rule in rules]
    nesting = set()
    for component in strong_components(len(rules), edges):
        if len(component) > 1 or any(v == component[0] for v, _ in edges[component[0]]):
            nesting.update(component)
    probes = {stacks.starting(root): (GROWTH_BEAM, GROWTH_SYMBOLS)}
    for rule in (r for r, reached in enumerate(reach) if reached and r != root):
        start = stacks.starting(rule)
        if rule in nesting or stacks.alike(start):
            probes.setdefault(start, (RULE_BEAM, RULE_SYMBOLS))
    for start, (width, length) in probes.items():
        _probe(stacks, start, width, length)


def _probe(stacks: "_Stacks", start: frozenset, width: int, length: int) -> None:
    """Feed `length` symbols from `start`, following the `width` inputs whose stacks grew
    last, the largest first."""
    # (stacks, the most its input's stacks have been, characters since it grew)
    beam = [(start, len(start), 0)]
    for step in range(length):
        states = {}
        for state, peak, since in beam:
            for after in stacks.fed(state):
                if after not in states:
                    grew = len(after) > peak
                    states[after] = (max(peak, len(after)), 0 if grew else since + 1)
        if not states:
            return                      # (nothing more can come)
        beam = sorted(((after, peak, since) for after, (peak, since) in states.items()),
                      key=lambda entry: (entry[2], -len(entry[0])))[:width]
        most = max(len(entry[0]) for entry in beam)
        if most > PROBED_STACKS:
            raise GrammarTooLarge(
                f"the grammar's parse stacks reach {most:,} after {step + 1} "
                f"character(s) of text; at most {PROBED_STACKS} here (alternatives "
                "that begin alike each keep one alive, and multiply where they go on "
                "into the same rule: llama.cpp advances every stack through every "
                "character of a token, within one call nothing can stop)")


class _Stacks:
    """llama.cpp's parse stacks over `rules`, as its advance_stack and accept make them,
    within GROWTH_WORK steps. A stack is a number: 0 the empty one, each other its top
    position and the number of the stack under it, made once (pushing and popping cost
    the same at any depth); a state is a frozenset of them."""

    def __init__(self, rules: list):
        self.rules = rules
        self.alts: dict[int, list] = {}
        self.leaves: dict[tuple[int, int], tuple] = {}
        self.work = 0
        self.made: dict[tuple, int] = {}
        self.cells: list[tuple] = [((-1, -1), 0)]
        self.memo: dict[frozenset, list[frozenset]] = {}
        self.groups: dict[tuple, tuple] = {}     # the tops' classes -> _symbols of them

    def push(self, under: int, position: tuple[int, int]) -> int:
        key = (position, under)
        if key not in self.made:
            self.made[key] = len(self.cells)
            self.cells.append(key)
        return self.made[key]

    def spend(self, steps: int) -> None:
        self.work += steps
        if self.work > GROWTH_WORK:
            raise GrammarTooLarge(
                "the grammar's parse stacks are too costly to check (over "
                f"{GROWTH_WORK:,} steps for {GROWTH_SYMBOLS} characters)")

    def leaf(self, stack: int) -> tuple:
        position = self.cells[stack][0]
        if position not in self.leaves:
            self.leaves[position] = _leaf(self.rules[position[0]], position[1])
        return self.leaves[position]

    def advance(self, stack: int, out: set) -> None:
        """llama.cpp's advance_stack: every leaf the stack's top reference expands to."""
        rules = self.rules
        todo, done = [stack], set()
        while todo:
            top = todo.pop()
            if top in done:
                continue
            done.add(top)
            self.spend(1)
            if not top:
                out.add(top)
                continue
            (r, i), under = self.cells[top]
            kind, ref = rules[r][i]
            if kind != RULE_REF:
                out.add(top)
                continue
            base = under if ends(rules[r][i + 1]) else self.push(under, (r, i + 1))
            if ref not in self.alts:
                self.alts[ref] = alternatives(rules[ref])
            for start, end in self.alts[ref]:
                todo.append(self.push(base, (ref, start)) if start != end else base)

    def starting(self, rule: int) -> frozenset:
        out: set = set()
        for start, end in alternatives(self.rules[rule]):
            self.advance(self.push(0, (rule, start)) if start != end else 0, out)
        return frozenset(out)

    def alike(self, state: frozenset) -> bool:
        """Whether some symbol is taken by two of the stacks' tops."""
        tops = [self.leaf(stack)[:2] for stack in state if stack]
        classes = self.symbols_of(set(tops))
        return len(classes) < len(tops) or \
            any(len(taken) > 1 for _, taken in self.groups[classes][0])

    def symbols_of(self, tops) -> tuple:
        """The tops' distinct classes, in one order, with `_symbols` of them kept."""
        classes = tuple(sorted(tops, key=repr))
        if classes not in self.groups:
            self.groups[classes] = _symbols(classes)
            self.spend(self.groups[classes][1])
        return classes

    def fed(self, state: frozenset) -> list[frozenset]:
        """The states each symbol some tops take leaves, advanced (once a state)."""
        if state in self.memo:
            return self.memo[state]
        tops: dict[tuple, list] = {}
        for stack in state:
            if stack:
                tops.setdefault(self.leaf(stack)[:2], []).append(stack)
        classes = self.symbols_of(tops)
        out = []
        for _, taken in self.groups[classes][0]:
            going_on = set()            # (the stacks it leaves, each advanced once)
            for k in taken:
                for stack in tops[classes[k]]:
                    (r, i), under = self.cells[stack]
                    j = self.leaves[(r, i)][2]
                    going_on.add(under if ends(self.rules[r][j])
                                 else self.push(under, (r, j)))
            self.spend(len(going_on))
            after: set = set()
            for stack in going_on:
                self.advance(stack, after)
            if after:
                out.append(frozenset(after))
        self.memo[state] = out
        return out
