"""JSON schemas made into GBNF grammars in the front end, each within a budget.

llama-cpp-python's converter (`llama_cpp.llama_grammar`, a port of llama.cpp's
json-schema-to-grammar.py) does work that grows much faster than the schema's text: its
optional properties are joined pairwise (8,000 of them took 278 s), a `pattern`
quantifier copies its literal that many times (`\\a{100000002}`, 90 bytes, asked for
gigabytes), and it holds the GIL throughout. So a schema is converted in two guarded
steps, neither of them in a worker:

1. `estimate` walks the schema and adds up what the converter will do (properties and
   their names, optional properties squared, repetition counts, `pattern` quantifiers
   and the literals they copy, enum values, `$ref`s); a schema over `MAX_WORK`, or with
   one count over `MAX_REPETITION`, is refused with a message naming the construct.
2. `convert` runs the converter in a child process (`python -m
   dispatcher.common.schemagrammar`) with an address-space and CPU limit and a wall
   deadline, so that a shape nobody counted costs one child process, never a loop, a
   worker or another request. The grammar it returns is then checked like any other
   (`dispatcher.common.grammar.check`: size, parse stacks).

The converter module is loaded from llama-cpp-python's files without importing the
package (whose `__init__` loads the native library): it needs only the standard library.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

from dispatcher.common import grammar as gbnf, intrange

MAX_WORK = 400_000          # the converter's steps, as `estimate` counts them
MAX_REPETITION = 2000       # one count: minItems, maxLength, a pattern's {n,m} ...
CONVERT_SECONDS = 5.0       # the child's wall deadline (a schema that passed `estimate`
#                             converts in well under a second)
CONVERT_MEMORY = 1 << 30    # the child's address space
CACHE_SIZE = 32             # converted schemas kept per process (n choices, retries)

MAX_PATTERN = 4096          # characters of one `pattern` (real ones are tens to hundreds)

COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
VALUES = ("enum", "const", "default", "examples")   # JSON values, not schemas
# (possessive: no backtracking between the spaces and the digits, linear in the pattern)
_QUANTIFIER = re.compile(r"(?<!\\)\{\s*+(\d*+)\s*+(?:,\s*+(\d*+)\s*+)?\}")
_LITERAL = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\\")


class SchemaRefused(ValueError):
    """The schema cannot be made into a grammar here: the message says why (it may quote
    a bounded part of the schema; it is for the client, never for a log)."""


def _short(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _count(value) -> int:
    """A count keyword's value as the converter takes it (huge ones stay huge)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return 0
    return int(min(max(value, 0), 10 ** 12))


def pattern_work(pattern: str, where: str) -> int:
    """What the converter does for one `pattern`: every `{n,m}` quantifier repeats the
    item before it up to max(n, m) times (a literal item is copied whole that often).
    A pattern over MAX_PATTERN characters is refused before it is read."""
    if len(pattern) > MAX_PATTERN:
        raise SchemaRefused(f"{where} has {len(pattern):,} characters; at most "
                            f"{MAX_PATTERN:,} here.")
    work = len(pattern)
    for match in _QUANTIFIER.finditer(pattern):
        low, high = match.group(1), match.group(2)
        for digits in (low, high):
            if digits and (len(digits) > 6 or int(digits) > MAX_REPETITION):
                raise SchemaRefused(
                    f"{where}: the quantifier {_short(match.group(0), 24)} repeats more "
                    f"than {MAX_REPETITION} times (the grammar copies its item that often).")
        times = max(int(low or 0), int(high or 0)) + 1
        # the item before it: a literal run is copied whole, a group is named once
        start = end = match.start()
        while start > 0 and pattern[start - 1] in _LITERAL:
            start -= 1
        work += times * (max(end - start, 1) + 8)
    return work


