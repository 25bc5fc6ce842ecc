"""Read-only endpoints about the proxy itself: ``/v1/models`` and ``/health``."""

from __future__ import annotations

import json

from .router import Router


def json_response(status: int, payload: object) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return status, [(b"content-type", b"application/json")], json.dumps(payload).encode()


def models(router: Router) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The OpenAI ``ModelList`` of every model some node serves."""
    cards = [{"id": m, "object": "model", "created": 0, "owned_by": "pdproxy"} for m in router.models()]
    return json_response(200, {"object": "list", "data": cards})


def health(router: Router) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The proxy is up; says how many nodes it routes to."""
    return json_response(200, {"status": "healthy", "nodes": len(router.nodes())})
