"""The management API, compatible with LMDeploy's proxy: ``/nodes/add`` (LMDeploy's
registration body, as ``lmdeploy serve api_server --proxy-url`` sends it), ``/nodes/remove``,
``/nodes/status``, ``/nodes/terminate``, ``/nodes/terminate_all``. Unlike LMDeploy's, every
failure's status tells the truth (400 bad body, 404 unknown node, 502 node unreachable) and the
body is JSON. A registration answers 200 whether the node is new or known (``created`` says
which): LMDeploy's api_server logs any other status as a failed registration."""

from __future__ import annotations

import asyncio
import os
from typing import NotRequired, TypedDict
from urllib.parse import parse_qs

from pdproxy.errors import DistServeOff, PdproxyError
from pdproxy.fleet.fleet import Fleet
from pdproxy.management.models import (
    AddNodeAnswer,
    AddNodeBody,
    FreedSession,
    GcAnswer,
    GcBody,
    NodesStatus,
    NodeStatus,
    RemoveAnswer,
    TerminateAllAnswer,
    TerminateAnswer,
    TerminateResult,
    UrlBody,
    parse_body,
)
from pdproxy.management.peer_routes import PEER_ROUTES
from pdproxy.management.route_table import Route
from pdproxy.management.workers_api import WORKERS_ROUTES
from pdproxy.pd import PdAdapter, PdStatus
from pdproxy.server.asgi_types import HTTPReceive, HTTPScope
from pdproxy.server.group import GroupSummary
from pdproxy.server.responses import read_json

#: Management request bodies are small.
BODY_LIMIT = 64 << 10


async def _url_body(scope: HTTPScope, receive: HTTPReceive) -> str:
    payload = await read_json(scope, receive, BODY_LIMIT)
    # LMDeploy's documentation once used `?node_url=`; accept it too.
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if not isinstance(payload, dict) and query.get("node_url"):
        return str(query["node_url"][0])
    return parse_body(UrlBody, payload).url


async def add(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    body = parse_body(AddNodeBody, await read_json(scope, receive, BODY_LIMIT))
    # One call to the data plane checks, adds and answers with the node's view.
    view, created = await fleet.add(body.record())
    return 200, AddNodeAnswer(
        url=view.url,
        created=created,
        status=NodeStatus.model_validate(fleet.node_status(view)),
        models_unknown=fleet.router.models_unknown_because(view.url),
    )


async def remove(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    url = await fleet.remove(await _url_body(scope, receive))
    return 200, RemoveAnswer(url=url, removed=True)


async def status(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    return 200, fleet.status()


async def terminate(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    url = await fleet.terminate(await _url_body(scope, receive))
    return 200, TerminateAnswer(url=url, terminated=True)


async def terminate_all(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    results: dict[str, TerminateResult] = {}
    for url in [n.url for n in fleet.router.views()]:
        try:
            await fleet.terminate(url)
            results[url] = TerminateResult(terminated=True)
        except PdproxyError as e:  # TerminateFailed among them
            results[url] = TerminateResult(terminated=False, error=e.message)
    failed = [u for u, r in results.items() if not r.terminated]
    return (502 if failed else 200), TerminateAllAnswer(nodes=results, failed=failed)


def _pd(fleet: Fleet) -> PdAdapter:
    if fleet.pd is None:
        raise DistServeOff("this proxy does not serve with DistServe (--serving-strategy DistServe)")
    return fleet.pd


async def connection_warmup(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    return 200, await _pd(fleet).warmup()


async def distserve_gc(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    payload = await read_json(scope, receive, BODY_LIMIT)
    body = parse_body(GcBody, payload if isinstance(payload, dict) else {})
    freed = await _pd(fleet).gc(body.older_than)
    return 200, GcAnswer(freed=[FreedSession(prefill=e.prefill, session_id=e.session_id, state=e.state) for e in freed])


async def distserve_status(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    return 200, _pd(fleet).status()


class NodeCounts(TypedDict):
    in_flight: int
    circuit: str
    state: str


class DebugState(TypedDict):
    """``GET /debug/state``: counts that must return to zero and resources that must not grow
    (``pd``, ``group`` and ``requests_here`` only with a PD flow, or a worker group)."""

    nodes: dict[str, NodeCounts]
    queued: int
    policies: dict[str, str]
    asyncio_tasks: int
    open_fds: int | None
    pd: NotRequired[PdStatus]
    group: NotRequired[GroupSummary]
    #: This worker's own requests (the node counts are the group's).
    requests_here: NotRequired[int]


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))  # Linux; a few microseconds
    except OSError:
        return None


async def debug_state(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    """What the fault tests check after every scenario: counts that must return to zero and
    resources that must not grow."""
    state = DebugState(
        nodes={
            n.url: NodeCounts(in_flight=n.in_flight, circuit=n.circuit, state=n.state) for n in fleet.router.views()
        },
        queued=fleet.router.queued,
        policies=fleet.router.policies,
        asyncio_tasks=len(asyncio.all_tasks()),
        open_fds=_open_fds(),
    )
    if fleet.pd is not None:
        state["pd"] = fleet.pd.status()
    if fleet.group is not None:
        state["group"] = fleet.group.summary()
        state["requests_here"] = sum(fleet.router.model_requests().values())  # this worker's own
    return 200, state


ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/nodes/add",
        add,
        "Register a node, or update and renew a registered one",
        AddNodeBody,
        AddNodeAnswer,
        {200: "Added or updated (`created` says which)", 400: "Bad body or node URL", 415: "Body is not JSON"},
    ),
    Route(
        "POST", "/nodes/remove", remove, "Remove a node", UrlBody, RemoveAnswer, {200: "Removed", 404: "Unknown node"}
    ),
    Route(
        "GET",
        "/nodes/status",
        status,
        "Every node's role, models, health, load and latency",
        None,
        NodesStatus,
        {200: "Status by node URL"},
    ),
    Route(
        "POST",
        "/nodes/terminate",
        terminate,
        "Stop a node (its /terminate) and remove it",
        UrlBody,
        TerminateAnswer,
        {200: "Terminated", 404: "Unknown node", 502: "The node did not confirm; it was removed"},
    ),
    Route(
        "GET",
        "/nodes/terminate_all",
        terminate_all,
        "Stop and remove every node",
        None,
        TerminateAllAnswer,
        {200: "All terminated", 502: "Some nodes did not confirm; all were removed"},
    ),
    Route(
        "POST",
        "/distserve/connection_warmup",
        connection_warmup,
        "Connect every prefill-decode pair now (joins handshakes in flight: repeating it is harmless)",
        None,
        None,
        {200: "Link states", 404: "DistServe is off"},
    ),
    Route(
        "POST",
        "/distserve/gc",
        distserve_gc,
        "Free preserved prefill sessions older than `older_than` seconds (default 60)",
        GcBody,
        GcAnswer,
        {200: "What was freed", 404: "DistServe is off"},
    ),
    Route(
        "GET",
        "/debug/state",
        debug_state,
        "In-flight counts, queue, routing policies, asyncio tasks and open descriptors (for fault tests)",
        None,
        None,
        {200: "State"},
    ),
    Route(
        "GET",
        "/distserve/status",
        distserve_status,
        "Prefill-decode links and the ledger of preserved sessions",
        None,
        None,
        {200: "Links and ledger", 404: "DistServe is off"},
    ),
    *PEER_ROUTES,
    *WORKERS_ROUTES,
)
