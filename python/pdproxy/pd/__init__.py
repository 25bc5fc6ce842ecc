"""Prefill/decode disaggregation: the prefill runs on one node, the decode on another, the KV
cache migrated between them. The requests go through the data plane's pipeline in every
protocol; what the control plane keeps of a protocol is its ``PdAdapter``. LMDeploy's DistServe
(``lmdeploy``) keeps the prefill-decode links (``links``) and sweeps the ledger of preserved
sessions (``ledger``); vLLM's ``kv_transfer_params`` and SGLang's bootstrap rendezvous keep
nothing here."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypedDict

from pdproxy import _pdproxy
from pdproxy.config.settings import Settings
from pdproxy.errors import DistServeOff
from pdproxy.router import Router

if TYPE_CHECKING:
    from pdproxy.fleet.fleet import Fleet

    from .ledger import Swept
    from .links import LinkSummary, WarmupAnswer
    from .lmdeploy import DistServeStatus

__all__ = ["ApiKeyOf", "NodePdStatus", "PdAdapter", "PdStatus", "make_adapter"]

#: A node's API key by its URL (the fleet's ``api_key_of``).
ApiKeyOf = Callable[[str], str | None]


class StatelessStatus(TypedDict):
    protocol: str


#: What a flow shows of itself (``/distserve/status``, ``/debug/state``, the dashboard).
PdStatus: TypeAlias = "DistServeStatus | StatelessStatus"


class NodePdStatus(TypedDict):
    """What a flow keeps of one node, in its ``/nodes/status`` entry."""

    #: The prefill-decode links the node is on.
    links: list[LinkSummary]
    #: Sessions preserved on it (a prefill node) for a decode to take over.
    preserved_sessions: int


#: What a flow that keeps nothing across requests answers for its links and sessions.
NOTHING_KEPT = "links and preserved sessions exist only with --pd-protocol lmdeploy"


class PdAdapter(Protocol):
    """What the proxy keeps of a disaggregation protocol."""

    @property
    def protocol(self) -> str:
        """``--pd-protocol``'s name of it."""

    @property
    def paths(self) -> Collection[str]:
        """The request paths it serves (the rest go to one node, as Hybrid)."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def node_removed(self, url: str) -> None:
        """A node left the fleet: what the flow keeps of it goes."""

    def status(self) -> PdStatus:
        """What ``/distserve/status`` and ``/debug/state`` show of it."""

    def kept(self) -> DistServeStatus | None:
        """What it keeps across requests (links, the ledger of preserved sessions), for the
        metrics; ``None`` when it keeps nothing."""

    def node_status(self, url: str) -> NodePdStatus | None:
        """What it keeps of the node ``url`` (``/nodes/status``); ``None`` when it keeps nothing."""

    async def adopt_orphans(self) -> int:
        """A worker group's leader's round: frees what workers that died left; how many."""

    async def warmup(self) -> WarmupAnswer:
        """Connects every prefill-decode pair now. Raises ``DistServeOff`` when it keeps no links."""

    async def gc(self, older_than: float) -> list[Swept]:
        """Frees the sessions preserved longer than ``older_than`` seconds. Raises
        ``DistServeOff`` when it preserves none."""


class Stateless:
    """vLLM's and SGLang's protocols: the pipeline runs them whole, and nothing outlives a
    request."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.paths = frozenset(_pdproxy.PD_PATHS[protocol])

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def node_removed(self, url: str) -> None:
        pass

    def status(self) -> StatelessStatus:
        return StatelessStatus(protocol=self.protocol)

    def kept(self) -> None:
        return None

    def node_status(self, url: str) -> None:
        return None

    async def adopt_orphans(self) -> int:
        return 0

    async def warmup(self) -> WarmupAnswer:
        raise DistServeOff(NOTHING_KEPT)

    async def gc(self, older_than: float) -> list[Swept]:
        raise DistServeOff(NOTHING_KEPT)


def make_adapter(router: Router, settings: Settings, fleet: Fleet, group_dir: Path | None = None) -> PdAdapter:
    """The disaggregation flow for ``settings.pd.protocol`` (``group_dir``: a worker group's,
    whose workers share the prefill-decode links)."""
    if settings.pd.protocol != "lmdeploy":
        return Stateless(settings.pd.protocol)
    from .lmdeploy import DistServe

    return DistServe(router, settings, fleet.api_key_of, group_dir)
