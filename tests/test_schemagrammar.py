"""JSON schemas made into grammars in the front end (dispatcher/common/schemagrammar.py)
and the parse-stack bound on every grammar (dispatcher/common/grammar.py): the shapes
that froze or killed a worker are refused quickly with a message naming the construct,
ordinary schemas convert as llama-cpp-python's converter makes them, and a conversion
nobody counted is stopped by the child process's limits."""
import time

import pytest

from dispatcher.common import grammar as gbnf
from dispatcher.common import schemagrammar as sg
from dispatcher.common import schemashapes as shapes

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "born": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"},
    "kind": {"enum": ["a", "b", "c"]}}, "required": ["name", "age"]}


@pytest.mark.parametrize("schema, named", [
    ({"type": "string", "pattern": "^\\a\\a\\a\\a{100000002}$"}, "quantifier"),
    ({"type": "string", "pattern": "^(ab){2001}$"}, "quantifier"),
    ({"type": "string", "pattern": "^a{1," + "9" * 2000 + "}$"}, "quantifier"),
    ({"type": "object", "properties": {f"a{chr(0x4E00 + i)}": {} for i in range(8000)}},
     "optional properties"),
    ({"type": "string", "maxLength": 2_000_000_000}, "maxLength"),
    ({"type": "array", "items": {}, "minItems": 10 ** 30}, "minItems"),
    ({"type": "object", "properties": {f"p{i}": {"type": "array", "maxItems": 2000}
                                       for i in range(300)},
      "required": [f"p{i}" for i in range(300)]}, "too large"),
    # a pattern's length is bounded before it is read (its quantifier scan froze a
    # front end: "{" and 16,000 spaces took 10 s)
    ({"type": "string", "pattern": "{" + " " * 16_000 + "x"}, "characters"),
    # the items of a list count towards the bound as they are met
    ({"type": "object", "x": [0] * 500_000}, "too large"),
    # ... and a value's (enum, const, default, examples) with its text
    ({"type": "string", "enum": ["x" * 500_000]}, "too large"),
    # nested repetitions: a parse stack for each way the text splits among them (a
    # token's check took 1.1 s before the request was ended)
    ({"type": "string", "pattern": "^(a{0,100}){0,100}$"}, "nested repetitions"),
    ({"type": "string", "pattern": "^((a{0,10}){0,10}){0,30}$"}, "3,751 ways"),
    # counts the converter reads with int() though they are not digits alone (48 bytes
    # made the child write 250 MB)
    ({"type": "string", "pattern": "^ab{250_000_000}$"}, "digits alone"),
    ({"type": "string", "pattern": "^a{+1000}$"}, "digits alone"),
    ({"type": "string", "pattern": "^(a{0,1_00}){0,1_00}$"}, "digits alone"),
])
def test_schemas_whose_conversion_explodes_are_refused_before_converting(schema, named):
    ran = []
    grammars = sg.SchemaGrammars(run=lambda text: ran.append(text) or "root ::= \"x\"")
    started = time.perf_counter()
    with pytest.raises(sg.SchemaRefused) as refused:
        grammars.grammar(schema)
    assert named in str(refused.value) and not ran          # no child was started
    assert time.perf_counter() - started < 5.0


def test_a_conversion_kept_is_reused_by_its_tenant_only():
    """The same schema again is converted once, for the same key; another key's copy is
    converted anew (a kept one answered in a fifth of the time: an oracle of another
    key's schema, its field names and values)."""
    ran = []
    grammars = sg.SchemaGrammars(run=lambda text: ran.append(text) or 'root ::= "x"')
    schema = {"type": "object", "properties": {"acme_payroll_ssn": {"type": "string"}}}
    for scope in ("key-a", "key-a", "key-b", None, None):
        assert grammars.grammar(schema, scope=scope) == 'root ::= "x"'
    assert len(ran) == 3                        # key-a, key-b, and the shared scope


def test_an_ordinary_schema_converts_and_its_property_order_is_kept():
    grammar = sg.SchemaGrammars().grammar(PERSON)
    gbnf.check(grammar)
    root = next(line for line in grammar.splitlines() if line.startswith("root ::="))
    assert root.index("name-kv") < root.index("age-kv")
    reordered = {**PERSON, "properties": dict(reversed(PERSON["properties"].items()))}
    root = next(line for line in sg.SchemaGrammars().grammar(reordered).splitlines()
                if line.startswith("root ::="))
    assert root.index("age-kv") < root.index("name-kv")


@pytest.mark.parametrize("schema, rule", [
    ({"type": "array", "items": {}}, "root"),
    ({"type": "array", "items": True, "minItems": 2}, "root"),
    ({"type": "object", "properties": {"a": True}, "required": ["a"]}, "a"),
    (True, "root")])
def test_any_value_subschemas_convert_to_any_value(schema, rule):
    """JSON Schema's `true` and `"items": {}` mean any value; llama-cpp-python's
    converter fails on both (AttributeError, KeyError 'prefixItems': a 400 naming
    'prefixItems' for a list of anything). They convert, to every JSON type, counts
    kept; an empty schema elsewhere stays the converter's (and llama-server's) object."""
    grammar = sg.SchemaGrammars().grammar(schema)
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines() if " ::= " in line)
    union = rules.get("item", rules[rule])
    assert all(kind in union for kind in ("array", "string", "number", "boolean", "null"))
    if isinstance(schema, dict) and schema.get("minItems") == 2:
        assert 'item ("," space item)+' in rules["root"]      # two, then any more
    assert shapes.normalized({"enum": [True, {"items": {}}], "const": True}) == \
        {"enum": [True, {"items": {}}], "const": True}       # (values are left alone)
    # (extra properties beside declared ones are not written: see
    # test_extra_properties_beside_declared_ones_are_not_written)
    assert shapes.normalized({"type": "object", "properties": {"a": {}},
                          "additionalProperties": True}) == \
        {"type": "object", "properties": {"a": {}}, "additionalProperties": False}
    assert shapes.normalized({"type": "object", "additionalProperties": True}) == \
        {"type": "object", "additionalProperties": True}           # (no properties)


