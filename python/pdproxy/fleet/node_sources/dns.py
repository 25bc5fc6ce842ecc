"""DNS discovery: the nodes behind a name, re-resolved every ``--dns-interval``.

``--node-dns NAME:PORT`` takes the name's A and AAAA records (a headless Service, a Consul name,
a round-robin record), ``--node-dns srv:NAME`` its SRV records with their ports; either may
start with ``https://`` and be followed by ``,key=value`` node attributes as ``--node`` takes
them. A name that does not exist, or has no records, has no nodes; a resolution that fails
(a timeout, a server failure) keeps the last answer, and the source says it is down.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.name
import dns.rdatatype
import dns.resolver
from dns.rdata import Rdata
from dns.rdtypes.IN.A import A
from dns.rdtypes.IN.AAAA import AAAA
from dns.rdtypes.IN.SRV import SRV

from pdproxy import _background
from pdproxy.config.settings import Settings
from pdproxy.errors import ConfigError
from pdproxy.fleet.node_record import NodeRecord
from pdproxy.fleet.node_sources.found import Drop, FoundNodes, Owns, Put, SourceState

__all__ = ["DnsName", "DnsSource", "check", "parse_dns_name"]

log = logging.getLogger("pdproxy.dns")

SOURCE = "dns"
#: Answers that say the name has no addresses (the nodes go), as opposed to failures (they stay).
_NO_RECORDS = (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer)


@dataclass(frozen=True)
class DnsName:
    """One ``--node-dns`` entry."""

    text: str
    name: str
    #: The port of every address (None: each SRV record's own).
    port: int | None
    scheme: str
    #: The node attributes after the name, as ``--node`` reads them (``,key=value...``).
    attributes: str

    def record(self, host: str, port: int) -> NodeRecord:
        """The node at ``host:port`` with this entry's attributes. Raises ``ConfigError``."""
        if ":" in host:
            host = f"[{host}]"
        return NodeRecord.parse(f"{self.scheme}://{host}:{port}{self.attributes}")


def parse_dns_name(text: str) -> DnsName:
    """Reads ``[https://]NAME:PORT[,key=value...]`` or ``[https://]srv:NAME[,...]``; raises ``ConfigError``."""
    head, comma, rest = text.strip().partition(",")
    attributes = comma + rest
    scheme, sep, target = head.partition("://")
    if not sep:
        scheme, target = "http", head
    if scheme not in ("http", "https"):
        raise ConfigError(f"--node-dns {text!r}: the scheme must be http or https")
    if target.startswith("srv:"):
        name, port = target.removeprefix("srv:"), None
    else:
        name, colon, number = target.rpartition(":")
        if not colon or not number.isdigit() or not 0 < int(number) < 65536:
            raise ConfigError(f"--node-dns {text!r}: give NAME:PORT (the nodes' port), or srv:NAME for SRV records")
        port = int(number)
    try:
        dns.name.from_text(name)
    except dns.exception.DNSException as e:
        raise ConfigError(f"--node-dns {text!r}: {name!r} is not a DNS name ({e})") from None
    if not name or _is_address(name):
        raise ConfigError(f"--node-dns {text!r}: {name!r} is not a DNS name (give an address with --node)")
    entry = DnsName(text, name, port, scheme, attributes)
    entry.record("192.0.2.1", port or 1)  # the attributes, checked now
    return entry


