"""The SGLang gateway's and vllm-router's worker routes, called as their docs show: the same
node table as /nodes/*, behind the admin keys; their probes open as /health is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from pdproxy.testing import MockEngine
from servers import chat_body, eventually, pdproxy_serve

pytestmark = pytest.mark.usefixtures("edge")


@pytest.fixture
async def engines() -> AsyncIterator[tuple[MockEngine, MockEngine]]:
    async with MockEngine(model="m") as a, MockEngine(model="m") as b:
        yield a, b


async def nodes(http: aiohttp.ClientSession, url: str) -> set[str]:
    async with http.get(url + "/nodes/status") as r:
        return set(await r.json())


async def test_add_list_loads_and_remove_workers(
    tmp_path: Path, engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    a, b = engines
    async with pdproxy_serve(tmp_path, "--node", a.url) as proxy:
        async with http.post(proxy.url + "/add_worker", params={"url": b.url}) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/plain")
            assert await r.text() == f"Successfully added worker: {b.url}"
        assert await nodes(http, proxy.url) == {a.url, b.url}, "the same table as /nodes/*"
        async with http.get(proxy.url + "/list_workers") as r:
            assert r.status == 200
            assert sorted((await r.json())["urls"]) == sorted([a.url, b.url])
        async with http.get(proxy.url + "/get_loads") as r:
            loads = (await r.json())["workers"]
        assert sorted(w["worker"] for w in loads) == sorted([a.url, b.url])
        assert all(w["load"] == 0 for w in loads)
        async with http.post(proxy.url + "/remove_worker", params={"url": a.url}) as r:
            assert r.status == 200
            assert await r.text() == f"Successfully removed worker: {a.url}"
        assert await nodes(http, proxy.url) == {b.url}
        await eventually(lambda: serves(http, proxy.url), what="the added worker's models")
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
            assert r.status == 200, "the worker added through /add_worker serves"


async def serves(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(url + "/v1/models") as r:
        return r.status == 200 and "m" in {m["id"] for m in (await r.json())["data"]}


async def test_bad_worker_calls_get_clear_errors(
    tmp_path: Path, engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    async with pdproxy_serve(tmp_path) as proxy:
        async with http.post(proxy.url + "/add_worker") as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "url"
        async with http.post(proxy.url + "/add_worker", params={"url": "ftp://x:1"}) as r:
            assert r.status == 400
        async with http.post(proxy.url + "/remove_worker", params={"url": "http://127.0.0.1:9"}) as r:
            assert r.status == 404
        async with http.get(proxy.url + "/add_worker") as r:
            assert r.status == 405


async def test_flush_cache_reaches_every_node_with_each_result(
    tmp_path: Path, engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    a, b = engines
    async with pdproxy_serve(tmp_path, "--node", a.url, "--node", b.url) as proxy:
        async with http.post(proxy.url + "/flush_cache") as r:
            assert r.status == 200
            answer = await r.json()
        assert answer == {"results": {a.url: {"status": 200}, b.url: {"status": 200}}, "failed": []}
        for engine in engines:
            async with http.get(engine.url + "/mock/stats") as r:
                assert (await r.json())["flushes"] == 1
        # What the policies learnt each node holds went with its cache.
        async with http.get(proxy.url + "/nodes/status") as r:
            status = await r.json()
        assert [status[url]["engine"]["flushes"] for url in (a.url, b.url)] == [1, 1]
        await b.stop()
        async with http.post(proxy.url + "/flush_cache") as r:
            assert r.status == 502
            answer = await r.json()
        assert answer["failed"] == [b.url]
        assert "could not be reached" in answer["results"][b.url]["error"]


async def test_the_worker_routes_keep_the_admin_keys_and_the_probes_stay_open(
    tmp_path: Path, engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    a, b = engines
    keys = tmp_path / "admin-keys"
    keys.write_text("admin-secret\n")
    async with pdproxy_serve(tmp_path, "--node", a.url, "--admin-keys-file", str(keys)) as proxy:
        async with http.post(proxy.url + "/add_worker", params={"url": b.url}) as r:
            assert r.status == 401
        async with http.get(proxy.url + "/list_workers") as r:
            assert r.status == 401
        admin = {"authorization": "Bearer admin-secret"}
        async with http.post(proxy.url + "/add_worker", params={"url": b.url}, headers=admin) as r:
            assert r.status == 200
        async with http.get(proxy.url + "/liveness") as r:
            assert (r.status, await r.text()) == (200, "OK")
        await eventually(lambda: ready(http, proxy.url), what="a healthy worker")
        async with http.get(proxy.url + "/readiness") as r:
            body = await r.json()
        assert body["status"] == "ready"
        assert body["total_workers"] == 2


async def ready(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(url + "/readiness") as r:
        return r.status == 200


async def test_readiness_without_a_healthy_worker_is_503(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with pdproxy_serve(tmp_path) as proxy:
        async with http.get(proxy.url + "/readiness") as r:
            assert r.status == 503
            body = await r.json()
        assert body == {"status": "not_ready", "reason": "no healthy workers available", "total_workers": 0}


async def test_health_generate_asks_a_healthy_node_to_generate(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    # SGLang's engine answers its own /health_generate; vLLM's has none and gets one token.
    async with MockEngine(model="m", metrics_dialect="sglang") as sglang, MockEngine(model="m") as vllm:
        for engine, generated in ((sglang, 0), (vllm, 1)):
            async with pdproxy_serve(tmp_path, "--node", engine.url) as proxy:
                await eventually(lambda: ready(http, proxy.url), what="a healthy node")
                async with http.get(proxy.url + "/health_generate") as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["status"] == "ok"
                async with http.get(engine.url + "/mock/requests") as r:
                    completions = [c for c in await r.json() if c["path"] == "/v1/completions"]
                assert len(completions) == generated
                if completions:
                    assert completions[0]["body"]["max_tokens"] == 1


async def test_health_generate_is_503_when_no_node_can_generate(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with pdproxy_serve(tmp_path) as proxy, http.get(proxy.url + "/health_generate") as r:
        assert r.status == 503
        assert "no healthy node" in (await r.json())["error"]["message"]
    async with (
        MockEngine(model="m", fault="status=500") as broken,
        pdproxy_serve(tmp_path, "--node", broken.url) as proxy,
    ):
        await eventually(lambda: ready(http, proxy.url), what="the node healthy (its /health is fine)")
        async with http.get(proxy.url + "/health_generate") as r:
            assert r.status == 503
            error = (await r.json())["error"]
        assert "1 tried" in error["message"]
        assert broken.url not in error["message"], "an open probe names no node address"


async def test_finish_session_is_answered_as_vllm_router_does(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with pdproxy_serve(tmp_path) as proxy:
        async with http.post(proxy.url + "/finish_session", params={"session_id": "chat-7"}) as r:
            assert r.status == 200
            assert (await r.json())["session_id"] == "chat-7"
        async with http.post(proxy.url + "/finish_session", json={"session_id": "chat-8"}) as r:
            assert (r.status, (await r.json())["session_id"]) == (200, "chat-8")
        async with http.post(proxy.url + "/finish_session") as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "session_id"
        async with http.post(proxy.url + "/finish_session", json={"session_id": 7}) as r:
            assert r.status == 400
