"""pdproxy as a drop-in for `lmdeploy serve proxy`: LMDeploy's api_servers register with it
unchanged, and a verbatim `lmdeploy serve proxy` command line starts it with those settings in
force.

Where LMDeploy's own code can run (an interpreter with lmdeploy installed: ``LMDEPLOY_PYTHON``,
else the benchmark's ``bench/.peers/lmdeploy-venv``), its registration function and its CLI
parser are run against pdproxy; the other tests reproduce LMDeploy's exact requests."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme

from pdproxy.config.settings import LOG_LEVELS
from pdproxy.testing import MockEngine
from servers import REPO, chat_body, free_port, get_json, ledger, mock_engine, pdproxy_serve, run_process

LMDEPLOY_PYTHON = os.environ.get("LMDEPLOY_PYTHON") or str(
    REPO / "bench" / ".peers" / "lmdeploy-venv" / "bin" / "python"
)
needs_lmdeploy = pytest.mark.skipif(
    not Path(LMDEPLOY_PYTHON).exists(),
    reason=f"LMDeploy's own code needs an interpreter with lmdeploy, none at {LMDEPLOY_PYTHON} (set LMDEPLOY_PYTHON, "
    "or run bench/run.py once); the other tests here reproduce LMDeploy's requests and command lines",
)


def lmdeploy_post(url: str, payload: dict[str, Any]) -> tuple[int, str]:
    """POSTs as LMDeploy's api_server does (`requests.post(url, headers=..., json=data)`)."""
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"accept": "application/json", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_registration_as_lmdeploy_posts_it(tmp_path: Path) -> None:
    """LMDeploy's api_server treats any status but 200 as a failed registration, new node or not."""
    with mock_engine(tmp_path, "m") as engine, pdproxy_serve(tmp_path) as proxy:
        registration = {"url": engine.url, "status": {"models": ["m"], "role": 1}}
        status, text = lmdeploy_post(proxy.url + "/nodes/add", registration)
        assert status == 200, text
        assert json.loads(text)["created"] is True
        status, text = lmdeploy_post(proxy.url + "/nodes/add", registration)
        assert status == 200, text
        assert json.loads(text)["created"] is False
        assert engine.url in get_json(proxy.url + "/nodes/status")


#: Runs LMDeploy's `register_to_proxy` from its installed source (its module imports the whole
#: OpenAI serving stack; the function needs only what is given here), and prints what it logged.
REGISTER_SCRIPT = textwrap.dedent(
    """
    import __future__, ast, importlib.util, logging, pathlib, sys, types
    from fastapi import HTTPException
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.disagg.config import EngineRole
    from lmdeploy.serve.openai.utils import get_model_list
    from lmdeploy.utils import get_logger

    source_dir = pathlib.Path(importlib.util.find_spec("lmdeploy").submodule_search_locations[0])
    tree = ast.parse((source_dir / "serve" / "openai" / "api_server.py").read_text())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "register_to_proxy")
    logger = get_logger("lmdeploy")
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    namespace = {"logger": logger, "HTTPException": HTTPException, "get_model_list": get_model_list}
    module = ast.Module(body=[function], type_ignores=[])
    # api_server.py is compiled with `from __future__ import annotations`: so is its function here.
    exec(compile(module, "api_server.py", "exec", flags=__future__.annotations.compiler_flag), namespace)

    proxy_url, node_url, role = sys.argv[1], sys.argv[2], sys.argv[3]
    config = PytorchEngineConfig(role=EngineRole[role])
    engine = types.SimpleNamespace(model_name="m", backend_config=config, engine=types.SimpleNamespace())
    context = types.SimpleNamespace(
        async_engine=engine, engine_config=config, proxy_url=proxy_url, api_server_url=node_url
    )
    namespace["register_to_proxy"](context)
    namespace["register_to_proxy"](context)  # an api_server restarted: the node is known already
    print("\\n".join(records))
    """
)


