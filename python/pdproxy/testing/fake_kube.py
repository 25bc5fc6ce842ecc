"""A fake Kubernetes API server for Pods, speaking the REST protocol as kube-apiserver does, for
tests of pod discovery (list with selectors, chunked lists, watch with bookmarks, 410 Gone) and
of what a client must survive (lost events, stalled or broken watches, an API server that goes
away)::

    async with FakeKubeApi(bookmark_interval=0.2) as api:
        api.add_pod("default", "engine-0", ip="10.0.0.5", phase="Running", ready=True, labels={"app": "engine"})
        ...  # GET {api.url}/api/v1/namespaces/default/pods?labelSelector=app%3Dengine
              # with the header "Authorization: Bearer test-token"

The cluster state is changed by synchronous methods (``add_pod``, ``update_pod``, ``delete_pod``);
each change gets the next resourceVersion of one global counter and wakes every watch.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import copy
import dataclasses
import datetime
import enum
import ipaddress
import json
import math
import random
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from aiohttp import web

from pdproxy._json_types import JsonObject, JsonValue, loads

__all__ = ["FakeKubeApi"]

_T = TypeVar("_T")
EventType = Literal["ADDED", "MODIFIED", "DELETED"]
Verb = Literal["get", "list", "watch"]

#: Who the forbidden answers name, as for a pod's service account.
USER = "system:serviceaccount:default:pdproxy"
PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")
DEFAULT_PORTS: list[JsonObject] = [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
#: What kube-apiserver sets on a graceful delete without a grace period of its own (the pod's).
GRACE_SECONDS = 30
#: How long a watch from a resourceVersion the server has not reached yet waits for it (as the
#: watch cache does) before it fails with 504.
TOO_LARGE_WAIT = 3.0
#: Chunked-list snapshots kept for continue tokens (older tokens get 410, as after a compaction).
SNAPSHOTS = 64
VERSION: JsonObject = {
    "major": "1",
    "minor": "31",
    "gitVersion": "v1.31.0-fake",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2024-08-13T00:00:00Z",
    "goVersion": "go1.22.5",
    "compiler": "gc",
    "platform": "linux/amd64",
}
_INCONSISTENT_CONTINUE = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new list "
    "without the continue parameter, or use the continue token in this response to retrieve the remainder of the "
    "results. Continuing with the provided token results in an inconsistent list - objects that were created, "
    "modified, or deleted between the time the first chunk was returned and now may show up in the list."
)


def _now(offset: float = 0.0) -> str:
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _dump(value: JsonValue) -> bytes:
    # kube-apiserver writes compact JSON, each object followed by a newline.
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


# --- Status objects ---------------------------------------------------------------------------


def _status(code: int, reason: str, message: str, *, details: JsonObject | None = None) -> JsonObject:
    status: JsonObject = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
    }
    if details is not None:
        status["details"] = details
    status["code"] = code
    return status


class _Fail(Exception):
    """An answer with a Status body instead of the resource."""

    def __init__(self, status: JsonObject) -> None:
        super().__init__(status["message"])
        self.status = status

    @property
    def code(self) -> int:
        code = self.status["code"]
        assert isinstance(code, int)
        return code


def _bad_request(message: str) -> _Fail:
    return _Fail(_status(400, "BadRequest", message))


# --- names and labels (apimachinery's validation, messages included) ---------------------------

_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_PART_RULE = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
    "character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
_VALUE_RULE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start "
    "and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for "
    "validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


def _qualified_name_problem(key: str) -> str | None:
    """Why ``key`` is no label key (an optional DNS-subdomain prefix and '/', then a name), or None."""
    parts = key.split("/")
    if len(parts) > 2:
        return "a qualified name " + _NAME_PART_RULE + " with an optional DNS subdomain prefix and '/'"
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            return "prefix part must be non-empty"
        if len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix):
            return "prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters"
    if not name:
        return "name part must be non-empty"
    if len(name) > 63:
        return "name part must be no more than 63 characters"
    if not _NAME_PART.fullmatch(name):
        return "name part " + _NAME_PART_RULE
    return None


def _label_value_problem(value: str) -> str | None:
    if len(value) > 63:
        return "must be no more than 63 characters"
    if not _LABEL_VALUE.fullmatch(value):
        return _VALUE_RULE
    return None


def _check_labels(labels: Mapping[str, str], what: str) -> dict[str, str]:
    for key, value in labels.items():
        problem = _qualified_name_problem(key)
        if problem is None and what == "labels":
            problem = _label_value_problem(value)
        if problem is not None:
            raise ValueError(f"{what} {key}={value!r}: {problem}")
    return dict(labels)


# --- label selectors ---------------------------------------------------------------------------


class _SelectorError(ValueError):
    """A selector that does not parse; the message is kube-apiserver's."""


