"""Tenants: the tenants file, its reloads, and the sharing of each tenant's use between replicas.

The file (TOML) names each tenant, its API keys and its limits::

    [tenants.search]
    keys = ["sk-search-1", "sk-search-2"]
    rpm = 600               # requests per minute
    tpm = 200000            # tokens per minute (prompt + completion)
    concurrency = 32        # requests at once
    daily_tokens = 5000000  # budget per UTC day
    priority = 0            # its requests' priority when they ask for none (smaller first)
    priority_limit = -5     # the most urgent priority they may ask for (default: priority)

Every limit is optional. The data plane enforces them (``rust/src/tenants.rs``); this module
loads the file at start, reloads it when it changes (polled each second) and on SIGHUP, keeping
the old tenants when a new version is invalid. With ``--registry redis://``, each replica adds
its use to Redis once per ``tenant_sync_interval`` and debits the other replicas' use from its
own windows: a limit then holds across replicas, exceeded by at most what the others admit
within one interval. Requests at once (``concurrency``) are counted per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from pdproxy.config.settings import read_toml
from pdproxy.errors import ConfigError

if TYPE_CHECKING:
    from pdproxy.router import Router

log = logging.getLogger("pdproxy.tenants")


class TenantLimits(TypedDict):
    """A tenant's limits (None: no such limit) and priorities, as the file gives them."""

    rpm: int | None
    tpm: int | None
    concurrency: int | None
    daily_tokens: int | None
    priority: int
    priority_limit: int


class TenantEntry(TenantLimits):
    """One tenant of the file, as the data plane takes it (``set_tenants``, ``rust/src/py/tenants.rs``)."""

    name: str
    keys: list[str]


#: What a tenant's table may hold.
_FIELDS = frozenset(TenantEntry.__annotations__) - {"name"}


def load(path: str | Path) -> list[TenantEntry]:
    """The tenants of the file at ``path``, checked; raises ``ConfigError`` naming the problem."""
    data = read_toml(path, "tenants file")
    extra = set(data) - {"tenants"}
    if extra:
        raise ConfigError(f"the tenants file {path} has unknown section(s): {', '.join(sorted(extra))}")
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise ConfigError(f"the tenants file {path}: [tenants.NAME] tables are expected")
    entries: list[TenantEntry] = []
    seen: dict[str, str] = {}
    for name, table in tenants.items():
        where = f"tenant {name!r} in {path}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table")
        unknown = set(table) - _FIELDS
        if unknown:
            raise ConfigError(f"{where} has unknown field(s): {', '.join(sorted(unknown))}")
        keys = table.get("keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k.strip() for k in keys):
            raise ConfigError(f'{where} needs keys = ["..."] (non-empty strings)')
        for key in keys:
            if key in seen:
                raise ConfigError(f"{where} repeats a key of tenant {seen[key]!r}")
            seen[key] = name
        priority = _priority(table, "priority", 0, where)
        entries.append(
            TenantEntry(
                name=name,
                keys=keys,
                rpm=_limit(table, "rpm", where),
                tpm=_limit(table, "tpm", where),
                concurrency=_limit(table, "concurrency", where),
                daily_tokens=_limit(table, "daily_tokens", where),
                priority=priority,
                priority_limit=_priority(table, "priority_limit", priority, where),
            )
        )
    return entries


def _limit(table: dict[str, object], name: str, where: str) -> int | None:
    value = table.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value


def _priority(table: dict[str, object], name: str, default: int, where: str) -> int:
    value = table.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not -(2**31) <= value < 2**31:
        raise ConfigError(f"{where}: {name} must be an integer, got {value!r}")
    return value


class TenantsFile:
    """The tenants file as the data plane knows it: loaded now, reloaded on change or ``reload()``."""

    def __init__(self, router: Router, path: str, poll_interval: float = 1.0) -> None:
        self.router = router
        self.path = path
        self.poll_interval = poll_interval
        self._stamp = self._file_stamp()
        router.core.set_tenants(load(path))
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="pdproxy-tenants-file")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def reload(self) -> bool:
        """Loads the file again; an invalid file is logged and the tenants stay as they were."""
        self._stamp = self._file_stamp()
        try:
            entries = load(self.path)
        except ConfigError as e:
            log.error("the tenants file was not reloaded: %s", e)
            return False
        self.router.core.set_tenants(entries)
        log.info("tenants reloaded from %s: %d tenant(s)", self.path, len(entries))
        return True

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return (stat.st_mtime_ns, stat.st_size, stat.st_ino)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            if self._file_stamp() != self._stamp:
                self.reload()