def test_references_beside_definitions_and_annotation_only_schemas_convert():
    """pydantic's shapes: a root `$ref` beside `$defs` whose definitions refer on
    (recursively here), and `Any` as annotations alone; the converter resolved no
    reference under a node that has one ('#/definitions/node') and knew no schema of
    annotations alone. An empty `enum` is refused, saying so (it was a grammar error
    about a newline)."""
    tree = {"definitions": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/definitions/node"}}}}},
        "$ref": "#/definitions/node"}
    grammar = sg.SchemaGrammars().grammar(tree)
    assert "-kids" in grammar and _takes(grammar, '{"kids": [{"kids": []}]}')
    anything = sg.SchemaGrammars().grammar({"type": "object", "properties": {
        "a": {"title": "Anything", "default": None}}, "required": ["a"]})
    rules = dict(line.split(" ::= ", 1) for line in anything.splitlines() if " ::= " in line)
    assert all(kind in rules["a"] for kind in ("array", "string", "number", "null"))
    # (the review's cases: a $ref beside a oneOf or under allOf with a dict default means
    # what it meant before; the tuple form of items takes `true`; `true` counts as much
    # as a sub-schema in the estimate)
    # (a $ref beside a oneOf wrote the reference and left the oneOf out, an integer
    # where the schema asks for a string too: a 400 naming it)
    before = {"$ref": "#/$defs/A", "oneOf": [{"type": "string"}],
              "$defs": {"A": {"type": "integer"}}}
    with pytest.raises(sg.SchemaRefused, match=r"beside a \$ref \(oneOf\)"):
        sg.SchemaGrammars().grammar(before)
    required = {"allOf": [{"$ref": "#/$defs/A", "default": {"x": 1}}], "$defs": {"A": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    # (an allOf of one is that schema: the object A, its x required)
    assert _texts_of(sg.SchemaGrammars().grammar(required), '{}":x1', 7) == {'{"x":1}'}
    assert "tuple-0" in sg.SchemaGrammars().grammar(
        {"type": "array", "items": [True, {"type": "string"}]})
    with pytest.raises(sg.SchemaRefused, match="too large"):
        sg.estimate({"type": "array", "prefixItems": [True] * 100_000})
    with pytest.raises(sg.SchemaRefused, match=r"another document is not fetched \(put"):
        sg.SchemaGrammars().grammar({"$ref": "https://example.com/x.json"})
    with pytest.raises(sg.SchemaRefused, match="enum is empty"):
        sg.SchemaGrammars().grammar({"type": "object", "properties": {"a": {"enum": []}}})


@pytest.mark.parametrize("pattern, made", [
    ("^\\d{3}-\\d{4}$", "^[0-9]{3}-[0-9]{4}$"),
    ("^[\\w.-]+@\\w+\\.com$", "^[0-9A-Z_a-z.\\x2D]+@[0-9A-Za-z_]+[.]com$"),
    ("^\\s\\S\\D\\W$", "^[ ][^{N} \\xA0\\u1680\\u2000-\\u200A\\u2028-\\u2029\\u202F\\u205F"
                       "\\u3000\\uFEFF][^{N}0-9][^{N}0-9A-Za-z_]$"),
    ("^(?:ab|cd)+$", "^(ab|cd)+$"),
    ("^[^\\]\\\\]+\\/$", "^[^{N}\\x5D\\x5C]+[/]$"),
    ("^.{1,3}@[^@]+$", "^[^{N}]{1,3}@[^{N}@]+$"),
    ('^a"+b\\\\c$', "^a([\\x5C][\\x22])+b([\\x5C][\\x5C])c$"),   # (JSON text's escapes)
    ("^[A-Z]\\u00e9?\\x41$", "^[A-Z][\\xE9]?[A]$")])   # (the converter split "\\u00e9?")
def test_patterns_are_written_in_the_forms_the_converter_makes_grammars_of(pattern, made):
    """`\\d`, `\\w`, `\\s` and escaped punctuation were copied into the grammar, which
    has no such escapes: `^\\d{3}-\\d{4}$` (JSON Schema's own example) was a 400 about
    an unknown escape; `(?:` was refused. Now the grammar is made and checked. A dot or
    a negated class leaves out what a JSON string may not hold unescaped ({N}): `[^@]`
    let the model end the string with a quote, or write a raw backslash."""
    from dispatcher.common.schemapatterns import NOT_IN_JSON_STRING, converter_pattern
    assert converter_pattern(pattern) == made.replace("{N}", NOT_IN_JSON_STRING)
    sg.SchemaGrammars().grammar({"type": "string", "pattern": pattern})


def _matches(rule: list, i: int, point: int) -> bool:
    """Whether the character element at rule[i] (with its ranges and alternatives)
    takes `point`, as llama.cpp's llama_grammar_match_char."""
    from dispatcher.common.grammar_rules import CHAR_ALT, CHAR_ANY, CHAR_NOT, CHAR_RNG_UPPER
    negated, found = rule[i][0] == CHAR_NOT, rule[i][0] == CHAR_ANY
    while True:
        low = rule[i][1]
        if i + 1 < len(rule) and rule[i + 1][0] == CHAR_RNG_UPPER:
            found |= low <= point <= rule[i + 1][1]
            i += 2
        else:
            found |= low == point
            i += 1
        if i >= len(rule) or rule[i][0] != CHAR_ALT:
            return found != negated


def _after_char(rule: list, i: int) -> int:
    from dispatcher.common.grammar_rules import CHAR_ALT, CHAR_RNG_UPPER
    i += 1
    while i < len(rule) and rule[i][0] in (CHAR_ALT, CHAR_RNG_UPPER):
        i += 1
    return i


def _expanded(rules: list, stack: tuple) -> set:
    """The stacks `stack` stands for, each with a character element on top (or empty:
    the grammar is complete), as llama.cpp's llama_grammar_advance_stack."""
    from dispatcher.common.grammar_rules import RULE_REF, alternatives, ends
    if not stack:
        return {stack}
    rule_id, i = stack[-1]
    kind, value = rules[rule_id][i]
    if kind != RULE_REF:
        return {stack}
    rest = stack[:-1]
    if not ends(rules[rule_id][i + 1]):
        rest += ((rule_id, i + 1),)
    made = set()
    for start, end in alternatives(rules[value]):
        made |= _expanded(rules, rest + ((value, start),) if start < end else rest)
    return made


def _texts_of(grammar: str, alphabet: str, length: int) -> set[str]:
    """Every text of at most `length` characters of `alphabet` that the grammar takes
    whole (a test's own reading of llama.cpp's grammar engine)."""
    import functools
    from dispatcher.common.grammar_rules import alternatives, ends
    parsed = gbnf.check(grammar)
    rules = parsed.rules
    matches = functools.lru_cache(None)(lambda r, i, c: _matches(rules[r], i, ord(c)))
    expanded = functools.lru_cache(None)(lambda stack: _expanded(rules, stack))
    states = {"": set().union(*(expanded(((parsed.root, start),))
                                for start, _ in alternatives(rules[parsed.root])))}
    whole = set()
    for _ in range(length + 1):
        following = {}
        for text, stacks in states.items():
            if () in stacks:
                whole.add(text)
            for c in alphabet:
                for stack in stacks:
                    if not stack:
                        continue
                    rule_id, i = stack[-1]
                    if matches(rule_id, i, c):
                        after = _after_char(rules[rule_id], i)
                        moved = stack[:-1] + ((() if ends(rules[rule_id][after])
                                               else ((rule_id, after),)))
                        following.setdefault(text + c, set()).update(expanded(moved))
        states = following
    return whole


# (pattern, values to be written, more characters to try texts of)
JSON_TEXT_PATTERNS = [
    ('^[a\\\\"]{1,2}$', ["a", '"', "\\", 'a"', '\\"'], 'a"\\ '),
    ("^[ -~]{2}$", ["ab", 'a"', "\\\\", ' "'], 'a"\\ \n'),
    ("^[\\x00-\\x7F]$", ["a", "\n", "\x01", '"', "\\"], 'a"\\nu01\n'),
    ("^[\\n\\t]x$", ["\nx", "\tx"], 'xnt\\"\n\t'),
    ("^a\\nb\\x22\\u005c$", ['a\nb"\\'], 'abn"\\\n5c'),
    ('^"\\\\?$', ['"', '"\\'], '"\\a'),
    ("^[^a]$", ["b", " "], 'ab"\\n\n'),
    ("^.a$", ["ba"], 'ab"\\n\n'),
    ("^[\\w\\s-]$", ["a", "-", " ", "_"], 'a-_ \t"\\'),
    # (`\\U` as Python and GBNF read it; `[\\b]` a backspace; `]` and `}` outside a
    # class are characters: the converter's literal loop stood still on them for 5 s)
    ("^\\U00000022[\\U00000041-\\U00000043]$", ['"A', '"C'], 'ABCD"\\-'),
    ("^[\\b]a]}{1,2}$", ["\ba]}", "\ba]}}"], 'ab]}"\\'),
    # (JavaScript's "any character" idiom, and a negated \S: a 400 naming an escape)
    ("^[\\s\\S][^\\S]$", ["a ", '" ', "\\ ", "\x01 "], 'a "\\\n\tbnu01'),
]


@pytest.mark.parametrize("pattern, values, alphabet", JSON_TEXT_PATTERNS)
def test_every_text_a_pattern_grammar_writes_is_json_of_a_matching_string(
        pattern, values, alphabet):
    """Every text the grammar of a `pattern` takes, over a few characters up to a
    length, is JSON of a string the pattern matches, and the JSON of the values given
    is taken. Before, a class with a quote or a backslash (`[\\\\"]`), or a range over
    them (`[ -~]`), and `\\n`, `\\x22` or `\\u005c` outside a class let the model write
    them raw: a string ended early, or invalid JSON."""
    import json
    import re
    grammar = sg.SchemaGrammars().grammar({"type": "string", "pattern": pattern})
    length = 2 + max(len(json.dumps(value)) for value in values)
    alphabet = "".join(sorted(set(alphabet + "".join(map(json.dumps, values)))))
    texts = _texts_of(grammar, alphabet, length)
    for text in texts:
        value = json.loads(text)
        assert isinstance(value, str) and re.fullmatch(pattern[1:-1], value), (text, value)
    for value in values:
        assert re.fullmatch(pattern[1:-1], value)
        assert json.dumps(value) in texts, value


PATTERN_ATOMS = ["a", '"', "\\\\", "\\n", "\\t", "\\x22", "\\u005c", ".", "[^a]", '[a"]',
                 "[ -~]", "[\\x00-\\x7F]", "\\d", "\\s", "\\S", "\\W", '[\\w"]', '(?:a|")',
                 "[\\\\-a]", "\\-", "\\U0000005c", "]", "}", "[\\b]",
                 "[\\s\\S]", "[^\\S]", "[\\d\\W]"]


@pytest.mark.parametrize("pattern, says", [
    ("^a[]b$", "empty class"), ("^[]a]$", "empty class"), ("^\\01$", "escape")])
def test_patterns_no_string_could_match_or_read_otherwise_are_refused(pattern, says):
    """An empty class matches nothing (JavaScript); it was left out, so `^a[]b$` wrote
    "ab". An octal escape (`\\01`) was a NUL and a 1."""
    with pytest.raises(sg.SchemaRefused, match=says):
        sg.SchemaGrammars().grammar({"type": "string", "pattern": pattern})


@pytest.mark.parametrize("pattern, says", [
    ("\\bword\\b", "word boundary"), ("^\\p{L}+$", "Unicode property"),
    ("^[\\p{L}\\d]$", "Unicode property"), ("^(a)\\1$", "back-reference"),
    ("^(?<a>x)\\k<a>$", "back-reference"), ("^(?=a)a$", "lookahead"),
    ("(?<!a)b", "lookbehind"), ("(?i)abc", "inline flag"), ("^a$b", "anchor"),
    ("^(a$)b", "anchor"), ("(^a)+", "anchor")])
def test_patterns_asking_what_no_grammar_writes_are_refused_by_name(pattern, says):
    """A word boundary, a Unicode property, a back-reference, a lookaround, an inline
    flag, an anchor inside the pattern: a 400 naming it. Before, `\\b` was a 400 about
    an escape at a column of the grammar, `\\p{L}` one about a quantifier, and an anchor
    inside a group was written as a character (JSON the pattern does not match)."""
    with pytest.raises(sg.SchemaRefused, match=says):
        sg.estimate({"type": "string", "pattern": pattern})


@pytest.mark.parametrize("pattern, python, values", [
    ("(^\\d+$)", "^\\d+$", ["1", "12"]), ("(?:^a$|^b1$)", "^a$|^b1$", ["a", "b1"]),
    ("^(?<y>\\d)-(?P<m>[ab])$", "^(?P<y>\\d)-(?P<m>[ab])$", ["1-a", "2-b"]),
    ("((a|b))", "a|b", ["a", "1b"])])
def test_groups_around_the_whole_pattern_and_named_groups_are_plain_groups(
        pattern, python, values):
    """A group around the whole pattern (`(^\\d+$)`, as some schemas wrap it) takes its
    anchors as anchors, and a named group (`(?<year>…)`, ECMA-262's; `(?P<year>…)`,
    Python's) is a group: the converter refused the name and wrote the anchors as
    characters."""
    import json
    import re
    grammar = sg.SchemaGrammars().grammar({"type": "string", "pattern": pattern})
    texts = _texts_of(grammar, 'ab12-"', 5)
    assert texts and all(re.search(python, json.loads(text)) for text in texts)
    assert all(json.dumps(value) in texts for value in values)


def test_random_patterns_of_json_escaped_characters_write_only_json_they_match():
    """The same over 200 patterns of two or three atoms from the shapes above, with
    quantifiers, every text up to 6 characters (a fixed seed: the same patterns every
    run)."""
    import json
    import random
    import re
    chooser, convert = random.Random(1205), sg._converter()
    for _ in range(200):
        pattern = "^" + "".join(chooser.choice(PATTERN_ATOMS) + chooser.choice(["", "?", "{1,2}"])
                                for _ in range(chooser.randint(2, 3))) + "$"
        # (converted in this process: the child's limits are not what is tested here)
        grammar = convert(json.dumps(shapes.normalized({"type": "string", "pattern": pattern})))
        for text in _texts_of(grammar, 'a1 "\\ntu05c\n-_', 6):
            value = json.loads(text)
            assert re.fullmatch(pattern[1:-1], value), (pattern, text)


def test_enum_and_const_strings_with_backslashes_and_quotes_make_json_literals():
    """llama-cpp-python's converter escaped only quotes and line breaks in literals:
    `"a\\"b"` made a grammar that did not parse, `c\\d` one that wrote `"c\\d"` (not
    JSON). The literal is now the JSON text, every backslash escaped for the grammar."""
    grammar = sg.SchemaGrammars().grammar({"enum": ["a\"b", "c\\d", "C:\\temp"]})
    root = next(line for line in grammar.splitlines() if line.startswith("root ::="))
    assert root == 'root ::= "\\"a\\\\\\"b\\"" | "\\"c\\\\\\\\d\\"" | "\\"C:\\\\\\\\temp\\""'
    # a NUL is written as JSON writes it, `\\u0000` (it was a NUL in the grammar, refused)
    assert sg.SchemaGrammars().grammar({"const": "a\u0000b"}).startswith(
        'root ::= "\\"a\\\\u0000b\\""')


def test_a_patterns_work_counts_the_literal_each_quantifier_copies():
    # "ab{3}": the literal "ab" copied 4 times (3 + 1), 8 steps each besides; spaces
    # inside the braces are the converter's too
    assert sg.pattern_work("ab{3}", "p") == 5 + 4 * (2 + 8)
    assert sg.pattern_work("x{ 2 , 5 }", "p") == 10 + 6 * (1 + 8)
    assert sg.pattern_work("(ab){2}c", "p") == 8 + 3 * (1 + 8)      # a group: named once
    spaces = "{" + " " * (sg.MAX_PATTERN - 2) + "x"                  # no quantifier in it
    assert sg.pattern_work(spaces, "p") == sg.MAX_PATTERN
    # an escaped backslash before a quantifier repeats the backslash (a look-behind read
    # the brace as escaped: `\\{0,2400}` passed, and its grammar went past the bound)
    assert sg.pattern_work("\\{3}", "p") == 4                     # (a brace: no count)
    with pytest.raises(sg.SchemaRefused, match="repeats more than"):
        sg.pattern_work("^\\\\{0,2400}$", "p")


@pytest.mark.parametrize("depth", [101, 985, 5000])
def test_a_schema_nested_past_the_depth_bound_is_refused(depth):
    """A schema (or a value in it) nesting arrays 985 deep was a 500: its text, made to
    key the kept conversions, went past Python's recursion limit. Past MAX_DEPTH it is
    refused by name, however deep (5,000 levels: its text cannot even be made)."""
    nested: list = []
    for _ in range(depth - 1):
        nested = [nested]
    with pytest.raises(sg.SchemaRefused, match="more than 100 deep"):
        sg.SchemaGrammars().grammar({"enum": [nested]})
    inner: dict = {"type": "string"}
    for _ in range(40):                          # (40 objects deep: a real schema's room)
        inner = {"type": "object", "properties": {"a": inner}, "required": ["a"]}
    assert "root ::=" in sg.SchemaGrammars().grammar(inner)


def test_values_are_not_read_as_schemas():
    """`enum`, `const`, `default` and `examples` hold JSON values: a long string under a
    key named `pattern` there is text, not a regular expression to bound."""
    long = {"pattern": "x" * (sg.MAX_PATTERN + 1)}
    for key in sg.VALUES:
        assert sg.estimate({"type": "object", key: [long] if key != "const" else long}) \
            < sg.MAX_WORK
    with pytest.raises(sg.SchemaRefused):
        sg.estimate({"type": "object", "properties": {"a": long}})


def test_a_schema_is_converted_once_and_refusals_are_remembered():
    ran = []
    grammars = sg.SchemaGrammars(run=lambda text: ran.append(text) or 'root ::= "x"')
    for _ in range(3):
        assert grammars.grammar({"type": "string"}) == 'root ::= "x"'
    assert len(ran) == 1


def test_the_converters_own_errors_are_a_message_and_a_hang_is_cut_off(monkeypatch):
    with pytest.raises(sg.SchemaRefused) as refused:
        sg.SchemaGrammars().grammar({"type": "no-such-type"})
    assert "unsupported or invalid json schema" in str(refused.value).lower()
    with pytest.raises(sg.SchemaRefused) as refused:
        sg.SchemaGrammars().grammar({"$ref": "https://example.com/schema.json"})
    assert "unsupported or invalid" in str(refused.value).lower()   # never fetched
    # a shape nobody counted: the child's deadline ends it (here, the child sleeps)
    monkeypatch.setattr(sg, "CONVERT_SECONDS", 1.0)
    import subprocess
    import sys
    real_run = subprocess.run
    monkeypatch.setattr(sg.subprocess, "run", lambda argv, **kw: real_run(
        [sys.executable, "-c", "import time; time.sleep(30)"], **kw))
    started = time.perf_counter()
    with pytest.raises(sg.SchemaRefused) as refused:
        sg.SchemaGrammars().grammar({"type": "string"})
    assert "took more than 1 s" in str(refused.value)
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize("grammar, stacks", [
    ('root ::= "a"', 1),
    ("root ::= [a-c]*", 2),
    ('root ::= ("x" | "y")* "z"', 3),
    ("root ::= " + " | ".join(f'"k{i}"' for i in range(200)), 200),
])
def test_grammars_within_the_stack_bound_are_accepted(grammar, stacks):
    gbnf.check(grammar)
    parser = gbnf._Parser(grammar)
    pos = parser.space(0, True)
    while parser.src[pos] != "\x00":
        pos = parser.rule(pos)
    names = {i: n for n, i in parser.symbols.items()}
    assert gbnf.stack_width([r or [] for r in parser.rules], parser.symbols["root"],
                            names)[0] == stacks


@pytest.mark.parametrize("grammar, says", [
    ("root ::= x x\nx ::= " + " | ".join(f'"{chr(0x4E00 + i)}"' for i in range(4000)),
     "4,000 parse stacks"),
    ('root ::= r\nr ::= "a" r y | "d"\ny ::= "b" | ', "unboundedly many"),
    ('root ::= n root "x" | "y"\nn ::= e\ne ::= "a" | ', "may be empty"),
    ("root ::= [" + "".join(chr(0x4E00 + i) for i in range(1100)) + "]",
     "character-class elements"),
])
def test_grammars_that_would_cost_seconds_a_token_are_refused(grammar, says):
    with pytest.raises(gbnf.GrammarRefused) as refused:
        gbnf.check(grammar)
    assert says in str(refused.value)


def _alike(k: int, lead: str = "[ -~]") -> str:
    """k alternatives that begin alike and go on into the rule itself, each closed by
    its own character: the stacks multiply by k at every character."""
    return "a ::= " + " | ".join(f'{lead} a "{chr(65 + i % 26)}{i}"' for i in range(k))


@pytest.mark.parametrize("grammar", [
    "root ::= a\n" + _alike(2),
    "root ::= a\n" + _alike(64),                          # (4,096 at the first character)
    'root ::= a\na ::= "x" "y" a "A" | "x" "y" a "B" | "z"',     # (alike for two)
    'root ::= "b"{60} a\n' + _alike(2),                    # (behind a fixed prefix)
    'root ::= [a-z]{50} "q" a\na ::= "x" a "A" | "x" a "B" | "z"',
    'root ::= a\na ::= "x" a "A" | "x" a "B" | ' +           # (beside steady decoys)
    " | ".join(f'[{chr(97 + i)}] [a-w]+ "!{i}"' for i in range(20)),
    # (and the shapes a second read found past the first probe: a negated class none of
    # its few test characters fed, more decoys than its beam, a plateau of 14 before the
    # stacks multiply by 64, a class's fifth range, alternatives that begin alike only
    # inside a rule behind 60 fixed characters)
    "root ::= a\na ::= " + " | ".join(
        f'[^a0 \\"{{\\n_\u4e00\U0010ffff] a "a{i}"' for i in range(64)) + ' | "a"',
    'root ::= a\na ::= [^a] a "0" | [^0] a "a" | "a"',
    'root ::= a\na ::= "x" "y" a "A" | "x" "y" a "B" | "z" | ' +
    " | ".join(f'"{c}" w "{c}"' for c in "abcdefgh") + '\nw ::= "1" | "2" | "3"',
    "root ::= a\na ::= " + " | ".join(f'"{"q" * 14}" a "A{i}"' for i in range(64)) + ' | "z"',
    'root ::= a\na ::= [bcdex] a "b" | [fghix] a "f" | [jklmx] a "j" | [nopqx] a "n" | '
    '[rstux] a "r" | "b"',
    'root ::= "b"{60} s\ns ::= "x" o p q s "A" | "z"\no ::= | "x" s "B"\n'
    'p ::= | "x" s "C"\nq ::= | "x" s "D"',
])
def test_grammars_whose_parse_stacks_multiply_as_text_comes_are_refused(grammar):
    """Alternatives that begin alike and go on into the same rule keep a stack each:
    `a ::= [ -~] a "A" | [ -~] a "B" | ...` (k of them) multiplies llama.cpp's stacks by
    k at every character, within one token's accept (64: 4,096 stacks at the second
    character of " The", 3.7 s; the third, hours: the watchdog took the worker and every
    stream on it). A width counted at one place of the rules never sees it (2 to 64
    here); a probe feeding the stacks the text that keeps the most alive does."""
    started = time.perf_counter()
    with pytest.raises(gbnf.GrammarTooLarge) as refused:
        gbnf.check(grammar)
    assert "parse stacks reach" in str(refused.value)
    assert time.perf_counter() - started < 5


def test_a_json_schema_whose_choices_nest_alike_is_refused_and_a_tree_is_not():
    """The same through `json_schema`: choices that each open an array of the same
    rule multiply the stacks by their count at every `[`; a recursive tree of objects,
    whose choices part at their first character, passes."""
    alike = {"$defs": {"n": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/n"},
                                        "maxItems": i} for i in range(1, 5)]}},
             "$ref": "#/$defs/n"}
    with pytest.raises(sg.SchemaRefused) as refused:
        sg.SchemaGrammars().grammar(alike)
    assert "parse stacks reach" in str(refused.value)
    node = {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array",
                                                  "items": {"$ref": "#/$defs/node"}}}}
    expression = {"anyOf": [{"type": "number"}, {"type": "object", "properties": {
        "op": {"enum": ["+", "-"]}, "args": {"type": "array",
                                             "items": {"$ref": "#/$defs/e"}}}}]}
    sg.SchemaGrammars().grammar({"$defs": {"node": node}, "$ref": "#/$defs/node"})
    sg.SchemaGrammars().grammar({"$defs": {"e": expression}, "$ref": "#/$defs/e"})


