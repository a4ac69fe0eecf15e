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
import time
from collections import OrderedDict

from dispatcher.common import grammar as gbnf, intrange
from dispatcher.common.schemapatterns import (MAX_NESTED_CHOICES, anchored, converter_pattern,
                                             length_bounded, nested_choices, unsupported)

MAX_WORK = 400_000          # the converter's steps, as `estimate` counts them
MAX_REPETITION = 2000       # one count: minItems, maxLength, a pattern's {n,m} ...
CONVERT_SECONDS = 5.0       # the child's wall deadline (a schema that passed `estimate`
#                             converts in well under a second)
CONVERT_MEMORY = 1 << 30    # the child's address space
CACHE_SIZE = 32             # converted schemas kept per process (n choices, retries)
CONVERT_WAIT = 15.0         # seconds a schema may wait for a conversion slot (then 503)

MAX_PATTERN = 4096          # characters of one `pattern` (real ones are tens to hundreds)
MAX_DEPTH = 100             # arrays and objects one inside another (real schemas: tens;
#                             the converter and a schema's text are made recursively)

COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
VALUES = ("enum", "const", "default", "examples")   # JSON values, not schemas
# (possessive: no backtracking between the spaces and the digits, linear in the pattern;
# an escape is read whole first, so `\{3}` is a brace and `\\{0,2400}` a backslash
# repeated, which a look-behind at one backslash read as a brace)
_QUANTIFIER = re.compile(r"\\.|\{\s*+(\d*+)\s*+(?:,\s*+(\d*+)\s*+)?\}", re.S)
# ... and one the converter reads though it is not digits alone (it takes a count with
# int(): `{250_000_000}` and `{+1000}` passed every count here, and the child wrote 250 MB)
_LOOSE_QUANTIFIER = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|"
                               r"\{\s*+[\d_+]*+\s*+(?:,\s*+[\d_+]*+\s*+)?\}", re.S)
_LITERAL = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\\")


