"""Node membership of one machine's worker group: a JSON document in the group's directory.

Writers (any worker handling a management call) change it under an exclusive ``flock`` and
then bump the epoch in the group's shared table; every worker polls the epoch (an atomic read)
each ``poll`` seconds and re-reads the document when it moved, so a change reaches every
worker within ``poll`` (0.1 s). The document is replaced by rename, so readers need no lock
and never see half of it. Leases are wall-clock deadlines in the document: the group's leader
drops expired ones (``expire``), and readers already leave them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from pdproxy import _background, _pdproxy
from pdproxy.fleet import state_file
from pdproxy.fleet.membership import Entry, Membership, OnChange

__all__ = ["GroupFileMembership"]

log = logging.getLogger("pdproxy.membership")

#: Seconds between two looks at the epoch.
POLL_INTERVAL = 0.1


class GroupFileMembership(Membership):
    def __init__(self, directory: Path, table: _pdproxy.SharedTable, poll: float = POLL_INTERVAL) -> None:
        self._path = directory / "members.json"
        self._lock_path = directory / "members.lock"
        self._table = table
        self._poll = poll
        self._task: asyncio.Task[None] | None = None

    async def start(self, on_change: OnChange) -> None:
        seen = self._table.epoch
        await on_change(await self.snapshot())
        self._task = _background.start(self._watch(on_change, seen), "pdproxy-membership")

    async def aclose(self) -> None:
        await _background.stop(self._task)

    async def put(self, entry: Entry) -> None:
        url, ttl = str(entry["url"]), entry.get("lease_ttl")
        deadline = time.time() + ttl if isinstance(ttl, int | float) else None
        stored: Entry = {**entry, "lease_deadline": deadline}
        with self._locked():
            entries = self._read()
            if entries.get(url) == stored:
                return  # the same registration again (each worker adds the configured nodes)
            entries[url] = stored
            self._write(entries)

    async def delete(self, url: str) -> None:
        with self._locked():
            entries = self._read()
            if entries.pop(url, None) is not None:
                self._write(entries)

    async def snapshot(self) -> list[Entry]:
        now = time.time()
        out = []
        for stored in self._read().values():
            entry = dict(stored)
            deadline = _deadline(entry)
            entry.pop("lease_deadline", None)
            if deadline is not None and deadline <= now:
                continue
            entry["lease_remaining"] = None if deadline is None else deadline - now
            out.append(entry)
        return out

    def expire(self) -> list[str]:
        """Drops entries whose lease ran out (the leader's job); returns their URLs."""
        now = time.time()
        with self._locked():
            entries = self._read()
            gone = [url for url, e in entries.items() if (deadline := _deadline(e)) is not None and deadline <= now]
            for url in gone:
                del entries[url]
            if gone:
                self._write(entries)
        for url in gone:
            log.warning("node %s: lease expired", url)
        return gone

    async def _watch(self, on_change: OnChange, seen: int) -> None:
        while True:
            await asyncio.sleep(self._poll)
            epoch = self._table.epoch
            if epoch == seen:
                continue
            seen = epoch
            try:
                await on_change(await self.snapshot())
            except Exception:
                log.exception("applying a membership change failed; the next change retries")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # Held for one small read and write on a memory-backed file system.
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Entry]:
        return {str(e["url"]): e for e in state_file.load(str(self._path))}

    def _write(self, entries: dict[str, Entry]) -> None:
        state_file.save(str(self._path), list(entries.values()))
        self._table.bump_epoch()


def _deadline(entry: Entry) -> float | None:
    """When a stored entry's lease runs out (``time.time()`` seconds), if it has a lease."""
    deadline = entry.get("lease_deadline")
    return deadline if isinstance(deadline, int | float) else None