def test_the_example_grammars_pass_the_growth_probe_quickly():
    """llama.cpp's example grammars (as llama-cpp-python ships them), whose stacks do not
    multiply: accepted, each in well under a second; and a doubling slower than the
    probe sees (every seven characters: 128 stacks in its 48) is left to the guard at
    generation (tests/test_neighbours.py)."""
    import llama_cpp.llama_grammar as examples
    from dispatcher.common.grammar_growth import GROWTH_SYMBOLS, PROBED_STACKS
    for name in ("JSON_GBNF", "JSON_ARR_GBNF", "C_GBNF", "CHESS_GBNF", "ARITHMETIC_GBNF",
                 "JAPANESE_GBNF", "LIST_GBNF"):
        started = time.perf_counter()
        gbnf.check(getattr(examples, name))
        assert time.perf_counter() - started < 2.0, name
    assert 2 ** (GROWTH_SYMBOLS // 7 + 1) <= PROBED_STACKS  # (2**7 = 128 stacks: within 512)
    gbnf.check('root ::= r\nr ::= "aaaaaaa" r "b" | "aaaaaaa" r "c" | "d"')
    # a worker's checks leave the probe out: the front end ran it before any job
    gbnf.check("root ::= a\n" + _alike(64), growth=False)
    # optional groups reached by many paths: each stack advanced once, as llama.cpp does
    gbnf.check("root ::= " + "a " * 18 + '"z"\na ::= ("x"? "y"?)?')
    # an object of 150 optional properties: 298 stacks after its opening quote, which
    # the count over the rules saw as 152, served before the probe and after
    sg.SchemaGrammars().grammar({"type": "object", "properties": {
        f"field_{i:03d}": {"type": "string"} for i in range(150)}})


def test_which_chains_may_seek_a_refused_pick_without_the_whole_vocabulary():
    """A refused pick is drawn again only where a draw the grammar allows is a draw from
    the allowed tokens (no cut that depends on the set), and sought among the likeliest
    tokens only where the chain keeps those alone (greedy, top-k first)."""
    from workers.engine.samplers import plain_draw, top_first
    from workers.sampling import SamplingParams as S
    assert plain_draw(S(temperature=0.8)) and plain_draw(S(temperature=0.8,
                                                           repetition_penalty=1.1))
    for cut in (dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05), dict(typical_p=0.5),
                dict(mirostat=2), dict(dynatemp_range=0.5)):
        assert not plain_draw(S(temperature=0.8, **cut)), cut
    assert not plain_draw(S(temperature=0))
    assert top_first(S(temperature=0), True) == 1
    assert top_first(S(temperature=0.8, top_k=40), False) == 40
    assert top_first(S(temperature=0.8, top_k=1000), False) == 0
    assert top_first(S(temperature=0.8, top_k=40, repetition_penalty=1.1), False) == 0
    assert top_first(S(temperature=0.8, top_p=0.9), False) == 0


