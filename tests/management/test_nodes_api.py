"""The control plane over real sockets: LMDeploy-compatible node management, health states,
leases, persistence, auth and header hygiene, with `pdproxy serve` as a subprocess and mock
engines in the test's event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdproxy.testing import MockEngine, MockSettings
from servers import Process, chat_body, eventually, pdproxy_serve

# Against both edges (see the `edge` fixture).
pytestmark = pytest.mark.usefixtures("edge")

FAST_HEALTH = ("--health-interval", "0.2", "--health-fall", "2", "--health-rise", "1")
ADMIN = {"authorization": "Bearer admin-key"}


@contextmanager
def proxy(tmp_path: Path, *args: str) -> Iterator[Process]:
    with pdproxy_serve(tmp_path, *FAST_HEALTH, *args) as process:
        yield process


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    async with MockEngine(model="m") as engine:
        yield engine


async def status(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    async with http.get(url + "/nodes/status", headers=headers) as r:
        assert r.status == 200
        return dict(await r.json())


async def test_lmdeploy_registration_body_is_accepted(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    with proxy(tmp_path) as p:
        # Exactly what `lmdeploy serve api_server --proxy-url` posts (role as its integer).
        registration = {"url": engine.url + "/", "status": {"models": ["m"], "role": 1}}
        headers = {"accept": "application/json", "content-type": "application/json"}
        async with http.post(p.url + "/nodes/add", json=registration, headers=headers) as r:
            assert r.status == 200
            added = await r.json()
        assert added["url"] == engine.url
        assert added["created"] is True
        async with http.post(p.url + "/nodes/add", json=registration) as r:
            assert r.status == 200, "adding the same node again updates it"
            assert (await r.json())["created"] is False
        node = (await status(http, p.url))[engine.url]
        # LMDeploy's keys, with its types, and pdproxy's.
        assert (node["role"], node["models"], node["unfinished"], node["speed"]) == (1, ["m"], 0, None)
        assert isinstance(node["latency"], list)
        assert node["state"] == "healthy"
        async with http.post(p.url + "/v1/chat/completions", json=chat_body("m")) as r:
            assert r.status == 200
        node = (await status(http, p.url))[engine.url]
        assert len(node["latency"]) == 1
        assert node["succeeded"] == 1


async def test_add_without_models_probes_the_node(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    with proxy(tmp_path) as p:
        async with http.post(p.url + "/nodes/add", json={"url": engine.url}) as r:
            assert r.status == 200
        await eventually(lambda: _models_of(http, p.url, engine.url, ["m"]))
        # Declared models the node does not serve give way to what it serves.
        async with http.post(p.url + "/nodes/add", json={"url": engine.url, "status": {"models": ["wrong"]}}) as r:
            assert r.status == 200
        await eventually(lambda: _models_of(http, p.url, engine.url, ["m"]))


async def test_a_node_takes_traffic_only_for_models_it_is_known_to_serve(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A node added without models whose /v1/models does not answer (yet) gets no request, for
    any model, until its models are known."""
    async with MockEngine(model="m") as known, MockEngine(model="m") as unknown:
        with proxy(tmp_path, "--policy", "round_robin", "--discovery-interval", "0.2") as p:
            async with http.post(p.url + "/nodes/add", json={"url": known.url}) as r:
                assert (await r.json())["status"]["models"] == ["m"], "discovered before the answer"
            async with http.post(unknown.url + "/mock/config", json={"models_status": 503}):
                pass
            async with http.post(p.url + "/nodes/add", json={"url": unknown.url}) as r:
                assert r.status == 200
            for _ in range(6):
                async with http.post(p.url + "/v1/chat/completions", json=chat_body("m")) as r:
                    assert r.status == 200
            async with http.post(p.url + "/v1/chat/completions", json=chat_body("other")) as r:
                assert r.status == 503, "maybe the undiscovered node serves it: not a 404 yet"
                assert "still being discovered" in (await r.json())["error"]["message"]
            assert (known.state.requests, unknown.state.requests) == (6, 0)
            async with http.post(unknown.url + "/mock/config", json={"models_status": 200}):
                pass
            await eventually(lambda: _models_of(http, p.url, unknown.url, ["m"]))
            for _ in range(4):
                async with http.post(p.url + "/v1/chat/completions", json=chat_body("m")) as r:
                    assert r.status == 200
            assert unknown.state.requests == 2, "once known, it takes its share"


