"""What the rules of a parsed grammar would cost llama.cpp, checked before it sees them.

Two costs: its left-recursion check (llama_grammar_detect_left_recursion recurses along
the rules' leftmost references, without remembering what it cleared inside a descent:
a chain of 75,000 references overflowed a worker's stack, and rules that each begin with
two references to the next take it 2^n calls), and its parse stacks, the most it can hold
at one position of the text, each of which every sampled token advances and every
rejected pick tests the whole vocabulary against. Both are worked out here without
recursion, and bounded.
"""
from __future__ import annotations

from dispatcher.common.grammar_rules import (
    CHAR, CHAR_ALT, CHAR_ANY, CHAR_NOT, CHAR_RNG_UPPER, RULE_REF, TOKEN, TOKEN_NOT,
    GrammarError, GrammarRefused, GrammarTooLarge, alternatives, ends)

MAX_LEFT_DEPTH = 2_000              # nested calls of llama.cpp's left-recursion check
MAX_LEFT_CALLS = 100_000            # ... and calls in all
# Parse stacks llama.cpp may hold at once, and the character-class elements they test:
# each sampled token advances every stack (its de-duplication compares each new stack
# with the others: ~stacks³ work), and a rejected pick tests every token of the
# vocabulary against every stack's class (`root ::= x x`, x 4,000 one-character
# alternatives, took 165 s a token).
MAX_STACKS = 256
MAX_STACK_ELEMENTS = 1024
LEAVES = (CHAR, CHAR_NOT, CHAR_ANY, TOKEN, TOKEN_NOT)
CAP = 10 ** 9                       # counts past any budget stay here (no huge integers)


def _many(count: int) -> str:
    return "unboundedly many" if count >= CAP else f"{count:,}"


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
        for a, (start, end) in enumerate(alternatives(rule)):
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
                stacks, elements = min(s + stacks, CAP), min(e + elements, CAP)
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
            return min(stacks + 1, CAP), min(elements + _class_length(rule, j), CAP)
        stacks, elements = min(stacks + first[value][0], CAP), \
            min(elements + first[value][1], CAP)
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
        for start, end in alternatives(rule):
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
                for start, end in alternatives(rule):
                    s, e = _start_width(rule, start, end, first, empty)
                    stacks, elements = min(stacks + s, CAP), min(elements + e, CAP)
                first[r] = (stacks, elements)
                state[r] = 2
                stack.pop()
    return first


def strong_components(n: int, edges: list[list[tuple[int, int]]]) -> list[list[int]]:
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


def reachable(rules: list, root: int) -> list[bool]:
    """Which rules the root's references reach."""
    reach, todo = [False] * len(rules), [root]
    reach[root] = True
    while todo:
        for kind, value in rules[todo.pop()]:
            if kind == RULE_REF and not reach[value]:
                reach[value] = True
                todo.append(value)
    return reach


def stack_width(rules: list, root: int, names: dict) -> tuple[int, int]:
    """The most parse stacks llama.cpp can hold at one position of this grammar, and the
    most character-class elements they test together (both capped at CAP: unbounded).

    At a leaf (a character class at position i of rule r) that accepts, the stack goes on
    with what follows it in r and, where all of that may be empty, with what follows r
    where it was referenced (`up`): `up[r]` is the most stacks a finished r gives, the
    longest path over the references that end their alternative's non-empty part. A
    cycle of such references that adds stacks on the way (`r ::= "a" r y`, y optional)
    grows with the nesting: unbounded."""
    n = len(rules)
    empty = _nullable(rules)
    first = _firsts(rules, empty, names)
    reach = reachable(rules, root)
    suffix = {}
    base = [(0, 0)] * n                           # up[] from references not at an end
    tails: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # u -> (r, (s, e))
    weights: dict[tuple[int, int], tuple[int, int]] = {}
    for u in range(n):
        if not reach[u]:
            continue
        rule = rules[u]
        for start, end in alternatives(rule):
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
    for comp in strong_components(n, tails):
        members = set(comp)
        s_in = max(up[v][0] for v in comp)
        e_in = max(up[v][1] for v in comp)
        grows = False
        for u in comp:
            for r, _ in tails[u]:
                if r in members and weights[(u, r)] != (0, 0):
                    grows = True
        if grows and s_in + e_in > 0 and any(reach[v] for v in comp):
            s_in = e_in = CAP
        for v in comp:
            up[v] = (s_in, e_in)
        for u in comp:
            for r, _ in tails[u]:
                if r not in members:
                    w = weights[(u, r)]
                    up[r] = (max(up[r][0], min(up[u][0] + w[0], CAP)),
                             max(up[r][1], min(up[u][1] + w[1], CAP)))
    stacks = first[root][0] + (1 if empty[root] else 0)
    elements = first[root][1]
    for (u, start), after in suffix.items():
        rule = rules[u]
        for j in range(start, len(rule)):
            kind = rule[j][0]
            if ends(rule[j]):
                break
            if kind not in LEAVES:
                continue
            k = j + _class_length(rule, j)
            s, e, rest_empty = after.get(k, (0, 0, True))
            if rest_empty:
                s, e = min(s + up[u][0], CAP), min(e + up[u][1], CAP)
            stacks, elements = max(stacks, s), max(elements, e)
    return stacks, elements


def check_left_recursion(rules: list, names: dict) -> None:
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
            if ends(element):
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
                recurse = ends(rule[i])
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


def check_costs(rules: list, root: int, names: dict) -> None:
    """GrammarError for left recursion (llama.cpp does not support it), GrammarRefused
    for one through rules that may be empty (llama.cpp's own check misses it and would
    loop), GrammarTooLarge where its left-recursion check would go too deep or too
    often, or where more parse stacks (or character-class elements) than this server
    allows could be held at once."""
    check_left_recursion(rules, names)
    stacks, elements = stack_width(rules, root, names)
    if stacks > MAX_STACKS or elements > MAX_STACK_ELEMENTS:
        raise GrammarTooLarge(
            f"the grammar can hold {_many(stacks)} parse stacks testing "
            f"{_many(elements)} character-class elements at one position; at most "
            f"{MAX_STACKS} stacks and {MAX_STACK_ELEMENTS} elements here (llama.cpp "
            "tests every candidate token against every stack: write a long "
            "alternation of single characters as one [...] class, and keep "
            "alternatives that share a beginning together, like \"a\" (\"b\" | \"c\"))")
