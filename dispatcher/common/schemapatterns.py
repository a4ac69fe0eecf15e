"""A JSON Schema `pattern` as llama-cpp-python's converter makes a grammar of it that
writes JSON: its escapes and classes in the forms the converter copies into GBNF, what a
JSON string must escape written escaped, its free ends (`anchored`), and a string's
length bounds folded into a pattern that repeats one character (`length_bounded`). Run
in the conversion child (dispatcher.common.schemagrammar)."""
from __future__ import annotations

import re
from dataclasses import dataclass


# what a JSON string may not hold unescaped: the grammar writes a pattern's characters
# as they are, inside the string's quotes
NOT_IN_JSON_STRING = "\\x22\\x5C\\x00-\\x1F"
# ... as code points, and the escape JSON text writes each with (json.dumps's forms)
JSON_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n",
                0x0D: "\\r", 0x09: "\\t"}


def _escaped_in_json(point: int) -> bool:
    return point < 0x20 or point in (0x22, 0x5C)


def _json_escape(point: int) -> str:
    """A group matching the JSON text of the character at `point`, one class a
    character (the converter splits literals where a quantifier might follow)."""
    text = JSON_ESCAPES.get(point) or f"\\u{point:04x}"
    return "(" + "".join(f"[\\x{ord(c):02X}]" for c in text) + ")"


def _json_escapes(points: list[int]) -> str:
    """A group matching the JSON text of any of the characters at `points` (each one's
    escape: a backslash, then its letter or `u00` and two hex digits), the backslash
    once, so that llama.cpp meets one choice where the class stands, not one a
    character."""
    short = "".join(_grammar_char(ord(JSON_ESCAPES[p][1])) for p in points
                    if p in JSON_ESCAPES)
    by_high: dict[int, str] = {}
    for point in points:
        if point not in JSON_ESCAPES:
            by_high[point >> 4] = by_high.get(point >> 4, "") + f"{point & 15:x}"
    after = [f"[{short}]"] if short else []
    if by_high:
        after.append("[u][0][0](" + "|".join(f"[{high:x}][{lows}]" for high, lows
                                            in sorted(by_high.items())) + ")")
    return "[\\x5C](" + "|".join(after) + ")"


def _ranges_text(ranges) -> str:
    """Code point ranges as a grammar class's text."""
    return "".join(_grammar_char(low) if low == high else
                   f"{_grammar_char(low)}-{_grammar_char(high)}" for low, high in ranges)


def _grammar_char(point: int) -> str:
    """The character at `point` as a grammar class writes it: as it is where that
    cannot be read otherwise."""
    if 0x20 <= point < 0x7F and chr(point) not in "\\]-[^\"":
        return chr(point)
    if point < 0x100:
        return f"\\x{point:02X}"
    return f"\\u{point:04X}" if point < 0x10000 else f"\\U{point:08X}"


# a regular expression's classes the converter copies into the grammar as they are, and
# GBNF has no such escapes: the sets they stand for outside a class
CLASS_ESCAPES = {"d": "[0-9]", "w": "[0-9A-Za-z_]",
                 "s": "[ ]",             # (a tab or line break is an escape in JSON text)
                 "D": f"[^{NOT_IN_JSON_STRING}0-9]",
                 "W": f"[^{NOT_IN_JSON_STRING}0-9A-Za-z_]",
                 "S": None}
# JavaScript's \\s (\\S is everything else)
WHITESPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
              (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
              (0xFEFF, 0xFEFF))
# (\\S leaves out every space JavaScript's \\s names, not the ASCII ones alone: it wrote
# a no-break space, U+2028, U+3000 where the schema asked for none)
CLASS_ESCAPES["S"] = "[^" + NOT_IN_JSON_STRING + "".join(
    _grammar_char(low) + (f"-{_grammar_char(high)}" if high > low else "")
    for low, high in WHITESPACE if low >= 0x20) + "]"


