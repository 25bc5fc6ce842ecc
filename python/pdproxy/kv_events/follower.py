"""Follows every node's KV events into the data plane's KV index (``rust/src/select/kv_index``).

Each rank of each healthy node gets a ``Subscription``; its events become ``Router.kv_*`` calls
(off the request path: the data plane only reads the index). Where a node's engine publishes
is given by a template of its URL's host (vLLM's ``--kv-events-config`` endpoint
``tcp://*:5557`` is ``tcp://{host}:5557`` from here, each data-parallel rank one port further),
or asked of the node's ``/server_info`` (``auto``: SGLang, and the mock engine, say there).

A rank is live, and priced from the index, while its subscription is connected and has no
unfilled gap; otherwise the approximate prefix table prices it, and ``status`` says why. A node
that leaves, or stops being healthy (restarting, perhaps), loses what the index held for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import zmq.asyncio

from pdproxy import _background, _pdproxy

from .subscriber import Endpoint, Subscription
from .wire import GPU, Batch, Cleared, Removed, Stored

log = logging.getLogger("pdproxy.kv_events")

#: How often subscriptions are matched to the node table, and their liveness to the index.
RECONCILE_S = 0.25
#: How long a node whose publisher could not be found waits before it is asked again.
RETRY_S = 10.0


@dataclass(frozen=True)
class KvEventsPlan:
    """Where the engines publish: ``endpoint`` and ``replay`` templates (``{host}``: the node's
    host; ``auto``: ask its ``/server_info``), ``ranks`` per node, the ``topic``."""

    endpoint: str
    replay: str | None = None
    ranks: int = 1
    topic: str = ""


class KvEventFollower:
    def __init__(
        self, router_core: _pdproxy.Router, plan: KvEventsPlan, *, session_of: Callable[[], aiohttp.ClientSession]
    ) -> None:
        self._core = router_core
        self._plan = plan
        self._session_of = session_of
        self._context = zmq.asyncio.Context()
        self._subscriptions: dict[tuple[str, int], Subscription] = {}
        self._live: dict[tuple[str, int], bool] = {}
        #: Why a node has no subscription (``auto`` found no publisher, say), and when to try again.
        self.errors: dict[str, str] = {}
        self._retry_at: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = _background.start(self._run(), "pdproxy-kv-events")

    async def aclose(self) -> None:
        await _background.stop(self._task)
        self._task = None
        for subscription in self._subscriptions.values():
            await subscription.close()
        self._subscriptions.clear()
        self._context.term()

    def statuses(self) -> dict[str, dict[str, object]]:
        """What ``/nodes/status`` shows of each followed node's events (a node not followed, and
        with no error to show, has no entry): one reading of the index for all nodes."""
        out: dict[str, dict[str, object]] = {}
        ranks: dict[str, dict[int, dict[str, object]]] = {}
        for (url, rank), subscription in self._subscriptions.items():
            figures = subscription.status.as_dict()
            # Live as the data plane prices it: what it was last told (each reconcile tells it).
            figures["live"] = self._live.get((url, rank), False)
            ranks.setdefault(url, {})[rank] = figures
        streams = self._core.kv_index_stats()["streams"]
        for node, rank, blocks, *_ in streams if isinstance(streams, list) else []:
            if rank in ranks.get(node, {}):
                ranks[node][rank]["blocks"] = blocks
        for url in {*ranks, *self.errors}:
            mine = ranks.get(url, {})
            out[url] = {
                "live": bool(mine) and all(r["live"] for r in mine.values()),
                "ranks": mine,
                **({"error": self.errors[url]} if url in self.errors else {}),
            }
        return out

    async def _run(self) -> None:
        while True:
            await self.reconcile()
            await asyncio.sleep(RECONCILE_S)

    async def reconcile(self) -> None:
        nodes = {n.url: n.state for n in self._core.views()}
        healthy = {url for url, state in nodes.items() if state == "healthy"}
        for key in [k for k in self._subscriptions if k[0] not in healthy]:
            await self._drop(key, "not healthy" if key[0] in nodes else "removed")
        for url in set(self.errors) - set(nodes):
            del self.errors[url]
            self._retry_at.pop(url, None)
        now = time.monotonic()
        for url in sorted(healthy):
            if not any(k[0] == url for k in self._subscriptions) and self._retry_at.get(url, 0.0) <= now:
                await self._follow(url)
        for key, subscription in self._subscriptions.items():
            live = subscription.status.live
            if self._live.get(key) != live:
                self._live[key] = live
                self._core.kv_live(key[0], key[1], live)

    async def _follow(self, url: str) -> None:
        try:
            endpoints = await self._endpoints(url)
        except _NoPublisher as e:
            self.errors[url] = str(e)
            self._retry_at[url] = time.monotonic() + RETRY_S
            return
        self.errors.pop(url, None)
        self._retry_at.pop(url, None)
        for endpoint in endpoints:
            subscription = Subscription(endpoint, _IndexSink(self._core), self._context)
            self._subscriptions[(url, endpoint.rank)] = subscription
            subscription.start()

    async def _drop(self, key: tuple[str, int], why: str) -> None:
        subscription = self._subscriptions.pop(key)
        self._live.pop(key, None)
        await subscription.close()
        if why == "removed":
            self._core.kv_forget_node(key[0])
        else:
            # Down, restarting perhaps: what it held is not known until its events say again.
            self._core.kv_cleared(key[0], key[1])
            self._core.kv_live(key[0], key[1], False)

    async def _endpoints(self, url: str) -> list[Endpoint]:
        plan = self._plan
        if plan.endpoint == "auto":
            events, replay, topic = await self._advertised(url)
        else:
            host = urlsplit(url).hostname or "127.0.0.1"
            host = f"[{host}]" if ":" in host else host
            events = plan.endpoint.format(host=host)
            replay = plan.replay.format(host=host) if plan.replay else None
            topic = plan.topic
        return [
            Endpoint(url, rank, _port_plus(events, rank), _port_plus(replay, rank) if replay else None, topic)
            for rank in range(plan.ranks)
        ]

    async def _advertised(self, url: str) -> tuple[str, str | None, str]:
        """The publisher the node's ``/server_info`` advertises (``kv_events_config``)."""
        session = self._session_of()
        for path in ("/server_info", "/get_server_info"):
            try:
                async with session.get(url + path, allow_redirects=False) as response:
                    if response.status != 200:
                        continue
                    info = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            config = info.get("kv_events_config") if isinstance(info, dict) else None
            if isinstance(config, str):  # SGLang passes its --kv-events-config through as JSON text
                try:
                    config = json.loads(config)
                except ValueError:
                    config = None
            if isinstance(config, dict) and isinstance(config.get("endpoint"), str):
                host = urlsplit(url).hostname or "127.0.0.1"
                replay = config.get("replay_endpoint")
                return (
                    _reachable(config["endpoint"], host),
                    _reachable(replay, host) if isinstance(replay, str) else None,
                    str(config.get("topic") or ""),
                )
        raise _NoPublisher("its /server_info advertises no KV event publisher (kv_events_config)")


