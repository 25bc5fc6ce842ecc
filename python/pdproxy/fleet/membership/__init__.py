"""Shared node membership: where node registrations live when several proxies share them.

A backend is picked by ``from_url`` from the ``--registry`` URL; today only Redis
(``redis://HOST:PORT/DB`` or ``rediss://``), in ``redis_store``.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import TypeAlias
from urllib.parse import urlsplit

from pdproxy._json_types import JsonObject
from pdproxy.config.settings import RegistrySettings
from pdproxy.errors import ConfigError, RegistryUnavailable

__all__ = ["Entry", "Membership", "OnChange", "RegistryUnavailable", "check_url", "from_url"]

#: One node registration (a saved ``NodeRecord``): at least "url" (str); may have "lease_ttl"
#: (seconds or None).
Entry: TypeAlias = JsonObject
OnChange: TypeAlias = Callable[[list[Entry]], Awaitable[None]]


class Membership(abc.ABC):
    """Where node registrations live when several proxies share them."""

    @abc.abstractmethod
    async def start(self, on_change: OnChange) -> None:
        """Connect and begin watching; ``on_change(full snapshot)`` on every observed change and once after start."""

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    @abc.abstractmethod
    async def put(self, entry: Entry) -> None:
        """Add or replace by ``entry["url"]``; (re)starts its lease if ``entry["lease_ttl"]`` is a number."""

    @abc.abstractmethod
    async def delete(self, url: str) -> None:
        """Remove the entry; removing one that is not there is not an error."""

    @abc.abstractmethod
    async def snapshot(self) -> list[Entry]:
        """Current entries, leased-out ones excluded; each carries "lease_remaining" (seconds, or None)."""


def check_url(url: str) -> None:
    """Raises ``ConfigError`` unless ``url`` names a registry pdproxy can use."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError when not a number
        db = parts.path.strip("/")
    except ValueError as e:
        raise ConfigError(f"--registry {url!r} is not a valid URL ({e})") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"--registry {url!r}: unsupported scheme; use redis://HOST:PORT/DB or rediss://HOST:PORT/DB")
    if not parts.hostname:
        raise ConfigError(f"--registry {url!r} has no host; use redis://HOST:PORT/DB")
    if db and not db.isdigit():
        raise ConfigError(f"--registry {url!r}: the database must be a number, as in redis://HOST:{port or 6379}/0")
    try:  # an optional extra: checked before anything is served
        import redis.asyncio  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"--registry {url!r} needs the redis package: pip install 'pdproxy[redis]' ({e})") from None


def from_url(settings: RegistrySettings) -> Membership:
    """The backend for the ``--registry`` URL of ``settings`` (the shared-membership group)."""
    url = settings.registry
    check_url(url)
    try:
        from pdproxy.fleet.membership.redis_store import RedisMembership
    except ImportError as e:  # redis is an optional extra
        raise ConfigError(f"--registry {url!r} needs the redis package: pip install 'pdproxy[redis]' ({e})") from None
    return RedisMembership(settings)