def estimate(schema: object) -> int:
    """The converter's work for `schema`, in steps (refused past MAX_WORK or any count
    past MAX_REPETITION). Iterative, as deep as JSON allows."""
    work = 0
    # (node, path, name, whether it is a value, not a schema: under `enum`, `const`,
    # `default`, `examples`, whose keys mean nothing to the converter)
    stack: list[tuple[object, str, int, bool]] = [(schema, "json_schema", 4, False)]
    while stack:
        node, path, name, value = stack.pop()
        if isinstance(node, (list, dict)) and (value or isinstance(node, list)):
            items = list(node.items() if isinstance(node, dict) else enumerate(node))
            work += len(items) + (sum(len(v) for _, v in items if isinstance(v, str))
                                  if value else 0)     # (a value's text becomes a literal)
            if work > MAX_WORK:
                raise _too_large(path)
            stack.extend((item, f"{path}[{_short(str(i), 32)}]", name + 4, value)
                         for i, item in items)
            continue
        if node is True and not value:      # (any value: made a union of every type)
            node = ANY
        if not isinstance(node, dict):
            continue
        work += name                        # each sub-schema is a rule named by its path
        for key in COUNTS:
            times = _count(node.get(key))
            if times > MAX_REPETITION:
                raise SchemaRefused(f"{path}.{key} is at most {MAX_REPETITION} here (the "
                                    "grammar repeats its item that many times).")
            work += times * (name + 2)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            work += pattern_work(pattern, f"{path}.pattern")
        enum = node.get("enum")
        if isinstance(enum, list):
            if not enum:
                raise SchemaRefused(f"{path}.enum is empty: no value could match it.")
            work += 4 * len(enum)
        properties = node.get("properties")
        if isinstance(properties, dict):
            required = node.get("required")
            required = set(r for r in required if isinstance(r, str)) \
                if isinstance(required, list) else set()
            optional = sum(1 for p in properties if p not in required) + \
                (1 if node.get("additionalProperties") not in (None, False) else 0)
            # the converter joins every suffix of the optional properties: n² steps
            work += optional * optional + len(properties)
            if optional * optional > MAX_WORK:
                raise SchemaRefused(
                    f"{path}.properties has {optional} optional properties; at most "
                    f"{int(MAX_WORK ** 0.5)} here (the grammar built from them grows with "
                    "their square).")
            for prop, sub in properties.items():
                label = f"{path}.properties.{_short(str(prop), 32)}"
                work += 2 * (name + len(prop))
                stack.append((sub, label, name + len(prop) + 1, False))
        for key, sub in node.items():
            if key != "properties" and isinstance(sub, (dict, list)):
                stack.append((sub, f"{path}.{_short(str(key), 32)}", name + len(key) + 1,
                               key in VALUES))
        if work > MAX_WORK:
            raise _too_large(path)
    return work


def _too_large(path: str) -> SchemaRefused:
    return SchemaRefused(f"The JSON schema is too large to make into a grammar here (past "
                         f"{path}: at most {MAX_WORK:,} conversion steps).")


def _converter():
    """llama-cpp-python's json_schema_to_gbnf, loaded from its file alone, its literals
    escaping backslashes too: it escaped only quotes and line breaks, so an `enum` or
    `const` string with a backslash (`"C:\\temp"`, `"a\"b"`) made a grammar that did not
    parse, or that wrote invalid JSON (`"c\\d"`)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise SchemaRefused("JSON schemas need llama-cpp-python, which is not installed.")
    path = os.path.join(list(spec.submodule_search_locations)[0], "llama_grammar.py")
    module_spec = importlib.util.spec_from_file_location("_llama_grammar", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if "\\" not in getattr(module, "GRAMMAR_LITERAL_ESCAPES", {"\\": ""}):
        module.GRAMMAR_LITERAL_ESCAPE_RE = re.compile(r'[\r\n"\\]')
        module.GRAMMAR_LITERAL_ESCAPES = {**module.GRAMMAR_LITERAL_ESCAPES, "\\": "\\\\"}
    if hasattr(module, "_build_repetition"):
        module._build_repetition = gbnf_repetition
    converter = getattr(module, "SchemaConverter", None)
    if converter is not None and hasattr(module, "RESERVED_NAMES"):
        converter.visit = _bounded_integers(converter.visit, module.RESERVED_NAMES)
    return module.json_schema_to_gbnf


def _ranged(schema) -> tuple[str, str] | None:
    """(a rule name, its body) for an integer or a number with bounds, or None."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind not in ("integer", "number") or "enum" in schema or "const" in schema \
            or not any(key in schema for key in intrange.BOUNDS):
        return None
    if kind == "integer":
        least, most = intrange.integer_bounds(schema)
        if least is None and most is None:
            return None
        return (f"integer-from-{least}-to-{most}",
                f"({intrange.integer_range(least, most)}) space")
    bounds = intrange.number_bounds(schema)
    if bounds is None or bounds[0] is None and bounds[2] is None:
        return None
    least, least_open, most, most_open = bounds
    return (f"number-from-{least}{'-open' * least_open}-to-{most}{'-open' * most_open}",
            f"({intrange.number_range(bounds)}) space")