def _complement(ranges) -> tuple[tuple[int, int], ...]:
    """Every code point outside the sorted, disjoint `ranges`."""
    out, low = [], 0
    for start, end in ranges:
        if low < start:
            out.append((low, start - 1))
        low = end + 1
    return tuple(out + [(low, 0x10FFFF)])


# ... the sets inside a class, as code point ranges (`[\\s\\S]`: anything but
# whitespace other than the space, as \\s is a space here)
DIGITS, WORD = ((0x30, 0x39),), ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
CLASS_RANGES = {"d": DIGITS, "w": WORD, "s": ((0x20, 0x20),), "D": _complement(DIGITS),
                "W": _complement(WORD), "S": _complement(WHITESPACE)}
# escapes of one character (a regular expression's, JavaScript's)
LETTER_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}          # (`\\U`: Python's, and GBNF's)


@dataclass(frozen=True)
class Atom:
    """One character of a pattern, or one escape: a character's code point (`point`),
    a `\\d`-like class's letter (`letter`), or an escape left to the converter as it
    is (`raw`: `\\b`, `\\p`, a back-reference); `end`: where the next atom starts."""
    end: int
    point: int | None = None
    letter: str | None = None
    raw: str | None = None


def _atom(pattern: str, i: int, in_class: bool = False) -> Atom:
    c = pattern[i]
    if c != "\\" or i + 1 == len(pattern):
        return Atom(i + 1, point=ord(c))
    e = pattern[i + 1]
    size = HEX_ESCAPES.get(e)
    if size is not None:
        digits = pattern[i + 2:i + 2 + size]
        if len(digits) == size and all(d in "0123456789abcdefABCDEF" for d in digits) \
                and int(digits, 16) <= 0x10FFFF:
            return Atom(i + 2 + size, point=int(digits, 16))
    if e in CLASS_ESCAPES:
        return Atom(i + 2, letter=e)
    if e == "0" and pattern[i + 2:i + 3].isdigit():
        return Atom(i + 2, raw=pattern[i:i + 2])        # (an octal escape: refused)
    if e in LETTER_ESCAPES or (e == "b" and in_class):  # (`[\\b]`: a backspace)
        return Atom(i + 2, point=LETTER_ESCAPES.get(e, 0x08))
    if e.isascii() and not e.isalnum():
        return Atom(i + 2, point=ord(e))
    return Atom(i + 2, raw=pattern[i:i + 2])


def _less(ranges: list[tuple[int, int]], points: list[int]) -> list[tuple[int, int]]:
    """The ranges (inclusive) less the sorted `points`."""
    kept = []
    for low, high in ranges:
        for point in points:
            if low <= point <= high:
                if low < point:
                    kept.append((low, point - 1))
                low = point + 1
        if low <= high:
            kept.append((low, high))
    return kept


def _class(pattern: str, i: int) -> tuple[str, int] | None:
    """The class at `i` (a `[`) as the grammar may hold it, and where it ends; None
    where it does not end (the converter says so). A negated class leaves out what a
    JSON string may not hold unescaped; a class with a quote, a backslash or a control
    character becomes a group of the class without them and their JSON escapes."""
    j, negated = i + 1, pattern.startswith("[^", i)
    j += negated
    parts, ranges, exact = [], [], True
    while j < len(pattern) and pattern[j] != "]":   # (to the next "]", as the converter)
        atom = _atom(pattern, j, in_class=True)
        j = atom.end
        if atom.point is not None and pattern.startswith("-", j) \
                and j + 1 < len(pattern) and pattern[j + 1] != "]":
            upper = _atom(pattern, j + 1, in_class=True)
            if upper.point is not None:
                parts.append(f"{_grammar_char(atom.point)}-{_grammar_char(upper.point)}")
                ranges.append((atom.point, upper.point))
                j = upper.end
                continue
        if atom.point is not None:
            parts.append(_grammar_char(atom.point))
            ranges.append((atom.point, atom.point))
        elif atom.letter is not None:
            parts.append(_ranges_text(CLASS_RANGES[atom.letter]))
            ranges.extend(CLASS_RANGES[atom.letter])
        else:
            parts.append(atom.raw)
            exact = False                           # (left for the converter to refuse)
    if j >= len(pattern):
        return None
    if not parts and not negated:
        raise ValueError("an empty class [] matches nothing")
    if negated:
        return "[^" + NOT_IN_JSON_STRING + "".join(parts) + "]", j + 1
    escaped = sorted({p for low, high in ranges for p in range(low, min(high, 0x5C) + 1)
                      if _escaped_in_json(p)})
    if not exact or not escaped:
        return "[" + "".join(parts) + "]", j + 1
    kept = _ranges_text(_less(ranges, escaped))
    choices = ([f"[{kept}]"] if kept else []) + [_json_escapes(escaped)]
    return "(" + "|".join(choices) + ")", j + 1


