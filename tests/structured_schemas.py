"""JSON schemas for the structured-output tests, and a small validator for what they use.

jsonschema is not a dependency, so `validate` checks the keywords these schemas use (and raises on any
other, so a schema added here cannot pass unchecked). Strings are bounded with maxLength and arrays with
maxItems where a tiny random model would otherwise ramble until max_tokens.
"""

from __future__ import annotations

import re

_S = {"type": "string", "maxLength": 6}
_DEFS_PERSON = {"$defs": {"Person": {"type": "object", "properties": {"name": _S, "age": {
    "type": "integer", "minimum": 0, "maximum": 150}}, "required": ["name", "age"]}}}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": _S, "ok": {"type": "boolean"}}, "required": ["name", "ok"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}}, "required": ["x"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}}, "required": ["n"]},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}},
     "required": ["n"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"v": {"enum": [1, "two", None, True]}}, "required": ["v"]},
    {"type": "object", "properties": {"k": {"const": "fixed"}}, "required": ["k"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _S, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                       "maximum": 9}, "minItems": 2, "maxItems": 4}},
     "required": ["xs"]},
    {"type": "object", "properties": {"p": {"type": "array", "prefixItems": [{"type": "integer", "maximum": 99,
                                                                              "minimum": 0}, _S], "items": False}},
     "required": ["p"]},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"deep": {"type": "object",
     "properties": {"z": {"type": "boolean"}}, "required": ["z"]}}, "required": ["deep"]}}, "required": ["inner"]},
    {"type": "object", "properties": {"a": _S, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["a"]},  # b optional
    {"type": "object", "properties": {"opt": {"type": "boolean"}}},  # nothing required
    {"type": "object", "properties": {"maybe": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "null"}]}}, "required": ["maybe"]},
    {"type": "object", "properties": {"u": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["u"]},
    {"type": "object", "properties": {"t": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}},
     "required": ["t"]},
    {**_DEFS_PERSON, "type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"]},
    {**_DEFS_PERSON, "type": "object", "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/Person"},
                                                                 "maxItems": 2}}, "required": ["people"]},
    {"$defs": {"Color": {"enum": ["c", "m", "y", "k"]}}, "type": "object",
     "properties": {"fg": {"$ref": "#/$defs/Color"}, "bg": {"$ref": "#/$defs/Color"}}, "required": ["fg", "bg"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["s"]},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 5},
    {"type": "array", "items": {"type": "object", "properties": {"k": _S}, "required": ["k"]}, "minItems": 1,
     "maxItems": 2},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "object", "properties": {"m": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0,
                                                                                        "maximum": 9},
                                            "maxProperties": 2}}, "required": ["m"]},
    {"type": "object", "properties": {"level": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}},
     "required": ["level"]},
    {"title": "Event", "description": "annotations are ignored", "type": "object",
     "properties": {"when": {"type": "string", "format": "time"}, "what": {**_S, "default": "x"}},
     "required": ["when", "what"]},
]


class Invalid(AssertionError):
    pass


_KNOWN = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
          "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
          "pattern", "anyOf", "oneOf", "$ref", "$defs", "format", "title", "description", "default", "multipleOf",
          "maxProperties", "minProperties"}
_FORMATS = {"date": r"\d{4}-\d{2}-\d{2}", "time": r"\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})",
            "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"}
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def validate(value, schema, root=None, path="$") -> None:
    root = root if root is not None else schema
    if schema is True:
        return
    if schema is False:
        raise Invalid(f"{path}: no value is allowed here")
    unknown = set(schema) - _KNOWN
    assert not unknown, f"the test validator does not know {unknown}"
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        validate(value, target, root, path)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, t) for t in types):
            raise Invalid(f"{path}: {value!r} is not of type {types}")
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        raise Invalid(f"{path}: {value!r} not in {schema['enum']}")
    if "const" in schema and not _same(value, schema["const"]):
        raise Invalid(f"{path}: {value!r} != {schema['const']!r}")
    for key in ("anyOf", "oneOf"):
        if key in schema:
            ok = 0
            for sub in schema[key]:
                try:
                    validate(value, sub, root, path)
                    ok += 1
                except Invalid:
                    pass
            if ok == 0 or (key == "oneOf" and ok != 1):
                raise Invalid(f"{path}: {value!r} matches {ok} of {key}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, bad in (("minimum", lambda v, b: v < b), ("maximum", lambda v, b: v > b),
                         ("exclusiveMinimum", lambda v, b: v <= b), ("exclusiveMaximum", lambda v, b: v >= b),
                         ("multipleOf", lambda v, b: v % b != 0)):
            if key in schema and bad(value, schema[key]):
                raise Invalid(f"{path}: {value!r} violates {key}={schema[key]}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", 10**9):
            raise Invalid(f"{path}: length of {value!r} out of bounds")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise Invalid(f"{path}: {value!r} does not match {schema['pattern']}")
        if "format" in schema and not re.fullmatch(_FORMATS[schema["format"]], value):
            raise Invalid(f"{path}: {value!r} is not a {schema['format']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", 10**9):
            raise Invalid(f"{path}: {len(value)} items out of bounds")
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            validate(item, prefix[i] if i < len(prefix) else schema.get("items", True), root, f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in value]
        if missing:
            raise Invalid(f"{path}: missing {missing}")
        if len(value) < schema.get("minProperties", 0) or len(value) > schema.get("maxProperties", 10**9):
            raise Invalid(f"{path}: {len(value)} properties out of bounds")
        for k, v in value.items():
            validate(v, props[k] if k in props else schema.get("additionalProperties", True), root, f"{path}.{k}")


def _is_type(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b or (_is_type(a, "number") and _is_type(b, "number") and a == b)