@pytest.mark.parametrize("schema, repeated", [
    ({"type": "string", "maxLength": 200}, "char{0,200}"),
    ({"type": "string", "minLength": 5, "maxLength": 2000}, "char{5,2000}"),
    ({"type": "string", "pattern": "^.{0,200}$"}, "root-1{0,200}"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 150},
     '(integer ("," space integer){0,149})?'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 3},
     'integer ("," space integer){2,}')])
def test_long_repetitions_are_written_with_gbnfs_own_bounds(schema, repeated):
    """The converter nested an optional group in another for each repetition past the
    least: `"maxLength": 200` (or `.{0,200}`, `"maxItems": 150`) made a grammar more than
    100 groups deep, a 400. GBNF's `{m,n}` says it in one place, as llama.cpp's own
    converter now writes it."""
    assert repeated in sg.SchemaGrammars().grammar(schema)


def test_what_a_repetition_takes_is_what_it_took():
    """The same texts over a few characters, bounds written either way."""
    import json
    convert = sg._converter()
    for schema in ({"type": "string", "minLength": 1, "maxLength": 3},
                   {"type": "array", "items": {"enum": [1]}, "minItems": 1, "maxItems": 3},
                   {"type": "array", "items": {"enum": [1]}, "maxItems": 2},
                   {"type": "string", "pattern": "^(ab){1,2}c{2}d{2,}$"}):
        texts = _texts_of(convert(json.dumps(shapes.normalized(schema))), 'ab1cd"[], ', 9)
        assert texts and all(json.loads(text) is not None for text in texts)
        bounds = schema.get("maxLength") or schema.get("maxItems")
        for text in texts:
            value = json.loads(text)
            if bounds:
                assert schema.get("minLength", schema.get("minItems", 0)) <= len(value) <= bounds
            else:
                import re
                assert re.fullmatch(schema["pattern"][1:-1], value)


