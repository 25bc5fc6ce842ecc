"""Node membership in Redis, shared by several pdproxy replicas.

Keys, under a namespace (default ``pdproxy``)::

    {ns}:nodes          hash     url -> the entry as JSON (keys sorted)
    {ns}:lease:{url}    string   "1" with PX = lease_ttl, only for an entry that has a lease;
                                 a leased entry whose lease key is gone has expired
    {ns}:changes        channel  every put, delete and expiry publishes the url
    {ns}:instance       string   a random id, SET NX by the first replica that finds it missing
                                 (Redis restarted empty, or was flushed): a new id means lost data

What a replica sees:

- A put or delete is one MULTI/EXEC (entry, lease key and notice together), and each entry is
  read together with its lease's PTTL, so no replica sees an entry without its lease.
- ``snapshot()`` reads Redis, so a replica sees its own writes at once.
- Another replica's change reaches ``on_change`` as soon as its notice arrives (milliseconds; a
  burst costs one re-read per 50 ms), and within about ``reconcile_interval`` even if the notice
  is lost: pub/sub drops messages, so every replica also re-reads everything on that period.
- An expired lease leaves every replica within about ``reconcile_interval``; whichever replica
  notices first removes it from the hash, unless a renewal got there first (checked in Lua).
- ``on_change`` gets the full snapshot once at start and then only when it differs from the one
  last delivered (``lease_remaining`` aside). If it raises, the same snapshot is offered again at
  the next reconcile.

Outage: a replica keeps its last known snapshot and never calls ``on_change`` because of an
error; leases stop counting down for it (their holders cannot renew either). ``put`` and
``delete`` raise ``RegistryUnavailable`` (503) instead of hanging: every socket operation has
``timeout`` seconds and redis-py does not retry. One warning is logged per outage, and
reconnecting is retried with a backoff capped at ``max_backoff``. If Redis is down when ``start``
runs, ``start`` returns anyway and the first snapshot comes when Redis is reachable.

Lost data: a replica that finds another instance id writes back its last known entries, each
with the lease it had left, without overwriting an entry written since (by a replica or a node),
then goes on as before. Until some replica does, a replica that starts fresh sees none; and a
node deleted through one replica while another was cut off can come back this way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio
from redis.asyncio.client import Pipeline, PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from pdproxy.config.settings import RegistrySettings
from pdproxy.errors import InvalidRequest, RegistryUnavailable
from pdproxy.fleet.membership import Entry, Membership, OnChange

__all__ = ["RedisMembership"]

log = logging.getLogger("pdproxy.membership")

# Errors that mean "Redis cannot be used now" (socket errors and timeouts are OSErrors).
_UNAVAILABLE = (RedisError, OSError)
_MIN_BACKOFF = 0.1
_BURST = 1000  # notices read at once before one reconcile; a burst needs one re-read, not one each
_MIN_GAP = 0.05  # seconds between two reconciles, so that a stream of heartbeats costs a few re-reads a second
_MAX_LEASE = 365 * 86400.0

# Removes an entry whose lease key is gone, unless it changed since it was read (a renewal wins).
_EXPIRE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[3], ARGV[1])
return 1
"""

