"""Exceptions raised by pdproxy, and the one OpenAI-style error body they map to. Each class's
status, type, code and ``Retry-After`` are the data plane's table (``_pdproxy.ERRORS``, declared in
``rust/src/edge/answer.rs``), read here by class name.

    PdproxyError
    ├── ConfigError(ValueError)            bad settings
    ├── InvalidRequest(ValueError)         the client's request is unusable
    │   ├── RequestTooLarge                its body is over the limit
    │   └── RequestTimeout                 its body came too slowly
    ├── UnsupportedMediaType               the body is not JSON
    ├── NotFound, MethodNotAllowed         no such route, or not with that method
    ├── Unauthorized, Forbidden            no valid key, or a key not allowed there
    ├── Draining                           shutting down, no new requests
    ├── InvalidNode(ValueError)            a node URL that cannot be used
    ├── NodeNotFound(KeyError)             no node with that URL is registered
    ├── RegistryUnavailable                the shared registry is down
    ├── DistServeOff                       a DistServe route without DistServe
    ├── NoNodeAvailable                    nothing can serve the request now
    │   └── ModelNotFound                  no node serves the model
    ├── Overloaded                         every node is at its limit and the queue is full
    ├── RateLimited                        a tenant over its requests, tokens or concurrency
    │   │                                  (x-ratelimit-* headers)
    │   └── QuotaExceeded                  a tenant's daily token budget is spent
    ├── ProxyOverloaded                    the proxy's own cap on requests is reached
    ├── LoopDetected                       the request came back to this proxy
    └── UpstreamError                      the node failed after receiving it
        ├── UpstreamConnectError(ConnectionError)  never reached a node
        ├── UpstreamTimeout(TimeoutError)          the node did not answer in time
        ├── TerminateFailed                a node did not confirm /terminate
        ├── InvalidAnswer                  a node's answer the proxy cannot use
        │   └── InvalidPrefillAnswer       a prefill answer PD cannot use
        ├── PrefillFailed                  SGLang's prefill leg failed
        └── LinkFailed                     prefill and decode could not be linked

    Outside the hierarchy (never answered to a client as such):
    ClientGone                             the client left before its request was read
    HandshakeError                         one PD link handshake call failed (retried)
    AnswerTooLarge(ValueError)             a node's control answer is larger than the proxy reads

The data plane (Rust) raises these same classes. Each carries the HTTP status and error code
the proxy answers with; ``message`` is safe to show a client, ``detail`` (the underlying cause,
which may name addresses) is for logs only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdproxy._pdproxy import ERRORS
from pdproxy._pdproxy import error_body as _error_body

__all__ = [
    "AnswerTooLarge",
    "ClientGone",
    "ConfigError",
    "DistServeOff",
    "Draining",
    "Forbidden",
    "HandshakeError",
    "InvalidAnswer",
    "InvalidNode",
    "InvalidPrefillAnswer",
    "InvalidRequest",
    "LinkFailed",
    "LoopDetected",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoNodeAvailable",
    "NodeNotFound",
    "NotFound",
    "Overloaded",
    "PdproxyError",
    "PrefillFailed",
    "ProxyOverloaded",
    "QuotaExceeded",
    "RateLimited",
    "RegistryUnavailable",
    "RequestTimeout",
    "RequestTooLarge",
    "TerminateFailed",
    "Unauthorized",
    "UnsupportedMediaType",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamTimeout",
    "error_body",
]


def _answers_as_declared(cls: type[PdproxyError]) -> None:
    """Gives ``cls`` its answer from the error table, when the table names it."""
    entry = ERRORS.get(cls.__name__)
    if entry is not None:
        cls.status, cls.type, cls.code, cls.retry_after = entry


class PdproxyError(Exception):
    """Base class of every pdproxy error. A class named in the data plane's error table
    (``_pdproxy.ERRORS``) answers with its status, type, code and ``Retry-After``; any other
    answers as its base does."""

    status: int
    code: str
    type: str
    #: Seconds a client should wait before retrying, when retrying may help.
    retry_after: int | None
    #: The field an error of this kind is about when it names none itself.
    default_param: str | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _answers_as_declared(cls)

    def __init__(
        self, message: str = "", detail: str | None = None, retry_after: int | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail
        #: The request's field that is wrong, when one is (the error body's ``param``).
        self.param = param if param is not None else self.default_param
        if retry_after is not None:
            self.retry_after = retry_after

    def __str__(self) -> str:
        # For whoever reads a traceback: the node and the cause. Clients get `message` alone.
        return f"{self.message} ({self.detail})" if self.detail else self.message

    def body(self) -> bytes:
        """The OpenAI-style error body for this error."""
        return error_body(self.message, type=self.type, code=self.code, param=self.param)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers for this error, as ASGI wants them."""
        headers = [
            (b"content-type", b"application/json"),
            (b"x-pdproxy-error", self.code.encode()),
        ]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(self.retry_after).encode()))
        return headers