class SchemaBusy(RuntimeError):
    """Every conversion slot stayed busy for CONVERT_WAIT: try again (a flood of schemas
    never seen before keeps the others' waiting bounded)."""


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
    A pattern over MAX_PATTERN characters is refused before it is read, and one that
    asks what no grammar writes (`unsupported`: `\\b`, `\\p{L}`, a lookahead) by name."""
    if len(pattern) > MAX_PATTERN:
        raise SchemaRefused(f"{where} has {len(pattern):,} characters; at most "
                            f"{MAX_PATTERN:,} here.")
    problem = unsupported(pattern)
    if problem is not None:
        raise SchemaRefused(f"{where} uses {problem}, which no grammar here can write; "
                            "say it with characters, classes, groups and repetitions.")
    for match in _LOOSE_QUANTIFIER.finditer(pattern):
        if match.group(0)[0] not in "\\[" and ("_" in match.group(0) or
                                                     "+" in match.group(0)):
            raise SchemaRefused(f"{where}: write the quantifier {_short(match.group(0), 24)}"
                                "'s counts with digits alone.")
    work = len(pattern)
    for match in _QUANTIFIER.finditer(pattern):
        if match.group(0).startswith("\\"):
            continue                    # (an escape: `\{` is a brace)
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
    ways = nested_choices(pattern)
    if ways > MAX_NESTED_CHOICES:
        raise SchemaRefused(
            f"{where}: its nested repetitions can count {ways:,} ways at "
            f"once (at most {MAX_NESTED_CHOICES:,} here; the grammar keeps a parse for each "
            "way the text could split among them: bound the inner repetition by a "
            "separator, or repeat less).")
    return work


def estimate(schema: object) -> int:
    """The converter's work for `schema`, in steps (refused past MAX_WORK or any count
    past MAX_REPETITION). Iterative, as deep as JSON allows."""
    work = 0
    # (node, path, name, whether it is a value, not a schema: under `enum`, `const`,
    # `default`, `examples`, whose keys mean nothing to the converter; its depth)
    stack: list[tuple[object, str, int, bool, int]] = [(schema, "json_schema", 4, False, 0)]
    while stack:
        node, path, name, value, depth = stack.pop()
        if depth > MAX_DEPTH and isinstance(node, (list, dict)):
            raise SchemaRefused(f"The JSON schema nests arrays and objects more than "
                                f"{MAX_DEPTH} deep (at {_short(path, 64)}).")
        if isinstance(node, (list, dict)) and (value or isinstance(node, list)):
            items = list(node.items() if isinstance(node, dict) else enumerate(node))
            work += len(items) + (sum(len(v) for _, v in items if isinstance(v, str))
                                  if value else 0)     # (a value's text becomes a literal)
            if work > MAX_WORK:
                raise _too_large(path)
            stack.extend((item, f"{path}[{_short(str(i), 32)}]", name + 4, value, depth + 1)
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
        for key in ("anyOf", "oneOf", "type"):      # (a GBNF parse error, or 'anyOf' for
            if node.get(key) == []:                 # an empty oneOf, said it before)
                raise SchemaRefused(f"{path}.{key} is empty: no value could match it.")
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
                stack.append((sub, label, name + len(prop) + 1, False, depth + 2))
        for key, sub in node.items():
            if key != "properties" and isinstance(sub, (dict, list)):
                stack.append((sub, f"{path}.{_short(str(key), 32)}", name + len(key) + 1,
                               key in VALUES, depth + 1))
        if work > MAX_WORK:
            raise _too_large(path)
    return work


def _too_large(path: str) -> SchemaRefused:
    return SchemaRefused(f"The JSON schema is too large to make into a grammar here (past "
                         f"{path}: at most {MAX_WORK:,} conversion steps).")


JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'


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
    rules = getattr(module, "PRIMITIVE_RULES", {})
    if "char" in rules and hasattr(module, "BuiltinRule"):
        # a string's characters: never a control character (JSON writes those escaped;
        # the converter's `[^"\\]` let the model end a line inside a string, and the
        # answer was not JSON), nor DEL, as llama.cpp's own converter has them
        rules["char"] = module.BuiltinRule(JSON_CHAR, [])
    converter = getattr(module, "SchemaConverter", None)
    if converter is not None and hasattr(module, "RESERVED_NAMES"):
        converter.visit = _bounded_numbers(converter.visit, module.RESERVED_NAMES)
    return module.json_schema_to_gbnf


def _ranged(schema) -> tuple[str, str] | None:
    """(a rule name, its body) for an integer or a number with bounds, or None (the
    name says the range: one rule a range, however many values have it)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind not in ("integer", "number") or "enum" in schema or "const" in schema \
            or not any(key in schema for key in intrange.BOUNDS):
        return None
    if kind == "integer":
        least, most = intrange.integer_bounds(schema)
        if least is None and most is None:
            return None
        return (f"integer-from-{least}-to-{most}".replace("None", "any"),
                f"({intrange.integer_range(least, most)}) space")
    bounds = intrange.number_bounds(schema)
    if bounds is None or bounds[0] is None and bounds[2] is None:
        return None
    least, least_open, most, most_open = bounds
    name = f"number-from-{least}{'-open' * least_open}-to-{most}{'-open' * most_open}"
    return name.replace("None", "any"), f"({intrange.number_range(bounds)}) space"


def _bounded_numbers(visit, reserved):
    """The converter's `visit`, an integer or a number with bounds (`minimum`, ...) made
    the choice of those between them (intrange): the converter left the bounds out."""
    def bounded_visit(self, schema, name):
        ranged = _ranged(schema)
        if ranged is None:
            return visit(self, schema, name)
        rule = name + "-" if name in reserved else name or "root"
        return self._add_rule(rule, self._add_rule(*ranged))
    return bounded_visit


