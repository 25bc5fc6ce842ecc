"""The mock engine's vLLM dialect against the record of a real vLLM's answers
(tests/fixtures/vllm-*.json, which the real-engine tier checks the real engine against): the same
/v1/models card, the same answer and stream shapes, the same error for a request too long, and
/metrics families a real vLLM has, with its types and label names."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from engine_shapes import RECORD, record_of
from pdproxy.fleet.engine_report import _NAMES
from pdproxy.testing import MockEngine

MODEL = "tiny"


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return dict(json.loads(RECORD.read_text()))


@pytest.fixture
async def mock(http: aiohttp.ClientSession) -> dict[str, Any]:
    async with MockEngine(model=MODEL, metrics_dialect="vllm", max_model_len=2048, simulate=True) as engine:

        async def fetch(method: str, path: str, body: dict[str, Any] | None) -> tuple[int, str]:
            async with http.request(method, engine.url + path, json=body) as r:
                return r.status, await r.text()

        return await record_of(fetch, MODEL)


@pytest.mark.parametrize("part", ["models", "chat", "chat_stream", "completion", "completion_stream", "too_long"])
def test_the_mock_answers_as_vllm_does(mock: dict[str, Any], recorded: dict[str, Any], part: str) -> None:
    assert mock[part] == recorded[part]


def test_the_mocks_metrics_are_vllms(mock: dict[str, Any], recorded: dict[str, Any]) -> None:
    real = recorded["metrics"]
    for name, family in mock["metrics"].items():
        assert name in real, f"vLLM {RECORD.stem} has no {name}"
        assert family == real[name], name
    read = {name for names in _NAMES["vllm"].values() for name in names}
    served = {name.removesuffix("_total") for name in mock["metrics"]}
    exported = {name.removesuffix("_total") for name in real}
    assert read & exported <= served, "every vLLM figure pdproxy reads is one the mock serves"
