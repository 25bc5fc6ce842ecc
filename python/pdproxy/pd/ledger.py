"""The ledger of preserved prefill sessions.

Between its prefill answer and its decode's first token, a request's KV cache lives on the
prefill node and nobody but pdproxy knows it is still needed. The ledger holds it until decode
has consumed it; on any other ending (decode refused or failed before starting, link failure,
client gone, decode node removed, shutdown) pdproxy frees it on the prefill node with
``/distserve/free_cache``, exactly once, with bounded retries. Entries also expire after a TTL,
swept in the background, so nothing outlives a bug.

In a worker group each worker also journals its entries, one small file each in the group's
directory, so that when a worker dies the leader adopts and frees what it had preserved."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import aiohttp

from pdproxy import background
from pdproxy.tls import node_session

from .relay import ApiKeyOf

log = logging.getLogger("pdproxy.pd")


@dataclass(eq=False)
class Preserved:
    id: int
    prefill: str
    session_id: int
    decode: str | None
    created: float
    state: str = "preserved"  # preserved -> consumed | freeing -> freed | lost (| preserved again)
    #: The prefill node's key when the session was preserved: still known once the node is removed.
    api_key: str | None = field(default=None, repr=False)


class LedgerStatus(TypedDict):
    """The ledger in ``/distserve/status``: sessions held now, the oldest one's age (seconds),
    and how the others ended."""

    preserved: int
    oldest_age: float | None
    consumed: int
    freed: int
    free_failures: int


class SessionLedger:
    def __init__(
        self,
        *,
        ttl: float,
        free_timeout: float,
        free_attempts: int,
        api_key_of: ApiKeyOf,
        journal: Path | None = None,
        ca_file: str = "",
    ) -> None:
        self.entries: dict[int, Preserved] = {}
        #: In a worker group: this worker's journal directory.
        self._journal = journal
        if journal is not None:
            journal.mkdir(parents=True, exist_ok=True)
        self._ids = itertools.count(1)
        self._ttl = ttl
        self._timeout = free_timeout
        self._ca_file = ca_file
        self._attempts = free_attempts
        self._api_key_of = api_key_of
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self.freed = 0
        self.consumed = 0
        self.free_failures = 0

    async def start(self) -> None:
        self._session = node_session(self._ca_file, self._timeout)
        self._task = background.start(self._sweep(), "pdproxy-pd-ledger")

    async def aclose(self) -> None:
        await background.stop(self._task)
        # Shutting down: what is still preserved is freed now, not left to leak.
        await asyncio.gather(*(self.free(e, "shutdown") for e in list(self.entries.values())))
        if self._session is not None:
            await self._session.close()
        if self._journal is not None:
            with contextlib.suppress(OSError):  # empty by now: every entry was freed or given up
                self._journal.rmdir()

    def add(self, prefill: str, session_id: int, decode: str | None) -> Preserved:
        entry = Preserved(
            next(self._ids), prefill, session_id, decode, time.monotonic(), api_key=self._api_key_of(prefill)
        )
        self.entries[entry.id] = entry
        if self._journal is not None:
            record = {"prefill": prefill, "session_id": session_id, "decode": decode}
            (self._journal / f"{entry.id}.json").write_text(json.dumps(record))
        return entry

    def _settled(self, entry: Preserved) -> None:
        self.entries.pop(entry.id, None)
        if self._journal is not None:
            (self._journal / f"{entry.id}.json").unlink(missing_ok=True)

    def consume(self, entry: Preserved) -> None:
        """Decode has taken the session over: it frees it on the prefill node itself."""
        if entry.state == "preserved":
            entry.state = "consumed"
            self.consumed += 1
            self._settled(entry)

    async def adopt(self, journal: Path) -> int:
        """Frees the sessions a dead worker journaled in ``journal``, then removes it; how many."""
        adopted = self._take_over(journal)
        await asyncio.gather(*(self.free(e, "its worker died") for e in adopted))
        return len(adopted)

    def _take_over(self, journal: Path) -> list[Preserved]:
        """Moves another journal's entries into this ledger (a few small files in memory)."""
        adopted = []
        for path in sorted(journal.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                record = json.loads(path.read_text())
                adopted.append(self.add(str(record["prefill"]), int(record["session_id"]), record.get("decode")))
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            journal.rmdir()
        return adopted

    async def free(self, entry: Preserved, reason: str, keep_if_unreachable: bool = False) -> None:
        """Frees the session on its prefill node, once, whatever the number of callers. When the
        node cannot be reached the entry is given up (``lost``), or with ``keep_if_unreachable``
        kept as it was, for the TTL sweep to try again."""
        if entry.state != "preserved":
            return
        entry.state = "freeing"
        body = {"remote_engine_id": entry.prefill, "remote_session_id": entry.session_id}
        key = self._api_key_of(entry.prefill) or entry.api_key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        for attempt in range(self._attempts):
            try:
                assert self._session is not None
                async with self._session.post(f"{entry.prefill}/distserve/free_cache", json=body, headers=headers) as r:
                    if r.status == 200:
                        entry.state = "freed"
                        self.freed += 1
                        log.info("freed prefill session %s on %s (%s)", entry.session_id, entry.prefill, reason)
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1 * 2**attempt)
        else:
            if keep_if_unreachable:
                entry.state = "preserved"
                log.warning(
                    "prefill session %s on %s not freed yet (%s): the sweep tries again after %g s",
                    entry.session_id,
                    entry.prefill,
                    reason,
                    self._ttl,
                )
                return
            entry.state = "lost"
            self.free_failures += 1
            log.error("could not free prefill session %s on %s (%s)", entry.session_id, entry.prefill, reason)
        self._settled(entry)

    async def release_prefill(self, url: str) -> None:
        """A prefill node is being removed: the sessions preserved on it are freed while it can
        still be reached (its engine would keep their KV blocks until it restarts); those it
        cannot free now stay for the TTL sweep."""
        leaving = [e for e in self.entries.values() if e.prefill == url and e.state == "preserved"]
        await asyncio.gather(*(self.free(e, "its prefill node was removed", keep_if_unreachable=True) for e in leaving))

    async def gc(self, older_than: float = 0.0) -> list[Preserved]:
        """Frees every entry older than ``older_than`` seconds; returns them, each in the state
        it ended in (``freed`` or ``lost``)."""
        now = time.monotonic()
        stale = [e for e in self.entries.values() if now - e.created >= older_than and e.state == "preserved"]
        await asyncio.gather(*(self.free(e, "gc") for e in stale))
        return stale

    def status(self) -> LedgerStatus:
        now = time.monotonic()
        return LedgerStatus(
            preserved=len(self.entries),
            oldest_age=max((now - e.created for e in self.entries.values()), default=None),
            consumed=self.consumed,
            freed=self.freed,
            free_failures=self.free_failures,
        )

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(max(self._ttl / 4, 0.05))
            await self.gc(older_than=self._ttl)
