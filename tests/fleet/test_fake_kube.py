"""The fake Kubernetes API server speaks the protocol as kube-apiserver does (lists, selectors,
chunks, watches, bookmarks, 410, Status errors), and its fault knobs do what they say."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from pdproxy.testing import fake_kube
from pdproxy.testing.fake_kube import FakeKubeApi

AUTH = {"Authorization": "Bearer test-token"}
PODS = "/api/v1/namespaces/default/pods"
USER = "system:serviceaccount:default:pdproxy"


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi(bookmark_interval=0.2) as api:
        yield api


async def get(http: aiohttp.ClientSession, api: FakeKubeApi, path: str, **params: str) -> tuple[int, Any]:
    async with http.get(api.url + path, params=params, headers=AUTH) as response:
        return response.status, await response.json()


async def ok(http: aiohttp.ClientSession, api: FakeKubeApi, path: str, **params: str) -> Any:
    status, answer = await get(http, api, path, **params)
    assert status == 200, answer
    return answer


def names(answer: Any) -> list[str]:
    return [item["metadata"]["name"] for item in answer["items"]]


@contextlib.asynccontextmanager
async def watching(
    http: aiohttp.ClientSession, api: FakeKubeApi, path: str = PODS, **params: str
) -> AsyncIterator[aiohttp.ClientResponse]:
    async with http.get(api.url + path, params={"watch": "true", **params}, headers=AUTH) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "application/json"
        assert response.headers["Transfer-Encoding"] == "chunked"
        yield response


async def next_line(response: aiohttp.ClientResponse, within: float = 2.0) -> bytes:
    async with asyncio.timeout(within):
        return await response.content.readline()


async def next_event(response: aiohttp.ClientResponse, within: float = 2.0) -> Any:
    line = await next_line(response, within)
    assert line.endswith(b"\n"), line
    return json.loads(line)


async def silent(response: aiohttp.ClientResponse, within: float) -> None:
    with pytest.raises(TimeoutError):
        await next_line(response, within)


def event_of(event: Any) -> tuple[str, str, str]:
    obj = event["object"]
    return event["type"], obj["metadata"].get("name", ""), obj["metadata"]["resourceVersion"]


async def test_version_and_list_shape(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    status, version = await get(http, api, "/version")
    assert status == 200
    assert (version["major"], version["minor"], version["gitVersion"]) == ("1", "31", "v1.31.0-fake")
    api.add_pod("default", "a", ip="10.0.0.5", phase="Running", ready=True, labels={"app": "engine"})
    api.add_pod("default", "b", ip="fd00::5", annotations={"pdproxy/role": "prefill"})
    api.add_pod("other", "c")

    status, answer = await get(http, api, PODS)
    assert status == 200
    assert answer["kind"] == "PodList"
    assert answer["apiVersion"] == "v1"
    assert answer["metadata"] == {"resourceVersion": "3"}  # no continue: nothing more
    assert names(answer) == ["a", "b"]
    a, b = answer["items"]
    assert "kind" not in a
    assert "apiVersion" not in a
    assert a["metadata"]["resourceVersion"] == "1"
    assert a["metadata"]["labels"] == {"app": "engine"}
    assert len(a["metadata"]["uid"]) == 36
    assert a["metadata"]["creationTimestamp"].endswith("Z")
    assert a["spec"]["containers"][0]["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert a["status"]["phase"] == "Running"
    assert a["status"]["podIPs"] == [{"ip": "10.0.0.5"}]
    conditions = {c["type"]: c["status"] for c in a["status"]["conditions"]}
    assert conditions == {"Initialized": "True", "Ready": "True", "ContainersReady": "True", "PodScheduled": "True"}
    assert b["status"]["podIP"] == "fd00::5"
    assert b["metadata"]["annotations"] == {"pdproxy/role": "prefill"}
    assert "labels" not in b["metadata"]  # empty maps are left out, as the real server does

    everywhere = await ok(http, api, "/api/v1/pods")
    assert names(everywhere) == ["a", "b", "c"]
    status, pod = await get(http, api, PODS + "/a")
    assert (status, pod["kind"], pod["metadata"]["name"]) == (200, "Pod", "a")
    status, missing = await get(http, api, PODS + "/nope")
    assert status == 404
    assert missing == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'pods "nope" not found',
        "reason": "NotFound",
        "details": {"name": "nope", "kind": "pods"},
        "code": 404,
    }
    assert names({"items": api.pods("other")}) == ["c"]
    assert api.lists == 2
    assert ("/api/v1/pods", {}) in api.requests


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("", ["p1", "p2", "p3", "p4"]),
        ("app=engine", ["p1", "p2"]),
        ("app==engine", ["p1", "p2"]),
        ("app!=engine", ["p3", "p4"]),
        ("role in (prefill,decode)", ["p1", "p2"]),
        ("role notin (prefill)", ["p2", "p3", "p4"]),
        ("gpu", ["p2"]),
        ("!gpu", ["p1", "p3", "p4"]),
        ("app=engine,!gpu", ["p1"]),
        ("app in (engine, router), role!=decode", ["p1", "p3"]),
        ("example.com/tier=gold", ["p4"]),
    ],
)
async def test_label_selectors(
    api: FakeKubeApi, http: aiohttp.ClientSession, selector: str, expected: list[str]
) -> None:
    api.add_pod("default", "p1", labels={"app": "engine", "role": "prefill"})
    api.add_pod("default", "p2", labels={"app": "engine", "role": "decode", "gpu": "h100"})
    api.add_pod("default", "p3", labels={"app": "router"})
    api.add_pod("default", "p4", labels={"example.com/tier": "gold"})
    status, answer = await get(http, api, PODS, labelSelector=selector)
    assert status == 200
    assert names(answer) == expected


@pytest.mark.parametrize(
    ("param", "selector", "message"),
    [
        ("labelSelector", "app in engine", "unable to parse requirement: found 'engine', expected: '('"),
        ("labelSelector", "app=engine,", "found '', expected: identifier after ','"),
        ("labelSelector", "app=x y", "found 'y', expected: ',' or 'end of string'"),
        ("labelSelector", "app=-bad", 'unable to parse requirement: values[0][app]: Invalid value: "-bad": '),
        ("labelSelector", "app ~ x", "unable to parse requirement: found '~', expected: in, notin, =, ==, !=, gt, lt"),
        ("fieldSelector", "spec.foo=x", "field label not supported: spec.foo"),
        ("fieldSelector", "status.phase", "invalid selector: 'status.phase'; can't understand 'status.phase'"),
    ],
)
async def test_bad_selectors(
    api: FakeKubeApi, http: aiohttp.ClientSession, param: str, selector: str, message: str
) -> None:
    for watch in ("false", "true"):
        status, answer = await get(http, api, PODS, watch=watch, **{param: selector})
        assert status == 400
        assert answer["kind"] == "Status"
        assert (answer["reason"], answer["code"], answer["status"]) == ("BadRequest", 400, "Failure")
        assert answer["message"].startswith(message), answer["message"]


async def test_field_selectors(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    api.add_pod("default", "a", phase="Running", labels={"app": "engine"})
    api.add_pod("default", "b", phase="Pending", labels={"app": "engine"})
    api.add_pod("default", "c", phase="Running")
    for selector, expected in [
        ("metadata.name=b", ["b"]),
        ("status.phase=Running", ["a", "c"]),
        ("status.phase!=Running", ["b"]),
        ("status.phase==Running,metadata.name!=c", ["a"]),
    ]:
        status, answer = await get(http, api, PODS, fieldSelector=selector)
        assert (status, names(answer)) == (200, expected), selector
    answer = await ok(http, api, PODS, fieldSelector="status.phase=Running", labelSelector="app")
    assert names(answer) == ["a"]


async def test_chunked_list_is_one_snapshot(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    for i in range(5):
        api.add_pod("default", f"n{i}")
    api.add_pod("other", "x")
    first = await ok(http, api, PODS, limit="2")
    assert names(first) == ["n0", "n1"]
    snapshot = first["metadata"]["resourceVersion"]
    assert first["metadata"]["remainingItemCount"] == 3
    # Changes between chunks do not show: every chunk is of the first one's resourceVersion.
    api.add_pod("default", "n5")
    api.delete_pod("default", "n2")
    second = await ok(http, api, PODS, limit="2", **{"continue": first["metadata"]["continue"]})
    assert names(second) == ["n2", "n3"]
    assert second["metadata"]["resourceVersion"] == snapshot
    third = await ok(http, api, PODS, limit="2", **{"continue": second["metadata"]["continue"]})
    assert names(third) == ["n4"]
    assert third["metadata"] == {"resourceVersion": snapshot}
    fresh = await ok(http, api, PODS)
    assert names(fresh) == ["n0", "n1", "n3", "n4", "n5"]

    # With a selector the count of what remains is unknown; resourceVersion=0 (the cache) ignores limit.
    selected = await ok(http, api, PODS, limit="2", labelSelector="!gpu")
    assert "remainingItemCount" not in selected["metadata"]
    assert "continue" in selected["metadata"]
    cached = await ok(http, api, PODS, limit="2", resourceVersion="0")
    assert (names(cached), cached["metadata"]) == (names(fresh), {"resourceVersion": api.resource_version})

    # A token older than the kept history gets 410, with a token that goes on at the latest state.
    page = await ok(http, api, PODS, limit="2")
    api.add_pod("default", "n00")
    api.expire_history()
    status, expired = await get(http, api, PODS, limit="2", **{"continue": page["metadata"]["continue"]})
    assert status == 410
    assert (expired["reason"], expired["code"]) == ("Expired", 410)
    assert expired["message"].startswith("The provided continue parameter is too old")
    status, rest = await get(http, api, PODS, limit="10", **{"continue": expired["metadata"]["continue"]})
    assert (status, names(rest)) == (200, ["n3", "n4", "n5"])

    status, bad = await get(http, api, PODS, **{"continue": "not-a-token"})
    assert (status, bad["reason"]) == (400, "BadRequest")
    assert bad["message"].startswith("continue key is not valid")


async def test_watch_from_the_list_resource_version(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    api.add_pod("default", "old")
    listed = await ok(http, api, PODS)
    since = listed["metadata"]["resourceVersion"]
    async with watching(http, api, resourceVersion=since) as watch:
        api.add_pod("default", "a", ip="10.0.0.1")
        api.update_pod("default", "a", phase="Running", ready=True)
        api.update_pod("default", "a", ready=True)  # no change: no event, as on a real server
        api.update_pod("default", "a", terminating=True)
        api.delete_pod("default", "a")
        api.add_pod("other", "elsewhere")  # another namespace: not this watch's
        events = [await next_event(watch) for _ in range(4)]
    assert [event_of(e) for e in events] == [
        ("ADDED", "a", "2"),
        ("MODIFIED", "a", "3"),
        ("MODIFIED", "a", "4"),
        ("DELETED", "a", "5"),
    ]
    assert all(e["object"]["kind"] == "Pod" and e["object"]["apiVersion"] == "v1" for e in events)
    assert events[1]["object"]["status"]["phase"] == "Running"
    terminating = events[2]["object"]["metadata"]
    assert terminating["deletionTimestamp"].endswith("Z")
    assert terminating["deletionGracePeriodSeconds"] == 30
    # The DELETED event carries the last state, at the delete's resourceVersion.
    assert events[3]["object"]["status"]["phase"] == "Running"
    assert "deletionTimestamp" in events[3]["object"]["metadata"]

    # Resuming from the same resourceVersion replays the kept events, then goes on live.
    async with watching(http, api, resourceVersion=since) as watch:
        replayed = [event_of(await next_event(watch)) for _ in range(4)]
        assert replayed == [event_of(e) for e in events]
        api.add_pod("default", "b")
        assert event_of(await next_event(watch)) == ("ADDED", "b", "7")
    # Without a resourceVersion: ADDED for every pod there is, then live events.
    async with watching(http, api) as watch:
        assert [event_of(await next_event(watch)) for _ in range(2)] == [("ADDED", "b", "7"), ("ADDED", "old", "1")]
        api.delete_pod("default", "old")
        assert event_of(await next_event(watch)) == ("DELETED", "old", "8")
    assert api.watches == 3


async def test_selector_change_is_deleted_or_added(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    api.add_pod("default", "a", labels={"app": "engine"})
    async with watching(http, api, resourceVersion=api.resource_version, labelSelector="app=engine") as watch:
        api.update_pod("default", "a", labels={"app": "other"})
        gone = await next_event(watch)
        assert event_of(gone) == ("DELETED", "a", "2")
        assert gone["object"]["metadata"]["labels"] == {"app": "engine"}  # the state it was selected in
        api.update_pod("default", "a", ready=True)  # not selected: nothing
        api.update_pod("default", "a", labels={"app": "engine"})
        assert event_of(await next_event(watch)) == ("ADDED", "a", "4")
    async with watching(http, api, resourceVersion=api.resource_version, fieldSelector="status.phase=Running") as watch:
        api.update_pod("default", "a", phase="Running")
        assert event_of(await next_event(watch)) == ("ADDED", "a", "5")
        api.update_pod("default", "a", phase="Failed")
        assert event_of(await next_event(watch)) == ("DELETED", "a", "6")


async def test_bookmarks_only_when_asked(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    api.add_pod("default", "a")
    since = api.resource_version
    async with (
        watching(http, api, resourceVersion=since, allowWatchBookmarks="true") as marked,
        watching(http, api, resourceVersion=since) as plain,
    ):
        bookmark = await next_event(marked, within=1.0)
        assert bookmark == {
            "type": "BOOKMARK",
            "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": since}},
        }
        api.add_pod("default", "b")
        assert event_of(await next_event(marked)) == ("ADDED", "b", "2")
        assert (await next_event(marked, within=1.0))["object"]["metadata"]["resourceVersion"] == "2"
        assert event_of(await next_event(plain)) == ("ADDED", "b", "2")
        await silent(plain, within=0.5)


async def test_too_old_resource_version_is_410(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    api.add_pod("default", "a")
    old = api.resource_version
    api.add_pod("default", "b")
    api.expire_history()
    async with watching(http, api, resourceVersion=old) as watch:
        assert await next_event(watch) == {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": "too old resource version: 1 (2)",
                "reason": "Expired",
                "code": 410,
            },
        }
        assert await next_line(watch) == b""  # and the server ends the watch
    async with watching(http, api, resourceVersion=api.resource_version) as watch:
        await silent(watch, within=0.3)  # from the current one: fine

    async with FakeKubeApi(history=2) as small:
        for i in range(5):
            small.add_pod("default", f"p{i}")
        async with watching(http, small, resourceVersion="2") as watch:
            assert (await next_event(watch))["object"]["message"] == "too old resource version: 2 (3)"
        async with watching(http, small, resourceVersion="3") as watch:
            assert [event_of(await next_event(watch)) for _ in range(2)] == [("ADDED", "p3", "4"), ("ADDED", "p4", "5")]


async def test_too_large_resource_version(
    api: FakeKubeApi, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fake_kube, "TOO_LARGE_WAIT", 0.3)
    status, answer = await get(http, api, PODS, watch="1", resourceVersion="5")
    assert (status, answer["reason"]) == (504, "Timeout")
    assert answer["message"] == "Too large resource version: 5, current: 0"
    assert answer["details"]["causes"][0]["reason"] == "ResourceVersionTooLarge"
    # One the server reaches while the watch waits is fine.
    asyncio.get_running_loop().call_later(0.1, lambda: api.add_pod("default", "a"))
    async with watching(http, api, resourceVersion="1") as watch:
        api.add_pod("default", "b")
        assert event_of(await next_event(watch)) == ("ADDED", "b", "2")


async def test_unauthorized(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    unauthorized = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Unauthorized",
        "reason": "Unauthorized",
        "code": 401,
    }
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-token"}):
        async with http.get(api.url + PODS, headers=headers) as response:
            assert response.status == 401
            assert await response.json() == unauthorized
    api.token = "rotated"
    status, answer = await get(http, api, PODS)
    assert (status, answer) == (401, unauthorized)
    async with http.get(api.url + PODS, headers={"Authorization": "Bearer rotated"}) as response:
        assert response.status == 200


async def test_forbidden(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    api.forbid("default", "list")
    status, answer = await get(http, api, PODS)
    assert status == 403
    assert answer == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'pods is forbidden: User "{USER}" cannot list resource "pods" in API group "" '
        'in the namespace "default"',
        "reason": "Forbidden",
        "details": {"kind": "pods"},
        "code": 403,
    }
    status, answer = await get(http, api, "/api/v1/pods")
    assert status == 403
    assert answer["message"].endswith('cannot list resource "pods" in API group "" at the cluster scope')
    assert (await get(http, api, "/api/v1/namespaces/other/pods"))[0] == 200
    async with watching(http, api):  # another verb
        pass
    api.forbid(None, "watch")
    status, answer = await get(http, api, "/api/v1/namespaces/other/pods", watch="true")
    assert status == 403
    assert 'cannot watch resource "pods"' in answer["message"]
    api.allow()
    assert (await get(http, api, PODS))[0] == 200


async def test_not_found_and_method_not_allowed(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    status, answer = await get(http, api, "/api/v1/services")
    assert (status, answer["reason"]) == (404, "NotFound")
    async with http.post(api.url + PODS, headers=AUTH, json={}) as response:
        assert response.status == 405
        assert (await response.json())["reason"] == "MethodNotAllowed"


async def test_dropped_event_only_a_relist_sees(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    api.add_pod("default", "a")
    api.add_pod("default", "b")
    since = api.resource_version
    async with watching(http, api, resourceVersion=since) as watch:
        api.drop_events(1, "DELETED")
        api.delete_pod("default", "a")
        api.delete_pod("default", "b")
        assert event_of(await next_event(watch)) == ("DELETED", "b", "4")
    async with watching(http, api, resourceVersion=since) as watch:  # not even replayed
        assert event_of(await next_event(watch)) == ("DELETED", "b", "4")
    answer = await ok(http, api, PODS)
    assert (names(answer), answer["metadata"]["resourceVersion"]) == ([], "4")


async def test_stalled_watches_stay_silent(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    api.add_pod("default", "a")
    async with watching(http, api, resourceVersion="0", allowWatchBookmarks="true") as stalled:
        assert event_of(await next_event(stalled)) == ("ADDED", "a", "1")
        assert (await next_event(stalled))["type"] == "BOOKMARK"
        api.stall_watches()
        api.update_pod("default", "a", ready=True)
        await silent(stalled, within=0.4)  # two bookmark intervals, and the event: nothing
        async with watching(http, api, allowWatchBookmarks="true") as new:
            await silent(new, within=0.4)
        api.resume_watches()
        async with watching(http, api, allowWatchBookmarks="true") as new:
            assert event_of(await next_event(new)) == ("ADDED", "a", "2")
            api.update_pod("default", "a", phase="Running")
            assert event_of(await next_event(new)) == ("MODIFIED", "a", "3")
        await silent(stalled, within=0.4)  # broken for good
    answer = await ok(http, api, PODS)  # lists work all along
    assert answer["metadata"]["resourceVersion"] == "3"


async def test_closed_watch(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    api.add_pod("default", "a")
    async with watching(http, api) as watch:
        await next_event(watch)
        api.close_watches()
        with pytest.raises(aiohttp.ClientPayloadError):  # no end of the chunked body
            await asyncio.wait_for(watch.content.read(), 2)
    async with watching(http, api) as watch:  # a new one works
        assert event_of(await next_event(watch)) == ("ADDED", "a", "1")


async def test_closed_mid_event(api: FakeKubeApi) -> None:
    api.add_pod("default", "a", labels={"app": "engine"})
    reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
    try:
        writer.write(f"GET {PODS}?watch=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-token\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert b"transfer-encoding: chunked" in head.lower()
        added = json.loads(await read_chunk(reader))
        assert event_of(added) == ("ADDED", "a", "1")
        api.close_watches(mid_event=True)
        rest = await asyncio.wait_for(reader.read(), 2)  # until the server closes
    finally:
        writer.close()
    body, complete = dechunk(rest)
    assert not complete  # no zero-length last chunk: the connection broke
    assert body
    assert b"\n" not in body  # half a line, no newline
    assert body.startswith(b'{"type":"MODIFIED","object":{"kind":"Pod"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(body)


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    size = int((await asyncio.wait_for(reader.readline(), 2)).strip(), 16)
    return (await reader.readexactly(size + 2))[:-2]


def dechunk(raw: bytes) -> tuple[bytes, bool]:
    """A chunked body's payload, and whether it ended with the zero-length last chunk."""
    body = b""
    while raw:
        size_line, _, raw = raw.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body, True
        body, raw = body + raw[:size], raw[size + 2 :]
    return body, False


