"""`pdproxy serve --workers N`: real granian worker processes sharing one node table.

Each check talks to the group through fresh connections, which the kernel spreads over the
workers; `/debug/state` says which worker answered, so a test can tell it has seen them all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdproxy.testing.faults import FAULT_HEADER
from redis_server import REDIS_SERVER, redis_server
from servers import Process, chat_body, child_pids, get_json, mock_engine, pdproxy_serve, post_json, wait_until

pytestmark = pytest.mark.slow

WORKERS = 2


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Process]:
    with mock_engine(tmp_path, "alpha") as process:
        yield process


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Process]:
    with pdproxy_serve(tmp_path, "--edge", "granian", "--workers", str(WORKERS), "--health-interval", "0.2") as proxy:
        _wait_for_workers(proxy.url)
        yield proxy


def _state(url: str) -> dict[str, Any]:
    state: dict[str, Any] = get_json(url + "/debug/state")
    return state


def _workers_seen(url: str, rounds: int = 20) -> dict[int, dict[str, Any]]:
    """Each worker's /debug/state answer, by pid, over `rounds` fresh connections."""
    seen: dict[int, dict[str, Any]] = {}
    for _ in range(rounds):
        try:
            state = _state(url)
        except OSError:
            continue  # a connection a killed worker had accepted: the others answer the next rounds
        seen[state["group"]["pid"]] = state
    return seen


def _every_worker(url: str, check: Any) -> bool:
    """Whether `check(state)` holds on every worker (all of them answered)."""
    seen = _workers_seen(url)
    return len(seen) == WORKERS and all(check(s) for s in seen.values())


def _wait_for_workers(url: str) -> None:
    wait_until(lambda: len(_workers_seen(url)) == WORKERS, 20, "every worker to answer")


def _add_everywhere(url: str, node: dict[str, Any]) -> None:
    """Registers a node through one worker and waits until every worker routes to it."""
    post_json(url + "/nodes/add", node)
    wait_until(lambda: _every_worker(url, lambda s: node["url"] in s["nodes"]), 5, "the node on every worker")


@contextlib.contextmanager
def _distserve_group(tmp_path: Path) -> Iterator[tuple[Process, Process, Process]]:
    """A DistServe worker group with a prefill and a decode engine registered: (proxy, prefill, decode)."""
    with (
        mock_engine(tmp_path, "m", "--role", "prefill") as prefill,
        mock_engine(tmp_path, "m", "--role", "decode") as decode,
        pdproxy_serve(
            tmp_path, "--edge", "granian", "--workers", str(WORKERS), "--serving-strategy", "DistServe"
        ) as proxy,
    ):
        _wait_for_workers(proxy.url)
        for engine, role in ((prefill, 2), (decode, 3)):
            _add_everywhere(proxy.url, {"url": engine.url, "status": {"models": ["m"], "role": role}})
        yield proxy, prefill, decode


async def _stream(http: aiohttp.ClientSession, url: str, delay_ms: int, tokens: int = 10) -> bytes:
    headers = {FAULT_HEADER: f"token_delay_ms={delay_ms}"}
    body = chat_body(stream=True, max_tokens=tokens)
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.read()


