"""Exceptions raised by pdproxy, and the one OpenAI-style error body they map to.

    PdproxyError
    ├── ConfigError(ValueError)            bad settings
    ├── InvalidRequest(ValueError)         400 invalid_request: the client's request is unusable
    │   ├── RequestTooLarge                413 request_too_large
    │   └── RequestTimeout                 408 request_timeout: the body came too slowly
    ├── Draining                           503 draining: shutting down, no new requests
    ├── InvalidNode(ValueError)            a node URL that cannot be used
    ├── NodeNotFound(KeyError)             no node with that URL is registered
    ├── NoNodeAvailable                    503 no_healthy_node: nothing can serve the request now
    │   └── ModelNotFound                  404 model_not_found: no node serves the model
    ├── Overloaded                         429 overloaded: every node is at its limit and the queue is full
    ├── RateLimited                        429 rate_limit_exceeded: a tenant over its requests, tokens or
    │   │                                  concurrency (x-ratelimit-* headers)
    │   └── QuotaExceeded                  429 insufficient_quota: a tenant's daily token budget is spent
    ├── ProxyOverloaded                    503 overloaded: the proxy's own cap on requests is reached
    ├── LoopDetected                       508 loop_detected: the request came back to this proxy
    └── UpstreamError                      502 upstream_error: the node failed after receiving it
        ├── UpstreamConnectError(ConnectionError)  503 upstream_connect_failed: never reached a node
        └── UpstreamTimeout(TimeoutError)          504 upstream_timeout

The data plane (Rust) raises these same classes. Each carries the HTTP status and error code
the proxy answers with; ``message`` is safe to show a client, ``detail`` (the underlying cause,
which may name addresses) is for logs only.
"""

from __future__ import annotations

import json

__all__ = [
    "ConfigError",
    "Draining",
    "InvalidNode",
    "InvalidRequest",
    "LoopDetected",
    "ModelNotFound",
    "NoNodeAvailable",
    "NodeNotFound",
    "Overloaded",
    "PdproxyError",
    "ProxyOverloaded",
    "QuotaExceeded",
    "RateLimited",
    "RequestTimeout",
    "RequestTooLarge",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamTimeout",
    "error_body",
]


class PdproxyError(Exception):
    """Base class of every pdproxy error."""

    status: int = 500
    code: str = "internal_error"
    type: str = "internal_error"
    #: Seconds a client should wait before retrying, when retrying may help.
    retry_after: int | None = None

    def __init__(self, message: str = "", detail: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail
        if retry_after is not None:
            self.retry_after = retry_after

    def __str__(self) -> str:
        # For whoever reads a traceback: the node and the cause. Clients get `message` alone.
        return f"{self.message} ({self.detail})" if self.detail else self.message

    def body(self) -> bytes:
        """The OpenAI-style error body for this error."""
        return error_body(self.message, type=self.type, code=self.code)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers for this error, as ASGI wants them."""
        headers = [
            (b"content-type", b"application/json"),
            (b"x-pdproxy-error", self.code.encode()),
        ]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(self.retry_after).encode()))
        return headers


class ConfigError(PdproxyError, ValueError):
    """A setting has a value pdproxy cannot use."""

    code = "invalid_config"


class InvalidRequest(PdproxyError, ValueError):
    """The client's request cannot be routed: bad JSON, wrong field types."""

    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class RequestTooLarge(InvalidRequest):
    """The request body exceeds the configured limit."""

    status = 413
    code = "request_too_large"


class RequestTimeout(InvalidRequest):
    """The client did not send its request body in time."""

    status = 408
    code = "request_timeout"


class Draining(PdproxyError):
    """The proxy is shutting down and takes no new requests; another replica may."""

    status = 503
    code = "draining"
    type = "service_unavailable"
    retry_after: int | None = 1

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"connection", b"close")]


class InvalidNode(PdproxyError, ValueError):
    """A node URL that cannot be used (not http, no host)."""

    status = 400
    code = "invalid_node"
    type = "invalid_request_error"


class NodeNotFound(PdproxyError, KeyError):
    """No node with that URL is registered."""

    status = 404
    code = "node_not_found"
    type = "invalid_request_error"

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class NoNodeAvailable(PdproxyError):
    """No node can take the request now; nothing was executed, so retrying is safe."""

    status = 503
    code = "no_healthy_node"
    type = "service_unavailable"
    retry_after: int | None = 1


class ModelNotFound(NoNodeAvailable):
    """No registered node serves the requested model."""

    status = 404
    code = "model_not_found"
    type = "invalid_request_error"
    retry_after: int | None = None


class Overloaded(PdproxyError):
    """Every node that could serve the request is at its limit and the wait queue is full
    (or the wait timed out). ``retry_after`` comes from the observed completion rate."""

    status = 429
    code = "overloaded"
    type = "rate_limit_error"
    retry_after: int | None = 1


class RateLimited(PdproxyError):
    """A tenant is over one of its limits: ``limit`` is requests, tokens or concurrency (per
    minute, or at once); its answer carries the tenant's ``x-ratelimit-*`` headers."""

    status = 429
    code = "rate_limit_exceeded"
    type = "requests"

    def __init__(
        self,
        message: str = "",
        detail: str | None = None,
        retry_after: int | None = None,
        limit: str = "requests",
        rate_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message, detail, retry_after)
        self.limit = limit
        if limit == "tokens":
            self.type = "tokens"
        self.rate_headers = rate_headers or []

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), *self.rate_headers]


class QuotaExceeded(RateLimited):
    """A tenant's daily token budget is spent (until midnight UTC)."""

    code = "insufficient_quota"
    type = "insufficient_quota"


class ProxyOverloaded(PdproxyError):
    """The proxy itself serves as many requests as it may (its global cap)."""

    status = 503
    code = "overloaded"
    type = "service_unavailable"
    retry_after: int | None = 1


class LoopDetected(PdproxyError):
    """The request came back to this proxy (a node is this proxy, or routes back to it)."""

    status = 508
    code = "loop_detected"
    type = "server_error"


class UpstreamError(PdproxyError):
    """The node failed after it received the request; it may have done work."""

    status = 502
    code = "upstream_error"
    type = "upstream_error"


class UpstreamConnectError(UpstreamError, ConnectionError):
    """The node could not be reached: the request never ran, retrying is safe."""

    status = 503
    code = "upstream_connect_failed"
    retry_after: int | None = 1


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The node did not answer in time."""

    status = 504
    code = "upstream_timeout"


def error_body(message: str, *, type: str, code: str, param: str | None = None) -> bytes:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()
