"""The SGLang gateway's (SMG's) REST API for workers, on pdproxy's node table: ``GET``/``POST
/workers``, ``GET``/``PUT``/``PATCH``/``DELETE /workers/{worker_id}``.

A worker's id is a UUID derived from its URL (``worker_id``), so every process and every restart
gives the same one and no table of ids is kept. The gateway registers in the background and
answers 202; pdproxy registers at once and answers 202 all the same, with the gateway's body. What
a pdproxy node cannot hold (priority, cost, per-worker health-check and retry settings) is named in
the answer's ``ignored``, or refused when a PATCH asks to change it. The routes sit behind the
admin keys, as ``/nodes/*`` do."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import TYPE_CHECKING, NotRequired, TypedDict
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field

from pdproxy.errors import InvalidRequest, NodeNotFound, PdproxyError
from pdproxy.fleet.node_record import NodeRecord
from pdproxy.management.models import parse_body
from pdproxy.management.peer_routes import BODY_LIMIT, query_param
from pdproxy.management.route_table import Route, WithHeaders
from pdproxy.server.asgi_types import HTTPReceive, HTTPScope
from pdproxy.server.inference import path_as_sent
from pdproxy.server.responses import read_json

if TYPE_CHECKING:
    from pdproxy._pdproxy import NodeView
    from pdproxy.fleet.fleet import Fleet

__all__ = ["WORKERS_ROUTES", "worker_id"]

#: Where the gateway's per-worker routes live: ``/workers/{worker_id}``.
WORKERS_PREFIX = "/workers/"
#: The gateway's worker types for pdproxy's roles.
WORKER_TYPES = {"hybrid": "regular", "prefill": "prefill", "decode": "decode"}
ROLES = {worker_type: role for role, worker_type in WORKER_TYPES.items()}
#: The gateway's worker status (``WorkerStatus``) for each state of a pdproxy node.
STATUSES = {
    "healthy": "ready",
    "unhealthy": "not_ready",
    "sleeping": "not_ready",
    "draining": "draining",
    "initializing": "pending",
}
#: The engines the gateway names as runtimes (the rest it calls unspecified).
RUNTIMES = ("sglang", "vllm")


def worker_id(url: str) -> str:
    """A node's id in the gateway's ``/workers`` API: a UUID derived from its URL, the same in
    every process of a worker group, every replica sharing a registry, and after a restart."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, url))


class ModelCard(BaseModel):
    """A model in the gateway's ``models`` list (its other fields describe the model to the
    gateway's own tokenizer and parsers, which pdproxy has not)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str


class WorkerSpec(BaseModel):
    """``POST /workers`` and ``PUT /workers/{worker_id}``: the gateway's ``WorkerSpec``, as far as
    a pdproxy node holds it. Its other fields are accepted and named in the answer's ``ignored``."""

    model_config = ConfigDict(strict=True, frozen=True, extra="allow")

    url: str = Field(description="The worker's base URL, e.g. http://10.0.0.5:30000")
    worker_type: str = Field("regular", description="regular, prefill or decode (pdproxy's hybrid, prefill, decode)")
    bootstrap_port: int | None = Field(None, description="SGLang prefill workers: their bootstrap server's port")
    api_key: str | None = Field(None, description="Sent to the worker as `Authorization: Bearer`; never shown")
    labels: dict[str, str] = Field(default_factory=dict, description="The operator's labels, shown in status")
    models: list[ModelCard | str] | None = Field(None, description="Models it serves (none: ask the worker)")
    model_id: str | None = Field(None, description="The model it serves (older gateways' field)")
    connection_mode: str = Field("http", description="Only http: pdproxy proxies HTTP")

    def record(self) -> NodeRecord:
        """The node this spec registers. Raises ``InvalidRequest`` or ``InvalidNode`` naming the field."""
        role = ROLES.get(self.worker_type.strip().lower())
        if role is None:
            raise InvalidRequest(
                f"worker_type {self.worker_type!r} is not regular, prefill or decode (pdproxy has no encode workers)",
                param="worker_type",
            )
        if self.connection_mode.strip().lower() != "http":
            raise InvalidRequest(
                f"connection_mode {self.connection_mode!r}: pdproxy reaches workers over HTTP only",
                param="connection_mode",
            )
        fields: dict[str, object] = {"url": self.url, "role": role, "labels": self.labels, "models": self._models()}
        fields.update(
            (name, getattr(self, name)) for name in ("bootstrap_port", "api_key") if name in self.model_fields_set
        )
        return NodeRecord.checked(fields)

    def _models(self) -> list[str] | None:
        if self.models:
            return [m if isinstance(m, str) else m.id for m in self.models]
        return [self.model_id] if self.model_id else None

    def ignored(self) -> list[str]:
        """The fields given that a pdproxy node has no place for."""
        return sorted(self.model_extra or {})


