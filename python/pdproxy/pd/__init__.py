"""Prefill/decode disaggregation: the prefill runs on one node, the decode on another, the KV
cache migrated between them. ``lmdeploy`` speaks LMDeploy's DistServe; ``links`` keeps the
prefill-decode connections; ``ledger`` makes sure no preserved prefill session is ever lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdproxy.config import Settings
from pdproxy.router import Router


def make_adapter(router: Router, settings: Settings, fleet: Any, group_dir: Path | None = None) -> Any:
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
