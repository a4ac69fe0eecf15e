"""JSON schemas as llama-cpp-python's converter takes them, meaning what JSON Schema says
(`shaped`): the shapes it misreads rewritten into ones it reads right (`true` and `{}`
where a schema goes, a list of types with their keywords, mergeable allOfs, objects'
extra and undeclared required properties, `false` items and properties, long string
enums as tries, definitions renamed so that no rule of theirs is taken), and the
keywords it would leave out (so that an answer broke the schema) refused by name, as a
ValueError the child process reports. Pure functions over the schema's JSON; the budget
and the child process are `dispatcher.common.schemagrammar`'s."""
from __future__ import annotations

import hashlib
import re

from dispatcher.common.schemapatterns import anchored, converter_pattern, length_bounded

COUNTS = ("minItems", "maxItems", "minLength", "maxLength")

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


def shaped(schema: object) -> object:
    """`schema` as the converter takes it: its definitions renamed (`renamed_definitions`),
    then every node `normalized`, a $ref's siblings ignored where the draft its `$schema`
    names (4-7) says so."""
    _REF_SIBLINGS_IGNORED[0] = isinstance(schema, dict) and bool(
        _OLD_DRAFT.search(str(schema.get("$schema", ""))))
    return normalized(renamed_definitions(schema))