def _scan(pattern: str):
    """(index, character, groups open before it, inside a class) of each character of
    `pattern`; an escape as one, its letter after the backslash at the backslash's
    index (a class ends at its first `]`, as the converter reads it)."""
    depth, in_class, i = 0, False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            yield i, "\\" + pattern[i + 1:i + 2], depth, in_class
            i += 2
            continue
        yield i, c, depth, in_class
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c in "()":
            depth += 1 if c == "(" else -1
        i += 1


def _structure(pattern: str):
    """(index, character, groups open before it) of each character of `pattern` outside
    every class and escape."""
    return ((i, c, depth) for i, c, depth, in_class in _scan(pattern)
            if not in_class and c != "[" and not c.startswith("\\"))


def _choices(pattern: str) -> list[str]:
    """`pattern` split at each `|` outside every group and class."""
    out, last = [], 0
    for i, c, depth in _structure(pattern):
        if c == "|" and depth == 0:
            out.append(pattern[last:i])
            last = i + 1
    return out + [pattern[last:]]


def _free_ends(choice: str) -> str:
    """One choice of a pattern without its anchors, each free end `.*`."""
    start = choice.startswith("^")
    body = choice[1:] if start else choice
    end = body.endswith("$") and (len(body) - len(body[:-1].rstrip("\\")) - 1) % 2 == 0
    body = body[:-1] if end else body
    if not body:
        return "" if start and end else ".*"
    return ("" if start else ".*") + body + ("" if end else ".*")


# a group that names what it captures, ECMA-262's `(?<name>` and Python's `(?P<name>`
NAMED_GROUP = re.compile(r"\(\?P?<[A-Za-z_$][\w$]*>")


def _group_start(pattern: str, i: int) -> int:
    """Where the group opening at `i` (a `(`) starts its inside: after `(`, `(?:` or a
    name (what a group captures is nothing to a grammar)."""
    if pattern.startswith("(?:", i):
        return i + 3
    named = NAMED_GROUP.match(pattern, i)
    return named.end() if named else i + 1


def _unwrapped(pattern: str) -> str:
    """`pattern` without groups around the whole of it (`(^\\d+$)` is `^\\d+$`)."""
    closes, opened = {}, []              # each group's `(` → its `)`, in one pass
    for i, c, _ in _structure(pattern):
        if c == "(":
            opened.append(i)
        elif c == ")" and opened:
            closes[opened.pop()] = i
    low, high = 0, len(pattern)          # (peeled in place: 2,000 groups, one pass)
    while low < high and pattern[low] == "(" and closes.get(low) == high - 1:
        start = _group_start(pattern, low)
        if start == low + 1 and pattern.startswith("(?", low):
            break                        # (a lookaround or a flag: not a group's inside)
        low, high = start, high - 1
    return pattern[low:high]