def gbnf_repetition(item_rule: str, min_items: int, max_items: int | None,
                    separator_rule: str | None = None, item_rule_is_literal: bool = False
                    ) -> str:
    """The converter's `_build_repetition`, written with GBNF's own `{m,n}` (as llama.cpp's
    converter writes it now): the converter nested one optional group in another for
    each repetition past the least, so `"maxLength": 200`, `"maxItems": 150` or
    `.{0,200}` made a grammar more than 100 groups deep, refused. `item_rule` is one
    element (a rule's name, a literal, a group)."""
    if max_items is not None and min_items > max_items:
        raise ValueError(f"at least {min_items} and at most {max_items} of one thing")
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


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else")


ANY = {"type": ["object", "array", "string", "number", "boolean", "null"]}
# keywords that say nothing of the value (JSON Schema's annotations)
ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$schema", "$id"))


# keywords the converter reads nowhere, each with the values that ask nothing (those pass):
# any other value was left out, and the answer broke the schema (`maxProperties: 0`
# wrote an object of several, `contains` an array without the item)
NOT_KEPT = {"contains": lambda v: False, "minContains": lambda v: False,
            "maxContains": lambda v: False, "maxProperties": lambda v: False,
            "minProperties": lambda v: v == 0, "uniqueItems": lambda v: v is False,
            # (beside a type these were left out: `{"type": "string", "not": {"const":
            # "a"}}` wrote "a", an `if`/`then` never asked for what `then` requires)
            **{key: (lambda v: False) for key in (
                "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                "dependencies", "propertyNames", "unevaluatedProperties",
                "unevaluatedItems")}}
# ... and those a node meets already as it is written (`unevaluatedProperties: false`
# beside `properties`: no undeclared one is written; `unevaluatedItems: false` beside
# `prefixItems`: no item past the tuple is)
MET_BY = {"unevaluatedProperties": "properties", "unevaluatedItems": "prefixItems"}
# keywords that ask something of a value (left out beside a $ref, the answer broke them)
VALIDATION_KEYWORDS = frozenset((
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "not", "properties", "required",
    "additionalProperties", "patternProperties", "items", "prefixItems"))
# what several parts of an allOf may each bound: the merged bound is the tightest
TIGHTEST = {"maximum": min, "exclusiveMaximum": min, "maxLength": min, "maxItems": min,
            "minimum": max, "exclusiveMinimum": max, "minLength": max, "minItems": max}


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


def _merged_all_of(node: dict) -> dict:
    """An `allOf` the converter can read: it merges only objects' properties, so
    pydantic v1's `{"allOf": [{"$ref": "#/definitions/Color"}], "description": ...}` (an
    enum) or `{"allOf": [{"type": "integer"}, {"minimum": 0}]}` wrote `{}`. One schema
    beside annotations alone is that schema; schemas without references whose keywords
    do not meet are merged into one. Anything else is left to the converter."""
    parts = node.get("allOf")
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) for p in parts):
        return node
    rest = {k: v for k, v in node.items() if k != "allOf"}
    definitions = {k: v for k, v in rest.items() if k in ("$defs", "definitions")}
    # (a keyword that asks nothing of the value, OpenAPI's `nullable` or `example`
    # too, is an annotation here: beside a one-part allOf it made `{}`)
    validating = SCALAR_KEYWORDS | VALIDATION_KEYWORDS | {"$ref"}
    if len(parts) == 1 and not set(rest) & validating:
        return {**parts[0], **definitions}
    merged: dict = {}
    for part in [rest] + parts:
        for key, value in part.items():
            if key in merged and merged[key] != value and key in TIGHTEST and \
                    all(isinstance(v, (int, float)) and not isinstance(v, bool)
                        for v in (merged[key], value)):
                value = TIGHTEST[key](merged[key], value)   # (both bounds hold)
            elif key in merged and merged[key] != value and key not in validating:
                continue                          # (an annotation: the first kept)
            elif key == "$ref" or (key in merged and merged[key] != value):
                return _unmerged_all_of(node, parts, rest, key)
            merged[key] = value
    return merged


