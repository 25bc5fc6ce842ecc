"""A Kubernetes pod as a node (pdproxy.fleet.node_sources.pods): when it is one, at which URL, with
which attributes, and what it says when it cannot be one."""

from __future__ import annotations

from typing import Any

import pytest

from pdproxy._json_types import JsonObject
from pdproxy.errors import ConfigError
from pdproxy.fleet.node_sources.pods import pod_node
from pdproxy.fleet.node_sources.selectors import check_selector


def pod(
    *,
    ip: str | None = "10.0.0.5",
    phase: str = "Running",
    ready: bool = True,
    terminating: bool = False,
    annotations: dict[str, str] | None = None,
    ports: list[dict[str, Any]] | None = None,
) -> JsonObject:
    metadata: JsonObject = {"name": "vllm-0", "namespace": "llm", "annotations": annotations or {}}
    if terminating:
        metadata["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    status: JsonObject = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    ports = ports if ports is not None else [{"name": "http", "containerPort": 8000}]
    containers = [{"name": "engine", "ports": ports}]
    return {"metadata": metadata, "spec": {"containers": containers}, "status": status}


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        ({"phase": "Pending"}, "phase Pending"),
        ({"ready": False}, "not Ready"),
        ({"terminating": True}, "terminating"),
        ({"ip": None}, "no IP"),
    ],
)
def test_a_pod_is_a_node_only_running_ready_not_terminating_with_an_ip(shape: dict[str, Any], reason: str) -> None:
    node = pod_node(pod(**shape), "", None)
    assert node.record is None
    assert node.reason == reason
    assert not node.problem, "a state the pod passes through, not its owner's to fix"


def test_the_port_the_role_and_the_annotations() -> None:
    annotations = {
        "pdproxy.io/models": "qwen, llama",
        "pdproxy.io/speed": "2.5",
        "pdproxy.io/max-concurrency": "16",
        "vllm.ai/bootstrap-port": "8998",
        "sglang.ai/bootstrap-port": "8999",
        "pdproxy.io/label.zone": "eu",
        "pdproxy.io/role": "decode",
    }
    record = pod_node(pod(annotations=annotations), "", None).record
    assert record is not None
    assert record.url == "http://10.0.0.5:8000"
    assert record.models == ["qwen", "llama"]
    assert (record.speed, record.max_concurrency) == (2.5, 16)
    assert record.bootstrap_port == 8999, "SGLang's annotation comes before vllm-router's"
    assert record.labels == {"zone": "eu"}
    assert record.role == "decode"
    by_selector = pod_node(pod(annotations=annotations), "", "prefill").record
    assert by_selector is not None
    assert by_selector.role == "prefill", "a per-role selector wins over the annotation"


def test_ports_by_name_number_annotation_and_ipv6() -> None:
    ports = [{"name": "metrics", "containerPort": 9090}, {"name": "api", "containerPort": 30000}]
    record = pod_node(pod(ip="fd00::7", ports=ports), "api", None).record
    assert record is not None
    assert record.url == "http://[fd00::7]:30000"
    numbered = pod_node(pod(ports=ports), "8080", None).record
    assert numbered is not None
    assert numbered.url.endswith(":8080")
    annotated = pod_node(pod(ports=ports, annotations={"pdproxy.io/port": "metrics"}), "", None).record
    assert annotated is not None
    assert annotated.url.endswith(":9090")
    only = pod_node(pod(ports=[{"containerPort": 23333}]), "", None).record
    assert only is not None
    assert only.url.endswith(":23333")
    tls = pod_node(pod(annotations={"pdproxy.io/scheme": "https"}), "", None).record
    assert tls is not None
    assert tls.url == "https://10.0.0.5:8000"


@pytest.mark.parametrize(
    ("shape", "port", "message"),
    [
        ({"ports": [{"name": "api", "containerPort": 1}, {"name": "x", "containerPort": 2}]}, "", "no port"),
        ({}, "grpc", "no container port named 'grpc' (it has http)"),
        ({"annotations": {"pdproxy.io/speed": "fast"}}, "", "speed"),
        ({"annotations": {"pdproxy.io/role": "sideways"}}, "", "role"),
    ],
)
def test_a_pod_that_cannot_be_a_node_says_why(shape: dict[str, Any], port: str, message: str) -> None:
    node = pod_node(pod(**shape), port, None)
    assert node.record is None
    assert node.problem
    assert node.reason is not None
    assert message in node.reason


@pytest.mark.parametrize(
    "selector", ["app=vllm", "app.kubernetes.io/name=vllm,tier!=cpu", "role in (prefill, decode),!canary", "gpu"]
)
def test_selectors_that_parse(selector: str) -> None:
    check_selector(selector, "--k8s-selector")


@pytest.mark.parametrize("selector", ["app=vllm,", "app in vllm", "=vllm", "app = vllm x", "a/b/c=d", "app=(x)"])
def test_selectors_that_do_not(selector: str) -> None:
    with pytest.raises(ConfigError, match="is not a label selector requirement"):
        check_selector(selector, "--k8s-selector")
