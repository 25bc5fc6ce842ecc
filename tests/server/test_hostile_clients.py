"""What a hostile or careless client may do to the proxy (issue "Hardening, round two"): numbers
that size the proxy's work, floods of connections, headers that claim an origin, paths that
decode into another route, management calls from nowhere, bodies nested past any parser. Each
of these failed before its fix."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdproxy.testing import MockEngine
from pdproxy.testing.hostile_clients import idle_connections
from servers import Process, chat_body, child_pids, eventually, pdproxy_serve, raw_post, register

# Against both edges (see the `edge` fixture).
pytestmark = pytest.mark.usefixtures("edge")

CHAT = "/v1/chat/completions"


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    async with MockEngine(model="m") as engine:
        yield engine


async def requests_seen(http: aiohttp.ClientSession, engine: MockEngine) -> list[dict[str, Any]]:
    async with http.get(engine.url + "/mock/requests") as r:
        return list(await r.json())


async def serves_m(http: aiohttp.ClientSession, proxy: str) -> bool:
    async with http.get(proxy + "/v1/models") as r:
        return r.status == 200 and "m" in {m["id"] for m in (await r.json())["data"]}


# 1. Client numbers that size the proxy's work are bounded.


@pytest.mark.parametrize(("field", "value"), [("n", 10**12), ("best_of", 10**12), ("n", 129)])
async def test_n_and_best_of_are_bounded(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession, field: str, value: int
) -> None:
    async with pdproxy_serve(tmp_path, "--node", engine.url) as proxy:
        await eventually(lambda: serves_m(http, proxy.url))
        async with http.post(proxy.url + CHAT, json=chat_body("m", **{field: value})) as r:
            assert r.status == 400, await r.text()
            error = (await r.json())["error"]
        assert error["param"] == field
        assert "at most 128 (max_n)" in error["message"], error
        assert await requests_seen(http, engine) == [], "the node got nothing"
        async with http.post(proxy.url + CHAT, json=chat_body("m", n=2)) as r:
            assert r.status == 200, "within the bound"


async def test_n_in_sglang_disaggregation_is_refused_before_anything_grows(
    tmp_path: Path, pd_engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = pd_engines
    args = ("--serving-strategy", "DistServe", "--pd-protocol", "sglang", "--max-n", "4")
    async with pdproxy_serve(tmp_path, *args) as proxy:
        await register(http, proxy.url, prefill, 2)
        await register(http, proxy.url, decode, 3)
        body = {"model": "m", "prompt": "hi", "n": 10**12}
        async with http.post(proxy.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(10)) as r:
            assert r.status == 400, await r.text()
            error = (await r.json())["error"]
        assert (error["param"], "max_n" in error["message"]) == ("n", True), error
        body["n"] = 3
        async with http.post(proxy.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()


# 4. Running out of descriptors is the proxy's problem, never a node's.


def _open_file_limit(pid: int) -> int:
    """The soft limit on open files of process ``pid``."""
    limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
    return int(next(line for line in limits if line.startswith("Max open files")).split()[3])


def _with_nofile(soft: int, hard: int) -> Any:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def flood_taken_in(proxy: Process, flood: list[socket.socket]) -> bool:
    """Whether the proxy has taken in all of ``flood`` that it can: every connection accepted (held,
    or refused at the cap), none left in its listen queue, or else it is out of descriptors."""
    port = int(proxy.url.rsplit(":", 1)[1])
    ports = {s.getsockname()[1] for s in flood}
    accepted = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
        if int(local.split(":")[1], 16) != port or int(remote.split(":")[1], 16) not in ports:
            continue
        # Established with a descriptor (one still in the listen queue has none), or closed by the proxy.
        if (state == "01" and inode != "0") or state in ("04", "05", "06", "07", "0B"):
            accepted += 1
    processes = [proxy.proc.pid, *child_pids(proxy.proc.pid)]
    return accepted == len(flood) or any(
        len(os.listdir(f"/proc/{pid}/fd")) >= _open_file_limit(pid) for pid in processes
    )


def connections_to(url: str) -> set[int]:
    """The local ports of the open connections to ``url`` (a node; only the proxy connects to it):
    established, or closed by the node and not yet by the proxy (its descriptor still open)."""
    port = int(url.rsplit(":", 1)[1])
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] in ("01", "08") and int(fields[2].split(":")[1], 16) == port:
            ports.add(int(fields[1].split(":")[1], 16))
    return ports


async def test_the_soft_descriptor_limit_is_raised_to_the_hard_one(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    hard = 8192  # the usual soft limit below it
    async with pdproxy_serve(tmp_path, "--node", engine.url, preexec=_with_nofile(1024, hard)) as proxy:
        await eventually(lambda: serves_m(http, proxy.url))
        assert _open_file_limit(proxy.proc.pid) == hard
        idle = idle_connections(int(proxy.url.rsplit(":", 1)[1]), 1100)
        try:
            await eventually(lambda: flood_taken_in(proxy, idle), "the 1,100 connections taken in")
            # A new client, its connection after the 1,100 others, and its request a new node connection.
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as fresh,
                fresh.post(proxy.url + CHAT, json=chat_body("m", stream=True)) as r,
            ):
                assert r.status == 200, await r.text()
        finally:
            for s in idle:
                s.close()
        async with http.get(proxy.url + "/nodes/status") as r:
            node = (await r.json())[engine.url]
        assert (node["circuit"], node["failed"]) == ("closed", 0), node


async def test_a_flood_of_connections_is_refused_at_accept_and_opens_no_circuit(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    flags = ("--node", engine.url, "--max-connections", "64", "--circuit-failures", "2")
    async with pdproxy_serve(tmp_path, *flags, preexec=_with_nofile(200, 200)) as proxy:
        await eventually(lambda: serves_m(http, proxy.url))
        # An open connection, kept through the flood.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as kept:
            async with kept.post(proxy.url + CHAT, json=chat_body("m")) as r:
                assert r.status == 200
            idle = idle_connections(int(proxy.url.rsplit(":", 1)[1]), 400)
            try:
                await eventually(lambda: flood_taken_in(proxy, idle), "the flood taken in")
                for _ in range(5):
                    async with kept.post(proxy.url + CHAT, json=chat_body("m")) as r:
                        assert r.status == 200, await r.text()
            finally:
                for s in idle:
                    s.close()
        # A fixed wait for a negative assertion: whatever the flood did to the node is counted by now.
        await asyncio.sleep(0.5)
        async with http.get(proxy.url + "/nodes/status") as r:
            node = (await r.json())[engine.url]
        assert (node["circuit"], node["failed"]) == ("closed", 0), node


# The Rust edge only: granian stops accepting at its own backpressure, so a flood cannot take
# its descriptors.
@pytest.mark.parametrize("edge", ["rust"], indirect=True)
async def test_running_out_of_descriptors_is_not_a_node_failure(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession, edge: str
) -> None:
    # A cap above what the descriptors allow, and node connections that do not stay pooled: a
    # request that comes during the flood finds no descriptor for its node connection.
    flags = ("--node", engine.url, "--max-connections", "1000", "--circuit-failures", "2", "--retries", "0")
    async with pdproxy_serve(tmp_path, *flags, "--pool-idle-timeout", "0.3", preexec=_with_nofile(128, 128)) as proxy:
        await eventually(lambda: serves_m(http, proxy.url))
        answers = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as kept:
            before = connections_to(engine.url)  # the control plane's (discovery, health checks)
            async with kept.post(proxy.url + CHAT, json=chat_body("m")) as r:
                assert r.status == 200
            pooled = connections_to(engine.url) - before
            assert pooled, "the request opened a node connection"
            idle = idle_connections(int(proxy.url.rsplit(":", 1)[1]), 400)
            try:
                await eventually(
                    # In this order: the descriptor the pooled connection frees is counted as
                    # taken by the flood again, not as free for the next request's node connection.
                    lambda: not pooled & connections_to(engine.url) and flood_taken_in(proxy, idle),
                    "the pooled node connection closed (idle 0.3 s), then the flood to take every descriptor",
                )
                for _ in range(4):
                    async with kept.post(proxy.url + CHAT, json=chat_body("m")) as r:
                        answers.append((r.status, (await r.json())["error"]["code"] if r.status != 200 else None))
            finally:
                for s in idle:
                    s.close()
        assert answers == [(503, "overloaded")] * 4, answers
        async with http.get(proxy.url + "/nodes/status") as r:
            node = (await r.json())[engine.url]
        assert (node["circuit"], node["failed"]) == ("closed", 0), node

        async def served() -> bool:  # once the edge has seen the flood's connections close
            async with http.post(proxy.url + CHAT, json=chat_body("m")) as r:
                return r.status == 200

        await eventually(served, what="served again once descriptors are free")


# 10. Where a request came from is the proxy's to say.


async def test_forwarded_and_x_real_ip_from_the_client_do_not_reach_the_node(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    async with pdproxy_serve(tmp_path, "--node", engine.url) as proxy:
        await eventually(lambda: serves_m(http, proxy.url))
        claims = {"forwarded": "for=1.2.3.4;proto=https", "x-real-ip": "1.2.3.4"}
        async with http.post(proxy.url + CHAT, json=chat_body("m"), headers=claims) as r:
            assert r.status == 200
        seen = (await requests_seen(http, engine))[-1]["headers"]
        assert "forwarded" not in seen, seen
        assert "x-real-ip" not in seen, seen
        assert seen["x-forwarded-for"] == "127.0.0.1"


# 11. Paths, origins and bodies that slipped past the checks.


async def test_an_encoded_inference_path_is_not_served(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    async with pdproxy_serve(tmp_path, "--node", engine.url) as proxy:
        await eventually(lambda: serves_m(http, proxy.url))
        for path in ("/v1%2Fchat%2Fcompletions", "/v1%2fcompletions", "/%761/chat/completions"):
            answer = await raw_post(proxy.url, path, json.dumps(chat_body("m")).encode())
            assert answer.startswith(b"HTTP/1.1 404"), (path, answer[:300])
        assert await requests_seen(http, engine) == []


async def test_keyless_management_refuses_the_null_origin(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    async with pdproxy_serve(tmp_path, "--node", engine.url) as proxy:
        async with http.post(proxy.url + "/nodes/remove", json={"url": engine.url}, headers={"origin": "null"}) as r:
            assert r.status == 403, await r.text()
        async with http.get(proxy.url + "/nodes/status") as r:
            assert engine.url in await r.json(), "nothing was done"


async def test_a_body_nested_past_any_parser_is_a_400(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    deep = b'{"url": "http://127.0.0.1:1", "status": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    async with (
        pdproxy_serve(tmp_path) as proxy,
        http.post(proxy.url + "/nodes/add", data=deep, headers={"content-type": "application/json"}) as r,
    ):
        assert r.status == 400, await r.text()
        assert (await r.json())["error"]["code"] == "invalid_request"


def test_every_key_on_the_command_line_is_warned_about(tmp_path: Path) -> None:
    flags = ("--node", "http://127.0.0.1:9,api_key=node-key", "--otlp-header", "authorization=Bearer t")
    with pdproxy_serve(tmp_path, *flags, "--otlp-endpoint", "http://127.0.0.1:9") as proxy:
        log = proxy.log()
    assert "--node" in log, log
    assert "--otlp-header" in log, log
    assert "node-key" not in log
    assert "Bearer t" not in log