@pytest.mark.parametrize("pattern, values", [
    ("\\d", ["1", "a1b", "11"]), ("^a", ["a", "ab1"]), ("1$", ["1", "a1"]),
    ("a|1", ["a", "b1", "1b"]), ("", ["", "ab"]), ("^a|b$", ["a", "ab1", "1b"]),
    ("^a$|^1$", ["a", "1"]), ("^\\d$|^\\d-\\d$", ["1", "1-1"])])
def test_a_pattern_without_anchors_matches_anywhere_as_json_schema_says(pattern, values):
    """JSON Schema's patterns search (ECMA-262): `\\d` is any string with a digit. The
    converter refused every pattern without both anchors (pydantic's `Field(pattern=
    r"\\d+")` was a 400); the free ends are now any characters, each choice's on its own
    (`^a$|^1$` wrote a `$` and a `^` as characters: invalid JSON)."""
    import json
    import re
    texts = _texts_of(sg.SchemaGrammars().grammar({"type": "string", "pattern": pattern}),
                      'ab1-"\\', 6)
    assert texts and all(re.search(pattern, json.loads(text)) for text in texts)
    assert all(json.dumps(value) in texts for value in values)


@pytest.mark.parametrize("schema, alphabet, length, some", [
    ({"type": "integer", "minimum": 0, "maximum": 100}, "-0123456789", 4, ["0", "100"]),
    ({"type": ["integer", "null"], "exclusiveMinimum": 0, "maximum": 12},
     "-0123456789nul", 4, ["1", "12", "null"]),
    ({"type": ["string", "null"], "enum": ["red", None, 3]}, 'rednul3"', 6,
     ['"red"', "null"]),
    ({"type": ["object", "null"], "properties": {"a": {"type": "integer", "minimum": 0,
                                                       "maximum": 3}}, "required": ["a"]},
     '-0134{}":anul ', 9, ['{"a": 3}', "null"]),
    ({"type": ["string", "integer"], "maxLength": 2, "minimum": 2, "maximum": 3},
     'ab"234', 4, ['"ab"', "2", "3"]),
    ({"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1}, "-019.nul", 5,
     ["1", "0.1", "1.00", "null"])])
def test_bounds_and_keywords_beside_a_list_of_types_are_kept(schema, alphabet, length, some):
    """The converter left integer and number bounds out (its own TODO: `minimum: 0` let
    the model write -5), and beside a list of types it kept the types bare: `properties`,
    `maxLength` and `enum` were left out (OpenAI's strict `{"type": ["string", "null"],
    "enum": [...]}` wrote any string). Every text the grammar takes is valid against
    the schema."""
    import json
    import jsonschema
    texts = _texts_of(sg.SchemaGrammars().grammar(schema), alphabet, length)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert set(some) <= texts
    with pytest.raises(sg.SchemaRefused, match="no integer lies between"):
        sg.SchemaGrammars().grammar({"type": "integer", "minimum": 0.2, "maximum": 0.8})
    for schema, says in (({"type": ["boolean", "null"], "const": 1}, "const value"),
                         ({"type": ["string"], "enum": [1, 2]}, "no enum value"),
                         ({"type": "array", "minItems": 2, "maxItems": 1}, "no list fits"),
                         ({"type": "string", "minLength": 1, "maxLength": 0},
                          "no string fits")):                  # (it wrote "")
        with pytest.raises(sg.SchemaRefused, match=says):
            sg.SchemaGrammars().grammar(schema)
    # a type named twice is named once (each level doubled the branches: 16 levels of
    # ["object", "object"] took the child past its 5 s)
    node = {"type": "integer"}
    for _ in range(16):
        node = {"type": ["object", "object", "object"], "properties": {"a": node}}
    assert len(sg.SchemaGrammars().grammar(node)) < 20_000
    # one rule for a range however many values have it (int32 bounds on 300 fields
    # passed the grammar's size limit)
    field = {"type": "integer", "minimum": -2 ** 31, "maximum": 2 ** 31 - 1}
    many = {f"f{i}": field for i in range(300)}
    assert len(sg.SchemaGrammars().grammar({"type": "object", "properties": many,
                                            "required": list(many)})) < 60_000


@pytest.mark.parametrize("schema, some", [
    ({"type": "string", "pattern": "^[a-c]+$", "maxLength": 3}, ['"a"', '"abc"']),
    ({"type": "string", "pattern": "^\\w*$", "minLength": 2, "maxLength": 2}, ['"ab"']),
    ({"type": "string", "pattern": "^.{1,9}$", "maxLength": 2}, ['"a"', '"ab"'])])
def test_a_patterns_length_bounds_are_kept_where_it_repeats_one_character(schema, some):
    """pydantic's `constr(pattern="^[a-z]+$", max_length=20)`: the converter took the
    pattern and left the lengths out."""
    import json
    import jsonschema
    texts = _texts_of(sg.SchemaGrammars().grammar(schema), 'abc"\\\\', 7)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert set(some) <= texts
    with pytest.raises(sg.SchemaRefused, match="no string of 4..9 characters"):
        sg.SchemaGrammars().grammar({"type": "string", "pattern": "^x{3}$", "minLength": 4,
                                     "maxLength": 9})


@pytest.mark.parametrize("schema, alphabet, length, some", [
    ({"type": "object", "required": ["c"], "definitions": {"Color": {"enum": ["r", "g"]}},
      "properties": {"c": {"allOf": [{"$ref": "#/definitions/Color"}], "title": "C"}}},
     '{}":crg ', 10, ['{"c": "r"}']),
    ({"allOf": [{"type": "integer"}, {"minimum": 0, "maximum": 12}]}, "-0123", 3,
     ["0", "12"]),
    ({"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {"const": 1}},
                                        "required": ["b"]}],
      "$defs": {"A": {"type": "object", "properties": {"a": {"const": 2}},
                      "required": ["a"]}}}, '{}":ab12, ', 16, ['{"a": 2, "b": 1}'])])
def test_all_of_as_pydantic_v1_and_hand_written_schemas_use_it(schema, alphabet, length, some):
    """The converter merges only objects' properties under `allOf`: pydantic v1's enum
    field (`{"allOf": [{"$ref": ...}], "title": ...}`) and `allOf` of an integer and
    its bounds wrote `{}`."""
    import json
    import jsonschema
    texts = _texts_of(sg.SchemaGrammars().grammar(schema), alphabet, length)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert set(some) <= texts


def _random_schema(rng, depth: int = 0) -> dict:
    """A small schema of the shapes real ones use: bounded integers and numbers,
    strings with lengths or patterns, enums, consts, lists of types, objects, arrays,
    anyOf, an allOf of one."""
    r = rng.random()
    if depth < 2 and r < 0.25:
        props = {k: _random_schema(rng, depth + 1)
                 for k in rng.sample(["a", "b"], rng.randint(1, 2))}
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": rng.sample(list(props), rng.randint(0, len(props)))}
    if depth < 2 and r < 0.4:
        bounds = {"maxItems": rng.randint(0, 2)} if rng.random() < 0.6 else {}
        return {"type": "array", "items": _random_schema(rng, depth + 1), **bounds}
    if depth < 2 and r < 0.5:
        return {"anyOf": [_random_schema(rng, depth + 1), _random_schema(rng, depth + 1)]}
    if depth < 2 and r < 0.55:
        return {"allOf": [_random_schema(rng, 2)], "description": "d"}
    return rng.choice([
        {"type": "integer", "minimum": rng.randint(-3, 3), "maximum": rng.randint(3, 12)},
        {"type": "integer", "exclusiveMinimum": rng.randint(-3, 3)},
        {"type": "number", "minimum": rng.choice([0, 0.5, -1]),
         "maximum": rng.choice([1, 2.5])},
        {"type": "number", "exclusiveMaximum": rng.choice([1, 0.5])},
        {"type": "string", "minLength": rng.randint(0, 1), "maxLength": rng.randint(1, 3)},
        {"type": "string", "pattern": rng.choice(
            ["^a+$", "^[a1]{1,2}$", "1", "^a|1$", "^[^a]$", '^["a]$'])},
        {"type": "string", "pattern": "^[a1]+$", "maxLength": 2},
        {"enum": rng.sample(["a", 1, None, True, "1", 0.5], rng.randint(1, 3))},
        {"const": rng.choice(["a", 1, None, [1], {"a": 1}])},
        {"type": ["integer", "null", "string"][:rng.randint(1, 3)], "minimum": 0,
         "maximum": 2, "maxLength": 1},
        {"type": ["string", "null"], "enum": ["a", None, 1]},
        {"type": "boolean"}])