def test_one_leader_and_membership_seen_by_every_worker(group: Process, engine: Process) -> None:
    leaders = [s["group"]["leader"] for s in _workers_seen(group.url).values()]
    assert leaders.count(True) == 1, leaders
    with urllib.request.urlopen(group.url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert f"pdproxy_group_workers {WORKERS:.1f}" in metrics
    assert 'pdproxy_group_node_slots{use="bound"} 0.0' in metrics

    _add_everywhere(group.url, {"url": engine.url, "status": {"models": ["alpha"]}, "max_concurrency": 3})
    status = get_json(group.url + "/nodes/status")[engine.url]
    assert status["max_concurrency"] == 3

    # The leader's health verdict is every worker's.
    post_json(engine.url + "/mock/health", {"status": "unhealthy"})
    wait_until(
        lambda: _every_worker(group.url, lambda s: s["nodes"][engine.url]["state"] == "unhealthy"),
        10,
        "every worker to see the node unhealthy",
    )

    # Every worker shows the leader's health view in /nodes/status.
    def failures_shown() -> bool:
        health = get_json(group.url + "/nodes/status")[engine.url]["health"]
        return health is not None and health["consecutive_failures"] > 0

    wait_until(lambda: all(failures_shown() for _ in range(10)), 5, "every worker to show the leader's health view")
    post_json(engine.url + "/mock/health", {"status": "healthy"})
    wait_until(
        lambda: _every_worker(group.url, lambda s: s["nodes"][engine.url]["state"] == "healthy"),
        10,
        "every worker to see the node healthy again",
    )

    post_json(group.url + "/nodes/remove", {"url": engine.url})
    wait_until(lambda: _every_worker(group.url, lambda s: not s["nodes"]), 5, "the node gone from every worker")


async def test_a_nodes_cap_holds_across_workers(group: Process, engine: Process) -> None:
    cap = 3
    _add_everywhere(group.url, {"url": engine.url, "status": {"models": ["alpha"]}, "max_concurrency": cap})
    post_json(engine.url + "/mock/reset", {})
    # A connection per request, so that the kernel spreads them over both workers.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        bodies = await asyncio.gather(*(_stream(http, group.url, delay_ms=20) for _ in range(24)))
    assert all(b.endswith(b"data: [DONE]\n\n") for b in bodies)
    stats = get_json(engine.url + "/mock/stats")
    assert stats["peak_active"] == cap, stats  # reached, never passed, whichever worker sent them
    workers = _workers_seen(group.url)
    assert all(s["requests_here"] > 0 for s in workers.values()), "both workers forwarded some"
    assert [s["nodes"][engine.url]["in_flight"] for s in workers.values()] == [0] * WORKERS


async def test_a_dead_workers_permits_are_handed_back(group: Process, engine: Process) -> None:
    cap = 4
    _add_everywhere(group.url, {"url": engine.url, "status": {"models": ["alpha"]}, "max_concurrency": cap})
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        # Long streams, so that permits are held while a worker is killed.
        streams = [asyncio.create_task(_stream(http, group.url, delay_ms=300, tokens=20)) for _ in range(12)]
        holder: dict[str, Any] = {}

        def a_worker_holds_permits() -> bool:
            for state in _workers_seen(group.url).values():
                if state["group"]["held"] > 0 and state["nodes"][engine.url]["in_flight"] == cap:
                    holder.update(state["group"])
                    return True
            return False

        await asyncio.to_thread(wait_until, a_worker_holds_permits, 10, "a worker holding permits")
        os.kill(holder["pid"], signal.SIGKILL)
        outcomes = await asyncio.gather(*streams, return_exceptions=True)
    assert any(isinstance(o, Exception) for o in outcomes), "the killed worker's streams broke"
    assert any(isinstance(o, bytes) for o in outcomes), "the other worker's streams finished"
    # The counts do not drift: the killed worker's permits came back, and granian replaced it.
    wait_until(
        lambda: _every_worker(group.url, lambda s: s["nodes"][engine.url]["in_flight"] == 0),
        10,
        "in-flight counts back to zero",
    )
    pids = set(_workers_seen(group.url))
    assert holder["pid"] not in pids
    assert "handed back" in group.log()
    # The whole cap is usable again.
    post_json(engine.url + "/mock/reset", {})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as http:
        await asyncio.gather(*(_stream(http, group.url, delay_ms=100, tokens=5) for _ in range(cap)))
    assert get_json(engine.url + "/mock/stats")["peak_active"] == cap


def test_drain_on_one_worker_ends_the_group(group: Process, engine: Process) -> None:
    post_json(group.url + "/nodes/add", {"url": engine.url, "status": {"models": ["alpha"]}})
    answer = post_json(group.url + "/drain", {})
    assert answer["status"] == "draining"
    wait_until(lambda: group.proc.poll() is not None, 20, "the group to exit")
    assert group.proc.returncode == 0, group.log()


def test_distserve_links_are_connected_once_for_the_group(tmp_path: Path) -> None:
    with _distserve_group(tmp_path) as (proxy, prefill, decode):

        async def requests() -> None:
            connector = aiohttp.TCPConnector(force_close=True, limit=0)
            async with aiohttp.ClientSession(connector=connector) as http:

                async def one(i: int) -> None:
                    async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m", prompt=f"q{i}")) as r:
                        assert r.status == 200, await r.text()

                await asyncio.gather(*(one(i) for i in range(16)))

        asyncio.run(requests())
        workers = _workers_seen(proxy.url)
        assert all(s["requests_here"] > 0 for s in workers.values()), "both workers served PD requests"
        for engine in (prefill, decode):
            operations = [op for op, _, _ in get_json(engine.url + "/mock/ledger")["links"] if op != "engine_info"]
            assert operations == ["p2p_initialize", "p2p_connect"], (engine.url, operations)

        # Removing the decode node drops the link once, from one worker.
        post_json(proxy.url + "/nodes/remove", {"url": decode.url})
        wait_until(
            lambda: [op for op, _, _ in get_json(prefill.url + "/mock/ledger")["links"]][-1] == "p2p_drop_connect",
            5,
            "the link dropped",
        )
        wait_until(lambda: _every_worker(proxy.url, lambda s: len(s["nodes"]) == 1), 5, "the removal applied")
        time.sleep(0.5)  # a second drop, if any worker sent one, would have landed by now
        drops = [op for op, _, _ in get_json(prefill.url + "/mock/ledger")["links"]].count("p2p_drop_connect")
        assert drops == 1


async def test_workers_of_replicas_share_membership_through_redis(tmp_path: Path, engine: Process) -> None:
    if REDIS_SERVER is None:
        pytest.fail("this test needs Debian's redis-server (apt-get install redis-server)")
    cap = 2
    with (
        redis_server(tmp_path) as redis,
        pdproxy_serve(tmp_path, "--edge", "granian", "--workers", str(WORKERS), "--registry", redis.url) as proxy,
    ):
        _wait_for_workers(proxy.url)
        _add_everywhere(proxy.url, {"url": engine.url, "status": {"models": ["alpha"]}, "max_concurrency": cap})
        post_json(engine.url + "/mock/reset", {})
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as http:
            await asyncio.gather(*(_stream(http, proxy.url, delay_ms=20) for _ in range(12)))
        assert get_json(engine.url + "/mock/stats")["peak_active"] == cap  # exact on the machine


async def test_sessions_preserved_by_a_dead_worker_are_freed(tmp_path: Path) -> None:
    with _distserve_group(tmp_path) as (proxy, prefill, _decode):

        def live() -> list[int]:
            return list(get_json(prefill.url + "/mock/ledger")["live"])

        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            # The decode never starts: each request's prefill session stays preserved.
            headers = {FAULT_HEADER: "decode.hang"}

            async def one(i: int) -> int:
                body = chat_body("m", prompt=f"q{i}")
                async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
                    return r.status

            requests = [asyncio.create_task(one(i)) for i in range(8)]
            victim: dict[str, Any] = {}

            def a_worker_holds_sessions() -> bool:
                for state in _workers_seen(proxy.url).values():
                    if state["pd"]["ledger"]["preserved"] > 0:
                        victim.update(state["group"])
                        return True
                return False

            await asyncio.to_thread(wait_until, a_worker_holds_sessions, 10, "a worker holding preserved sessions")
            os.kill(victim["pid"], signal.SIGKILL)
            await asyncio.to_thread(wait_until, lambda: not _alive(victim["pid"]), 10, "the worker killed")
            # The survivor's requests are abandoned by their client: it frees those itself.
            for task in requests:
                task.cancel()
            await asyncio.gather(*requests, return_exceptions=True)
        wait_until(lambda: not live(), 10, "every preserved session freed")
        report = get_json(prefill.url + "/mock/ledger")
        assert report["double_frees"] == []
        assert report["unknown_frees"] == []
        assert "its worker died" in proxy.log()


def test_the_leadership_passes_on_when_the_leader_dies(group: Process, engine: Process) -> None:
    _add_everywhere(group.url, {"url": engine.url, "status": {"models": ["alpha"]}})
    leader = next(s["group"]["pid"] for s in _workers_seen(group.url).values() if s["group"]["leader"])
    os.kill(leader, signal.SIGKILL)

    def new_leader() -> bool:
        workers = _workers_seen(group.url)
        return leader not in workers and [s["group"]["leader"] for s in workers.values()].count(True) == 1

    wait_until(new_leader, 15, "another worker to lead")
    # The new leader checks health: its verdict reaches every worker.
    post_json(engine.url + "/mock/health", {"status": "unhealthy"})
    wait_until(
        lambda: _every_worker(group.url, lambda s: s["nodes"][engine.url]["state"] == "unhealthy"),
        10,
        "every worker to see the node unhealthy",
    )


def test_a_worker_ends_with_its_main_process(tmp_path: Path) -> None:
    """A worker whose main process was killed stops serving (it would otherwise keep the port)."""
    with pdproxy_serve(tmp_path, "--edge", "granian") as proxy:
        workers = child_pids(proxy.proc.pid)
        assert workers, "granian runs its worker as a child process"
        os.kill(proxy.proc.pid, signal.SIGKILL)
        proxy.proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphans = [w for w in workers if _alive(w)]
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        assert not orphans, "the worker kept serving after its main process died"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
