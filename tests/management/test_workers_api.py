"""The SGLang gateway's (SMG's) REST API for workers, called with the bodies its docs show: the
same node table as /nodes/*, ids that are the same for a URL everywhere, what a node cannot hold
named or refused, and the admin keys in front of it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest

from pdproxy.testing import MockEngine
from servers import eventually, pdproxy_serve

pytestmark = pytest.mark.usefixtures("edge")


@pytest.fixture
async def engines() -> AsyncIterator[tuple[MockEngine, MockEngine]]:
    async with MockEngine(model="m") as a, MockEngine(model="m", metrics_dialect="sglang") as b:
        yield a, b


def id_of(url: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, url))


async def workers(http: aiohttp.ClientSession, proxy: str, query: str = "") -> dict[str, Any]:
    async with http.get(proxy + "/workers" + query) as r:
        assert r.status == 200
        return dict(await r.json())


async def test_a_worker_made_listed_changed_and_removed(
    tmp_path: Path, engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    a, b = engines
    async with pdproxy_serve(tmp_path, "--node", a.url) as proxy:
        spec = {"url": b.url, "worker_type": "regular", "labels": {"zone": "a"}, "priority": 5, "cost": 1.5}
        async with http.post(proxy.url + "/workers", json=spec) as r:
            assert r.status == 202, await r.text()
            made = await r.json()
            location = r.headers["location"]
        assert made["worker_id"] == id_of(b.url)
        assert location == made["location"] == f"/workers/{id_of(b.url)}"
        assert made["ignored"] == ["cost", "priority"], "what a node cannot hold is named"
        async with http.get(proxy.url + "/nodes/status") as r:
            assert set(await r.json()) == {a.url, b.url}, "the same table as /nodes/*"
        async with http.post(proxy.url + "/workers", json={"url": b.url}) as r:
            assert r.status == 409

        await eventually(lambda: serve_m(http, proxy.url, 2), what="both workers' models")

        async def runtime_known() -> bool:  # from the engine's /metrics, read every 2 s
            listed = await workers(http, proxy.url)
            return any(w["url"] == b.url and w["runtime_type"] != "unspecified" for w in listed["workers"])

        await eventually(runtime_known, what="the engine's metrics read")
        listed = await workers(http, proxy.url)
        assert listed["total"] == 2
        assert listed["stats"] == {"prefill_count": 0, "decode_count": 0, "regular_count": 2}
        by_url = {w["url"]: w for w in listed["workers"]}
        mine = by_url[b.url]
        assert mine["id"] == id_of(b.url)
        assert (mine["worker_type"], mine["connection_mode"], mine["runtime_type"]) == ("regular", "http", "sglang")
        assert (mine["is_healthy"], mine["status"], mine["load"]) == (True, "ready", 0)
        assert mine["models"] == [{"id": "m"}]
        assert mine["model_id"] == "m"
        assert mine["labels"] == {"zone": "a"}
        assert by_url[a.url]["runtime_type"] == "unspecified", "an LMDeploy node is neither runtime"
        assert (await workers(http, proxy.url, "?model=other"))["total"] == 0

        async with http.get(proxy.url + location) as r:
            assert (r.status, (await r.json())["url"]) == (200, b.url)
        async with http.get(proxy.url + "/workers/" + quote(b.url, safe="")) as r:
            assert (r.status, (await r.json())["id"]) == (200, id_of(b.url)), "a percent-encoded URL names it too"

        async with http.patch(proxy.url + location, json={"labels": {"rack": "7"}}) as r:
            assert r.status == 202, await r.text()
        async with http.get(proxy.url + location) as r:
            assert (await r.json())["labels"] == {"zone": "a", "rack": "7"}, "labels are merged"
        async with http.patch(proxy.url + location, json={"priority": 1}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "priority", "refused, not dropped"
        async with http.put(proxy.url + location, json={"url": a.url}) as r:
            assert r.status == 400, "a PUT cannot move a worker to another URL"
        async with http.put(proxy.url + location, json={"url": b.url, "labels": {"zone": "b"}}) as r:
            assert r.status == 202
        async with http.get(proxy.url + location) as r:
            assert (await r.json())["labels"] == {"zone": "b"}, "a PUT replaces the whole spec"

        async with http.delete(proxy.url + location) as r:
            assert (r.status, (await r.json())["worker_id"]) == (202, id_of(b.url))
        async with http.get(proxy.url + location) as r:
            assert r.status == 404
        assert [w["url"] for w in (await workers(http, proxy.url))["workers"]] == [a.url]


async def serve_m(http: aiohttp.ClientSession, proxy: str, count: int) -> bool:
    listed = await workers(http, proxy, "?model=m")
    return bool(listed["total"] == count and all(w["is_healthy"] for w in listed["workers"]))


async def test_prefill_and_decode_workers_keep_their_roles(
    tmp_path: Path, engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = engines
    async with pdproxy_serve(tmp_path, "--pd-protocol", "sglang") as proxy:
        spec = {"url": prefill.url, "worker_type": "prefill", "bootstrap_port": 8998}
        async with http.post(proxy.url + "/workers", json=spec) as r:
            assert r.status == 202, await r.text()
        async with http.post(proxy.url + "/workers", json={"url": decode.url, "worker_type": "decode"}) as r:
            assert r.status == 202, await r.text()
        async with http.get(proxy.url + "/nodes/status") as r:
            status = await r.json()
        assert (status[prefill.url]["role_name"], status[prefill.url]["bootstrap_port"]) == ("prefill", 8998)
        assert status[decode.url]["role_name"] == "decode"
        listed = await workers(http, proxy.url)
        assert listed["stats"] == {"prefill_count": 1, "decode_count": 1, "regular_count": 0}
        by_url = {w["url"]: w for w in listed["workers"]}
        assert by_url[prefill.url]["bootstrap_port"] == 8998
        assert "bootstrap_port" not in by_url[decode.url]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "url"),
        ({"url": "ftp://x:1"}, "url"),
        ({"url": "http://127.0.0.1:9", "worker_type": "encode"}, "worker_type"),
        ({"url": "http://127.0.0.1:9", "connection_mode": "grpc"}, "connection_mode"),
        ({"url": "http://127.0.0.1:9", "labels": ["a"]}, "labels"),
    ],
)
async def test_a_spec_pdproxy_cannot_honour_is_a_400_naming_the_field(
    tmp_path: Path, http: aiohttp.ClientSession, body: dict[str, Any], param: str
) -> None:
    async with pdproxy_serve(tmp_path) as proxy:
        async with http.post(proxy.url + "/workers", json=body) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == param
        assert (await workers(http, proxy.url))["total"] == 0, "nothing half made"


async def test_unknown_and_malformed_worker_ids(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with pdproxy_serve(tmp_path) as proxy:
        async with http.get(proxy.url + "/workers/" + id_of("http://127.0.0.1:9")) as r:
            assert r.status == 404
        async with http.delete(proxy.url + "/workers/not-an-id") as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "worker_id"
        async with http.post(proxy.url + "/workers/" + id_of("http://127.0.0.1:9")) as r:
            assert r.status == 405


async def test_the_workers_api_keeps_the_admin_keys(
    tmp_path: Path, engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    a, _ = engines
    keys = tmp_path / "admin-keys"
    keys.write_text("admin-secret\n")
    async with pdproxy_serve(tmp_path, "--node", a.url, "--admin-keys-file", str(keys)) as proxy:
        for method, path in (("GET", "/workers"), ("POST", "/workers"), ("DELETE", f"/workers/{id_of(a.url)}")):
            async with http.request(method, proxy.url + path, json={"url": a.url}) as r:
                assert r.status == 401, (method, path)
        admin = {"authorization": "Bearer admin-secret"}
        async with http.get(proxy.url + f"/workers/{id_of(a.url)}", headers=admin) as r:
            assert r.status == 200
