"""What a node is: the one record every way in fills (``--node``, TOML ``nodes``, ``/nodes/add``,
the state file, a shared registry) and the data plane keeps (``Router.add_node`` reads it by
attribute; ``Router.node(url)`` gives it back). Adding a node attribute means a field here, its
place in the data plane's node (``rust/src/node.rs``, carried by ``rust/src/py/node.rs``) and
the stub; everything else (parsing, the state file, status, the management body) follows.

On the command line and in the environment a node is one word: the URL, then ``,key=value``
pairs, e.g. ``http://10.0.0.2:30000,role=prefill,model=qwen,bootstrap_port=8998,labels.zone=a``
(``model`` may repeat; a map field takes ``NAME.KEY=VALUE``). In TOML it may also be a table with
the field names as keys (``models`` a list, ``labels`` a table).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdproxy import _pdproxy
from pdproxy._json_types import JsonObject
from pdproxy.config.settings import Settings
from pdproxy.errors import ConfigError, InvalidNode

__all__ = ["NodeAttributes", "NodeRecord", "configured_nodes", "validation_field", "validation_message"]

#: Roles as LMDeploy names and numbers them (EngineRole: 1 Hybrid, 2 Prefill, 3 Decode).
ROLES = {"hybrid": "hybrid", "1": "hybrid", "prefill": "prefill", "2": "prefill", "decode": "decode", "3": "decode"}
#: The largest cap on a node's requests in flight (the data plane counts in 32 bits).
MAX_CONCURRENCY = 2**32 - 1
#: The largest port (the data plane keeps a bootstrap port in 16 bits).
MAX_PORT = 2**16 - 1
#: Error type of a value the node table refuses (a 400 ``invalid_node``, not ``invalid_request``).
INVALID_NODE = "invalid_node"
#: The validation context's key for a record whose data-plane rules are checked as it is added.
_UNCHECKED = "unchecked"


class NodeAttributes(BaseModel):
    """Everything a node is registered with besides its URL. Values keep their JSON types
    (``strict``): a management body's ``"speed": "fast"`` is refused, never guessed at.

    The validators here give each value the form the record keeps (a role's name, no cap or
    key for 0 or empty) and refuse integers the data plane's types cannot hold; the node
    table's rules (a positive speed and lease, a non-zero port, a key fit for a header, the
    URL's) are the data plane's alone (``NodeSpec::check`` in ``rust/src/node/mod.rs``),
    applied as a record is built (``NodeRecord``) or, for an unchecked one, as it is added."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    role: Annotated[str, Field(description="hybrid, prefill or decode (LMDeploy's 1, 2, 3)")] = "hybrid"
    models: list[str] | None = Field(None, description="Models it serves (none: ask the node's /v1/models)")
    speed: float | None = Field(None, description="Relative throughput (random and min_expected_latency)")
    max_concurrency: int | None = Field(None, description="Hard cap on its requests in flight (0: none)")
    api_key: str | None = Field(None, description="Sent to it as `Authorization: Bearer`")
    bootstrap_port: int | None = Field(None, description="SGLang prefill nodes: their bootstrap server's port")
    lease_ttl: float | None = Field(None, description="Seconds until the registration lapses unless renewed")
    labels: dict[str, str] = Field(default_factory=dict, description="The operator's labels, shown in status")

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, value: object) -> str:
        role = ROLES.get(str(value).strip().lower()) if isinstance(value, int | str) else None
        if role is None or isinstance(value, bool):
            raise PydanticCustomError(
                INVALID_NODE, "role {value} is not hybrid, prefill or decode (or 1, 2, 3)", {"value": repr(value)}
            )
        return role

    @field_validator("max_concurrency")
    @classmethod
    def _cap(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_CONCURRENCY:
            raise PydanticCustomError(
                INVALID_NODE, "max_concurrency must be between 0 (no cap) and {top}", {"top": MAX_CONCURRENCY}
            )
        return value or None  # 0: no cap, as the data plane keeps it

    @field_validator("api_key")
    @classmethod
    def _key(cls, value: str | None) -> str | None:
        return value or None  # an empty key is none, as the data plane keeps it

    @field_validator("bootstrap_port")
    @classmethod
    def _port(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_PORT:
            raise PydanticCustomError(INVALID_NODE, "bootstrap_port must be a port number")
        return value  # 0 is the data plane's to refuse, with the node's other rules


class NodeRecord(NodeAttributes):
    """A node: its URL (in the canonical form the data plane gives it) and its attributes.
    Building one applies every rule of the node table (``_pdproxy.Router.check_node``), so a
    record that exists can be added; an ``unchecked`` one leaves them to the data plane, which
    applies them as it adds the node (in the same call)."""

    url: str = Field(description="The node's base URL, e.g. http://10.0.0.5:23333")

    @model_validator(mode="after")
    def _canonical(self, info: ValidationInfo) -> NodeRecord:
        if info.context is not None and info.context.get(_UNCHECKED):
            return self
        try:
            canonical = _pdproxy.Router.check_node(self)
        except InvalidNode as e:
            raise PydanticCustomError(INVALID_NODE, "{reason}", {"reason": e.message}) from None
        if canonical != self.url:
            object.__setattr__(self, "url", canonical)  # frozen; this is still its construction
        return self

    @classmethod
    def of(cls, fields: Mapping[str, object], where: str = "node", *, strict: bool = True) -> NodeRecord:
        """A record from ``fields``; raises ``ConfigError`` naming the field and ``where``."""
        try:
            return cls.model_validate(fields, strict=strict)
        except ValidationError as e:
            unknown = [str(err["loc"][0]) for err in e.errors() if err["type"] == "extra_forbidden"]
            if unknown:
                known = ", ".join(sorted(cls.model_fields))
                raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {known}") from None
            raise ConfigError(f"{where}: {validation_message(e)}") from None

    @classmethod
    def checked(cls, fields: Mapping[str, object]) -> NodeRecord:
        """A record from ``fields``; raises ``InvalidNode`` naming the field (its ``param``)."""
        try:
            return cls.model_validate(fields)
        except ValidationError as e:
            raise InvalidNode(validation_message(e), param=validation_field(e)) from None

    @classmethod
    def unchecked(cls, fields: Mapping[str, object]) -> NodeRecord:
        """``checked`` without the data plane's rules (its URL as given): for a record about to
        be added (``Fleet.add``), which checks them and answers with the canonical URL."""
        try:
            return cls.model_validate(fields, context={_UNCHECKED: True})
        except ValidationError as e:
            raise InvalidNode(validation_message(e), param=validation_field(e)) from None

    @classmethod
    def parse(cls, text: str) -> NodeRecord:
        """Reads ``URL[,key=value...]``; raises ``ConfigError`` naming what is wrong."""
        url, *pairs = [part.strip() for part in text.strip().split(",")]
        if not url or "=" in url:
            raise ConfigError(f"node {text!r}: it must start with the node's URL")
        fields: dict[str, object] = {"url": url}
        several: dict[str, list[str]] = {}
        maps: dict[str, dict[str, str]] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            key, value = key.strip().replace("-", "_"), value.strip()
            if not sep or not value:
                raise ConfigError(f"node {url}: {pair!r} must read key=value")
            name, dot, inner = key.partition(".")
            if dot and _shape(cls, name) is dict:
                maps.setdefault(name, {})[inner] = value
            elif _shape(cls, name) is list or _shape(cls, f"{name}s") is list:  # `model=` repeats into `models`
                several.setdefault(name if _shape(cls, name) is list else f"{name}s", []).append(value)
            else:
                fields[name] = value
        fields.update(several)
        fields.update(maps)
        return cls.of(fields, f"node {url}", strict=False)  # numbers are still text here

    def text(self) -> str:
        """The one-word form ``parse`` reads."""
        parts = [self.url]
        for name, value in self.model_dump(exclude_defaults=True, exclude={"url"}).items():
            if isinstance(value, list):
                parts += [f"{name.removesuffix('s')}={v}" for v in value]
            elif isinstance(value, dict):
                parts += [f"{name}.{k}={v}" for k, v in value.items()]
            else:
                parts.append(f"{name}={value}")
        return ",".join(parts)

    def redacted(self) -> str:
        """``text`` with the node's API key hidden."""
        return self.model_copy(update={"api_key": "<hidden>"}).text() if self.api_key else self.text()

    def saved(self) -> JsonObject:
        """The record as the state file and a shared registry keep it."""
        return self.model_dump()

    @classmethod
    def of_node(cls, node: Mapping[str, object]) -> NodeRecord:
        """The record of a node as ``Router.node(url)`` describes it (the models it declared)."""
        fields = {name: node.get(name) for name in cls.model_fields if name in node}
        fields["models"] = node.get("declared_models")
        return cls.model_validate(fields)

    @classmethod
    def shown_fields(cls) -> tuple[str, ...]:
        """The fields ``/nodes/status`` shows as they are (the key never; url, models and role
        have LMDeploy's places)."""
        return tuple(name for name in cls.model_fields if name not in ("url", "models", "role", "api_key"))


def configured_nodes(settings: Settings) -> tuple[NodeRecord, ...]:
    """The nodes of the static configuration (``--node``, ``PDPROXY_NODES``, TOML ``nodes``)."""
    return tuple(NodeRecord.parse(text) for text in settings.routing.nodes)


def _shape(model: type[BaseModel], name: str) -> type | None:
    """``list`` or ``dict`` for a field holding several values, else ``None``."""
    field = model.model_fields.get(name)
    text = str(field.annotation) if field is not None else ""
    return list if text.startswith("list[") else dict if text.startswith("dict[") else None


def validation_field(error: ValidationError) -> str | None:
    """The field the first problem of ``error`` is in (``status.models``), if it is in one."""
    return ".".join(str(part) for part in error.errors()[0]["loc"]) or None


def validation_message(error: ValidationError) -> str:
    """The first problem of ``error`` in one line, naming the field (``status.models``)."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = str(first["msg"])
    if not where or message.startswith(where + " "):  # a message that names its field
        return message
    return f"{where}: {message}"