# what a pattern may ask that no grammar writes, by the escape's letter
NO_GRAMMAR_ESCAPES = {"b": "a word boundary (\\b)", "B": "a word boundary (\\B)",
                      "p": "a Unicode property (\\p{…})", "P": "a Unicode property (\\P{…})",
                      "k": "a back-reference (\\k<…>)"}
GROUP_KINDS = {"(?=": "a lookahead (?=…)", "(?!": "a lookahead (?!…)",
               "(?<=": "a lookbehind (?<=…)", "(?<!": "a lookbehind (?<!…)"}


def _anchor_ends(pattern: str) -> set[int]:
    """Where `^` and `$` may stand in the (unwrapped) `pattern`: at its choices' ends."""
    ends, start = set(), 0
    for choice in _choices(pattern):
        if choice.startswith("^"):
            ends.add(start)
        body = choice[1:] if choice.startswith("^") else choice
        if body.endswith("$") and (len(body) - len(body[:-1].rstrip("\\")) - 1) % 2 == 0:
            ends.add(start + len(choice) - 1)
        start += len(choice) + 1
    return ends


def unsupported(pattern: str) -> str | None:
    """What in `pattern` no grammar can write, named (None: nothing): a word boundary,
    a Unicode property, a back-reference, a lookaround, an inline flag (`(?i)`), or an
    anchor anywhere but at the ends of the pattern's choices (the converter wrote `\\b`
    as an escape the grammar refused, read `\\p{L}` as a quantifier, and an anchor
    inside a group as a character)."""
    body = _unwrapped(pattern)
    ends, name_end = _anchor_ends(body), 0
    for i, c, _, in_class in _scan(body):
        if i < name_end:
            continue                     # (a group's name: `$` may be in it)
        e = c[1:] if c.startswith("\\") else None
        if e is not None and (e in ("p", "P") or (e.isdigit() and e != "0") or
                              (not in_class and e in NO_GRAMMAR_ESCAPES)):
            return NO_GRAMMAR_ESCAPES.get(e, f"a back-reference (\\{e})")
        if in_class or e is not None:
            continue
        if c == "(":
            name_end = _group_start(body, i)
        if c == "(" and body.startswith("(?", i) and name_end == i + 1:
            kind = next((k for k in GROUP_KINDS if body.startswith(k, i)), None)
            return GROUP_KINDS[kind] if kind else f"an inline flag or group kind " \
                f"({body[i + 1:i + 3]}…)"
        if c in "^$" and i not in ends:
            return f"an anchor ({c}) inside the pattern, not at an end of it or of one " \
                "of its top-level choices"
    return None


def anchored(pattern: str) -> str:
    """A JSON Schema `pattern` as the converter takes it, `^…$`: JSON Schema's patterns
    match anywhere in the string (ECMA-262's search), and the converter refused any
    without both anchors, so `\\d+` (pydantic's `Field(pattern=...)` as often written)
    was a 400. The free ends become `.*` (`abc` is `^.*abc.*$`), each choice's on its own
    (`^a$|^b$`, `^\\d{5}$|^\\d{5}-\\d{4}$`: the converter took the first `^` and the last
    `$` off and wrote the others as characters, invalid JSON), and groups around the
    whole pattern are taken off first (`(^a$|^b$)`)."""
    pattern = _unwrapped(pattern)
    choices = _choices(pattern)
    if len(choices) == 1:
        return "^" + _free_ends(pattern) + "$"
    return "^(?:" + "|".join(map(_free_ends, choices)) + ")$"


# a pattern of one character repeated, `^[a-z]+$`, `^\\w{2,8}$` (the atom, the quantifier)
ONE_CHARACTER_REPEATED = re.compile(
    r"\^(\[(?:\\.|[^\]\\])+\]|\\[dwsDWS]|\.|[^\\\[\](){}|*+?.^$])"
    r"(\*|\+|\?|\{\s*\d+\s*\}|\{\s*\d+\s*,\s*\d*\s*\})\$")