def test_random_schemas_write_only_json_valid_against_them():
    """Every text of up to 5 characters the grammar of 60 random small schemas takes
    is JSON that `jsonschema` finds valid against the schema (a fixed seed: the same
    schemas every run; a longer run of the same found `minLength` above `maxLength`)."""
    import json
    import random
    import jsonschema
    rng, convert = random.Random(1206), sg._converter()
    for _ in range(60):
        schema = _random_schema(rng)
        try:
            grammar = convert(json.dumps(shapes.normalized(schema)))
        except ValueError:                       # (bounds nothing meets: refused)
            continue
        for text in _texts_of(grammar, '{}[]":,a1-0.5tnul', 5):
            jsonschema.validate(json.loads(text), schema)


def test_a_schema_waits_for_a_conversion_slot_a_bounded_time(monkeypatch):
    """Conversions run two at a time per front end; a flood of schemas never seen before
    kept every other schema waiting without end. Past CONVERT_WAIT: SchemaBusy (a 503
    to retry), never remembered as the schema's answer."""
    monkeypatch.setattr(sg, "CONVERT_WAIT", 0.2)
    grammars = sg.SchemaGrammars(run=lambda text: 'root ::= "1"', at_once=1)
    grammars.slots.acquire()                         # (a long conversion, still going)
    with pytest.raises(sg.SchemaBusy):
        grammars.grammar({"type": "integer"})
    grammars.slots.release()
    assert grammars.grammar({"type": "integer"}) == 'root ::= "1"'


def test_groups_around_a_whole_pattern_are_taken_off_in_one_pass():
    """Each group around the whole pattern was found by scanning what was left: 2,047 of
    them were 0.5 s a pattern, 200 such patterns 32 s of a front end's CPU before the
    schema was refused as too large. One pass now (well under the bound below); and a
    group's name may hold a `$` (ECMA-262), not an anchor."""
    import time
    from dispatcher.common.schemapatterns import _unwrapped, unsupported
    assert _unwrapped("(" * 2047 + "1" + ")" * 2047) == "1"
    assert _unwrapped("((a)|(b))") == "(a)|(b)" and _unwrapped("(a)(b)") == "(a)(b)"
    schema = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "(" * 2047 + str(i % 10) + ")" * 2047}
        for i in range(200)}}
    started = time.monotonic()
    with pytest.raises(sg.SchemaRefused, match="too large"):
        sg.estimate(schema)
    assert time.monotonic() - started < 5
    assert unsupported("^(?<$x>a)$") is None and unsupported("(?<n>^a$)") is None


def test_keywords_no_grammar_keeps_are_refused_and_bare_array_bounds_kept():
    """The converter reads `contains`, `minProperties`/`maxProperties` and
    `uniqueItems` nowhere, and makes an array without `items` its bare rule: each was
    left out, and the answer broke the schema (`maxItems: 0` wrote `[1]`,
    `maxProperties: 0` an object of several). The bounds of an array without `items`
    are kept now; the rest are refused by name (as OpenAI's strict mode does), where
    their value asks something. Empty `anyOf`/`oneOf`/`type` lists are named as an
    empty `enum` is (they were a GBNF parse error, or named 'anyOf' for a oneOf)."""
    grammars = sg.SchemaGrammars()
    assert _texts_of(grammars.grammar({"type": "array", "maxItems": 0}), "[]1,", 4) == {"[]"}
    two = _texts_of(grammars.grammar({"type": "array", "maxItems": 2}), "[]1,", 7)
    assert "[1,1]" in two and "[1,1,1]" not in two
    for schema, keyword in (({"type": "array", "contains": {"const": 5}}, "contains"),
                            ({"type": "object", "maxProperties": 0}, "maxProperties"),
                            ({"type": "object", "minProperties": 2}, "minProperties"),
                            ({"type": "array", "items": {"type": "integer"},
                              "uniqueItems": True}, "uniqueItems")):
        with pytest.raises(sg.SchemaRefused, match=f"'{keyword}' is a keyword"):
            grammars.grammar(schema)
    grammars.grammar({"type": "object", "minProperties": 0})         # (asks nothing)
    grammars.grammar({"type": "array", "items": {"type": "integer"}, "uniqueItems": False})
    for key in ("anyOf", "oneOf", "type"):
        with pytest.raises(sg.SchemaRefused, match=f"json_schema.{key} is empty"):
            grammars.grammar({key: []})


@pytest.mark.parametrize("schema", [
    {"type": "string"}, {"type": "string", "maxLength": 4},
    {"type": "array", "items": {"type": "string"}}, {"type": "object"}])
def test_strings_never_hold_a_raw_control_character(schema):
    """JSON writes a control character inside a string escaped: the converter's string
    characters (`[^"\\\\]`) let the model end a line inside one (seen under load: a
    `maxLength: 20` name with a line break in it, and the answer was not JSON). Every
    text of up to 5 characters the grammar takes is JSON, with no raw control
    character or DEL; escapes still are (`\\n`)."""
    import json
    grammar = sg.SchemaGrammars().grammar(schema)
    texts = _texts_of(grammar, '"a\n\t\x7f\x00\\n{}[]:', 5)
    assert texts
    for text in texts:
        json.loads(text)                    # (strict: a raw control character fails)
        assert not any(ord(c) < 0x20 or c == "\x7f" for c in text), repr(text)
    if schema.get("type") == "string":
        assert '"\\n"' in texts


def test_one_key_converting_schema_after_schema_leaves_a_slot_to_the_others(monkeypatch):
    """The front end converts two schemas at once: one key sending new schema after new
    schema held both, and every other key's waited CONVERT_WAIT s for a 503. A key's
    conversions go one at a time, so another key's finds a slot."""
    import threading
    monkeypatch.setattr(sg, "CONVERT_WAIT", 0.5)
    release, started = threading.Event(), []

    def run(text):
        started.append(text)
        release.wait(10)
        return 'root ::= "x"'
    grammars = sg.SchemaGrammars(run=run)
    schemas = [{"type": "string", "description": f"flood {i}"} for i in range(2)]
    busy = []

    def convert(schema):
        try:
            grammars.grammar(schema, scope="key-a")
        except sg.SchemaBusy:
            busy.append(schema)             # (its own second waits its turn, then 503)
    flood = [threading.Thread(target=convert, args=(s,)) for s in schemas]
    for thread in flood:
        thread.start()
    deadline = time.monotonic() + 5
    while not started and time.monotonic() < deadline:
        time.sleep(0.01)
    other = []
    neighbour = threading.Thread(target=lambda: other.append(grammars.grammar(
        {"type": "integer"}, scope="key-b")))
    neighbour.start()
    while len(started) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any("integer" in text for text in started)      # key-b got the second slot
    release.set()
    for thread in (*flood, neighbour):
        thread.join(10)
    assert other == ['root ::= "x"'] and len(busy) <= 1


