"""Which node URLs may be added: a node URL is where the proxy will send requests, so an
attacker who can register nodes must not be able to point it at internal services."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from pdproxy.errors import InvalidNode, NodeUnresolvable

#: Cloud metadata and platform services, reachable from most VMs: AWS/GCP/Azure/OpenStack
#: (169.254.169.254), ECS (169.254.170.2), AWS over IPv6, Alibaba (100.100.100.200), Azure's
#: wire server (168.63.129.16), Oracle Cloud (192.0.0.192).
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",
        "169.254.170.2",
        "fd00:ec2::254",
        "100.100.100.200",
        "168.63.129.16",
        "192.0.0.192",
    )
)
#: Where IPv6 addresses carry an IPv4 address that is the real destination.
SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
TEREDO = ipaddress.ip_network("2001::/32")
NAT64 = ipaddress.ip_network("64:ff9b::/96")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_networks(cidrs: Sequence[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, 6to4, Teredo, NAT64), if any."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in SIX_TO_FOUR:
        return address.sixtofour
    if address in TEREDO and address.teredo is not None:
        return address.teredo[1]
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _refusal(address: Address, allowed: tuple[Network, ...]) -> str | None:
    inner = embedded_ipv4(address)
    if inner is not None:
        reason = _refusal(inner, allowed)
        return f"{reason} (as {inner})" if reason else None
    if address.is_unspecified:
        return "the unspecified address (this host)"
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_multicast or address.is_reserved:
        return "not a unicast address"
    if allowed and not any(address in network for network in allowed):
        return "outside the allowed networks"
    return None


def is_local(address: Address) -> bool:
    """Whether ``address`` is one of this machine's own (a socket can be bound to it)."""
    if address.is_loopback or address.is_unspecified:
        return True
    family = socket.AF_INET6 if isinstance(address, ipaddress.IPv6Address) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
        return True


async def check_node_url(url: str, allowed: tuple[Network, ...], own_port: int | None = None) -> str:
    """Raises ``InvalidNode`` unless the node at ``url`` (a record's canonical URL: http or https,
    no credentials, as the data plane parsed it once) has a host that resolves only to permitted
    addresses, none of them this proxy itself (a local address on ``own_port``). Returns the
    address the node is to be reached at (``host:port``), pinned so that the name is not
    resolved again at connect time. Resolution runs off the event loop."""
    host, port = _host_and_port(url)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise NodeUnresolvable(f"node {url}: its host does not resolve ({e.strerror or e})") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    _check_addresses(url, host, port, addresses, allowed, own_port)
    first = addresses[0]
    return f"[{first}]:{port}" if isinstance(first, ipaddress.IPv6Address) else f"{first}:{port}"


def check_address_node(url: str, allowed: tuple[Network, ...], own_port: int | None = None) -> None:
    """``check_node_url`` without resolving: raises ``InvalidNode`` for a node whose host is an
    address the rules refuse (a name is checked when the node is added, once it resolves). For
    the settings' nodes, before anything is served."""
    host, port = _host_and_port(url)
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return
    _check_addresses(url, host, port, [address], allowed, own_port)


def _host_and_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        raise InvalidNode(f"node {url}: the URL has no host")
    if any(len(label) > 63 for label in host.split(".")) or len(host) > 253:
        raise InvalidNode(f"node {url}: the host is not a valid name (labels of at most 63 characters)")
    try:
        return host, parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        raise InvalidNode(f"node {url}: the port is not a number between 0 and 65535") from None


def _check_addresses(
    url: str, host: str, port: int, addresses: list[Address], allowed: tuple[Network, ...], own_port: int | None
) -> None:
    if not addresses:
        raise NodeUnresolvable(f"node {url}: its host does not resolve")
    for address in addresses:
        reason = _refusal(address, allowed)
        if reason is not None:
            raise InvalidNode(f"node {url}: {host} resolves to {address}, {reason}")
        if own_port is not None and port == own_port and is_local(address):
            raise InvalidNode(f"node {url}: that is this proxy itself")
