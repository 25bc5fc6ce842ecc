"""DistServe (LMDeploy's protocol) end to end: `pdproxy serve --serving-strategy DistServe` as a
subprocess, prefill and decode mock engines in the test's loop. After every test the engines'
ledgers must show no live preserved session, no double or unknown free, no refused migration,
no malformed prefill or decode request, and the proxy no request in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdproxy.testing import FAULT_HEADER, MockEngine, MockSettings
from pdproxy.testing.generation import generate, prompt_text
from servers import Process, chat_body, eventually, ledger, pdproxy_serve, register

# One pipeline serves both edges: this suite runs against the Rust edge (test_proxy.py and the
# tests marked with the `edge` fixture cover the --edge granian transport).

PD_ARGS = ("--serving-strategy", "DistServe", "--pd-link-backoff", "0.05", "--pd-link-wait-timeout", "5")


@dataclass
class Fleet:
    proxy: Process
    prefill: MockEngine
    decode: MockEngine


@contextmanager
def distserve_proxy(tmp_path: Path, *args: str) -> Iterator[Process]:
    with pdproxy_serve(tmp_path, *PD_ARGS, *args) as process:
        yield process


async def settle(http: aiohttp.ClientSession, engines: list[MockEngine], proxy: str, timeout: float = 5.0) -> None:
    """Waits until nothing is preserved or in flight any more."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        live = [s for e in engines for s in (await ledger(http, e))["live"]]
        async with http.get(proxy + "/nodes/status") as r:
            in_flight = sum(n["unfinished"] for n in (await r.json()).values())
        if not live and not in_flight:
            return
        assert asyncio.get_running_loop().time() < deadline, f"live sessions {live}, in flight {in_flight}"
        await asyncio.sleep(0.05)


async def assert_clean(http: aiohttp.ClientSession, *engines: MockEngine, migration_errors: int = 0) -> None:
    errors = 0
    for engine in engines:
        report = await ledger(http, engine)
        assert report["double_frees"] == [], engine.settings.role
        assert report["unknown_frees"] == [], engine.settings.role
        assert report["shape_errors"] == [], report["shape_errors"]
        errors += len(report["migration_errors"])
    assert errors == migration_errors