def _takes(grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole (the reading `_texts_of` makes)."""
    import functools
    from dispatcher.common.grammar_rules import alternatives, ends
    parsed = gbnf.check(grammar)
    rules = parsed.rules
    expanded = functools.lru_cache(None)(lambda stack: _expanded(rules, stack))
    stacks = set().union(*(expanded(((parsed.root, start),))
                           for start, _ in alternatives(rules[parsed.root])))
    for c in text:
        following = set()
        for stack in stacks:
            if stack and _matches(rules[stack[-1][0]], stack[-1][1], ord(c)):
                rule_id, i = stack[-1]
                after = _after_char(rules[rule_id], i)
                following |= expanded(stack[:-1] + ((() if ends(rules[rule_id][after])
                                                     else ((rule_id, after),))))
        stacks = following
    return () in stacks


@pytest.mark.parametrize("extra", [True, {"type": "string"}])
def test_extra_properties_beside_declared_ones_are_not_written(extra):
    """pydantic's extra="allow" (`additionalProperties: true` beside `properties`): the
    converter's rule for extra properties after an optional one had no comma, so once
    the model wrote that property it could only go on to invalid JSON ({"name": "x",
    "age": 1} refused, {"name": "x", "age": 1 "k": {}} taken). Extra properties are
    not written: every answer is the schema's."""
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name"], "additionalProperties": extra}
    grammar = sg.SchemaGrammars().grammar(schema)
    assert _takes(grammar, '{"name": "x", "age": 1}') and _takes(grammar, '{"name": "x"}')
    assert not _takes(grammar, '{"name": "x", "age": 1 "k": "v"}')


def test_a_required_name_not_declared_is_a_property_of_any_value():
    """`required` naming a property `properties` does not declare: the converter left it
    out, and every answer broke the schema."""
    grammar = sg.SchemaGrammars().grammar({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a", "z"]})
    assert _takes(grammar, '{"a": 1, "z": null}') and not _takes(grammar, '{"a": 1}')


@pytest.mark.parametrize("schema, named", [
    ({"type": "string", "not": {"const": "a"}}, "'not'"),
    ({"type": "integer", "not": {"enum": [1, 2]}}, "'not'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, "'if'"),
    ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}},
     "'dependentRequired'"),
    ({"type": "object", "propertyNames": {"pattern": "^x"}}, "'propertyNames'"),
    ({"$ref": "#/$defs/x", "maximum": 2, "$defs": {"x": {"type": "integer"}}},
     r"beside a \$ref \(maximum\)"),
    ({"type": "object", "properties": {"size": {"allOf": [{"$ref": "#/$defs/S"}],
                                                "maximum": 9}},
      "$defs": {"S": {"type": "integer"}}}, r"beside an allOf that cannot be merged \(maximum\)"),
    ({"allOf": [{"type": "integer"}, {"type": "string"}]}, "different 'type'"),
    ({"type": "object", "properties": {"": {"type": "integer"}}}, 'named ""'),
])
def test_keywords_the_grammar_would_leave_out_are_refused(schema, named):
    """Beside a type, `not`, `if`/`then`, `dependentRequired`, `propertyNames`, keywords
    beside a `$ref` and an allOf the converter cannot merge were left out, and the
    answer broke the schema (`not: {const: "a"}` wrote "a"; an allOf of an integer and
    a bound wrote `{}`): a 400 naming them. A property named "" took the root's rule."""
    with pytest.raises(sg.SchemaRefused, match=named):
        sg.SchemaGrammars().grammar(schema)


def test_an_allof_of_bounds_keeps_the_tightest():
    """Parts bounding one value each their own way are merged to the tightest bounds
    (they wrote `{}`)."""
    grammar = sg.SchemaGrammars().grammar({"allOf": [{"type": "integer", "maximum": 5},
                                                     {"maximum": 3, "minimum": 1}]})
    assert [n for n in range(8) if _takes(grammar, str(n))] == [1, 2, 3]
    text = sg.SchemaGrammars().grammar({"allOf": [{"type": "string", "maxLength": 5},
                                                  {"maxLength": 2}]})
    assert _takes(text, '"ab"') and not _takes(text, '"abc"')


def test_a_grammar_past_the_limit_is_refused_by_the_child_not_sent():
    """A schema whose conversion copies its parts at every use (allOf references) made a
    37 MB grammar that crossed the pipe and was parsed on the front end's loop before
    the check refused it: the child says so instead."""
    part = {"type": "object", "properties": {f"property_{i}": {"type": "integer"}
                                             for i in range(600)},
            "required": [f"property_{i}" for i in range(600)]}
    schema = {"$defs": {"A": part}, "type": "array", "prefixItems": [
        {"allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/A"}]} for _ in range(40)]}
    with pytest.raises(sg.SchemaRefused, match="grammar it makes has [0-9,]+ characters"):
        sg.SchemaGrammars().grammar(schema)


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "object", "properties": {"y": {"$ref": "#/$defs/space"}}, "required": ["y"],
      "$defs": {"space": {"enum": ["a", "b"]}}}, '{"y": "a"}', '{"y": }'),
    ({"type": "object", "properties": {"n": {"type": "string"},
                                       "y": {"$ref": "#/definitions/string"}},
      "required": ["n", "y"], "definitions": {"string": {"enum": ["a", "b"]}}},
     '{"n": "zz", "y": "a"}', '{"n": "zz", "y": "q"}'),
    ({"$defs": {"": {"type": "integer"}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/"}}, "required": ["a"]}, '{"a": 7}', "7"),
])
def test_a_definition_named_as_a_built_in_rule_keeps_its_own(schema, good, bad):
    """The converter's references take an existing rule of the definition's name: one
    named `space` or `string` took the built-in rule (`{"y": }` written), one named ""
    the root (an integer where an object was asked for). They are renamed first."""
    grammar = sg.SchemaGrammars().grammar(schema)
    assert _takes(grammar, good) and not _takes(grammar, bad)


def test_a_patterns_surrogate_pair_is_its_character():
    """ECMA patterns write a character past U+FFFF as a surrogate pair's escapes: the
    converter made two classes of one surrogate each, which no UTF-8 text meets."""
    grammar = sg.SchemaGrammars().grammar({"type": "string", "pattern": "^\\uD83D\\uDE00$"})
    assert _takes(grammar, '"\U0001F600"')


def test_lazy_quantifiers_and_non_spaces_mean_what_they_say():
    """A lazy quantifier matches, whole, what the greedy one does: its `?` was read as
    "optional" (`^a+?$` took ""). `\\S` leaves out every space JavaScript's `\\s` names
    (it wrote a no-break space, U+2028, U+3000)."""
    lazy = sg.SchemaGrammars().grammar({"type": "string", "pattern": "^a+?$"})
    assert _takes(lazy, '"aa"') and not _takes(lazy, '""')
    counted = sg.SchemaGrammars().grammar({"type": "string", "pattern": "^\\d{2,3}?$"})
    assert _takes(counted, '"12"') and not _takes(counted, '"1"')
    word = sg.SchemaGrammars().grammar({"type": "string", "pattern": "^\\S+$"})
    assert _takes(word, '"ab"')
    assert not any(_takes(word, f'"a{space}b"') for space in "\u00a0\u2028\u3000 ")


@pytest.mark.parametrize("schema, said", [
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "no object fits"),
    ({"enum": {}}, "'enum' must be a list"),
    ({"anyOf": {}}, "'anyOf' must be a list"),
    ({"type": "array", "items": [], "maxItems": 1.5}, "'maxItems' must be a whole number"),
    ({"type": "string", "pattern": "^?a$"}, "the converter could not read it"),
])
def test_schemas_the_converter_misread_are_refused_in_their_own_words(schema, said):
    """The converter's own Python errors were the message ('prefixItems', "'bool' object
    has no attribute 'get'", a GBNF parse error about a newline)."""
    with pytest.raises(sg.SchemaRefused, match=said):
        sg.SchemaGrammars().grammar(schema)


def test_false_items_and_properties_and_a_tuple_with_items_mean_what_they_say():
    """`"items": false` is no item (past the tuple), a property `false` is never there,
    and beside `prefixItems` an `items` schema is left out (the converter wrote only
    `items`: a string where the tuple asked for an integer)."""
    empty = sg.SchemaGrammars().grammar({"type": "array", "items": False})
    assert _takes(empty, "[]") and not _takes(empty, "[1]")
    absent = sg.SchemaGrammars().grammar({"type": "object", "properties": {
        "a": False, "b": {"type": "integer"}}})
    assert _takes(absent, '{"b": 1}') and not _takes(absent, '{"a": 1}')
    assert shapes.normalized({"type": "array", "maxItems": 2.0})["maxItems"] == 2
    tuple_ = sg.SchemaGrammars().grammar({"type": "array", "prefixItems": [
        {"type": "integer"}], "items": {"type": "string"}})
    assert _takes(tuple_, "[1]") and not _takes(tuple_, '["x"]')


def test_a_long_enum_of_strings_converts_and_writes_only_its_values():
    """The converter writes an enum as one alternative a value, each beginning with a
    quote: the grammar held a parse stack for each, and past ~255 values (time zones)
    it was refused. Written as a trie of the values' beginnings it converts, and takes
    exactly those values (others of the enum's beside them)."""
    zones = [f"{region}/{city}_{i}" for i, (region, city) in enumerate(
        (r, c) for r in ("Africa", "America", "Asia", "Europe", "Pacific")
        for c in ("Abidjan", "Accra", "Adak", "Aden", "Almaty", "Amman", "Anadyr", "Aqtau",
                  "Athens", "Auckland", "Azores", "Bahia") * 10)]
    assert len(zones) == 600
    grammar = sg.SchemaGrammars().grammar({"type": "object", "properties": {
        "tz": {"enum": zones}}, "required": ["tz"]})
    for zone in zones[::37] + [zones[-1]]:
        assert _takes(grammar, f'{{"tz": "{zone}"}}'), zone
    for wrong in ("Europe/Athens", "Europe/Athens_1x", "europe/Athens_8", "", zones[0][:-1]):
        assert not _takes(grammar, f'{{"tz": "{wrong}"}}'), wrong
    mixed = sg.SchemaGrammars().grammar({"enum": [f"v{i}" for i in range(100)]
                                         + [1, None, 'a"b']})
    assert all(_takes(mixed, text) for text in ('"v7"', '"v99"', "1", "null", '"a\\"b"'))
    assert not _takes(mixed, '"v100"') and not _takes(mixed, '"v"')


