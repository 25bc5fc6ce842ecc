"""LMDeploy's DistServe, the control plane's side.

Its requests run in the data plane's pipeline (``rust/src/edge/pd.rs``): the prefill (the
client's body with ``max_tokens=1``, ``stream=false``, ``with_cache`` and ``preserve_cache``) on a
prefill node while the pair's link is made ready, then the decode with ``migration_request``,
the session preserved in between kept in the data plane's ledger and freed unless decode
consumed it. This module starts that side (``DistServeCore``), makes the links it asks for (the
handshakes, in ``links``), sweeps the ledger (``ledger``) and shows both.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from pdproxy import _pdproxy
from pdproxy._pdproxy import LinkDone
from pdproxy.config.settings import Settings
from pdproxy.errors import LinkFailed
from pdproxy.router import Router
from pdproxy.server.group import alive

from . import ApiKeyOf, NodePdStatus
from .ledger import LedgerStatus, SessionLedger, Swept
from .links import LinkPool, LinkSummary, Transport, WarmupAnswer

log = logging.getLogger("pdproxy.pd")

PD_PATHS = frozenset(_pdproxy.PD_PATHS["lmdeploy"])


class DistServeStatus(TypedDict):
    """``/distserve/status`` with LMDeploy's flow: its links, and the ledger of preserved sessions."""

    links: list[LinkSummary]
    ledger: LedgerStatus


class DistServe:
    protocol = "lmdeploy"
    paths = PD_PATHS

    def __init__(self, router: Router, settings: Settings, api_key_of: ApiKeyOf, group_dir: Path | None = None) -> None:
        self.router = router
        self.settings = settings
        self.links = LinkPool(
            settings.pd,
            api_key_of=api_key_of,
            transport=Transport(
                settings.pd.migration_protocol, settings.pd.link_type, with_gdr=not settings.pd.disable_gdr
            ),
            group_dir=group_dir,
            ca_file=settings.security.node_ca_file,
        )
        self._group_dir = group_dir
        self._api_key_of = api_key_of
        #: Frees in progress, kept so that a cancelled request cannot cut them short.
        self._frees: set[asyncio.Task[object]] = set()
        journal = group_dir / "ledger" / str(os.getpid()) if group_dir is not None else None
        #: The flow's data-plane side: the requests' links and sessions.
        self.core = router.core.start_distserve(
            CoreSettings(
                migration_protocol=self.links.transport.protocol_number,
                dummy_prefill=settings.pd.dummy_prefill,
                free_timeout=settings.pd.free_timeout,
                free_attempts=settings.pd.free_attempts,
                journal=journal,
            ),
            self._link_for_data_plane,
        )
        self.ledger = SessionLedger(self.core, ttl=settings.pd.session_ttl, api_key_of=api_key_of, journal=journal)

    async def start(self) -> None:
        await self.links.start()
        await self.ledger.start()

    def _link_for_data_plane(self, prefill: str, decode: str, done: LinkDone) -> None:
        """A request in the data plane found its pair unconnected: connect it (sharing a
        handshake in flight) and tell it how that went."""
        task = asyncio.ensure_future(self.links.ensure(prefill, decode))
        task.add_done_callback(lambda ended: done(_link_failure(ended)))

    async def aclose(self) -> None:
        await asyncio.gather(*self._frees, return_exceptions=True)
        self.core.stop()
        await self.ledger.aclose()
        await self.links.aclose()

    async def adopt_orphans(self) -> int:
        """The group leader's round: frees the sessions preserved by workers that died."""
        if self._group_dir is None:
            return 0
        freed = 0
        for journal in (self._group_dir / "ledger").iterdir():
            if journal.name.isdigit() and int(journal.name) != os.getpid() and not alive(int(journal.name)):
                freed += await self.ledger.adopt(journal)
        return freed

    def node_removed(self, url: str) -> None:
        """Drops the node's links on both sides and, if it was a prefill node, frees the
        sessions preserved on it (those it cannot free now are left to the TTL sweep)."""
        self.core.forget_links(url)
        self._spawn(self.ledger.release_prefill(url))
        self._spawn(self.links.drop(url, self._api_key_of(url)))

    def _spawn(self, work: Coroutine[object, None, object]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._frees.add(task)
        task.add_done_callback(self._frees.discard)

    def release(self, entry: int | None, reason: str) -> None:
        """Frees ``entry`` unless decode consumed it; never interrupted by cancellation."""
        if entry is not None:
            self._spawn(self.ledger.free(entry, reason))

    async def warmup(self) -> WarmupAnswer:
        nodes = [n for n in self.router.views() if n.state == "healthy"]
        prefills = [n.url for n in nodes if n.role == "prefill"]
        decodes = [n.url for n in nodes if n.role == "decode"]
        return await self.links.warmup(prefills, decodes, self.settings.pd.warmup_concurrency)

    def status(self) -> DistServeStatus:
        return DistServeStatus(links=self.links.status(), ledger=self.ledger.status())

    def kept(self) -> DistServeStatus:
        return self.status()

    def node_status(self, url: str) -> NodePdStatus:
        links = [link for link in self.links.status() if url in (link["prefill"], link["decode"])]
        return NodePdStatus(links=links, preserved_sessions=self.ledger.held_on(url))

    async def gc(self, older_than: float) -> list[Swept]:
        return await self.ledger.gc(older_than)


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """What the data plane's side of the flow is started with."""

    migration_protocol: int
    dummy_prefill: bool
    free_timeout: float
    free_attempts: int
    journal: Path | None


def _link_failure(task: asyncio.Future[None]) -> str | None:
    """Why a link task did not connect its pair (``None``: it did)."""
    if task.cancelled():
        return "the prefill-decode link was dropped (a node was removed)"
    error = task.exception()
    if error is None:
        return None
    if isinstance(error, LinkFailed):
        return error.message
    return f"the prefill and decode nodes could not be connected: {error}"
