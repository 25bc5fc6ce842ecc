"""The `pdproxy` command line: options, environment, config file, and the demo."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

import pdproxy
from pdproxy.config.settings import FIELDS, Settings
from pdproxy.fleet.node_record import NodeAttributes
from pdproxy.testing import MockSettings
from servers import REPO, chat_body, free_port, get_json, pdproxy_serve


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "pdproxy", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0
    assert pdproxy.__version__ in result.stdout


def test_every_setting_is_an_option_with_an_env_var() -> None:
    help_text = run("serve", "--help").stdout
    for name, field in FIELDS.items():
        flag = (field.json_schema_extra or {}).get("flag") or "--" + name.replace("_", "-")  # type: ignore[union-attr]
        assert flag in help_text, flag
        assert f"PDPROXY_{name.upper()}" in help_text, name
    mock_help = run("mock-engine", "--help").stdout
    for name in MockSettings.model_fields:
        assert "--" + name.replace("_", "-") in mock_help, name


def effective(*args: str, env: dict[str, str] | None = None) -> dict:
    result = run("serve", "--print-config", *args, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    config = tmp_path / "pdproxy.toml"
    config.write_text(
        'port = 9001\npolicy = "round_robin"\nnodes = ["http://a:1", "http://b:2"]\nconnect_timeout = 3.5\n'
    )
    assert effective()["port"] == Settings().server.port
    from_file = effective("--config", str(config))
    assert (from_file["port"], from_file["nodes"], from_file["connect_timeout"]) == (
        9001,
        ["http://a:1", "http://b:2"],
        3.5,
    )
    env = {"PDPROXY_PORT": "9002", "PDPROXY_NODES": "http://c:3 http://d:4"}
    from_env = effective("--config", str(config), env=env)
    assert (from_env["port"], from_env["nodes"]) == (9002, ["http://c:3", "http://d:4"])
    from_cli = effective("--config", str(config), "--port", "9003", "--node", "http://e:5", env=env)
    assert (from_cli["port"], from_cli["nodes"], from_cli["connect_timeout"]) == (9003, ["http://e:5"], 3.5)
    assert effective(env={"PDPROXY_CONFIG": str(config)})["port"] == 9001


def test_lmdeploy_spellings_and_hidden_keys() -> None:
    config = effective(
        "--server-name",
        "0.0.0.0",
        "--server-port",
        "9005",
        "--routing-strategy",
        "random",
        "--api-keys",
        "secret-1",
        "--api-keys",
        "secret-2",
    )
    assert (config["host"], config["port"], config["policy"]) == ("0.0.0.0", 9005, "random")
    assert config["api_keys"] == ["<hidden>", "<hidden>"], "keys are never printed"
    assert effective(env={"PDPROXY_API_KEYS": "one-long-key"})["api_keys"] == ["<hidden>"], "one key, not letters"


def test_settings_file_keys_are_the_option_names_and_the_older_spellings_still_read(tmp_path: Path) -> None:
    config = tmp_path / "pdproxy.toml"
    config.write_text(
        'node = ["http://a:1"]\nmodel_policy = ["qwen=random"]\nallow_node_cidr = ["10.0.0.0/8"]\n'
        'keyless_registration_from = ["10.1.0.0/16"]\notlp_header = ["x-team=llm"]\n'
    )
    read = effective("--config", str(config))
    assert read["nodes"] == ["http://a:1"]
    assert read["model_policies"] == ["qwen=random"]
    assert read["allow_node_cidrs"] == ["10.0.0.0/8"]
    assert read["keyless_registration_cidrs"] == ["10.1.0.0/16"]
    assert read["otlp_headers"] == ["<hidden>"]
    config.write_text('nodes = ["http://b:2"]\nmodel_policies = ["qwen=random"]\n')
    assert effective("--config", str(config))["model_policies"] == ["qwen=random"], "the older spelling"
    config.write_text('node = ["http://a:1"]\nnodes = ["http://b:2"]\n')
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "nodes is given twice" in result.stderr


def test_bad_configuration_is_reported(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("prot = 1\nmodel_polcy = 2\nzzz = 3\n")
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "unknown setting(s)" in result.stderr
    assert "prot (did you mean port?)" in result.stderr
    assert "model_polcy (did you mean model_policy?)" in result.stderr, "the option's name is the one suggested"
    assert result.stderr.rstrip().endswith(", zzz"), "nothing close: no guess"
    result = run("serve", "--connect-timeout", "0", "--print-config")
    assert result.returncode == 2
    assert "connect_timeout must be a positive number" in result.stderr
    result = run("serve", "--workers", "99")
    assert result.returncode == 2
    assert "--workers is at most 32" in result.stderr
    result = run("serve", "--registry", "http://redis:6379")
    assert result.returncode == 2
    assert "unsupported scheme" in result.stderr
    result = run("mock-engine", "--role", "chef")
    assert result.returncode == 2
    assert "role must be one of" in result.stderr


def one_line_refusal(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    """A setting pdproxy cannot use: exit 2, one line naming it, nothing served or printed before."""
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pdproxy: ")
    for text in expected:
        assert text in lines[0]


@pytest.mark.parametrize("edge", ["rust", "granian"])
def test_unknown_policies_are_refused_before_serving(edge: str) -> None:
    port = str(free_port())
    for args, named in (
        (("--policy", "fastest"), "'fastest' (policy)"),
        (("--routing-strategy", "fastest"), "'fastest' (policy)"),
        (("--prefill-policy", "fastest"), "'fastest' (prefill_policy)"),
        (("--decode-policy", "fastest"), "'fastest' (decode_policy)"),
        (("--model-policy", "m=fastest"), "'fastest' (model policy for m)"),
        (("--model-policy", "fastest"), "must read MODEL=POLICY"),
    ):
        result = run("serve", "--edge", edge, "--port", port, *args)
        one_line_refusal(result, named)
    known = ", ".join(pdproxy._pdproxy.POLICY_NAMES)
    assert known in run("serve", "--policy", "fastest").stderr, "the data plane's own list is the one shown"


@pytest.mark.parametrize(
    ("node", "named"),
    [
        ("http://169.254.169.254:80", "a cloud metadata address"),
        ("http://[fe80::1]:80", "a link-local address"),
        ("http://0.0.0.0:8000", "the unspecified address"),
    ],
)
def test_a_static_node_the_rules_refuse_stops_the_start(node: str, named: str) -> None:
    result = run("serve", "--port", str(free_port()), "--node", node)
    one_line_refusal(result, "--node", named)
    result = run(
        "serve", "--port", str(free_port()), "--node", "http://10.1.2.3:80", "--allow-node-cidr", "10.9.0.0/16"
    )
    one_line_refusal(result, "outside the allowed networks")


def test_a_static_node_whose_name_does_not_resolve_yet_is_tried_again_while_serving(tmp_path: Path) -> None:
    # A service name that is not in DNS yet (a pod still coming up) is not a bad setting.
    node = "http://engine-not-up-yet.invalid:8000"
    with pdproxy_serve(tmp_path, "--node", node) as proxy:
        assert node not in get_json(proxy.url + "/nodes/status")
        assert f"node {node} not added yet" in proxy.log()
        assert "trying again" in proxy.log()


def test_missing_optional_packages_are_refused_before_serving() -> None:
    without_redis = "import sys; sys.modules['redis'] = None; from pdproxy.cli import main; main()"
    result = subprocess.run(
        [sys.executable, "-c", without_redis, "serve", "--port", str(free_port()), "--registry", "redis://r:6379/0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    one_line_refusal(result, "needs the redis package", "pip install 'pdproxy[redis]'")


def test_lmdeploy_spellings_of_multi_values_log_levels_and_transport() -> None:
    config = effective("--api-keys", "k1", "k2", "--log-level", "WARN", "--node", "http://a:1", "http://b:2")
    assert (len(config["api_keys"]), config["log_level"]) == (2, "warning")
    assert config["nodes"] == ["http://a:1", "http://b:2"]
    assert effective("--api-keys", "--ssl", env={"SSL_CERTFILE": "c", "SSL_KEYFILE": "k"})["api_keys"] == []
    assert len(effective("--api-keys=-starts-with-a-dash", "--port", "1")["api_keys"]) == 1
    for given, level in (("CRITICAL", "critical"), ("FATAL", "critical"), ("REQUEST", "debug"), ("NOTSET", "debug")):
        assert effective("--log-level", given)["log_level"] == level
    transport = effective("--migration-protocol", "NVLINK", "--link-type", "IB", "--disable-gdr")
    assert (transport["migration_protocol"], transport["link_type"], transport["disable_gdr"]) == ("NVLINK", "IB", True)
    one_line_refusal(run("serve", "--link-type", "Ethernet"), "link_type must be RoCE or IB")
    one_line_refusal(run("serve", "--ssl"), "SSL_CERTFILE and SSL_KEYFILE")
    one_line_refusal(run("serve", "--allow-credentials"), "never * with credentials")


def test_routing_strategy_applies_to_every_role_unless_a_role_has_its_own() -> None:
    from pdproxy import Router

    assert Router(settings=Settings(policy="random")).policies == {
        "hybrid": "random",
        "prefill": "random",
        "decode": "random",
    }
    own = Router(settings=Settings(policy="random", decode_policy="round_robin")).policies
    assert (own["prefill"], own["decode"]) == ("random", "round_robin")


def test_help_is_grouped_by_section() -> None:
    help_text = run("serve", "--help").stdout
    headings = [line.rstrip(":") for line in help_text.splitlines() if line and not line.startswith(" ")]
    for heading in ("Serving", "Routing, limits and timeouts", "Keys, TLS and CORS", "Health checks"):
        assert heading in headings, headings
    security = help_text.split("Keys, TLS and CORS:")[1].split("Health checks:")[0]
    assert "--api-keys" in security
    assert "--ssl" in security
    assert "--connect-timeout" not in security


def test_help_reads_at_80_columns_with_whole_words_and_typed_defaults() -> None:
    help_text = run("serve", "--help", env={"COLUMNS": "80"}).stdout
    lines = help_text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert not [line for line in lines if line.rstrip().endswith(("-", "="))], "a flag or example split"
    assert "http://10.0.0.2:30000,role=prefill,model=qwen" in help_text, "the example stays whole"
    node_help = help_text.split("--node TEXT")[1].split("\n  --")[0]
    for name in NodeAttributes.model_fields:
        assert name.removesuffix("s") in node_help, f"--node's help leaves out {name}"
    assert "default: -1" not in help_text, "an unset marker is not a default"
    assert 'default: ""' not in help_text
    assert "PDPROXY_EDGE_THREADS; default: 0]" in " ".join(help_text.split()), "a zero default is still shown"
    health = help_text.split("Health checks:")[1].split("\n\n")[0]
    assert "--health-interval" in health
    assert "--engine-metrics-interval" not in health, "engine readings have their own group"
    mock_help = " ".join(run("mock-engine", "--help", env={"COLUMNS": "80"}).stdout.split())
    for knob in ("status=N", "hang", "drop_after=N", "stall_body", "endless", "prefill.KNOB"):
        assert knob in mock_help, knob
    assert "(see faults)" not in mock_help


def test_a_bad_node_attribute_is_named_once() -> None:
    result = run("serve", "--node", "http://a:1,role=prefil")
    one_line_refusal(result, "role 'prefil' is not hybrid, prefill or decode")
    assert "role: role" not in result.stderr


def test_static_nodes_carry_what_registration_would(tmp_path: Path) -> None:
    spec = "http://p:1,role=prefill,model=m,model=n,speed=2,max_concurrency=4,api_key=k,bootstrap_port=8998"
    config = tmp_path / "fleet.toml"
    config.write_text(
        'nodes = ["http://h:1", {url = "http://p:1", role = "prefill", models = ["m", "n"], speed = 2, '
        'max_concurrency = 4, api_key = "k", bootstrap_port = 8998}]\n'
    )
    shown = spec.replace("api_key=k", "api_key=<hidden>").replace("speed=2", "speed=2.0")
    assert effective("--node", spec)["nodes"] == [shown], "the key is never printed"
    assert effective(env={"PDPROXY_NODES": f"http://h:1 {spec}"})["nodes"] == ["http://h:1", shown]
    assert effective("--config", str(config))["nodes"] == ["http://h:1", shown]
    for bad, named in (
        ("http://p:1,role=chef", "role 'chef'"),
        ("http://p:1,max_concurrency=lots", "max_concurrency"),
        ("http://p:1,colour=red", "unknown key(s) colour"),
        ("http://p:1,role", "must read key=value"),
        ("ftp://p:1", "scheme"),
    ):
        one_line_refusal(run("serve", "--node", bad), named)


async def test_static_nodes_are_registered_with_what_they_declare(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    from pdproxy.testing import MockEngine

    async with MockEngine(model="m", role="prefill") as prefill, MockEngine(model="m", role="decode") as decode:
        nodes = [
            f"{prefill.url},role=prefill,model=m,speed=2,max_concurrency=3,api_key=node-key,bootstrap_port=8998",
            f"{decode.url},role=3,model=m",
        ]
        async with pdproxy_serve(tmp_path, "--serving-strategy", "DistServe", "--node", *nodes) as proxy:
            async with http.get(proxy.url + "/nodes/status") as r:
                status = await r.json()
            assert (status[prefill.url]["role"], status[decode.url]["role"]) == (2, 3)
            assert (status[prefill.url]["speed"], status[prefill.url]["max_concurrency"]) == (2, 3)
            async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
                assert r.status == 200, await r.text()
            async with http.get(prefill.url + "/mock/requests") as r:
                seen = [rec["headers"].get("authorization") for rec in await r.json()]
            assert "Bearer node-key" in seen, "the node's own key is sent to it"


def test_mock_engine_on_a_taken_port_says_so_in_one_line() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("mock-engine", "--port", str(port))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines == [f"pdproxy mock-engine: cannot listen on 127.0.0.1:{port}: address already in use"], lines


def test_settings_validate_types() -> None:
    with pytest.raises(pdproxy.ConfigError, match="port"):
        Settings(port="80")  # type: ignore[arg-type]
    with pytest.raises(pdproxy.ConfigError, match="log_level"):
        Settings(log_level="loud")
    assert Settings(nodes="http://a:1").routing.nodes == ("http://a:1",)  # type: ignore[arg-type]
    assert Settings.from_json(Settings(nodes=("x",)).to_json()) == Settings(nodes=("x",))


@pytest.mark.slow
async def test_demo_serves_a_streaming_chat_and_cleans_up(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    def has_demo_model(url: str) -> bool:
        return [m["id"] for m in get_json(url + "/v1/models")["data"]] == ["pdproxy-demo"]

    async with pdproxy_serve(tmp_path, "--demo", ready=has_demo_model) as demo:
        body = chat_body("pdproxy-demo", stream=True)
        async with http.post(demo.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            received = await r.read()
        assert received.endswith(b"data: [DONE]\n\n")
        engine_urls = re.findall(r"starting demo mock engine (http://\S+)", demo.log())
        assert len(engine_urls) == 2
        assert demo.stop(signal.SIGTERM) == 0
    for url in engine_urls:  # the mock engines went away with the proxy
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url + "/health", timeout=2)


def test_there_is_a_global_cap_by_default() -> None:
    assert Settings().limits.max_requests > 0


def test_the_license_is_the_one_the_package_declares() -> None:
    root = REPO
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["license"]
    assert declared == {"text": "Apache-2.0"}
    text = (root / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
