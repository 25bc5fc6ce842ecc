"""The routes of the SGLang gateway (SMG) and vllm-router, so that scripts written for them keep
working. They act on the same node table as ``/nodes/*`` (a worker added here is in
``/nodes/status``, the dashboard and ``pdproxy status``) and sit behind the admin keys; the
probes are open, as ``/health`` is.

- Both routers: ``POST /add_worker?url=``, ``POST /remove_worker?url=``, ``GET /list_workers``,
  ``GET /get_loads``, ``POST /flush_cache``; the probes ``/liveness``, ``/readiness`` and
  ``/health_generate`` (can a healthy node generate a token).
- The gateway's REST API ``/workers``: see ``workers_api``.
- vllm-router's ``POST /finish_session?session_id=``: accepted, and nothing to release, since
  pdproxy's session affinity (``consistent_hash``) is rendezvous hashing, with no per-session table.

Their successes answer what those routers answer (text for adding and removing, the same JSON
shapes for the lists and the workers); their failures are pdproxy's own error bodies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, TypedDict
from urllib.parse import parse_qs

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from pdproxy._json_types import JsonObject
from pdproxy.errors import InvalidRequest, NodeNotFound, NoNodeAvailable
from pdproxy.fleet.node_record import NodeRecord
from pdproxy.fleet.tls import node_session
from pdproxy.management.models import parse_body
from pdproxy.management.route_table import PlainText, Route
from pdproxy.server.asgi_types import HTTPReceive, HTTPScope
from pdproxy.server.responses import header, parse_json, read_body

if TYPE_CHECKING:
    from pdproxy.fleet.fleet import Fleet

__all__ = ["BODY_LIMIT", "PEER_ROUTES", "health_generate", "query_param", "readiness"]

log = logging.getLogger("pdproxy.peer_routes")

#: The request bodies of these routes are small (as those of /nodes/*).
BODY_LIMIT = 64 << 10
#: Healthy nodes asked at once by /health_generate (per role with DistServe).
GENERATE_TRIES = 3


def query_param(scope: HTTPScope, name: str) -> str | None:
    """The query's first ``name``, unless it is missing or blank."""
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(name, [""])
    return values[0].strip() or None


def _url_param(scope: HTTPScope) -> str:
    url = query_param(scope, "url")
    if url is None:
        raise InvalidRequest("give the worker's URL as ?url=http://HOST:PORT", param="url")
    return url