def _quantifier_bounds(quantifier: str) -> tuple[int, int | None]:
    if quantifier in "*+?":
        return {"*": (0, None), "+": (1, None), "?": (0, 1)}[quantifier]
    numbers = [n.strip() for n in quantifier[1:-1].split(",")]
    least = int(numbers[0])
    if len(numbers) == 1:
        return least, least
    return least, int(numbers[1]) if numbers[1] else None


def length_bounded(pattern: str, least: int, most: int | None) -> str | None:
    """A pattern of one character repeated (`^[a-z]+$`) with a string's `minLength`
    and `maxLength` folded into its quantifier (`^[a-z]{1,20}$`): the converter takes
    the pattern and leaves the lengths out, so pydantic's `constr(pattern=...,
    max_length=20)` wrote strings of any length. None for any other pattern (the
    lengths are then left out, as the converter and llama-server leave them)."""
    match = ONE_CHARACTER_REPEATED.fullmatch(pattern)
    if match is None:
        return None
    low, high = _quantifier_bounds(match.group(2))
    low = max(low, least)
    high = most if high is None else high if most is None else min(high, most)
    if high is not None and low > high:
        raise ValueError(f"no string of {least}..{most} characters matches the pattern "
                         f"{pattern[:48]}")
    return f"^{match.group(1)}{{{low},{'' if high is None else high}}}$"


# ECMA's idioms for characters past U+FFFF as surrogate classes: a high surrogate and a
# range of low ones (`\uD83D[\uDE00-\uDE4F]`: U+1F600-U+1F64F), and every high one
# before every low one (`[\uD800-\uDBFF][\uDC00-\uDFFF]`: U+10000-U+10FFFF)
_SURROGATE_RANGE = re.compile(
    r"\\u(D[89AB][0-9A-F]{2})\[\\u(D[C-F][0-9A-F]{2})-\\u(D[C-F][0-9A-F]{2})\]"
    r"|\[\\u(D[89AB][0-9A-F]{2})-\\u(D[89AB][0-9A-F]{2})\]\[\\u(DC00)-\\u(DFFF)\]"
    r"|\\.", re.I | re.S)                          # (any other escape, read whole)


def _astral(high: str, low: str) -> int:
    return 0x10000 + ((int(high, 16) - 0xD800) << 10) + int(low, 16) - 0xDC00


def _astral_range(match: re.Match) -> str:
    if not match.group(1) and not match.group(4):
        return match.group(0)
    if match.group(1):
        low, high = _astral(match.group(1), match.group(2)), \
            _astral(match.group(1), match.group(3))
    else:
        low, high = _astral(match.group(4), match.group(6)), \
            _astral(match.group(5), match.group(7))
    return f"[\\U{low:08X}-\\U{high:08X}]"


# a surrogate pair's escapes, or any other escape (read whole: `\\\\uD83D` is an escaped
# backslash, then text)
_SURROGATE_PAIR = re.compile(r"\\u(D[89AB][0-9A-F]{2})\\u(D[C-F][0-9A-F]{2})|\\.",
                             re.I | re.S)


# a lazy quantifier (`+?`, `*?`, `??`, `{2,3}?`): in a whole match the same strings as
# the greedy one, and the converter read its `?` as "optional" (`^a+?$` took "")
_LAZY = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|([*+?]|\{\d+(?:,\d*)?\})\?", re.S)