# keywords of a value that are not an object's (which the converter's allOf merges)
SCALAR_KEYWORDS = frozenset(k for kind in ("string", "number", "array")
                            for k in TYPE_KEYWORDS[kind]) | {"const", "enum", "format"}


def _unmerged_all_of(node: dict, parts: list, rest: dict, key: str) -> dict:
    """An allOf left to the converter, which merges its parts' object properties
    (through references too) and reads nothing else: where its parts are no objects
    and ask for different values of one keyword, or a scalar's keyword stands beside
    it, a 400 (it wrote `{}` for an integer, or left a bound out)."""
    if key in SCALAR_KEYWORDS | {"type"} and not any("$ref" in part for part in parts) \
            and not any("properties" in part for part in parts):
        raise ValueError(f"allOf's parts ask for different '{key}' values: no value meets "
                         "them all")
    beside = sorted(set(rest) & (SCALAR_KEYWORDS | VALIDATION_KEYWORDS) - {"type"})
    if beside or rest.get("type") not in (None, "object"):
        raise ValueError(f"keywords beside an allOf that cannot be merged "
                         f"({', '.join(beside or ['type'])}) are not kept here: put them "
                         "in its parts")
    for part in parts:                          # (it merges objects' properties alone)
        unkept = sorted(set(part) & ({"oneOf", "anyOf", "enum", "const"} | SCALAR_KEYWORDS))
        if unkept or part.get("type") not in (None, "object"):
            raise ValueError(f"an allOf part with {', '.join(unkept or ['type'])} cannot "
                             "be merged here with its other parts")
    return node


ENUM_AS_TRIE = 64          # string values of an enum past which it is written as a trie
TRIE_DEPTH = 90            # ... unless its groups nest deeper (the grammar's bound: 100)


def _enum_as_trie(node: dict) -> dict:
    """A long enum of strings as one pattern of their shared beginnings (a trie): the
    converter writes an enum as one alternative a value, each beginning with a quote,
    so the grammar held a parse stack for each at once, and past ~255 (time zones,
    currencies with names) it was refused. Written so, the stacks at a position are the
    characters that may come next. Other values stay an enum beside it (anyOf)."""
    values = node.get("enum")
    if not isinstance(values, list) or node.get("type") not in (None, "string") or \
            sum(isinstance(v, str) for v in values) <= ENUM_AS_TRIE or \
            set(node) & {"pattern", "anyOf", "oneOf", "allOf", "const"}:
        return node
    trie: dict = {}
    for value in dict.fromkeys(v for v in values if isinstance(v, str)):
        at = trie
        for c in value:
            at = at.setdefault(c, {})
        at[None] = {}                              # (a value ends here)

    def char(c: str) -> str:
        if c.isascii() and c.isalnum():
            return c
        point = ord(c)
        return f"\\x{point:02X}" if point < 0x100 else \
            f"\\u{point:04X}" if point < 0x10000 else f"\\U{point:08X}"

    def written(at: dict) -> str:
        parts = []
        for c, after in at.items():               # (a chain of single branches: a loop)
            if c is None:
                continue
            text = char(c)
            while len(after) == 1 and None not in after:
                (c, after), = after.items()
                text += char(c)
            parts.append(text + written(after))
        if not parts:
            return ""
        return parts[0] if len(parts) == 1 and None not in at else \
            "(?:" + "|".join(parts) + ")" + ("?" if None in at else "")
    def depth(top: dict) -> int:                  # (groups one inside another)
        deepest, todo = 0, [(top, 0)]
        while todo:
            at, groups = todo.pop()
            while len(at) == 1 and None not in at:
                (_, at), = at.items()
            if at and set(at) != {None}:
                groups += 1
                todo += [(after, groups) for c, after in at.items() if c is not None]
            deepest = max(deepest, groups)
        return deepest
    if depth(trie) > TRIE_DEPTH:                   # (past the grammar's nesting bound:
        return node                                # as an enum, refused past ~255 values)
    rest = {k: v for k, v in node.items() if k not in ("enum", "type")}
    strings = {"type": "string", "pattern": "^" + written(trie) + "$"}
    others = [v for v in values if not isinstance(v, str)] \
        if node.get("type") != "string" else []   # (`type: string`: those are not kept)
    return {**rest, **strings} if not others else \
        {**rest, "anyOf": [strings, {"enum": others}]}


