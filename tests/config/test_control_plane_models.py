"""The control plane's edges as pydantic models: settings refused with one line naming the
setting, management bodies refused with a 400 naming the field, `/openapi.json` generated from
the same models, and one node record (its `labels` attribute, from static config and from
`/nodes/add`, shown in `/nodes/status` and kept in the state file)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import pdproxy
from pdproxy.config.settings import Settings
from pdproxy.fleet.node_record import NodeRecord
from pdproxy.management.nodes_api import ROUTES
from pdproxy.testing import MockEngine
from servers import pdproxy_serve


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"port": "80"}, "port: Input should be a valid integer"),
        ({"port": 70000}, "port must be between 1 and 65535, got 70000"),
        ({"connect_timeout": 0}, "connect_timeout must be a positive number of seconds, got 0"),
        ({"health_fall": 0}, "health_fall must be at least 1, got 0"),
        ({"queue_size": -1}, "queue_size must not be negative, got -1"),
        ({"retry_budget_ratio": 2.0}, "retry_budget_ratio must be between 0 and 1, got 2.0"),
        ({"hash_load_factor": 0.5}, "hash_load_factor must be at least 1, got 0.5"),
        ({"edge": "nginx"}, "edge must be rust or granian, got 'nginx'"),
        ({"link_type": "Ethernet"}, "link_type must be RoCE or IB, got 'Ethernet'"),
        ({"pd_protocol": "mooncake"}, "pd_protocol must be lmdeploy, vllm or sglang, got 'mooncake'"),
        ({"model_policies": ("random",)}, "model policy 'random' must read MODEL=POLICY"),
        ({"allow_node_cidrs": ("10.0.0.0/33",)}, "allow_node_cidrs: '10.0.0.0/33' is not a network"),
        ({"api_keys": ("",)}, "api_keys and admin_keys must not contain empty keys"),
        ({"otlp_endpoint": "https://collector"}, "otlp_endpoint must be an http:// URL"),
        ({"demo": "yes"}, "demo: Input should be a valid boolean"),
        ({"colour": "red"}, "unknown setting colour"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(values: dict[str, Any], message: str) -> None:
    with pytest.raises(pdproxy.ConfigError) as refused:
        Settings(**values)
    text = str(refused.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_settings_groups_hold_every_setting_once() -> None:
    from pdproxy.config.settings import FIELDS, GROUPS, flat_name

    declared = [flat_name(name, field) for group in GROUPS for name, field in group.model_fields.items()]
    assert sorted(declared) == sorted(FIELDS), "each setting in exactly one group"
    assert Settings.group_of("health_interval").title == "Health checks"
    assert Settings(log_level="WARN").server.log_level == "warning", "a validator may also normalise"


def test_node_records_parse_from_every_form() -> None:
    one_word = NodeRecord.parse("HTTP://Node:8001/,role=2,model=a,model=b,speed=2,labels.zone=eu,labels.rack=7")
    assert one_word.url == "http://node:8001", "normalised once, by the data plane's parser"
    assert (one_word.role, one_word.models, one_word.speed) == ("prefill", ["a", "b"], 2.0)
    assert one_word.labels == {"zone": "eu", "rack": "7"}
    assert NodeRecord.parse(one_word.text()) == one_word, "the one-word form reads back"
    table = {"url": "http://node:8001", "role": "prefill", "models": ["a", "b"], "speed": 2.0}
    assert NodeRecord.of({**table, "labels": {"zone": "eu", "rack": "7"}}) == one_word
    with pytest.raises(pdproxy.ConfigError, match=r"labels\.zone: Input should be a valid string"):
        NodeRecord.of({"url": "http://node:8001", "labels": {"zone": 1}})


async def test_bad_management_bodies_name_the_field(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    cases: list[tuple[str, object, str, str]] = [
        ("/nodes/add", {"status": {}}, "invalid_request", "url"),
        ("/nodes/add", {"url": 5}, "invalid_request", "url"),
        ("/nodes/add", {"url": "http://127.0.0.1:1", "status": {"models": "m"}}, "invalid_request", "status.models"),
        ("/nodes/add", {"url": "http://127.0.0.1:1", "status": {"speed": "fast"}}, "invalid_request", "status.speed"),
        ("/nodes/add", {"url": "http://127.0.0.1:1", "max_concurrency": True}, "invalid_request", "max_concurrency"),
        ("/nodes/add", {"url": "http://127.0.0.1:1", "labels": {"zone": 3}}, "invalid_request", "labels.zone"),
        ("/nodes/add", {"url": "http://127.0.0.1:1", "status": {"role": 7}}, "invalid_node", "status.role"),
        ("/nodes/add", {"url": "http://127.0.0.1:1", "lease_ttl": -1}, "invalid_node", "lease_ttl"),
        ("/nodes/add", {"url": "http://127.0.0.1:1", "bootstrap_port": 70000}, "invalid_node", "bootstrap_port"),
        ("/nodes/remove", {"url": ["http://127.0.0.1:1"]}, "invalid_request", "url"),
        ("/nodes/terminate", {}, "invalid_request", "url"),
    ]
    async with pdproxy_serve(tmp_path) as p:
        for path, body, code, field in cases:
            async with http.post(p.url + path, json=body) as r:
                error = (await r.json())["error"]
                assert (r.status, error["code"], error["param"]) == (400, code, field), (path, body, error)
                assert r.headers["x-pdproxy-error"] == code
                assert field in error["message"], error
        async with http.post(p.url + "/nodes/add", json=[1, 2]) as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"] == "the body must be a JSON object"
        async with http.get(p.url + "/nodes/status") as r:
            assert await r.json() == {}, "no bad body registered anything"


async def test_openapi_lists_every_management_route_with_its_body_schema(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pdproxy_serve(tmp_path) as p, http.get(p.url + "/openapi.json") as r:
        document = await r.json()
    schemas = document["components"]["schemas"]

    def resolve(reference: dict[str, Any]) -> dict[str, Any]:
        return dict(schemas[reference["$ref"].removeprefix("#/components/schemas/")])

    for route in ROUTES:
        operation = document["paths"][route.path][route.method.lower()]
        if route.body is None:
            assert "requestBody" not in operation, route.path
            continue
        body = resolve(operation["requestBody"]["content"]["application/json"]["schema"])
        assert set(body["properties"]) == set(route.body.model_fields), route.path
    add = resolve(document["paths"]["/nodes/add"]["post"]["requestBody"]["content"]["application/json"]["schema"])
    assert add["required"] == ["url"]
    assert {"url", "status", "models", "role", "labels", "lease_ttl"} <= set(add["properties"])
    answer = document["paths"]["/nodes/add"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert set(resolve(answer)["properties"]) == {"url", "created", "status", "models_unknown"}


async def test_labels_come_from_static_config_and_registration(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    state = tmp_path / "nodes.json"
    async with MockEngine(model="m") as configured, MockEngine(model="m") as registered:
        async with pdproxy_serve(
            tmp_path, "--state-file", str(state), "--node", f"{configured.url},labels.zone=eu"
        ) as p:
            body = {"url": registered.url, "status": {"models": ["m"], "role": 1}, "labels": {"rack": "r7"}}
            async with http.post(p.url + "/nodes/add", json=body) as r:
                assert r.status == 200
                assert (await r.json())["status"]["labels"] == {"rack": "r7"}
            async with http.get(p.url + "/nodes/status") as r:
                status = await r.json()
            assert status[configured.url]["labels"] == {"zone": "eu"}
            assert status[registered.url]["labels"] == {"rack": "r7"}
            assert "api_key" not in status[registered.url], "status never shows a node's key"
            # `pdproxy nodes add` takes every attribute of the record, labels too.
            command = [sys.executable, "-m", "pdproxy", "nodes", "add", registered.url, "--url", p.url]
            command += ["--model", "m", "--label", "rack=r8", "--label", "row=2"]
            updated = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=30)
            assert updated.stdout.strip() == f"updated {registered.url}", updated.stderr
            async with http.get(p.url + "/nodes/status") as r:
                assert (await r.json())[registered.url]["labels"] == {"rack": "r8", "row": "2"}
        saved = {entry["url"]: entry for entry in json.loads(state.read_text())["nodes"]}
        assert saved[registered.url]["labels"] == {"rack": "r8", "row": "2"}, "the state file keeps the whole record"


def test_settings_hold_groups_and_take_flat_names() -> None:
    from pdproxy.config.settings import FIELDS, FLAT, HealthSettings

    assert set(FLAT) == set(FIELDS), "each setting's group, from the groups themselves"
    settings = Settings(health_interval=1.5, connect_timeout=3.0, port=9001)
    assert (settings.health.interval, settings.timeouts.connect, settings.server.port) == (
        1.5,
        3.0,
        9001,
    )
    assert settings.health == HealthSettings(health_interval=1.5), "a group built from its flat names"
    assert settings.health == HealthSettings(interval=1.5), "or from its fields' names"
    assert settings.health.model_dump()["health_interval"] == 1.5, "a group dumped by its flat names"
    assert Settings.from_json(settings.to_json()) == settings, "the JSON a granian worker reads"
    changed = settings.replace(health_fall=5)
    assert (changed.health.fall, changed.health.interval) == (5, 1.5), "replace keeps the group's others"
    assert changed.timeouts is settings.timeouts, "an untouched group is kept as it is"
    assert Settings(health=HealthSettings(health_rise=4)).health.rise == 4, "a group given whole"
    assert list(settings.flat()) == list(FIELDS), "--print-config shows the flat names"
    with pytest.raises(pdproxy.ConfigError, match=r"^health_interval must be a positive number of seconds"):
        settings.replace(health_interval=0)
    with pytest.raises(pdproxy.ConfigError, match=r"^connect_timeout must be a positive number of seconds"):
        Settings(health=HealthSettings(), connect_timeout=-1.0)
    with pytest.raises(pdproxy.ConfigError, match=r"^health_interval: Input should be a valid number"):
        Settings(health_interval="often")
    with pytest.raises(pdproxy.ConfigError, match=r"^unknown setting nope"):
        settings.replace(nope=1)
