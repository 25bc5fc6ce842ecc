"""vLLM's prefill/decode disaggregation through pdproxy (`--pd-protocol vllm`), on two real vLLM
servers with NixlConnector over UCX on the CPUs: the prefill server a KV producer, the decode
server a consumer. The KV cache really moves: the decode server counts the prompt tokens it
received in ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import aiohttp
import pytest

from conftest import BLOCK_TOKENS, MAX_MODEL_LEN, MODEL, VllmServer, metric, start_vllm, wait_ready
from servers import Process, eventually, free_port, pdproxy_serve

CHAT = "/v1/chat/completions"
EXTERNAL = "external_kv_transfer"


def kv_transfer(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A prefill server (KV producer) and a decode server (KV consumer), each with its own NIXL
    side channel, one core each."""
    log_dir = tmp_path_factory.mktemp("vllm-pd")
    servers = []
    for core, role in ((0, "kv_producer"), (1, "kv_consumer")):
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        servers.append(start_vllm(log_dir, core, "--kv-transfer-config", kv_transfer(role), env=env))
    try:
        for server in servers:
            wait_ready(server)
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def proxy(pd_pair: tuple[VllmServer, VllmServer], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    prefill, decode = pd_pair
    with pdproxy_serve(
        tmp_path_factory.mktemp("pd-proxy"),
        *("--serving-strategy", "DistServe", "--pd-protocol", "vllm"),
        *("--node", f"{prefill.url},role=prefill", "--node", f"{decode.url},role=decode"),
    ) as process:
        yield process


@pytest.fixture
async def ready(http: aiohttp.ClientSession, proxy: Process) -> Process:
    async def both() -> bool:
        async with http.get(proxy.url + "/nodes/status") as r:
            nodes = (await r.json()).values()
        return len(nodes) == 2 and all(n["state"] == "healthy" and MODEL in n["models"] for n in nodes)

    await eventually(both, timeout=60, what="the prefill and decode servers routable")
    return proxy


def counter(server: VllmServer, name: str, **labels: str) -> float:
    return metric(server.metrics(), name, **labels)


def long_chat(tag: str, **extra: object) -> dict[str, object]:
    content = f"{tag} " + "prefill decode cache node " * 120  # several KV blocks
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


@pytest.mark.parametrize("stream", [False, True])
async def test_the_kv_cache_moves_from_prefill_to_decode(
    http: aiohttp.ClientSession, ready: Process, pd_pair: tuple[VllmServer, VllmServer], stream: bool
) -> None:
    prefill, decode = pd_pair
    received = counter(decode, "vllm:prompt_tokens_by_source_total", source=EXTERNAL)
    prefilled = counter(prefill, "vllm:request_success_total")
    async with http.post(ready.url + CHAT, json=long_chat(f"moves {stream}", stream=stream)) as r:
        assert r.status == 200, await r.text()
        text = await r.text()
    if stream:
        assert text.rstrip().endswith("data: [DONE]")
    else:
        assert json.loads(text)["usage"]["completion_tokens"] == 8
    moved = counter(decode, "vllm:prompt_tokens_by_source_total", source=EXTERNAL) - received
    assert moved >= BLOCK_TOKENS, f"the decode server received {moved:.0f} prompt tokens over NIXL"
    assert counter(prefill, "vllm:request_success_total") == prefilled + 1, "the prefill leg ran there"
    total = counter(decode, "vllm:prompt_tokens_by_source_total", source=EXTERNAL)

    async def reported() -> bool:
        async with http.get(ready.url + "/nodes/status") as r:
            engine = (await r.json())[decode.url]["engine"]
        return bool(engine["transferred_tokens"] == total)

    await eventually(reported, timeout=10, what="pdproxy's reading of the KV the decode server received")


async def test_a_failing_prefill_leg_answers_its_error_and_spares_the_decode(
    http: aiohttp.ClientSession, ready: Process, pd_pair: tuple[VllmServer, VllmServer]
) -> None:
    prefill, decode = pd_pair
    too_long = {"model": MODEL, "prompt": "token " * (MAX_MODEL_LEN + 64), "max_tokens": 4}
    async with http.post(prefill.url + "/v1/completions", json=too_long) as r:
        direct = (r.status, await r.json())
    decoded = counter(decode, "vllm:request_success_total")
    async with http.post(ready.url + "/v1/completions", json=too_long) as r:
        through = (r.status, await r.json())
    assert direct[0] == 400
    assert through == direct, "the prefill leg's own status and error"
    assert counter(decode, "vllm:request_success_total") == decoded


async def test_a_client_leaving_during_decode_stops_both_servers(
    http: aiohttp.ClientSession, ready: Process, pd_pair: tuple[VllmServer, VllmServer]
) -> None:
    prefill = pd_pair[0]
    body = long_chat("leaves", max_tokens=1500, ignore_eos=True, stream=True)
    async with http.post(ready.url + CHAT, json=body) as r:
        assert r.status == 200
        for _ in range(4):
            await r.content.readline()

    async def idle() -> bool:
        return all(counter(s, "vllm:num_requests_running") == 0 for s in pd_pair)

    async def released() -> bool:
        async with http.get(ready.url + "/nodes/status") as r:
            return all(n["in_flight"] == 0 for n in (await r.json()).values())

    # pdproxy lets go of both legs at once; when vLLM notices depends on how busy its CPU is
    # (see test_vllm.py: a direct client fares the same), so its tokens are not bounded here.
    await eventually(released, timeout=2, what="pdproxy to let go of both legs")
    await eventually(idle, timeout=30, what="both servers idle")
    assert counter(prefill, "vllm:kv_cache_usage_perc") < 0.05, "the prefill server holds no KV for it"