class _NoPublisher(Exception):
    pass


class _IndexSink:
    """A subscription's events, into the data plane's index."""

    def __init__(self, core: _pdproxy.Router) -> None:
        self._core = core

    def apply(self, endpoint: Endpoint, batch: Batch) -> None:
        core, node, rank = self._core, endpoint.node, endpoint.rank
        for event in batch.events:
            if isinstance(event, Stored):
                # Blocks of another tier (CPU, disk), or of an adapter, are not what a prompt
                # of the base model finds on the GPU.
                if event.medium == GPU and event.lora is None:
                    core.kv_stored(
                        node, rank, list(event.block_hashes), event.parent, list(event.token_ids), event.block_size
                    )
            elif isinstance(event, Removed):
                if event.medium == GPU:
                    core.kv_removed(node, rank, list(event.block_hashes))
            elif isinstance(event, Cleared):
                core.kv_cleared(node, rank)

    def forget(self, endpoint: Endpoint, why: str) -> None:
        self._core.kv_cleared(endpoint.node, endpoint.rank)


def _port_plus(endpoint: str, offset: int) -> str:
    """``endpoint`` with its TCP port ``offset`` further (an engine's data-parallel ranks
    publish on consecutive ports)."""
    if offset == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + offset}"


def _reachable(endpoint: str, host: str) -> str:
    """An endpoint an engine bound (``tcp://*:5557``), as a subscriber connects to it."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard) :]}"
    return endpoint
