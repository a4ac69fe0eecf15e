"""How many parse stacks llama.cpp holds as text comes, probed before it sees a grammar.

`grammar_cost.stack_width` bounds what one position of the rules expands into; not the
stacks that several alternatives keep alive together, which multiply where they go on
into the same rule. `check_growth` feeds the stacks, simulated as llama.cpp's
advance_stack and accept make them, the text that keeps the most alive.
"""
from __future__ import annotations

from dispatcher.common.grammar_cost import MAX_STACKS
from dispatcher.common.grammar_rules import (
    CHAR, CHAR_ALT, CHAR_ANY, CHAR_NOT, CHAR_RNG_UPPER, RULE_REF, TOKEN, TOKEN_NOT,
    GrammarTooLarge, alternatives, ends)

# The growth probe (`check_growth`): symbols it feeds the grammar's stacks, and the
# elementary steps (a stack advanced, a class tested) it may take before it gives up
GROWTH_SYMBOLS = 48
GROWTH_WORK = 1_000_000
GROWTH_BEAM = 8                     # ... following the inputs that keep the most alive
GROWTH_PLATEAU = 12                 # ... while they grow within this many characters
# characters tried against a negated class (one outside it, to feed it)
_PROBES = (ord("a"), ord("0"), ord(" "), ord('"'), ord("{"), ord("\n"), ord("_"), 0x4E00,
           0x10FFFF)


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
    """Whether the leaf takes `symbol`: a character (>= 0), or a token (-1 - its id)."""
    kind, value, _ = leaf
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


def _feeds(leaf: tuple) -> list[int]:
    """Symbols that the leaf takes (a few)."""
    kind, value, _ = leaf
    if kind == TOKEN:
        return [-1 - value]
    if kind == TOKEN_NOT:
        return [-2 - value]
    if kind == CHAR_ANY:
        return [ord("a")]
    if kind == CHAR:
        return [low for low, _ in value[:4]]
    return [c for c in _PROBES if _matches(leaf, c)][:1]