@dataclass(frozen=True)
class _Requirement:
    key: str
    #: "in", "notin", "=", "==", "!=", "gt", "lt", "exists" or "!" (does not exist).
    op: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.op in ("in", "=", "=="):
            return value is not None and value in self.values
        if self.op in ("notin", "!="):
            return value is None or value not in self.values
        if self.op == "exists":
            return value is not None
        if self.op == "!":
            return value is None
        # gt / lt compare integers; a label that is none does not match.
        if value is None or not re.fullmatch(r"[+-]?\d+", value):
            return False
        have, want = int(value), int(next(iter(self.values)))
        return have > want if self.op == "gt" else have < want


_SYMBOLS = ("!=", "==", "=", "!", "(", ")", ",", ">", "<")  # the longest first
_SPECIAL = frozenset("=!(),><")
_OPERATORS = {"in": "in", "notin": "notin", "=": "=", "==": "==", "!=": "!=", ">": "gt", "<": "lt"}


def _tokens(text: str) -> list[tuple[bool, str]]:
    """(whether an identifier, literal) for each token, then the end ('' as its literal)."""
    tokens: list[tuple[bool, str]] = []
    i = 0
    while i < len(text):
        if text[i] in " \t\r\n":
            i += 1
        elif text[i] in _SPECIAL:
            symbol = next(s for s in _SYMBOLS if text.startswith(s, i))
            tokens.append((False, symbol))
            i += len(symbol)
        else:
            start = i
            while i < len(text) and text[i] not in _SPECIAL and text[i] not in " \t\r\n":
                i += 1
            tokens.append((True, text[start:i]))
    tokens.append((False, ""))
    return tokens


class _LabelParser:
    """apimachinery's label selector grammar: comma-separated requirements, all of which must hold."""

    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.at = 0

    def peek(self) -> tuple[bool, str]:
        return self.tokens[self.at]

    def take(self) -> tuple[bool, str]:
        token = self.tokens[self.at]
        self.at = min(self.at + 1, len(self.tokens) - 1)
        return token

    def parse(self) -> list[_Requirement]:
        requirements: list[_Requirement] = []
        while True:
            ident, literal = self.peek()
            if literal == "" and not ident:
                return requirements
            if not ident and literal != "!":
                raise _SelectorError(f"found '{literal}', expected: !, identifier, or 'end of string'")
            try:
                requirements.append(self.requirement())
            except _SelectorError as error:
                raise _SelectorError(f"unable to parse requirement: {error}") from None
            ident, literal = self.take()
            if literal == "" and not ident:
                return requirements
            if ident or literal != ",":
                raise _SelectorError(f"found '{literal}', expected: ',' or 'end of string'")
            ident, literal = self.peek()
            if not ident and literal != "!":
                raise _SelectorError(f"found '{literal}', expected: identifier after ','")

    def requirement(self) -> _Requirement:
        ident, key = self.take()
        absent = not ident and key == "!"
        if absent:
            ident, key = self.take()
        if not ident:
            raise _SelectorError(f"found '{key}', expected: identifier")
        problem = _qualified_name_problem(key)
        if problem is not None:
            raise _SelectorError(f'key: Invalid value: "{key}": {problem}')
        if absent:
            return _Requirement(key, "!")
        ident, literal = self.peek()
        if not ident and literal in ("", ","):
            return _Requirement(key, "exists")
        ident, literal = self.take()
        # `in` and `notin` are words, the other operators symbols: a key named `in` stays a key.
        is_word = literal in ("in", "notin")
        op = _OPERATORS.get(literal) if ident == is_word else None
        if op is None:
            raise _SelectorError(f"found '{literal}', expected: in, notin, =, ==, !=, gt, lt")
        values = self.value_set() if op in ("in", "notin") else self.exact_value()
        for index, value in enumerate(sorted(values)):
            problem = _label_value_problem(value)
            if problem is not None:
                raise _SelectorError(f'values[{index}][{key}]: Invalid value: "{value}": {problem}')
        if op in ("gt", "lt") and not re.fullmatch(r"[+-]?\d+", next(iter(values))):
            raise _SelectorError(
                f'values[0]: Invalid value: "{next(iter(values))}": '
                "for 'Gt', 'Lt' operators, the value must be an integer"
            )
        return _Requirement(key, op, values)

    def exact_value(self) -> frozenset[str]:
        ident, literal = self.peek()
        if not ident and literal in ("", ","):
            return frozenset({""})  # `k=` asks for an empty value
        ident, literal = self.take()
        if not ident:
            raise _SelectorError(f"found '{literal}', expected: identifier")
        return frozenset({literal})

    def value_set(self) -> frozenset[str]:
        ident, literal = self.take()
        if ident or literal != "(":
            raise _SelectorError(f"found '{literal}', expected: '('")
        values: set[str] = set()
        want_value = True  # an empty item (`(a,)`, `(,a)`, `()`) stands for the empty value
        while True:
            ident, literal = self.take()
            if ident:
                if not want_value:
                    raise _SelectorError(f"found '{literal}', expected: ',' or ')'")
                values.add(literal)
                want_value = False
            elif literal == ",":
                if want_value:
                    values.add("")
                want_value = True
            elif literal == ")":
                if want_value:
                    values.add("")
                return frozenset(values)
            else:
                raise _SelectorError(f"found '{literal}', expected: ',', ')' or identifier")


