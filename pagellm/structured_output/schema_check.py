"""JSON-schema keywords xgrammar would silently ignore, found before compiling.

xgrammar drops some assertions with at most a log line (measured with xgrammar 0.2.9: a violating
instance is accepted for each keyword refused below). Generating against such a schema would give
output that does not validate, so these are refused with the keyword and its place in the schema.
Keywords it enforces, or enforces more strictly than the schema asks (patternProperties, propertyNames:
the output still validates), pass. Annotations (title, description, default, ...) and unknown keywords
are ignored, as JSON Schema itself says.
"""

from __future__ import annotations

# Assertions xgrammar does not enforce.
_UNSUPPORTED = {
    "not": "not", "if": "if/then/else", "then": "if/then/else", "else": "if/then/else",
    "dependentRequired": "dependentRequired", "dependentSchemas": "dependentSchemas",
    "dependencies": "dependencies", "contains": "contains", "minContains": "minContains",
    "maxContains": "maxContains",
}
# `format` values xgrammar turns into a grammar; any other would be ignored.
SUPPORTED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer", "uuid"})
# Keywords whose value is a schema, a list of schemas or a map of name -> schema.
_SCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
           "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_schema_feature(schema, path: str = "") -> str | None:
    """A sentence naming the first keyword xgrammar cannot enforce (with its JSON pointer), or None."""
    if not isinstance(schema, dict):
        return None
    where = f" at {path or '/'}"
    for key, name in _UNSUPPORTED.items():
        if key in schema:
            return f"the JSON-schema keyword {name!r}{where} is not supported"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' with more than one schema{where} is not supported"
    if schema.get("uniqueItems") is True:
        return f"'uniqueItems': true{where} is not supported"
    if "multipleOf" in schema and _types(schema) != {"integer"}:
        return f"'multipleOf'{where} is supported only for \"type\": \"integer\""
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        # Only references inside the schema: a file or URL is never fetched, and ignoring it would be silent.
        return f"'$ref': {ref!r}{where} is not supported: only references within the schema ('#/...')"
    fmt = schema.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        return (f"the string format {fmt!r}{where} is not supported (supported: "
                f"{', '.join(sorted(SUPPORTED_FORMATS))})")
    for key in _SCHEMA:
        found = unsupported_schema_feature(schema.get(key), f"{path}/{key}")
        if found:
            return found
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []) if isinstance(schema.get(key), list) else ():
            found = unsupported_schema_feature(sub, f"{path}/{key}/{i}")
            if found:
                return found
    if isinstance(schema.get("items"), list):  # the old tuple form of prefixItems
        for i, sub in enumerate(schema["items"]):
            found = unsupported_schema_feature(sub, f"{path}/items/{i}")
            if found:
                return found
    for key in _SCHEMA_MAPS:
        subs = schema.get(key)
        for name, sub in subs.items() if isinstance(subs, dict) else ():
            found = unsupported_schema_feature(sub, f"{path}/{key}/{name}")
            if found:
                return found
    return None


def _types(schema: dict) -> set[str]:
    t = schema.get("type")
    return {t} if isinstance(t, str) else set(t or [])