def _array_keywords(node: dict) -> dict:
    """An array's `items` as the converter reads it: `false` (no item past
    `prefixItems`) is the tuple alone, or the empty list; beside `prefixItems`, an
    `items` schema is left out (the converter wrote only `items`, an integer's place
    taken by a string): the tuple is written, and no item past it."""
    prefix = node.get("prefixItems")
    if isinstance(prefix, list):
        least, most = node.get("minItems"), node.get("maxItems")
        if isinstance(least, int) and least > len(prefix):
            raise ValueError(f"minItems ({least}) past prefixItems ({len(prefix)}) is not "
                             "kept here (the tuple is written, and no item past it)")
        if isinstance(most, int) and most < len(prefix):
            node = {**node, "prefixItems": prefix[:most]}   # (a shorter tuple is valid)
    if "items" not in node or isinstance(node["items"], list):
        return node
    if "prefixItems" in node:
        return {k: v for k, v in node.items() if k != "items"}
    if node["items"] is False:
        return {**{k: v for k, v in node.items() if k != "items"}, "maxItems": 0}
    return node


def _object_keywords(node: dict, add_required: bool = True) -> dict:
    """An object's keywords as the converter writes them right: extra properties beside
    declared ones (`additionalProperties` true or a schema: pydantic's extra="allow")
    are not written (the converter's rule for them after an optional property had no
    comma: it could only write invalid JSON once it wrote that property); a `required`
    name not among `properties` is a property of any value (left out, every answer
    broke the schema). A property named "" is refused (its rule took the root's name)."""
    node = _array_keywords(node)
    if "required" in node and not isinstance(node["required"], list) and \
            "properties" not in node:
        node = {k: v for k, v in node.items() if k != "required"}  # (draft 3's `true`)
    for key in ("enum", "anyOf", "oneOf", "allOf", "prefixItems", "required"):
        if key in node and not isinstance(node[key], list):
            raise ValueError(f"'{key}' must be a list")
    for key in COUNTS:
        value = node.get(key)
        if isinstance(value, float) and value.is_integer():
            node = {**node, key: int(value)}          # (2.0 is JSON Schema's 2)
        elif key in node and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"'{key}' must be a whole number")
    properties, required = node.get("properties"), node.get("required")
    if properties is None and isinstance(required, list) and required and add_required \
            and (node.get("type") == "object" or "additionalProperties" in node):
        properties = {}                 # (names required of an object none declares)
    if not isinstance(properties, dict):
        return node
    if "" in properties:
        raise ValueError("a property named \"\" is not supported here")
    absent = [name for name, sub in properties.items() if sub is False]
    if absent:                          # (`false`: no value may be there)
        if isinstance(required, list) and set(absent) & set(required):
            raise ValueError(f"the property {sorted(set(absent) & set(required))[0]!r} is "
                             "required and may have no value (false): no object fits")
        properties = {name: sub for name, sub in properties.items() if sub is not False}
        node = {**node, "properties": properties}
    extra = node.get("additionalProperties")
    if isinstance(required, list) and add_required:
        # (not in an allOf's part: the name may be another part's property)
        missing = [name for name in required if isinstance(name, str)
                   and name not in properties]
        if missing and extra is False:
            raise ValueError(f"{missing[0]!r} is required, not among properties, and "
                             "additionalProperties is false: no object fits")
        if missing:
            value = extra if isinstance(extra, dict) else dict(ANY)
            node = {**node, "properties": {**properties,
                                           **{name: value for name in missing}}}
    if properties and extra not in (None, False):
        node = {**node, "additionalProperties": False}
    return node


