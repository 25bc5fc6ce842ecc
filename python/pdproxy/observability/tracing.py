"""Tracing settings from OpenTelemetry's standard environment, and the trace id on log lines.

The spans themselves are made and exported by the data plane (``rust/src/trace.rs``); the
control plane only opens a request's trace (``Router.core.trace``) and names its legs.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Mapping
from urllib.parse import unquote

from pdproxy._pdproxy import Response, Trace
from pdproxy.config.settings import Settings
from pdproxy.errors import ConfigError

#: The trace of the request being served (for log lines written while serving it).
current_trace_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdproxy_trace_id", default=None)

SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


def otel_settings(settings: Settings, env: Mapping[str, str]) -> dict[str, object]:
    """The tracing settings left unset, filled from ``OTEL_*`` variables and OpenTelemetry's
    defaults (``OTEL_SDK_DISABLED=true`` turns tracing off)."""
    out: dict[str, object] = {}
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    if not settings.observability.otlp_endpoint and not disabled:
        if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            out["otlp_endpoint"] = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].strip()
        elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            out["otlp_endpoint"] = env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip().rstrip("/") + "/v1/traces"
    if not settings.observability.otlp_headers:
        raw = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS") or ""
        # W3C baggage format: name=value pairs separated by commas, values percent-encoded.
        pairs = [p.split("=", 1) for p in raw.split(",") if "=" in p]
        if pairs:
            out["otlp_headers"] = tuple(f"{name.strip()}={unquote(value.strip())}" for name, value in pairs)
    if not settings.observability.service_name:
        out["service_name"] = env.get("OTEL_SERVICE_NAME", "").strip() or "pdproxy"
    if not settings.observability.trace_sampler:
        out["trace_sampler"] = env.get("OTEL_TRACES_SAMPLER", "").strip() or "parentbased_always_on"
    if settings.observability.trace_sampler_arg < 0:
        try:
            out["trace_sampler_arg"] = min(max(float(env.get("OTEL_TRACES_SAMPLER_ARG", "1")), 0.0), 1.0)
        except ValueError:
            out["trace_sampler_arg"] = 1.0
    sampler = out.get("trace_sampler", settings.observability.trace_sampler)
    if sampler not in SAMPLERS:
        raise ConfigError(f"trace_sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}")
    return out


class TraceIdFilter(logging.Filter):
    """Adds ``trace_id=...`` to lines logged while a traced request is served."""

    def filter(self, record: logging.LogRecord) -> bool:
        trace_id = current_trace_id.get()
        if trace_id is not None and not getattr(record, "_pdproxy_traced", False):
            record.msg = f"{record.getMessage()} trace_id={trace_id}"
            record.args = None
            record._pdproxy_traced = True
        return True


def trace_id_of(traceparent: bytes | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (for logs when requests are not traced here)."""
    if traceparent is None:
        return None
    parts = traceparent.strip().split(b"-")
    if len(parts) < 4 or len(parts[1]) != 32 or parts[1] == b"0" * 32:
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return parts[1].decode().lower()


def leg(trace: Trace | None, name: str) -> Trace | None:
    """A span for one leg of a disaggregated request under ``trace`` (``None`` untraced)."""
    return trace.child(name) if trace is not None else None


def end_on_answer(span: Trace | None, answer: asyncio.Future[Response]) -> None:
    """Ends a leg's ``span`` when its ``answer`` future is done: the node's status or the error."""
    if span is None:
        return

    def done(future: asyncio.Future[Response]) -> None:
        if future.cancelled():
            span.end(error="cancelled")
        elif future.exception() is not None:
            span.end(error=str(future.exception()))
        else:
            span.end(status=future.result().status)

    answer.add_done_callback(done)
