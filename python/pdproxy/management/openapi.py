"""The OpenAPI description of the proxy's own endpoints, built from the same route table
that dispatches them and the pydantic models its handlers parse and answer with, so it cannot
drift from what the proxy does."""

from __future__ import annotations

from pydantic import BaseModel

from pdproxy import __version__, _pdproxy
from pdproxy.management.nodes_api import ROUTES

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string"},
            },
        }
    },
}

#: Endpoints served outside the management table: (method, path, summary, statuses).
PROXY_ROUTES: tuple[tuple[str, str, str, dict[int, str]], ...] = (
    *(
        ("POST", path, "Inference, routed by the body's model", {200: "The node's answer"})
        for path in _pdproxy.INFERENCE_PATHS
    ),
    ("GET", "/v1/models", "Models served by healthy nodes (OpenAI ModelList)", {200: "Model list"}),
    ("GET", "/health", "The proxy is alive", {200: "Alive"}),
    ("GET", "/ready", "The proxy can route: at least one healthy node", {200: "Ready", 503: "No routable node"}),
    ("GET", "/openapi.json", "This document", {200: "OpenAPI document"}),
    ("GET", "/metrics", "Prometheus metrics (admin)", {200: "Metrics in the Prometheus text format"}),
    ("GET", "/usage", "Each tenant's limits, current window, tokens today and counts (admin)", {200: "Usage"}),
    ("GET", "/dashboard", "Live dashboard page (its data needs the admin key: /dashboard#key=KEY)", {200: "HTML"}),
    ("GET", "/dashboard/data", "The dashboard's data (admin)", {200: "Nodes, queue, in flight, PD links"}),
    ("POST", "/drain", "Stop taking requests, finish those in flight, then exit (admin)", {202: "Draining"}),
)


def _responses(statuses: dict[int, str], answer: dict[str, str] | None = None) -> dict[str, object]:
    """The responses of an operation: errors in the error body, a 200 in ``answer`` (its schema)."""
    out: dict[str, object] = {}
    for code, text in statuses.items():
        entry: dict[str, object] = {"description": text}
        if code >= 400:
            entry["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
        elif code == 200 and answer is not None:
            entry["content"] = {"application/json": {"schema": answer}}
        out[str(code)] = entry
    return out


def _model_schema(model: type[BaseModel], components: dict[str, object]) -> dict[str, str]:
    """A reference to ``model``'s JSON schema, which (with the models it uses) joins ``components``."""
    generated = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(generated.pop("$defs", {}))
    components[model.__name__] = generated
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def schema() -> dict[str, object]:
    """The OpenAPI document."""
    paths: dict[str, dict[str, object]] = {}
    components: dict[str, object] = {"Error": _ERROR}
    for method, path, summary, statuses in PROXY_ROUTES:
        paths.setdefault(path, {})[method.lower()] = {"summary": summary, "responses": _responses(statuses)}
    for route in ROUTES:
        statuses = {**route.responses, 401: "Missing or wrong admin key"}
        body = None if route.body is None else _model_schema(route.body, components)
        answer = None if route.answer is None else _model_schema(route.answer, components)
        operation: dict[str, object] = {
            "summary": route.summary,
            "tags": ["nodes"],
            "responses": _responses(statuses, answer),
        }
        if body is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdproxy", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
