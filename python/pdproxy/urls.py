"""Which node URLs may be added: a node URL is where the proxy will send requests, so an
attacker who can register nodes must not be able to point it at internal services."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from .errors import InvalidNode

#: Cloud metadata services, reachable from most VMs.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200")
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_networks(cidrs: Sequence[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def _refusal(address: Address, allowed: tuple[Network, ...]) -> str | None:
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_multicast or address.is_reserved:
        return "not a unicast address"
    if allowed and not any(address in network for network in allowed):
        return "outside the allowed networks"
    return None


async def check_node_url(url: str, allowed: tuple[Network, ...]) -> None:
    """Raises ``InvalidNode`` unless ``url`` is an http or https URL without credentials whose
    host resolves only to permitted addresses. Resolution runs off the event loop."""
    raw = url.strip()
    parts = urlsplit(raw if "://" in raw else f"http://{raw}")
    if parts.scheme.lower() not in ("http", "https"):
        raise InvalidNode(f"node {raw}: the scheme must be http or https")
    if parts.username is not None or parts.password is not None:
        raise InvalidNode(f"node {raw}: credentials in the URL are refused; register the node with an api_key")
    host = parts.hostname
    if not host:
        raise InvalidNode(f"node {raw}: the URL has no host")
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        raise InvalidNode(f"node {raw}: the port is not a number between 0 and 65535") from None
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise InvalidNode(f"node {raw}: its host does not resolve ({e.strerror or e})") from None
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        reason = _refusal(address, allowed)
        if reason is not None:
            raise InvalidNode(f"node {raw}: {host} resolves to {address}, {reason}")
