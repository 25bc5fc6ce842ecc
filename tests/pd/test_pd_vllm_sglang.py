"""vLLM's and SGLang's disaggregation protocols end to end, against mock engines that check
what a real engine would silently accept."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdproxy.testing import FAULT_HEADER, MockEngine
from pdproxy.testing.generation import generate, prompt_text
from servers import Process, chat_body, eventually, ledger, pdproxy_serve, register

# One pipeline serves both edges: this suite runs against the Rust edge (test_proxy.py and the
# tests marked with the `edge` fixture cover the --edge granian transport).


@asynccontextmanager
async def pd_proxy(
    tmp_path: Path,
    protocol: str,
    http: aiohttp.ClientSession,
    engines: tuple[MockEngine, MockEngine],
    **prefill_extra: Any,
) -> AsyncIterator[Process]:
    """`pdproxy serve` speaking ``protocol``, the prefill and decode engines registered."""
    prefill, decode = engines
    async with pdproxy_serve(tmp_path, "--serving-strategy", "DistServe", "--pd-protocol", protocol) as proxy:
        await register(http, proxy.url, prefill, 2, **prefill_extra)
        await register(http, proxy.url, decode, 3)
        yield proxy


def text_of(raw: bytes, stream: bool, chat: bool = True) -> str:
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return str(choice["message"]["content"] if chat else choice["text"])
    chunks = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


# vLLM


@pytest.mark.usefixtures("edge")
async def test_vllm_passes_params_verbatim_on_one_request_id(
    tmp_path: Path, pd_engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = pd_engines
    async with pd_proxy(tmp_path, "vllm", http, pd_engines) as proxy:
        for stream in (False, True):
            body = chat_body(
                "m",
                stream=stream,
                max_tokens=7,
                min_tokens=2,
                max_completion_tokens=7,
                stream_options={"include_usage": True} if stream else None,
            )
            async with http.post(proxy.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                raw = await r.read()
            assert text_of(raw, stream) == "".join(generate(prompt_text(body), 7)[0])
            p_req, d_req = prefill.state.records[-1], decode.state.records[-1]
            assert p_req["headers"]["x-request-id"] == d_req["headers"]["x-request-id"]
            params = d_req["body"]["kv_transfer_params"]
            assert params["remote_request_id"].startswith("vllm-")
            assert set(params) >= {"remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "tp_size"}
            assert (d_req["body"]["max_tokens"], d_req["body"]["min_tokens"], d_req["body"]["stream"]) == (7, 2, stream)
        report = await ledger(http, prefill)
        assert report["shape_errors"] == []
        assert report["live"] == []
        assert set(report["freed"].values()) == {"decode"}, "every prefill KV was read and freed by decode"
        assert (await ledger(http, decode))["vllm_remote"] == 2


async def test_vllm_null_params_and_failures(
    tmp_path: Path, pd_engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = pd_engines
    async with pd_proxy(tmp_path, "vllm", http, pd_engines) as proxy:
        async with http.post(
            proxy.url + "/v1/completions",
            json={"model": "m", "prompt": "p", "max_tokens": 3},
            headers={FAULT_HEADER: "prefill.stop_first"},
        ) as r:
            assert r.status == 200, "a prefill that ended on its token still completes"
        assert (await ledger(http, decode))["local_prefills"] == 1
        decoded = len(decode.state.records)
        async with http.post(
            proxy.url + "/v1/chat/completions", json=chat_body("m"), headers={FAULT_HEADER: "prefill.status=500"}
        ) as r:
            assert r.status == 500
        assert len(decode.state.records) == decoded, "decode never runs after a failed prefill"
        async with http.post(
            proxy.url + "/v1/chat/completions",
            json=chat_body("m", stream=True, max_tokens=8),
            headers={FAULT_HEADER: "decode.drop_after=2"},
        ) as r:
            raw = await r.read()
        assert b'"error"' in raw.split(b"\n\n")[-2]
        assert (await ledger(http, prefill))["live"] == []


# SGLang


@pytest.mark.usefixtures("edge")
async def test_sglang_sends_one_body_to_both_legs_at_once(
    tmp_path: Path, pd_engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = pd_engines
    async with pd_proxy(tmp_path, "sglang", http, pd_engines) as proxy:
        rooms = set()
        for stream in (False, True, True):
            body = chat_body("m", stream=stream, max_tokens=5)
            # The prefill waits for the decode to join its room: sent one after the other, this would time out.
            async with http.post(proxy.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                raw = await r.read()
            assert text_of(raw, stream) == "".join(generate(prompt_text(body), 5)[0])
            p_body, d_body = prefill.state.records[-1]["body"], decode.state.records[-1]["body"]
            assert p_body == d_body, "both legs get the same body"
            assert (p_body["bootstrap_host"], p_body["bootstrap_port"]) == ("127.0.0.1", prefill.port)
            rooms.add(p_body["bootstrap_room"])
        assert len(rooms) == 3, "a fresh room for every request"
        report = (await ledger(http, prefill))["rendezvous"]
        assert (report["transferred"], report["reused_rooms"], report["timeouts"]) == (3, [], 0)


async def test_sglang_batch_and_declared_bootstrap_port(
    tmp_path: Path, pd_engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = pd_engines
    async with pd_proxy(tmp_path, "sglang", http, pd_engines, bootstrap_port=prefill.port) as proxy:
        body = {"model": "m", "prompt": ["a b", "c d", "e f"], "max_tokens": 2}
        async with http.post(proxy.url + "/v1/completions", json=body) as r:
            assert r.status == 200
        sent = prefill.state.records[-1]["body"]
        assert [len(sent[k]) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")] == [3, 3, 3]
        assert len(set(sent["bootstrap_room"])) == 3
        assert decode.state.records[-1]["body"] == sent


@pytest.mark.parametrize(
    ("fault", "status", "cancelled"),
    # The failure comes after 300 ms, so the other leg has surely reached its engine by then.
    [
        ("prefill.status=500;prefill.ttft_ms=300", 502, "decode"),
        ("decode.status=503;decode.ttft_ms=300", 503, "prefill"),
    ],
)
async def test_sglang_a_failed_leg_cancels_the_other(
    tmp_path: Path,
    pd_engines: tuple[MockEngine, MockEngine],
    http: aiohttp.ClientSession,
    fault: str,
    status: int,
    cancelled: str,
) -> None:
    prefill, decode = pd_engines
    async with pd_proxy(tmp_path, "sglang", http, pd_engines) as proxy:
        async with http.post(
            proxy.url + "/v1/chat/completions", json=chat_body("m"), headers={FAULT_HEADER: fault}
        ) as r:
            assert r.status == status
        other = decode if cancelled == "decode" else prefill

        async def other_gave_up() -> bool:
            return other.state.active == 0 and other.state.disconnected == 1

        # The other leg is cancelled, not left waiting out its bootstrap timeout.
        await eventually(other_gave_up, timeout=2.0)


async def test_vllm_decode_nodes_report_the_kv_they_received(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    # vLLM counts a decode node's KV read over its connector apart from its prefix-cache hits
    # (`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`): pdproxy shows it.
    async with (
        MockEngine(model="m", role="prefill", metrics_dialect="vllm") as prefill,
        MockEngine(model="m", role="decode", metrics_dialect="vllm") as decode,
    ):
        flags = ("--serving-strategy", "DistServe", "--pd-protocol", "vllm", "--engine-metrics-interval", "0.2")
        async with pdproxy_serve(tmp_path, *flags) as proxy:
            await register(http, proxy.url, prefill, 2)
            await register(http, proxy.url, decode, 3)
            async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m", max_tokens=4)) as r:
                assert r.status == 200
            async with http.get(decode.url + "/metrics") as r:
                text = await r.text()
            sent = re.search(r'vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"\} (\S+)', text)
            assert sent is not None
            assert float(sent.group(1)) > 0

            async def reported() -> bool:
                async with http.get(proxy.url + "/nodes/status") as r:
                    engine = (await r.json())[decode.url]["engine"]
                return bool(engine["transferred_tokens"] == int(float(sent.group(1))))

            await eventually(reported)
            async with http.get(proxy.url + "/metrics") as r:
                exposed = await r.text()
            assert f'pdproxy_engine_transferred_tokens{{node="{decode.url}"}} {float(sent.group(1))}' in exposed
