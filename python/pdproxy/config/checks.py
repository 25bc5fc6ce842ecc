"""The checks of a ``Settings`` that need the rest of pdproxy: the worker group's size (the
shared table's), the shared registry's URL, the tenants file, each configured node (its form,
and the node rules where its host is an address), and the tracing settings left to the
``OTEL_*`` environment. ``checked`` runs them before anything is served (the CLI, and every
``Router``), so that ``settings`` stays a leaf. (Routing policies are the settings' own check:
``RoutingSettings.policies``.)"""

from __future__ import annotations

import os

from pdproxy import _pdproxy
from pdproxy.config.settings import Settings
from pdproxy.errors import ConfigError, InvalidNode
from pdproxy.fleet.membership import check_url as check_registry_url
from pdproxy.fleet.node_record import configured_nodes
from pdproxy.fleet.node_sources import check as check_node_sources
from pdproxy.fleet.urls import parse_networks
from pdproxy.observability.tracing import otel_settings
from pdproxy.server.group import MAX_WORKERS
from pdproxy.server.tenants import load as load_tenants

__all__ = ["checked"]


def checked(settings: Settings) -> Settings:
    """``settings`` with the tracing settings the environment fills; raises ``ConfigError``
    naming the first setting pdproxy cannot use."""
    if settings.server.workers > MAX_WORKERS:
        raise ConfigError(f"--workers is at most {MAX_WORKERS}, got {settings.server.workers}")
    if settings.server.edge == "rust" and settings.server.workers != 1:
        raise ConfigError("--workers is for --edge granian; the Rust edge uses every core in one process")
    if settings.observability.metrics_port and settings.observability.metrics_port == settings.server.port:
        raise ConfigError(f"--metrics-port {settings.server.port} is the serving port, where /metrics is served anyway")
    if settings.membership.registry:
        check_registry_url(settings.membership.registry)
    if settings.tenants.file:
        load_tenants(settings.tenants.file)  # a bad file stops the start, naming its problem
    _check_configured_nodes(settings)
    check_node_sources(settings)  # selectors, names, the Kubernetes configuration
    filled = otel_settings(settings, os.environ)
    return settings.replace(**filled) if filled else settings


def _check_configured_nodes(settings: Settings) -> None:
    """Each node of the settings parses and, when its host is an address, is one the node rules
    allow: a refused node stops the start rather than leaving the proxy serving without it."""
    rules = _pdproxy.NodeAddressRules([str(network) for network in parse_networks(settings.security.allow_node_cidrs)])
    for record in configured_nodes(settings):
        try:
            rules.check_literal(record.url)
        except InvalidNode as e:
            raise ConfigError(f"--node: {e.message}") from None
