"""What ``GET /v1/models`` says about a model: what the nodes serving it said, merged.

Engines describe their models beyond OpenAI's four fields: vLLM adds ``max_model_len``, ``root``
(the weights' path), ``parent`` and ``permission``; SGLang and LMDeploy similar. A client that
sizes its requests from ``max_model_len`` needs it through the proxy too. Each node's own card
(from its ``/v1/models``, read by model discovery) is kept, and the cards of the healthy nodes
serving a model are merged: a field all of them agree on is kept; ``max_model_len`` and the other
limits take the smallest (a request that fits it fits every node it may be routed to);
``created`` the earliest; any other field they disagree on is left out rather than picked from
one node at random. A model whose nodes told nothing (declared at registration, never probed)
gets OpenAI's fields alone, ``owned_by`` pdproxy.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdproxy._json_types import JsonObject, JsonValue

__all__ = ["merged_card"]

#: Fields whose smallest value is the one every node honours.
LIMITS = frozenset({"max_model_len", "context_length", "max_context_length", "max_total_tokens"})


def merged_card(model: str, cards: Iterable[JsonObject]) -> JsonObject:
    """The card of ``model`` from its nodes' ``cards`` (none: OpenAI's fields, ours)."""
    card: JsonObject = {"id": model, "object": "model", "created": 0, "owned_by": "pdproxy"}
    given = list(cards)
    if not given:
        return card
    fields: dict[str, list[JsonValue]] = {}
    for one in given:
        for name, value in one.items():
            fields.setdefault(name, []).append(value)
    for name, values in fields.items():
        if name in ("id", "object"):
            continue
        card.update((name, value) for value in _merged(name, values, len(given)))
    return card


def _merged(name: str, values: list[JsonValue], nodes: int) -> list[JsonValue]:
    """``[value]`` the nodes' values of ``name`` merge to, or ``[]`` when they disagree."""
    if len(values) == nodes and all(value == values[0] for value in values):
        return [values[0]]
    numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if (name in LIMITS or name == "created") and numbers:
        return [min(numbers)]
    return []
