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

from dispatcher.common import grammar as gbnf, intrange
from dispatcher.common.schemapatterns import MAX_NESTED_CHOICES, nested_choices, unsupported
from dispatcher.common.schemashapes import ANY, COUNTS, shaped
from dispatcher.common.tenantlru import TenantLRU

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
        schema = shaped(json.loads(text))
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
    """A process's conversions, CACHE_SIZE kept (the same schema sent again, or for
    several choices, is converted once), each tenant's own (`TenantLRU`: a key sending
    many schemas pushes out its own)."""

    def __init__(self, run=_run_child, off_loop=lambda function, *args: function(*args),
                 at_once: int = 2) -> None:
        self.run = run
        self.off_loop = off_loop            # the CPU-bound steps, off a gevent loop
        self.slots = threading.BoundedSemaphore(at_once)   # child processes at once
        # ... and one at a time for each tenant (a key's scope): a key sending schema
        # after new schema took every slot, and every other key's waited CONVERT_WAIT s
        # for a 503 (the dispatcher's shares come after the front end's conversion)
        self.own: dict[str, threading.BoundedSemaphore] = {}
        # (grammar, problem) by scope and digest
        self.kept = TenantLRU(CACHE_SIZE)

    def grammar(self, schema: object, n_vocab: int | None = None,
                scope: str | None = None, who: str | None = None) -> str:
        """The checked grammar for `schema`, or SchemaRefused. A conversion kept is
        reused within its `scope` only (the request's tenant: another key's schema
        answered in a fifth of the time, an oracle of its fields and values). One
        conversion at a time runs for `who` (the API key; its scope where not given),
        whatever the cache's scope: under `--cache-scope shared` one key sending new
        schemas at once held both of the front end's conversions."""
        # (the order of properties is the order of the output's keys: kept as sent;
        # kept by digest: a schema's text may be megabytes)
        try:
            text, key = self.off_loop(_text_and_digest, schema)
        except RecursionError:      # (deeper than `estimate` allows, and then some)
            raise SchemaRefused(f"The JSON schema nests arrays and objects more than "
                                f"{MAX_DEPTH} deep.") from None
        kept = self.kept.get(scope, key)
        if kept is None:
            try:
                self.off_loop(estimate, schema)
                grammar = self._converted(text, scope if who is None else who)
                self.off_loop(gbnf.check, grammar, n_vocab)
                kept = (grammar, None)
            except gbnf.GrammarError as exc:
                kept = (None, f"The JSON schema makes a grammar that cannot be used: {exc}")
            except SchemaRefused as exc:
                kept = (None, str(exc))
            self.kept.put(scope, key, kept)
        grammar, problem = kept
        if problem is not None:
            raise SchemaRefused(problem)
        return grammar

    def _converted(self, text: str, who: str | None) -> str:
        """`text` converted by a child process, within a slot of the front end's and,
        for a key (or a tenant's scope), its own one; SchemaBusy past CONVERT_WAIT s of
        waiting."""
        own = self.own.setdefault(who, threading.BoundedSemaphore(1)) \
            if who is not None else None
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