_answers_as_declared(PdproxyError)


class ConfigError(PdproxyError, ValueError):
    """A setting has a value pdproxy cannot use."""


class InvalidRequest(PdproxyError, ValueError):
    """The client's request cannot be routed: bad JSON, wrong field types."""


class RequestTooLarge(InvalidRequest):
    """The request body exceeds the configured limit."""


class RequestTimeout(InvalidRequest):
    """The client did not send its request body in time."""


class Draining(PdproxyError):
    """The proxy is shutting down and takes no new requests; another replica may."""

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"connection", b"close")]


class InvalidNode(PdproxyError, ValueError):
    """A node URL that cannot be used (not http, no host)."""

    default_param = "url"


class NodeUnresolvable(InvalidNode):
    """A node whose host name does not resolve (yet: a service that is still coming up)."""


class NodeNotFound(PdproxyError, KeyError):
    """No node with that URL is registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class NoNodeAvailable(PdproxyError):
    """No node can take the request now; nothing was executed, so retrying is safe."""


class ModelNotFound(NoNodeAvailable):
    """No registered node serves the requested model."""


class Overloaded(PdproxyError):
    """Every node that could serve the request is at its limit and the wait queue is full
    (or the wait timed out). ``retry_after`` comes from the observed completion rate."""


class RateLimited(PdproxyError):
    """A tenant is over one of its limits: ``limit`` is requests, tokens or concurrency (per
    minute, or at once); its answer carries the tenant's ``x-ratelimit-*`` headers."""

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
            self.type = ERRORS["TokensRateLimited"][1]
        self.rate_headers = rate_headers or []

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), *self.rate_headers]


class QuotaExceeded(RateLimited):
    """A tenant's daily token budget is spent (until midnight UTC)."""


class ProxyOverloaded(PdproxyError):
    """The proxy itself serves as many requests as it may (its global cap)."""


class LoopDetected(PdproxyError):
    """The request came back to this proxy (a node is this proxy, or routes back to it)."""


class UpstreamError(PdproxyError):
    """The node failed after it received the request; it may have done work."""


class UpstreamConnectError(UpstreamError, ConnectionError):
    """The node could not be reached: the request never ran, retrying is safe."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The node did not answer in time."""


def error_body(message: str, *, type: str, code: str, param: str | None = None) -> bytes:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``, as the
    data plane writes every error answer."""
    return _error_body(message, type, code, param)


class ClientGone(Exception):
    """The client disconnected before its request was read."""


class UnsupportedMediaType(PdproxyError):
    """The request body is not JSON."""


class NotFound(PdproxyError):
    """No such route."""


class MethodNotAllowed(PdproxyError):
    """The route exists, not with this method; the answer's ``Allow`` names the methods it takes
    (RFC 9110 requires it)."""

    def __init__(self, message: str = "", allow: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.allow = tuple(allow)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"allow", ", ".join(self.allow).encode())]


class Unauthorized(PdproxyError):
    """No key, or a wrong one."""

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"www-authenticate", b"Bearer")]


class Forbidden(PdproxyError):
    """A valid inference key used on the management API."""


class RegistryUnavailable(PdproxyError):
    """The shared registry cannot be reached, so a node cannot be added or removed now."""


class DistServeOff(PdproxyError):
    """A DistServe management route on a proxy that does not serve with it (or not its protocol)."""


class TerminateFailed(UpstreamError):
    """The node did not confirm its termination (it was removed all the same)."""


class InvalidAnswer(UpstreamError):
    """The node's answer cannot be used: malformed or ambiguous framing, or larger or slower than
    the proxy reads whole."""


class InvalidPrefillAnswer(InvalidAnswer):
    """The prefill node answered with something the protocol cannot use."""


class PrefillFailed(UpstreamError):
    """The prefill leg failed (its 5xx or a transport error): the request was not served."""


class LinkFailed(UpstreamError):
    """The prefill and decode nodes could not be connected."""


class HandshakeError(Exception):
    """A PD link handshake call failed (retried, then reported as `LinkFailed`)."""


class AnswerTooLarge(ValueError):
    """The node's answer is larger than the proxy reads."""
