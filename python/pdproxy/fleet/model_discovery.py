"""Model discovery: learn which models a node serves from its ``GET /v1/models``.

A node added without a model list takes no traffic until its models are known: it is probed
at once (a registration waits for that first answer, ``probe``) and then in the background
until it answers. A node added with a declared list is probed once to verify it: when the node
answers, its own list wins; when it cannot be reached, the declared list is trusted (an
LMDeploy api_server registers before it accepts connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from pdproxy import _background
from pdproxy._json_types import JsonObject
from pdproxy.errors import NodeNotFound
from pdproxy.fleet.node_answers import read_json
from pdproxy.fleet.tls import node_session

if TYPE_CHECKING:
    from pdproxy._pdproxy import NodeView
    from pdproxy._pdproxy import Router as CoreRouter

log = logging.getLogger("pdproxy.discovery")


@dataclass
class _Pending:
    """A node still to probe (what it declared and its key are the node's own: ``core.node``)."""

    #: Why the last probe got no model list.
    failure: str | None = None


class ModelDiscovery:
    def __init__(self, core: CoreRouter, timeout: float, interval: float, ca_file: str = "") -> None:
        self._core = core
        self._timeout = timeout
        self._ca_file = ca_file
        self._interval = interval
        self._pending: dict[str, _Pending] = {}
        #: What each node's /v1/models said about each of its models (its card), by node URL.
        self._cards: dict[str, dict[str, JsonObject]] = {}
        self._wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    def watch(self, url: str) -> None:
        """Probes ``url`` (a normalised node URL): until its models are known, or once to
        verify those it declared."""
        self._pending[url] = _Pending()
        self._wake.set()

    def forget(self, url: str) -> None:
        self._pending.pop(url, None)
        self._cards.pop(url, None)

    def card(self, url: str, model: str) -> JsonObject | None:
        """The card of ``model`` in the node's last ``/v1/models`` answer, if it gave one."""
        return self._cards.get(url, {}).get(model)

    @property
    def pending(self) -> frozenset[str]:
        return frozenset(self._pending)

    def failures(self) -> dict[str, str]:
        """Why each node whose models are still unknown did not tell them, when it was asked."""
        return {url: p.failure for url, p in self._pending.items() if p.failure is not None and not self._declared(url)}

    async def start(self) -> None:
        """Probes every pending node once, then keeps at it in the background."""
        self._session = node_session(self._ca_file, self._timeout)
        await self.probe_pending()
        self._task = _background.start(self._run(), "pdproxy-model-discovery")

    async def aclose(self) -> None:
        await _background.stop(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def probe(self, url: str) -> NodeView | None:
        """Probes ``url`` now if it is still pending (one attempt, within the timeout); the
        node's view once its models are known (by this probe or an earlier one), else ``None``."""
        pending = self._pending.get(url)
        if pending is not None and self._session is not None:
            await self._probe(url, pending)
        # The background loop's probe may have told them first, before or during this one.
        if url in self._pending:
            return None
        with contextlib.suppress(NodeNotFound):
            return self._core.view(url)
        return None

    async def probe_pending(self, unknown_only: bool = False) -> None:
        """Probes every pending node concurrently (``unknown_only``: those that declared no models,
        which take no traffic until they answer)."""
        self._wake.clear()
        if self._pending and self._session is not None:
            pending = [(url, p) for url, p in self._pending.items() if not unknown_only or not self._declared(url)]
            await asyncio.gather(*(self._probe(url, p) for url, p in pending))

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation that
            # arrives as the event is set, and the task would never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await self._wake.wait()
            await self.probe_pending()

    def _declared(self, url: str) -> bool:
        with contextlib.suppress(NodeNotFound):
            return self._core.node(url)["declared_models"] is not None
        return False

    async def _probe(self, url: str, pending: _Pending) -> NodeView | None:
        assert self._session is not None
        try:
            node = self._core.node(url)
        except NodeNotFound:
            self._pending.pop(url, None)
            return None
        declared: list[str] | None = node["declared_models"]
        headers = {"authorization": f"Bearer {node['api_key']}"} if node["api_key"] else {}
        status: int | str
        try:
            async with self._session.get(f"{url}/v1/models", headers=headers, allow_redirects=False) as response:
                payload = await read_json(response) if response.status == 200 else None
                status = response.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            payload, status = None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        models = _model_ids(payload)
        # The node may have been removed or re-added while it was being probed.
        if self._pending.get(url) is not pending:
            return None
        if models is None:
            if declared is not None:
                # No probe possible: trust what the node declared, and stop probing.
                del self._pending[url]
                log.info("node %s: /v1/models unavailable (%s); trusting its declared models", url, status)
            else:
                pending.failure = f"/v1/models failed ({status})"
                log.info("node %s: model discovery failed (%s); will retry", url, status)
            return None
        del self._pending[url]
        self._cards[url] = _cards(payload)
        if declared is not None and sorted(declared) != sorted(models):
            log.warning("node %s declared models %s but serves %s; using what it serves", url, declared, models)
        view = self._core.set_models(url, models)
        log.info("node %s serves %s", url, ", ".join(models) or "no models")
        return view


def _cards(payload: object) -> dict[str, JsonObject]:
    """The model cards of a ``/v1/models`` answer, by model id."""
    data = payload.get("data") if isinstance(payload, dict) else None
    cards = [card for card in data if isinstance(card, dict)] if isinstance(data, list) else []
    return {card["id"]: card for card in cards if isinstance(card.get("id"), str)}


def _model_ids(payload: object) -> list[str] | None:
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        return None
    ids = [card.get("id") for card in payload["data"] if isinstance(card, dict)]
    return [i for i in ids if isinstance(i, str)]
