"""``POST /nodes/add`` crosses into the data plane once: the record checked, the host resolved
and checked, the node added and its view given back in one call (issue 30). Counted in-process
with a shim that wraps every object of the extension the control plane holds (the router, the
address rules, and the module ``NodeRecord`` checks itself with)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdproxy import Router, Settings, _pdproxy
from pdproxy.errors import InvalidNode
from pdproxy.fleet import node_record
from pdproxy.fleet.fleet import Fleet, NodeStatusRow
from pdproxy.fleet.node_record import NodeRecord
from pdproxy.management import nodes_api


class Counting:
    """Stands for an extension object: every attribute read (a method call or a property) is
    one crossing, recorded by name."""

    def __init__(self, inner: object, crossings: list[str], name: str) -> None:
        self._inner, self._crossings, self._name = inner, crossings, name

    def __getattr__(self, attribute: str) -> Any:
        self._crossings.append(f"{self._name}.{attribute}")
        value = getattr(self._inner, attribute)
        if not callable(value) or isinstance(value, type):
            return value

        def call(*args: object, **kwargs: object) -> object:
            # Another shim handed in (the address rules) goes across as what it stands for.
            args = tuple(a._inner if isinstance(a, Counting) else a for a in args)
            return value(*args, **{k: v._inner if isinstance(v, Counting) else v for k, v in kwargs.items()})

        return call


async def _post(fleet: Fleet, body: object) -> tuple[int, dict[str, Any]]:
    """``POST /nodes/add`` through the management handler, in this process."""
    sent = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, object]:
        return sent.pop(0)

    headers = [(b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": "/nodes/add", "headers": headers}
    code, answer = await nodes_api.add(fleet, scope, receive)  # type: ignore[arg-type]
    return code, answer.model_dump(mode="json")  # type: ignore[attr-defined]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[Fleet, list[str]]:
    settings = Settings(port=18000)
    router = Router(settings=settings)
    fleet = Fleet(router, settings)
    crossings: list[str] = []
    monkeypatch.setattr(router, "_core", Counting(router.core, crossings, "Router"))
    monkeypatch.setattr(fleet, "address_rules", Counting(fleet.address_rules, crossings, "NodeAddressRules"))
    monkeypatch.setattr(node_record, "_pdproxy", Counting(_pdproxy, crossings, "_pdproxy"))
    return fleet, crossings


async def test_adding_a_node_is_one_crossing(counted: tuple[Fleet, list[str]]) -> None:
    fleet, crossings = counted
    body = {"url": "HTTP://127.0.0.1:18001/", "status": {"models": ["m"], "role": 2, "speed": 2}, "labels": {"z": "a"}}
    code, answer = await _post(fleet, body)
    assert crossings == ["Router.add_node"], "checked, resolved, added and answered in one call"
    assert code == 200
    assert (answer["url"], answer["created"]) == ("http://127.0.0.1:18001", True), "the URL parsed once, in Rust"
    status = answer["status"]
    assert (status["role"], status["role_name"], status["models"], status["speed"]) == (2, "prefill", ["m"], 2.0)
    assert (status["address"], status["labels"], status["state"]) == ("127.0.0.1:18001", {"z": "a"}, "healthy")

    crossings.clear()
    code, again = await _post(fleet, body)
    assert crossings == ["Router.add_node"]
    assert again["created"] is False
    crossings.clear()
    assert fleet.status() == {"http://127.0.0.1:18001": fleet.node_status(fleet.router.core.view(answer["url"]))}


async def test_a_refused_node_is_refused_in_the_same_crossing(counted: tuple[Fleet, list[str]]) -> None:
    fleet, crossings = counted
    for url, named in [
        ("ftp://127.0.0.1:1", "unsupported scheme"),
        ("http://169.254.169.254", "a cloud metadata address"),
        ("http://127.0.0.1:18000", "that is this proxy itself"),
    ]:
        crossings.clear()
        with pytest.raises(InvalidNode, match=named):
            await _post(fleet, {"url": url, "models": ["m"]})
        assert crossings == ["Router.add_node"], url
    assert fleet.status() == {}


def test_the_status_row_declares_every_field_the_record_shows() -> None:
    declared = set(NodeStatusRow.__annotations__)
    assert set(NodeRecord.shown_fields()) <= declared, "a node attribute shown in /nodes/status is declared"
