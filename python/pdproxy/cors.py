"""CORS on the inference routes, configured as LMDeploy's api_server configures it
(``--allow-origins``, ``--allow-credentials``, ``--allow-methods``, ``--allow-headers``), so that
browser applications can call the proxy. Management routes never answer CORS: a web page must
not drive ``/nodes/*`` from a browser. The Rust edge applies the same rules to what it serves
(``rust/src/edge/cors.rs``); this module to what the control plane serves."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import CorsRefused

#: What ``*`` means in ``--allow-methods`` (Starlette's list, as LMDeploy's api_server uses).
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
#: Headers browsers may always send (the CORS safelist).
SAFELISTED = frozenset({"accept", "accept-language", "content-language", "content-type"})
#: Seconds a browser may cache a preflight's answer.
MAX_AGE = b"600"

Headers = list[tuple[bytes, bytes]]


def is_cors_path(path: str, inference_paths: frozenset[str]) -> bool:
    """The routes browsers may call: the OpenAI API (``/v1/...``) and the other inference routes."""
    return path.startswith("/v1/") or path in inference_paths


class Cors:
    def __init__(
        self, origins: Sequence[str], credentials: bool, methods: Sequence[str], headers: Sequence[str]
    ) -> None:
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)
        self.credentials = credentials
        self.methods = ALL_METHODS if "*" in methods else tuple(m.upper() for m in methods)
        self.any_header = "*" in headers
        self.headers = SAFELISTED | {h.lower() for h in headers}

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def _allows(self, origin: bytes) -> bool:
        return self.any_origin or origin.decode("latin-1") in self.origins

    def _origin_headers(self, origin: bytes) -> Headers:
        if self.any_origin and not self.credentials:
            return [(b"access-control-allow-origin", b"*")]
        out = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if self.credentials:
            out.append((b"access-control-allow-credentials", b"true"))
        return out

    def response_headers(self, origin: bytes | None) -> Headers:
        """What an actual (not preflight) answer to ``origin`` carries: nothing for an origin
        that is not allowed, so the browser keeps the answer from the page."""
        if origin is None or not self._allows(origin):
            return []
        return self._origin_headers(origin)

    def preflight(self, origin: bytes, method: bytes, requested: bytes | None) -> Headers:
        """The headers of an allowed preflight's answer (204); raises ``CorsRefused``."""
        if not self._allows(origin):
            raise CorsRefused("this origin may not call the proxy from a browser (see --allow-origins)")
        if method.decode("latin-1").upper() not in self.methods:
            raise CorsRefused("this method may not be used from a browser (see --allow-methods)")
        names = [n.strip().lower() for n in (requested or b"").decode("latin-1").split(",") if n.strip()]
        if not self.any_header and any(n not in self.headers for n in names):
            raise CorsRefused("a requested header may not be sent from a browser (see --allow-headers)")
        out = self._origin_headers(origin)
        out.append((b"access-control-allow-methods", ", ".join(self.methods).encode()))
        if names:
            out.append((b"access-control-allow-headers", ", ".join(names).encode()))
        out.append((b"access-control-max-age", MAX_AGE))
        return out
