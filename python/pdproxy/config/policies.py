"""The routing policies as the settings give them: one model per policy kind, carrying that
kind's own knobs (``ScoredPolicy`` its weights and prefix table, ``PrefixPolicy`` its table,
``ConsistentHashPolicy`` its load factor; the others have none), and ``RolePolicies``, the policy
of each role and model. The data plane reads these (``rust/src/py/config.rs``, into its
``PolicySpec``) and parses no policy names of its own.

A policy is named as ``--policy`` takes it (``scored``, or ``scored:prefix=N,queue=N`` to change
weights for that policy only); ``parse`` turns a name into its model, with the knobs of the
settings (``RoutingSettings.policies``, which refuses a name it cannot parse). No defaults
here: every knob comes from a setting.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "POLICY_KINDS",
    "BasicPolicy",
    "ConsistentHashPolicy",
    "Policy",
    "PolicyRefused",
    "PrefixPolicy",
    "RolePolicies",
    "ScoredPolicy",
    "parse",
]


class _PolicyModel(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class BasicPolicy(_PolicyModel):
    """A policy without knobs of its own (those that read the engines' reports follow
    ``engine_metrics_max_age``, shared by the whole data plane)."""

    kind: Literal[
        "round_robin",
        "random",
        "least_requests",
        "min_expected_latency",
        "min_observed_latency",
        "min_observed_latency_per_token",
        "min_cache_usage",
        "least_engine_load",
    ]


class ConsistentHashPolicy(_PolicyModel):
    """``consistent_hash``: a node keeps a key while its in-flight count is below ``load_factor``
    times the average (``hash_load_factor``)."""

    kind: Literal["consistent_hash"] = "consistent_hash"
    load_factor: float


class PrefixPolicy(_PolicyModel):
    """``prefix``: its table of prompt prefixes (the ``prefix_*`` settings)."""

    kind: Literal["prefix"] = "prefix"
    block_bytes: int
    max_blocks: int
    cache_entries: int
    balance_threshold: int


class ScoredPolicy(_PolicyModel):
    """``scored``: the weights of its terms (the ``score_*_weight`` settings, or the name's own:
    ``scored:prefix=N,queue=N,hidden=N,reported=N,future=N``), then its prefix table (``prefix_*``)."""

    kind: Literal["scored"] = "scored"
    prefix: float
    queue: float
    hidden: float
    reported: float
    future: float
    block_bytes: int
    max_blocks: int
    cache_entries: int
    bytes_per_token: float


#: One routing policy, by its ``kind``.
Policy = Annotated[BasicPolicy | ConsistentHashPolicy | PrefixPolicy | ScoredPolicy, Field(discriminator="kind")]

#: Every policy's name, as ``--policy`` takes it (the data plane's ``POLICY_NAMES``, in this order).
POLICY_KINDS: tuple[str, ...] = (
    *get_args(BasicPolicy.model_fields["kind"].annotation),
    "consistent_hash",
    "prefix",
    "scored",
)
#: The weights ``scored:...`` may set, and the number each takes (a non-negative decimal).
_WEIGHTS = ("prefix", "queue", "hidden", "reported", "future")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


class RolePolicies(_PolicyModel):
    """The policy of each role, and of each model that has its own (``--model-policy``)."""

    hybrid: Policy
    prefill: Policy
    decode: Policy
    by_model: dict[str, Policy]


class PolicyRefused(ValueError):
    """A policy name ``parse`` cannot use; its message says why (the caller says where)."""


def parse(name: str, configured: Mapping[str, Policy], what: str) -> Policy:
    """The policy ``name`` says (``scored``, ``scored:prefix=2,queue=0.5``): the model of
    ``configured`` for its kind, where it has knobs (the settings' ones), with the weights the
    name sets. Raises ``PolicyRefused`` naming ``what`` setting gave it."""
    kind, weighted, weights = name.strip().partition(":")
    if kind not in POLICY_KINDS:
        raise PolicyRefused(f"unknown routing policy {name!r} ({what}); known: {', '.join(POLICY_KINDS)}")
    if weighted and kind != "scored":
        raise PolicyRefused(f"routing policy {name!r} ({what}): only scored takes weights (scored:queue=0.5)")
    policy = configured.get(kind)
    if policy is None:
        return BasicPolicy(kind=kind)  # type: ignore[arg-type]  # one of its kinds: checked above
    if not weights:
        return policy
    try:
        return policy.model_copy(update=_weights(weights))
    except ValueError:
        raise PolicyRefused(
            f"routing policy {name!r} ({what}): scored weights {weights!r}: use prefix=N, queue=N, hidden=N,"
            " reported=N and future=N separated by commas (non-negative numbers)"
        ) from None


def _weights(spec: str) -> dict[str, float]:
    """The weights ``spec`` sets (``prefix=2,queue=0.5``), each a non-negative number; raises
    ``ValueError``."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        key, _, raw = (s.strip() for s in part.partition("="))
        if key not in _WEIGHTS or not _NUMBER.fullmatch(raw) or not 0 <= float(raw) < float("inf"):
            raise ValueError(part)
        out[key] = float(raw)
    return out
