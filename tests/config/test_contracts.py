"""The contracts both planes keep are declared once, in the data plane, and the control plane
reads them from there: the error table, the inference and prefill/decode paths, the prefill
leg's body, where a key is read from, keys and CORS. Nothing in Python restates them."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

import pdproxy
from pdproxy import _pdproxy, errors
from pdproxy.management import workers_api
from pdproxy.pd import Stateless, lmdeploy
from pdproxy.server import app

#: Entries only the data plane answers with (no exception class raises them: the edge's own
#: refusals, CORS, which it answers for both planes), and the second type of a tenant's rate
#: limit (``RateLimited`` answers with it when the limit is tokens).
EDGE_ONLY = {"TooManyConnections", "ControlPlaneUnavailable", "TokensRateLimited", "CorsRefused"}
ANSWER_FIELDS = {"status", "code", "type", "retry_after"}


def control_plane_modules() -> list[Path]:
    """Every module of the package but the test helpers (``pdproxy.testing``: its mock engine
    answers as an engine does)."""
    package = Path(pdproxy.__file__).parent
    return [path for path in package.rglob("*.py") if "testing" not in path.relative_to(package).parts]


def error_classes() -> dict[str, type[errors.PdproxyError]]:
    found: dict[str, type[errors.PdproxyError]] = {}
    pending: list[type[errors.PdproxyError]] = [errors.PdproxyError]
    while pending:
        cls = pending.pop()
        found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found


def test_every_error_class_answers_as_the_data_plane_declares() -> None:
    classes = error_classes()
    for name, (status, kind, code, retry_after) in _pdproxy.ERRORS.items():
        if name in EDGE_ONLY:
            assert name not in classes
            continue
        cls = classes[name]
        assert (cls.status, cls.type, cls.code, cls.retry_after) == (status, kind, code, retry_after), name
        body = json.loads(cls("m").body())["error"]
        assert (body["type"], body["code"], body["message"]) == (kind, code, "m")
    # A class the table does not name answers as its base does.
    assert errors.InvalidPrefillAnswer.code == _pdproxy.ERRORS["InvalidAnswer"][2]
    assert set(_pdproxy.ERRORS) - EDGE_ONLY <= set(classes)


@pytest.mark.parametrize("module", [errors, workers_api])
def test_no_error_class_restates_its_answer(module: object) -> None:
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for statement in cls.body:
            targets = statement.targets if isinstance(statement, ast.Assign) else []
            if isinstance(statement, ast.AnnAssign) and statement.value is not None:
                targets = [statement.target]
            named = {t.id for t in targets if isinstance(t, ast.Name)}
            assert not named & ANSWER_FIELDS, f"{cls.name} sets {named & ANSWER_FIELDS} itself"


def test_paths_are_the_data_planes() -> None:
    assert frozenset(_pdproxy.INFERENCE_PATHS) == app.INFERENCE_PATHS
    assert lmdeploy.DistServe.paths == frozenset(_pdproxy.PD_PATHS["lmdeploy"])
    for protocol in ("vllm", "sglang"):
        assert Stateless(protocol).paths == frozenset(_pdproxy.PD_PATHS[protocol]), protocol


def test_no_python_module_lists_the_paths_itself() -> None:
    for path in control_plane_modules():
        source = path.read_text()
        assert '"/v1/completions"' not in source, path.name


@pytest.mark.parametrize(
    ("protocol", "path", "expected"),
    [
        (
            "lmdeploy",
            "/v1/chat/completions",
            {"max_tokens": 1, "stream": False, "with_cache": True, "preserve_cache": True, "max_completion_tokens": 1},
        ),
        ("lmdeploy", "/v1/completions", {"max_tokens": 1, "stream": False, "with_cache": True, "preserve_cache": True}),
        ("vllm", "/v1/completions", {"max_tokens": 1, "stream": False}),
    ],
)
def test_prefill_bodies(protocol: str, path: str, expected: dict[str, object]) -> None:
    client = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 9}
    body = json.loads(_pdproxy.pd_prefill_body(protocol, path, json.dumps(client).encode()))
    assert {key: body[key] for key in expected} == expected
    assert "stream_options" not in body
    assert (body["model"], body["prompt"]) == ("m", "hi")
    if protocol == "vllm":
        assert body["kv_transfer_params"]["do_remote_decode"] is True
    with pytest.raises(errors.ConfigError):
        _pdproxy.pd_prefill_body("nope", path, b"{}")


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ([(b"authorization", b"Bearer  k1 ")], b"k1"),
        ([(b"authorization", b"bearer k1"), (b"x-api-key", b"k2")], b"k1"),
        ([(b"x-api-key", b" k2 ")], b"k2"),
        ([(b"authorization", b"Basic k1"), (b"x-api-key", b"k2")], None),  # the first header decides
        ([(b"authorization", b"Bearer")], None),
        ([], None),
    ],
)
def test_the_key_is_read_as_the_edge_reads_it(headers: list[tuple[bytes, bytes]], key: bytes | None) -> None:
    assert _pdproxy.client_key(headers) == key


def test_no_python_module_reads_keys_or_answers_cors_itself() -> None:
    assert not any(path.name == "cors.py" for path in control_plane_modules())
    for path in control_plane_modules():
        source = path.read_text()
        assert "access-control-allow-origin" not in source, path.name
        assert 'b"x-api-key"' not in source, path.name