def _bounded_integers(visit, reserved):
    """The converter's `visit`, an integer with bounds (`minimum`, ...) made the choice
    of the integers between them, a number with whole bounds that of the numbers
    (intrange): the converter left the bounds out."""
    def bounded_visit(self, schema, name):
        ranged = _ranged(schema)
        if ranged is None:
            return visit(self, schema, name)
        rule = name + "-" if name in reserved else name or "root"
        # (one rule for each range, however many values have it)
        return self._add_rule(rule, self._add_rule(ranged[0].replace("None", "any"),
                                                   ranged[1]))
    return bounded_visit


def gbnf_repetition(item_rule: str, min_items: int, max_items: int | None,
                    separator_rule: str | None = None, item_rule_is_literal: bool = False
                    ) -> str:
    """The converter's `_build_repetition`, written with GBNF's own `{m,n}` (as llama.cpp's
    converter writes it now): the converter nested one optional group in another for
    each repetition past the least, so `"maxLength": 200`, `"maxItems": 150` or
    `.{0,200}` made a grammar more than 100 groups deep, refused. `item_rule` is one
    element (a rule's name, a literal, a group)."""
    if max_items == 0:
        return ""
    if min_items == 0 and max_items == 1:
        return f"{item_rule}?"
    if item_rule_is_literal and min_items == max_items and not separator_rule:
        return '"' + item_rule[1:-1] * min_items + '"'       # (`ab{3}`: "ababab")
    if not separator_rule:
        if max_items is None:
            return {0: f"{item_rule}*", 1: f"{item_rule}+"}.get(
                min_items, f"{item_rule}{{{min_items},}}")
        return f"{item_rule}{{{min_items},{max_items}}}"
    rest = gbnf_repetition(f"({separator_rule} {item_rule})", max(min_items - 1, 0),
                           None if max_items is None else max_items - 1)
    return f"{item_rule} {rest}" if min_items else f"({item_rule} {rest})?"


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
                 "S": f"[^{NOT_IN_JSON_STRING} ]"}
# JavaScript's \\s (\\S is everything else)
WHITESPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
              (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
              (0xFEFF, 0xFEFF))


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


def _choices(pattern: str) -> list[str]:
    """`pattern` split at each `|` outside every group and class."""
    out, depth, in_class, i, last = [], 0, False, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c in "()":
            depth += 1 if c == "(" else -1
        elif c == "|" and depth == 0:
            out.append(pattern[last:i])
            last = i + 1
        i += 1
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