def converter_pattern(pattern: str) -> str:
    """A JSON Schema `pattern` in the forms llama-cpp-python's converter turns into a
    grammar that parses and writes JSON text: `\\d`, `\\w`, `\\s` (and their negations
    outside a class) as classes, an escaped punctuation mark as a class of its `\\xHH`
    (`\\.`, `\\-`, `\\/`: copied as they were, GBNF knows no such escapes), and a
    non-capturing group `(?:` as a group (the converter refuses `?` there; what a group
    captures is nothing to a grammar). What a JSON string may not hold unescaped (a
    quote, a backslash, control characters), wherever the pattern asks for it (`"`,
    `\\n`, `\\x22`, `[\\\\"]`, `[ -~]`), is written as JSON text escapes it; a `.` or a
    negated class (`[^@]`) leaves it out: written as they are, they ended the string
    early or made it invalid JSON. For the same reason `\\s` is a space (a tab or a line
    break is an escape in JSON text). Anything else is left for the converter to take
    or refuse. A surrogate pair's escapes (`\\uD83D\\uDE00`, as JSON Schema's ECMA
    patterns write a character past U+FFFF) are that character (two classes of one
    surrogate each no text could meet)."""
    pattern = _SURROGATE_PAIR.sub(
        lambda m: chr(0x10000 + ((int(m.group(1), 16) - 0xD800) << 10)
                      + int(m.group(2), 16) - 0xDC00) if m.group(1) else m.group(0),
        pattern)
    pattern = _SURROGATE_RANGE.sub(_astral_range, pattern)
    pattern = _LAZY.sub(lambda m: m.group(1) or m.group(0), pattern)
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "[":
            made = _class(pattern, i)
            if made is None:
                out.append(pattern[i:])
                break
            out.append(made[0])
            i = made[1]
            continue
        if c == ".":
            out.append(f"[^{NOT_IN_JSON_STRING}]")
            i += 1
            continue
        if c == "(":                    # (`(?:` and named groups too)
            out.append("(")
            i = _group_start(pattern, i)
            continue
        if c == "{":                    # a quantifier, to its "}" (as the converter reads it)
            end = pattern.find("}", i)
            end = len(pattern) if end < 0 else end + 1
            out.append(pattern[i:end])
            i = end
            continue
        if c in "]}":                   # (a literal, as JavaScript reads it: the converter's
            out.append(f"[\\x{ord(c):02X}]")     # literal loop stood still on it until cut off)
            i += 1
            continue
        atom = _atom(pattern, i)
        if atom.letter is not None:
            out.append(CLASS_ESCAPES[atom.letter])
        elif atom.point is not None and _escaped_in_json(atom.point):
            out.append(_json_escape(atom.point))
        elif atom.point is not None and c == "\\":
            # (a class of one: the converter splits an escape's characters where a
            # quantifier might follow, `\\u00e9?` into "\\u00e" "9"?)
            out.append(f"[{_grammar_char(atom.point)}]")
        else:
            out.append(pattern[i:atom.end])
        i = atom.end
    return "".join(out)


# choices nested repetitions leave open at once: llama.cpp keeps a parse stack for each
# way the text so far splits among them (`(a{0,100}){0,100}`: a token's check took 1.1 s)
MAX_NESTED_CHOICES = 2500
_BOUNDED = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")


def nested_choices(pattern: str) -> int:
    """The most ways one chain of nested bounded repetitions can count, the product of
    each one's (most - least + 1) (`([a-z]{1,50} ?){1,50}`: 50 × 50). Unbounded ones
    (`*`, `+`, `{m,}`) count 1: the grammar's own check bounds their stacks."""
    frames, last, i = [1], 1, 0          # the most found in each open group; the last atom's
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            last, i = 1, i + 2
            continue
        if c == "[":
            end = pattern.find("]", i + 2)
            last, i = 1, (len(pattern) if end < 0 else end + 1)
            continue
        if c == "(":
            frames.append(1)
        elif c == ")" and len(frames) > 1:
            last = frames.pop()
            frames[-1] = max(frames[-1], last)
        elif c == "{" and (match := _BOUNDED.match(pattern, i)) is not None:
            low, comma, high = match.groups()
            span = int(high) - int(low) + 1 if comma and high else 1
            frames[-1] = max(frames[-1], span * last)
            last, i = 1, match.end()
            continue
        else:
            last = 1
        i += 1
    return max(frames[0], last)
