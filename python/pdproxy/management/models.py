"""The management API's bodies and answers: LMDeploy's shapes (``/nodes/add`` as
``lmdeploy serve api_server --proxy-url`` sends it, ``/nodes/status`` as its tooling reads it)
and pdproxy's own. The handlers (``nodes_api``) parse with these, and ``/openapi.json`` is
generated from them. Management only: nothing here runs per inference request."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from pdproxy.errors import InvalidNode, InvalidRequest
from pdproxy.fleet.node_record import INVALID_NODE, NodeAttributes, NodeRecord, validation_field, validation_message

__all__ = [
    "AddNodeAnswer",
    "AddNodeBody",
    "FreedSession",
    "GcAnswer",
    "GcBody",
    "NodeStatus",
    "NodesStatus",
    "RemoveAnswer",
    "TerminateAllAnswer",
    "TerminateAnswer",
    "UrlBody",
    "parse_body",
]

Body = TypeVar("Body", bound=BaseModel)


class LmdeployNodeStatus(NodeAttributes):
    """LMDeploy's ``Status`` of a node (``models``, ``role``, ``speed``; its ``unfinished`` and
    ``latency`` are ignored), which may carry pdproxy's node fields too."""

    model_config = ConfigDict(extra="ignore")


class AddNodeBody(LmdeployNodeStatus):
    """``POST /nodes/add``: the node's URL and LMDeploy's ``status``; pdproxy's node fields may
    sit at the top level or inside ``status`` (the top level wins)."""

    url: str = Field(description="The node's base URL, e.g. http://10.0.0.5:23333")
    status: LmdeployNodeStatus | None = Field(None, description="LMDeploy's node status")

    def record(self) -> NodeRecord:
        """The node this body registers, its data-plane rules (URL, speed, key) left to the
        data plane, which checks them as it adds the node (``Fleet.add``). Raises
        ``InvalidNode`` naming the field."""
        fields: dict[str, object] = {}
        for part in (self.status, self):
            if part is not None:
                given = part.model_fields_set & NodeAttributes.model_fields.keys()
                fields.update((name, getattr(part, name)) for name in given)
        fields["models"] = fields.get("models") or None  # LMDeploy's empty list: ask the node
        return NodeRecord.unchecked({**fields, "url": self.url})


class UrlBody(BaseModel):
    """A node named by its URL (``/nodes/remove``, ``/nodes/terminate``)."""

    model_config = ConfigDict(strict=True, frozen=True)

    url: str = Field(description="The node's URL, as registered")


class GcBody(BaseModel):
    """``POST /distserve/gc``."""

    model_config = ConfigDict(strict=True, frozen=True)

    older_than: float = Field(60.0, ge=0, description="Free sessions preserved longer than this many seconds")


class NodeStatus(BaseModel):
    """One node in ``/nodes/status``: LMDeploy's keys (role as its integer, models, unfinished,
    latency, speed), then pdproxy's (the node record's shown fields, health and counters)."""

    model_config = ConfigDict(extra="allow")

    role: int = Field(description="LMDeploy's EngineRole: 1 Hybrid, 2 Prefill, 3 Decode")
    models: list[str]
    unfinished: int = Field(description="Requests in flight")
    latency: list[float] = Field(description="Recent request durations, seconds")
    speed: float | None


class NodesStatus(RootModel[dict[str, NodeStatus]]):
    """``GET /nodes/status``: every node by URL."""


class AddNodeAnswer(BaseModel):
    url: str
    created: bool = Field(description="Whether the node is new (else it was updated and its lease renewed)")
    status: NodeStatus | None
    models_unknown: str | None = Field(
        None,
        description="Why the node, asked for its models, did not tell them: it takes no traffic until it does "
        "(it is asked again in the background). None when it told them or they were declared",
    )


class RemoveAnswer(BaseModel):
    url: str
    removed: bool


class TerminateAnswer(BaseModel):
    url: str
    terminated: bool


class TerminateResult(BaseModel):
    terminated: bool
    error: str | None = None


class TerminateAllAnswer(BaseModel):
    nodes: dict[str, TerminateResult]
    failed: list[str]


class FreedSession(BaseModel):
    prefill: str = Field(description="The prefill node that held it")
    session_id: int
    state: str = Field(description="freed, or lost when the node could not be reached")


class GcAnswer(BaseModel):
    freed: list[FreedSession] = Field(description="The preserved sessions freed")


def parse_body(model: type[Body], payload: object) -> Body:
    """``payload`` as ``model``; a bad body raises ``InvalidRequest`` (``InvalidNode`` for a value
    the node table refuses) naming the field, as the error's ``param``."""
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        refused = InvalidNode if e.errors()[0]["type"] == INVALID_NODE else InvalidRequest
        field = validation_field(e)
        message = validation_message(e)
        if field is None and not isinstance(payload, dict):
            message = "the body must be a JSON object"
        raise refused(message, param=field) from None