# whether the schema being converted is of a draft whose $ref ignores its siblings (4-7)
_REF_SIBLINGS_IGNORED = [False]
_OLD_DRAFT = re.compile(r"json-schema\.org/(draft-0[4-7]|schema)\b")


def normalized(node: object, in_all_of: bool = False) -> object:
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
    node = _typed_choices(_merged_all_of(node))
    node = _object_keywords(_enum_as_trie(node), add_required=not in_all_of)
    # (a keyword of no validation beside it, `x-order` or OpenAPI's `nullable`, is left
    # out, as the converter does: what is written still meets the schema)
    # (nor `type`, a reference's type said again; nor anything under drafts 4-7, whose
    # $ref says its siblings are ignored)
    beside = sorted(set(node) & (SCALAR_KEYWORDS | VALIDATION_KEYWORDS) - {"type"}) \
        if "$ref" in node and not _REF_SIBLINGS_IGNORED[0] else []
    if beside:
        raise ValueError(f"keywords beside a $ref ({', '.join(beside)}) are not kept here "
                         "(the reference is written as defined): put them in the "
                         "definition")
    for key, kept in NOT_KEPT.items():
        if key in MET_BY and node.get(key) is False and MET_BY[key] in node:
            continue
        if key in node and not kept(node[key]):
            raise ValueError(f"'{key}' is a keyword the grammars here cannot keep (the "
                             "answer would not meet it); leave it out")
    if node.get("type") == "array" and "items" not in node and "prefixItems" not in node \
            and ("minItems" in node or "maxItems" in node):
        # (the converter makes an array without `items` its bare rule, its bounds left
        # out: maxItems 0 wrote [1])
        node = {**node, "items": dict(ANY)}
    for low, high, what in (("minItems", "maxItems", "list"),
                            ("minLength", "maxLength", "string")):
        least, most = node.get(low), node.get(high)
        if isinstance(least, int) and isinstance(most, int) and least > most:
            raise ValueError(f"{low} ({least}) is above {high} ({most}): no {what} fits")
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
            value = [normalized(sub, in_all_of=key == "allOf") for sub in value]
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


# the converter's own rules: a definition named so took that rule for its references
# (`"$defs": {"space": {"enum": ["a", "b"]}}` wrote `{"y": }`), and one named "" the root
BUILT_IN_RULES = frozenset((
    "root", "space", "boolean", "decimal-part", "integral-part", "number", "integer",
    "value", "object", "array", "uuid", "char", "string", "null", "dot", "date", "time",
    "date-time", "date-string", "time-string", "date-time-string"))