def check_growth(rules: list, root: int) -> None:
    """GrammarTooLarge where llama.cpp would hold more than MAX_STACKS parse stacks at
    once within GROWTH_SYMBOLS characters (or tokens) of text, fed as it would be: a
    beam of the GROWTH_BEAM inputs whose stacks grew last and most, each with every
    symbol some stack's top takes, one that has not grown for GROWTH_PLATEAU dropped;
    from the grammar's start, and from the start of every rule whose alternatives begin
    alike. `a ::= [ -~] a "A" | [ -~] a "B" | ...` (k alternatives) multiplies the stacks
    by k at every character, within one token's accept (64 of them: 4,096 stacks at the
    second character of " The", 3.7 s; the third, hours), which no guard after the
    accept can stop. Every refusal is such an input, found; a probe, not a proof (stacks
    that double every seven characters or slower pass it, left to the guard at
    generation); one past GROWTH_WORK steps refuses the grammar as too costly to check."""
    alts = {}
    leaves: dict[tuple[int, int], tuple] = {}
    work = 0

    def advance(stack: tuple, out: set) -> None:
        nonlocal work
        todo = [stack]
        while todo:
            top = todo.pop()
            work += 1
            if work > GROWTH_WORK:
                raise GrammarTooLarge(
                    "the grammar's parse stacks are too costly to check (over "
                    f"{GROWTH_WORK:,} steps for {GROWTH_SYMBOLS} characters)")
            if not top:
                out.add(top)
                continue
            r, i = top[-1]
            kind, ref = rules[r][i]
            if kind != RULE_REF:
                out.add(top)
                continue
            base = top[:-1] if ends(rules[r][i + 1]) else top[:-1] + ((r, i + 1),)
            if ref not in alts:
                alts[ref] = alternatives(rules[ref])
            for start, end in alts[ref]:
                todo.append(base + ((ref, start),) if start != end else base)

    seen: dict[frozenset, dict[int, frozenset]] = {}

    def fed(stacks: frozenset) -> dict[int, frozenset]:
        """The stacks each symbol that some top takes leaves, advanced (once a state)."""
        if stacks not in seen:
            seen[stacks] = feed(stacks)
        return seen[stacks]

    def feed(stacks: frozenset) -> dict[int, frozenset]:
        nonlocal work
        classes: dict[tuple, None] = {}
        for stack in stacks:
            if stack:
                top = stack[-1]
                if top not in leaves:
                    leaves[top] = _leaf(rules[top[0]], top[1])
                classes[leaves[top][:2]] = None
        out = {}
        for symbol in {c for kind, value in classes for c in _feeds((kind, value, 0))}:
            work += len(classes)
            going_on = set()            # (the stacks it leaves, each advanced once)
            for stack in stacks:
                if stack and _matches(leaves[stack[-1]], symbol):
                    r, _ = stack[-1]
                    j = leaves[stack[-1]][2]
                    going_on.add(stack[:-1] if ends(rules[r][j])
                                 else stack[:-1] + ((r, j),))
            after: set = set()
            for stack in going_on:
                advance(stack, after)
            out[symbol] = frozenset(after)
        return out

    def starting(rule: int) -> frozenset:
        out: set = set()
        if rule not in alts:
            alts[rule] = alternatives(rules[rule])
        for start, end in alts[rule]:
            advance(((rule, start),) if start != end else (), out)
        return frozenset(out)

    def ambiguous(stacks: frozenset) -> bool:
        """Whether one symbol is taken by two of the stacks."""
        leafs = []
        for stack in stacks:
            if stack:
                top = stack[-1]
                if top not in leaves:
                    leaves[top] = _leaf(rules[top[0]], top[1])
                leafs.append(leaves[top])
        for symbol in {c for leaf in leafs for c in _feeds(leaf)}:
            if sum(_matches(leaf, symbol) for leaf in leafs) > 1:
                return True
        return False

    # from the start, and from the start of every rule where two alternatives begin
    # alike (with nothing under it: a fixed prefix, `root ::= "b"{48} a`, hid `a` from a
    # probe from the start alone)
    reach, todo = {root}, [root]
    while todo:
        for kind, value in rules[todo.pop()]:
            if kind == RULE_REF and value not in reach:
                reach.add(value)
                todo.append(value)
    probes = [starting(root)] + [stacks for stacks in map(starting, sorted(reach - {root}))
                                 if ambiguous(stacks)]
    for stacks in dict.fromkeys(probes):
        # (stacks, the most its input's stacks have been, characters since): the inputs
        # whose stacks grew last go on first, the largest first; one that has not grown
        # for GROWTH_PLATEAU characters is dropped (a wide but steady grammar, whose
        # stacks never multiply, is not fed for long)
        beam = [(stacks, len(stacks), 0)]
        for step in range(GROWTH_SYMBOLS):
            states = {}
            for stacks, peak, since in beam:
                for after in fed(stacks).values():
                    if after and after not in states:
                        grew = len(after) > peak
                        states[after] = (max(peak, len(after)), 0 if grew else since + 1)
            beam = sorted(((after, peak, since) for after, (peak, since) in states.items()
                           if since <= GROWTH_PLATEAU),
                          key=lambda state: (state[2], -len(state[0])))[:GROWTH_BEAM]
            if not beam:
                break                   # (nothing more can come, or nothing grows)
            most = max(len(state[0]) for state in beam)
            if most > MAX_STACKS:
                raise GrammarTooLarge(
                    f"the grammar's parse stacks reach {most:,} after {step + 1} "
                    "character(s) of text (alternatives that begin alike each keep one "
                    "alive, and multiply where they go on into the same rule); at most "
                    f"{MAX_STACKS} here (llama.cpp advances every stack for every "
                    "character of a token, within one call nothing can stop)")
