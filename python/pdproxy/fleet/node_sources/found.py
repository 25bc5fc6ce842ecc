"""Where a node source found a node, and how the source itself is faring."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pdproxy._json_types import JsonObject
from pdproxy.fleet.node_record import NodeRecord


@dataclass(frozen=True)
class FoundBy:
    """The source that found a node, and where: ``kubernetes`` and ``pod/NAMESPACE/NAME``, or
    ``dns`` and the name it resolved."""

    source: str
    where: str

    def describe(self) -> str:
        return f"{self.source} ({self.where})"

    def shown(self) -> JsonObject:
        return {"source": self.source, "where": self.where}


@dataclass
class SourceState:
    """What ``/health``, ``/nodes/status`` and the metrics say of a source. Its nodes stay while
    it cannot reach where it looks: ``up`` says whether its last attempt did."""

    source: str
    up: bool = False
    #: Why it is not up (one line), when it is not.
    error: str | None = None
    #: Since when it has been down (monotonic), when it is.
    down_since: float | None = field(default_factory=time.monotonic)
    #: When it last knew the whole truth (a list or a resolution; monotonic).
    synced_at: float | None = None
    #: How often it started over from a full read, by reason.
    restarts: dict[str, int] = field(default_factory=dict)
    #: Events it applied, by type.
    events: dict[str, int] = field(default_factory=dict)
    #: What it found but cannot use, and why (a pod without the port asked for).
    skipped: dict[str, str] = field(default_factory=dict)

    def reached(self) -> None:
        self.up, self.error, self.down_since = True, None, None

    def failed(self, error: str) -> bool:
        """Records a failure; returns whether it is news (a new outage, or a new cause: to log once)."""
        new = error != self.error
        self.up, self.error = False, error
        if self.down_since is None:
            self.down_since = time.monotonic()
        return new

    def synced(self) -> None:
        self.synced_at = time.monotonic()

    def restarted(self, reason: str) -> None:
        self.restarts[reason] = self.restarts.get(reason, 0) + 1

    def counted(self, event: str) -> None:
        self.events[event] = self.events.get(event, 0) + 1

    def shown(self, nodes: int) -> JsonObject:
        now = time.monotonic()
        return {
            "up": self.up,
            "error": self.error,
            "down_for": None if self.down_since is None else round(now - self.down_since, 3),
            "synced_ago": None if self.synced_at is None else round(now - self.synced_at, 3),
            "nodes": nodes,
            "skipped": dict(self.skipped),
        }


#: Adds or updates a found node in the fleet (``Fleet.put_found``): whether it did.
Put = Callable[[NodeRecord, FoundBy], Awaitable[bool]]
#: Removes a found node (``Fleet.drop_found``): its URL and the source's name.
Drop = Callable[[str, str], bool]
#: Whether the fleet still has a node as the source's (``Fleet.owns_found``): URL, source.
Owns = Callable[[str, str], bool]


class FoundNodes:
    """A source's nodes, by what it found them as (a pod, a name's address), as last put in the
    fleet. Two of them may share a URL (an IP handed to a new pod at once): the node goes when
    the last of them does. Level-triggered: setting a key again puts back a node the fleet lost."""

    def __init__(self, source: str, put: Put, drop: Drop, owns: Owns) -> None:
        self.source = source
        self._put = put
        self._drop = drop
        self._owns = owns
        self.applied: dict[str, NodeRecord] = {}

    def __len__(self) -> int:
        return len({record.url for record in self.applied.values()})

    async def set(self, key: str, record: NodeRecord | None, where: str) -> None:
        """Makes ``key``'s node ``record`` (None: it has none now)."""
        before = self.applied.pop(key, None)
        # Unchanged, unless its node left the fleet meanwhile (health checks, a hand removal):
        # what the source sees is put back.
        if before == record and (record is None or self._owns(record.url, self.source)):
            if before is not None:
                self.applied[key] = before
            return
        put = record is not None and await self._put(record, FoundBy(self.source, where))
        if put and record is not None:
            self.applied[key] = record
        # The old node goes, unless its URL is still one of this source's (this key's again, or another's).
        if before is not None and not self._has(before.url):
            self._drop(before.url, self.source)

    def found_keys(self) -> list[str]:
        return list(self.applied)

    def _has(self, url: str) -> bool:
        return any(record.url == url for record in self.applied.values())