@pytest.fixture
async def fleet(
    tmp_path: Path, pd_engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> AsyncIterator[Fleet]:
    prefill, decode = pd_engines
    with distserve_proxy(tmp_path) as proxy:
        await register(http, proxy.url, prefill, 2)
        await register(http, proxy.url, decode, 3)
        yield Fleet(proxy, prefill, decode)
        await settle(http, [prefill, decode], proxy.url)


def expected_text(body: dict[str, Any]) -> str:
    return "".join(generate(prompt_text(body), body.get("max_tokens"))[0])


def handshakes(report: dict[str, Any]) -> list[str]:
    return [op for op, _, _ in report["links"] if op != "engine_info"]


@pytest.mark.usefixtures("edge")
async def test_stream_and_non_stream(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    for stream in (False, True):
        body = chat_body("m", stream=stream, max_tokens=6, prompt=f"tell me {stream}")
        async with http.post(fleet.proxy.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            raw = await r.read()
        if stream:
            events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in events if c["choices"])
            assert raw.endswith(b"data: [DONE]\n\n")
        else:
            text = json.loads(raw)["choices"][0]["message"]["content"]
        assert text == expected_text(body), "decode continued exactly from prefill's token"
    completion = {"model": "m", "prompt": "once", "max_tokens": 3}
    async with http.post(fleet.proxy.url + "/v1/completions", json=completion) as r:
        assert r.status == 200
        assert json.loads(await r.read())["choices"][0]["text"] == expected_text(completion)
    await settle(http, [fleet.prefill, fleet.decode], fleet.proxy.url)
    report = await ledger(http, fleet.prefill)
    assert set(report["freed"].values()) == {"decode"}, "every session was consumed by decode"
    assert len(report["freed"]) == 3
    await assert_clean(http, fleet.prefill, fleet.decode)
    # One handshake for the pair, in LMDeploy's order.
    p_log, d_log = (await ledger(http, fleet.prefill))["links"], (await ledger(http, fleet.decode))["links"]
    merged = sorted([("P", op, t) for op, _, t in p_log] + [("D", op, t) for op, _, t in d_log], key=lambda x: x[2])
    assert [(who, op) for who, op, _ in merged] == [
        ("P", "engine_info"),
        ("D", "engine_info"),
        ("P", "p2p_initialize"),
        ("D", "p2p_initialize"),
        ("P", "p2p_connect"),
        ("D", "p2p_connect"),
    ]
    assert {peer for _, peer, _ in p_log if peer} == {fleet.decode.url}


@pytest.mark.parametrize(
    ("args", "transport", "protocol"),
    [
        ((), {"protocol": "RDMA", "rdma": {"with_gdr": True, "link_type": "RoCE"}, "nvlink": None}, 2),
        (
            ("--link-type", "IB", "--disable-gdr"),
            {"protocol": "RDMA", "rdma": {"with_gdr": False, "link_type": "IB"}, "nvlink": None},
            2,
        ),
        (
            ("--migration-protocol", "NVLINK"),
            {"protocol": "NVLINK", "rdma": {"with_gdr": True, "link_type": "RoCE"}, "nvlink": None},
            3,
        ),
    ],
)
async def test_transport_options_reach_the_handshake_and_the_migration(
    tmp_path: Path,
    pd_engines: tuple[MockEngine, MockEngine],
    http: aiohttp.ClientSession,
    args: tuple[str, ...],
    transport: dict[str, Any],
    protocol: int,
) -> None:
    """LMDeploy's --migration-protocol, --link-type and --disable-gdr, as its proxy sends them
    (an NVLINK link still carries LMDeploy's rdma_config)."""
    prefill, decode = pd_engines
    with distserve_proxy(tmp_path, *args) as proxy:
        await register(http, proxy.url, prefill, 2)
        await register(http, proxy.url, decode, 3)
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m", max_tokens=3)) as r:
            assert r.status == 200, await r.text()
        assert (await ledger(http, prefill))["transport"] == {decode.url: transport}
        assert (await ledger(http, decode))["transport"] == {prefill.url: transport}
        assert decode.state.records[-1]["body"]["migration_request"]["protocol"] == protocol
        await settle(http, [prefill, decode], proxy.url)
        await assert_clean(http, prefill, decode)


async def test_prefill_request_shape(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    body = chat_body("m", stream=True, max_tokens=9, stream_options={"include_usage": True})
    async with http.post(fleet.proxy.url + "/v1/chat/completions", json=body) as r:
        await r.read()
    prefill_request = fleet.prefill.state.records[-1]["body"]
    assert (prefill_request["max_tokens"], prefill_request["max_completion_tokens"]) == (1, 1)
    assert prefill_request["stream"] is False
    assert "stream_options" not in prefill_request
    decode_request = fleet.decode.state.records[-1]["body"]
    assert (decode_request["max_tokens"], decode_request["stream"]) == (9, True)
    assert decode_request["migration_request"]["remote_engine_id"] == fleet.prefill.url
    assert decode_request["migration_request"]["protocol"] == 2
    await settle(http, [fleet.prefill, fleet.decode], fleet.proxy.url)
    await assert_clean(http, fleet.prefill, fleet.decode)


@pytest.mark.parametrize(
    ("fault", "status"),
    [("prefill.status=500", 500), ("prefill.no_id", 502), ("decode.status=503", 503), ("decode.status=400", 400)],
)
async def test_leg_failures_answer_truthfully_and_free(
    fleet: Fleet, http: aiohttp.ClientSession, fault: str, status: int
) -> None:
    async with http.post(
        fleet.proxy.url + "/v1/chat/completions", json=chat_body("m", stream=True), headers={FAULT_HEADER: fault}
    ) as r:
        assert r.status == status, await r.text()
    await settle(http, [fleet.decode] + ([] if fault == "prefill.no_id" else [fleet.prefill]), fleet.proxy.url)
    report = await ledger(http, fleet.prefill)
    if fault.startswith("decode"):
        assert list(report["freed"].values()) == ["proxy"], "decode never ran: pdproxy freed the session"
    if fault == "prefill.no_id":
        # The session cannot be named, so nothing is freed blindly; the engine keeps it.
        assert len(report["live"]) == 1
        fleet.prefill.state.ledger.free(report["live"][0], "test")
    await assert_clean(http, fleet.prefill, fleet.decode)


async def test_decode_dropping_mid_stream(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    async with http.post(
        fleet.proxy.url + "/v1/chat/completions",
        json=chat_body("m", stream=True, max_tokens=8),
        headers={FAULT_HEADER: "decode.drop_after=2"},
    ) as r:
        assert r.status == 200
        raw = await r.read()
    assert b'"error"' in raw.split(b"\n\n")[-2]
    await settle(http, [fleet.prefill, fleet.decode], fleet.proxy.url)
    assert list((await ledger(http, fleet.prefill))["freed"].values()) == ["decode"]
    await assert_clean(http, fleet.prefill, fleet.decode)


@pytest.mark.parametrize("id_format", ["cache_session_id", "chat", "completions"])
async def test_session_handle_formats(tmp_path: Path, http: aiohttp.ClientSession, id_format: str) -> None:
    async with (
        MockEngine(MockSettings(port=0, model="m", role="prefill", id_format=id_format)) as prefill,
        MockEngine(MockSettings(port=0, model="m", role="decode")) as decode,
    ):
        with distserve_proxy(tmp_path) as proxy:
            await register(http, proxy.url, prefill, 2)
            await register(http, proxy.url, decode, 3)
            async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
                if id_format == "cache_session_id":
                    assert r.status == 200
                else:
                    # chatcmpl-... or "-1": no usable handle; refused cleanly, not guessed.
                    assert r.status == 502
                    assert (await r.json())["error"]["code"] == "upstream_invalid_response"
            report = await ledger(http, prefill)
            assert report["unknown_frees"] == []
            for session in report["live"]:
                prefill.state.ledger.free(session, "test")
            await settle(http, [prefill, decode], proxy.url)
            await assert_clean(http, prefill, decode)


@pytest.mark.parametrize("breakage", ["engine_info", "tp_size"])
async def test_handshake_failure_frees_the_session(tmp_path: Path, http: aiohttp.ClientSession, breakage: str) -> None:
    tp = 2 if breakage == "tp_size" else 1
    async with (
        MockEngine(MockSettings(port=0, model="m", role="prefill", tp_size=tp)) as prefill,
        MockEngine(MockSettings(port=0, model="m", role="decode")) as decode,
    ):
        if breakage == "engine_info":
            async with http.post(decode.url + "/mock/config", json={"engine_info_status": 500}) as r:
                assert r.status == 200
        with distserve_proxy(tmp_path) as proxy:
            await register(http, proxy.url, prefill, 2)
            await register(http, proxy.url, decode, 3)
            async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
                assert r.status == 502
                assert (await r.json())["error"]["code"] == "pd_link_failed"
            await settle(http, [prefill, decode], proxy.url)
            assert list((await ledger(http, prefill))["freed"].values()) == ["proxy"]
            async with http.get(proxy.url + "/distserve/status") as r:
                payload = await r.json()
                assert r.status == 200, payload
                (link,) = payload["links"]
            assert link["state"] == "failed"
            assert link["attempts"] == 3
            await assert_clean(http, prefill, decode)


async def _raw_request(
    proxy: str, body: dict[str, Any], fault: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = proxy.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"{FAULT_HEADER}: {fault}\r\ncontent-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return reader, writer


@pytest.mark.usefixtures("edge")
@pytest.mark.parametrize("phase", ["prefill", "before-first-token", "mid-stream"])
async def test_client_disconnect_in_each_phase(fleet: Fleet, http: aiohttp.ClientSession, phase: str) -> None:
    fault = {
        "prefill": "prefill.ttft_ms=400",
        "before-first-token": "decode.ttft_ms=600",
        "mid-stream": "decode.token_delay_ms=150",
    }[phase]
    reader, writer = await _raw_request(fleet.proxy.url, chat_body("m", stream=True, max_tokens=20), fault)
    if phase == "mid-stream":
        seen = b""
        while seen.count(b"data: ") < 2:
            seen += await asyncio.wait_for(reader.read(65536), 5)
    else:  # the engine of that phase has the request (for 400 or 600 ms)
        working = fleet.prefill if phase == "prefill" else fleet.decode
        await eventually(lambda: working.state.active > 0, f"the request in its {phase} phase")
    writer.close()
    await writer.wait_closed()
    await settle(http, [fleet.prefill, fleet.decode], fleet.proxy.url)
    freed = list((await ledger(http, fleet.prefill))["freed"].values())
    assert freed == {"prefill": [], "before-first-token": ["proxy"], "mid-stream": ["decode"]}[phase]
    await assert_clean(http, fleet.prefill, fleet.decode)


async def test_concurrent_first_requests_share_one_handshake(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    async def one(i: int) -> int:
        async with http.post(fleet.proxy.url + "/v1/chat/completions", json=chat_body("m", prompt=f"q{i}")) as r:
            await r.read()
            return r.status

    assert await asyncio.gather(*(one(i) for i in range(12))) == [200] * 12
    assert handshakes(await ledger(http, fleet.prefill)) == ["p2p_initialize", "p2p_connect"]
    assert handshakes(await ledger(http, fleet.decode)) == ["p2p_initialize", "p2p_connect"]
    await settle(http, [fleet.prefill, fleet.decode], fleet.proxy.url)
    await assert_clean(http, fleet.prefill, fleet.decode)


async def test_warmup_is_idempotent_and_removal_drops_links(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    async def warmup() -> dict[str, Any]:
        async with http.post(fleet.proxy.url + "/distserve/connection_warmup") as r:
            assert r.status == 200
            return dict(await r.json())

    results = await asyncio.gather(*(warmup() for _ in range(5)))
    assert all(r["connected"] == 1 for r in results)
    assert handshakes(await ledger(http, fleet.prefill)) == ["p2p_initialize", "p2p_connect"]
    async with http.get(fleet.proxy.url + "/nodes/status") as r:
        links = (await r.json())[fleet.decode.url]["links"]
    assert [link["state"] for link in links] == ["connected"]

    async with http.post(fleet.proxy.url + "/nodes/remove", json={"url": fleet.decode.url}) as r:
        assert r.status == 200
    for engine in (fleet.prefill, fleet.decode):
        for _ in range(100):
            if handshakes(await ledger(http, engine))[-1:] == ["p2p_drop_connect"]:
                break
            await asyncio.sleep(0.02)
        assert handshakes(await ledger(http, engine))[-1] == "p2p_drop_connect", engine.settings.role
    # Re-added: a fresh handshake before the next request.
    await register(http, fleet.proxy.url, fleet.decode, 3)
    async with http.post(fleet.proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
        assert r.status == 200
    assert handshakes(await ledger(http, fleet.decode)).count("p2p_connect") == 2


async def test_n_above_one_and_readiness(
    tmp_path: Path, pd_engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = pd_engines
    with distserve_proxy(tmp_path) as proxy:
        await register(http, proxy.url, prefill, 2)
        async with http.get(proxy.url + "/ready") as r:
            assert r.status == 503, "no decode node yet"
        await register(http, proxy.url, decode, 3)
        async with http.get(proxy.url + "/ready") as r:
            assert r.status == 200
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m", n=2)) as r:
            assert r.status == 400


async def test_dummy_prefill(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with MockEngine(MockSettings(port=0, model="m", role="decode")) as decode:
        with distserve_proxy(tmp_path, "--dummy-prefill") as proxy:
            await register(http, proxy.url, decode, 3)
            async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m", stream=True)) as r:
                assert r.status == 200
                await r.read()
            migration = decode.state.records[-1]["body"]["migration_request"]
            assert (migration["is_dummy_prefill"], migration["remote_engine_id"]) == (True, "dummy:dummy")
            await assert_clean(http, decode)


async def test_node_removed_mid_request(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    # The prefill is slow; its node is removed while it runs, so the pair's link goes with it.
    request = asyncio.ensure_future(
        http.post(
            fleet.proxy.url + "/v1/chat/completions", json=chat_body("m"), headers={FAULT_HEADER: "prefill.ttft_ms=400"}
        )
    )
    await eventually(lambda: fleet.prefill.state.active > 0, "the prefill at work")
    async with http.post(fleet.proxy.url + "/nodes/remove", json={"url": fleet.prefill.url}) as r:
        assert r.status == 200
    async with await request as r:
        assert r.status in (500, 502), "the request fails cleanly, never with a 200 hiding an error"
        await r.read()

    # Whatever the prefill preserved was freed, not leaked.
    async def freed() -> bool:
        return not (await ledger(http, fleet.prefill))["live"]

    await eventually(freed, "the preserved sessions freed (one leaked)", timeout=5)
    await assert_clean(
        http, fleet.prefill, fleet.decode, migration_errors=len((await ledger(http, fleet.decode))["migration_errors"])
    )


async def distserve_status(http: aiohttp.ClientSession, proxy: str) -> dict[str, Any]:
    async with http.get(proxy + "/distserve/status") as r:
        return dict((await r.json())["ledger"])


async def test_removing_a_prefill_node_frees_the_sessions_preserved_on_it(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    """The decode has not taken the session yet (it hangs) when its prefill node is removed: the
    session is freed on that node now, not forgotten while the engine keeps its KV blocks."""
    request = asyncio.ensure_future(
        http.post(fleet.proxy.url + "/v1/chat/completions", json=chat_body("m"), headers={FAULT_HEADER: "decode.hang"})
    )
    await eventually(lambda: _live(http, fleet.prefill, 1), "the prefill to preserve a session")
    async with http.post(fleet.proxy.url + "/nodes/remove", json={"url": fleet.prefill.url}) as r:
        assert r.status == 200
    await eventually(lambda: _live(http, fleet.prefill, 0), "the removed node's session to be freed")
    assert not request.done(), "freed while the request still waits for its decode"
    assert set((await ledger(http, fleet.prefill))["freed"].values()) == {"proxy"}
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request
    await eventually(lambda: _ledger_count(http, fleet.proxy.url, "preserved", 0), "the proxy's ledger to empty")
    assert (await distserve_status(http, fleet.proxy.url))["free_failures"] == 0
    assert (await ledger(http, fleet.prefill))["double_frees"] == []


async def test_sessions_of_an_unreachable_removed_node_are_left_to_the_ttl_sweep(
    tmp_path: Path, pd_engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = pd_engines
    with distserve_proxy(tmp_path, "--pd-session-ttl", "4") as proxy:
        await register(http, proxy.url, prefill, 2)
        await register(http, proxy.url, decode, 3)
        request = asyncio.ensure_future(
            http.post(proxy.url + "/v1/chat/completions", json=chat_body("m"), headers={FAULT_HEADER: "decode.hang"})
        )
        await eventually(lambda: _live(http, prefill, 1), "the prefill to preserve a session")
        await prefill.stop()  # gone: its session cannot be freed now
        async with http.post(proxy.url + "/nodes/remove", json={"url": prefill.url}) as r:
            assert r.status == 200
        # The removal's attempts to free it are over (3 tries, 0.7 s of backoff): it says so.
        await eventually(lambda: "not freed yet" in proxy.log(), "the removal to give the session up")
        kept = await distserve_status(http, proxy.url)
        assert (kept["preserved"], kept["free_failures"]) == (1, 0), "kept for the sweep, not forgotten"
        await eventually(
            lambda: _ledger_count(http, proxy.url, "free_failures", 1), "the TTL sweep to try again", timeout=10
        )
        assert (await distserve_status(http, proxy.url))["preserved"] == 0
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request


async def _live(http: aiohttp.ClientSession, engine: MockEngine, count: int) -> bool:
    return len((await ledger(http, engine))["live"]) == count


async def _ledger_count(http: aiohttp.ClientSession, proxy: str, name: str, count: int) -> bool:
    return bool((await distserve_status(http, proxy))[name] == count)


def test_engine_info_accepts_both_encodings() -> None:
    from pdproxy.pd.links import parse_engine_info

    info = {"tp_size": 2, "block_size": 64}
    assert parse_engine_info(json.dumps(info)) == info  # LMDeploy's double encoding, once decoded by aiohttp
    assert parse_engine_info(info) == info
    with pytest.raises(ValueError, match="tp_size"):
        parse_engine_info("[1]")
