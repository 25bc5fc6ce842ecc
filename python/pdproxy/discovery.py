"""Model discovery: learn which models a node serves from its ``GET /v1/models``.

A node added without a model list is routable at once (for any model) and probed in the
background; until it answers, it is probed again every ``discovery_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:
    from ._pdproxy import Router as CoreRouter

log = logging.getLogger("pdproxy.discovery")


class ModelDiscovery:
    def __init__(self, core: CoreRouter, timeout: float, interval: float) -> None:
        self._core = core
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._interval = interval
        self._pending: set[str] = set()
        self._wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    def watch(self, url: str) -> None:
        """Probes ``url`` (a normalised node URL) until its models are known."""
        self._pending.add(url)
        self._wake.set()

    def forget(self, url: str) -> None:
        self._pending.discard(url)

    @property
    def pending(self) -> frozenset[str]:
        return frozenset(self._pending)

    async def start(self) -> None:
        """Probes every pending node once, then keeps retrying the silent ones in the background."""
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        await self.probe_pending()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pdproxy-model-discovery")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def probe_pending(self) -> None:
        self._wake.clear()
        if self._pending:
            await asyncio.gather(*(self._probe(url) for url in list(self._pending)))

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            await self.probe_pending()

    async def _probe(self, url: str) -> None:
        assert self._session is not None
        try:
            async with self._session.get(f"{url}/v1/models") as response:
                if response.status != 200:
                    log.info("node %s answered /v1/models with %d; will retry", url, response.status)
                    return
                payload = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.info("node %s: model discovery failed (%s); will retry", url, type(e).__name__)
            return
        models = _model_ids(payload)
        if models is None:
            log.warning("node %s: /v1/models is not an OpenAI model list; will retry", url)
            return
        # The node may have been removed while it was being probed: do not add it back.
        if url in self._pending:
            self._pending.discard(url)
            self._core.add_node(url, models)
            log.info("node %s serves %s", url, ", ".join(models) or "no models")


def _model_ids(payload: object) -> list[str] | None:
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        return None
    ids = [card.get("id") for card in payload["data"] if isinstance(card, dict)]
    return [i for i in ids if isinstance(i, str)]
