"""JSON as Python holds it once parsed: the one type for values whose shape is the sender's
(a request body relayed, a node's answer, a saved registration). Shapes pdproxy fixes itself
are ``TypedDict``s in the module that owns them. Imports nothing of pdproxy, so the inference
path may use it."""

from __future__ import annotations

import json
from typing import TypeAlias

__all__ = ["JsonObject", "JsonValue", "loads"]

#: Any JSON value, as ``json.loads`` returns it.
JsonValue: TypeAlias = "str | int | float | bool | list[JsonValue] | dict[str, JsonValue] | None"
#: A JSON object.
JsonObject: TypeAlias = "dict[str, JsonValue]"


def loads(text: str | bytes) -> JsonValue:
    """``json.loads``, typed: raises ``ValueError`` for text that is not JSON, or that nests
    deeper than the parser goes."""
    try:
        value: JsonValue = json.loads(text)
    except RecursionError:
        raise ValueError("the JSON nests too deeply") from None
    return value
