"""Replicas sharing membership through Redis: two `pdproxy serve --registry redis://...`
processes, a real redis-server and mock engines. Register on one, route through the other;
leases expire in Redis; a Redis that restarts empty is written back by the replicas."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from redis_server import REDIS_SERVER, RedisServer, redis_server
from servers import Process, chat_body, get_json, mock_engine, pdproxy_serve, post_json, wait_until

# One pipeline serves both edges: this suite runs against the Rust edge (test_proxy.py and the
# tests marked with the `edge` fixture cover the --edge granian transport).
pytestmark = pytest.mark.slow

WAIT = 10.0  # bound on what takes a Redis notice or one reconcile (1 s)


@dataclass
class Replicas:
    redis: RedisServer
    one: Process
    two: Process
    engine: Process
    other: Process


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    if REDIS_SERVER is None:
        pytest.fail("the replica tests need Debian's redis-server (apt-get install redis-server)")
    with ExitStack() as stack:
        redis = stack.enter_context(redis_server(tmp_path))
        engine = stack.enter_context(mock_engine(tmp_path, "alpha"))
        other = stack.enter_context(mock_engine(tmp_path, "beta"))
        one = stack.enter_context(pdproxy_serve(tmp_path, "--registry", redis.url))
        two = stack.enter_context(pdproxy_serve(tmp_path, "--registry", redis.url))
        yield Replicas(redis, one, two, engine, other)


def _nodes(proxy: Process) -> dict[str, Any]:
    nodes: dict[str, Any] = get_json(proxy.url + "/nodes/status")
    return nodes


def _post(proxy: Process, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
    """The status and JSON body of a POST, errors included."""
    request = urllib.request.Request(
        proxy.url + path, data=json.dumps(payload).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _chat(proxy: Process, model: str) -> tuple[int, Any]:
    return _post(proxy, "/v1/chat/completions", chat_body(model))


def _add(proxy: Process, engine: Process, model: str, **extra: Any) -> tuple[int, Any]:
    return _post(proxy, "/nodes/add", {"url": engine.url, "status": {"models": [model]}, **extra})


def test_registered_on_one_routed_through_the_other(replicas: Replicas) -> None:
    r = replicas
    assert _add(r.one, r.engine, "alpha")[0] == 200
    wait_until(lambda: r.engine.url in _nodes(r.two), WAIT, "the node on replica two")
    status, answer = _chat(r.two, "alpha")
    assert status == 200, answer
    assert get_json(r.engine.url + "/mock/stats")["requests"] >= 1
    # Each replica keeps its own in-flight counts and health view.
    assert _nodes(r.two)[r.engine.url]["requests"] == 1
    assert _nodes(r.one)[r.engine.url]["requests"] == 0

    # A registration the data plane would refuse is refused before Redis sees it.
    status, answer = _post(r.one, "/nodes/add", {"url": r.other.url, "status": {"role": "chef"}})
    assert status == 400, answer
    assert r.other.url not in _nodes(r.two)

    post_json(r.two.url + "/nodes/remove", {"url": r.engine.url})
    wait_until(lambda: r.engine.url not in _nodes(r.one), WAIT, "the removal on replica one")
    assert _chat(r.one, "alpha")[0] == 503  # no node at all


def test_a_lease_expires_in_redis_for_every_replica(replicas: Replicas) -> None:
    r = replicas
    assert _add(r.one, r.engine, "alpha", lease_ttl=1.5)[0] == 200
    assert _add(r.one, r.other, "beta")[0] == 200  # no lease: stays
    wait_until(lambda: {r.engine.url, r.other.url} <= set(_nodes(r.two)), WAIT, "both nodes on replica two")
    lease = _nodes(r.two)[r.engine.url]["lease"]
    assert lease["ttl"] == 1.5
    wait_until(
        lambda: r.engine.url not in _nodes(r.one) and r.engine.url not in _nodes(r.two),
        WAIT,
        "the lapsed node gone from both replicas",
    )
    assert r.other.url in _nodes(r.one)
    assert r.other.url in _nodes(r.two)


def test_replicas_recover_from_a_redis_restart(replicas: Replicas) -> None:
    r = replicas
    assert _add(r.one, r.engine, "alpha")[0] == 200
    wait_until(lambda: r.engine.url in _nodes(r.two), WAIT, "the node on replica two")

    r.redis.stop()
    # Routing goes on with the last known membership; changes are refused, not lost silently.
    assert _chat(r.two, "alpha")[0] == 200
    status, answer = _add(r.two, r.other, "beta")
    assert status == 503, answer
    assert answer["error"]["code"] == "registry_unavailable"
    assert r.engine.url in _nodes(r.one)

    r.redis.restart_empty()
    # The replicas write their membership back, and changes flow again both ways.
    wait_until(lambda: _add(r.two, r.other, "beta")[0] == 200, WAIT, "registration to work again")
    wait_until(lambda: r.other.url in _nodes(r.one), WAIT, "the new node on replica one")
    assert r.engine.url in _nodes(r.one)
    assert r.engine.url in _nodes(r.two)
    with ExitStack() as stack:
        third = stack.enter_context(pdproxy_serve(r.redis.workdir, "--registry", r.redis.url))
        wait_until(lambda: {r.engine.url, r.other.url} <= set(_nodes(third)), WAIT, "a new replica to see both")
        assert _chat(third, "beta")[0] == 200


def test_a_replica_starts_while_redis_is_down(tmp_path: Path) -> None:
    if REDIS_SERVER is None:
        pytest.fail("the replica tests need Debian's redis-server (apt-get install redis-server)")
    redis = RedisServer(tmp_path)  # its port is chosen, nothing listens on it yet
    with (
        mock_engine(tmp_path, "alpha") as engine,
        pdproxy_serve(tmp_path, "--registry", redis.url, "--node", engine.url) as replica,
    ):
        assert _nodes(replica) == {}  # the registry is the membership: nothing until it is reachable
        redis.start()
        try:
            # Registered first, then asked for its models (it gets no traffic until they are known).
            wait_until(
                lambda: _nodes(replica).get(engine.url, {}).get("models") == ["alpha"],
                20,
                "the configured node registered and its models discovered",
            )
            assert _chat(replica, "alpha")[0] == 200
        finally:
            redis.stop()


def test_an_entry_written_into_redis_by_anyone_passes_the_node_checks(replicas: Replicas) -> None:
    """Whoever can write to Redis cannot make the replicas send requests to a metadata service."""
    import redis

    r = replicas
    assert _add(r.one, r.engine, "alpha")[0] == 200
    client = redis.Redis.from_url(r.redis.url)
    bad = "http://169.254.169.254"
    client.hset("pdproxy:nodes", bad, json.dumps({"url": bad, "models": ["alpha"], "role": "hybrid"}))
    client.publish("pdproxy:changes", bad)
    client.close()
    # The next reconcile (within a second) applies the snapshot: the good node stays, the bad one never comes.
    wait_until(lambda: r.engine.url in _nodes(r.two), WAIT, "the good node on replica two")
    for proxy in (r.one, r.two):
        proxy_log = proxy.log()
        wait_until(lambda p=proxy: "169.254.169.254" in p.log(), WAIT, "the refusal to be logged")
        assert bad not in _nodes(proxy), proxy_log
