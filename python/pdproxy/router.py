"""``Router``: pdproxy's routing core, embeddable in any asyncio program.

    async with pdproxy.Router(nodes=["http://127.0.0.1:8001"]) as router:
        response = await router.forward("/v1/chat/completions", body)
        async for chunk in response:
            ...

Selection, in-flight accounting and forwarding run in the Rust data plane; this class adds
model discovery and the lifecycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from . import _pdproxy
from .config import Settings
from .discovery import ModelDiscovery

__all__ = ["Router"]

Headers = Sequence[tuple[bytes, bytes]]


class Router:
    """Routes OpenAI-style requests to a set of nodes.

    Args:
        nodes: node base URLs, added to those in ``settings.nodes``.
        settings: the configuration; keyword ``overrides`` replace single fields of it.
    """

    def __init__(self, nodes: Iterable[str] = (), *, settings: Settings | None = None, **overrides: Any) -> None:
        base = settings or Settings()
        self.settings = base.replace(**overrides) if overrides else base
        self._core = _pdproxy.Router(self.settings)
        self._discovery = ModelDiscovery(self._core, self.settings.discovery_timeout, self.settings.discovery_interval)
        for url in (*self.settings.nodes, *nodes):
            self.add_node(url)

    async def start(self) -> None:
        """Discovers the models of nodes added without a model list (one round, then in the background)."""
        await self._discovery.start()

    async def aclose(self) -> None:
        await self._discovery.aclose()
        self._core.close()

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def policy(self) -> str:
        return self._core.policy

    def add_node(self, url: str, models: Sequence[str] | None = None) -> str:
        """Adds a node, or updates an existing one; returns its normalised URL.

        Without ``models`` the node serves any model until discovery learns its list.
        """
        normalized = self._core.add_node(url, None if models is None else list(models))
        if models is None:
            self._discovery.watch(normalized)
        else:
            self._discovery.forget(normalized)
        return normalized

    def remove_node(self, url: str) -> str:
        """Stops routing to a node; its requests in flight run to their end. Raises ``NodeNotFound``."""
        normalized = self._core.remove_node(url)
        self._discovery.forget(normalized)
        return normalized

    def nodes(self) -> list[dict[str, Any]]:
        """One snapshot of every node: url, generation, models, in_flight, request counts, mean latency."""
        return self._core.nodes()

    def models(self) -> list[str]:
        """The models served by the registered nodes, deduplicated."""
        return self._core.models()

    def forward(
        self, path: str, body: bytes, headers: Headers = (), method: str = "POST"
    ) -> asyncio.Future[_pdproxy.Response]:
        """Routes ``body`` by its ``model`` and sends it to the chosen node.

        Returns an awaitable of the node's ``Response``. Raises ``InvalidRequest`` for a body
        that is not a JSON object, ``ModelNotFound`` or ``NoNodeAvailable`` when no node can
        take it; awaiting raises ``UpstreamError`` and its subclasses when the node fails.
        """
        return self._core.forward(path, body, headers if isinstance(headers, list) else list(headers), method)
