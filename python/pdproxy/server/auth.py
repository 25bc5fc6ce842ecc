"""The management API's keys (the inference routes' keys are the data plane's, checked through
its ``Pipeline``), read as the edge reads them and compared in constant time. With API keys but
no admin keys, management takes an API key, so setting keys never leaves management open by
accident. Without any key, management answers only
requests that no other web site can have made: a page the operator visits must not be able to
register nodes, drain the proxy or terminate engines (by an image tag, a form, or a name it
rebinds to the proxy's address). Registration (``POST /nodes/add``) alone may be opened to
trusted networks (``--keyless-registration-from``), for engines that send no key."""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from pdproxy._pdproxy import client_key
from pdproxy.errors import Forbidden, Unauthorized


def _matches(token: bytes, keys: tuple[bytes, ...]) -> bool:
    # Compare with every key so the time taken does not tell which one nearly matched.
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found


class Keys:
    def __init__(
        self,
        api_keys: Sequence[str],
        admin_keys: Sequence[str],
        host: str = "127.0.0.1",
        keyless_registration: Sequence[str] = (),
    ) -> None:
        self.api = tuple(k.encode() for k in api_keys)
        self.admin = tuple(k.encode() for k in admin_keys) or self.api
        #: Host names (not addresses) the proxy answers to without an admin key.
        self.names = {"localhost", socket.gethostname().lower(), host.lower()}
        self.keyless_registration = tuple(ipaddress.ip_network(n, strict=False) for n in keyless_registration)

    def check_registration(self, headers: Sequence[tuple[bytes, bytes]], client: str | None) -> None:
        """``POST /nodes/add``: an admin key, or a client in the keyless-registration networks
        (a request no other web site made, as for keyless management)."""
        if client is not None and self.keyless_registration:
            try:
                address = ipaddress.ip_address(client)
            except ValueError:
                address = None
            if address is not None and any(address in network for network in self.keyless_registration):
                self._check_same_site(headers)
                return
        self.check_admin(headers)

    def check_admin(self, headers: Sequence[tuple[bytes, bytes]]) -> None:
        if not self.admin:
            self._check_same_site(headers)
            return
        token = client_key(list(headers))
        if token is not None and _matches(token, self.admin):
            return
        if token is not None and self.admin is not self.api and _matches(token, self.api):
            raise Forbidden("this key may not use the management API")
        raise Unauthorized("a valid admin key is required (Authorization: Bearer KEY)")

    def _check_same_site(self, headers: Sequence[tuple[bytes, bytes]]) -> None:
        """Refuses a keyless management request that another site may have sent: one a browser
        marks cross-site (``Sec-Fetch-Site``), one from a foreign or opaque (``null``) ``Origin``,
        or one whose ``Host`` is a name the proxy does not go by (DNS rebinding)."""
        found = {name: value.decode("latin-1") for name, value in headers if name in _SITE_HEADERS}
        host = found.get(b"host", "").strip().lower()
        fetch_site = found.get(b"sec-fetch-site", "").strip().lower()
        if fetch_site and fetch_site not in ("same-origin", "none"):
            raise Forbidden(f"{_WHY} (this request came from another site: Sec-Fetch-Site {fetch_site})")
        origin = found.get(b"origin", "").strip()
        # `null` is what a sandboxed frame, a local file or a redirected page sends: some page.
        if origin and (origin == "null" or urlsplit(origin).netloc.lower() != host):
            raise Forbidden(f"{_WHY} (this request came from {origin})")
        name = urlsplit(f"http://{host}").hostname or ""
        if name and not _is_address(name) and name not in self.names:
            raise Forbidden(f"{_WHY} (this proxy does not answer to the name {name!r})")


_SITE_HEADERS = (b"host", b"origin", b"sec-fetch-site")
_WHY = "without an admin key, management is served only to the proxy's own page and to tools"


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
