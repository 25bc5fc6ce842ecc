from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

import servers
from pdproxy.testing import MockEngine, MockSettings
from servers import Process, get_json, mock_engine, pdproxy_serve


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings must come from the test, never from the developer's shell."""
    for name in list(os.environ):
        if name.startswith("PDPROXY_") or name.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session", params=["rust", "granian"])
def edge(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the suites that use it against both edges: `pdproxy serve` with the Rust edge, and
    with granian serving the ASGI app alone (`--edge granian`); a client must not tell them apart."""
    servers.EDGE = request.param
    yield request.param
    servers.EDGE = "rust"


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Process]]:
    """Three mock engines as subprocesses: two serve `alpha`, one serves `beta`."""
    logs = tmp_path_factory.mktemp("engines")
    with mock_engine(logs, "alpha") as a1, mock_engine(logs, "alpha") as a2, mock_engine(logs, "beta") as b:
        yield {"alpha-1": a1, "alpha-2": a2, "beta": b}


def _knows_models(url: str, wanted: set[str]) -> bool:
    return {m["id"] for m in get_json(url + "/v1/models")["data"]} == wanted


@pytest.fixture(scope="session")
def proxy(engines: dict[str, Process], edge: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """`pdproxy serve` (granian subprocess) in front of the three engines, models discovered."""
    args: list[str] = ["--policy", "round_robin"]
    for engine in engines.values():
        args += ["--node", engine.url]
    with pdproxy_serve(
        tmp_path_factory.mktemp("proxy"), *args, ready=lambda url: _knows_models(url, {"alpha", "beta"})
    ) as process:
        yield process


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture
async def pd_engines() -> AsyncIterator[tuple[MockEngine, MockEngine]]:
    """A prefill and a decode mock engine in the test's loop, serving `m`."""
    async with (
        MockEngine(MockSettings(port=0, model="m", role="prefill")) as prefill,
        MockEngine(MockSettings(port=0, model="m", role="decode")) as decode,
    ):
        yield prefill, decode
