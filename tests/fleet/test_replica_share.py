"""Replicas telling each other their load on the nodes (``--replica-listen``, ``--replica-peer``):
two `pdproxy serve` processes, each the other's peer over real UDP sockets, in front of two
simulated engines with slow prefill. A request one replica holds unanswered shows in the other's
``/nodes/status``, and steers the other's new prompts away from that engine."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from pdproxy.testing.mock_engine import MockEngine
from pdproxy.testing.ports import free_udp_port
from servers import Process, eventually, pdproxy_serve

pytestmark = pytest.mark.slow

MODEL = "share-model"
#: Simulated engines whose prefill is slow: 1.7 ms a token (4 bytes), so the long prompt below
#: (about 3,000 tokens) waits about 5 s for its first token. Long, so that pdproxy's price for its
#: prefill (before any speed is learnt, about 300 ms) still runs when a busy machine reads it.
ENGINE = {"model": MODEL, "simulate": True, "prefill_ms_per_token": 1.7, "decode_step_ms": 1.0}
LONG_PROMPT = "a long document to read. " * 480
#: How long what a peer says takes to show: a few intervals of 20 ms, on a busy machine.
SHOWS_WITHIN = 10.0


@dataclass
class Pair:
    engines: list[MockEngine]
    a: Process
    b: Process
    #: Where replica B listens for its peers' datagrams.
    b_listen: tuple[str, int]
    http: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def replicas(tmp_path: Any) -> AsyncIterator[Pair]:
    """Replicas A and B, each the other's peer, in front of two simulated engines, once each
    sees the other live."""
    a_port, b_port = free_udp_port(), free_udp_port()
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(MockEngine(**ENGINE)) for _ in range(2)]
        nodes = [arg for e in engines for arg in ("--node", e.url)]
        common = (*nodes, "--policy", "scored", "--replica-share-interval-ms", "20")

        def replica(mine: int, peer: int) -> Any:
            listen, other = f"127.0.0.1:{mine}", f"127.0.0.1:{peer}"
            return pdproxy_serve(tmp_path, *common, "--replica-listen", listen, "--replica-peer", other)

        a = await stack.enter_async_context(replica(a_port, b_port))
        b = await stack.enter_async_context(replica(b_port, a_port))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        pair = Pair(engines, a, b, ("127.0.0.1", b_port), http)
        for proxy in (a, b):
            await eventually(lambda p=proxy: _peers_live(pair, p, 1), "each replica to hear the other")
        yield pair


async def status(pair: Pair, proxy: Process) -> dict[str, Any]:
    async with pair.http.get(proxy.url + "/nodes/status") as r:
        assert r.status == 200, await r.text()
        nodes: dict[str, Any] = await r.json()
        return nodes


async def _peers_live(pair: Pair, proxy: Process, live: int) -> bool:
    rows = (await status(pair, proxy)).values()
    return all(row["replicas"] is not None and row["replicas"]["peers"] == live for row in rows)


async def peer_unanswered(pair: Pair, proxy: Process) -> dict[str, int]:
    return {url: row["replicas"]["peer_unanswered"] for url, row in (await status(pair, proxy)).items()}


async def datagrams(pair: Pair, proxy: Process, direction: str) -> float:
    async with pair.http.get(proxy.url + "/metrics") as r:
        text = await r.text()
    found = re.search(rf'^pdproxy_replica_share_datagrams_total{{direction="{direction}"}} (\S+)$', text, re.M)
    assert found is not None, text
    return float(found[1])


def chat(text: str, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2, "stream": stream}


@contextlib.asynccontextmanager
async def held_through(pair: Pair, proxy: Process) -> AsyncIterator[tuple[str, asyncio.Task[bytes]]]:
    """A streamed request with the long prompt through ``proxy``, still waiting for its first
    token: yields the node it went to (as ``proxy`` counts it in flight) and the task reading its
    answer to the end."""

    async def read() -> bytes:
        async with pair.http.post(proxy.url + "/v1/chat/completions", json=chat(LONG_PROMPT, stream=True)) as r:
            assert r.status == 200, await r.text()
            return await r.read()

    answer = asyncio.create_task(read())
    try:
        busy: list[str] = []

        async def sent() -> bool:
            busy[:] = [url for url, row in (await status(pair, proxy)).items() if row["in_flight"] == 1]
            return len(busy) == 1

        await eventually(sent, "the long prompt to reach a node")
        yield busy[0], answer
    finally:
        if not answer.done():
            answer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await answer


async def test_a_request_held_through_one_replica_shows_in_the_other(tmp_path: Any) -> None:
    async with replicas(tmp_path) as pair:
        assert set((await peer_unanswered(pair, pair.b)).values()) == {0}
        async with held_through(pair, pair.a) as (node, answer):

            async def shown() -> bool:
                return await peer_unanswered(pair, pair.b) == {e.url: int(e.url == node) for e in pair.engines}

            async def prefill_shown() -> bool:
                return bool((await status(pair, pair.b))[node]["replicas"]["peer_prefill_ms_left"] > 0)

            await eventually(shown, "B to count A's unanswered request on its node", timeout=SHOWS_WITHIN)
            # The prefill A prices there (about 300 ms, its speed not learnt yet) shows too.
            await eventually(prefill_shown, "B to show the prefill A owes there", timeout=SHOWS_WITHIN)
            row = (await status(pair, pair.b))[node]
            assert not answer.done(), "the prefill still runs: what B shows is A's request waiting"
            assert row["replicas"]["peer_in_flight"] == 1, row["replicas"]
            assert row["in_flight"] == 0, "B sent nothing there itself"
            # A counts only its own: what it hears from B (nothing) adds nothing.
            assert set((await peer_unanswered(pair, pair.a)).values()) == {0}
            body = await asyncio.wait_for(answer, 30)
            assert b"[DONE]" in body

            async def cleared() -> bool:
                return set((await peer_unanswered(pair, pair.b)).values()) == {0}

            await eventually(cleared, "B to see A's request answered", timeout=SHOWS_WITHIN)


async def test_a_replica_sends_new_prompts_away_from_an_engine_busy_with_the_others(tmp_path: Any) -> None:
    async with replicas(tmp_path) as pair, held_through(pair, pair.a) as (busy, answer):
        await eventually(lambda: _b_counts(pair, busy), "B to count A's request on its node", timeout=SHOWS_WITHIN)
        # Fresh prompts through B, one after the other: alone, B would send them to each node in
        # turn (both look idle to it, and it breaks ties toward the one sent fewer).
        for i in range(4):
            body = chat(f"question {i}: " + f"fresh words {i} " * 8, stream=False)
            async with pair.http.post(pair.b.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
        sent = {url: row["requests"] for url, row in (await status(pair, pair.b)).items()}
        assert sent[busy] == 0, f"B sent {sent[busy]} of 4 fresh prompts to the engine busy with A's: {sent}"
        assert sum(sent.values()) == 4, sent
        assert not answer.done(), "A's long prefill was pending all along"


async def _b_counts(pair: Pair, node: str) -> bool:
    return (await peer_unanswered(pair, pair.b))[node] == 1


async def test_a_garbage_datagram_is_counted_and_changes_nothing(tmp_path: Any) -> None:
    async with replicas(tmp_path) as pair:
        before = await datagrams(pair, pair.b, "malformed")
        assert await datagrams(pair, pair.b, "received") > 0
        assert await datagrams(pair, pair.b, "sent") > 0
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"GET / HTTP/1.1\r\n\r\n", pair.b_listen)
            # The right magic and version, but part 0 of no parts.
            sender.sendto(b"pdr\x01" + bytes(30), pair.b_listen)

        async def counted() -> bool:
            return await datagrams(pair, pair.b, "malformed") == before + 2

        await eventually(counted, "B to count both datagrams as malformed")
        assert set((await peer_unanswered(pair, pair.b)).values()) == {0}
        assert await _peers_live(pair, pair.b, 1), "still one peer: A, and no other"
        async with pair.http.get(pair.b.url + "/metrics") as r:
            assert "pdproxy_replica_share_peers_live 1.0" in await r.text()
