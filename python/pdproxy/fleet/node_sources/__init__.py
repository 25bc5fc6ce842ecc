"""Node sources: where the fleet finds nodes by itself, and keeps them in step with what it
finds. Kubernetes pods by label selector (``kubernetes``, with the ``kubernetes`` extra) and
DNS names (``dns``). A source puts its nodes into the fleet and takes them out again
(``Fleet.put_found``, ``Fleet.drop_found``); a node registered any other way is never its.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from pdproxy.config.settings import Settings
from pdproxy.errors import ConfigError
from pdproxy.fleet.node_sources.found import Drop, FoundBy, Owns, Put, SourceState
from pdproxy.fleet.node_sources.selectors import SELECTORS

if TYPE_CHECKING:
    from pdproxy.fleet.node_sources.kubernetes import KubernetesSource

__all__ = ["FoundBy", "NodeSource", "SourceState", "check", "sources_for"]


class NodeSource(Protocol):
    name: str
    state: SourceState

    async def start(self, put: Put, drop: Drop, owns: Owns) -> None: ...

    async def aclose(self) -> None: ...

    def node_count(self) -> int: ...


def sources_for(settings: Settings) -> list[NodeSource]:
    """The sources ``settings`` ask for. Raises ``ConfigError``."""
    sources: list[NodeSource] = []
    if _wants_kubernetes(settings):
        source, _ = _kubernetes()
        sources.append(source(settings))
    if settings.discovery.node_dns:
        from pdproxy.fleet.node_sources.dns import DnsSource

        sources.append(DnsSource(settings))
    return sources


def check(settings: Settings) -> None:
    """Raises ``ConfigError`` for a source ``settings`` ask for that cannot run: a selector or
    a name that does not parse, no Kubernetes configuration, the extra not installed."""
    if _wants_kubernetes(settings):
        _, check_kubernetes = _kubernetes()
        check_kubernetes(settings)
    if settings.discovery.node_dns:
        from pdproxy.fleet.node_sources.dns import check as check_dns

        check_dns(settings)


def _wants_kubernetes(settings: Settings) -> bool:
    return any(getattr(settings.discovery, name) for name, _ in SELECTORS)


def _kubernetes() -> tuple[type[KubernetesSource], Callable[[Settings], None]]:
    try:
        from pdproxy.fleet.node_sources.kubernetes import KubernetesSource, check
    except ImportError as e:  # lightkube is an extra
        needs = "pip install 'pdproxy[kubernetes]'"
        raise ConfigError(f"--k8s-selector needs the Kubernetes client: {needs} ({e})") from None
    return KubernetesSource, check
