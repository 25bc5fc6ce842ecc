"""Kubernetes discovery (`--k8s-selector`) against pdproxy.testing.fake_kube, a fake API server
that speaks the real protocol, with mock engines as the pods' servers: pods that become nodes
and stop being ones, events the server loses, watches that break or stall, an API server that
goes away, permissions that are missing, and the settings that cannot work."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdproxy.config.settings import DiscoverySettings
from pdproxy.fleet.node_sources.found import SourceState
from pdproxy.fleet.node_sources.kube_api import KubeApi, KubeApiError
from pdproxy.fleet.node_sources.kubernetes import PodWatcher, Selection
from pdproxy.testing import MockEngine, MockSettings
from pdproxy.testing.fake_kube import FakeKubeApi
from servers import chat_body, eventually, pdproxy_serve, register

NS = "fleet"
CHAT = "/v1/chat/completions"
#: The most a pod's change may take to show in routing (the issue's target: one second).
ONE_SECOND = 1.0


def kubeconfig(path: Path, api: FakeKubeApi, *, token_file: Path | None = None) -> Path:
    return api.write_kubeconfig(path, namespace=NS, token_file=token_file)


def engine_pod(api: FakeKubeApi, name: str, engine: MockEngine, *, ready: bool = True, **extra: Any) -> None:
    """A pod whose server is ``engine`` (its IP 127.0.0.1, its port named http the engine's)."""
    port = int(engine.url.rsplit(":", 1)[1])
    labels = {"app": "vllm", **extra.pop("labels", {})}
    api.add_pod(
        NS,
        name,
        ip="127.0.0.1",
        phase="Running",
        ready=ready,
        labels=labels,
        ports=[{"name": "http", "containerPort": port, "protocol": "TCP"}],
        **extra,
    )


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi(bookmark_interval=0.5) as api:
        yield api


@pytest.fixture
async def engines() -> AsyncIterator[list[MockEngine]]:
    async with MockEngine(model="m") as a, MockEngine(model="m") as b, MockEngine(model="m") as c:
        yield [a, b, c]


@pytest.fixture
def proxy(tmp_path: Path, api: FakeKubeApi) -> Iterator[Any]:
    config = kubeconfig(tmp_path / "kubeconfig", api)
    flags = ("--k8s-selector", "app=vllm", "--k8s-kubeconfig", str(config), "--k8s-relist-interval", "3")
    with pdproxy_serve(tmp_path, *flags, "--health-interval", "0.5") as proxy:
        yield proxy


async def status(http: aiohttp.ClientSession, proxy: Any) -> dict[str, Any]:
    async with http.get(proxy.url + "/nodes/status") as r:
        return dict(await r.json())


async def nodes(http: aiohttp.ClientSession, proxy: Any) -> set[str]:
    return set(await status(http, proxy))


async def routable(http: aiohttp.ClientSession, proxy: Any, url: str) -> bool:
    node = (await status(http, proxy)).get(url)
    return node is not None and node["state"] == "healthy" and "m" in node["models"]


async def measured(check: Any, what: str, budget: float = ONE_SECOND) -> float:
    """Seconds until ``check()`` holds, failing past ``budget``."""
    started = time.monotonic()
    await eventually(check, timeout=budget, what=what)
    return time.monotonic() - started


async def test_pods_become_nodes_when_ready_and_stop_when_they_go(
    api: FakeKubeApi, engines: list[MockEngine], proxy: Any, http: aiohttp.ClientSession
) -> None:
    a, b, _ = engines
    engine_pod(api, "vllm-a", a)
    engine_pod(api, "vllm-b", b, ready=False)
    api.add_pod(NS, "other", ip="127.0.0.1", phase="Running", ready=True, labels={"app": "redis"})
    await eventually(lambda: routable(http, proxy, a.url), what="the ready pod to be a node")
    assert await nodes(http, proxy) == {a.url}, "the unready pod and the unmatched one are not nodes"
    found = (await status(http, proxy))[a.url]["found_by"]
    assert found == {"source": "kubernetes", "where": f"pod/{NS}/vllm-a"}

    # A stream in flight on a pod that is deleted runs to its end; new requests go elsewhere.
    async with http.post(proxy.url + CHAT, json=chat_body("m", stream=True, max_tokens=40)) as stream:
        assert stream.status == 200
        assert (await stream.content.readline()).startswith(b"data: ")
        api.update_pod(NS, "vllm-b", ready=True)
        await measured(lambda: routable(http, proxy, b.url), "the pod that became Ready to be routable")
        api.delete_pod(NS, "vllm-a")
        await measured(lambda: nodes_without(http, proxy, a.url), "the deleted pod's node to go")
        rest = await stream.read()
    assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
    served_by_a = await requests_served(http, a)
    for _ in range(6):
        async with http.post(proxy.url + CHAT, json=chat_body("m")) as r:
            assert r.status == 200
    assert await requests_served(http, a) == served_by_a, "the deleted pod's node got new requests"


async def requests_served(http: aiohttp.ClientSession, engine: MockEngine) -> int:
    async with http.get(engine.url + "/mock/stats") as r:
        return int((await r.json())["requests"])


async def nodes_without(http: aiohttp.ClientSession, proxy: Any, url: str) -> bool:
    return url not in await nodes(http, proxy)


async def test_unready_terminating_and_ipless_pods_stop_being_nodes(
    api: FakeKubeApi, engines: list[MockEngine], proxy: Any, http: aiohttp.ClientSession
) -> None:
    a, b, c = engines
    for name, engine in zip(("a", "b", "c"), engines, strict=True):
        engine_pod(api, name, engine)
    await eventually(lambda: nodes_are(http, proxy, {a.url, b.url, c.url}), what="three nodes")
    api.update_pod(NS, "a", ready=False)
    await measured(lambda: nodes_are(http, proxy, {b.url, c.url}), "the unready pod to go")
    api.update_pod(NS, "b", terminating=True)
    await measured(lambda: nodes_are(http, proxy, {c.url}), "the terminating pod to go")
    api.update_pod(NS, "c", phase="Failed")
    await measured(lambda: nodes_are(http, proxy, set()), "the failed pod to go")
    api.update_pod(NS, "a", ready=True)
    await measured(lambda: nodes_are(http, proxy, {a.url}), "the pod ready again to come back")


async def nodes_are(http: aiohttp.ClientSession, proxy: Any, urls: set[str]) -> bool:
    return await nodes(http, proxy) == urls


async def test_a_pod_recreated_elsewhere_moves_its_node(
    api: FakeKubeApi, engines: list[MockEngine], proxy: Any, http: aiohttp.ClientSession
) -> None:
    a, b, _ = engines
    engine_pod(api, "vllm-0", a)
    await eventually(lambda: nodes_are(http, proxy, {a.url}), what="the pod's node")
    api.delete_pod(NS, "vllm-0")
    engine_pod(api, "vllm-0", b)  # the same name, a new address (a StatefulSet's pod rescheduled)
    await measured(lambda: nodes_are(http, proxy, {b.url}), "the node to move to the new address")


async def test_a_lost_delete_is_repaired_by_the_next_list(
    api: FakeKubeApi, engines: list[MockEngine], proxy: Any, http: aiohttp.ClientSession
) -> None:
    a, b, _ = engines
    engine_pod(api, "a", a)
    engine_pod(api, "b", b)
    await eventually(lambda: nodes_are(http, proxy, {a.url, b.url}), what="two nodes")
    api.drop_events(1, "DELETED")
    api.delete_pod(NS, "a")
    await asyncio.sleep(0.5)  # a fixed wait for a negative assertion: without its event, nothing removes it
    assert a.url in await nodes(http, proxy), "the watch never said so"
    # The relist period is 3 s: the ghost is gone within one period.
    took = await measured(lambda: nodes_are(http, proxy, {b.url}), "the relist to remove the ghost", budget=3.5)
    assert took <= 3.5


async def test_a_broken_or_stalled_watch_recovers(
    api: FakeKubeApi, engines: list[MockEngine], proxy: Any, http: aiohttp.ClientSession
) -> None:
    a, b, c = engines
    engine_pod(api, "a", a)
    await eventually(lambda: nodes_are(http, proxy, {a.url}), what="the first node")
    await eventually(lambda: api.watching > 0, what="the watch after the first list")
    # The watch is dropped half way through an event: that event is not applied, a new list is.
    api.close_watches(mid_event=True)
    engine_pod(api, "b", b)
    await eventually(lambda: nodes_are(http, proxy, {a.url, b.url}), timeout=3, what="a list after a broken watch")
    lists = api.lists
    # A watch that stalls without a word: the next list (the 3 s period) repairs what it missed.
    api.stall_watches()
    engine_pod(api, "c", c)
    api.resume_watches()
    await eventually(lambda: nodes_are(http, proxy, {a.url, b.url, c.url}), timeout=10, what="recovery from a stall")
    assert api.lists > lists
    assert 'pdproxy_discovery_restarts_total{reason="broken",source="kubernetes"}' in await metrics(http, proxy)
    # A healthy watch again: its bookmarks (every 0.5 s here) come through.
    bookmarks = 'pdproxy_discovery_events_total{source="kubernetes",type="BOOKMARK"}'
    await eventually(lambda: has(metrics(http, proxy), bookmarks), timeout=5, what="bookmarks")


async def metrics(http: aiohttp.ClientSession, proxy: Any) -> str:
    async with http.get(proxy.url + "/metrics") as r:
        return await r.text()


async def has(text: Any, part: str) -> bool:
    return part in await text


async def test_a_watch_from_a_forgotten_version_gets_410_and_lists_again(tmp_path: Path, api: FakeKubeApi) -> None:
    # In this process, against the fake's real HTTP: the place in history a watch needs is gone.
    kube = KubeApi(str(kubeconfig(tmp_path / "kubeconfig", api)))
    changed: list[str] = []
    state = SourceState("kubernetes")
    discovery = DiscoverySettings(k8s_port="", k8s_relist_interval=30.0, k8s_max_backoff=1.0)
    watcher = PodWatcher(kube, NS, Selection("app=vllm", None), discovery, state, changed.append)
    try:
        api.add_pod(NS, "a", ip="10.0.0.1", phase="Running", ready=True, labels={"app": "vllm"})
        listed = await kube.list_pods(NS, "app=vllm")
        api.add_pod(NS, "b", ip="10.0.0.2", phase="Running", ready=True, labels={"app": "vllm"})
        api.expire_history()
        with pytest.raises(KubeApiError) as refused:
            async for _ in kube.watch_pods(NS, "app=vllm", listed.resource_version, 5):
                pass
        assert refused.value.gone, refused.value.message
        # The informer itself: it lists again at once and goes on from there.
        watcher.version = listed.resource_version
        task = asyncio.create_task(watcher.run())
        await eventually(lambda: {f"{NS}/a", f"{NS}/b"} <= set(watcher.nodes), timeout=3, what="both pods")
        api.delete_pod(NS, "a")
        await eventually(lambda: f"{NS}/a" not in watcher.nodes, timeout=3, what="the delete through the watch")
        task.cancel()
    finally:
        await kube.aclose()


@pytest.mark.timeout(180)  # the outage itself lasts a minute
async def test_the_api_server_gone_for_a_minute_loses_no_node_and_no_request(
    api: FakeKubeApi, engines: list[MockEngine], proxy: Any, http: aiohttp.ClientSession
) -> None:
    a, b, c = engines
    engine_pod(api, "a", a)
    engine_pod(api, "b", b)
    await eventually(lambda: nodes_are(http, proxy, {a.url, b.url}), what="two nodes")
    # Found is not yet routable: a node serves once its first check has read its models.
    await eventually(lambda: routable(http, proxy, a.url), what="a's models")
    await eventually(lambda: routable(http, proxy, b.url), what="b's models")
    await api.go_down()
    failures = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        async with http.post(proxy.url + CHAT, json=chat_body("m")) as r:
            if r.status != 200:
                failures.append(r.status)
        await asyncio.sleep(0.2)  # a fixed pace: a steady trickle of requests through the outage
    assert failures == []
    assert await nodes(http, proxy) == {a.url, b.url}, "the fleet is kept while the API server is gone"
    async with http.get(proxy.url + "/health") as r:
        health = await r.json()
    assert r.status == 200
    source = health["discovery"]["kubernetes"]
    assert source["up"] is False, source
    assert source["down_for"] > 50, source
    assert source["nodes"] == 2, source
    assert "cannot be reached" in source["error"]
    async with http.get(proxy.url + "/metrics") as r:
        assert 'pdproxy_discovery_up{source="kubernetes"} 0.0' in await r.text()
    # Meanwhile a pod went away and another came; back up, the cluster's truth wins.
    api.delete_pod(NS, "a")
    engine_pod(api, "c", c)
    await api.come_up()
    await eventually(lambda: nodes_are(http, proxy, {b.url, c.url}), timeout=35, what="the fleet after the outage")
    async with http.get(proxy.url + "/health") as r:
        assert (await r.json())["discovery"]["kubernetes"]["up"] is True


async def test_missing_permission_is_one_clear_line_and_nodes_stay(
    api: FakeKubeApi, engines: list[MockEngine], proxy: Any, http: aiohttp.ClientSession
) -> None:
    a = engines[0]
    engine_pod(api, "a", a)
    await eventually(lambda: nodes_are(http, proxy, {a.url}), what="the node")
    await eventually(lambda: api.watching > 0, what="the watch after the first list")
    api.forbid(NS, "list")
    api.close_watches()
    await eventually(lambda: refused(http, proxy), timeout=10, what="the refusal to show")
    error = await source_error(http, proxy)
    assert 'cannot list resource "pods"' in error, error
    assert f'in the namespace "{NS}"' in error, error
    assert await nodes(http, proxy) == {a.url}
    log = proxy.log()
    assert log.count("cannot list resource") == 1, "one line per outage, not one per attempt"
    api.allow()
    await eventually(lambda: source_up(http, proxy), timeout=40, what="the source to recover")


async def refused(http: aiohttp.ClientSession, proxy: Any) -> bool:
    return "forbidden" in await source_error(http, proxy)


async def source_error(http: aiohttp.ClientSession, proxy: Any) -> str:
    async with http.get(proxy.url + "/health") as r:
        return str((await r.json())["discovery"]["kubernetes"]["error"] or "")


async def source_up(http: aiohttp.ClientSession, proxy: Any) -> bool:
    async with http.get(proxy.url + "/health") as r:
        return bool((await r.json())["discovery"]["kubernetes"]["up"])


async def test_a_node_added_by_hand_is_never_removed_by_the_watch(
    api: FakeKubeApi, engines: list[MockEngine], proxy: Any, http: aiohttp.ClientSession
) -> None:
    a, b, _ = engines
    await register(http, proxy.url, a, 1)
    engine_pod(api, "a", a)  # a pod at the same address as the node added by hand
    engine_pod(api, "b", b)
    await eventually(lambda: nodes_are(http, proxy, {a.url, b.url}), what="both nodes")
    assert (await status(http, proxy))[a.url]["found_by"] is None
    api.delete_pod(NS, "a")
    api.delete_pod(NS, "b")
    await eventually(lambda: nodes_are(http, proxy, {a.url}), what="only the pod's node to go")


async def test_pods_annotations_and_role_selectors_make_a_distserve_fleet(
    tmp_path: Path, api: FakeKubeApi, http: aiohttp.ClientSession
) -> None:
    async with (
        MockEngine(MockSettings(port=0, model="m", role="prefill")) as prefill,
        MockEngine(MockSettings(port=0, model="m", role="decode")) as decode,
    ):
        engine_pod(
            api,
            "prefill-0",
            prefill,
            labels={"role": "prefill"},
            # The mock engine serves SGLang's bootstrap on its own port.
            annotations={
                "sglang.ai/bootstrap-port": str(prefill.port),
                "pdproxy.io/label.zone": "a",
                "pdproxy.io/speed": "2",
            },
        )
        engine_pod(api, "decode-0", decode, labels={"role": "decode"}, annotations={"pdproxy.io/models": "m"})
        config = kubeconfig(tmp_path / "kubeconfig", api)
        flags = (
            *("--serving-strategy", "DistServe", "--pd-protocol", "sglang"),
            *("--k8s-prefill-selector", "app=vllm,role=prefill", "--k8s-decode-selector", "app=vllm,role in (decode)"),
            *("--k8s-kubeconfig", str(config)),
        )
        async with pdproxy_serve(tmp_path, *flags) as proxy:
            await eventually(lambda: nodes_are(http, proxy, {prefill.url, decode.url}), what="the pair")
            await eventually(lambda: routable(http, proxy, prefill.url), what="the prefill node's models")
            nodes = await status(http, proxy)
            assert nodes[prefill.url]["role_name"] == "prefill"
            assert nodes[prefill.url]["bootstrap_port"] == prefill.port
            assert nodes[prefill.url]["labels"] == {"zone": "a"}
            assert nodes[prefill.url]["speed"] == 2.0
            assert nodes[decode.url]["role_name"] == "decode"
            async with http.post(proxy.url + CHAT, json=chat_body("m")) as r:
                assert r.status == 200, await r.text()


async def test_a_pod_without_the_named_port_is_reported_not_routed(
    tmp_path: Path, api: FakeKubeApi, engines: list[MockEngine], http: aiohttp.ClientSession
) -> None:
    engine_pod(api, "a", engines[0])
    config = kubeconfig(tmp_path / "kubeconfig", api)
    flags = ("--k8s-selector", "app=vllm", "--k8s-kubeconfig", str(config), "--k8s-port", "grpc")
    async with pdproxy_serve(tmp_path, *flags) as proxy:
        await eventually(lambda: skipped(http, proxy), what="the pod to be reported")
        assert "no container port named 'grpc'" in (await skipped(http, proxy))[f"{NS}/a"]
        assert await nodes(http, proxy) == set()


async def skipped(http: aiohttp.ClientSession, proxy: Any) -> dict[str, str]:
    async with http.get(proxy.url + "/health") as r:
        return dict((await r.json())["discovery"]["kubernetes"]["skipped"])


async def test_a_rotated_token_is_read_again(
    tmp_path: Path, api: FakeKubeApi, engines: list[MockEngine], http: aiohttp.ClientSession
) -> None:
    token = tmp_path / "token"
    token.write_text(api.token)
    config = kubeconfig(tmp_path / "kubeconfig", api, token_file=token)
    flags = ("--k8s-selector", "app=vllm", "--k8s-kubeconfig", str(config), "--k8s-relist-interval", "1")
    async with pdproxy_serve(tmp_path, *flags) as proxy:
        engine_pod(api, "a", engines[0])
        await eventually(lambda: nodes_are(http, proxy, {engines[0].url}), what="the node")
        api.token = "rotated"
        token.write_text("rotated")
        engine_pod(api, "b", engines[1])
        await eventually(lambda: nodes_are(http, proxy, {engines[0].url, engines[1].url}), what="the new token used")
        assert await source_up(http, proxy)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--k8s-selector", "app in vllm"), "'app in vllm' is not a label selector requirement"),
        (("--k8s-selector", "app=vllm", "--k8s-kubeconfig", "/nonexistent/kubeconfig"), "no such file"),
        (("--k8s-selector", "app=vllm", "--k8s-context", "nowhere"), "nowhere"),
    ],
)
def test_settings_that_cannot_work_stop_the_start_with_one_line(
    tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    import subprocess
    import sys

    config = tmp_path / "kubeconfig"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    args = flags if "--k8s-kubeconfig" in flags else (*flags, "--k8s-kubeconfig", str(config))
    result = subprocess.run(
        [sys.executable, "-m", "pdproxy", "serve", "--port", "0", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert message in lines[0], result.stderr


async def test_a_thousand_pods_with_churn_end_as_the_cluster_is(
    tmp_path: Path, api: FakeKubeApi, http: aiohttp.ClientSession
) -> None:
    rng = random.Random(7)

    def ip(index: int, generation: int) -> str:
        return f"127.{1 + generation}.{index // 250}.{1 + index % 250}"

    def add(index: int, generation: int = 0) -> None:
        api.add_pod(
            NS,
            f"p{index}",
            ip=ip(index, generation),
            phase="Running",
            ready=True,
            labels={"app": "vllm"},
            annotations={"pdproxy.io/models": "m"},
            ports=[{"name": "http", "containerPort": 9}],
        )

    for index in range(1000):
        add(index)
    config = kubeconfig(tmp_path / "kubeconfig", api)
    flags = ("--k8s-selector", "app=vllm", "--k8s-kubeconfig", str(config), "--health-interval", "60")
    async with pdproxy_serve(tmp_path, *flags) as proxy:
        await eventually(lambda: count_is(http, proxy, 1000), timeout=30, what="1,000 nodes")
        generations = dict.fromkeys(range(1000), 0)
        for _ in range(300):
            index = rng.randrange(1000)
            roll = rng.random()
            if roll < 0.4:
                api.update_pod(NS, f"p{index}", ready=rng.random() < 0.5)
            elif roll < 0.7:
                api.update_pod(NS, f"p{index}", annotations={"pdproxy.io/models": "m", "pdproxy.io/speed": "2"})
            else:
                api.delete_pod(NS, f"p{index}")
                generations[index] += 1
                add(index, generations[index])
            await asyncio.sleep(0.005)  # a fixed pace: the churn comes as a stream of events, not one batch
        expected = set()
        for pod in api.pods(NS):
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])
            if ready:
                expected.add(f"http://{pod['status']['podIP']}:9")
        await eventually(lambda: nodes_are(http, proxy, expected), timeout=10, what="the cluster's pods, exactly")


async def count_is(http: aiohttp.ClientSession, proxy: Any, count: int) -> bool:
    async with http.get(proxy.url + "/health") as r:
        return bool((await r.json())["discovery"]["kubernetes"]["nodes"] == count)


async def test_a_found_node_that_left_the_table_comes_back_with_the_next_list(
    api: FakeKubeApi, engines: list[MockEngine], proxy: Any, http: aiohttp.ClientSession
) -> None:
    a = engines[0]
    engine_pod(api, "a", a)
    await eventually(lambda: nodes_are(http, proxy, {a.url}), what="the node")
    async with http.post(proxy.url + "/nodes/remove", json={"url": a.url}) as r:
        assert r.status == 200
    assert await nodes(http, proxy) == set()
    # The pod is still Ready: the cluster, not the table, says what the fleet is (3 s period).
    await eventually(lambda: nodes_are(http, proxy, {a.url}), timeout=5, what="the node back")
    assert (await status(http, proxy))[a.url]["found_by"]["source"] == "kubernetes"