async def add_worker(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    view, _ = await fleet.add(NodeRecord.checked({"url": _url_param(scope)}))
    return 200, PlainText(f"Successfully added worker: {view.url}")


async def remove_worker(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    url = await fleet.remove(_url_param(scope))
    return 200, PlainText(f"Successfully removed worker: {url}")


async def list_workers(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    return 200, {"urls": [node.url for node in fleet.router.views()]}


async def get_loads(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    # The load is what pdproxy itself counts: the worker's requests in flight through it.
    return 200, {"workers": [{"worker": n.url, "load": n.in_flight} for n in fleet.router.views()]}


async def flush_cache(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    """Asks every node to flush its prefix cache (SGLang's and vLLM's ``POST /flush_cache``)."""
    urls = [node.url for node in fleet.router.views()]
    async with node_session(fleet.settings.security.node_ca_file, fleet.settings.timeouts.admin) as session:
        answers = await asyncio.gather(*(_flush(session, url, fleet.api_key_of(url)) for url in urls))
    results = dict(zip(urls, answers, strict=True))
    for url, result in results.items():
        status = result.get("status")
        if isinstance(status, int) and 200 <= status < 300:
            # What the policies learnt each node holds went with its cache.
            with contextlib.suppress(NodeNotFound):
                fleet.router.cache_flushed(url)
    failed = [url for url, result in results.items() if "error" in result]
    return (502 if failed else 200), {"results": results, "failed": failed}


def _authorization(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


async def _flush(session: aiohttp.ClientSession, url: str, key: str | None) -> JsonObject:
    try:
        async with session.post(f"{url}/flush_cache", headers=_authorization(key), allow_redirects=False) as answer:
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
    nodes = fleet.router.views()
    healthy = [n for n in nodes if n.state == "healthy"]
    roles = {n.role for n in healthy}
    ready = {"prefill", "decode"} <= roles if fleet.pd is not None else bool(healthy)
    if ready:
        return 200, {"status": "ready", "healthy_workers": len(healthy), "total_workers": len(nodes)}
    reason = "no healthy prefill and decode workers" if fleet.pd is not None else "no healthy workers available"
    return 503, {"status": "not_ready", "reason": reason, "total_workers": len(nodes)}


# --- GET /health_generate -------------------------------------------------------------------


class HealthGenerateAnswer(TypedDict):
    status: str
    message: str


async def health_generate(fleet: Fleet) -> tuple[int, HealthGenerateAnswer]:
    """The routers' ``GET /health_generate``: 200 once a healthy node generated (with DistServe,
    a prefill node and a decode node), within ``--admin-timeout``; else ``NoNodeAvailable`` (503).

    A node is asked its own ``/health_generate`` (SGLang's); one without the route (vLLM,
    LMDeploy) is sent a one-token completion instead. The calls go to the nodes directly, not
    through the router, so they count in no node's requests and take no permit. Up to
    ``GENERATE_TRIES`` of the least busy healthy nodes are asked at once, and the first that
    generates answers: one stuck node does not make a working proxy look broken."""
    groups = _generate_groups(fleet)
    settings = fleet.settings
    async with node_session(settings.security.node_ca_file, settings.timeouts.admin) as session:
        try:
            async with asyncio.timeout(settings.timeouts.admin):
                failures = await asyncio.gather(*(_some_generates(session, fleet, urls) for _, urls in groups))
        except TimeoutError:
            failures = [[f"no node generated within {settings.timeouts.admin:g} s"]] * len(groups)
    failed = [(what, urls, why) for (what, urls), why in zip(groups, failures, strict=True) if why or not urls]
    if failed:
        message = "; ".join(_shortfall(what, urls) for what, urls, _ in failed)
        detail = "; ".join(reason for _, _, why in failed for reason in why)
        log.warning("health_generate: %s (%s)", message, detail or "no candidates")
        raise NoNodeAvailable(f"health_generate failed: {message}", detail=detail or None)
    what = " and ".join(f"a {what}" for what, _ in groups)
    return 200, HealthGenerateAnswer(status="ok", message=f"{what} generated")


def _generate_groups(fleet: Fleet) -> list[tuple[str, list[str]]]:
    """Which nodes to ask, in groups of which one must generate: any healthy node, or with
    DistServe a prefill node and a decode node. Least busy first, as a probe should not queue
    behind traffic; an open circuit takes no traffic, so it does not count as healthy here."""
    nodes = sorted(fleet.router.views(), key=lambda n: n.in_flight)
    usable = [n for n in nodes if n.state == "healthy" and n.circuit != "open"]
    if fleet.pd is None:
        return [("healthy node", [n.url for n in usable][:GENERATE_TRIES])]
    return [
        (f"healthy {role} node", [n.url for n in usable if n.role == role][:GENERATE_TRIES])
        for role in ("prefill", "decode")
    ]


def _shortfall(what: str, urls: list[str]) -> str:
    # The message is for any client (the probe is open): counts, never addresses.
    return f"no {what} generated ({len(urls)} tried)" if urls else f"no {what}"


async def _some_generates(session: aiohttp.ClientSession, fleet: Fleet, urls: list[str]) -> list[str]:
    """``[]`` once one of ``urls`` generated, else why each did not (every attempt ends before
    this returns: none is left running)."""
    attempts = [asyncio.create_task(_generates(session, url, fleet)) for url in urls]
    try:
        for attempt in asyncio.as_completed(attempts):
            if await attempt is None:
                return []
        return [f"{url}: {task.result()}" for url, task in zip(urls, attempts, strict=True)]
    finally:
        for task in attempts:
            task.cancel()
        await asyncio.gather(*attempts, return_exceptions=True)


async def _generates(session: aiohttp.ClientSession, url: str, fleet: Fleet) -> str | None:
    """``None`` when the node generated, else why not."""
    try:
        node = fleet.router.node(url)
        headers = _authorization(node["api_key"])
        async with session.get(f"{url}/health_generate", headers=headers, allow_redirects=False) as answer:
            status = answer.status
        if 200 <= status < 300:
            return None
        if status not in (404, 405):
            return f"/health_generate answered {status}"
        if not node["models"]:
            return "it has no /health_generate and no known model to generate with"
        # An engine without the route: one token of a completion is what SGLang's route does.
        body = {"model": node["models"][0], "prompt": "ping", "max_tokens": 1, "temperature": 0, "stream": False}
        async with session.post(f"{url}/v1/completions", json=body, headers=headers, allow_redirects=False) as answer:
            status = answer.status
        return None if 200 <= status < 300 else f"a one-token completion answered {status}"
    except (aiohttp.ClientError, TimeoutError) as e:
        return f"not reached ({type(e).__name__})"
    except NodeNotFound:
        return "removed meanwhile"


# --- POST /finish_session -------------------------------------------------------------------


class FinishSessionBody(BaseModel):
    """vllm-router takes the session as ``?session_id=``; a JSON body may carry it too."""

    model_config = ConfigDict(strict=True, frozen=True)

    session_id: str = Field(description="The session, as sent in X-Session-ID or the body's session_id")


class FinishSessionAnswer(TypedDict):
    status: str
    session_id: str
    message: str


async def finish_session(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    """vllm-router's ``POST /finish_session``: its sticky policies drop the session's entry.
    pdproxy has none to drop: ``consistent_hash`` ranks the nodes by a hash of the session key
    on every request (rendezvous hashing), so a finished session leaves nothing behind. The call
    is answered as vllm-router answers it, so clients that end their sessions keep working."""
    session_id = query_param(scope, "session_id")
    if session_id is None:
        # vllm-router's clients send no body (and some a content type all the same).
        body = await read_body(receive, BODY_LIMIT, header(scope, b"content-length"))
        payload = parse_json(scope, body) if body.strip() else None
        if payload is None:
            raise InvalidRequest("give the session as ?session_id=ID", param="session_id")
        session_id = parse_body(FinishSessionBody, payload).session_id
    return 200, FinishSessionAnswer(
        status="ok",
        session_id=session_id,
        message="nothing to release: pdproxy's session affinity keeps no per-session state",
    )


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
    Route(
        "POST",
        "/finish_session",
        finish_session,
        "vllm-router: end the session `?session_id=`; nothing to release (pdproxy's affinity keeps no session state)",
        None,
        None,
        {200: '{"status": "ok", "session_id": ID}', 400: "No session id"},
    ),
)
