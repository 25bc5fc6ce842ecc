"""The worker routes of the SGLang gateway and vllm-router, so that scripts written for them keep
working: ``POST /add_worker?url=``, ``POST /remove_worker?url=``, ``GET /list_workers``,
``GET /get_loads`` and ``POST /flush_cache``. They act on the same node table as ``/nodes/*``
(a worker added here is in ``/nodes/status``, the dashboard and ``pdproxy status``) and sit behind
the admin keys. Their successes answer what those routers answer (text for adding and removing,
the same JSON shapes for the lists); their failures are pdproxy's own error bodies."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

import aiohttp

from .asgi_types import HTTPReceive, HTTPScope
from .errors import InvalidRequest
from .json_types import JsonObject
from .node_record import NodeRecord
from .route_table import PlainText, Route
from .tls import node_session

if TYPE_CHECKING:
    from .fleet import Fleet

__all__ = ["PEER_ROUTES", "readiness"]


def _url_param(scope: HTTPScope) -> str:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    urls = query.get("url")
    if not urls or not urls[0].strip():
        raise InvalidRequest("give the worker's URL as ?url=http://HOST:PORT", param="url")
    return urls[0].strip()


async def add_worker(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    url, _ = await fleet.add(NodeRecord.checked({"url": _url_param(scope)}))
    return 200, PlainText(f"Successfully added worker: {url}")


async def remove_worker(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    url = await fleet.remove(_url_param(scope))
    return 200, PlainText(f"Successfully removed worker: {url}")


async def list_workers(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    return 200, {"urls": [node["url"] for node in fleet.router.nodes()]}


async def get_loads(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    # The load is what pdproxy itself counts: the worker's requests in flight through it.
    return 200, {"workers": [{"worker": n["url"], "load": n["in_flight"]} for n in fleet.router.nodes()]}


async def flush_cache(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    """Asks every node to flush its prefix cache (SGLang's and vLLM's ``POST /flush_cache``)."""
    urls = [node["url"] for node in fleet.router.nodes()]
    async with node_session(fleet.settings.node_ca_file, fleet.settings.admin_timeout) as session:
        answers = await asyncio.gather(*(_flush(session, url, fleet.api_key_of(url)) for url in urls))
    results = dict(zip(urls, answers, strict=True))
    failed = [url for url, result in results.items() if "error" in result]
    return (502 if failed else 200), {"results": results, "failed": failed}


async def _flush(session: aiohttp.ClientSession, url: str, key: str | None) -> JsonObject:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        async with session.post(f"{url}/flush_cache", headers=headers, allow_redirects=False) as answer:
            await answer.read()
            if 200 <= answer.status < 300:
                return {"status": answer.status}
            if answer.status in (404, 405):  # an engine without the route (vLLM names it otherwise)
                return {"status": answer.status, "supported": False}
            return {"status": answer.status, "error": f"the node answered {answer.status}"}
    except (aiohttp.ClientError, TimeoutError) as e:
        return {"error": f"the node could not be reached ({type(e).__name__})"}


def readiness(fleet: Fleet) -> tuple[int, JsonObject]:
    """vllm-router's and the SGLang gateway's ``/readiness``: ready with a healthy node (with
    DistServe, a healthy prefill node and a healthy decode node)."""
    nodes = fleet.router.nodes()
    healthy = [n for n in nodes if n["state"] == "healthy"]
    roles = {n["role"] for n in healthy}
    ready = {"prefill", "decode"} <= roles if fleet.pd is not None else bool(healthy)
    if ready:
        return 200, {"status": "ready", "healthy_workers": len(healthy), "total_workers": len(nodes)}
    reason = "no healthy prefill and decode workers" if fleet.pd is not None else "no healthy workers available"
    return 503, {"status": "not_ready", "reason": reason, "total_workers": len(nodes)}


PEER_ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/add_worker",
        add_worker,
        "SGLang gateway / vllm-router: add the worker `?url=` (a node, as /nodes/add makes one)",
        None,
        None,
        {200: "Added (text)", 400: "No URL, or a URL that cannot be a node"},
    ),
    Route(
        "POST",
        "/remove_worker",
        remove_worker,
        "SGLang gateway / vllm-router: remove the worker `?url=`",
        None,
        None,
        {200: "Removed (text)", 404: "Unknown worker"},
    ),
    Route(
        "GET",
        "/list_workers",
        list_workers,
        "SGLang gateway / vllm-router: the workers' URLs",
        None,
        None,
        {200: '{"urls": [...]}'},
    ),
    Route(
        "GET",
        "/get_loads",
        get_loads,
        "SGLang gateway / vllm-router: each worker's requests in flight through this proxy",
        None,
        None,
        {200: '{"workers": [{"worker": URL, "load": N}]}'},
    ),
    Route(
        "POST",
        "/flush_cache",
        flush_cache,
        "Ask every node to flush its prefix cache; each node's result (`supported: false` for one without the route)",
        None,
        None,
        {200: "Every node flushed", 502: "Some nodes did not (`failed`)"},
    ),
)
