"""Locust load for OpenAI-compatible servers: pdproxy, a single node, or any other.

    locust -f bench/locustfile.py --headless -u 32 -r 8 -t 60s --host http://127.0.0.1:8000

Besides request latency it records, as locust metrics (request type ``METRIC``):
``time_to_first_token`` and ``inter_token_latency`` (ms, streams) and ``tokens_per_second``
(tokens per second of each answer, reported in the response-time column). Settings from the
environment: LOAD_MODEL (default: the first of /v1/models), LOAD_API (chat or completions),
LOAD_STREAM (share of streamed requests, 0..1), LOAD_PROMPT_WORDS, LOAD_MAX_TOKENS,
LOAD_API_KEY.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from locust import HttpUser, constant, task

API = os.environ.get("LOAD_API", "chat")
STREAM_SHARE = float(os.environ.get("LOAD_STREAM", "0.5"))
PROMPT_WORDS = int(os.environ.get("LOAD_PROMPT_WORDS", "32"))
MAX_TOKENS = int(os.environ.get("LOAD_MAX_TOKENS", "64"))
WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch".split()


class OpenAIUser(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        key = os.environ.get("LOAD_API_KEY")
        if key:
            self.client.headers["authorization"] = f"Bearer {key}"
        self.model = os.environ.get("LOAD_MODEL") or self._first_model()

    def _first_model(self) -> str | None:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as r:
            try:
                return str(r.json()["data"][0]["id"])
            except (ValueError, KeyError, IndexError):
                r.failure("no model listed")
                return None

    def _body(self, stream: bool) -> tuple[str, dict[str, Any]]:
        prompt = " ".join(random.choices(WORDS, k=PROMPT_WORDS))
        body: dict[str, Any] = {"model": self.model, "max_tokens": MAX_TOKENS, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if API == "completions":
            return "/v1/completions", {**body, "prompt": prompt}
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}

    def _metric(self, name: str, value: float) -> None:
        self.environment.events.request.fire(
            request_type="METRIC", name=name, response_time=value, response_length=0, exception=None, context={}
        )

    @task
    def complete(self) -> None:
        stream = random.random() < STREAM_SHARE
        path, body = self._body(stream)
        name = f"{path} ({'stream' if stream else 'non-stream'})"
        started = time.perf_counter()
        if not stream:
            with self.client.post(path, json=body, name=name, catch_response=True) as r:
                try:
                    tokens = r.json()["usage"]["completion_tokens"]
                except (ValueError, KeyError, TypeError):
                    r.failure(f"status {r.status_code}: not a completion")
                    return
            self._metric("tokens_per_second", tokens / max(time.perf_counter() - started, 1e-9))
            return
        with self.client.post(path, json=body, name=name, stream=True, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"status {r.status_code}")
                return
            first = last = None
            tokens = 0
            done = False
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.failure(f"stream error: {chunk['error'].get('code')}")
                    return
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                    self._metric("time_to_first_token", (now - started) * 1000)
                elif last is not None:
                    self._metric("inter_token_latency", (now - last) * 1000)
                last = now
                tokens += 1
            if not done:
                r.failure("the stream ended without [DONE]")
                return
        if first is not None and last is not None and tokens > 1:
            self._metric("tokens_per_second", tokens / max(last - started, 1e-9))
