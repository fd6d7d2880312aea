"""Leaf text of an XML-style tool call -> a JSON value, by the tool's JSON schema.

Rule (shared/design/minimax_m3.md §4.3, after the MiniMax-M2/M3 parsers in vLLM and llama.cpp): leaf text is
stripped, then coerced by the declared type; strings stay verbatim; numbers, booleans, null, objects and arrays
parse as JSON; anything that does not fit its type falls back to the string. Without a schema for the value (tool
or property not declared) the string is kept: nothing was promised to the client about its type.
A union (`"type": [...]`, `anyOf`, `oneOf`) tries its non-string members first, then string.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

_FAIL = object()


def schema_types(schema: Optional[dict[str, Any]]) -> list[str]:
    """Declared JSON types of `schema`, non-string ones first; [] when nothing is declared."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types.extend(t for t in schema_types(sub) if t not in types)
    if not types and "properties" in schema:
        types = ["object"]
    if not types and "items" in schema:
        types = ["array"]
    return [t for t in types if t != "string"] + [t for t in types if t == "string"]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return _FAIL


def _integer(text: str) -> Any:
    value = _json(text)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else _FAIL


def _number(text: str) -> Any:
    value = _json(text)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else _FAIL


def _boolean(text: str) -> Any:
    return {"true": True, "false": False}.get(text.lower(), _FAIL)


def _null(text: str) -> Any:
    return None if text in ("null", "None", "") else _FAIL


def _object(text: str) -> Any:
    value = {} if text == "" else _json(text)
    return value if isinstance(value, dict) else _FAIL


def _array(text: str) -> Any:
    value = [] if text == "" else _json(text)
    return value if isinstance(value, list) else _FAIL


_COERCERS: dict[str, Callable[[str], Any]] = {
    "string": lambda text: text, "integer": _integer, "number": _number, "boolean": _boolean,
    "null": _null, "object": _object, "array": _array,
}


def coerce_leaf(text: str, schema: Optional[dict[str, Any]]) -> Any:
    """Stripped `text` as the first of the schema's types it fits; the string itself if none (or no schema)."""
    text = text.strip()
    for type_name in schema_types(schema):
        coerce = _COERCERS.get(type_name)
        value = coerce(text) if coerce else _FAIL
        if value is not _FAIL:
            return value
    return text


def wants(schema: Optional[dict[str, Any]], type_name: str) -> bool:
    """Does `schema` declare `type_name` among its types?"""
    return type_name in schema_types(schema)


def _find_sub_schema(schema: Any, pick: Callable[[dict], Any]) -> Optional[dict[str, Any]]:
    """`pick(schema)`, else the first hit among its anyOf / oneOf members (depth first); None if none."""
    if not isinstance(schema, dict):
        return None
    found = pick(schema)
    if isinstance(found, dict):
        return found
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            found = _find_sub_schema(sub, pick)
            if found is not None:
                return found
    return None


def property_schema(schema: Optional[dict[str, Any]], name: str) -> Optional[dict[str, Any]]:
    """Schema of property `name` of an object schema; None if undeclared."""
    return _find_sub_schema(schema, lambda s: s["properties"].get(name) if isinstance(s.get("properties"), dict)
                            else None)


def items_schema(schema: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Schema of an array schema's items; None if undeclared."""
    return _find_sub_schema(schema, lambda s: s.get("items"))
