"""Prefill/decode disaggregation: the prefill runs on one node, the decode on another, the KV
cache migrated between them. Each protocol is a ``PdAdapter``: ``lmdeploy`` speaks LMDeploy's
DistServe (``links`` keeps the prefill-decode connections; ``ledger`` makes sure no preserved
prefill session is ever lost), ``vllm`` vLLM's ``kv_transfer_params``, ``sglang`` SGLang's
bootstrap rendezvous."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias

from pdproxy.config import Settings
from pdproxy.router import Router

from .relay import PdRequest

if TYPE_CHECKING:
    from pdproxy.fleet import Fleet

    from .lmdeploy import DistServeStatus
    from .sglang import SglangStatus
    from .vllm import VllmStatus

__all__ = ["PdAdapter", "PdStatus", "make_adapter"]

#: What a flow shows of itself (``/distserve/status``, ``/debug/state``, the dashboard).
PdStatus: TypeAlias = "DistServeStatus | VllmStatus | SglangStatus"


class PdAdapter(Protocol):
    """What the proxy asks of a disaggregation flow."""

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

    async def handle(self, request: PdRequest) -> None:
        """Serves one request: its prefill on a prefill node, its decode on a decode node."""


def make_adapter(router: Router, settings: Settings, fleet: Fleet, group_dir: Path | None = None) -> PdAdapter:
    """The disaggregation flow for ``settings.pd_protocol`` (``group_dir``: a worker group's,
    whose workers share the prefill-decode links)."""
    if settings.pd_protocol == "vllm":
        from .vllm import VllmPD

        return VllmPD(router, settings, fleet.api_key_of)
    if settings.pd_protocol == "sglang":
        from .sglang import SglangPD

        return SglangPD(router, settings, fleet.bootstrap_port_of)
    from .lmdeploy import DistServe

    return DistServe(router, settings, fleet.api_key_of, group_dir)
