"""Tenants with real processes: each key's limits (requests, tokens, requests at once, a daily
budget) answered with 429 and OpenAI's x-ratelimit-* headers, a reloaded tenants file, usage
per tenant, and a limit shared by two replicas through Redis."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp

from pdproxy.testing import MockEngine, MockSettings
from redis_server import redis_server
from servers import chat_body, eventually, pdproxy_serve

# One pipeline serves both edges: this suite runs against the Rust edge (test_proxy.py and the
# tests marked with the `edge` fixture cover the --edge granian transport).

ADMIN = {"authorization": "Bearer admin"}

TENANTS = """
[tenants.rpm]
keys = ["k-rpm"]
rpm = 3

[tenants.solo]
keys = ["k-solo"]
concurrency = 1

[tenants.tokens]
keys = ["k-tokens"]
tpm = 60

[tenants.budget]
keys = ["k-budget"]
daily_tokens = 30

[tenants.free]
keys = ["k-free", "k-free-2"]
"""


def key(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {name}"}


async def ask(
    http: aiohttp.ClientSession, url: str, who: str, stream: bool = False, **extra: Any
) -> tuple[int, dict[str, str], bytes]:
    body = chat_body("m", stream=stream, max_tokens=8, **extra)
    async with http.post(url + "/v1/chat/completions", json=body, headers=key(who)) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


def error_of(raw: bytes) -> dict[str, Any]:
    return dict(json.loads(raw)["error"])


async def test_each_limit_answers_429_with_the_tenants_headers(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    args = ("--tenants-file", str(tenants), "--admin-keys", "admin")
    async with (
        MockEngine(MockSettings(port=0, model="m", token_delay_ms=20)) as engine,
        pdproxy_serve(tmp_path, *args) as proxy,
    ):
        await register_as_admin(http, proxy.url, engine)
        # Requests per minute: three, then 429 with the window in the headers.
        for remaining in (2, 1, 0):
            status, headers, _ = await ask(http, proxy.url, "k-rpm")
            assert status == 200
            assert headers["x-ratelimit-limit-requests"] == "3"
            assert headers["x-ratelimit-remaining-requests"] == str(remaining)
            assert headers["x-ratelimit-reset-requests"].endswith("s")
        status, headers, raw = await ask(http, proxy.url, "k-rpm")
        assert status == 429
        assert error_of(raw)["code"] == "rate_limit_exceeded"
        assert error_of(raw)["type"] == "requests"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert 1 <= int(headers["retry-after"]) <= 20, "one request comes back within 20 s at 3/min"
        # Requests at once: a second one while the first streams.
        slow = asyncio.ensure_future(ask(http, proxy.url, "k-solo", stream=True))
        await until_in_flight(http, proxy.url, "solo", 1)
        status, headers, raw = await ask(http, proxy.url, "k-solo")
        assert status == 429
        assert "requests in flight" in error_of(raw)["message"]
        assert (await slow)[0] == 200
        await until_in_flight(http, proxy.url, "solo", 0)
        assert (await ask(http, proxy.url, "k-solo"))[0] == 200, "the slot came back"
        # Tokens per minute: the first request's usage (its answer's, streamed) spends the window.
        status, headers, _ = await ask(http, proxy.url, "k-tokens", stream=True, stream_options={"include_usage": True})
        assert status == 200
        assert headers["x-ratelimit-limit-tokens"] == "60"
        used = (await usage_of(http, proxy.url))["tokens"]
        assert used["prompt_tokens"] + used["completion_tokens"] > 0
        assert used["estimated"] == 0, "the streamed usage was read"
        status, headers, raw = await ask(http, proxy.url, "k-tokens", prompt="x" * 400)
        assert status == 429
        assert error_of(raw)["type"] == "tokens"
        assert int(headers["x-ratelimit-remaining-tokens"]) < 100
        # A daily budget runs out.
        statuses = [(await ask(http, proxy.url, "k-budget"))[0] for _ in range(4)]
        assert statuses[0] == 200
        assert statuses[-1] == 429
        status, headers, raw = await ask(http, proxy.url, "k-budget")
        assert error_of(raw)["code"] == "insufficient_quota"
        assert int(headers["retry-after"]) <= 86400
        # No key, or a key of nobody: 401.
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
            assert r.status == 401
        assert (await ask(http, proxy.url, "k-nobody"))[0] == 401
        # Usage per tenant, for the admin key only; and in /metrics.
        report = await usage_of(http, proxy.url)
        assert report["rpm"]["rejected"]["requests"] == 1
        assert report["rpm"]["total_requests"] == 3
        assert report["solo"]["rejected"]["concurrency"] == 1
        assert report["budget"]["rejected"]["budget"] >= 1
        assert report["free"]["limits"]["rpm"] is None
        async with http.get(proxy.url + "/usage", headers=key("k-free")) as r:
            assert r.status in (401, 403)
        async with http.get(proxy.url + "/metrics", headers=ADMIN) as r:
            text = await r.text()
        assert 'pdproxy_tenant_requests_total{tenant="rpm"} 3.0' in text
        assert 'pdproxy_tenant_rejected_total{limit="requests",tenant="rpm"} 1.0' in text


async def register_as_admin(http: aiohttp.ClientSession, proxy: str, engine: MockEngine) -> None:
    body = {"url": engine.url, "status": {"models": [engine.settings.model], "role": 1}}
    async with http.post(proxy + "/nodes/add", json=body, headers=ADMIN) as r:
        assert r.status in (200, 201), await r.text()


async def usage_of(http: aiohttp.ClientSession, proxy: str) -> dict[str, Any]:
    async with http.get(proxy + "/usage", headers=ADMIN) as r:
        assert r.status == 200
        return dict((await r.json())["tenants"])


async def until_in_flight(http: aiohttp.ClientSession, proxy: str, tenant: str, count: int) -> None:
    async def reached() -> bool:
        return bool((await usage_of(http, proxy))[tenant]["in_flight"] == count)

    await eventually(reached, f"tenant {tenant} to have {count} request(s) in flight", timeout=4)


async def test_a_reloaded_tenants_file_takes_effect_without_dropping_a_request(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.team]\nkeys = ["old"]\n')
    args = ("--tenants-file", str(tenants), "--admin-keys", "admin")
    async with (
        MockEngine(MockSettings(port=0, model="m", token_delay_ms=5)) as engine,
        pdproxy_serve(tmp_path, *args) as proxy,
    ):
        await register_as_admin(http, proxy.url, engine)

        async def steady(who: str, rounds: int) -> list[int]:
            return [(await ask(http, proxy.url, who, stream=True))[0] for _ in range(rounds)]

        running = asyncio.ensure_future(steady("old", 30))
        await eventually(lambda: engine.state.requests > 0, "the old key in use")
        # Both keys while the old one is still in use: nothing in flight may fail.
        tenants.write_text('[tenants.team]\nkeys = ["old", "new"]\nrpm = 1000\n')
        await until_status(http, proxy.url, "new", 200)
        assert await running == [200] * 30, "no request failed across the reload"
        report = await usage_of(http, proxy.url)
        assert report["team"]["total_requests"] >= 31, "one tenant, counts kept across the reload"
        assert report["team"]["limits"]["rpm"] == 1000
        # An invalid file is refused and the tenants stay as they were.
        tenants.write_text("[tenants.team]\nkeys = []\n")
        await eventually(lambda: "was not reloaded" in proxy.log(), "the invalid file refused")
        assert (await ask(http, proxy.url, "new"))[0] == 200
        if "--edge" not in args and proxy_edge() == "rust":
            # SIGHUP reloads at once (the file's time may not have changed).
            tenants.write_text('[tenants.team]\nkeys = ["newest"]\n')
            os.kill(proxy.proc.pid, signal.SIGHUP)
            await until_status(http, proxy.url, "newest", 200)
            assert (await ask(http, proxy.url, "old"))[0] == 401


def proxy_edge() -> str:
    import servers

    return servers.EDGE


async def until_status(http: aiohttp.ClientSession, proxy: str, who: str, status: int) -> None:
    async def answered() -> bool:
        return bool((await ask(http, proxy, who))[0] == status)

    await eventually(answered, f"key {who} to get {status}", timeout=5)


async def test_two_replicas_share_a_limit_through_redis(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.shared]\nkeys = ["k"]\nrpm = 6\n')
    async with MockEngine(MockSettings(port=0, model="m")) as engine:
        with redis_server(tmp_path) as redis:
            redis_url = redis.url
            args = (
                "--tenants-file",
                str(tenants),
                "--admin-keys",
                "admin",
                "--registry",
                redis_url,
                "--tenant-sync-interval",
                "0.2",
            )
            async with pdproxy_serve(tmp_path, *args) as a, pdproxy_serve(tmp_path, *args) as b:
                await register_as_admin(http, a.url, engine)
                for _ in range(100):
                    async with http.get(b.url + "/nodes/status", headers=ADMIN) as r:
                        if engine.url in await r.json():
                            break
                    await asyncio.sleep(0.05)
                for _ in range(6):
                    assert (await ask(http, a.url, "k"))[0] == 200
                # Within a sync or two, b has debited what a admitted.
                for _ in range(100):
                    window = (await usage_of(http, b.url))["shared"]["requests"]
                    if window["remaining"] == 0:
                        break
                    await asyncio.sleep(0.05)
                status, headers, _ = await ask(http, b.url, "k")
                assert status == 429, "the six requests a admitted count on b too"
                assert headers["x-ratelimit-remaining-requests"] == "0"