def _pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def renamed_definitions(schema: object) -> object:
    """`schema` with each definition whose rule would be a built-in one's (or none), or
    whose name a rule cannot have, renamed, its references too (the output's text is the same: rule names are the
    grammar's own)."""
    if not isinstance(schema, dict):
        return schema
    renames: dict[str, str] = {}                  # old reference prefix -> new one
    out = dict(schema)
    for where in ("$defs", "definitions"):
        definitions = schema.get(where)
        if not isinstance(definitions, dict):
            continue
        renamed: dict = {}
        for name, value in definitions.items():
            # every definition: the converter's reference takes any rule already of its
            # name, a property's too (`a_b`'s rule is `a-b`), and writes a recursive one
            # as the name itself (`linked_list_node`: a grammar that did not parse); a
            # digest of the name is no property's rule
            tag = hashlib.sha256(f"{where}/{name}".encode("utf-8", "surrogatepass"))
            new = (re.sub(r"[^a-zA-Z0-9-]+", "-", name).strip("-")[:40] or "defined") + \
                f"-d{tag.hexdigest()[:8]}"
            if new != name:
                renames[f"#/{where}/{_pointer(name)}"] = f"#/{where}/{_pointer(new)}"
            renamed[new] = value
        out[where] = renamed
    if not renames:
        return schema

    def visit(node):
        if isinstance(node, dict):
            node = {k: visit(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for old, new in renames.items():
                    if ref == old or ref.startswith(old + "/"):
                        node["$ref"] = new + ref[len(old):]
            return node
        if isinstance(node, list):
            return [visit(v) for v in node]
        return node
    return visit(out)


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
        raw = json.loads(text)
        _REF_SIBLINGS_IGNORED[0] = isinstance(raw, dict) and bool(
            _OLD_DRAFT.search(str(raw.get("$schema", ""))))
        schema = normalized(renamed_definitions(raw))
        grammar = _converter()(json.dumps(schema, ensure_ascii=False))
        # (said here, not sent: a grammar past the limit, megabytes, crossed the pipe
        # and was parsed by the front end's loop before the check refused it)
        result = {"grammar": grammar} if len(grammar) <= gbnf.MAX_GRAMMAR_CHARS else {
            "error": f"the grammar it makes has {len(grammar):,} characters; at most "
                     f"{gbnf.MAX_GRAMMAR_CHARS:,}"}
    except MemoryError:
        result = {"error": "the JSON schema needs more memory to convert than allowed"}
    except RecursionError:
        result = {"error": "the JSON schema is nested too deeply to convert"}
    except (KeyError, AttributeError, IndexError, TypeError) as exc:   # (its own Python)
        result = {"error": "unsupported or invalid JSON schema: the converter could not "
                           f"read it ({type(exc).__name__} {_short(str(exc), 80)})"}
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
        # ... and one at a time for each tenant (a key's scope): a key sending schema
        # after new schema took every slot, and every other key's waited CONVERT_WAIT s
        # for a 503 (the dispatcher's shares come after the front end's conversion)
        self.own: dict[str, threading.BoundedSemaphore] = {}
        self.kept: OrderedDict[bytes, tuple[str | None, str | None]] = OrderedDict()   # by
        # scope and digest

    def grammar(self, schema: object, n_vocab: int | None = None,
                scope: str | None = None) -> str:
        """The checked grammar for `schema`, or SchemaRefused. A conversion kept is
        reused within its `scope` only (the request's tenant: another key's schema
        answered in a fifth of the time, an oracle of its fields and values)."""
        # (the order of properties is the order of the output's keys: kept as sent;
        # kept by digest: a schema's text may be megabytes)
        try:
            text, digest = self.off_loop(_text_and_digest, schema)
            key = (scope or "").encode("utf-8", "surrogateescape") + b"\0" + digest
        except RecursionError:      # (deeper than `estimate` allows, and then some)
            raise SchemaRefused(f"The JSON schema nests arrays and objects more than "
                                f"{MAX_DEPTH} deep.") from None
        if key not in self.kept:
            try:
                self.off_loop(estimate, schema)
                grammar = self._converted(text, scope)
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

    def _converted(self, text: str, scope: str | None) -> str:
        """`text` converted by a child process, within a slot of the front end's and,
        for a tenant's scope, its own one; SchemaBusy past CONVERT_WAIT s of waiting."""
        own = self.own.setdefault(scope, threading.BoundedSemaphore(1)) \
            if scope is not None else None
        busy = SchemaBusy(f"Every JSON schema conversion of this front end was busy for "
                          f"{CONVERT_WAIT:g} s: try again.")
        deadline = time.monotonic() + CONVERT_WAIT
        if own is not None and not own.acquire(timeout=CONVERT_WAIT):
            raise busy
        try:
            if not self.slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise busy
            try:
                return self.run(text)
            finally:
                self.slots.release()
        finally:
            if own is not None:
                own.release()


if __name__ == "__main__":
    sys.exit(child_main())
