"""A Kubernetes pod as a node: whether it is one now, at which URL, with which attributes.

A pod is a node while it is Running, Ready, not terminating and has an IP. What pdproxy and the
other routers read from it, so that one Deployment manifest serves them all:

- the port: ``--k8s-port`` (a number or a container port's name), else the ``pdproxy.io/port``
  annotation, else the container port named ``http``, else the pod's only container port;
- the role: the per-role selector that matched it (``--k8s-prefill-selector``,
  ``--k8s-decode-selector``), else the ``pdproxy.io/role`` annotation or label, else hybrid;
- an SGLang prefill node's bootstrap port: ``pdproxy.io/bootstrap-port``, else the SGLang
  gateway's ``sglang.ai/bootstrap-port``, else vllm-router's ``vllm.ai/bootstrap-port``;
- node attributes under the ``pdproxy.io/`` prefix: ``models`` (comma-separated), ``speed``,
  ``max-concurrency``, ``scheme`` (http or https) and ``label.KEY`` for each of its labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdproxy._json_types import JsonObject, JsonValue
from pdproxy.errors import ConfigError
from pdproxy.fleet.node_record import NodeRecord

__all__ = ["PREFIX", "PodNode", "pod_key", "pod_node"]

#: The prefix of pdproxy's own annotations.
PREFIX = "pdproxy.io/"
#: Where a bootstrap port is read, first found wins.
BOOTSTRAP_ANNOTATIONS = (PREFIX + "bootstrap-port", "sglang.ai/bootstrap-port", "vllm.ai/bootstrap-port")
#: Annotations read as the node field of the same name.
FIELD_ANNOTATIONS = {"speed": "speed", "max-concurrency": "max_concurrency"}


@dataclass(frozen=True)
class PodNode:
    """What one pod is to the proxy: a node (``record``), or why it is not one now (``reason``);
    a ``problem`` is a reason its owner must fix (a port it lacks), not a state it passes through."""

    record: NodeRecord | None
    reason: str | None = None
    problem: bool = False


def pod_key(pod: Mapping[str, JsonValue]) -> str:
    """``NAMESPACE/NAME``, a pod's identity while it lives."""
    metadata = _object(pod.get("metadata"))
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


def pod_node(pod: Mapping[str, JsonValue], port: str, role: str | None) -> PodNode:
    """The pod as a node, with ``port`` (``--k8s-port``) and ``role`` (its selector's, if any)."""
    metadata, status = _object(pod.get("metadata")), _object(pod.get("status"))
    if metadata.get("deletionTimestamp"):
        return PodNode(None, "terminating")
    if status.get("phase") != "Running":
        return PodNode(None, f"phase {status.get('phase') or 'unknown'}")
    if not _ready(status):
        return PodNode(None, "not Ready")
    ip = status.get("podIP")
    if not isinstance(ip, str) or not ip:
        return PodNode(None, "no IP")
    annotations = _strings(metadata.get("annotations"))
    labels = _strings(metadata.get("labels"))
    number = _port(pod, port, annotations)
    if isinstance(number, str):
        return PodNode(None, number, problem=True)
    scheme = annotations.get(PREFIX + "scheme", "http")
    host = f"[{ip}]" if ":" in ip else ip
    fields: dict[str, object] = {"url": f"{scheme}://{host}:{number}"}
    fields["role"] = role or annotations.get(PREFIX + "role") or labels.get(PREFIX + "role") or "hybrid"
    models = annotations.get(PREFIX + "models")
    if models is not None:
        fields["models"] = [m.strip() for m in models.split(",") if m.strip()]
    for annotation, name in FIELD_ANNOTATIONS.items():
        if PREFIX + annotation in annotations:
            fields[name] = annotations[PREFIX + annotation]
    bootstrap = next((annotations[a] for a in BOOTSTRAP_ANNOTATIONS if a in annotations), None)
    if bootstrap is not None:
        fields["bootstrap_port"] = bootstrap
    label = PREFIX + "label."
    node_labels = {k.removeprefix(label): v for k, v in annotations.items() if k.startswith(label)}
    if node_labels:
        fields["labels"] = node_labels
    try:
        return PodNode(NodeRecord.of(fields, f"pod {pod_key(pod)}", strict=False))
    except ConfigError as e:
        return PodNode(None, str(e), problem=True)


def _port(pod: Mapping[str, JsonValue], port: str, annotations: Mapping[str, str]) -> int | str:
    """The pod's port number, or why it has none."""
    ports = {
        str(p.get("name") or ""): p.get("containerPort")
        for container in _list(_object(pod.get("spec")).get("containers"))
        for p in _list(_object(container).get("ports"))
        if isinstance(p, dict)
    }
    wanted = port or annotations.get(PREFIX + "port", "")
    if wanted.isdigit():
        number: JsonValue = int(wanted)
    elif wanted:
        if wanted not in ports:
            return f"no container port named {wanted!r} (it has {', '.join(sorted(ports)) or 'none'})"
        number = ports[wanted]
    elif "http" in ports:
        number = ports["http"]
    elif len(ports) == 1:
        number = next(iter(ports.values()))
    else:
        return "no port: give --k8s-port, a pdproxy.io/port annotation, or a container port named http"
    if not isinstance(number, int) or not 0 < number < 65536:
        return f"port {number!r} is not a port number"
    return number


def _ready(status: Mapping[str, JsonValue]) -> bool:
    return any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in _list(status.get("conditions"))
    )


def _object(value: JsonValue | None) -> JsonObject:
    return value if isinstance(value, dict) else {}


def _list(value: JsonValue | None) -> list[JsonValue]:
    return value if isinstance(value, list) else []


def _strings(value: JsonValue | None) -> dict[str, str]:
    return {k: v for k, v in _object(value).items() if isinstance(v, str)}