# Writes an entry back after Redis lost its data, unless another replica already has.
_SEED = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if ARGV[3] ~= '' then redis.call('SET', KEYS[2], '1', 'PX', ARGV[3]) end
redis.call('PUBLISH', ARGV[4], ARGV[1])
return 1
"""


@dataclass(frozen=True)
class _Row:
    raw: str  # the JSON as stored: what changes are detected on
    entry: Entry
    pttl: int  # of the lease key, as Redis answers: -2 missing, -1 without expiry, else milliseconds

    @property
    def expired(self) -> bool:
        return _lease_ttl(self.entry) is not None and self.pttl == -2

    def public(self) -> Entry:
        leased = _lease_ttl(self.entry) is not None and self.pttl >= 0
        return {**self.entry, "lease_remaining": self.pttl / 1000 if leased else None}


def _lease_ttl(entry: Entry) -> float | None:
    ttl = entry.get("lease_ttl")
    return float(ttl) if isinstance(ttl, int | float) and not isinstance(ttl, bool) else None


def _redacted(url: str) -> str:
    """The URL without its password, for logs and error details."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisMembership(Membership):
    def __init__(self, settings: RegistrySettings) -> None:
        """Membership in the Redis at ``settings.registry`` (the group's checks hold: a
        namespace, positive seconds)."""
        url, namespace, timeout = settings.registry, settings.namespace, settings.timeout
        reconcile_interval, max_backoff = settings.reconcile_interval, settings.max_backoff
        self.url = _redacted(url)
        self._nodes = f"{namespace}:nodes"
        self._lease_prefix = f"{namespace}:lease:"
        self._channel = f"{namespace}:changes"
        self._instance_key = f"{namespace}:instance"
        self._interval = reconcile_interval
        self._max_backoff = max_backoff
        # No retries inside redis-py: a failed write must answer 503 at once, and the watcher
        # has its own backoff. Connections a restarted Redis closed are replaced at checkout.
        self._client = redis.asyncio.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self._expire = self._client.register_script(_EXPIRE)
        self._seed = self._client.register_script(_SEED)
        self._on_change: OnChange | None = None
        self._task: asyncio.Task[None] | None = None
        self._instance: str | None = None  # the id of the Redis this replica last read
        self._known: dict[str, _Row] | None = None  # the last successful read, for outages and re-seeding
        self._delivered: dict[str, str] | None = None  # url -> raw JSON of the snapshot on_change last got
        self._outage = False

    # -- the Membership interface

    async def start(self, on_change: OnChange) -> None:
        if self._task is not None:
            raise RuntimeError("RedisMembership.start() was already called")
        self._on_change = on_change
        # The first connection is tried here, so that when Redis is up on_change has run once
        # by the time start returns; when it is down the watcher goes on trying.
        try:
            pubsub: PubSub | None = await self._connect()
        except _UNAVAILABLE as e:
            self._lost(e)
            pubsub = None
        self._task = asyncio.create_task(self._watch(pubsub), name="pdproxy-membership")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        # redis-py can swallow a cancellation on Python 3.11 (asyncio.wait_for returns the result
        # of a write that finished as the cancel came), so cancel until the watcher has ended.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=0.1)
        await self._client.aclose()

    async def put(self, entry: Entry) -> None:
        url = entry.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidRequest("a node registration needs a url")
        ttl = entry.get("lease_ttl")
        lease = _lease_ttl(entry)
        if ttl is not None and (lease is None or not 0 < lease <= _MAX_LEASE):
            raise InvalidRequest(f"lease_ttl must be a number of seconds above 0 and up to a year, not {ttl!r}")
        stored = {k: v for k, v in entry.items() if k != "lease_remaining"}  # computed, never stored
        try:
            raw = json.dumps(stored, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"node registration for {url} is not JSON: {e}") from None

        def write(pipe: Pipeline) -> None:
            pipe.hset(self._nodes, url, raw)
            if lease is None:
                pipe.delete(self._lease_key(url))
            else:
                pipe.set(self._lease_key(url), "1", px=max(1, round(lease * 1000)))
            pipe.publish(self._channel, url)

        await self._write(f"register {url}", write)

    async def delete(self, url: str) -> None:
        def write(pipe: Pipeline) -> None:
            pipe.hdel(self._nodes, url)
            pipe.delete(self._lease_key(url))
            pipe.publish(self._channel, url)

        await self._write(f"remove {url}", write)

    async def snapshot(self) -> list[Entry]:
        """Read from Redis (so a replica sees its own writes at once); during an outage, the
        last known snapshot, with leases as they were when Redis was last reached."""
        if not self._outage:
            try:
                _, rows = await self._read(claim=False)
            except _UNAVAILABLE as e:
                log.debug("registry read failed, answering the last known snapshot: %r", e)
            else:
                return _public(rows)
        if self._known is None:
            raise RegistryUnavailable("the node registry is unavailable and no snapshot of it is known yet")
        return _public(self._known)

    # -- internals

    def _lease_key(self, url: str) -> str:
        return self._lease_prefix + url

    async def _write(self, what: str, fill: Callable[[Pipeline], None]) -> None:
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                fill(pipe)
                await pipe.execute()
        except _UNAVAILABLE as e:
            raise RegistryUnavailable(
                f"the node registry is unavailable; cannot {what} now", detail=f"{self.url}: {e!r}"
            ) from e

    async def _read(self, claim: bool) -> tuple[str | None, dict[str, _Row]]:
        """The instance id and every entry with its lease's PTTL, each pair read atomically.
        ``claim`` sets the instance id if Redis has none (it started empty)."""
        async with self._client.pipeline(transaction=True) as pipe:
            if claim:
                pipe.set(self._instance_key, uuid.uuid4().hex, nx=True)
            pipe.get(self._instance_key)
            pipe.hkeys(self._nodes)
            *_, instance, urls = await pipe.execute()
        if not urls:
            return instance, {}
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hmget(self._nodes, urls)
            for url in urls:
                pipe.pttl(self._lease_key(url))
            values, *pttls = await pipe.execute()
        rows = {}
        for url, raw, pttl in zip(urls, values, pttls, strict=True):
            if raw is None:  # deleted between the two reads
                continue
            try:
                entry = json.loads(raw)
            except ValueError:
                entry = None
            if not isinstance(entry, dict) or entry.get("url") != url:
                log.debug("registry entry %r is not a node registration; ignored", url)
                continue
            rows[url] = _Row(raw, entry, pttl)
        return instance, rows

    async def _connect(self) -> PubSub:
        """Subscribe first (so no change made after the read below goes unnoticed), then reconcile."""
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channel)
            await self._reconcile()
        except BaseException:
            await pubsub.aclose()
            raise
        if self._outage:
            self._outage = False
            log.warning("node registry %s is reachable again", self.url)
        return pubsub

    async def _watch(self, pubsub: PubSub | None) -> None:
        backoff = _MIN_BACKOFF
        while True:
            try:
                if pubsub is None:
                    pubsub = await self._connect()
                    backoff = _MIN_BACKOFF
                loop = asyncio.get_running_loop()
                while True:
                    last = loop.time()
                    if await pubsub.get_message(ignore_subscribe_messages=True, timeout=self._interval):
                        await asyncio.sleep(last + _MIN_GAP - loop.time())  # no wait after a quiet spell
                        for _ in range(_BURST):
                            if not await pubsub.get_message(ignore_subscribe_messages=True, timeout=0):
                                break
                    await self._reconcile()
            except _UNAVAILABLE as e:
                self._lost(e)
            except Exception:  # a bug must not stop the watching for good
                log.exception("node registry watcher failed; retrying")
            finally:
                if pubsub is not None:
                    await pubsub.aclose()
                    pubsub = None
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff)

    def _lost(self, error: BaseException) -> None:
        if not self._outage:
            self._outage = True
            known = "no" if self._known is None else len(self._known)
            log.warning("node registry %s is unreachable (%r); keeping the %s nodes last seen", self.url, error, known)

    async def _reconcile(self) -> None:
        instance, rows = await self._read(claim=True)
        if instance != self._instance:
            if self._instance is not None and self._known:
                log.warning(
                    "node registry %s lost its data (new instance id); writing back the %d nodes last seen",
                    self.url,
                    len(self._known),
                )
                await self._reseed(self._known)
                instance, rows = await self._read(claim=True)
            self._instance = instance
        for url, row in rows.items():
            if row.expired:
                await self._expire(keys=[self._nodes, self._lease_key(url)], args=[url, row.raw, self._channel])
        live = {url: row for url, row in rows.items() if not row.expired}
        self._known = live
        current = {url: row.raw for url, row in live.items()}
        if current == self._delivered or self._on_change is None:
            return
        try:
            await self._on_change(_public(live))
        except Exception:
            log.exception("node registry on_change callback failed; it gets the snapshot again next time")
        else:
            self._delivered = current

    async def _reseed(self, rows: dict[str, _Row]) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            for url, row in rows.items():
                ttl = _lease_ttl(row.entry)
                # The lease left when Redis was last reached; one without expiry restarts whole.
                px = "" if ttl is None else str(max(1, row.pttl if row.pttl >= 0 else round(ttl * 1000)))
                await self._seed(
                    keys=[self._nodes, self._lease_key(url)], args=[url, row.raw, px, self._channel], client=pipe
                )
            await pipe.execute()


def _public(rows: dict[str, _Row]) -> list[Entry]:
    return [rows[url].public() for url in sorted(rows)]
