"""Which node URLs may be added: a node URL is where the proxy will send requests, so an
attacker who can register nodes must not be able to point it at internal services. The rules
live in the data plane (``rust/src/node/address.rs``, as ``_pdproxy.NodeAddressRules``), which
parses a node's URL once and resolves its host as it adds the node; here only the settings'
networks are read."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(cidrs: Sequence[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)
