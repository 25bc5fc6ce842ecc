"""A node in static configuration (``--node``, ``PDPROXY_NODES``, TOML ``nodes``): its URL and,
optionally, what ``/nodes/add`` would say of it, so that a whole fleet (prefill and decode roles,
keys, caps, SGLang bootstrap ports) is described without management calls after every start.

On the command line and in the environment a node is one word: the URL, then ``,key=value``
pairs, e.g. ``http://10.0.0.2:30000,role=prefill,model=qwen,bootstrap_port=8998``
(``model`` may repeat). In TOML it may also be a table with the same keys (``models`` a list).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["NodeSpec"]

#: Roles as LMDeploy names and numbers them (EngineRole: 1 Hybrid, 2 Prefill, 3 Decode).
ROLES = {"hybrid": "hybrid", "1": "hybrid", "prefill": "prefill", "2": "prefill", "decode": "decode", "3": "decode"}


@dataclass(frozen=True)
class NodeSpec:
    url: str
    models: tuple[str, ...] | None = None
    role: str = "hybrid"
    speed: float | None = None
    max_concurrency: int | None = None
    api_key: str | None = None
    bootstrap_port: int | None = None

    @classmethod
    def parse(cls, text: str) -> NodeSpec:
        """Reads ``URL[,key=value...]``; raises ``ConfigError`` naming what is wrong."""
        url, *pairs = [part.strip() for part in text.strip().split(",")]
        if not url or "=" in url:
            raise ConfigError(f"node {text!r}: it must start with the node's URL")
        fields: dict[str, Any] = {}
        models: list[str] = []
        for pair in pairs:
            key, sep, value = pair.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or not value.strip():
                raise ConfigError(f"node {url}: {pair!r} must read key=value")
            if key == "model":
                models.append(value.strip())
            else:
                fields[key] = value.strip()
        if models:
            fields["models"] = models
        return cls.from_table({"url": url, **fields}, where=f"node {url}")

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str = "node") -> NodeSpec:
        """A node from a TOML table (or parsed pairs, whose values are still text)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        url = table.get("url")
        if not isinstance(url, str) or not url.strip():
            raise ConfigError(f"{where}: `url` must be the node's URL")
        models = table.get("models")
        if isinstance(models, str):
            models = [models]
        if models is not None and not (isinstance(models, list | tuple) and all(isinstance(m, str) for m in models)):
            raise ConfigError(f"{where}: `models` must be a list of model names")
        role = ROLES.get(str(table.get("role", "hybrid")).strip().lower())
        if role is None:
            raise ConfigError(f"{where}: role {table['role']!r} is not hybrid, prefill or decode (or 1, 2, 3)")
        api_key = table.get("api_key")
        if api_key is not None and (not isinstance(api_key, str) or "," in api_key):
            raise ConfigError(f"{where}: `api_key` must be text without commas")
        return cls(
            url=url.strip(),
            models=tuple(models) if models is not None else None,
            role=role,
            speed=_number(table, "speed", float, where),
            max_concurrency=_number(table, "max_concurrency", int, where),
            api_key=api_key,
            bootstrap_port=_number(table, "bootstrap_port", int, where),
        )

    def text(self) -> str:
        """The one-word form ``parse`` reads."""
        parts = [self.url]
        if self.role != "hybrid":
            parts.append(f"role={self.role}")
        parts += [f"model={m}" for m in self.models or ()]
        for name in ("speed", "max_concurrency", "api_key", "bootstrap_port"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}={value}")
        return ",".join(parts)

    def redacted(self) -> str:
        """``text`` with the node's API key hidden."""
        return dataclasses.replace(self, api_key="<hidden>").text() if self.api_key else self.text()

    def registration(self) -> dict[str, Any]:
        """The keyword arguments of ``Fleet.add`` (and ``Router.add_node``) for this node."""
        out = dataclasses.asdict(self)
        out["models"] = list(self.models) if self.models is not None else None
        return out


def _number(table: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = table.get(name)
    if value is None:
        return None
    try:
        number = kind(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    valid = isinstance(number, int | float) and not isinstance(number, bool)
    if kind is int:
        valid = valid and isinstance(number, int)
    if not valid or number <= 0:
        raise ConfigError(
            f"{where}: `{name}` must be a positive {'integer' if kind is int else 'number'}, got {value!r}"
        )
    return kind(number)
