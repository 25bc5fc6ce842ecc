"""Sending JSON answers and errors over ASGI, and reading JSON request bodies: one place for
each, so every endpoint answers the same way."""

from __future__ import annotations

import json

from pdproxy._json_types import JsonValue, loads
from pdproxy.errors import (
    ClientGone,
    InvalidRequest,
    PdproxyError,
    RequestTooLarge,
    UnsupportedMediaType,
)
from pdproxy.server.asgi_types import Headers, HTTPReceive, HTTPScope, Send

JSON_HEADERS = [(b"content-type", b"application/json")]


async def send_json(send: Send, status: int, payload: object, headers: Headers | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers or JSON_HEADERS})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


async def send_text(send: Send, status: int, text: str) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text.encode()})


async def send_error(send: Send, error: PdproxyError, extra: Headers | None = None) -> None:
    headers = error.headers() + (extra or [])
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.body()})


def header(scope: HTTPScope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def require_json(scope: HTTPScope) -> None:
    """Refuses a body declared as something other than JSON (no declaration is accepted)."""
    check_media_type(header(scope, b"content-type"))


def check_media_type(content_type: bytes | None) -> None:
    if content_type is None:
        return
    media = content_type.split(b";", 1)[0].strip().lower()
    if media != b"application/json" and not media.endswith(b"+json"):
        raise UnsupportedMediaType(f"the request body must be JSON, not {media.decode('latin-1')}")


async def read_body(receive: HTTPReceive, limit: int, declared: bytes | None) -> bytes:
    """The whole request body, refused past ``limit`` bytes (``declared``: its content-length
    header) while it is read."""
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidRequest("invalid content-length header") from None
        if size > limit:
            raise RequestTooLarge(f"request body is larger than {limit} bytes")
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise RequestTooLarge(f"request body is larger than {limit} bytes")
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body is larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def read_json(scope: HTTPScope, receive: HTTPReceive, limit: int) -> JsonValue:
    return parse_json(scope, await read_body(receive, limit, header(scope, b"content-length")))


def parse_json(scope: HTTPScope, body: bytes) -> JsonValue:
    """``body`` read as the JSON its content type must declare (or leave undeclared); ``None``
    when it is empty."""
    require_json(scope)
    if not body.strip():
        return None
    try:
        return loads(body)
    except ValueError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