def _parse_label_selector(text: str) -> list[_Requirement]:
    """The requirements of a ``labelSelector``; raises ``_SelectorError``."""
    return _LabelParser(text).parse()


# --- pods --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pod:
    """One pod's state; never changed in place (a change makes a new one), so events and list
    snapshots may share it."""

    namespace: str
    name: str
    uid: str
    rv: int
    created: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ip: str | None
    phase: str
    ready: bool
    ready_since: str
    ports: list[JsonObject]
    deletion: str | None = None

    @property
    def key(self) -> str:
        """Its etcd key below `/registry/pods/`: the order of lists and the start of continue tokens."""
        return f"{self.namespace}/{self.name}"

    def _ports(self) -> list[JsonValue]:
        return [copy.deepcopy(port) for port in self.ports]

    def render(self, rv: int | None = None, *, typed: bool = False) -> JsonObject:
        """The pod as the API serves it; ``typed`` adds kind and apiVersion, as watch events carry
        them (list items do not)."""
        metadata: JsonObject = {
            "name": self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "resourceVersion": str(self.rv if rv is None else rv),
            "creationTimestamp": self.created,
        }
        if self.deletion is not None:
            metadata["deletionTimestamp"] = self.deletion
            metadata["deletionGracePeriodSeconds"] = GRACE_SECONDS
        # Empty maps are left out, as the real server's omitempty does.
        if self.labels:
            metadata["labels"] = dict(self.labels)
        if self.annotations:
            metadata["annotations"] = dict(self.annotations)
        ready = "True" if self.ready else "False"
        status: JsonObject = {
            "phase": self.phase,
            "conditions": [
                _condition("Initialized", "True", self.created),
                _condition("Ready", ready, self.ready_since),
                _condition("ContainersReady", ready, self.ready_since),
                _condition("PodScheduled", "True", self.created),
            ],
        }
        if self.ip is not None:
            status["podIP"] = self.ip
            status["podIPs"] = [{"ip": self.ip}]
        pod: JsonObject = {"kind": "Pod", "apiVersion": "v1"} if typed else {}
        pod["metadata"] = metadata
        pod["spec"] = {
            "containers": [{"name": "engine", "image": "fake", "ports": self._ports()}],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": GRACE_SECONDS,
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "nodeName": "fake-node",
            "schedulerName": "default-scheduler",
        }
        pod["status"] = status
        return pod


