"""The parts of ASGI the control plane's app uses (the spec's HTTP and lifespan scopes and
messages), typed, so that every read of a scope or a message is checked. Imports nothing, so
the inference path may use it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal, NotRequired, TypeAlias, TypedDict

__all__ = [
    "HTTPReceive",
    "HTTPReceiveMessage",
    "HTTPScope",
    "Headers",
    "LifespanScope",
    "Receive",
    "ReceiveMessage",
    "ResponseBody",
    "ResponseStart",
    "Scope",
    "Send",
    "SendMessage",
]

#: Header names and values as ASGI carries them (names lower-cased).
Headers: TypeAlias = list[tuple[bytes, bytes]]


class HTTPScope(TypedDict):
    type: Literal["http"]
    method: str
    #: Decoded; ``raw_path`` is the path as the client sent it.
    path: str
    raw_path: NotRequired[bytes | None]
    query_string: NotRequired[bytes]
    headers: Headers
    #: The client's (host, port), when known.
    client: NotRequired[tuple[str, int] | None]
    scheme: NotRequired[str]


class LifespanScope(TypedDict):
    type: Literal["lifespan"]


Scope: TypeAlias = HTTPScope | LifespanScope


class HTTPRequest(TypedDict):
    type: Literal["http.request"]
    body: NotRequired[bytes]
    more_body: NotRequired[bool]


class HTTPDisconnect(TypedDict):
    type: Literal["http.disconnect"]


class LifespanStartup(TypedDict):
    type: Literal["lifespan.startup"]


class LifespanShutdown(TypedDict):
    type: Literal["lifespan.shutdown"]


class ResponseStart(TypedDict):
    type: Literal["http.response.start"]
    status: int
    headers: NotRequired[Headers]


class ResponseBody(TypedDict):
    type: Literal["http.response.body"]
    body: NotRequired[bytes]
    more_body: NotRequired[bool]


class LifespanStartupComplete(TypedDict):
    type: Literal["lifespan.startup.complete"]


class LifespanStartupFailed(TypedDict):
    type: Literal["lifespan.startup.failed"]
    message: str


class LifespanShutdownComplete(TypedDict):
    type: Literal["lifespan.shutdown.complete"]


HTTPReceiveMessage: TypeAlias = HTTPRequest | HTTPDisconnect
ReceiveMessage: TypeAlias = HTTPReceiveMessage | LifespanStartup | LifespanShutdown
SendMessage: TypeAlias = (
    ResponseStart | ResponseBody | LifespanStartupComplete | LifespanStartupFailed | LifespanShutdownComplete
)

#: What an HTTP request's ``receive`` gives (an ASGI server gives a scope's own messages only).
HTTPReceive: TypeAlias = Callable[[], Awaitable[HTTPReceiveMessage]]
Receive: TypeAlias = Callable[[], Awaitable[ReceiveMessage]]
Send: TypeAlias = Callable[[SendMessage], Awaitable[None]]
