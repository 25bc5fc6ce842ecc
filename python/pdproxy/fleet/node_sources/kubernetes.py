"""Kubernetes discovery: the pods label selectors match, kept in step with the cluster.

Level-triggered, one informer per selector (``PodWatcher``): a list, then a watch from the
list's resourceVersion (bookmarks move it on while nothing changes); a 410 Gone, or a watch
that breaks, stalls or sends half an event, ends in a new list (with backoff while the API
server fails), and a full list every ``--k8s-relist-interval`` repairs whatever a watch missed.
Every list replaces what the informer knew, so a lost DELETED cannot leave a ghost behind.

While the API server cannot be reached the nodes found so far stay (health checks still act on
them) and the source says so: ``/health``, ``/nodes/status`` and ``pdproxy_discovery_up``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdproxy import _background
from pdproxy._json_types import JsonObject
from pdproxy.config.settings import DiscoverySettings, Settings
from pdproxy.fleet.node_record import NodeRecord
from pdproxy.fleet.node_sources.found import Drop, FoundNodes, Owns, Put, SourceState
from pdproxy.fleet.node_sources.kube_api import KubeApi, KubeApiError, load_config
from pdproxy.fleet.node_sources.pods import PodNode, pod_key, pod_node
from pdproxy.fleet.node_sources.selectors import SELECTORS, check_selector

log = logging.getLogger("pdproxy.kubernetes")

__all__ = ["KubernetesSource", "PodWatcher", "check"]

SOURCE = "kubernetes"
#: The first wait before the API server is tried again; it doubles up to --k8s-max-backoff.
MIN_BACKOFF = 0.2
#: A watch that lived this long was healthy: the backoff starts over.
HEALTHY_WATCH = 5.0


@dataclass(frozen=True)
class Selection:
    """One selector and the role it gives the pods it matches (None: the pod's own)."""

    selector: str
    role: str | None


class PodWatcher:
    """One selector's pods, as they are in the cluster: ``nodes`` by pod key, each a node or
    the reason it is not one. ``on_change(key)`` after every change of a pod's entry."""

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        selection: Selection,
        discovery: DiscoverySettings,
        state: SourceState,
        on_change: Callable[[str], None],
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.selection = selection
        self.port = discovery.k8s_port
        self.relist_interval = discovery.k8s_relist_interval
        self.max_backoff = discovery.k8s_max_backoff
        self.state = state
        self.on_change = on_change
        self.nodes: dict[str, PodNode] = {}
        #: The resourceVersion the watch goes on from.
        self.version: str | None = None

    async def run(self) -> None:
        backoff = MIN_BACKOFF
        while True:
            started = time.monotonic()
            try:
                at_once = await self._list_and_watch()
            except Exception:  # a bug must not end discovery: said, then a new list
                log.exception("kubernetes: the pod watch failed; listing the pods again")
                self.state.restarted("error")
                at_once = False
            elapsed = time.monotonic() - started
            if at_once or elapsed >= HEALTHY_WATCH:
                backoff = MIN_BACKOFF
            if at_once and elapsed >= MIN_BACKOFF:  # a server that forgets at once still waits
                continue
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff)

    async def _list_and_watch(self) -> bool:
        """One list and its watch until the relist period ends; returns whether the next list
        is due at once (the period ended, or the server forgot the watch's place)."""
        try:
            listed = await self.api.list_pods(self.namespace, self.selection.selector)
        except KubeApiError as e:
            self._failed(e)
            return False
        self.replace(listed.pods)
        self.state.reached()
        self.state.synced()
        self.version = listed.resource_version
        try:
            await self._watch_until(time.monotonic() + self.relist_interval)
        except KubeApiError as e:
            if e.gone:
                log.info("kubernetes: %s; listing the pods again", e.message)
                self.state.restarted("gone")
                return True
            if e.status is None:  # broken off: the server restarted, a balancer cut it
                log.info("kubernetes: %s; listing the pods again", e.message)
                self.state.restarted("broken")
            else:
                self._failed(e)
            return False
        self.state.restarted("period")
        return True

    def _failed(self, error: KubeApiError) -> None:
        """The API server refused or could not be reached: said once per cause, the nodes kept."""
        self.state.restarted("error")
        if self.state.failed(error.message):
            log.warning(
                "kubernetes discovery: %s; keeping the %d node(s) found, trying again", error.message, self._count()
            )

    async def _watch_until(self, deadline: float) -> None:
        """Watches until ``deadline``. Raises ``KubeApiError``."""
        while (left := deadline - time.monotonic()) > 0:
            assert self.version is not None
            async for event in self.api.watch_pods(self.namespace, self.selection.selector, self.version, left):
                self.state.counted(event.type)
                if event.type in ("ADDED", "MODIFIED"):
                    self._put(event.object)
                elif event.type == "DELETED":
                    self._drop(pod_key(event.object))
                self.version = event.resource_version or self.version

    def replace(self, pods: list[JsonObject]) -> None:
        """What a full list says: every pod it has, none it has not."""
        listed = {pod_key(pod) for pod in pods}
        for key in [key for key in self.nodes if key not in listed]:
            self._drop(key)
        for pod in pods:
            self._put(pod)
        for key in listed:  # each pod checked against the fleet again, changed or not
            self.on_change(key)

    def _put(self, pod: JsonObject) -> None:
        key = pod_key(pod)
        node = pod_node(pod, self.port, self.selection.role)
        if self.nodes.get(key) == node:
            return
        if node.problem and node.reason is not None:
            if self.state.skipped.get(key) != node.reason:
                log.warning("kubernetes: pod %s is not a node: %s", key, node.reason)
            self.state.skipped[key] = node.reason
        else:
            self.state.skipped.pop(key, None)
        self.nodes[key] = node
        self.on_change(key)

    def _drop(self, key: str) -> None:
        self.state.skipped.pop(key, None)
        if self.nodes.pop(key, None) is not None:
            self.on_change(key)

    def _count(self) -> int:
        return sum(1 for node in self.nodes.values() if node.record is not None)


