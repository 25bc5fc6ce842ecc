"""What an engine's answers look like, as data that can be recorded and compared: the shape of
JSON (keys and value types, not values), the families of a Prometheus text (their TYPE and label
names). The real-engine tier records a real vLLM's (tests/fixtures/vllm-*.json) and checks the
live engine still answers so; the main suite checks the mock engine's vLLM dialect against the
same record, so that the two cannot drift apart silently."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"
#: The vLLM the record was made from (scripts/real_engine.sh installs it).
VLLM_VERSION = "0.32.0"
RECORD = FIXTURES / f"vllm-{VLLM_VERSION}.json"

MODEL_LEN_EXCEEDED = 1 << 20  # max_tokens no model's context holds


def shape(value: Any) -> Any:
    """A JSON value's structure: its keys, recursively, and the types of its values."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def stream_shapes(events: list[str]) -> list[Any]:
    """The shapes of a stream's events in order, a run of equal shapes kept once (how many
    tokens a model sends is not the protocol); ``[DONE]`` as itself."""
    shapes: list[Any] = []
    for event in events:
        one = event if event == "[DONE]" else shape(json.loads(event))
        if not shapes or shapes[-1] != one:
            shapes.append(one)
    return shapes


def metric_families(text: str, prefix: str = "vllm:") -> dict[str, dict[str, Any]]:
    """Each family named in a ``# TYPE`` line (as written there: counters with ``_total``, as
    vLLM writes them), with its type and the label names of its samples."""
    families: dict[str, dict[str, Any]] = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        if name.startswith(prefix):
            families[name] = {"type": kind, "labels": set()}
    for line in text.splitlines():
        match = re.match(r"([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s", line)
        if not match or line.startswith("#"):
            continue
        sample, labels = match.group(1), match.group(2) or ""
        family = next((f for f in _family_names(sample) if f in families), None)
        if family is not None:
            names = set(re.findall(r'(\w+)="', labels)) - {"le", "quantile"}
            families[family]["labels"] |= names
    return {name: {"type": f["type"], "labels": sorted(f["labels"])} for name, f in sorted(families.items())}


def _family_names(sample: str) -> list[str]:
    """The families a sample may belong to (a histogram's ``_bucket`` its family's)."""
    names = [sample]
    for suffix in ("_bucket", "_count", "_sum", "_created"):
        if sample.endswith(suffix):
            names.append(sample.removesuffix(suffix))
    return names


def requests(model: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """The requests whose answers are recorded, by name: (path, body)."""
    # Eight tokens whatever the model samples (random weights may end an answer at once).
    fixed = {"max_tokens": 8, "ignore_eos": True}
    chat = {"model": model, "messages": [{"role": "user", "content": "hello world"}], **fixed}
    completion = {"model": model, "prompt": "hello world", **fixed}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    return {
        "chat": ("/v1/chat/completions", chat),
        "chat_stream": ("/v1/chat/completions", {**chat, **usage}),
        "completion": ("/v1/completions", completion),
        "completion_stream": ("/v1/completions", {**completion, **usage}),
        "too_long": ("/v1/chat/completions", {**chat, "max_tokens": MODEL_LEN_EXCEEDED}),
    }


#: How a test fetches: (method, path, body) -> (status, body text).
Fetch = Callable[[str, str, "dict[str, Any] | None"], Awaitable[tuple[int, str]]]


async def record_of(fetch: Fetch, model: str) -> dict[str, Any]:
    """An engine's answers, as shapes: its /v1/models card, /metrics families, and each of
    ``requests``' status and answer (a stream's events)."""
    status, text = await fetch("GET", "/v1/models", None)
    out: dict[str, Any] = {"models": {"status": status, "card": shape(json.loads(text)["data"][0])}}
    for name, (path, body) in requests(model).items():
        status, text = await fetch("POST", path, body)
        if body.get("stream") and status == 200:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            out[name] = {"status": status, "events": stream_shapes(events)}
        else:
            out[name] = {"status": status, "body": shape(json.loads(text))}
    _, text = await fetch("GET", "/metrics", None)  # after traffic: every family has samples
    out["metrics"] = metric_families(text)
    return out
