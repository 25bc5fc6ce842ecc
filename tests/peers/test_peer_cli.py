"""The peer routers' command lines start pdproxy (program name changed): read as their own
parsers read them, every flag applied or refused with a reason, their documented lines taken
field by field as their parsers took them.

Their parsers are the authority: the flag tables pdproxy reads with are checked against the
dumps of their parsers (tests/fixtures/peer_parsers), and those dumps against the parsers
installed from PyPI (scripts/peer_venvs.sh) — lmdeploy-router is not on PyPI, so its dump was
recorded from its source in the lmdeploy repository."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from pdproxy.peers import ROUTERS, Plan, Refused, read, table, whose
from pdproxy.peers.flags import Flag
from pdproxy.peers.rules import rule_of
from pdproxy.testing.fake_kube import FakeKubeApi
from servers import REPO, free_port, get_json, run_process

ROOT = REPO
FIXTURES = ROOT / "tests" / "fixtures" / "peer_parsers"
PEERS = ROOT / "bench" / ".peers"
#: The routers whose parsers install from PyPI (scripts/peer_venvs.sh).
ON_PYPI = ("sglang-router", "smg", "vllm-router")
#: The source label of a line taken from the router's repository (owner/name@commit:path).
FROM_REPOSITORY = re.compile(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}:")


def examples(router: str) -> list[dict[str, Any]]:
    """The command lines in the router's own documentation, each with what its parser read."""
    entries: list[dict[str, Any]] = json.loads((FIXTURES / f"{router}-examples.json").read_text())
    return [e for e in entries if e["parsed"].get("ok")]


def peer_words(entry: dict[str, Any]) -> list[str]:
    """The words of a documented line after its program (what pdproxy is given)."""
    return list(entry["parsed"]["argv"])


# --------------------------------------------------------------------------------------------
# The tables are their parsers


