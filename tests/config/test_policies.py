"""The routing policies as the settings give them (``settings.routing.policies``): one model per
kind, carrying that kind's own knobs, parsed once from the policy settings and the knobs'; a name
that cannot be parsed is refused when the settings are built, in one line naming the setting; and
the data plane builds every kind."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

import pdproxy
from pdproxy import _pdproxy
from pdproxy.config.policies import (
    POLICY_KINDS,
    BasicPolicy,
    ConsistentHashPolicy,
    Policy,
    PrefixPolicy,
    RolePolicies,
    ScoredPolicy,
)
from pdproxy.config.settings import Settings

TABLE = {"block_bytes": 256, "max_blocks": 1024, "cache_entries": 65536}


def test_the_kinds_are_the_data_planes_and_it_builds_each() -> None:
    assert POLICY_KINDS == _pdproxy.POLICY_NAMES
    for kind in POLICY_KINDS:
        assert set(pdproxy.Router(policy=kind).policies.values()) == {kind}


def test_each_policy_carries_its_own_knobs_from_the_settings() -> None:
    policies = Settings().routing.policies
    assert policies.hybrid == ScoredPolicy(
        prefix=2.0, queue=1.0, hidden=0.0, reported=0.0, future=3.0, bytes_per_token=4.0, **TABLE
    ), "the settings' defaults"
    assert policies.prefill == policies.decode == policies.hybrid
    assert policies.by_model == {}

    routing = Settings(
        policy="prefix",
        decode_policy="consistent_hash",
        model_policies=("m=random", " n =scored"),
        hash_load_factor=2.0,
        prefix_block_bytes=64,
        prefix_balance_threshold=3,
        score_hidden_weight=0.5,
    ).routing
    assert routing.policies == RolePolicies(
        hybrid=PrefixPolicy(block_bytes=64, max_blocks=1024, cache_entries=65536, balance_threshold=3),
        prefill=PrefixPolicy(block_bytes=64, max_blocks=1024, cache_entries=65536, balance_threshold=3),
        decode=ConsistentHashPolicy(load_factor=2.0),
        by_model={
            "m": BasicPolicy(kind="random"),
            "n": ScoredPolicy(
                prefix=2.0,
                queue=1.0,
                hidden=0.5,
                reported=0.0,
                future=3.0,
                block_bytes=64,
                max_blocks=1024,
                cache_entries=65536,
                bytes_per_token=4.0,
            ),
        },
    )


def test_a_scored_name_sets_its_own_weights_over_the_settings() -> None:
    policies = Settings(
        policy="scored:prefix=1, queue=0.5,future=0", score_reported_weight=1.0, decode_policy="scored"
    ).routing
    hybrid = policies.policies.hybrid
    assert isinstance(hybrid, ScoredPolicy)
    assert (hybrid.prefix, hybrid.queue, hybrid.hidden, hybrid.reported, hybrid.future) == (1.0, 0.5, 0.0, 1.0, 0.0)
    assert policies.policies.prefill == hybrid, "a role without its own policy takes the general one"
    assert policies.policies.decode == hybrid.model_copy(update={"prefix": 2.0, "queue": 1.0, "future": 3.0})
    assert Settings(policy="scored:").routing.policies.hybrid == Settings().routing.policies.hybrid


def test_the_union_is_told_apart_by_kind() -> None:
    adapter: TypeAdapter[Policy] = TypeAdapter(Policy)
    assert adapter.validate_python({"kind": "least_requests"}) == BasicPolicy(kind="least_requests")
    assert adapter.validate_python({"kind": "consistent_hash", "load_factor": 1.5}) == ConsistentHashPolicy(
        load_factor=1.5
    )
    with pytest.raises(ValueError, match="does not match any of the expected tags"):
        adapter.validate_python({"kind": "fastest"})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"policy": "fastest"}, "unknown routing policy 'fastest' (policy); known: round_robin, random,"),
        ({"prefill_policy": "Scored"}, "unknown routing policy 'Scored' (prefill_policy); known:"),
        ({"model_policies": ("m=fastest",)}, "unknown routing policy 'fastest' (model policy for m); known:"),
        ({"decode_policy": "prefix:queue=1"}, "routing policy 'prefix:queue=1' (decode_policy): only scored takes"),
        ({"policy": "round_robin:"}, "routing policy 'round_robin:' (policy): only scored takes weights"),
    ],
)
def test_a_policy_that_cannot_be_parsed_is_refused_naming_its_setting(values: dict[str, object], message: str) -> None:
    with pytest.raises(pdproxy.ConfigError) as refused:
        Settings(**values)
    assert str(refused.value).startswith(message), refused.value


@pytest.mark.parametrize(
    "weights",
    [
        "prefix",
        "prefix=-1",
        "speed=2",
        "kv=1",
        "load=1",
        "queue=inf",
        "queue=nan",
        "queue=x",
        "queue=1_0",
        "queue=1e999",
    ],
)
def test_weights_of_scored_are_its_five_each_a_non_negative_number(weights: str) -> None:
    with pytest.raises(pdproxy.ConfigError) as refused:
        Settings(decode_policy=f"scored:{weights}")
    assert str(refused.value).startswith(
        f"routing policy 'scored:{weights}' (decode_policy): scored weights {weights!r}: use prefix=N, queue=N,"
    ), refused.value
