"""Sending a node's answer on to the client, shared by the disaggregation protocols."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from pdproxy._pdproxy import Response, TenantTicket, Trace
from pdproxy.asgi_types import Send
from pdproxy.config import Settings
from pdproxy.errors import InvalidAnswer

#: A node's API key by its URL (the fleet's ``api_key_of``).
ApiKeyOf = Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class PdRequest:
    """One disaggregated request, as every protocol's adapter takes it."""

    #: The path as the client sent it (with its query).
    path: str
    body: bytes
    #: The headers the nodes get.
    headers: list[tuple[bytes, bytes]]
    send: Send
    #: The proxy's headers on every answer (request id, rate limits).
    echo: list[tuple[bytes, bytes]]
    trace: Trace | None = None
    tenant: TenantTicket | None = None


async def read_all(response: Response, settings: Settings) -> bytes:
    """A node's whole answer, within ``answer_buffer_limit`` bytes and ``answer_timeout`` seconds;
    past either the answer is dropped (its connection closed) and the request fails with 502."""
    if response.body is not None:
        return response.body
    limit = settings.answer_buffer_limit
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(settings.answer_timeout):
            async for chunk in response:
                size += len(chunk)
                if size > limit:
                    raise InvalidAnswer(f"the node's answer is larger than the {limit} bytes the proxy reads whole")
                chunks.append(chunk)
    except TimeoutError:
        response.close()
        raise InvalidAnswer(f"the node's answer did not end within {settings.answer_timeout:g}s") from None
    except BaseException:
        response.close()
        raise
    return b"".join(chunks)


async def send_raw(send: Send, response: Response, raw: bytes, echo: list[tuple[bytes, bytes]]) -> None:
    """A node's whole answer (typically its error), status and body unchanged."""
    headers = [(n, v) for n, v in response.headers if n not in (b"content-length", b"x-request-id")]
    await send({"type": "http.response.start", "status": response.status, "headers": [*headers, *echo]})
    await send({"type": "http.response.body", "body": raw})


def with_echo(headers: list[tuple[bytes, bytes]], echo: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The node's headers plus the proxy's (request id, rate limits) that the node did not set."""
    present = {name for name, _ in headers}
    headers.extend(header for header in echo if header[0] not in present)
    return headers


async def relay(
    response: Response,
    send: Send,
    echo: list[tuple[bytes, bytes]],
    settings: Settings,
    on_first: Callable[[], object] | None = None,
) -> None:
    """Streams a node's answer back (its error answer read whole, within the answer limits).
    ``on_first`` runs once the answer proved to be under way: its first streamed batch, or a
    whole successful non-stream answer."""
    if response.status != 200:
        await send_raw(send, response, await read_all(response, settings), echo)
        return
    headers = with_echo(response.headers, echo)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    if response.body is not None:
        if on_first is not None:
            on_first()
        await send({"type": "http.response.body", "body": response.body})
        return
    from pdproxy.proxy import stream_body  # the hybrid path's, so both end streams the same way

    await stream_body(response, send, on_first=on_first)
