"""Kubernetes label selectors, checked before they are sent: one that does not parse is a
one-line error at start, not an API server's 400 repeated in the log.

The grammar (Kubernetes' "Labels and Selectors"): requirements separated by commas, each
``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``, ``key in (v1,v2)`` or
``key notin (v1,v2)``; a key is an optional DNS-subdomain prefix and ``/`` and a name of at
most 63 characters; a value is at most 63 characters of the same alphabet, or empty.
"""

from __future__ import annotations

import re

from pdproxy.errors import ConfigError

__all__ = ["SELECTORS", "check_selector"]

#: The selector settings, and the role each gives the pods it matches (None: the pod's own).
SELECTORS = (("k8s_selector", None), ("k8s_prefill_selector", "prefill"), ("k8s_decode_selector", "decode"))

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_KEY = rf"({_PREFIX}/)?{_NAME}"
_VALUE = rf"({_NAME})?"
_REQUIREMENT = re.compile(
    rf"^\s*(?:!\s*{_KEY}|{_KEY}\s*(?:(?:==|!=|=)\s*{_VALUE}|\s(?:in|notin)\s*\(\s*{_VALUE}(?:\s*,\s*{_VALUE})*\s*\))?)\s*$"
)
_SET = re.compile(r"\([^()]*\)")


def check_selector(selector: str, flag: str) -> None:
    """Raises ``ConfigError`` naming ``flag`` and the requirement that does not parse."""
    # Commas inside `in (...)` do not separate requirements.
    protected = _SET.sub(lambda m: m.group(0).replace(",", "\0"), selector)
    for part in protected.split(","):
        requirement = part.replace("\0", ",")
        if not _REQUIREMENT.match(requirement):
            raise ConfigError(
                f"{flag} {selector!r}: {requirement.strip()!r} is not a label selector requirement "
                "(key, !key, key=value, key!=value, key in (a,b), key notin (a,b))"
            )
