"""The management API, compatible with LMDeploy's proxy: ``/nodes/add`` (LMDeploy's
registration body, as ``lmdeploy serve api_server --proxy-url`` sends it), ``/nodes/remove``,
``/nodes/status``, ``/nodes/terminate``, ``/nodes/terminate_all``. Unlike LMDeploy's, every
failure's status tells the truth (400 bad body, 404 unknown node, 502 node unreachable) and the
body is JSON. A registration answers 200 whether the node is new or known (``created`` says
which): LMDeploy's api_server logs any other status as a failed registration."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from .errors import InvalidRequest, PdproxyError
from .fleet import Fleet, TerminateFailed
from .responses import Receive, Scope, read_json

#: Management request bodies are small.
BODY_LIMIT = 64 << 10

Handler = Callable[[Fleet, Scope, Receive], Awaitable[tuple[int, Any]]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    request: dict[str, Any] | None = None
    responses: dict[int, str] = field(default_factory=dict)


def _field(payload: dict[str, Any], name: str, kinds: tuple[type, ...], where: str = "") -> Any:
    value = payload.get(name)
    if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        names = " or ".join(k.__name__ for k in kinds)
        raise InvalidRequest(f"`{where}{name}` must be {names}")
    return value


def _role(value: Any) -> str:
    if value is None:
        return "hybrid"
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidRequest("`status.role` must be LMDeploy's integer (1, 2, 3) or a role name")
    return str(value)


async def _url_body(scope: Scope, receive: Receive) -> str:
    payload = await read_json(scope, receive, BODY_LIMIT)
    if isinstance(payload, dict) and isinstance(payload.get("url"), str):
        return str(payload["url"])
    # LMDeploy's documentation once used `?node_url=`; accept it too.
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("node_url"):
        return str(query["node_url"][0])
    raise InvalidRequest("the body must be a JSON object with a string `url`")


async def add(fleet: Fleet, scope: Scope, receive: Receive) -> tuple[int, Any]:
    payload = await read_json(scope, receive, BODY_LIMIT)
    if not isinstance(payload, dict) or not isinstance(payload.get("url"), str):
        raise InvalidRequest("the body must be a JSON object with a string `url`")
    status = payload.get("status") or {}
    if not isinstance(status, dict):
        raise InvalidRequest("`status` must be an object or null")
    models = _field(status, "models", (list,), "status.")
    if models is not None and not all(isinstance(m, str) for m in models):
        raise InvalidRequest("`status.models` must be a list of strings")
    # pdproxy's own fields may sit at the top level or inside `status`.
    extra = {**status, **payload}
    registration, created = await fleet.add(
        payload["url"],
        models=models or None,
        role=_role(status.get("role")),
        speed=_field(status, "speed", (int, float), "status."),
        max_concurrency=_field(extra, "max_concurrency", (int,)),
        api_key=_field(extra, "api_key", (str,)),
        lease_ttl=_field(extra, "lease_ttl", (int, float)),
        bootstrap_port=_field(extra, "bootstrap_port", (int,)),
    )
    return 200, {
        "url": registration.url,
        "created": created,
        "status": fleet.status().get(registration.url),
    }


async def remove(fleet: Fleet, scope: Scope, receive: Receive) -> tuple[int, Any]:
    url = await fleet.remove(await _url_body(scope, receive))
    return 200, {"url": url, "removed": True}


async def status(fleet: Fleet, scope: Scope, receive: Receive) -> tuple[int, Any]:
    return 200, fleet.status()


async def terminate(fleet: Fleet, scope: Scope, receive: Receive) -> tuple[int, Any]:
    url = await fleet.terminate(await _url_body(scope, receive))
    return 200, {"url": url, "terminated": True}


async def terminate_all(fleet: Fleet, scope: Scope, receive: Receive) -> tuple[int, Any]:
    urls = list(fleet.registrations) or [n["url"] for n in fleet.router.nodes()]
    results: dict[str, Any] = {}
    for url in urls:
        try:
            await fleet.terminate(url)
            results[url] = {"terminated": True}
        except TerminateFailed as e:
            results[url] = {"terminated": False, "error": e.message}
        except PdproxyError as e:
            results[url] = {"terminated": False, "error": e.message}
    failed = [u for u, r in results.items() if not r["terminated"]]
    return (502 if failed else 200), {"nodes": results, "failed": failed}


class DistServeOff(PdproxyError):
    status = 404
    code = "distserve_off"
    type = "invalid_request_error"


def _distserve(fleet: Fleet, lmdeploy: bool = True) -> Any:
    if fleet.distserve is None:
        raise DistServeOff("this proxy does not serve with DistServe (--serving-strategy DistServe)")
    if lmdeploy and fleet.distserve.protocol != "lmdeploy":
        raise DistServeOff("links and preserved sessions exist only with --pd-protocol lmdeploy")
    return fleet.distserve


async def connection_warmup(fleet: Fleet, scope: Scope, receive: Receive) -> tuple[int, Any]:
    return 200, await _distserve(fleet).warmup()


async def distserve_gc(fleet: Fleet, scope: Scope, receive: Receive) -> tuple[int, Any]:
    payload = await read_json(scope, receive, BODY_LIMIT)
    older_than = payload.get("older_than", 60.0) if isinstance(payload, dict) else 60.0
    if not isinstance(older_than, int | float) or isinstance(older_than, bool) or older_than < 0:
        raise InvalidRequest("`older_than` must be a non-negative number of seconds")
    freed = await _distserve(fleet).ledger.gc(float(older_than))
    return 200, {"freed": freed}


async def distserve_status(fleet: Fleet, scope: Scope, receive: Receive) -> tuple[int, Any]:
    return 200, _distserve(fleet, lmdeploy=False).status()


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))  # Linux; a few microseconds
    except OSError:
        return None


async def debug_state(fleet: Fleet, scope: Scope, receive: Receive) -> tuple[int, Any]:
    """What the fault tests check after every scenario: counts that must return to zero and
    resources that must not grow."""
    state: dict[str, Any] = {
        "nodes": {
            n["url"]: {"in_flight": n["in_flight"], "circuit": n["circuit"], "state": n["state"]}
            for n in fleet.router.nodes()
        },
        "queued": fleet.router.queued,
        "policies": fleet.router.policies,
        "asyncio_tasks": len(asyncio.all_tasks()),
        "open_fds": _open_fds(),
    }
    if fleet.distserve is not None:
        state["pd"] = fleet.distserve.status()
    if fleet.group is not None:
        state["group"] = fleet.group.summary()
        state["requests_here"] = sum(fleet.router.model_requests().values())  # this worker's own
    return 200, state


_URL_BODY = {"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}}
_ADD_BODY = {
    "type": "object",
    "required": ["url"],
    "properties": {
        "url": {"type": "string", "description": "The node's base URL, e.g. http://10.0.0.5:23333"},
        "status": {
            "type": ["object", "null"],
            "description": "LMDeploy's node status",
            "properties": {
                "models": {"type": "array", "items": {"type": "string"}},
                "role": {"description": "1 Hybrid, 2 Prefill, 3 Decode, or the name", "type": ["integer", "string"]},
                "speed": {"type": ["number", "null"]},
            },
        },
        "max_concurrency": {"type": "integer", "description": "Hard cap on the node's requests in flight"},
        "api_key": {"type": "string", "description": "Sent to the node as `Authorization: Bearer`"},
        "lease_ttl": {"type": "number", "description": "Seconds until the registration lapses unless renewed"},
        "bootstrap_port": {"type": "integer", "description": "SGLang prefill nodes: their bootstrap server's port"},
    },
}

ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/nodes/add",
        add,
        "Register a node, or update and renew a registered one",
        _ADD_BODY,
        {200: "Added or updated (`created` says which)", 400: "Bad body or node URL", 415: "Body is not JSON"},
    ),
    Route("POST", "/nodes/remove", remove, "Remove a node", _URL_BODY, {200: "Removed", 404: "Unknown node"}),
    Route(
        "GET",
        "/nodes/status",
        status,
        "Every node's role, models, health, load and latency",
        None,
        {200: "Status by node URL"},
    ),
    Route(
        "POST",
        "/nodes/terminate",
        terminate,
        "Stop a node (its /terminate) and remove it",
        _URL_BODY,
        {200: "Terminated", 404: "Unknown node", 502: "The node did not confirm; it was removed"},
    ),
    Route(
        "GET",
        "/nodes/terminate_all",
        terminate_all,
        "Stop and remove every node",
        None,
        {200: "All terminated", 502: "Some nodes did not confirm; all were removed"},
    ),
    Route(
        "POST",
        "/distserve/connection_warmup",
        connection_warmup,
        "Connect every prefill-decode pair now (joins handshakes in flight: repeating it is harmless)",
        None,
        {200: "Link states", 404: "DistServe is off"},
    ),
    Route(
        "POST",
        "/distserve/gc",
        distserve_gc,
        "Free preserved prefill sessions older than `older_than` seconds (default 60)",
        {"type": "object", "properties": {"older_than": {"type": "number"}}},
        {200: "What was freed", 404: "DistServe is off"},
    ),
    Route(
        "GET",
        "/debug/state",
        debug_state,
        "In-flight counts, queue, routing policies, asyncio tasks and open descriptors (for fault tests)",
        None,
        {200: "State"},
    ),
    Route(
        "GET",
        "/distserve/status",
        distserve_status,
        "Prefill-decode links and the ledger of preserved sessions",
        None,
        {200: "Links and ledger", 404: "DistServe is off"},
    ),
)