def _table_script() -> Any:
    spec = importlib.util.spec_from_file_location("peer_flag_tables", ROOT / "scripts" / "peer_flag_tables.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flag_tables_are_the_dumps_of_their_parsers() -> None:
    script = _table_script()
    dumps = script.dumps()
    assert sorted(dumps) == sorted(ROUTERS)
    for router, path in dumps.items():
        packaged = json.loads((ROOT / "python" / "pdproxy" / "peers" / "flags" / f"{router}.json").read_text())
        assert packaged == script.table(path), f"{router}: run scripts/peer_flag_tables.py"


def _peer_python(router: str) -> Path:
    python = PEERS / f"{router}-venv" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: scripts/peer_venvs.sh installs the peers' parsers (scripts/test.sh runs it)")
    return python


def _run_dump(router: str, *args: str) -> Any:
    python = _peer_python(router)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}  # their defaults read the environment
    out = subprocess.run(
        [str(python), str(ROOT / "scripts" / "peer_parsers.py"), "--router", router, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.parametrize("router", ROUTERS)
def test_the_installed_parsers_are_the_dumped_ones(router: str) -> None:
    if router not in ON_PYPI:
        pytest.skip(f"{router} is not on PyPI: its dump was recorded from its source (tests/fixtures/peer_parsers)")
    live = _run_dump(router)
    version = live["distribution"]["version"]
    recorded = json.loads((FIXTURES / f"{router}-{version}.json").read_text())
    assert live["parser"] == recorded["parser"]
    recorded_examples = json.loads((FIXTURES / f"{router}-examples.json").read_text())
    packaged = [e for e in recorded_examples if not FROM_REPOSITORY.match(e["source"])]
    live_examples = _run_dump(router, "--examples")
    assert [e["parsed"] for e in live_examples] == [e["parsed"] for e in packaged], (
        "their parser reads the lines of their package's docs as recorded"
    )
    # Lines from their repository's docs (not in the package): their argv read again.
    for entry in recorded_examples:
        if FROM_REPOSITORY.match(entry["source"]):
            live = _run_dump(router, "--parse", "--", *peer_words(entry))
            assert live["config"] == entry["parsed"]["config"], entry["source"]


# --------------------------------------------------------------------------------------------
# Every flag: applied, or taken with a note, or refused with one line

#: Sample values for flags whose value must have a form (the rest take a number or a word).
SAMPLES: dict[str, list[str]] = {
    "worker_urls": ["http://127.0.0.1:9001"],
    "prefill": ["http://127.0.0.1:9002", "8998"],
    "decode": ["http://127.0.0.1:9003"],
    "encode": ["http://127.0.0.1:9004"],
    "selector": ["app=vllm"],
    "prefill_selector": ["app=prefill"],
    "decode_selector": ["app=decode"],
    "encode_selector": ["app=encode"],
    "router_selector": ["app=router"],
    "control_plane_api_keys": ["ci:CI:admin:secret"],
    "otlp_traces_endpoint": ["http://127.0.0.1:4318/v1/traces"],
    "host": ["127.0.0.2"],
    "health_check_endpoint": ["/health"],
    "ca_cert_paths": ["/tmp/ca.pem"],
    "cors_allowed_origins": ["http://localhost:3000"],
    "history_backend": ["none"],
    "log_level": ["debug"],
    "discovery_provider": ["kubernetes"],
    "intra_node_data_parallel_size": ["1"],
    "model_alias": ["a=b"],
}

PD_FLAG = {
    "sglang-router": "--pd-disaggregation",
    "smg": "--pd-disaggregation",
    "vllm-router": "--vllm-pd-disaggregation",
}


def _pd_flag(router: str) -> str:
    return PD_FLAG.get(router, "--lmdeploy-pd-disaggregation")


def _context(router: str, flag: Flag) -> list[str]:
    """What the flag needs beside it to mean anything (its mode, the pods to find); never the flag itself."""
    discovery = ["--service-discovery", "--selector", "a=b"]
    return {
        "prefill": [_pd_flag(router)],
        "decode": [_pd_flag(router)],
        "service_discovery": ["--selector", "a=b"],
        "discovery_provider": ["--selector", "a=b"],
        "selector": ["--service-discovery"],
        "prefill_selector": ["--service-discovery"],
        "decode_selector": ["--service-discovery"],
        "service_discovery_namespace": discovery,
        "service_discovery_port": discovery,
        "enable_trace": ["--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"],
        "otlp_traces_endpoint": ["--enable-trace"],
    }.get(flag.dest, [])


def _given(flag: Flag) -> list[str]:
    """The flag with a sample value, as a command line would give it."""
    if not flag.takes_value:
        return [flag.name]
    if flag.dest in SAMPLES:
        sample = SAMPLES[flag.dest]
        return [flag.name, *(sample[:1] if flag.nargs == 1 else sample)]  # lmdeploy-router: --prefill URL
    if flag.choices:
        value = next((c for c in flag.choices if c != flag.default), flag.choices[0])
        return [flag.name, str(value)]
    return [flag.name, {"int": "7", "float": "0.5"}.get(flag.type or "str", "word")]


def _outcome(line: list[str], router: str) -> Plan | Refused:
    """The plan of a line, or its refusal."""
    try:
        return read(line, router)
    except Refused as e:
        return e


def _flags() -> Iterator[tuple[str, str]]:
    for router in ROUTERS:
        for flag in table(router).flags:
            yield router, flag.dest


def _changes(plan: Plan) -> tuple[object, ...]:
    return (plan.settings, plan.workers, plan.policies, plan.pd_protocol)


@pytest.mark.parametrize(("router", "dest"), list(_flags()))
def test_every_flag_is_applied_or_refused_with_a_reason(router: str, dest: str) -> None:
    flag = table(router).by_dest[dest]
    rule = rule_of(router, dest)
    assert rule is not None, f"{router} {flag.name}: no rule"
    context = _context(router, flag)
    line = [*context, *_given(flag)]
    plan = _outcome(line, router)
    if isinstance(plan, Refused):
        assert plan.flag == flag.name, f"{line}: refused for {plan.flag}, not {flag.name}"
        assert plan.reason
        assert "\n" not in plan.reason
        assert rule.kind != "note", f"{flag.name} is described as taken but is refused: {plan.reason}"
        return
    assert rule.kind != "refuse", f"{flag.name} is described as refused but was taken"
    without = _outcome(context, router)
    # A line refused without the flag needs it to be taken at all: the flag had its effect.
    changed = isinstance(without, Refused) or _changes(plan) != _changes(without)
    noted = [n for n in plan.notes if n.startswith((f"{flag.name}:", f"{flag.name} "))]
    assert noted or changed, f"{router} {' '.join(line)}: no setting changed and no note"
    if rule.kind == "note":
        assert noted, f"{flag.name}: a note says why it has no effect"


def test_a_refused_flag_is_one_line_and_status_2(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdproxy", "--worker-urls", "http://127.0.0.1:9", "--enable-igw"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("pdproxy (as sglang-router): --enable-igw: IGW"), lines[0]


def test_an_unknown_policy_is_one_line_listing_the_known_ones() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdproxy",
            "--as-router",
            "smg",
            "--worker-urls",
            "http://127.0.0.1:9",
            "--policy",
            "fast",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()
    for word in ("--policy", "'fast'", "cache_aware", "prefix_hash"):
        assert word in line, line


def test_a_line_says_whose_it_is_and_the_flag_names_another() -> None:
    line = ["--worker-urls", "http://127.0.0.1:9"]
    assert whose(line) == "sglang-router"
    assert read(line, "sglang-router").settings["host"] == "0.0.0.0"  # the routers' own defaults
    assert read(line, "vllm-router").settings["host"] == "127.0.0.1"
    assert whose(["--vllm-pd-disaggregation", "--prefill", "http://a:1", "--decode", "http://b:2"]) == "vllm-router"
    assert whose(["--worker-urls", "http://a:1", "--policy", "prefix_hash"]) == "smg"


def test_help_says_what_each_flag_becomes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdproxy", "--as-router", "vllm-router", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for flag in table("vllm-router").flags:
        assert flag.flags[0] in out.stdout, flag.name
    assert "no rule" not in out.stdout
    assert re.search(r"--policy .*cache_aware -> scored", out.stdout.replace("\n    ", " ")), out.stdout[:2000]


# --------------------------------------------------------------------------------------------
# Their documented lines, field by field as their parsers read them

#: Each peer policy and the pdproxy policy it is routed with (the README's table).
OURS = {
    "random": "random",
    "round_robin": "round_robin",
    "cache_aware": "scored",
    "kv_aware": "scored",
    "bucket": "scored",
    "power_of_two": "least_requests",
    "least_load": "least_engine_load",
    "consistent_hash": "consistent_hash",
    "consistent_hashing": "consistent_hash",
    "rendezvous_hash": "consistent_hash",
    "sticky_least_loaded": "consistent_hash",
    "manual": "consistent_hash",
    "prefix_hash": "prefix",
}


def _workers(plan: Plan, role: str) -> list[tuple[str, int | None]]:
    return [(w.url, w.bootstrap_port) for w in plan.workers if w.role == role]


def _selector(value: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in value.items())


Check = Callable[[dict[str, Any], Plan], None]


def _same(setting: str, field: str | None = None, convert: Callable[[Any], Any] = lambda v: v) -> Check:
    def check(config: dict[str, Any], plan: Plan) -> None:
        assert plan.settings[setting] == convert(config[field or setting]), setting

    return check


def _pd_mode(protocol: str) -> Check:
    def check(config: dict[str, Any], plan: Plan) -> None:
        assert plan.settings["serving_strategy"] == "DistServe"
        assert plan.settings["pd_protocol"] == protocol

    return check


def _role_policy(role: str) -> Check:
    def check(config: dict[str, Any], plan: Plan) -> None:
        assert plan.settings[role] == OURS[config[role]], role

    return check


def _discovery(config: dict[str, Any], plan: Plan) -> None:
    for theirs, ours in (
        ("selector", "k8s_selector"),
        ("prefill_selector", "k8s_prefill_selector"),
        ("decode_selector", "k8s_decode_selector"),
    ):
        if config[theirs]:
            assert plan.settings[ours] == _selector(config[theirs])
        else:
            assert ours not in plan.settings


#: Each dest a documented line may give: how pdproxy's plan must agree with their config.
AGREES: dict[str, Check] = {
    # A comma-joined value (in lmdeploy-router's docs) is its URLs, which its parser keeps as one.
    "worker_urls": lambda c, p: _expect(
        _workers(p, "hybrid") == [(u, None) for joined in c["worker_urls"] for u in joined.split(",")]
    ),
    # (URL, bootstrap port) pairs, or URLs alone (lmdeploy-router's --prefill takes no port).
    "prefill": lambda c, p: _expect(
        _workers(p, "prefill") == [(u, None) if isinstance(u, str) else tuple(u) for u in c["prefill_urls"]]
    ),
    "decode": lambda c, p: _expect(_workers(p, "decode") == [(u, None) for u in c["decode_urls"]]),
    "policy": _role_policy("policy"),
    "prefill_policy": _role_policy("prefill_policy"),
    "decode_policy": _role_policy("decode_policy"),
    "pd_disaggregation": _pd_mode("sglang"),
    "vllm_pd_disaggregation": _pd_mode("vllm"),
    "lmdeploy_pd_disaggregation": _pd_mode("lmdeploy"),
    "host": _same("host"),
    "port": _same("port"),
    "prometheus_port": _same("metrics_port", "prometheus_port"),
    "prometheus_host": _same("metrics_host", "prometheus_host"),
    "max_concurrent_requests": _same("max_requests", "max_concurrent_requests", lambda v: max(0, v)),
    "queue_size": _same("queue_size"),
    "queue_timeout_secs": _same("queue_timeout", "queue_timeout_secs"),
    "request_timeout_secs": _same("request_timeout", "request_timeout_secs"),
    "retry_max_retries": _same("retries", "retry_max_retries", lambda v: v - 1),
    "cb_failure_threshold": _same("circuit_failures", "cb_failure_threshold"),
    "cb_timeout_duration_secs": _same("circuit_cooldown", "cb_timeout_duration_secs"),
    "health_failure_threshold": _same("health_fall", "health_failure_threshold"),
    "health_success_threshold": _same("health_rise", "health_success_threshold"),
    "health_check_timeout_secs": _same("health_timeout", "health_check_timeout_secs"),
    "health_check_interval_secs": _same("health_interval", "health_check_interval_secs"),
    "service_discovery": _discovery,
    "service_discovery_namespace": _same("k8s_namespace", "service_discovery_namespace"),
    "service_discovery_port": _same("k8s_port", "service_discovery_port", str),
    "api_key": _same("node_api_key", "api_key"),
    "tls_cert_path": _same("ssl_certfile", "server_cert_path"),
    "tls_key_path": _same("ssl_keyfile", "server_key_path"),
    "max_payload_size": _same("max_body_size", "max_payload_size"),
    "log_level": _same("log_level"),
    "lmdeploy_migration_protocol": _same("migration_protocol", "lmdeploy_migration_protocol", str.upper),
    "lmdeploy_rdma_link_type": _same("link_type", "lmdeploy_rdma_link_type", str.upper),
    # Their parser keeps each as (id, name, key, role); pdproxy's admin keys are the keys.
    "control_plane_api_keys": lambda c, p: _expect(
        p.settings["admin_keys"] == tuple(k[2] for k in c["control_plane_api_keys"])
    ),
    "selector": lambda c, p: _discovery_or_note(c, p, "--selector"),
    "prefill_selector": lambda c, p: _discovery_or_note(c, p, "--prefill-selector"),
    "decode_selector": lambda c, p: _discovery_or_note(c, p, "--decode-selector"),
    "enable_trace": _same("otlp_endpoint", "otlp_traces_endpoint"),
    "otlp_traces_endpoint": lambda c, p: _expect("otlp_endpoint" in p.settings or _noted(p, "--otlp-traces-endpoint")),
}


def _expect(condition: bool) -> None:
    assert condition


def _noted(plan: Plan, flag: str) -> bool:
    return any(n.startswith(f"{flag}:") for n in plan.notes)


def _discovery_or_note(config: dict[str, Any], plan: Plan, flag: str) -> None:
    """A selector is applied with --service-discovery, and noted as without effect otherwise."""
    if config["service_discovery"]:
        _discovery(config, plan)
    else:
        assert _noted(plan, flag), flag


def _lines() -> Iterator[tuple[str, int]]:
    for router in ROUTERS:
        for index, _ in enumerate(examples(router)):
            yield router, index


@pytest.mark.parametrize(("router", "index"), list(_lines()))
def test_their_documented_lines_read_as_their_parsers_read_them(router: str, index: int) -> None:
    entry = examples(router)[index]
    config, given = entry["parsed"]["config"], entry["parsed"]["namespace_changed"]
    flags = table(router).by_dest
    plan = _outcome(peer_words(entry), router)
    if isinstance(plan, Refused):
        # A refusal names a flag the line gave (or the PD workers given without a PD flag).
        assert any(flags[dest].name == plan.flag for dest in given) or plan.flag.startswith("--prefill"), plan
        assert plan.reason
        assert "\n" not in plan.reason
        return
    for dest in given:
        if dest in AGREES:
            AGREES[dest](config, plan)
        else:
            name = flags[dest].name
            assert any(n.startswith(f"{name}:") for n in plan.notes), f"{name}: neither applied nor noted"


def _refused(router: str, entry: dict[str, Any]) -> bool:
    return isinstance(_outcome(peer_words(entry), router), Refused)


def _startable(router: str) -> list[dict[str, Any]]:
    """The router's documented whole command lines (a program before the flags) pdproxy takes."""
    return [e for e in examples(router) if e["launcher"] and not _refused(router, e)]


@contextlib.contextmanager
def fake_cluster(tmp_path: Path) -> Iterator[Path]:
    """A fake Kubernetes API server (pdproxy.testing.fake_kube) on a loop of its own thread, for
    the documented lines that discover their workers in a cluster; yields its kubeconfig."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    api = FakeKubeApi()
    asyncio.run_coroutine_threadsafe(api.come_up(), loop).result(timeout=10)
    try:
        yield api.write_kubeconfig(tmp_path / "kubeconfig")
    finally:
        asyncio.run_coroutine_threadsafe(api.go_down(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.mark.parametrize("router", ROUTERS)
def test_five_documented_lines_of_each_router_start_pdproxy(
    tmp_path: Path, router: str, certificates: dict[str, Path]
) -> None:
    lines = _startable(router)
    seen: set[tuple[str, ...]] = set()
    started = 0
    with fake_cluster(tmp_path) as config:
        for entry in lines:
            words = peer_words(entry)
            if tuple(words) in seen:  # the same line for the Rust binary and the Python launcher
                continue
            seen.add(tuple(words))
            _start(tmp_path, router, entry, config, certificates)
            started += 1
    assert started >= 5, f"{router}: {started} distinct documented lines pdproxy takes"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Files for the documented lines' placeholder paths (/path/to/server.crt): a throwaway CA,
    and a server certificate for 127.0.0.1 that it signed."""
    where = tmp_path_factory.mktemp("certs")
    authority = trustme.CA()
    server = authority.issue_cert("127.0.0.1")
    files = {"ca": where / "ca.pem", "crt": where / "server.crt", "key": where / "server.key"}
    authority.cert_pem.write_to_path(str(files["ca"]))
    server.cert_chain_pems[0].write_to_path(str(files["crt"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    return files


def _with_files(words: list[str], certificates: dict[str, Path]) -> list[str]:
    """The line with its certificate paths (placeholders here) replaced by real files."""
    out = []
    for word in words:
        name = Path(word).name
        if word.startswith("/") and name.endswith((".crt", ".key", ".pem")):
            kind = "key" if name.endswith(".key") else "ca" if name.startswith("ca") else "crt"
            word = str(certificates[kind])
        out.append(word)
    return out


def _start(tmp_path: Path, router: str, entry: dict[str, Any], kubeconfig: Path, certificates: dict[str, Path]) -> None:
    words = _with_files(peer_words(entry), certificates)
    program = ["launch"] if router == "smg" else []
    if router != "smg" and whose(words) != router:
        program = ["--as-router", router]  # a line another router's parser reads as well
    port, metrics = free_port(), free_port()
    # The documented line, then where this test serves it (the last of a repeated flag wins).
    args = [*program, *words, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics)]
    plan = read(words, router)
    tls = None
    if plan.settings.get("ssl"):
        tls = ssl.create_default_context(cafile=str(certificates["ca"]))
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    env = {"PDPROXY_EDGE": os.environ.get("PDPROXY_EDGE", "rust"), "KUBECONFIG": str(kubeconfig)}
    log_path = str(tmp_path / f"{router}-{port}.log")
    with run_process(args, url, "/liveness", log_path, env=env, tls=tls) as proxy:
        status = get_json(url + "/nodes/status", context=tls)
        log = proxy.log()
        for worker in plan.workers:
            if worker.url.rstrip("/") in status:
                node = status[worker.url.rstrip("/")]
                assert node["role_name"] == worker.role, (worker, node)
                assert node.get("bootstrap_port") == worker.bootstrap_port, (worker, node)
            else:
                # A documented host that does not resolve here (worker1, prefill1): tried, not added.
                assert f"node {worker.url} not added" in log, (worker, log[-2000:])
        metrics_url = f"{'https' if tls else 'http'}://127.0.0.1:{metrics}/metrics"
        assert "# TYPE" in _text(metrics_url, tls), "the metrics listener serves /metrics"
        if "k8s_selector" in plan.settings:
            discovery = get_json(url + "/health", context=tls)["discovery"]
            assert "kubernetes" in discovery, discovery


def _text(url: str, tls: ssl.SSLContext | None = None) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5, context=tls) as response:
        return str(response.read().decode())