class UsageSync:
    """Shares each tenant's use with the other replicas through Redis.

    Every replica keeps, per tenant, a hash of each replica's running totals (requests, tokens);
    each round it adds its own use since the last round and debits from its windows what the
    others' totals grew by since it last looked.
    """

    def __init__(self, router: Router, url: str, interval: float, namespace: str, timeout: float) -> None:
        import redis.asyncio

        self.router = router
        self.interval = interval
        self.replica = os.urandom(8).hex()
        self._prefix = f"{namespace}:tenant-usage:"
        self._client = redis.asyncio.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._totals: dict[str, tuple[int, int]] = {}
        self._seen: dict[tuple[str, str], tuple[int, int]] = {}
        self._watched: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """A first round now, before this replica serves (what others used until then is
        outside its windows), then one per interval."""
        with contextlib.suppress(Exception):
            await self.sync()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pdproxy-tenant-sync")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._client.aclose()

    async def _run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sync()
                if failing:
                    log.info("tenant usage is shared with the other replicas again")
                failing = False
            except Exception as e:
                if not failing:
                    log.warning("cannot share tenant usage through Redis (%s); limits hold per replica", e)
                failing = True

    async def sync(self) -> None:
        """One round: publish this replica's totals, absorb the others' growth."""
        ttl = max(int(self.interval * 120), 120)  # a replica gone for two minutes is forgotten
        local = self.router.core.take_tenant_usage()
        pipe = self._client.pipeline(transaction=False)
        for name, requests, tokens in local:
            total = self._totals.get(name, (0, 0))
            total = (total[0] + requests, total[1] + tokens)
            self._totals[name] = total
            key = self._prefix + name
            pipe.hset(key, self.replica, f"{total[0]} {total[1]}")
            pipe.expire(key, ttl)
            pipe.hgetall(key)
        results = await pipe.execute()
        for (name, _, _), others in zip(local, results[2::3], strict=True):
            # A replica first seen after this one's first round is new: all of its use counts.
            watching = name in self._watched
            self._watched.add(name)
            grown_requests = grown_tokens = 0
            for replica_raw, value_raw in others.items():
                replica = replica_raw.decode() if isinstance(replica_raw, bytes) else replica_raw
                if replica == self.replica:
                    continue
                value = value_raw.decode() if isinstance(value_raw, bytes) else value_raw
                requests_text, _, tokens_text = value.partition(" ")
                now = (int(requests_text), int(tokens_text))
                before = self._seen.get((name, replica))
                self._seen[(name, replica)] = now
                if before is None and not watching:
                    continue  # there at this replica's start: its past is outside these windows
                before = before or (0, 0)
                # A replica that restarted counts from zero again: all of its total is new.
                grown = (now[0] - before[0], now[1] - before[1]) if now >= before else now
                grown_requests += max(grown[0], 0)
                grown_tokens += max(grown[1], 0)
            if grown_requests or grown_tokens:
                self.router.core.absorb_tenant_usage(name, grown_requests, grown_tokens)


def usage(router: Router) -> dict[str, dict[str, dict[str, object]]]:
    """``GET /usage``: every tenant's limits, current window, budget and counts, by name."""
    return {"tenants": {t["name"]: {k: v for k, v in t.items() if k != "name"} for t in router.core.tenants()}}
