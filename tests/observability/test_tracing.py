"""Tracing against a local OTLP/HTTP receiver: one trace per request under the caller's
`traceparent`, with spans for admission, selection, each attempt and each PD leg, and the
node called with the same trace."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from otlp_receiver import attributes, otlp_receiver
from pdproxy.testing import MockEngine, MockSettings
from servers import chat_body, eventually, pdproxy_serve, register

# One pipeline serves both edges: this suite runs against the Rust edge (test_proxy.py and the
# tests marked with the `edge` fixture cover the --edge granian transport).


def by_id(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["spanId"]: s for s in spans}


def chain(span: dict[str, Any], spans: dict[str, dict[str, Any]]) -> list[str]:
    """The names from `span` up to the request's root."""
    names = [span["name"]]
    while span["name"] != "pdproxy.request":
        span = spans[span["parentSpanId"]]
        names.append(span["name"])
    return names


def node_context(record: dict[str, Any]) -> tuple[str, str, str]:
    """The trace id, span id and flags a node was called with."""
    _, trace_id, span_id, flags = record["headers"]["traceparent"].split("-")
    return trace_id, span_id, flags


async def test_a_request_is_one_trace_under_the_callers_span(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with MockEngine(MockSettings(port=0, model="m")) as engine:
        with (
            otlp_receiver() as otlp,
            pdproxy_serve(tmp_path, "--otlp-endpoint", otlp.url, "--access-log") as proxy,
        ):
            await register(http, proxy.url, engine, 1)
            trace_ids = []
            for stream in (False, True):
                trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
                trace_ids.append(trace_id)
                headers = {"traceparent": f"00-{trace_id}-{caller}-01", "tracestate": "vendor=1"}
                body = chat_body("m", stream=stream, max_tokens=4)
                async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200
                    await r.read()
                await eventually(lambda t=trace_id: bool(otlp.named(t, "pdproxy.request")), "the request's root span")
                spans = by_id(otlp.trace(trace_id))
                (root,) = otlp.named(trace_id, "pdproxy.request")
                assert root["parentSpanId"] == caller
                assert root["kind"] == 2
                assert attributes(root)["pdproxy.model"] == "m"
                assert attributes(root)["pdproxy.node"] == engine.url
                assert attributes(root)["http.response.status_code"] == "200"
                (attempt,) = otlp.named(trace_id, "pdproxy.attempt")
                assert attempt["kind"] == 3
                assert chain(attempt, spans) == ["pdproxy.attempt", "pdproxy.request"]
                assert attributes(attempt)["pdproxy.node"] == engine.url
                (select,) = otlp.named(trace_id, "pdproxy.select")
                assert chain(select, spans) == ["pdproxy.select", "pdproxy.admission", "pdproxy.request"]
                assert attributes(select)["pdproxy.node"] == engine.url
                assert attributes(select)["pdproxy.candidates"] == "1"
                assert attributes(select)["pdproxy.policy"] == "scored"  # the default
                assert attributes(otlp.named(trace_id, "pdproxy.admission")[0])["pdproxy.queued"] == "false"
                for span in spans.values():
                    assert int(root["startTimeUnixNano"]) <= int(span["startTimeUnixNano"])
                    assert int(span["startTimeUnixNano"]) <= int(span["endTimeUnixNano"])
                # The node was called within the same trace, as the attempt's child.
                record = engine.state.records[-1]
                assert node_context(record) == (trace_id, attempt["spanId"], "01")
                assert record["headers"]["tracestate"] == "vendor=1"
            assert {r["attributes"][0]["value"]["stringValue"] for r in otlp.resources} == {"pdproxy"}
        log = proxy.log()
        for trace_id in trace_ids:
            assert f"trace_id={trace_id}" in log, "the access log names each request's trace"


async def test_untraced_callers_start_a_trace_and_otel_variables_are_honoured(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with MockEngine(MockSettings(port=0, model="m")) as engine:
        with otlp_receiver() as otlp:
            env = {
                "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url.removesuffix("/v1/traces"),
                "OTEL_EXPORTER_OTLP_HEADERS": "x-team=blue%20team",
                "OTEL_SERVICE_NAME": "gateway-7",
            }
            async with pdproxy_serve(tmp_path, env=env) as proxy:
                await register(http, proxy.url, engine, 1)
                async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
                    assert r.status == 200
                trace_id, span_id, flags = node_context(engine.state.records[-1])
                assert flags == "01"
                await eventually(lambda: bool(otlp.named(trace_id, "pdproxy.request")), "the new trace")
                (root,) = otlp.named(trace_id, "pdproxy.request")
                assert "parentSpanId" not in root, "a new trace starts at the proxy"
                (attempt,) = otlp.named(trace_id, "pdproxy.attempt")
                assert attempt["spanId"] == span_id
                assert otlp.headers[-1]["x-team"] == "blue team"
                assert otlp.resources[-1]["attributes"][0]["value"]["stringValue"] == "gateway-7"


async def test_unsampled_traces_are_passed_on_and_not_exported(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with MockEngine(MockSettings(port=0, model="m")) as engine:
        with otlp_receiver() as otlp, pdproxy_serve(tmp_path, "--otlp-endpoint", otlp.url) as proxy:
            await register(http, proxy.url, engine, 1)
            skipped, kept = secrets.token_hex(16), secrets.token_hex(16)
            for trace_id, flags in ((skipped, "00"), (kept, "01")):
                headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"}
                async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m"), headers=headers) as r:
                    assert r.status == 200
                got_trace, _, got_flags = node_context(engine.state.records[-1])
                assert (got_trace, got_flags) == (trace_id, flags), "the caller's decision travels on"
            await eventually(lambda: bool(otlp.trace(kept)), "the sampled trace")
            assert otlp.trace(skipped) == [], "the caller did not sample it (parentbased_always_on)"


async def test_refusals_are_traced_as_errors(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    with otlp_receiver() as otlp, pdproxy_serve(tmp_path, "--otlp-endpoint", otlp.url) as proxy:
        trace_id = secrets.token_hex(16)
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("nope"), headers=headers) as r:
            assert r.status in (404, 503)
            status = r.status
        await eventually(lambda: bool(otlp.named(trace_id, "pdproxy.request")), "the refused request's span")
        (root,) = otlp.named(trace_id, "pdproxy.request")
        assert root["status"]["code"] == 2
        assert root["status"]["message"]
        assert attributes(root)["http.response.status_code"] == str(status)


@pytest.mark.parametrize("protocol", ["vllm", "sglang", "lmdeploy"])
async def test_each_pd_leg_is_a_span_with_its_attempt(
    tmp_path: Path, protocol: str, pd_engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = pd_engines
    args = ["--serving-strategy", "DistServe", "--pd-protocol", protocol]
    with otlp_receiver() as otlp, pdproxy_serve(tmp_path, *args, "--otlp-endpoint", otlp.url) as proxy:
        await register(http, proxy.url, prefill, 2)
        await register(http, proxy.url, decode, 3)
        trace_id = secrets.token_hex(16)
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        body = chat_body("m", stream=True, max_tokens=4)
        async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            await r.read()
        await eventually(lambda: bool(otlp.named(trace_id, "pdproxy.request")), "the request's root span")
        spans = by_id(otlp.trace(trace_id))
        for leg, engine in (("pdproxy.prefill", prefill), ("pdproxy.decode", decode)):
            (span,) = otlp.named(trace_id, leg)
            assert chain(span, spans) == [leg, "pdproxy.request"]
            assert attributes(span)["http.response.status_code"] == "200"
            attempts = [a for a in otlp.named(trace_id, "pdproxy.attempt") if a["parentSpanId"] == span["spanId"]]
            assert [attributes(a)["pdproxy.node"] for a in attempts] == [engine.url]
            called = [r for r in engine.state.records if r["path"] == "/v1/chat/completions"][-1]
            assert node_context(called) == (trace_id, attempts[0]["spanId"], "01")


async def test_the_last_spans_are_exported_when_the_proxy_stops(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with MockEngine(MockSettings(port=0, model="m")) as engine:
        with otlp_receiver() as otlp:
            async with pdproxy_serve(tmp_path, "--otlp-endpoint", otlp.url) as proxy:
                await register(http, proxy.url, engine, 1)
                trace_id = secrets.token_hex(16)
                headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
                async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m"), headers=headers) as r:
                    assert r.status == 200
                assert proxy.stop() == 0, "stopped at once, within the exporter's batching delay"
            assert otlp.named(trace_id, "pdproxy.request"), "flushed on the way out"
            assert otlp.named(trace_id, "pdproxy.attempt")