@needs_lmdeploy
def test_lmdeploy_registration_function_logs_no_failure(tmp_path: Path) -> None:
    with mock_engine(tmp_path, "m", "--role", "prefill") as engine, pdproxy_serve(tmp_path) as proxy:
        result = subprocess.run(
            [LMDEPLOY_PYTHON, "-c", REGISTER_SCRIPT, proxy.url, engine.url, "Prefill"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
        assert result.returncode == 0, result.stderr
        assert "Service registration failed" not in result.stdout + result.stderr, result.stdout
        node = get_json(proxy.url + "/nodes/status")[engine.url]
        assert (node["role"], node["models"]) == (2, ["m"])


def lmdeploy_line(line: str) -> list[str]:
    """The arguments of an `lmdeploy serve proxy ...` command line, for `pdproxy serve`."""
    words = line.split()
    assert words[:3] == ["lmdeploy", "serve", "proxy"]
    return words[3:]


def post(url: str, payload: object, key: str | None = None, context: ssl.SSLContext | None = None) -> int:
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_verbatim_hybrid_command_line(tmp_path: Path) -> None:
    port = free_port()
    line = (
        f"lmdeploy serve proxy --server-name 127.0.0.1 --server-port {port} --routing-strategy min_observed_latency "
        "--api-keys key-one key-two --log-level INFO --disable-cache-status"
    )
    args, url = ["serve", *lmdeploy_line(line)], f"http://127.0.0.1:{port}"
    with (
        mock_engine(tmp_path, "m") as engine,
        run_process(args, url, "/health", str(tmp_path / "proxy.log")) as proxy,
    ):
        registration = {"url": engine.url, "status": {"models": ["m"], "role": 1}}
        assert post(proxy.url + "/nodes/add", registration) == 401, "keys guard registration too"
        assert post(proxy.url + "/nodes/add", registration, key="key-one") == 200
        for key in ("key-one", "key-two"):
            assert post(proxy.url + "/v1/chat/completions", chat_body("m"), key=key) == 200
        assert post(proxy.url + "/v1/chat/completions", chat_body("m"), key="key-three") == 401
        state = get_json_with_key(proxy.url + "/debug/state", "key-two")
        assert set(state["policies"].values()) == {"min_observed_latency"}, "every role, as LMDeploy routes"


def get_json_with_key(url: str, key: str, context: ssl.SSLContext | None = None) -> Any:
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        return json.loads(response.read())


async def test_verbatim_distserve_command_line_with_every_transport_flag(
    tmp_path: Path, pd_engines: tuple[MockEngine, MockEngine], http: aiohttp.ClientSession
) -> None:
    """DistServe, several keys, every transport flag and --ssl (LMDeploy's certificate variables)."""
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued.private_key_pem.write_to_path(str(key))
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    client = ssl.create_default_context()
    authority.configure_trust(client)
    port = free_port()
    line = (
        f"lmdeploy serve proxy --server-name 127.0.0.1 --server-port {port} --serving-strategy DistServe "
        "--routing-strategy random --migration-protocol NVLINK --link-type IB --disable-gdr "
        "--api-keys key-one key-two --ssl --log-level WARNING"
    )
    prefill, decode = pd_engines
    env = {"SSL_CERTFILE": str(cert), "SSL_KEYFILE": str(key)}
    url = f"https://127.0.0.1:{port}"
    async with run_process(
        ["serve", *lmdeploy_line(line)], url, "/health", str(tmp_path / "proxy.log"), env=env, tls=client
    ):
        auth = {"authorization": "Bearer key-two"}
        for engine, role in ((prefill, 2), (decode, 3)):
            registration = {"url": engine.url, "status": {"models": ["m"], "role": role}}
            async with http.post(url + "/nodes/add", json=registration, headers=auth, ssl=client) as r:
                assert r.status == 200
        body = chat_body("m", max_tokens=3)
        async with http.post(url + "/v1/chat/completions", json=body, headers=auth, ssl=client) as r:
            assert r.status == 200, await r.text()
        transport = {"protocol": "NVLINK", "rdma": {"with_gdr": False, "link_type": "IB"}, "nvlink": None}
        assert (await ledger(http, prefill))["transport"] == {decode.url: transport}
        assert decode.state.records[-1]["body"]["migration_request"]["protocol"] == 3
        async with http.get(url + "/debug/state", headers=auth, ssl=client) as r:
            policies = (await r.json())["policies"]
        assert (policies["prefill"], policies["decode"]) == ("random", "random")


#: How every `lmdeploy serve proxy` option reads in pdproxy's settings: its field, and the value
#: LMDeploy's argument has there (None: the field takes the argument as it is).
LMDEPLOY_MEANING: dict[str, tuple[str, Any]] = {
    "server_name": ("host", None),
    "server_port": ("port", None),
    "serving_strategy": ("serving_strategy", None),
    "dummy_prefill": ("dummy_prefill", None),
    "routing_strategy": ("policy", None),
    "disable_cache_status": ("disable_cache_status", None),
    "migration_protocol": ("migration_protocol", None),
    "link_type": ("link_type", None),
    "disable_gdr": ("disable_gdr", None),
    "api_keys": ("api_keys", lambda keys: ["<hidden>"] * len(keys)),
    "ssl": ("ssl", None),
    "log_level": ("log_level", lambda level: LOG_LEVELS[level.lower()]),  # pdproxy's name of each
}

#: Prints the options of LMDeploy's own `lmdeploy serve proxy` parser as JSON.
PARSER_SCRIPT = textwrap.dedent(
    """
    import argparse, json
    from lmdeploy.cli.serve import SubCliServe
    parser = argparse.ArgumentParser()
    SubCliServe.subparsers = parser.add_subparsers()
    SubCliServe.add_parser_proxy()
    proxy = SubCliServe.subparsers.choices["proxy"]
    options = [
        {"flag": a.option_strings[-1], "dest": a.dest, "nargs": a.nargs, "choices": a.choices,
         "type": getattr(a.type, "__name__", None)}
        for a in proxy._actions if a.dest != "help"
    ]
    print(json.dumps(options))
    """
)


@needs_lmdeploy
def test_every_lmdeploy_proxy_flag_is_taken_with_its_meaning() -> None:
    """Read from LMDeploy's own parser: every option, with every choice it allows."""
    found = subprocess.run([LMDEPLOY_PYTHON, "-c", PARSER_SCRIPT], capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    options = json.loads(found.stdout)
    assert {o["dest"] for o in options} == set(LMDEPLOY_MEANING), "an option of LMDeploy's is not mapped here"
    env = {**os.environ, "SSL_CERTFILE": "cert.pem", "SSL_KEYFILE": "key.pem"}
    for option in options:
        field, meaning = LMDEPLOY_MEANING[option["dest"]]
        if option["nargs"] == 0:
            values: list[list[str]] = [[]]
        elif option["nargs"] == "*":
            values = [["k1", "k2", "k3"], ["k1"]]
        elif option["choices"]:
            values = [[choice] for choice in option["choices"]]
        else:
            values = [["9123" if option["type"] == "int" else "10.0.0.1"]]
        for given in values:
            result = subprocess.run(
                [sys.executable, "-m", "pdproxy", "serve", "--print-config", option["flag"], *given],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
            assert result.returncode == 0, (option["flag"], given, result.stderr)
            argument: Any = (
                True if not given and option["nargs"] == 0 else given if option["nargs"] == "*" else given[0]
            )
            if option["type"] == "int":
                argument = int(argument)
            expected = meaning(argument) if meaning else argument
            assert json.loads(result.stdout)[field] == expected, (option["flag"], given)
