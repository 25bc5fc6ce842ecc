"""DNS discovery (`--node-dns`) against a real DNS server the test runs on a free port (dnslib):
A records, SRV records with their ports, records that change, a name that goes away, and a
server that fails (the last answer is kept)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from dnslib import QTYPE, RCODE, RR, SRV, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer

from pdproxy.testing import MockEngine, MockSettings
from servers import chat_body, eventually, free_port, pdproxy_serve


class Zone(BaseResolver):
    """Records the test changes while the server runs; ``failing`` answers SERVFAIL."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[Any]] = {}
        self.failing = False
        self.lock = threading.Lock()

    def set(self, name: str, kind: str, rdata: list[Any]) -> None:
        with self.lock:
            self.records[(name.rstrip(".") + ".", kind)] = rdata

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        name, kind = str(request.q.qname), QTYPE[request.q.qtype]
        with self.lock:
            if self.failing:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            known = any(n == name for n, _ in self.records)
            for rdata in self.records.get((name, kind), []):
                reply.add_answer(RR(name, getattr(QTYPE, kind), rdata=rdata, ttl=5))
        if not known:
            reply.header.rcode = RCODE.NXDOMAIN
        return reply


@pytest.fixture
def zone() -> Iterator[tuple[Zone, int]]:
    zone, port = Zone(), free_port()
    quiet = DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data,-log_prefix")
    server = DNSServer(zone, address="127.0.0.1", port=port, logger=quiet)
    server.start_thread()
    try:
        yield zone, port
    finally:
        server.stop()


@pytest.fixture
async def pair() -> AsyncIterator[list[MockEngine]]:
    """Two engines on one port at two loopback addresses, as a headless Service's pods are."""
    port = free_port()
    async with (
        MockEngine(MockSettings(host="127.0.0.1", port=port, model="m")) as a,
        MockEngine(MockSettings(host="127.0.0.2", port=port, model="m")) as b,
    ):
        yield [a, b]


def dns_flags(port: int, *names: str) -> tuple[str, ...]:
    flags: tuple[str, ...] = ("--dns-server", f"127.0.0.1:{port}", "--dns-interval", "0.3", "--dns-timeout", "0.5")
    for name in names:
        flags += ("--node-dns", name)
    return flags


async def nodes(http: aiohttp.ClientSession, proxy: Any) -> dict[str, Any]:
    async with http.get(proxy.url + "/nodes/status") as r:
        return dict(await r.json())


async def nodes_are(http: aiohttp.ClientSession, proxy: Any, urls: set[str]) -> bool:
    return set(await nodes(http, proxy)) == urls


async def dns_state(http: aiohttp.ClientSession, proxy: Any) -> dict[str, Any]:
    async with http.get(proxy.url + "/health") as r:
        return dict((await r.json())["discovery"]["dns"])


async def test_a_names_records_are_its_nodes_and_follow_its_changes(
    tmp_path: Path, zone: tuple[Zone, int], pair: list[MockEngine], http: aiohttp.ClientSession
) -> None:
    records, port = zone
    a, b = pair
    engine_port = a.port
    records.set("vllm.fleet.test", "A", [A("127.0.0.1"), A("127.0.0.2")])
    records.set("vllm.fleet.test", "AAAA", [])
    flags = dns_flags(port, f"vllm.fleet.test:{engine_port},role=hybrid,labels.pool=dns")
    async with pdproxy_serve(tmp_path, *flags) as proxy:
        await eventually(lambda: nodes_are(http, proxy, {a.url, b.url}), what="both addresses as nodes")
        node = (await nodes(http, proxy))[b.url]
        assert node["found_by"] == {"source": "dns", "where": "vllm.fleet.test"}
        assert node["labels"] == {"pool": "dns"}
        await eventually(lambda: serve_m(http, proxy), what="the nodes' models")
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
            assert r.status == 200, await r.text()
        records.set("vllm.fleet.test", "A", [A("127.0.0.2")])
        await eventually(lambda: nodes_are(http, proxy, {b.url}), timeout=3, what="the address that left to go")
        # The server fails: the last answer stays, and the source says it is down.
        records.failing = True
        await eventually(lambda: is_down(http, proxy), timeout=5, what="the failure to show")
        assert await nodes_are(http, proxy, {b.url})
        records.failing = False
        records.set("vllm.fleet.test", "A", [A("127.0.0.1"), A("127.0.0.2")])
        await eventually(lambda: nodes_are(http, proxy, {a.url, b.url}), timeout=3, what="the address back")
        assert (await dns_state(http, proxy))["up"] is True
        # The name goes away (NXDOMAIN is an answer): its nodes go.
        records.records.clear()
        await eventually(lambda: nodes_are(http, proxy, set()), timeout=3, what="the nodes of a name gone")


async def serve_m(http: aiohttp.ClientSession, proxy: Any) -> bool:
    return all("m" in node["models"] for node in (await nodes(http, proxy)).values())


async def is_down(http: aiohttp.ClientSession, proxy: Any) -> bool:
    state = await dns_state(http, proxy)
    return state["up"] is False and "vllm.fleet.test" in (state["error"] or "")


async def test_srv_records_give_each_node_its_port(
    tmp_path: Path, zone: tuple[Zone, int], http: aiohttp.ClientSession
) -> None:
    records, port = zone
    async with MockEngine(model="m") as one, MockEngine(model="m") as two:
        records.set("_http._tcp.vllm.fleet.test", "SRV", [SRV(target="e.fleet.test.", port=e.port) for e in (one, two)])
        records.set("e.fleet.test", "A", [A("127.0.0.1")])
        records.set("e.fleet.test", "AAAA", [])
        async with pdproxy_serve(tmp_path, *dns_flags(port, "srv:_http._tcp.vllm.fleet.test")) as proxy:
            await eventually(lambda: nodes_are(http, proxy, {one.url, two.url}), what="a node per SRV record")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("vllm.fleet.test", "give NAME:PORT"),
        ("vllm.fleet.test:0", "give NAME:PORT"),
        ("10.0.0.1:8000", "is not a DNS name"),
        ("ftp://vllm.fleet.test:80", "the scheme must be http or https"),
        ("vllm.fleet.test:8000,role=sideways", "role"),
    ],
)
def test_an_entry_that_cannot_work_stops_the_start_with_one_line(entry: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdproxy", "serve", "--port", "0", "--node-dns", entry],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert message in lines[0], result.stderr


async def test_a_found_node_that_left_the_table_comes_back_with_the_next_resolution(
    tmp_path: Path, zone: tuple[Zone, int], http: aiohttp.ClientSession
) -> None:
    records, port = zone
    async with MockEngine(model="m") as engine:
        records.set("one.fleet.test", "A", [A("127.0.0.1")])
        async with pdproxy_serve(tmp_path, *dns_flags(port, f"one.fleet.test:{engine.port}")) as proxy:
            await eventually(lambda: nodes_are(http, proxy, {engine.url}), what="the node")
            async with http.post(proxy.url + "/nodes/remove", json={"url": engine.url}) as r:
                assert r.status == 200
            await eventually(lambda: nodes_are(http, proxy, {engine.url}), timeout=3, what="the node back")
