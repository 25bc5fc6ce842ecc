"""What a management route is: its method, path, handler and what ``/openapi.json`` says of it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel

from pdproxy.server.asgi_types import HTTPReceive, HTTPScope

if TYPE_CHECKING:
    from pdproxy.fleet.fleet import Fleet

__all__ = ["Handler", "PlainText", "Route", "WithHeaders", "template_of", "templates"]


@dataclass(frozen=True)
class PlainText:
    """An answer sent as ``text/plain``, for the routes whose callers read text (the peers')."""

    text: str


@dataclass(frozen=True)
class WithHeaders:
    """A JSON answer with response headers of its own (the ``Location`` of a worker made)."""

    answer: object
    headers: tuple[tuple[str, str], ...] = ()


#: A handler's answer: its status and a model (or, for routes without a fixed shape, JSON data,
#: or ``PlainText``).
Handler = Callable[["Fleet", HTTPScope, HTTPReceive], Awaitable[tuple[int, object]]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    #: The request body's model (``/openapi.json`` shows its schema), if the route takes one.
    body: type[BaseModel] | None = None
    #: The 200 answer's model, if it has a fixed shape.
    answer: type[BaseModel] | None = None
    responses: dict[int, str] = field(default_factory=dict)


def templates(routes: Iterable[Route]) -> dict[str, str]:
    """The routes whose last segment is a parameter (``/workers/{worker_id}``), by the prefix
    before it (``/workers/``)."""
    return {route.path.rpartition("/")[0] + "/": route.path for route in routes if route.path.endswith("}")}


def template_of(path: str, prefixes: Mapping[str, str]) -> str:
    """The route path that serves ``path``: a parameterised route's (see ``templates``) for a
    path under its prefix, else ``path`` itself. The parameter is the rest of the path, slashes
    and all: a handler may take a URL there."""
    for prefix, template in prefixes.items():
        if path.startswith(prefix) and len(path) > len(prefix):
            return template
    return path