async def test_go_down_and_come_up(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    api.add_pod("default", "a")
    url = api.url
    async with watching(http, api) as watch:
        await next_event(watch)
        await api.go_down()
        with pytest.raises(aiohttp.ClientError):
            await asyncio.wait_for(watch.content.read(), 2)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", api.port)
    api.add_pod("default", "b")  # while down
    await api.come_up()
    assert api.url == url
    status, answer = await get(http, api, PODS)
    assert (status, names(answer), answer["metadata"]["resourceVersion"]) == (200, ["a", "b"], "2")
    async with watching(http, api, resourceVersion="1") as watch:
        assert event_of(await next_event(watch)) == ("ADDED", "b", "2")


async def test_fixed_port() -> None:
    async with FakeKubeApi() as first:
        port = first.port
    async with FakeKubeApi(port=port) as second:
        assert second.url == f"http://127.0.0.1:{port}"


async def test_timeout_seconds_ends_the_watch(api: FakeKubeApi, http: aiohttp.ClientSession) -> None:
    started = time.monotonic()
    async with watching(http, api, timeoutSeconds="1", allowWatchBookmarks="true") as watch:
        body = await asyncio.wait_for(watch.content.read(), 3)  # a clean end, no error
    assert 0.9 < time.monotonic() - started < 2.5
    assert all(json.loads(line)["type"] == "BOOKMARK" for line in body.splitlines())


def test_state_checks() -> None:
    api = FakeKubeApi()
    api.add_pod("default", "a")
    with pytest.raises(ValueError, match="already exists"):
        api.add_pod("default", "a")
    with pytest.raises(KeyError):
        api.update_pod("default", "nope", ready=True)
    with pytest.raises(ValueError, match="phase"):
        api.update_pod("default", "a", phase="Sleeping")
    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 address"):
        api.update_pod("default", "a", ip="10.0.0.300")
    with pytest.raises(ValueError, match="labels"):
        api.update_pod("default", "a", labels={"app": "-x"})
    pod: Any = api.update_pod("default", "a", ip="fd00::5", labels=None)
    assert pod["status"]["podIPs"] == [{"ip": "fd00::5"}]
    assert api.resource_version == "2"
