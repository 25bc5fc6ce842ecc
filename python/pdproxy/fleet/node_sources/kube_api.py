"""The Kubernetes API as pod discovery uses it: a list of pods, then a watch of their changes.

lightkube finds the cluster and signs the requests: the in-cluster service account (its token
re-read when the API server refuses it, as the kubelet rotates it), or a kubeconfig (tokens,
token files, client certificates, exec plugins such as `aws eks get-token`). The two requests are
sent here on lightkube's HTTP client, because the informer (``kubernetes.PodWatcher``) needs
what lightkube's own watch does not give: bookmarks, the list's resourceVersion beside raw pod
objects, and an ERROR event (410 Gone) as an error rather than a silent restart from nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
from lightkube.config import client_adapter
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.core.exceptions import ConfigError as LightkubeConfigError

from pdproxy._json_types import JsonObject
from pdproxy.errors import ConfigError

__all__ = ["KubeApi", "KubeApiError", "PodList", "WatchEvent", "load_config"]

#: Pods asked for in one page of a list.
PAGE_SIZE = 500
#: The seconds a watch may go beyond the timeout it asked the server for before it counts as stalled.
WATCH_GRACE = 5.0


class KubeApiError(Exception):
    """The API server refused a call or could not be reached (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    @property
    def gone(self) -> bool:
        """The resourceVersion is too old: only a new list can go on."""
        return self.status == 410


@dataclass(frozen=True)
class PodList:
    pods: list[JsonObject]
    resource_version: str


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED or BOOKMARK
    object: JsonObject

    @property
    def resource_version(self) -> str | None:
        metadata = self.object.get("metadata")
        version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
        return version if isinstance(version, str) else None


class KubeApi:
    def __init__(self, kubeconfig: str = "", context: str = "", timeout: float = 10.0) -> None:
        """Raises ``ConfigError`` when no configuration can be found or used."""
        self.config = load_config(kubeconfig, context)
        self.timeout = timeout
        try:
            params = client_adapter.ConnectionParams(timeout=httpx.Timeout(timeout))
            self._http = client_adapter.AsyncClient(self.config, params)
        except (LightkubeConfigError, OSError, ValueError) as e:
            raise ConfigError(f"Kubernetes configuration: {e}") from None

    @property
    def server(self) -> str:
        return str(self.config.cluster.server)

    @property
    def namespace(self) -> str:
        """The configuration's namespace: the service account's in a cluster, else its context's."""
        return str(self.config.namespace)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def list_pods(self, namespace: str, selector: str) -> PodList:
        """Every pod ``selector`` matches in ``namespace``, page by page (one consistent snapshot)."""
        pods: list[JsonObject] = []
        params = {"labelSelector": selector, "limit": str(PAGE_SIZE)}
        while True:
            try:
                answer = await self._http.get(_pods_path(namespace), params=params)
            except httpx.HTTPError as e:
                raise _unreachable(self.server, e) from None
            page = _json_answer(answer, "list")
            items = page.get("items")
            metadata = page.get("metadata")
            if not isinstance(items, list) or not isinstance(metadata, dict):
                raise KubeApiError("the API server's pod list has no items or metadata")
            pods.extend(item for item in items if isinstance(item, dict))
            token = metadata.get("continue")
            if not token:
                version = metadata.get("resourceVersion")
                if not isinstance(version, str):
                    raise KubeApiError("the API server's pod list has no resourceVersion")
                return PodList(pods, version)
            params["continue"] = str(token)

    async def watch_pods(
        self, namespace: str, selector: str, resource_version: str, seconds: float
    ) -> AsyncIterator[WatchEvent]:
        """The changes after ``resource_version``, for about ``seconds`` (the server ends the
        watch then; one that stays silent past that is given up as stalled). Raises
        ``KubeApiError``: an ERROR event (``gone`` for 410), a refusal, a broken stream."""
        params = {
            "labelSelector": selector,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(max(1, round(seconds))),
        }
        timeout = httpx.Timeout(self.timeout, read=seconds + WATCH_GRACE)
        try:
            async with self._http.stream("GET", _pods_path(namespace), params=params, timeout=timeout) as answer:
                if answer.status_code != 200:
                    await answer.aread()
                    _json_answer(answer, "watch")
                try:
                    async for line in answer.aiter_lines():
                        if line.strip():
                            yield _event(line)
                except httpx.HTTPError as e:
                    raise KubeApiError(f"the pod watch broke off: {type(e).__name__}: {e}") from None
        except httpx.HTTPError as e:
            raise _unreachable(self.server, e) from None


def load_config(kubeconfig: str, context: str) -> SingleConfig:
    """The cluster and credentials to use; raises ``ConfigError``."""
    try:
        if kubeconfig:
            if not Path(kubeconfig).expanduser().is_file():
                raise ConfigError(f"--k8s-kubeconfig {kubeconfig}: no such file")
            found = KubeConfig.from_file(Path(kubeconfig).expanduser())
        else:
            found = KubeConfig.from_env()
        config = found.get(context_name=context or None)
    except LightkubeConfigError as e:
        where = f"--k8s-kubeconfig {kubeconfig}" if kubeconfig else "in-cluster, $KUBECONFIG or ~/.kube/config"
        raise ConfigError(f"no usable Kubernetes configuration ({where}): {e}") from None
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"the Kubernetes configuration cannot be read: {type(e).__name__}: {e}") from None
    if config is None:
        raise ConfigError("the Kubernetes configuration has no current context; give one with --k8s-context")
    return config


def _pods_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"


def _json_answer(answer: httpx.Response, call: str) -> JsonObject:
    """The JSON body of a 200 answer; a refusal as ``KubeApiError`` with the server's message."""
    try:
        body = json.loads(answer.content)
    except ValueError:
        body = None
    if answer.status_code == 200 and isinstance(body, dict):
        return body
    message = body.get("message") if isinstance(body, dict) else None
    text = message if isinstance(message, str) and message else answer.reason_phrase
    raise KubeApiError(f"the API server refused the pod {call} ({answer.status_code}): {text}", answer.status_code)


def _event(line: str) -> WatchEvent:
    try:
        raw = json.loads(line)
    except ValueError:
        raise KubeApiError("the watch broke off inside an event") from None
    kind, obj = (raw.get("type"), raw.get("object")) if isinstance(raw, dict) else (None, None)
    if not isinstance(kind, str) or not isinstance(obj, dict):
        raise KubeApiError("the watch sent an event without a type or an object")
    if kind == "ERROR":
        code = obj.get("code")
        message = obj.get("message") or obj.get("reason") or "no message"
        raise KubeApiError(f"the watch ended with an error: {message}", code if isinstance(code, int) else None)
    return WatchEvent(kind, obj)


def _unreachable(server: str, error: httpx.HTTPError) -> KubeApiError:
    return KubeApiError(f"the API server {server} cannot be reached: {type(error).__name__}: {error}".rstrip(": "))
