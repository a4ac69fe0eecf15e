"""How many parse stacks llama.cpp holds as text comes, probed before it sees a grammar.

`grammar_cost.stack_width` bounds what one position of the rules expands into; not the
stacks that several alternatives keep alive together, which multiply where they go on
into the same rule. `check_growth` feeds the stacks, simulated as llama.cpp's
advance_stack and accept make them, the text that keeps the most alive.
"""
from __future__ import annotations

from dispatcher.common.grammar_cost import MAX_STACKS, strong_components
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
    alts: dict[int, list] = {}
    leaves: dict[tuple[int, int], tuple] = {}
    work = 0
    # a stack is a number: 0 the empty one, each other its top position and the number
    # of the stack under it, made once (pushing and popping cost the same at any depth)
    made: dict[tuple, int] = {}
    cells: list[tuple] = [((-1, -1), 0)]

    def push(under: int, position: tuple[int, int]) -> int:
        key = (position, under)
        if key not in made:
            made[key] = len(cells)
            cells.append(key)
        return made[key]

    def spend(steps: int) -> None:
        nonlocal work
        work += steps
        if work > GROWTH_WORK:
            raise GrammarTooLarge(
                "the grammar's parse stacks are too costly to check (over "
                f"{GROWTH_WORK:,} steps for {GROWTH_SYMBOLS} characters)")

    def advance(stack: int, out: set) -> None:
        """llama.cpp's advance_stack: every leaf the stack's top reference expands to."""
        todo, done = [stack], set()
        while todo:
            top = todo.pop()
            if top in done:
                continue
            done.add(top)
            spend(1)
            if not top:
                out.add(top)
                continue
            (r, i), under = cells[top]
            kind, ref = rules[r][i]
            if kind != RULE_REF:
                out.add(top)
                continue
            base = under if ends(rules[r][i + 1]) else push(under, (r, i + 1))
            if ref not in alts:
                alts[ref] = alternatives(rules[ref])
            for start, end in alts[ref]:
                todo.append(push(base, (ref, start)) if start != end else base)

    memo: dict[frozenset, list[frozenset]] = {}
    groups: dict[tuple, tuple] = {}     # the tops' classes -> _symbols of them

    def fed(stacks: frozenset) -> list[frozenset]:
        """The stacks each symbol some tops take leaves, advanced (once a state)."""
        if stacks in memo:
            return memo[stacks]
        tops: dict[tuple, list] = {}
        for stack in stacks:
            if stack:
                position = cells[stack][0]
                if position not in leaves:
                    leaves[position] = _leaf(rules[position[0]], position[1])
                tops.setdefault(leaves[position][:2], []).append(stack)
        classes = tuple(sorted(tops, key=repr))
        if classes not in groups:
            groups[classes] = _symbols(classes)
            spend(groups[classes][1])
        out = []
        for _, taken in groups[classes][0]:
            going_on = set()            # (the stacks it leaves, each advanced once)
            for k in taken:
                for stack in tops[classes[k]]:
                    (r, i), under = cells[stack]
                    j = leaves[(r, i)][2]
                    going_on.add(under if ends(rules[r][j]) else push(under, (r, j)))
            spend(len(going_on))
            after: set = set()
            for stack in going_on:
                advance(stack, after)
            if after:
                out.append(frozenset(after))
        memo[stacks] = out
        return out

    def alike(stacks: frozenset) -> bool:
        """Whether some symbol is taken by two of the stacks' tops."""
        classes = [leaves.setdefault(cells[stack][0], _leaf(rules[cells[stack][0][0]],
                                                            cells[stack][0][1]))[:2]
                   for stack in stacks if stack]
        symbols, tests = _symbols(tuple(classes))
        spend(tests)
        return any(len(taken) > 1 for _, taken in symbols)

    def starting(rule: int) -> frozenset:
        out: set = set()
        for start, end in alternatives(rules[rule]):
            advance(push(0, (rule, start)) if start != end else 0, out)
        return frozenset(out)

    reach, todo = {root}, [root]
    while todo:
        for kind, value in rules[todo.pop()]:
            if kind == RULE_REF and value not in reach:
                reach.add(value)
                todo.append(value)
    # the start's probe at full strength; narrower and shorter, that of every rule that
    # can begin a multiplication: one that nests in itself, or whose alternatives begin
    # alike (a probe of each of a large schema's hundreds of rules passed the budget)
    edges = [[(value, 0) for kind, value in rule if kind == RULE_REF] for rule in rules]
    nesting = set()
    for component in strong_components(len(rules), edges):
        if len(component) > 1 or any(v == component[0] for v, _ in edges[component[0]]):
            nesting.update(component)
    probes = {starting(root): (GROWTH_BEAM, GROWTH_SYMBOLS)}
    for rule in sorted(reach - {root}):
        stacks = starting(rule)
        if rule in nesting or alike(stacks):
            probes.setdefault(stacks, (RULE_BEAM, RULE_SYMBOLS))
    for stacks, (width, length) in probes.items():
        # (stacks, the most its input's stacks have been, characters since it grew):
        # the inputs whose stacks grew last go on first, the largest first
        beam = [(stacks, len(stacks), 0)]
        for step in range(length):
            states = {}
            for stacks, peak, since in beam:
                for after in fed(stacks):
                    if after not in states:
                        grew = len(after) > peak
                        states[after] = (max(peak, len(after)), 0 if grew else since + 1)
            if not states:
                break                   # (nothing more can come)
            beam = sorted(((after, peak, since) for after, (peak, since) in states.items()),
                          key=lambda state: (state[2], -len(state[0])))[:width]
            most = max(len(state[0]) for state in beam)
            if most > PROBED_STACKS:
                raise GrammarTooLarge(
                    f"the grammar's parse stacks reach {most:,} after {step + 1} "
                    f"character(s) of text; at most {PROBED_STACKS} here (alternatives "
                    "that begin alike each keep one alive, and multiply where they go on "
                    "into the same rule: llama.cpp advances every stack through every "
                    "character of a token, within one call nothing can stop)")
