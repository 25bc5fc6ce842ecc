"""The `pdproxy` command line: options, environment, config file, and the demo."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

import pdproxy
from pdproxy.config import Settings
from pdproxy.testing import MockSettings
from servers import chat_body, get_json, pdproxy_serve


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
    for field in dataclasses.fields(Settings):
        flag = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
        assert flag in help_text, flag
        assert f"PDPROXY_{field.name.upper()}" in help_text, field.name
    mock_help = run("mock-engine", "--help").stdout
    for field in dataclasses.fields(MockSettings):
        assert "--" + field.name.replace("_", "-") in mock_help, field.name


def effective(*args: str, env: dict[str, str] | None = None) -> dict:
    result = run("serve", "--print-config", *args, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    config = tmp_path / "pdproxy.toml"
    config.write_text(
        'port = 9001\npolicy = "round_robin"\nnodes = ["http://a:1", "http://b:2"]\nconnect_timeout = 3.5\n'
    )
    assert effective()["port"] == Settings().port
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


def test_bad_configuration_is_reported(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("prot = 1\n")
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "unknown setting(s)" in result.stderr
    assert "prot" in result.stderr
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


def test_settings_validate_types() -> None:
    with pytest.raises(pdproxy.ConfigError, match="port"):
        Settings(port="80")  # type: ignore[arg-type]
    with pytest.raises(pdproxy.ConfigError, match="log_level"):
        Settings(log_level="loud")
    assert Settings(nodes="http://a:1").nodes == ("http://a:1",)  # type: ignore[arg-type]
    assert Settings.from_json(Settings(nodes=("x",)).to_json()) == Settings(nodes=("x",))


@pytest.mark.slow
async def test_demo_serves_a_streaming_chat_and_cleans_up(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    def has_demo_model(url: str) -> bool:
        return [m["id"] for m in get_json(url + "/v1/models")["data"]] == ["pdproxy-demo"]

    with pdproxy_serve(tmp_path, "--demo", ready=has_demo_model) as demo:
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
    assert Settings().max_requests > 0
