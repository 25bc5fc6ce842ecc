"""Typed stubs of the data plane extension (Rust, built by maturin)."""

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol, final

__version__: str

class _RouterConfig(Protocol):
    """What the router reads from `pdproxy.Settings` (by attribute)."""

    policy: str
    runtime_threads: int
    connect_timeout: float
    first_byte_timeout: float
    pool_idle_timeout: float
    pool_max_idle_per_node: int
    prefetch_limit: int

@final
class Router:
    """The node table, selection and forwarding. Every method but `forward` returns at once."""

    def __init__(self, config: _RouterConfig) -> None: ...
    @property
    def policy(self) -> str:
        """The routing policy's name."""

    def add_node(self, url: str, models: list[str] | None = None) -> str:
        """Adds a node (or updates the models of a registered one); returns its normalised URL.

        Raises:
            InvalidNode: the URL is not a usable http URL.
        """

    def remove_node(self, url: str) -> str:
        """Stops routing to a node; requests in flight run to their end.

        Raises:
            NodeNotFound: no node with this URL is registered.
        """

    def models(self) -> list[str]:
        """Models served by the registered nodes, deduplicated."""

    def nodes(self) -> list[dict[str, Any]]:
        """A snapshot of each node: url, generation, models, in_flight, requests, succeeded,
        failed, cancelled, mean_latency (seconds, or None)."""

    def forward(
        self, path: str, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ..., method: str = "POST"
    ) -> asyncio.Future[Response]:
        """Selects a node for `body` (by its `model`) and sends the request to it.

        Raises at once:
            InvalidRequest: the body is not a JSON object or a field has the wrong type.
            ModelNotFound: no node serves the model.
            NoNodeAvailable: no node is registered.

        The returned future raises `UpstreamConnectError`, `UpstreamTimeout` or `UpstreamError`
        when the node fails before its response head. Cancelling it cancels the upstream request.
        """

@final
class Response:
    """A node's response: the head, and the body as an async iterator of byte batches."""

    @property
    def status(self) -> int: ...
    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers without hop-by-hop headers, as ASGI wants them."""

    @property
    def node(self) -> str:
        """URL of the node that answered."""

    @property
    def body(self) -> bytes | None:
        """The whole body when it was read before the head was handed over (small responses
        that are not event streams); None when it streams. Iteration yields it too."""

    @property
    def closed(self) -> bool:
        """True once `close()` was called."""

    def __aiter__(self) -> Response: ...
    def __anext__(self) -> asyncio.Future[bytes]:
        """Everything received so far, cut after the last complete server-sent event."""

    def close(self) -> None:
        """Stops reading: closes the node's connection and releases its in-flight count now."""
