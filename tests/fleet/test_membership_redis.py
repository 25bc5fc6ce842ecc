"""The Redis membership store against a real redis-server: replicas see each other's puts and
deletes, leases expire everywhere and renew, an outage keeps the last known nodes and refuses
writes, and a Redis that restarted empty is written back by the replicas."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

from pdproxy.config.settings import RegistrySettings
from pdproxy.errors import ConfigError, InvalidRequest, RegistryUnavailable
from pdproxy.fleet.membership import Entry, from_url
from pdproxy.fleet.membership.redis_store import RedisMembership
from redis_server import REDIS_SERVER, RedisServer, redis_server
from servers import eventually

N1 = "http://10.0.0.1:8000"  # never contacted: only stored
N2 = "http://10.0.0.2:8000"
WAIT = 5.0  # upper bound for anything that should take milliseconds to a couple of reconciles


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.fail("the registry tests need Debian's redis-server (apt-get install redis-server)")
    with redis_server(tmp_path) as s:
        yield s


class Recorder:
    """An on_change callback that keeps every snapshot it was given."""

    def __init__(self) -> None:
        self.calls: list[list[Entry]] = []

    async def __call__(self, entries: list[Entry]) -> None:
        self.calls.append(entries)

    def urls(self) -> set[str] | None:
        return {e["url"] for e in self.calls[-1]} if self.calls else None


@contextlib.asynccontextmanager
async def replica(url: str, **options: Any) -> AsyncIterator[tuple[RedisMembership, Recorder]]:
    options = {"reconcile_interval": 0.2, "timeout": 1.0, "max_backoff": 0.3, **options}
    store = RedisMembership(RegistrySettings(registry=url, **{f"registry_{k}": v for k, v in options.items()}))
    recorder = Recorder()
    try:
        await store.start(recorder)
        yield store, recorder
    finally:
        await store.aclose()


@contextlib.asynccontextmanager
async def raw_client(url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.from_url(url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


async def test_put_and_delete_reach_the_other_replica_through_pubsub(server: RedisServer) -> None:
    # A reconcile period far longer than the waits: only the change notices can make this pass.
    async with (
        replica(server.url, reconcile_interval=60) as (a, seen_a),
        replica(server.url, reconcile_interval=60) as (b, seen_b),
    ):
        assert seen_a.calls == [[]]  # once at start, before start returned
        assert seen_b.calls == [[]]

        await a.put({"url": N1, "model": "m", "lease_ttl": None})
        await eventually(lambda: seen_b.urls() == {N1}, "b to see the put")
        assert seen_b.calls[-1] == [{"url": N1, "model": "m", "lease_ttl": None, "lease_remaining": None}]
        assert await b.snapshot() == seen_b.calls[-1]

        await a.put({"url": N1, "model": "m2"})  # replace by url
        await eventually(lambda: seen_b.calls[-1][0].get("model") == "m2", "b to see the replacement")

        await b.delete(N1)
        await eventually(lambda: seen_a.urls() == set(), "a to see the delete")
        await b.delete(N1)  # idempotent
        assert await a.snapshot() == []


async def test_lease_expires_on_every_replica_and_in_redis(server: RedisServer) -> None:
    async with replica(server.url) as (a, seen_a), replica(server.url) as (_, seen_b), raw_client(server.url) as r:
        await a.put({"url": N1, "lease_ttl": 0.5})
        await a.put({"url": N2})  # no lease: stays
        await eventually(lambda: any(N1 in {e["url"] for e in call} for call in seen_b.calls), "b to see the lease")
        assert await r.exists(f"pdproxy:lease:{N1}") == 1
        assert await r.exists(f"pdproxy:lease:{N2}") == 0

        await eventually(lambda: seen_a.urls() == seen_b.urls() == {N2}, "the lease to expire on both")
        assert await r.hkeys("pdproxy:nodes") == [N2]
        assert [e["url"] for e in await a.snapshot()] == [N2]


async def test_put_renews_a_lease(server: RedisServer) -> None:
    async with replica(server.url) as (a, _), replica(server.url) as (b, seen_b):
        entry = {"url": N1, "lease_ttl": 2.0}
        await a.put(entry)
        await eventually(lambda: seen_b.urls() == {N1}, "b to see the lease")
        calls = len(seen_b.calls)

        async def remaining() -> float:
            (snapshot,) = await b.snapshot()
            return float(snapshot["lease_remaining"])

        first = await remaining()
        assert 0 < first <= 2.0
        # Bounded wait for the lease to run down a little, then renew it; 1.5 s of slack before expiry.
        deadline = asyncio.get_running_loop().time() + WAIT
        while (left := await remaining()) > first - 0.3:
            assert asyncio.get_running_loop().time() < deadline, "the lease does not count down"
            await asyncio.sleep(0.05)
        await a.put(entry)
        assert await remaining() > left

        # Same entry, new lease: not a change, so on_change is not called again.
        await asyncio.sleep(0.6)  # a fixed wait for a negative assertion: no call within three reconcile periods
        assert len(seen_b.calls) == calls
        assert all(N1 in {e["url"] for e in call} for call in seen_b.calls[calls - 1 :])


async def test_outage_keeps_the_last_known_nodes_and_refuses_writes(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdproxy.membership")
    async with replica(server.url) as (a, seen_a), replica(server.url) as (_, seen_b):
        await a.put({"url": N1})
        await a.put({"url": N2, "lease_ttl": 30})
        await eventually(lambda: seen_a.urls() == seen_b.urls() == {N1, N2}, "both replicas to see both nodes")
        before = (len(seen_a.calls), len(seen_b.calls))

        server.stop()

        def unreachable() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.name == "pdproxy.membership" and "unreachable" in r.message]

        await eventually(lambda: len(unreachable()) >= 2, "both replicas to notice the outage")
        with pytest.raises(RegistryUnavailable) as raised:
            await a.put({"url": "http://10.0.0.3:8000"})
        assert (raised.value.status, raised.value.code) == (503, "registry_unavailable")
        with pytest.raises(RegistryUnavailable):
            await a.delete(N1)

        snapshot = await a.snapshot()
        assert [e["url"] for e in snapshot] == [N1, N2]
        assert 0 < snapshot[1]["lease_remaining"] <= 30

        # A fixed wait for a negative assertion: no more warnings and no call over several
        # reconnect attempts (backoff capped at 0.3 s).
        await asyncio.sleep(1.0)
        assert len(unreachable()) == 2, "one warning per replica per outage"
        assert (len(seen_a.calls), len(seen_b.calls)) == before, "on_change called because of an error"

    # A store that never read Redis has nothing to fall back on.
    never = RedisMembership(RegistrySettings(registry=server.url, registry_timeout=1.0))
    try:
        with pytest.raises(RegistryUnavailable):
            await never.snapshot()
    finally:
        await never.aclose()


async def test_a_redis_that_restarted_empty_is_written_back(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdproxy.membership")
    async with replica(server.url) as (a, seen_a), replica(server.url) as (_, seen_b):
        await a.put({"url": N1, "model": "m"})
        await a.put({"url": N2, "lease_ttl": 30})
        await eventually(lambda: seen_a.urls() == seen_b.urls() == {N1, N2}, "both replicas to see both nodes")

        server.restart_empty()
        # Written before either replica can run again (no await since the restart): a newer entry
        # than theirs, which their write-back must leave alone.
        with redis.Redis.from_url(server.url) as sync:
            sync.hset("pdproxy:nodes", N1, json.dumps({"url": N1, "model": "newer"}))

        async with replica(server.url) as (c, seen_c), raw_client(server.url) as r:
            await eventually(lambda: seen_c.urls() == {N1, N2}, "a fresh replica to see the written-back nodes")
            assert 0 < await r.pttl(f"pdproxy:lease:{N2}") <= 30_000
            assert await r.exists(f"pdproxy:lease:{N1}") == 0
            assert {e["url"]: e.get("model") for e in await c.snapshot()} == {N1: "newer", N2: None}

            # Writes work again at once, from an old replica as from the new one.
            await a.delete(N1)
            await eventually(lambda: seen_c.urls() == {N2}, "c to see a's delete after the restart")

        assert any("lost its data" in r.message for r in caplog.records if r.name == "pdproxy.membership")
        assert all(call for call in seen_a.calls[1:] + seen_b.calls[1:]), "a replica delivered an empty snapshot"


async def test_put_rejects_unusable_entries(server: RedisServer) -> None:
    async with replica(server.url) as (a, _):
        for bad in ({"model": "m"}, {"url": N1, "lease_ttl": 0}, {"url": N1, "lease_ttl": "5"}, {"url": N1, "x": {1}}):
            with pytest.raises(InvalidRequest):
                await a.put(bad)
        assert await a.snapshot() == []


@pytest.mark.parametrize(
    "url", ["http://x", "redis://host:notaport", "redis://", "redis://host:6379/zero", "etcd://host:2379"]
)
def test_from_url_rejects(url: str) -> None:
    with pytest.raises(ConfigError):
        from_url(RegistrySettings(registry=url))


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://user:secret@127.0.0.1:6380", "redis://h"])
async def test_from_url_accepts_redis(url: str) -> None:
    store = from_url(RegistrySettings(registry=url, registry_namespace="t"))
    try:
        assert isinstance(store, RedisMembership)
        assert "secret" not in store.url
    finally:
        await store.aclose()