async def _models_of(http: aiohttp.ClientSession, proxy_url: str, node: str, models: list[str]) -> bool:
    return bool((await status(http, proxy_url)).get(node, {}).get("models") == models)


async def test_bad_management_requests(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    with proxy(tmp_path) as p:
        cases: list[tuple[str, Any, int, str]] = [
            ("/nodes/add", {"status": {}}, 400, "invalid_request"),
            ("/nodes/add", {"url": "http://127.0.0.1:1", "status": {"models": "m"}}, 400, "invalid_request"),
            ("/nodes/add", {"url": "http://127.0.0.1:1", "status": {"role": 7}}, 400, "invalid_node"),
            ("/nodes/add", {"url": "ftp://127.0.0.1:1"}, 400, "invalid_node"),
            ("/nodes/remove", {"url": "http://127.0.0.1:1"}, 404, "node_not_found"),
            ("/nodes/terminate", {"url": "http://127.0.0.1:1"}, 404, "node_not_found"),
        ]
        for path, body, code, error_code in cases:
            async with http.post(p.url + path, json=body) as r:
                assert r.status == code, (path, body)
                assert (await r.json())["error"]["code"] == error_code
                assert r.headers["x-pdproxy-error"] == error_code
        async with http.post(p.url + "/nodes/add", data=b"{oops", headers={"content-type": "application/json"}) as r:
            assert r.status == 400
        async with http.post(p.url + "/nodes/add", data=b"url=x", headers={"content-type": "text/plain"}) as r:
            assert r.status == 415
        async with http.get(p.url + "/nodes/add") as r:
            assert r.status == 405


@pytest.mark.parametrize(
    "url",
    ["http://169.254.169.254/", "http://user:pw@127.0.0.1:9", "http://[fe80::1]:80", "ftp://127.0.0.1:9"],
)
async def test_unsafe_node_urls_are_refused(tmp_path: Path, http: aiohttp.ClientSession, url: str) -> None:
    with proxy(tmp_path) as p:
        async with http.post(p.url + "/nodes/add", json={"url": url}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "invalid_node"
        assert await status(http, p.url) == {}


async def test_node_allow_list(tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession) -> None:
    with proxy(tmp_path, "--allow-node-cidr", "10.0.0.0/8") as p:
        async with http.post(p.url + "/nodes/add", json={"url": engine.url}) as r:
            assert r.status == 400
            assert "outside the allowed networks" in (await r.json())["error"]["message"]


async def test_remove_and_terminate(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with (
        MockEngine(MockSettings(port=0, model="m", allow_terminate=True)) as stoppable,
        MockEngine(model="m") as stubborn,
    ):
        with proxy(tmp_path) as p:
            for engine in (stoppable, stubborn):
                async with http.post(p.url + "/nodes/add", json={"url": engine.url}) as r:
                    assert r.status == 200
            async with http.post(p.url + "/nodes/terminate", json={"url": stoppable.url}) as r:
                assert r.status == 200
                assert (await r.json())["terminated"] is True
            assert stoppable.state.terminated.is_set()
            # The stubborn engine refuses /terminate (LMDeploy without --allow-terminate-by-client).
            async with http.post(p.url + "/nodes/terminate", json={"url": stubborn.url}) as r:
                assert r.status == 502
                assert "did not confirm" in (await r.json())["error"]["message"]
            assert await status(http, p.url) == {}, "terminated nodes are removed everywhere"
            async with http.post(p.url + "/nodes/add", json={"url": stubborn.url}) as r:
                assert r.status == 200
            async with http.post(p.url + "/nodes/remove", json={"url": stubborn.url}) as r:
                assert r.status == 200
            assert await status(http, p.url) == {}


async def test_health_states_follow_the_engine(tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession) -> None:
    with proxy(tmp_path, "--node", f"{engine.url},model=m") as p:

        async def state() -> str:
            return str((await status(http, p.url))[engine.url]["state"])

        async def set_engine(health: str) -> None:
            async with http.post(engine.url + "/mock/health", json={"status": health}) as r:
                assert r.status == 200

        await eventually(lambda: _is(state(), "healthy"))
        await set_engine("unhealthy")
        await eventually(lambda: _is(state(), "unhealthy"))
        async with http.post(p.url + "/v1/chat/completions", json=chat_body("m")) as r:
            assert r.status == 503
            assert r.headers["x-pdproxy-error"] == "no_healthy_node"
            assert "retry-after" in r.headers
        async with http.get(p.url + "/ready") as r:
            assert r.status == 503
        async with http.get(p.url + "/v1/models") as r:
            assert (await r.json())["data"] == [], "models of unhealthy nodes are not listed"
        await set_engine("healthy")
        await eventually(lambda: _is(state(), "healthy"))
        await set_engine("sleeping")
        await eventually(lambda: _is(state(), "sleeping"))
        assert engine.url in await status(http, p.url), "a sleeping node is kept"
        await set_engine("healthy")
        await eventually(lambda: _is(state(), "healthy"))
        async with http.get(p.url + "/ready") as r:
            assert r.status == 200


async def _is(value: Any, expected: str) -> bool:
    return bool(await value == expected)


async def test_unreachable_node_goes_unhealthy(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    engine = MockEngine(model="m")
    await engine.start()
    url = engine.url
    with proxy(tmp_path, "--node", url) as p:
        await eventually(lambda: _models_of(http, p.url, url, ["m"]))
        await engine.stop()
        await eventually(lambda: _is(_state(http, p.url, url), "unhealthy"))


async def _state(http: aiohttp.ClientSession, proxy_url: str, node: str) -> str:
    return str((await status(http, proxy_url))[node]["state"])


async def test_lease_expires_and_renews(tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession) -> None:
    with proxy(tmp_path) as p:
        registration = {"url": engine.url, "status": {"models": ["m"]}, "lease_ttl": 1.0}
        async with http.post(p.url + "/nodes/add", json=registration) as r:
            assert r.status == 200
        lease = (await status(http, p.url))[engine.url]["lease"]
        assert lease["ttl"] == 1.0
        for _ in range(3):  # renewing keeps it
            await asyncio.sleep(0.5)  # a fixed wait: a node that renews every half of its TTL is the case
            async with http.post(p.url + "/nodes/add", json=registration) as r:
                assert r.status == 200
        assert engine.url in await status(http, p.url)
        await eventually(lambda: _gone(http, p.url, engine.url), timeout=6)


async def _gone(http: aiohttp.ClientSession, proxy_url: str, node: str) -> bool:
    return node not in await status(http, proxy_url)


async def test_state_file_survives_a_restart(tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession) -> None:
    state = tmp_path / "nodes.json"
    with proxy(tmp_path, "--state-file", str(state)) as p:
        body = {"url": engine.url, "status": {"models": ["m"], "role": 1, "speed": 2}, "max_concurrency": 3}
        async with http.post(p.url + "/nodes/add", json=body) as r:
            assert r.status == 200
    saved = json.loads(state.read_text())
    assert saved["nodes"][0]["url"] == engine.url
    assert oct(state.stat().st_mode & 0o777) == "0o600"
    with proxy(tmp_path, "--state-file", str(state)) as p:
        node = (await status(http, p.url))[engine.url]
        assert (node["speed"], node["max_concurrency"], node["models"]) == (2, 3, ["m"])


async def test_api_and_admin_keys(tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession) -> None:
    node = f"{engine.url},model=m"
    with proxy(tmp_path, "--api-keys", "client-key", "--admin-keys", "admin-key", "--node", node) as p:
        client = {"authorization": "Bearer client-key"}
        for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": "client-key"}):
            async with http.post(p.url + "/v1/chat/completions", json=chat_body("m"), headers=headers) as r:
                assert r.status == 401
                assert r.headers["www-authenticate"] == "Bearer"
        async with http.post(p.url + "/v1/chat/completions", json=chat_body("m"), headers=client) as r:
            assert r.status == 200
        received = engine.state.records[-1]["headers"]
        assert "authorization" not in received, "the client's key never reaches the node"
        anthropic = {"x-api-key": "client-key"}  # Anthropic's clients send their key so
        async with http.post(p.url + "/v1/chat/completions", json=chat_body("m"), headers=anthropic) as r:
            assert r.status == 200
        assert "x-api-key" not in engine.state.records[-1]["headers"], "nor does an Anthropic client's"
        async with http.post(p.url + "/v1/chat/completions", json=chat_body("m"), headers={"x-api-key": "no"}) as r:
            assert r.status == 401
        async with http.get(p.url + "/nodes/status", headers=client) as r:
            assert r.status == 403
        async with http.get(p.url + "/nodes/status") as r:
            assert r.status == 401
        assert engine.url in await status(http, p.url, ADMIN)
        async with http.get(p.url + "/health") as r:
            assert r.status == 200, "liveness stays open"


async def test_api_keys_alone_also_guard_management(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    with proxy(tmp_path, "--api-keys", "only-key") as p:
        async with http.get(p.url + "/nodes/status") as r:
            assert r.status == 401
        assert await status(http, p.url, {"authorization": "Bearer only-key"}) == {}


async def test_keyless_registration_only_from_trusted_networks(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    """With keys set, an unchanged LMDeploy api_server (it sends no key) registers only from a
    network given to --keyless-registration-from; nothing else opens."""
    registration = {"url": engine.url, "status": {"models": ["m"], "role": 1}}
    with proxy(tmp_path, "--api-keys", "k", "--keyless-registration-from", "10.0.0.0/8") as p:
        async with http.post(p.url + "/nodes/add", json=registration) as r:
            assert r.status == 401, "127.0.0.1 is not in 10.0.0.0/8"
    with proxy(tmp_path, "--api-keys", "k", "--keyless-registration-from", "10.0.0.0/8", "127.0.0.0/8") as p:
        async with http.post(p.url + "/nodes/add", json=registration) as r:
            assert r.status == 200
        async with http.post(p.url + "/nodes/remove", json={"url": engine.url}) as r:
            assert r.status == 401, "only registration is open"
        async with http.get(p.url + "/nodes/status") as r:
            assert r.status == 401
        async with http.post(p.url + "/v1/chat/completions", json=chat_body("m")) as r:
            assert r.status == 401


async def test_node_api_key_and_header_hygiene(tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession) -> None:
    with proxy(tmp_path) as p:
        body = {"url": engine.url, "status": {"models": ["m"]}, "api_key": "node-secret"}
        async with http.post(p.url + "/nodes/add", json=body) as r:
            assert r.status == 200
        sent = {
            "authorization": "Bearer client",
            "connection": "keep-alive, x-hop",
            "x-hop": "1",
            "x-forwarded-for": "10.1.1.1",
            "x-custom": "kept",
        }
        async with http.post(p.url + "/v1/chat/completions", json=chat_body("m"), headers=sent) as r:
            assert r.status == 200
            generated = r.headers["x-request-id"]
        got = engine.state.records[-1]["headers"]
        assert got["authorization"] == "Bearer node-secret"
        assert "x-hop" not in got
        assert got["x-custom"] == "kept"
        assert got["x-forwarded-for"] == "10.1.1.1, 127.0.0.1"
        assert got["x-forwarded-proto"] == "http"
        assert got["x-forwarded-host"].startswith("127.0.0.1:")
        assert got["x-request-id"] == generated
        async with http.post(
            p.url + "/v1/chat/completions", json=chat_body("m", stream=True), headers={"x-request-id": "mine-1"}
        ) as r:
            assert r.headers["x-request-id"] == "mine-1"
            await r.read()
        assert engine.state.records[-1]["headers"]["x-request-id"] == "mine-1"
        async with http.post(
            p.url + "/v1/chat/completions", json=chat_body("absent"), headers={"x-request-id": "e1"}
        ) as r:
            assert r.status == 404
            assert r.headers["x-request-id"] == "e1", "the proxy's own errors echo the id too"


async def test_pass_through_endpoints(tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession) -> None:
    with proxy(tmp_path, "--node", f"{engine.url},model=m") as p:
        await eventually(lambda: _models_of(http, p.url, engine.url, ["m"]))
        # The mock has no /v1/embeddings: the node's own 404 comes back unchanged.
        async with http.post(p.url + "/v1/embeddings", json={"model": "m", "input": "x"}) as r:
            assert r.status == 404
            assert "x-pdproxy-error" not in r.headers
        async with http.post(p.url + "/v1/anything/else", json={"model": "m"}) as r:
            assert "x-pdproxy-error" not in r.headers, "a /v1/ POST naming a model is passed through"
        async with http.post(p.url + "/v1/anything/else", json={"input": "x"}) as r:
            assert r.status == 404
            assert r.headers["x-pdproxy-error"] == "not_found"


async def test_openapi_matches_the_routes(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    from pdproxy.management.nodes_api import ROUTES

    with proxy(tmp_path) as p:
        async with http.get(p.url + "/openapi.json") as r:
            document = await r.json()
        for route in ROUTES:
            assert route.method.lower() in document["paths"][route.path]
        assert "post" in document["paths"]["/drain"]
        for path, operations in document["paths"].items():
            if path == "/drain":
                continue  # it ends the proxy (tested in test_resilience)
            for method in operations:
                async with http.request(method.upper(), p.url + path, json={}) as r:
                    assert r.status != 405, f"{method} {path} is documented but not served"
                    assert r.headers.get("x-pdproxy-error") != "not_found", f"{method} {path}"


async def test_every_answer_tells_its_id_and_a_wrong_method_what_is_allowed(
    tmp_path: Path, engine: MockEngine, http: aiohttp.ClientSession
) -> None:
    with proxy(tmp_path, "--node", f"{engine.url},model=m") as p:
        for method, path, status, allow in (
            ("GET", "/nodes/add", 405, "POST"),
            ("GET", "/v1/chat/completions", 405, "POST"),
            ("POST", "/health", 405, "GET, HEAD"),
            ("DELETE", "/v1/models/m", 405, "GET"),
            ("GET", "/no/such/route", 404, None),
            ("GET", "/nodes/status", 200, None),
        ):
            async with http.request(method, p.url + path) as r:
                assert r.status == status, (method, path)
                assert len(r.headers["x-request-id"]) == 32, (method, path, "a new id: 32 hex digits")
                assert r.headers.get("allow") == allow, (method, path)
            async with http.request(method, p.url + path, headers={"x-request-id": "mine-7"}) as r:
                assert r.headers.getall("x-request-id") == ["mine-7"], (method, path, "the client's own, once")
        async with http.get(p.url + "/") as r:
            assert r.status == 200
            index = await r.json()
        assert (index["service"], index["dashboard"], index["api"]) == ("pdproxy", "/dashboard", "/openapi.json")
        async with http.get(p.url + index["dashboard"]) as r:
            assert r.status == 200
