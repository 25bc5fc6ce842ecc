"""What a management route is: its method, path, handler and what ``/openapi.json`` says of it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel

from .asgi_types import HTTPReceive, HTTPScope

if TYPE_CHECKING:
    from .fleet import Fleet

__all__ = ["Handler", "PlainText", "Route"]


@dataclass(frozen=True)
class PlainText:
    """An answer sent as ``text/plain``, for the routes whose callers read text (the peers')."""

    text: str


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