class WorkerUpdate(BaseModel):
    """``PATCH /workers/{worker_id}``: the gateway's ``WorkerUpdateRequest``. Labels are merged
    into the worker's; ``api_key`` replaces its key (empty: none)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    labels: dict[str, str] | None = Field(None, description="Labels to set (merged into the worker's)")
    api_key: str | None = Field(None, description="The worker's new key (key rotation)")
    priority: int | None = Field(None, description="Refused: pdproxy has no worker priority")
    cost: float | None = Field(None, description="Refused: pdproxy has no worker cost")
    health: dict[str, object] | None = Field(None, description="Refused: health checks are the proxy's settings")

    def refused(self) -> list[str]:
        return sorted(self.model_fields_set & {"priority", "cost", "health"})


class WorkerExists(PdproxyError):
    """``POST /workers`` for a URL already registered: the gateway's 409 (PUT or PATCH change one)."""


class ModelCardAnswer(TypedDict):
    id: str


class WorkerInfo(TypedDict):
    """One worker as the gateway describes it (``WorkerInfo``); the key is never shown, and the
    fields a pdproxy node has no value for are left out, as the gateway leaves out its unset ones."""

    id: str
    url: str
    model_id: NotRequired[str]
    models: NotRequired[list[ModelCardAnswer]]
    worker_type: str
    connection_mode: str
    runtime_type: str
    labels: NotRequired[dict[str, str]]
    bootstrap_port: NotRequired[int]
    is_healthy: bool
    status: str
    load: int


class WorkerCounts(TypedDict):
    prefill_count: int
    decode_count: int
    regular_count: int


class WorkerList(TypedDict):
    """``GET /workers``."""

    workers: list[WorkerInfo]
    total: int
    stats: WorkerCounts


class WorkerAccepted(TypedDict):
    """The gateway's 202 to a change of a worker (``url`` and ``location`` for a new one)."""

    status: str
    worker_id: str
    url: NotRequired[str]
    location: NotRequired[str]
    message: str
    #: pdproxy's: the fields given that it has no place for.
    ignored: NotRequired[list[str]]


def _worker_info(node: NodeView, dialect: str | None) -> WorkerInfo:
    info = WorkerInfo(
        id=worker_id(node.url),
        url=node.url,
        worker_type=WORKER_TYPES[node.role],
        connection_mode="http",
        runtime_type=dialect if dialect in RUNTIMES else "unspecified",
        is_healthy=node.state == "healthy",
        status=STATUSES.get(node.state, "not_ready"),
        load=node.in_flight,
    )
    if node.models:
        info["model_id"] = node.models[0]
        info["models"] = [ModelCardAnswer(id=model) for model in node.models]
    if node.labels:
        info["labels"] = dict(node.labels)
    if node.bootstrap_port is not None:
        info["bootstrap_port"] = node.bootstrap_port
    return info


def _addressed(fleet: Fleet, scope: HTTPScope) -> str:
    """The URL of the worker ``/workers/{worker_id}`` names: by its id (a UUID, as ``GET
    /workers`` gives it) or by its URL percent-encoded (as the gateway's older docs show).
    Raises ``InvalidRequest`` for neither, ``NodeNotFound`` for no such worker."""
    raw = unquote(path_as_sent(scope).removeprefix(WORKERS_PREFIX))
    if "://" in raw:
        return fleet.lookup(raw)
    try:
        wanted = str(uuid.UUID(raw))
    except ValueError:
        raise InvalidRequest(
            f"{raw!r} is neither a worker id (a UUID, as GET /workers gives) nor a worker's URL", param="worker_id"
        ) from None
    for node in fleet.router.views():
        if worker_id(node.url) == wanted:
            return node.url
    raise NodeNotFound(f"no worker has the id {wanted}")


def _accepted(url: str, message: str, spec: WorkerSpec | None = None) -> WorkerAccepted:
    answer = WorkerAccepted(status="accepted", worker_id=worker_id(url), message=message)
    if spec is not None and spec.ignored():
        answer["ignored"] = spec.ignored()
    return answer


async def _spec(scope: HTTPScope, receive: HTTPReceive) -> WorkerSpec:
    return parse_body(WorkerSpec, await read_json(scope, receive, BODY_LIMIT))


