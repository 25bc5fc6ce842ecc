"""Sending a node's answer on to the client, shared by the disaggregation protocols."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdproxy._pdproxy import Response, TenantTicket, Trace
from pdproxy.asgi_types import Send

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


async def read_all(response: Response) -> bytes:
    return response.body if response.body is not None else b"".join([c async for c in response])


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
    response: Response, send: Send, echo: list[tuple[bytes, bytes]], on_first: Callable[[], object] | None = None
) -> None:
    """Streams a node's answer back. ``on_first`` runs once the answer proved to be under way:
    its first streamed batch, or a whole successful non-stream answer."""
    if response.status != 200:
        await send_raw(send, response, await read_all(response), echo)
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
