"""The wait queue when the nodes are full: tenants share a class evenly whatever they send, a
more urgent request overtakes those queued before it, and the least urgent class still moves."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from pdproxy.testing import MockEngine, MockSettings
from servers import Process, chat_body, eventually, pdproxy_serve

# One pipeline serves both edges: this suite runs against the Rust edge (test_proxy.py and the
# tests marked with the `edge` fixture cover the --edge granian transport).

TENANTS = """
[tenants.big]
keys = ["k-big"]

[tenants.small]
keys = ["k-small"]

[tenants.urgent]
keys = ["k-urgent"]
priority_limit = -5
"""

#: Tokens per request and the engine's delay per token: each request holds the node ~40 ms.
TOKENS, TOKEN_DELAY_MS = 4, 10


@asynccontextmanager
async def full_node(tmp_path: Path, http: aiohttp.ClientSession) -> AsyncIterator[tuple[Process, MockEngine]]:
    """A proxy with tenants before one engine that takes one request at a time."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    args = ("--tenants-file", str(tenants), "--admin-keys", "admin", "--queue-size", "512")
    async with (
        MockEngine(MockSettings(port=0, model="m", token_delay_ms=TOKEN_DELAY_MS)) as engine,
        pdproxy_serve(tmp_path, *args) as proxy,
    ):
        body = {"url": engine.url, "status": {"models": ["m"], "role": 1}, "max_concurrency": 1}
        async with http.post(proxy.url + "/nodes/add", json=body, headers={"authorization": "Bearer admin"}) as r:
            assert r.status in (200, 201), await r.text()
        yield proxy, engine


async def queue_depth(http: aiohttp.ClientSession, url: str, at_least: int) -> bool:
    """Whether at least ``at_least`` requests wait for a node with room (``/metrics``)."""
    async with http.get(url + "/metrics", headers={"authorization": "Bearer admin"}) as r:
        text = await r.text()
    depth = next(float(line.split()[1]) for line in text.splitlines() if line.startswith("pdproxy_queue_depth "))
    return depth >= at_least


async def one(
    http: aiohttp.ClientSession, proxy: str, who: str, priority: int | None = None, request_id: str | None = None
) -> float:
    """Sends one request; its latency."""
    headers = {"authorization": f"Bearer {who}", "x-request-id": request_id or uuid.uuid4().hex}
    extra = {} if priority is None else {"priority": priority}
    started = time.monotonic()
    async with http.post(
        proxy + "/v1/chat/completions", json=chat_body("m", max_tokens=TOKENS, **extra), headers=headers
    ) as r:
        assert r.status == 200, await r.text()
        await r.read()
    return time.monotonic() - started


async def clients(
    http: aiohttp.ClientSession, proxy: str, who: str, count: int, until: float, priority: int | None = None
) -> list[float]:
    """`count` clients of `who`, each sending its next request as soon as the last one ended;
    the end times of the requests that ended before `until`."""
    ended: list[float] = []

    async def client() -> None:
        while time.monotonic() < until:
            await one(http, proxy, who, priority)
            ended.append(time.monotonic())

    await asyncio.gather(*(client() for _ in range(count)))
    return [t for t in ended if t <= until]


async def test_tenants_share_a_full_node_evenly_whatever_they_send(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with full_node(tmp_path, http) as (proxy, _):
        start = time.monotonic()
        until = start + 6.0
        big, small = await asyncio.gather(
            # Each tenant keeps more requests queued than the node serves in a client's round trip,
            # so a slow client machine cannot leave a tenant without a request waiting.
            clients(http, proxy.url, "k-big", 40, until),
            clients(http, proxy.url, "k-small", 4, until),
        )
        # The first second settles the queue; count what the node served after it.
        big_served = sum(1 for t in big if t > start + 1)
        small_served = sum(1 for t in small if t > start + 1)
        share = small_served / (big_served + small_served)
        assert big_served + small_served >= 40, "the node was kept busy"
        assert 0.4 <= share <= 0.6, f"10:1 offered, served big {big_served} and small {small_served}"


async def test_an_urgent_request_overtakes_those_queued_before_it(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with full_node(tmp_path, http) as (proxy, _):
        until = time.monotonic() + 3.0
        sent: list[tuple[float, float]] = []  # (sent, latency) of the low-priority requests

        async def low() -> None:
            while time.monotonic() < until:
                at = time.monotonic()
                sent.append((at, await one(http, proxy.url, "k-big")))

        background = asyncio.gather(*(low() for _ in range(10)))
        # Ten clients on a one-at-a-time node: nine waiting.
        await eventually(lambda: queue_depth(http, proxy.url, at_least=9), "nine requests queued")
        urgent_sent = time.monotonic()
        urgent = await one(http, proxy.url, "k-urgent", priority=-1)
        await background
        # Low-priority requests that were waiting when the urgent one came: sent before it,
        # ended after it.
        overtaken = [latency for at, latency in sent if at < urgent_sent and at + latency > urgent_sent + urgent]
        assert len(overtaken) >= 5, "the queue was full of earlier requests"
        assert urgent < min(overtaken), f"urgent waited {urgent:.3f}s, the earlier ones at least {min(overtaken):.3f}s"


async def test_the_least_urgent_class_still_progresses(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with full_node(tmp_path, http) as (proxy, _):
        start = time.monotonic()
        until = start + 4.0
        urgent, low = await asyncio.gather(
            clients(http, proxy.url, "k-urgent", 10, until, priority=-1), clients(http, proxy.url, "k-small", 2, until)
        )
        served = len(urgent) + len(low)
        # One slot in eight goes to the longest waiter of a less urgent class.
        assert len(low) >= served / 16, f"the low class got {len(low)} of {served} slots"
        assert len(urgent) > len(low), "the urgent class comes first otherwise"
