"""pdproxy: a proxy and router for fleets of OpenAI-compatible LLM inference servers.

The data plane (selection, in-flight accounting, forwarding) is the Rust extension
``pdproxy._pdproxy``; this package is the control plane around it.
"""

from ._pdproxy import Response, __version__
from .config.settings import Settings
from .errors import (
    ConfigError,
    InvalidNode,
    InvalidRequest,
    ModelNotFound,
    NodeNotFound,
    NoNodeAvailable,
    Overloaded,
    PdproxyError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from .router import Router

__all__ = [
    "ConfigError",
    "InvalidNode",
    "InvalidRequest",
    "ModelNotFound",
    "NoNodeAvailable",
    "NodeNotFound",
    "Overloaded",
    "PdproxyError",
    "Response",
    "Router",
    "Settings",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamTimeout",
    "__version__",
]
