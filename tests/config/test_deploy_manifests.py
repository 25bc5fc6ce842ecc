"""The Kubernetes manifests and the image in deploy/: every document valid against the Kubernetes
API's schema (offline, strict: an unknown field fails), and in agreement with pdproxy's own
settings, routes and image, so that a renamed setting, probe path or port breaks a test here
rather than a rollout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import pdproxy
from pdproxy.management.openapi import schema
from servers import REPO

DEPLOY = REPO / "deploy"
MANIFESTS = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "Dockerfile"
MANIFEST_FILES = sorted(MANIFESTS.glob("*.yaml"))
#: The oldest Kubernetes the manifests must load on, and the newest schema the validator bundles.
K8S_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
#: The engine examples: the hybrid one (found by the ConfigMap's k8s_selector), and the
#: DistServe one, whose pdproxy.toml is in its comments.
HYBRID_EXAMPLE = "vllm-example.yaml"
PD_EXAMPLE = "vllm-pd-example.yaml"
PD_TOML_MARKER = "# pdproxy.toml for this example"

Doc = dict[str, Any]


def load(path: Path) -> list[Doc]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs, f"{path.name}: no YAML document"
    for doc in docs:
        assert isinstance(doc, dict), f"{path.name}: a document is not a mapping: {doc!r}"
    return docs


@pytest.fixture(scope="module")
def manifests() -> dict[str, list[Doc]]:
    """Every document of every deploy/kubernetes/*.yaml, by file name."""
    assert {HYBRID_EXAMPLE, PD_EXAMPLE, "pdproxy.yaml"} <= {path.name for path in MANIFEST_FILES}
    return {path.name: load(path) for path in MANIFEST_FILES}


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def deployments(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] == "Deployment"]


def only_container(deployment: Doc) -> Doc:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{deployment['metadata']['name']}: expected one container"
    return containers[0]


def named_port(container: Doc, name: str) -> int:
    ports = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == name]
    assert len(ports) == 1, f"container {container['name']}: no single port named {name!r}"
    return ports[0]


def node_port(deployment: Doc, k8s_port: str) -> int:
    """The port pdproxy's discovery takes on the deployment's pods, as --k8s-port says: a number,
    a container port's name, or (empty) the pdproxy.io/port annotation, else the port named http,
    else the only container port."""
    template = deployment["spec"]["template"]
    container = only_container(deployment)
    ports = container.get("ports", [])
    if k8s_port.isdigit():
        assert int(k8s_port) in [p["containerPort"] for p in ports], f"no container port {k8s_port}"
        return int(k8s_port)
    if k8s_port:
        return named_port(container, k8s_port)
    annotated = template["metadata"].get("annotations", {}).get("pdproxy.io/port")
    if annotated is not None:
        return int(annotated)
    if any(p.get("name") == "http" for p in ports):
        return named_port(container, "http")
    assert len(ports) == 1, "no pdproxy.io/port annotation, no port named http, not exactly one port"
    return ports[0]["containerPort"]


def selector_labels(selector: str) -> dict[str, str]:
    """A label selector made of equalities only (``k=v,k2==v2``); anything else fails here rather
    than be matched wrongly."""
    labels: dict[str, str] = {}
    for term in selector.split(","):
        key, equals, value = term.partition("=")
        key, value = key.strip(), value.removeprefix("=").strip()
        assert equals, f"not an equality in selector {selector!r}: {term!r}"
        assert re.fullmatch(r"[\w./-]+", key), f"not a simple key in selector {selector!r}: {term!r}"
        assert re.fullmatch(r"[\w.-]*", value), f"not a simple value in selector {selector!r}: {term!r}"
        labels[key] = value
    return labels


def selects(selector: str, labels: dict[str, str]) -> bool:
    """Whether a pod with ``labels`` matches ``selector`` (empty: discovery off, matches none)."""
    if not selector:
        return False
    return all(labels.get(key) == value for key, value in selector_labels(selector).items())


def pod_labels(deployment: Doc) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"].get("labels", {})


IN_CLUSTER_STAND_IN = {
    "apiVersion": "v1",
    "kind": "Config",
    "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
    "users": [{"name": "u", "user": {"token": "t"}}],
    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    "current-context": "c",
}


def effective_settings(toml_text: str, tmp_path: Path) -> dict[str, Any]:
    """What ``pdproxy serve --config F --print-config`` makes of ``toml_text``: it must accept it."""
    config = tmp_path / "pdproxy.toml"
    config.write_text(toml_text)
    # Outside a cluster, the kubeconfig stands in for the pod's service account (the settings
    # are checked, the cluster is not asked).
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps(IN_CLUSTER_STAND_IN))
    run = subprocess.run(
        [sys.executable, "-m", "pdproxy", "serve", "--config", str(config), "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
    )
    assert run.returncode == 0, f"pdproxy refused the TOML:\n{toml_text}\n{run.stderr}"
    return json.loads(run.stdout)


def config_toml(manifests: dict[str, list[Doc]]) -> str:
    config_map = one(manifests["pdproxy.yaml"], "ConfigMap", "pdproxy-config")
    assert set(config_map["data"]) == {"pdproxy.toml"}
    return config_map["data"]["pdproxy.toml"]


def pd_example_toml() -> str:
    """The pdproxy.toml in the DistServe example's comments: the ``#   `` lines after the marker."""
    lines = (MANIFESTS / PD_EXAMPLE).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(PD_TOML_MARKER))
    block: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("#   "):
            block.append(line.removeprefix("#   "))
        elif block:
            break
    assert block, f"{PD_EXAMPLE}: no pdproxy.toml after {PD_TOML_MARKER!r}"
    return "\n".join(block) + "\n"


def proxy(manifests: dict[str, list[Doc]]) -> Doc:
    return one(manifests["pdproxy.yaml"], "Deployment", "pdproxy")


def prestop_seconds(container: Doc) -> float:
    pre_stop = container.get("lifecycle", {}).get("preStop")
    if pre_stop is None:
        return 0.0
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] in ("sleep", "/bin/sleep"), f"preStop is not a plain sleep: {command}"
    assert len(command) == 2, f"preStop is not a plain sleep: {command}"
    return float(command[1])


# ---- the Kubernetes schema ----


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFEST_FILES, ids=lambda path: path.name)
def test_documents_are_valid_kubernetes(path: Path, version: str) -> None:
    for doc in load(path):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata'].get('name')}: {error}")


def test_validator_rejects_an_unknown_field(manifests: dict[str, list[Doc]]) -> None:
    """The validation above means something: offline, strict, it refuses a misspelt field."""
    broken = json.loads(json.dumps(proxy(manifests)))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPortt"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_every_deployment_selects_its_own_pods(manifests: dict[str, list[Doc]]) -> None:
    """The API server refuses a Deployment whose selector does not match its template's labels."""
    for docs in manifests.values():
        for deployment in deployments(docs):
            match_labels = deployment["spec"]["selector"]["matchLabels"]
            assert match_labels.items() <= pod_labels(deployment).items(), deployment["metadata"]["name"]


# ---- pdproxy's settings ----


def test_configmap_is_accepted_by_pdproxy(manifests: dict[str, list[Doc]], tmp_path: Path) -> None:
    text = config_toml(manifests)
    settings = effective_settings(text, tmp_path)
    given = tomllib.loads(text)
    assert {key: settings[key] for key in given} == given  # every key read as written
    assert settings["host"] == "0.0.0.0", "in a pod pdproxy must listen on every address"
    assert settings["k8s_selector"], "no Kubernetes discovery"
    assert settings["port"] == named_port(only_container(proxy(manifests)), "http")


def test_probes_use_pdproxy_endpoints(manifests: dict[str, list[Doc]]) -> None:
    container = only_container(proxy(manifests))
    paths = schema()["paths"]
    assert isinstance(paths, dict)
    routes = {path for path, operations in paths.items() if "get" in operations}
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, f"{probe} must ask {path}"
        assert get["path"] in routes, f"pdproxy serves no GET {get['path']}"
        named_port(container, get["port"])


def test_grace_period_outlasts_the_drain(manifests: dict[str, list[Doc]], tmp_path: Path) -> None:
    """Kubernetes kills the pod terminationGracePeriodSeconds after its deletion, preStop
    included: the preStop sleep plus drain_timeout must fit in it, or SIGKILL cuts requests."""
    given = tomllib.loads(config_toml(manifests))
    drain_timeout = given.get("drain_timeout", pdproxy.Settings().server.drain_timeout)
    assert drain_timeout == effective_settings(config_toml(manifests), tmp_path)["drain_timeout"]
    pod = proxy(manifests)["spec"]["template"]["spec"]
    pre_stop = prestop_seconds(only_container(proxy(manifests)))
    assert pre_stop > 0, "no preStop sleep: the endpoint would still get requests while draining"
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain_timeout


def test_security_context(manifests: dict[str, list[Doc]]) -> None:
    pod = proxy(manifests)["spec"]["template"]["spec"]
    container = only_container(proxy(manifests))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"]
    assert "add" not in context["capabilities"]
    assert not context.get("privileged", False)
    # With a read-only root, the Rust edge's control socket (tempfile.mkdtemp) needs a writable /tmp.
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    tmp = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/tmp"]
    assert len(tmp) == 1, "no volume on /tmp"
    assert "emptyDir" in volumes[tmp[0]["name"]]
    assert not tmp[0].get("readOnly", False)
    for key in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][key]), f"resources.{key}"


def test_configmap_is_mounted_where_pdproxy_reads_it(manifests: dict[str, list[Doc]]) -> None:
    deployment = proxy(manifests)
    container = only_container(deployment)
    args = container["args"]
    assert args[0] == "serve"
    config_path = Path(args[args.index("--config") + 1])
    volumes = {volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    assert len(mounts) == 1, f"nothing mounted on {config_path.parent}"
    assert volumes[mounts[0]["name"]]["configMap"]["name"] == "pdproxy-config"
    assert config_path.name in one(manifests["pdproxy.yaml"], "ConfigMap", "pdproxy-config")["data"]


def test_service_reaches_the_proxy(manifests: dict[str, list[Doc]], tmp_path: Path) -> None:
    service = one(manifests["pdproxy.yaml"], "Service", "pdproxy")
    deployment = proxy(manifests)
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"
    assert named_port(only_container(deployment), port["targetPort"]) == port["port"] == 8000
    assert effective_settings(config_toml(manifests), tmp_path)["port"] == port["port"]


# ---- RBAC ----


def test_rbac_is_least_privilege(manifests: dict[str, list[Doc]]) -> None:
    docs = manifests["pdproxy.yaml"]
    account = one(docs, "ServiceAccount")["metadata"]["name"]
    pod = proxy(manifests)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account
    assert pod.get("automountServiceAccountToken", True) is True, "pdproxy needs its token to watch pods"

    role = one(docs, "Role", "pdproxy-pod-reader")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]

    binding = one(docs, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pdproxy-pod-reader"}
    (subject,) = binding["subjects"]
    assert subject["kind"] == "ServiceAccount"
    assert subject["name"] == account
    assert "namespace" not in subject, "the manifests are namespace-agnostic: the subject is the binding's own"

    everything = [doc for file_docs in manifests.values() for doc in file_docs]
    assert not [doc for doc in everything if doc["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert not [doc for doc in everything if "namespace" in doc["metadata"]]
    assert [doc["kind"] for doc in everything].count("Role") == 1


# ---- the engine examples ----


def test_hybrid_example_is_found(manifests: dict[str, list[Doc]], tmp_path: Path) -> None:
    settings = effective_settings(config_toml(manifests), tmp_path)
    engines = deployments(manifests[HYBRID_EXAMPLE])
    assert engines, f"{HYBRID_EXAMPLE}: no Deployment"
    for engine in engines:
        assert selects(settings["k8s_selector"], pod_labels(engine)), engine["metadata"]["name"]
        container = only_container(engine)
        port = node_port(engine, settings["k8s_port"])
        assert f"{port}" in container["args"], "the engine is not told to listen on the port pdproxy uses"
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        # pdproxy routes to Ready pods only: an engine without readiness would get requests while loading.
        named_port(container, container["readinessProbe"]["httpGet"]["port"])
    assert not selects(settings["k8s_selector"], pod_labels(proxy(manifests))), "pdproxy would route to itself"


def test_pd_example_is_found_in_its_roles(tmp_path: Path) -> None:
    docs = load(MANIFESTS / PD_EXAMPLE)
    settings = effective_settings(pd_example_toml(), tmp_path)
    assert settings["serving_strategy"] == "DistServe"
    assert settings["pd_protocol"] == "vllm"
    assert settings["host"] == "0.0.0.0"
    roles = {"prefill": settings["k8s_prefill_selector"], "decode": settings["k8s_decode_selector"]}
    found: list[str] = []
    for engine in deployments(docs):
        labels = pod_labels(engine)
        matched = [role for role, selector in roles.items() if selects(selector, labels)]
        assert len(matched) == 1, f"{engine['metadata']['name']}: matched by {matched}"
        assert engine["spec"]["template"]["metadata"]["annotations"]["pdproxy.io/role"] == matched[0]
        if settings["k8s_selector"]:
            assert selects(settings["k8s_selector"], labels)
        node_port(engine, settings["k8s_port"])
        found += matched
    assert sorted(found) == ["decode", "prefill"]


# ---- the image ----


def dockerfile_instructions() -> list[tuple[str, str]]:
    """The instructions of the runtime stage (the last FROM onwards), continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions: list[tuple[str, str]] = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            instructions.append((word.upper(), rest.strip()))
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    assert last_from > 0, "not a multi-stage build"
    return instructions[last_from:]


def test_image_agrees_with_the_deployment(manifests: dict[str, list[Doc]]) -> None:
    stage = dockerfile_instructions()
    values: dict[str, list[str]] = {}
    for word, rest in stage:
        values.setdefault(word, []).append(rest)
    deployment = proxy(manifests)
    container = only_container(deployment)
    assert json.loads(values["ENTRYPOINT"][-1]) == ["pdproxy"]
    assert json.loads(values["CMD"][-1]) == container["args"]
    assert values["EXPOSE"] == [str(named_port(container, "http"))]
    user = values["USER"][-1].split(":")[0]
    assert user.isdigit(), "a numeric USER, for runAsNonRoot to check"
    assert int(user) == deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] != 0
    assert any("[kubernetes]" in run for run in values["RUN"]), "the image lacks the kubernetes extra"