def anchored(pattern: str) -> str:
    """A JSON Schema `pattern` as the converter takes it, `^…$`: JSON Schema's patterns
    match anywhere in the string (ECMA-262's search), and the converter refused any
    without both anchors, so `\\d+` (pydantic's `Field(pattern=...)` as often written)
    was a 400. The free ends become `.*` (`abc` is `^.*abc.*$`), each choice's on its own
    (`^a$|^b$`, `^\\d{5}$|^\\d{5}-\\d{4}$`: the converter took the first `^` and the last
    `$` off and wrote the others as characters, invalid JSON)."""
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
                         f"{_short(pattern)}")
    return f"^{match.group(1)}{{{low},{'' if high is None else high}}}$"


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
    or refuse."""
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
        if pattern.startswith("(?:", i):
            out.append("(")
            i += 3
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


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else")


ANY = {"type": ["object", "array", "string", "number", "boolean", "null"]}
# keywords that say nothing of the value (JSON Schema's annotations)
ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$schema", "$id"))


# the keywords that say something of a value of one type only
TYPE_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains"),
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "minProperties", "maxProperties", "propertyNames", "dependentRequired")}
TYPE_KEYWORDS["integer"] = TYPE_KEYWORDS["number"]
JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "array": (list,),
              "object": (dict,), "boolean": (bool,), "null": (type(None),)}


def _of_type(value, kind: str) -> bool:
    if isinstance(value, bool):
        return kind == "boolean"
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, JSON_TYPES.get(kind, ()))


def _typed_choices(node: dict) -> dict:
    """A node of several types (`"type": ["object", "null"]`) with keywords for them, as
    a choice of one node a type, each with its own keywords: the converter made each
    type bare, so `"properties"`, `"maxLength"` or `"minimum"` beside a list of types
    were left out (any object, any string). With `enum` or `const` the values say it
    all: the list of types keeps only those of the types (the converter took the types
    and left the values out: OpenAI's strict `{"type": ["string", "null"], "enum":
    ["red", null]}` wrote any string)."""
    kinds = node.get("type")
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds) or \
            any(key in node for key in ("$ref", "anyOf", "oneOf", "allOf")):
        return node
    kinds = list(dict.fromkeys(kinds))          # (a type twice is the type once)
    if "enum" in node and isinstance(node["enum"], list):
        rest = {k: v for k, v in node.items() if k != "type"}
        values = [v for v in node["enum"] if any(_of_type(v, k) for k in kinds)]
        if node["enum"] and not values:
            raise ValueError("no enum value is of the schema's types")
        return {**rest, "enum": values}
    if "const" in node:
        if not any(_of_type(node["const"], k) for k in kinds):
            raise ValueError("the const value is not of the schema's types")
        return {k: v for k, v in node.items() if k != "type"}
    specific = {key for kind in kinds for key in TYPE_KEYWORDS.get(kind, ())}
    if not specific.intersection(node):
        return node
    shared = {k: v for k, v in node.items() if k != "type" and k not in specific}
    return {**shared, "anyOf": [
        {"type": kind, **{k: v for k, v in node.items() if k in TYPE_KEYWORDS.get(kind, ())}}
        for kind in kinds]}


def normalized(node: object) -> object:
    """`node` as llama-cpp-python's converter takes it, meaning what JSON Schema says:
    `true` (any value) where a schema goes, `"items": {}` (any items), and a schema of
    annotations alone (pydantic's `Any`: `{"title": "Anything", "default": null}`), as
    a union of every type. The converter fails on all three (`"properties": {"a":
    true}`: 'bool' object has no attribute 'get'; `"items": {}`: KeyError
    'prefixItems'; "Unrecognized schema"). An empty schema elsewhere is left as it
    is: the converter makes it an object, as llama-server does. Values (`enum`,
    `const`, `default`, `examples`) are left as they are, and so is
    `additionalProperties: true` (the converter takes it).

    And a `$ref` beside definitions (pydantic's root: `{"$defs": {...}, "$ref":
    "#/$defs/Item"}`) goes into a one-way `anyOf` beside them, its other keywords left
    out (the converter ignores them under a `$ref`): it resolves no reference under a
    node that has one, so the definitions' own references were unknown (KeyError
    '#/$defs/Color'). Not where the node has a `oneOf` or `anyOf` of its own (the
    converter would take those instead)."""
    if node is True:
        return dict(ANY)
    if not isinstance(node, dict):
        return node
    node = _typed_choices(node)
    least, most = node.get("minItems"), node.get("maxItems")
    if isinstance(least, int) and isinstance(most, int) and least > most:
        raise ValueError(f"minItems ({least}) is above maxItems ({most}): no list fits")
    if isinstance(node.get("pattern"), str) and ("minLength" in node or "maxLength" in node):
        least, most = node.get("minLength", 0), node.get("maxLength")
        if isinstance(least, int) and (most is None or isinstance(most, int)):
            bounded = length_bounded(anchored(node["pattern"]), least, most)
            node = node if bounded is None else {**node, "pattern": bounded}
    out = {}
    for key, value in node.items():
        if key == "pattern" and isinstance(value, str):
            value = converter_pattern(anchored(value))
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            value = {name: normalized(sub) for name, sub in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list):
            value = [normalized(sub) for sub in value]
        elif key == "items" and value == {}:
            value = dict(ANY)
        elif key == "items" and isinstance(value, list):      # (the tuple form)
            value = [normalized(sub) for sub in value]
        elif key in SCHEMA_ONE and not (key == "additionalProperties" and value is True):
            value = normalized(value)
        out[key] = value
    if out and ANNOTATIONS.issuperset(out):
        return {**out, **ANY}
    if "$ref" in out and ("$defs" in out or "definitions" in out) and \
            "anyOf" not in out and "oneOf" not in out:
        out = {"anyOf": [{"$ref": out["$ref"]}],
               **{k: v for k, v in out.items() if k in ("$defs", "definitions")}}
    return out


def _limit_child() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (CONVERT_MEMORY, CONVERT_MEMORY))
    seconds = int(CONVERT_SECONDS) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))


def child_main() -> int:
    """The child: a schema (JSON) on stdin, {"grammar"} or {"error"} on stdout."""
    _limit_child()
    text = sys.stdin.buffer.read().decode("utf-8")
    try:
        schema = normalized(json.loads(text))
        result = {"grammar": _converter()(json.dumps(schema, ensure_ascii=False))}
    except MemoryError:
        result = {"error": "the JSON schema needs more memory to convert than allowed"}
    except RecursionError:
        result = {"error": "the JSON schema is nested too deeply to convert"}
    except Exception as exc:             # the converter asserts and raises many kinds
        said = str(exc)
        if said.startswith("Fetching remote schemas is not allowed"):
            said = "a $ref to another document is not fetched (put its definitions in $defs)"
        result = {"error": f"unsupported or invalid JSON schema: {_short(said, 200)}"}
    sys.stdout.write(json.dumps(result))
    return 0


def _run_child(text: str) -> str:
    try:
        done = subprocess.run([sys.executable, "-m", "dispatcher.common.schemagrammar"],
                              input=text.encode("utf-8"), capture_output=True,
                              timeout=CONVERT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        raise SchemaRefused(f"The JSON schema took more than {CONVERT_SECONDS:g} s to make "
                            "into a grammar.")
    if done.returncode != 0 or not done.stdout:
        raise SchemaRefused("The JSON schema could not be made into a grammar within this "
                            "server's time and memory limits.")
    result = json.loads(done.stdout)
    if "error" in result:
        raise SchemaRefused(result["error"][0].upper() + result["error"][1:] + ".")
    return result["grammar"]


def _text_and_digest(schema: object) -> tuple[str, bytes]:
    text = json.dumps(schema, ensure_ascii=False)
    return text, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class SchemaGrammars:
    """A process's conversions, the last CACHE_SIZE kept (the same schema sent again, or
    for several choices, is converted once)."""

    def __init__(self, run=_run_child, off_loop=lambda function, *args: function(*args),
                 at_once: int = 2) -> None:
        self.run = run
        self.off_loop = off_loop            # the CPU-bound steps, off a gevent loop
        self.slots = threading.BoundedSemaphore(at_once)   # child processes at once
        self.kept: OrderedDict[bytes, tuple[str | None, str | None]] = OrderedDict()

    def grammar(self, schema: object, n_vocab: int | None = None) -> str:
        """The checked grammar for `schema`, or SchemaRefused."""
        # (the order of properties is the order of the output's keys: kept as sent;
        # kept by digest: a schema's text may be megabytes)
        text, key = self.off_loop(_text_and_digest, schema)
        if key not in self.kept:
            try:
                self.off_loop(estimate, schema)
                with self.slots:
                    grammar = self.run(text)
                self.off_loop(gbnf.check, grammar, n_vocab)
                self.kept[key] = (grammar, None)
            except gbnf.GrammarError as exc:
                self.kept[key] = (None, "The JSON schema makes a grammar that cannot be "
                                        f"used: {exc}")
            except SchemaRefused as exc:
                self.kept[key] = (None, str(exc))
            while len(self.kept) > CACHE_SIZE:
                self.kept.popitem(last=False)
        self.kept.move_to_end(key)
        grammar, problem = self.kept[key]
        if problem is not None:
            raise SchemaRefused(problem)
        return grammar


if __name__ == "__main__":
    sys.exit(child_main())