def _condition(kind: str, status: str, since: str) -> JsonObject:
    return {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": since}


def _check_ip(ip: str | None) -> str | None:
    if ip is not None:
        ipaddress.ip_address(ip)  # a typo in a test fails here, not in the client under test
    return ip


def _check_phase(phase: str) -> str:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    return phase


# --- field selectors ---------------------------------------------------------------------------

#: The pod fields kube-apiserver selects on, and their values here.
_POD_FIELDS: dict[str, Callable[[_Pod], str]] = {
    "metadata.name": lambda pod: pod.name,
    "metadata.namespace": lambda pod: pod.namespace,
    "spec.nodeName": lambda _: "fake-node",
    "spec.restartPolicy": lambda _: "Always",
    "spec.schedulerName": lambda _: "default-scheduler",
    "spec.serviceAccountName": lambda _: "default",
    "spec.hostNetwork": lambda _: "false",
    "status.phase": lambda pod: pod.phase,
    "status.podIP": lambda pod: pod.ip or "",
    "status.nominatedNodeName": lambda _: "",
}


@dataclass(frozen=True)
class _FieldRequirement:
    name: str
    value: str
    negated: bool

    def matches(self, pod: _Pod) -> bool:
        return (_POD_FIELDS[self.name](pod) == self.value) != self.negated


def _split_unescaped_commas(text: str) -> list[str]:
    terms, start, escaped = [], 0, False
    for i, char in enumerate(text):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == ",":
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return terms


def _unescape_field_value(value: str) -> str:
    out, escaped = [], False
    for char in value:
        if escaped:
            if char not in "\\,=":
                raise _SelectorError(f"invalid field selector value: {value}: invalid escape sequence")
            out.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in ",=":
            raise _SelectorError(f"invalid field selector value: {value}: unescaped {char!r}")
        else:
            out.append(char)
    if escaped:
        raise _SelectorError(f"invalid field selector value: {value}: invalid escape sequence")
    return "".join(out)


def _parse_field_selector(text: str) -> list[_FieldRequirement]:
    """The requirements of a ``fieldSelector`` on pods; raises ``_SelectorError``."""
    requirements = []
    for term in _split_unescaped_commas(text) if text else []:
        if not term:
            continue
        # The first operator from the left wins, `!=` and `==` before `=`, as apimachinery splits.
        found = next(
            ((i, op) for i in range(len(term)) for op in ("!=", "==", "=") if term.startswith(op, i)),
            None,
        )
        if found is None:
            raise _SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
        at, op = found
        name, value = term[:at], _unescape_field_value(term[at + len(op) :])
        if name not in _POD_FIELDS:
            raise _SelectorError(f"field label not supported: {name}")
        requirements.append(_FieldRequirement(name, value, op == "!="))
    return requirements


# --- watches -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Change:
    rv: int
    type: EventType
    #: The pod before (None: added) and after (None: deleted).
    old: _Pod | None
    new: _Pod | None


@dataclass(frozen=True)
class _Close:
    mid_event: bool


@dataclass(frozen=True)
class _Scope:
    """What a request selects: its namespace (None: all) and selectors."""

    namespace: str | None
    labels: list[_Requirement]
    fields: list[_FieldRequirement]

    @property
    def empty(self) -> bool:
        return not self.labels and not self.fields

    def matches(self, pod: _Pod) -> bool:
        return (
            (self.namespace is None or pod.namespace == self.namespace)
            and all(r.matches(pod.labels) for r in self.labels)
            and all(r.matches(pod) for r in self.fields)
        )

    def event(self, change: _Change) -> JsonObject | None:
        """What a watcher of this scope is sent for ``change``, as the watch cache converts it:
        by the pod's state after the change, and a pod that leaves the selection is DELETED (its
        state before, at the change's resourceVersion), one that enters it ADDED."""
        was = change.old is not None and self.matches(change.old)
        now = change.new is not None and self.matches(change.new)
        if now and change.new is not None:
            return _event("MODIFIED" if was else "ADDED", change.new.render(typed=True))
        if was and change.old is not None:
            return _event("DELETED", change.old.render(change.rv, typed=True))
        return None


def _event(kind: str, obj: JsonObject) -> JsonObject:
    return {"type": kind, "object": obj}


@dataclass(eq=False)
class _Watch:
    scope: _Scope
    queue: asyncio.Queue[JsonObject | _Close] = field(default_factory=asyncio.Queue)
    #: Set by a stall: the connection stays open and is sent nothing ever again.
    broken: bool = False


# --- the server --------------------------------------------------------------------------------


class _Keep(enum.Enum):
    """update_pod's "leave this as it is" (None is a value there: no IP, no labels)."""

    KEEP = enum.auto()


KEEP = _Keep.KEEP
_POD_PATH = re.compile(r"/api/v1/(?:pods|namespaces/(?P<ns>[^/]+)/pods(?:/(?P<name>[^/]+))?)")


class FakeKubeApi:
    """The fake API server on 127.0.0.1 (a free port unless ``port`` is given).

    ``token`` is the bearer token every request must carry (change it to rotate it), ``history``
    how many past events are kept for watches that resume from a resourceVersion, and
    ``bookmark_interval`` the seconds between BOOKMARK events on a watch that allows them.
    """

    def __init__(
        self, *, token: str = "test-token", history: int = 1000, bookmark_interval: float = 1.0, port: int = 0
    ) -> None:
        self.token = token
        self.history = history
        self.bookmark_interval = bookmark_interval
        self.port = port
        #: List requests answered (each page of a chunked list counts), watch requests started,
        #: and every request seen: its path and query.
        self.lists = 0
        self.watches = 0
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._rv = 0
        self._pods: dict[tuple[str, str], _Pod] = {}
        self._history: collections.deque[_Change] = collections.deque()
        #: A watch from a resourceVersion below this one has missed forgotten events: 410.
        self._floor = 0
        self._snapshots: collections.OrderedDict[int, list[_Pod]] = collections.OrderedDict()
        self._open: set[_Watch] = set()
        self._drops: collections.Counter[str] = collections.Counter()
        self._stalled = False
        self._changed = asyncio.Event()
        self._forbidden: list[tuple[str | None, Verb | None]] = []
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, *, namespace: str = "default", token_file: Path | None = None) -> Path:
        """Writes a kubeconfig for this server at ``path`` (JSON, which is YAML too): its URL, its
        token (or ``token_file``, to rotate it) and ``namespace`` as the context's."""
        user: dict[str, str] = {"tokenFile": str(token_file)} if token_file else {"token": self.token}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "pdproxy", "user": user}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "pdproxy", "namespace": namespace}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))
        return path

    @property
    def watching(self) -> int:
        """How many watch connections are open and being sent events (a test closes or stalls
        watches once a client has opened one, not in the moment between its list and its watch)."""
        return sum(1 for watch in self._open if not watch.broken)

    @property
    def resource_version(self) -> str:
        """The current resourceVersion (that of the last change)."""
        return str(self._rv)

    # --- lifecycle

    async def __aenter__(self) -> FakeKubeApi:
        await self.come_up()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.go_down()

    async def come_up(self) -> None:
        """Listens (again, on the same port after ``go_down``); the state is what it was, with
        every change made while down."""
        if self._runner is not None:
            return
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._serve)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.port = runner.addresses[0][1]
        self._runner = runner

    async def go_down(self) -> None:
        """Stops listening and drops every connection, watches with them (without the chunked
        body's end): connects are refused until ``come_up``."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if runner.server is not None:
            for connection in runner.server.connections:
                connection.force_close()
        await runner.cleanup()

    # --- cluster state

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        ip: str | None = None,
        phase: str = "Pending",
        ready: bool = False,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        ports: Sequence[JsonObject] | None = None,
    ) -> JsonObject:
        """Creates a pod (an ADDED event) and returns it as the API serves it."""
        if not _DNS_LABEL.fullmatch(namespace) or len(namespace) > 63:
            raise ValueError(f"namespace {namespace!r} is no DNS-1123 label")
        if not _DNS_SUBDOMAIN.fullmatch(name) or len(name) > 253:
            raise ValueError(f"pod name {name!r} is no DNS-1123 subdomain")
        if (namespace, name) in self._pods:
            raise ValueError(f'pods "{name}" already exists in namespace {namespace}')
        created = _now()
        pod = _Pod(
            namespace=namespace,
            name=name,
            uid=str(uuid.uuid4()),
            rv=self._rv + 1,
            created=created,
            labels=_check_labels(labels or {}, "labels"),
            annotations=_check_labels(annotations or {}, "annotations"),
            ip=_check_ip(ip),
            phase=_check_phase(phase),
            ready=ready,
            ready_since=created,
            ports=copy.deepcopy(list(DEFAULT_PORTS if ports is None else ports)),
        )
        self._commit("ADDED", None, pod)
        return pod.render()

    def update_pod(
        self,
        namespace: str,
        name: str,
        *,
        ip: str | _Keep | None = KEEP,
        phase: str | _Keep = KEEP,
        ready: bool | _Keep = KEEP,
        labels: Mapping[str, str] | _Keep | None = KEEP,
        annotations: Mapping[str, str] | _Keep | None = KEEP,
        ports: Sequence[JsonObject] | _Keep | None = KEEP,
        terminating: bool = False,
    ) -> JsonObject:
        """Changes what is given in one MODIFIED event: labels, annotations and ports are replaced
        whole (None: none, or the default ports), ``ip=None`` takes the IP away, ``terminating``
        starts a graceful delete (deletionTimestamp and deletionGracePeriodSeconds are set; it
        cannot be undone). As on a real server, an update that changes nothing makes no event."""
        old = self._pod(namespace, name)
        new_ready = old.ready if isinstance(ready, _Keep) else ready
        new = dataclasses.replace(
            old,
            ip=old.ip if isinstance(ip, _Keep) else _check_ip(ip),
            phase=old.phase if isinstance(phase, _Keep) else _check_phase(phase),
            ready=new_ready,
            ready_since=old.ready_since if new_ready == old.ready else _now(),
            labels=old.labels if isinstance(labels, _Keep) else _check_labels(labels or {}, "labels"),
            annotations=(
                old.annotations if isinstance(annotations, _Keep) else _check_labels(annotations or {}, "annotations")
            ),
            ports=old.ports
            if isinstance(ports, _Keep)
            else copy.deepcopy(list(DEFAULT_PORTS if ports is None else ports)),
            deletion=old.deletion or (_now(GRACE_SECONDS) if terminating else None),
        )
        if new == old:
            return old.render()
        new = dataclasses.replace(new, rv=self._rv + 1)
        self._commit("MODIFIED", old, new)
        return new.render()

    def delete_pod(self, namespace: str, name: str) -> None:
        """Removes a pod: a DELETED event that carries its last state at a new resourceVersion."""
        self._commit("DELETED", self._pod(namespace, name), None)

    def pods(self, namespace: str | None = None) -> list[JsonObject]:
        """The current pods (of ``namespace``, or all), in the order a list gives them."""
        return [pod.render() for pod in self._sorted() if namespace is None or pod.namespace == namespace]

    def _pod(self, namespace: str, name: str) -> _Pod:
        try:
            return self._pods[namespace, name]
        except KeyError:
            raise KeyError(f'pods "{name}" not found in namespace {namespace}') from None

    def _sorted(self) -> list[_Pod]:
        return sorted(self._pods.values(), key=lambda pod: pod.key)

    def _commit(self, kind: EventType, old: _Pod | None, new: _Pod | None) -> None:
        """Applies a change at the next resourceVersion, keeps it for resuming watches and sends
        it to the open ones (unless a drop swallows it)."""
        self._rv += 1
        self._changed.set()  # wakes the watches that wait for this resourceVersion, then re-arms
        self._changed = asyncio.Event()
        pod = new or old
        assert pod is not None
        if new is None:
            del self._pods[pod.namespace, pod.name]
        else:
            self._pods[pod.namespace, pod.name] = new
        if self._drops[kind] > 0:
            self._drops[kind] -= 1
            return  # lost for every watcher, resumed ones too: only a relist repairs it
        change = _Change(self._rv, kind, old, new)
        self._history.append(change)
        while len(self._history) > self.history:
            self._forget(self._history.popleft().rv)
        for watch in self._open:
            event = watch.scope.event(change)
            if event is not None:
                watch.queue.put_nowait(event)

    def _forget(self, rv: int) -> None:
        self._floor = max(self._floor, rv)
        for old in [snapshot for snapshot in self._snapshots if snapshot < self._floor]:
            del self._snapshots[old]

    # --- fault knobs

    def drop_events(self, n: int = 1, type: EventType = "DELETED") -> None:
        """The next ``n`` changes of ``type`` are applied but never sent to any watcher."""
        self._drops[type] += n

    def stall_watches(self) -> None:
        """Open watches, and those started until ``resume_watches``, are sent nothing (no events,
        no bookmarks; a new one gets its 200 head) while their connections stay open."""
        self._stalled = True
        for watch in self._open:
            watch.broken = True

    def resume_watches(self) -> None:
        """New watches work again; the stalled ones stay silent for good (a client must give up on
        them), as a connection that lost its events would."""
        self._stalled = False

    def close_watches(self, mid_event: bool = False) -> None:
        """Drops every open watch connection, without the chunked body's end; ``mid_event`` first
        writes half of an event line, with no newline."""
        for watch in self._open:
            watch.queue.put_nowait(_Close(mid_event))

    def expire_history(self) -> None:
        """Forgets every kept event (a compaction): a watch from an older resourceVersion than the
        current one gets 410 Expired, and so does a continue token of an older list."""
        self._history.clear()
        self._forget(self._rv)

    def forbid(self, namespace: str | None = None, verb: Verb | None = None) -> None:
        """Answers 403 to ``verb`` (None: every verb) in ``namespace`` (None: every namespace).
        A forbidden namespace forbids the cluster scope (all namespaces) too, as RBAC does: a
        cluster-wide list needs the right everywhere. ``allow`` lifts every ban."""
        self._forbidden.append((namespace, verb))

    def allow(self) -> None:
        self._forbidden.clear()

    # --- HTTP

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.path, dict(request.query)))
        try:
            if request.headers.get("Authorization") != f"Bearer {self.token}":
                raise _Fail(_status(401, "Unauthorized", "Unauthorized"))
            route = _POD_PATH.fullmatch(request.path)
            if request.path != "/version" and route is None:
                raise _Fail(_status(404, "NotFound", "the server could not find the requested resource", details={}))
            if request.method != "GET":
                raise _Fail(
                    _status(
                        405,
                        "MethodNotAllowed",
                        "the server does not allow this method on the requested resource",
                        details={},
                    )
                )
            if route is None:
                return _answer(VERSION)
            namespace, name = route["ns"], route["name"]
            if name is not None:
                self._authorize("get", namespace, name)
                return _answer(self._pod_answer(namespace, name))
            watching = _flag(request.query.get("watch"))
            self._authorize("watch" if watching else "list", namespace)
            scope = _Scope(
                namespace,
                _selector(_parse_label_selector, request.query.get("labelSelector", "")),
                _selector(_parse_field_selector, request.query.get("fieldSelector", "")),
            )
            if watching:
                return await self._watch(request, scope)
            answer = self._list(scope, request.query)
            self.lists += 1
            return _answer(answer)
        except _Fail as failure:
            return _answer(failure.status, failure.code)

    def _authorize(self, verb: Verb, namespace: str | None, name: str | None = None) -> None:
        for banned_namespace, banned_verb in self._forbidden:
            if banned_verb not in (None, verb):
                continue
            if banned_namespace is not None and namespace not in (None, banned_namespace):
                continue
            subject = "pods" if name is None else f'pods "{name}"'
            where = "at the cluster scope" if namespace is None else f'in the namespace "{namespace}"'
            details: JsonObject = {"kind": "pods"} if name is None else {"name": name, "kind": "pods"}
            raise _Fail(
                _status(
                    403,
                    "Forbidden",
                    f'{subject} is forbidden: User "{USER}" cannot {verb} resource "pods" in API group "" {where}',
                    details=details,
                )
            )

    def _pod_answer(self, namespace: str, name: str) -> JsonObject:
        pod = self._pods.get((namespace, name))
        if pod is None:
            raise _Fail(_status(404, "NotFound", f'pods "{name}" not found', details={"name": name, "kind": "pods"}))
        return pod.render(typed=True)

    def _list(self, scope: _Scope, query: Mapping[str, str]) -> JsonObject:
        resource_version = query.get("resourceVersion", "")
        token = query.get("continue", "")
        limit = _integer(query, "limit")
        if token and resource_version not in ("", "0"):
            raise _bad_request("specifying resource version is not allowed when using continue")
        # Scope keys are relative to the list's etcd prefix, as continue tokens hold them.
        prefix = "" if scope.namespace is None else f"{scope.namespace}/"
        start = ""
        if token:
            rv, start = _decode_continue(token)
            if rv == -1:  # the remainder at the latest state, as a 410 offered it
                rv, pods = self._rv, self._sorted()
            elif rv < self._floor or rv not in self._snapshots:
                fail = _Fail(_status(410, "Expired", _INCONSISTENT_CONTINUE))
                fail.status["metadata"] = {"continue": _encode_continue(-1, start)}
                raise fail
            else:
                pods = self._snapshots[rv]
        else:
            rv, pods = self._rv, self._sorted()
            if resource_version == "0":
                limit = 0  # served from the watch cache, which ignores limit
        candidates = [pod for pod in pods if pod.key.startswith(prefix) and pod.key[len(prefix) :] >= start]
        items: list[JsonValue] = []
        metadata: JsonObject = {"resourceVersion": str(rv)}
        for at, pod in enumerate(candidates):
            if limit > 0 and len(items) == limit:
                # More keys remain (matching or not: the server cannot know without reading them).
                last = candidates[at - 1].key[len(prefix) :]
                metadata["continue"] = _encode_continue(rv, last + "\x00")
                if scope.empty:
                    metadata["remainingItemCount"] = len(candidates) - at
                if rv not in self._snapshots:
                    self._snapshots[rv] = pods
                    while len(self._snapshots) > SNAPSHOTS:
                        self._snapshots.popitem(last=False)
                break
            if scope.matches(pod):
                items.append(pod.render())
        return {"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": items}

    async def _watch(self, request: web.Request, scope: _Scope) -> web.StreamResponse:
        since = request.query.get("resourceVersion", "")
        timeout = _integer(request.query, "timeoutSeconds")
        if timeout <= 0:
            timeout = int(random.uniform(1800, 3600))  # the real server's spread of 30 to 60 minutes
        deadline = asyncio.get_running_loop().time() + timeout
        bookmarks = _flag(request.query.get("allowWatchBookmarks"))
        start = await self._wait_for(since)
        watch = _Watch(scope, broken=self._stalled)
        expired = start is not None and start < self._floor
        if start is None:
            backlog = [_event("ADDED", pod.render(typed=True)) for pod in self._sorted() if scope.matches(pod)]
        elif expired:
            backlog = []
        else:
            backlog = [e for c in self._history if c.rv > start and (e := scope.event(c)) is not None]
        # Registered in the same step as the backlog is taken: no change can fall between them.
        for event in backlog:
            watch.queue.put_nowait(event)
        self._open.add(watch)
        try:
            response = web.StreamResponse(headers=_headers())
            response.content_type = "application/json"
            response.enable_chunked_encoding()
            await response.prepare(request)
            self.watches += 1
            if expired and not watch.broken:
                message = f"too old resource version: {start} ({self._floor})"
                await response.write(_dump(_event("ERROR", _status(410, "Expired", message))))
                return response
            with contextlib.suppress(ConnectionResetError):  # the client went away
                await self._stream(request, response, watch, deadline, bookmarks)
            return response
        finally:
            self._open.discard(watch)

    async def _stream(
        self, request: web.Request, response: web.StreamResponse, watch: _Watch, deadline: float, bookmarks: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        next_bookmark = loop.time() + self.bookmark_interval if bookmarks else math.inf
        while loop.time() < deadline:
            try:
                async with asyncio.timeout_at(min(deadline, next_bookmark)):
                    item = await watch.queue.get()
            except TimeoutError:
                if loop.time() >= next_bookmark:
                    next_bookmark = loop.time() + self.bookmark_interval
                    if not watch.broken:
                        # Sent only with nothing queued, so every event up to this RV is out.
                        await response.write(_dump(self._bookmark()))
                continue
            if isinstance(item, _Close):
                if item.mid_event and not watch.broken:
                    line = _dump(self._some_event(watch.scope))
                    await response.write(line[: len(line) // 2])
                if request.transport is not None:
                    request.transport.close()  # flushes what was written, then FIN: no last chunk
                return
            if not watch.broken:
                await response.write(_dump(item))

    def _some_event(self, scope: _Scope) -> JsonObject:
        """An event line to cut in half: a pod of the watch's, or a bookmark."""
        for pod in self._sorted():
            if scope.matches(pod):
                return _event("MODIFIED", pod.render(typed=True))
        return self._bookmark()

    def _bookmark(self) -> JsonObject:
        return _event("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)}})

    async def _wait_for(self, since: str) -> int | None:
        """The resourceVersion a watch starts after (None: from the current state, with synthetic
        ADDED events); one the server has not reached is waited for a while, then 504."""
        if since in ("", "0"):
            return None
        if not re.fullmatch(r"\d+", since):
            raise _bad_request(f'resourceVersion: Invalid value: "{since}": invalid resource version')
        wanted = int(since)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(TOO_LARGE_WAIT):
                while wanted > self._rv:
                    await self._changed.wait()
        if wanted > self._rv:
            details: JsonObject = {
                "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                "retryAfterSeconds": 1,
            }
            message = f"Too large resource version: {wanted}, current: {self._rv}"
            raise _Fail(_status(504, "Timeout", message, details=details))
        return wanted


# --- request helpers ---------------------------------------------------------------------------


def _headers() -> dict[str, str]:
    return {"Audit-Id": str(uuid.uuid4()), "Cache-Control": "no-cache, private"}


def _answer(body: JsonObject, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_dump(body), content_type="application/json", headers=_headers())


def _flag(raw: str | None) -> bool:
    # apimachinery's query conversion: present and neither "0" nor "false" is true.
    return raw is not None and raw != "0" and raw.lower() != "false"


def _integer(query: Mapping[str, str], name: str) -> int:
    raw = query.get(name, "")
    if not raw:
        return 0
    if not re.fullmatch(r"[+-]?\d+", raw):
        raise _bad_request(f'strconv.ParseInt: parsing "{raw}": invalid syntax')
    return int(raw)


def _selector(parse: Callable[[str], list[_T]], text: str) -> list[_T]:
    try:
        return parse(text)
    except _SelectorError as error:
        raise _bad_request(str(error)) from None


def _encode_continue(rv: int, start: str) -> str:
    token = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}, separators=(",", ":"))
    return base64.urlsafe_b64encode(token.encode()).rstrip(b"=").decode()


def _decode_continue(token: str) -> tuple[int, str]:
    try:
        decoded = loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (binascii.Error, ValueError) as error:
        raise _bad_request(f"continue key is not valid: {error}") from None
    if not isinstance(decoded, dict) or decoded.get("v") != "meta.k8s.io/v1":
        raise _bad_request("continue key is not valid: server does not recognize this encoded key")
    rv, start = decoded.get("rv"), decoded.get("start")
    if not isinstance(rv, int) or rv == 0 or rv < -1:
        raise _bad_request(
            "continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)"
        )
    if not isinstance(start, str) or not start:
        raise _bad_request("continue key is not valid: encoded start key empty")
    return rv, start