class DnsSource:
    """Keeps the fleet's nodes for every ``--node-dns`` name those its records give."""

    name = SOURCE

    def __init__(self, settings: Settings) -> None:
        """Raises ``ConfigError`` for an entry or a server that cannot be used."""
        self.names = [parse_dns_name(text) for text in settings.discovery.node_dns]
        self.interval = settings.discovery.dns_interval
        self.state = SourceState(SOURCE)
        self.resolver = _resolver(settings.discovery.dns_server, settings.discovery.dns_timeout)
        self.found: FoundNodes | None = None
        self._task: asyncio.Task[None] | None = None
        #: The names whose last resolution failed (logged once per outage).
        self._failing: set[str] = set()

    async def start(self, put: Put, drop: Drop, owns: Owns) -> None:
        self.found = FoundNodes(SOURCE, put, drop, owns)
        await self.resolve_all()  # the first answer before serving
        self._task = _background.start(self._run(), "pdproxy-dns")

    async def aclose(self) -> None:
        await _background.stop(self._task)

    def node_count(self) -> int:
        return 0 if self.found is None else len(self.found)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.resolve_all()
            except Exception:  # a bug must not end discovery: said, then the next round
                log.exception("dns: resolving the names failed")

    async def resolve_all(self) -> None:
        answers = await asyncio.gather(*(self._resolve(entry) for entry in self.names))
        failures = [a for a in answers if isinstance(a, str)]
        if failures:
            self.state.failed("; ".join(failures))
        else:
            self.state.reached()
            self.state.synced()
        for entry, answer in zip(self.names, answers, strict=True):
            if not isinstance(answer, str):
                await self._apply(entry, answer)

    async def _apply(self, entry: DnsName, addresses: set[tuple[str, int]]) -> None:
        assert self.found is not None
        wanted: dict[str, NodeRecord] = {}
        for host, port in sorted(addresses):
            try:
                wanted[f"{entry.text}|{host}:{port}"] = entry.record(host, port)
            except ConfigError as e:
                log.error("dns: %s: %s:%d is not a node: %s", entry.name, host, port, e)
        for key in self.found.found_keys():
            if key.startswith(entry.text + "|") and key not in wanted:
                await self.found.set(key, None, entry.name)
        for key, record in wanted.items():
            await self.found.set(key, record, entry.name)

    async def _resolve(self, entry: DnsName) -> set[tuple[str, int]] | str:
        """The addresses (and ports) the name has now, or why it could not be resolved."""
        try:
            if entry.port is not None:
                return {(host, entry.port) for host in await self._addresses(entry.name)}
            found: set[tuple[str, int]] = set()
            for srv in await self._services(entry.name):
                target = srv.target.to_text(omit_final_dot=True)
                found |= {(host, srv.port) for host in await self._addresses(target)}
        except dns.exception.DNSException as e:
            reason = f"{entry.name}: {type(e).__name__}: {e}"
            if entry.text not in self._failing:
                log.warning("dns: %s cannot be resolved (%s); keeping its last nodes", entry.name, e)
                self._failing.add(entry.text)
            return reason
        if entry.text in self._failing:
            log.info("dns: %s resolves again", entry.name)
            self._failing.discard(entry.text)
        return found

    async def _addresses(self, name: str) -> set[str]:
        v4, v6 = await asyncio.gather(self._query(name, dns.rdatatype.A), self._query(name, dns.rdatatype.AAAA))
        return {r.address for r in (*v4, *v6) if isinstance(r, A | AAAA)}

    async def _services(self, name: str) -> list[SRV]:
        return [r for r in await self._query(name, dns.rdatatype.SRV) if isinstance(r, SRV)]

    async def _query(self, name: str, kind: dns.rdatatype.RdataType) -> list[Rdata]:
        try:
            answer = await self.resolver.resolve(name, kind, search=True)
        except _NO_RECORDS:
            return []
        return list(answer)


def check(settings: Settings) -> None:
    """Raises ``ConfigError`` for an entry or a server that cannot be used."""
    for text in settings.discovery.node_dns:
        parse_dns_name(text)
    _resolver(settings.discovery.dns_server, settings.discovery.dns_timeout)


def _resolver(server: str, timeout: float) -> dns.asyncresolver.Resolver:
    if not server:
        try:
            resolver = dns.asyncresolver.Resolver()
        except dns.exception.DNSException as e:  # no /etc/resolv.conf, or no server in it
            reason = f"the system's DNS configuration cannot be read ({e})"
            raise ConfigError(f"--node-dns: {reason}; give --dns-server") from None
    else:
        host, port = _server(server)
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [host]
        resolver.port = port
    resolver.lifetime = timeout
    resolver.timeout = timeout
    return resolver


def _server(text: str) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or ``V6``; raises ``ConfigError``."""
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            port = int(rest.removeprefix(":")) if rest.removeprefix(":").isdigit() else -1
    elif text.count(":") == 1:
        host, number = text.split(":")
        port = int(number) if number.isdigit() else -1
    if not _is_address(host) or not 0 < port < 65536:
        raise ConfigError(f"--dns-server {text!r}: give the server's address, optionally with :PORT")
    return host, port


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