@pytest.mark.parametrize("schema, good, bad", [
    # an allOf of inline objects (the converter merges their properties)
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "string"}},
                 "required": ["b"]}]}, '{"a": 1, "b": "x"}', '{"a": 1}'),
    # "type": "object" beside an allOf of references (OpenAPI's composition)
    ({"$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}},
                      "required": ["a"]},
                "B": {"type": "object", "properties": {"b": {"type": "string"}},
                      "required": ["b"]}},
      "type": "object", "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
     '{"a": 1, "b": "x"}', '{"a": 1}'),
    # a part requiring a name another part declares (it was added to it as any value)
    ({"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}},
                         "required": ["id"]}},
      "allOf": [{"$ref": "#/$defs/Base"}, {"type": "object", "properties": {
          "name": {"type": "string"}}, "required": ["id", "name"]}]},
     '{"id": 1, "name": "x"}', '{"id": "x", "name": "x"}'),
    # a keyword of no validation beside a $ref (pydantic's json_schema_extra)
    ({"type": "object", "properties": {"s": {"$ref": "#/$defs/S", "x-order": 1}},
      "required": ["s"], "$defs": {"S": {"type": "integer"}}}, '{"s": 1}', '{"s": "x"}'),
    # a required name not declared takes additionalProperties' schema
    ({"properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"},
      "required": ["a", "b"]}, '{"a": 1, "b": 2}', '{"a": 1, "b": "s"}'),
    # unevaluatedProperties false beside properties is what is written anyway
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "unevaluatedProperties": False}, '{"a": 1}', '{"a": 1, "b": 2}'),
    # draft 3's `required: true` inside a property is left out, as before
    ({"properties": {"name": {"type": "string", "required": True}}}, '{"name": "x"}',
     '{"name": 1}'),
    # ECMA's surrogate classes for characters past U+FFFF, beside others
    ({"type": "string", "pattern": "^(?:[^\\uD800-\\uDFFF]|[\\uD800-\\uDBFF][\\uDC00-\\uDFFF])+$"},
     '"a\U0001F600"', '""'),
    ({"type": "string", "pattern": "^(?:[a-z]|\\uD83D[\\uDE00-\\uDE4F])+$"},
     '"a\U0001F600"', '"A"'),
    # a brace inside a class is no quantifier
    ({"type": "string", "pattern": "^[{+}]+$"}, '"{+}"', '"a"'),
    # an enum whose trie would nest past the grammar's bound stays an enum
    ({"enum": ["x" * n for n in range(1, 151)]}, '"xxx"', '"y"'),
])
def test_what_the_fixes_must_not_refuse_converts_as_before(schema, good, bad):
    """A second read's cases: each converted before the schema fixes of this stop, and
    must convert and mean the same after them."""
    grammar = sg.SchemaGrammars().grammar(schema)
    assert _takes(grammar, good) and not _takes(grammar, bad)


def test_a_required_name_that_no_object_can_have_is_refused():
    with pytest.raises(sg.SchemaRefused, match="no object fits"):
        sg.SchemaGrammars().grammar({"properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False, "required": ["a", "b"]})


def test_a_recursive_definition_with_a_name_no_rule_can_have_converts():
    """OpenAI's own structured-output example, a linked list: the converter wrote the
    recursive reference to `linked_list_node` as that name, and the grammar did not
    parse. Such definitions are renamed first, their references too."""
    node = {"type": "object", "properties": {"value": {"type": "number"}, "next": {
        "anyOf": [{"$ref": "#/$defs/linked_list_node"}, {"type": "null"}]}},
        "required": ["value", "next"], "additionalProperties": False}
    grammar = sg.SchemaGrammars().grammar({**node, "$defs": {"linked_list_node": node}})
    assert _takes(grammar, '{"value": 1, "next": {"value": 2, "next": null}}')
    assert not _takes(grammar, '{"value": 1}')


@pytest.mark.parametrize("schema, good, bad", [
    # OpenAPI's nullable reference: an annotation beside a one-part allOf (it wrote {})
    ({"type": "object", "properties": {"color": {"nullable": True, "allOf": [
        {"$ref": "#/$defs/Color"}]}}, "required": ["color"],
      "$defs": {"Color": {"type": "string", "enum": ["red", "green"]}}},
     '{"color": "red"}', '{"color": {}}'),
    # a definition named as a property's rule (`a_b` and `a-b`) keeps its own
    ({"type": "object", "properties": {"a_b": {"type": "string", "maxLength": 3},
                                       "c": {"$ref": "#/$defs/a_b"}},
      "required": ["a_b", "c"], "$defs": {"a_b": {"type": "integer"}}},
     '{"a_b": "x", "c": 1}', '{"a_b": "x", "c": "y"}'),
    # `type` said again beside a $ref
    ({"type": "object", "properties": {"s": {"$ref": "#/$defs/S", "type": "object"}},
      "required": ["s"], "$defs": {"S": {"type": "object", "properties": {
          "q": {"type": "integer"}}, "required": ["q"]}}}, '{"s": {"q": 1}}', '{"s": {}}'),
    # draft 7: a $ref's siblings are ignored, as the draft says
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "properties": {"s": {"$ref": "#/definitions/S", "maximum": 3}}, "required": ["s"],
      "definitions": {"S": {"type": "integer"}}}, '{"s": 7}', '{"s": "x"}'),
    # names required of an object that declares none
    ({"type": "object", "required": ["a"]}, '{"a": 1}', "{}"),
    # a tuple cut to maxItems (a shorter one is valid)
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
      "maxItems": 1}, "[1]", '[1, "x"]'),
    # `type: string` beside a long enum: its other values are not written
    ({"type": "string", "enum": [f"v{i}" for i in range(70)] + [None]}, '"v1"', "null"),
])
def test_a_final_reads_cases_mean_what_they_say(schema, good, bad):
    grammar = sg.SchemaGrammars().grammar(schema)
    assert _takes(grammar, good) and not _takes(grammar, bad)


@pytest.mark.parametrize("schema, said", [
    ({"type": "object", "additionalProperties": False, "required": ["a"]}, "no object fits"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"},
      "minItems": 3}, "past prefixItems"),
    ({"type": "string", "pattern": "^\\\\uD83D[\\uDE00-\\uDE4F]$"}, "surrogate U\\+DE00"),
    ({"type": "object", "properties": {"extra": {"type": "integer"}}, "required": ["extra"],
      "allOf": [{"$ref": "#/$defs/Pet"}], "$defs": {"Pet": {"type": "object", "properties": {
          "name": {"type": "string"}}, "required": ["name"]}}},
     r"beside an allOf that cannot be merged \(properties, required\)"),
    ({"allOf": [{"$ref": "#/$defs/P"}, {"oneOf": [{"type": "object"}]}],
      "$defs": {"P": {"type": "object"}}}, "an allOf part with oneOf"),
])
def test_what_would_be_written_wrong_is_refused(schema, said):
    """Keywords beside an allOf the converter cannot merge, parts it does not merge, a
    tuple shorter than minItems with no item past it, names no object can have, and a
    pattern's escaped backslash before a low-surrogate class: a 400, not a wrong answer."""
    with pytest.raises(sg.SchemaRefused, match=said):
        sg.SchemaGrammars().grammar(schema)


def test_one_key_converts_one_schema_at_a_time_whatever_the_cache_scope(monkeypatch):
    """Under `--cache-scope shared` (no tenant scope) a key sending new schemas at once
    held both of the front end's conversions, and another key's schema waited for a 503.
    The turn is the key's (`who`): its second waits, another key's runs."""
    import threading
    monkeypatch.setattr(sg, "CONVERT_WAIT", 0.3)
    release, entered = threading.Event(), threading.Semaphore(0)
    grammars = sg.SchemaGrammars(run=lambda text: (entered.release(), release.wait(5),
                                                   'root ::= "1"')[2])
    outcomes = {}

    def convert(name, who, schema):
        try:
            outcomes[name] = grammars.grammar(schema, scope=None, who=who)
        except sg.SchemaBusy:
            outcomes[name] = "busy"
    first = threading.Thread(target=convert, args=("a1", "key-a", {"type": "integer"}))
    first.start()
    assert entered.acquire(timeout=10)                   # a1 is converting
    convert("a2", "key-a", {"type": "string"})           # key a's second: its turn is taken
    other = threading.Thread(target=convert, args=("b1", "key-b", {"type": "boolean"}))
    other.start()
    assert entered.acquire(timeout=10)                   # b1 converts beside a1
    release.set()
    first.join()
    other.join()
    assert outcomes == {"a1": 'root ::= "1"', "a2": "busy", "b1": 'root ::= "1"'}


def test_one_key_sending_many_schemas_pushes_out_its_own_conversions(monkeypatch):
    """The kept conversions are bounded for all keys together: a key sending many
    distinct schemas evicts its own, and another key's kept one is not converted anew."""
    monkeypatch.setattr(sg, "CACHE_SIZE", 4)
    ran = []
    grammars = sg.SchemaGrammars(run=lambda text: ran.append(text) or 'root ::= "x"')
    mine = {"type": "object", "properties": {"victim": {"type": "string"}}}
    grammars.grammar(mine, scope="key-v")
    for i in range(20):
        grammars.grammar({"type": "object", "properties": {f"f{i}": {"type": "string"}}},
                         scope="key-f")
    before = len(ran)
    grammars.grammar(mine, scope="key-v")
    assert len(ran) == before and len(grammars.kept) == 4
    assert grammars.kept.tenants() == {"key-v": 1, "key-f": 3}
