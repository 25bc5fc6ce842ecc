"""pdproxy's KV index following a real vLLM's own KV events (``--kv-events-config``, ZMQ):
what the index predicts a request finds cached is held against what vLLM reports it found
(``usage.prompt_tokens_details.cached_tokens``), and a restarted engine is known cold.

The index runs in this process (``pdproxy.Router``'s data plane and the control plane's
follower, as ``pdproxy serve --kv-events`` runs them), so each prediction can be asked for
before its request is sent."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from conftest import BLOCK_TOKENS, ENGINE_DIR, MODEL, VllmServer, start_vllm, wait_ready
from pdproxy import Router
from pdproxy.kv_events import chat_template, index_options
from pdproxy.kv_events.follower import KvEventFollower, KvEventsPlan
from servers import eventually, free_port

#: The words the tiny model's tokenizer was trained on (scripts/tiny_model.py): about one token each.
WORDS = "the model request token stream prefill decode cache node proxy answer question user system".split()


def text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def events_config(port: int, replay: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
    )


class Publishing:
    """A vLLM server publishing its KV events on ``events``/``replay`` (restartable in place)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.events, self.replay, self.port = free_port(), free_port(), free_port()
        self.server: VllmServer | None = None

    def start(self) -> VllmServer:
        args = ("--enable-prompt-tokens-details", "--kv-events-config", events_config(self.events, self.replay))
        self.server = start_vllm(self.log_dir, 0, *args, port=self.port)
        wait_ready(self.server)
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Publishing]:
    publishing = Publishing(tmp_path_factory.mktemp("vllm-kv-events"))
    try:
        publishing.start()
        yield publishing
    finally:
        publishing.stop()


@pytest.fixture
async def index(engine: Publishing) -> AsyncIterator[tuple[Router, KvEventFollower, str]]:
    """The data plane's index following the engine's events, once it prices the engine from
    them; and the engine's URL."""
    assert engine.server is not None
    url = engine.server.url
    router = Router([url], policy="scored")
    core = router.core
    core.start_kv_index(chat_template("role-tags"), 100_000, **index_options(str(ENGINE_DIR / "tiny-llama")))  # type: ignore[arg-type]
    plan = KvEventsPlan(f"tcp://{{host}}:{engine.events}", f"tcp://{{host}}:{engine.replay}")
    async with aiohttp.ClientSession() as session:
        follower = KvEventFollower(core, plan, session_of=lambda: session)
        await follower.start()
        try:
            await eventually(lambda: live(router, follower, url), timeout=30, what="vLLM's KV events followed live")
            yield router, follower, url
        finally:
            await follower.aclose()
            await router.aclose()


def messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def predicted(router: Router, url: str, chat: list[dict[str, str]]) -> int:
    (tokens,) = router.core.kv_matched(json.dumps(chat).encode(), [url])
    assert tokens is not None, "the index is live for the engine"
    return tokens


async def ask(http: aiohttp.ClientSession, url: str, chat: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": MODEL, "messages": chat, "max_tokens": 4, "ignore_eos": True}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        usage: dict[str, Any] = (await r.json())["usage"]
        return usage


async def live(router: Router, follower: KvEventFollower, url: str) -> bool:
    """Followed live, as the follower says and as the data plane has been told."""
    status = follower.statuses().get(url)
    streams = router.core.kv_index_stats()["streams"]
    assert isinstance(streams, list)
    return bool(status and status["live"]) and any(s[0] == url and s[6] for s in streams)


def blocks(router: Router, url: str) -> int:
    streams = router.core.kv_index_stats()["streams"]
    assert isinstance(streams, list)
    return sum(s[2] for s in streams if s[0] == url)


async def test_predicted_cached_tokens_agree_with_what_vllm_found(
    index: tuple[Router, KvEventFollower, str], http: aiohttp.ClientSession
) -> None:
    router, _, url = index
    # Prefix-heavy: three long system prompts, each asked five questions, interleaved.
    systems = [text(600, seed) for seed in range(3)]
    chats = [messages(systems[i % 3], f"question {i}: " + text(40, 100 + i)) for i in range(15)]
    predictions, found = [], []
    for chat in chats:
        predictions.append(predicted(router, url, chat))
        usage = await ask(http, url, chat)
        found.append(usage["prompt_tokens_details"]["cached_tokens"])
        # Before the next prediction, the index has this request's full blocks (its events came).
        stored = usage["prompt_tokens"] // BLOCK_TOKENS * BLOCK_TOKENS
        await eventually(lambda c=chat, n=stored: predicted(router, url, c) >= n, what="the request's blocks indexed")
    assert sum(found) > 0, "the workload reuses prefixes"
    print(f"vLLM found {sum(found)} cached tokens; the index predicted {sum(predictions)}: {predictions} / {found}")
    assert abs(sum(predictions) - sum(found)) <= 0.05 * sum(found), (predictions, found)


async def test_a_restarted_engine_is_known_cold(
    engine: Publishing, index: tuple[Router, KvEventFollower, str], http: aiohttp.ClientSession
) -> None:
    router, follower, url = index
    chat = messages(text(600, 7), "warm")
    await ask(http, url, chat)
    await eventually(lambda: blocks(router, url) > 0, what="its blocks indexed")
    assert engine.server is not None
    os.killpg(engine.server.proc.pid, signal.SIGKILL)  # the api_server and its engine core, at once
    gone = time.monotonic()
    await eventually(lambda: blocks(router, url) == 0, what="the restarted engine known cold")
    print(f"known cold {time.monotonic() - gone:.3f} s after the engine's server was killed")

    async def not_live() -> bool:
        return not await live(router, follower, url)

    await eventually(not_live, what="the killed engine's events no longer followed")
    engine.stop()
    engine.start()
    await eventually(
        lambda: live(router, follower, url), timeout=30, what="the restarted engine's events followed again"
    )
    assert predicted(router, url, chat) == 0
    usage = await ask(http, url, chat)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    await eventually(lambda: predicted(router, url, chat) > 0, what="its new blocks indexed")
