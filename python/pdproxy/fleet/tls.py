"""TLS of the control plane: its own calls to nodes (health, discovery, registration checks, the
PD handshakes and frees) verify ``https://`` nodes against the system's roots or
``--node-ca-file``, as the data plane does; and the files ``--ssl`` and ``--node-ca-file`` name
are checked before anything is served."""

from __future__ import annotations

import functools
import ssl

import aiohttp

from pdproxy.config.settings import Settings
from pdproxy.errors import ConfigError

__all__ = ["check_files", "node_session"]


@functools.cache
def _node_context(ca_file: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_file or None)


#: Seconds the control plane keeps an idle connection to a node: below the nodes' own keep-alive
#: (uvicorn's 5 s), and soon gone when the node is removed.
IDLE_CONNECTION_SECONDS = 3.0


def node_session(ca_file: str, timeout: float) -> aiohttp.ClientSession:
    """A session for calls to nodes (inside a running loop): ``https://`` nodes are verified
    against ``ca_file``, or the system's roots when it is empty."""
    connector = aiohttp.TCPConnector(ssl=_node_context(ca_file), keepalive_timeout=IDLE_CONNECTION_SECONDS)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout))


def check_files(settings: Settings) -> None:
    """Raises ``ConfigError`` naming the file when the server certificate and key (``--ssl``) or
    the nodes' CA file cannot be used."""
    if settings.security.ssl:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                settings.security.ssl_certfile, settings.security.ssl_keyfile
            )
        except (OSError, ssl.SSLError) as e:
            security = settings.security
            raise ConfigError(
                f"--ssl: the certificate {security.ssl_certfile} and key {security.ssl_keyfile} cannot be used ({e})"
            ) from None
    if settings.security.node_ca_file:
        try:
            _node_context(settings.security.node_ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"--node-ca-file {settings.security.node_ca_file} cannot be used ({e})") from None