async def list_workers_rest(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    """``GET /workers[?model=M]``: every worker, or those serving ``M`` (a worker whose models
    are not known yet serves none: pdproxy sends it nothing until they are)."""
    model = query_param(scope, "model")
    nodes = [n for n in fleet.router.views() if model is None or model in n.models]
    workers = [_worker_info(n, fleet.engines.dialects.get(n.url)) for n in nodes]
    counts = Counter(w["worker_type"] for w in workers)
    stats = WorkerCounts(
        prefill_count=counts["prefill"], decode_count=counts["decode"], regular_count=counts["regular"]
    )
    return 200, WorkerList(workers=workers, total=len(workers), stats=stats)


async def create_worker(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    """``POST /workers``: registers the worker at once; 409 for a URL already registered."""
    spec = await _spec(scope, receive)
    record = spec.record()
    if fleet.state_of(record.url) is not None:
        raise WorkerExists(
            f"a worker is registered at {record.url} (id {worker_id(record.url)}): PUT or PATCH /workers/ID changes it"
        )
    view, _ = await fleet.add(record)
    url = view.url
    location = WORKERS_PREFIX + worker_id(url)
    answer = _accepted(url, "Worker registered (pdproxy adds it at once: GET location shows it)", spec)
    answer["url"], answer["location"] = url, location
    return 202, WithHeaders(answer, (("location", location),))


async def get_worker(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    url = _addressed(fleet, scope)
    return 200, _worker_info(fleet.router.core.view(url), fleet.engines.dialects.get(url))


async def replace_worker(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    """``PUT /workers/{worker_id}``: the worker registered anew from the whole spec (what it
    leaves out takes its default), at the same URL."""
    url = _addressed(fleet, scope)
    spec = await _spec(scope, receive)
    record = spec.record()
    if record.url != url:
        raise InvalidRequest(
            f"the body's url {record.url} is not the worker's ({url}): a URL cannot change (DELETE, then POST)",
            param="url",
        )
    await fleet.add(record)
    return 202, _accepted(url, "Worker replaced", spec)


async def update_worker(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    """``PATCH /workers/{worker_id}``: labels merged, key replaced; what pdproxy cannot honour
    is refused rather than acknowledged and dropped."""
    url = _addressed(fleet, scope)
    update = parse_body(WorkerUpdate, await read_json(scope, receive, BODY_LIMIT))
    refused = update.refused()
    if refused:
        raise InvalidRequest(
            f"pdproxy cannot change {', '.join(refused)}: a node has no priority or cost, and health checks "
            "are the proxy's settings (--health-*); labels and api_key can be changed",
            param=refused[0],
        )
    fields = NodeRecord.of_node(fleet.router.node(url)).model_dump()
    if update.labels is not None:
        fields["labels"] = {**fields["labels"], **update.labels}
    if "api_key" in update.model_fields_set:
        fields["api_key"] = update.api_key
    await fleet.add(NodeRecord.checked(fields))
    return 202, _accepted(url, "Worker updated")


async def delete_worker(fleet: Fleet, scope: HTTPScope, receive: HTTPReceive) -> tuple[int, object]:
    url = await fleet.remove(_addressed(fleet, scope))
    return 202, _accepted(url, "Worker removed")


WORKER = WORKERS_PREFIX + "{worker_id}"

WORKERS_ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/workers",
        list_workers_rest,
        "SGLang gateway: every worker (`?model=M`: those serving M), as the gateway describes them",
        None,
        None,
        {200: '{"workers": [...], "total": N, "stats": {...}}'},
    ),
    Route(
        "POST",
        "/workers",
        create_worker,
        "SGLang gateway: register a worker (its WorkerSpec; fields a node cannot hold come back in `ignored`)",
        WorkerSpec,
        None,
        {202: "Registered: `worker_id`, `location`", 400: "Bad body or URL", 409: "A worker has that URL"},
    ),
    Route(
        "GET",
        WORKER,
        get_worker,
        "SGLang gateway: one worker, by id (or percent-encoded URL)",
        None,
        None,
        {200: "The worker", 400: "Neither an id nor a URL", 404: "Unknown worker"},
    ),
    Route(
        "PUT",
        WORKER,
        replace_worker,
        "SGLang gateway: register the worker anew from a whole WorkerSpec (same URL)",
        WorkerSpec,
        None,
        {202: "Replaced", 400: "Bad body, or another URL", 404: "Unknown worker"},
    ),
    Route(
        "PATCH",
        WORKER,
        update_worker,
        "SGLang gateway: merge labels, replace the key (priority, cost and health are refused)",
        WorkerUpdate,
        None,
        {202: "Updated", 400: "Bad body, or a field pdproxy cannot honour", 404: "Unknown worker"},
    ),
    Route(
        "DELETE",
        WORKER,
        delete_worker,
        "SGLang gateway: remove the worker",
        None,
        None,
        {202: "Removed", 404: "Unknown worker"},
    ),
)