class KubernetesSource:
    """Keeps the fleet's Kubernetes nodes those the watchers see (through ``put``/``drop``,
    the fleet's ``put_found`` and ``drop_found``)."""

    name = SOURCE

    def __init__(self, settings: Settings) -> None:
        """Raises ``ConfigError``: a selector that does not parse, no usable configuration."""
        self.found: FoundNodes | None = None
        self.selections = _selections(settings)
        self.settings = settings
        self.state = SourceState(SOURCE)
        self.api = KubeApi(
            settings.discovery.k8s_kubeconfig, settings.discovery.k8s_context, settings.discovery.k8s_timeout
        )
        self.namespace = settings.discovery.k8s_namespace or self.api.namespace
        self.watchers: list[PodWatcher] = []
        #: Pods whose entry changed since they were last applied, in order of arrival.
        self._changed: dict[str, None] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, put: Put, drop: Drop, owns: Owns) -> None:
        self.found = FoundNodes(SOURCE, put, drop, owns)
        self.watchers = [
            PodWatcher(
                self.api,
                self.namespace,
                selection,
                self.settings.discovery,
                self.state,
                self._note,
            )
            for selection in self.selections
        ]
        log.info(
            "kubernetes: watching pods %s in namespace %s at %s",
            " and ".join(repr(s.selector) for s in self.selections),
            self.namespace,
            self.api.server,
        )
        self._tasks = [_background.start(self._apply_changes(), "pdproxy-k8s-apply")]
        self._tasks += [_background.start(w.run(), f"pdproxy-k8s-watch {w.selection.selector}") for w in self.watchers]

    async def aclose(self) -> None:
        for task in self._tasks:
            await _background.stop(task)
        with contextlib.suppress(Exception):
            await self.api.aclose()

    def node_count(self) -> int:
        return 0 if self.found is None else len(self.found)

    def _note(self, key: str) -> None:
        self._changed[key] = None
        self._wake.set()

    async def _apply_changes(self) -> None:
        """Applies the pods that changed, in order of arrival, one at a time (adding a node
        checks its address, which may wait)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._changed:
                key = next(iter(self._changed))
                del self._changed[key]
                try:
                    await self._apply(key)
                except Exception:  # one pod that cannot be applied must not stop the others
                    log.exception("kubernetes: pod %s could not be applied", key)

    async def _apply(self, key: str) -> None:
        assert self.found is not None
        await self.found.set(key, self._record_for(key), f"pod/{key}")

    def _record_for(self, key: str) -> NodeRecord | None:
        """The pod's node: a per-role selector's view wins over the general one."""
        by_role_first = sorted(self.watchers, key=lambda w: w.selection.role is None)
        records = [node.record for w in by_role_first if (node := w.nodes.get(key)) is not None and node.record]
        return records[0] if records else None


def check(settings: Settings) -> None:
    """Raises ``ConfigError``: a selector that does not parse, no usable configuration."""
    _selections(settings)
    load_config(settings.discovery.k8s_kubeconfig, settings.discovery.k8s_context)


def _selections(settings: Settings) -> list[Selection]:
    selections = []
    for name, role in SELECTORS:
        selector = getattr(settings.discovery, name)
        if selector:
            check_selector(selector, "--" + name.replace("_", "-"))
            selections.append(Selection(selector, role))
    return selections
