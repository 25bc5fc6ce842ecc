"""bench/fleet.py in a short run: eight simulated engines behind the oracle, round robin and
pdproxy, on the shared-system-prompts workload. The oracle, which sees every engine's cache and
queue, must answer first and find more in the caches; if the simulation stopped simulating
(caches, queues), the two would tie and this fails. And the fleet's control port: an engine's
cache flushed, an engine restarted, as the benchmark's events do them mid-run."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest

from pdproxy.testing.ports import free_port_range
from servers import REPO, get_json, post_json, stop_process, wait_until

BENCH = REPO / "bench"
FLEET = BENCH / "fleet.py"


@pytest.mark.timeout(120)
def test_the_oracle_answers_first_in_a_short_fleet_run(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    command = [sys.executable, str(FLEET), "--workloads", "system_prompts", "--loads", "0.8"]
    # A fixed capacity (no search), 6 s of arrivals, no second attempts: well under a minute.
    command += ["--routers", "oracle,round robin,pdproxy scored", "--capacity", "system_prompts=60", "--duration", "6"]
    command += ["--warmup", "2", "--retries", "0", "--drain", "20", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]["system_prompts@0.8"]
    oracle, rr = rows["oracle"], rows["round robin"]
    for row in (oracle, rr):
        assert row["errors"] == 0, row
        assert row["requests"] > 100, row
    assert oracle["ttft_s"]["p50"] < rr["ttft_s"]["p50"], (oracle["ttft_s"], rr["ttft_s"])
    assert oracle["ttft_s"]["mean"] < rr["ttft_s"]["mean"], (oracle["ttft_s"], rr["ttft_s"])
    # The engines' own count of cached prompt tokens agrees with what the answers said.
    assert oracle["cache_hit_rate"] > rr["cache_hit_rate"] > 0
    assert oracle["engine_cache_hit_rate"] > rr["engine_cache_hit_rate"] > 0
    # pdproxy's prices, checked on every stream's first token, show in its row.
    scored = rows["pdproxy scored"]
    assert scored["errors"] == 0, scored
    priced = scored["priced_off"]
    assert priced["priced"] >= scored["requests"], "every stream priced (the warm-up's too)"
    assert 0 <= priced["early"] + priced["late"] < 1, priced


@pytest.mark.timeout(60)
def test_the_fleets_control_port_flushes_and_restarts_an_engine(tmp_path: Path) -> None:
    first = free_port_range(3)
    shape = {"kv_blocks": 256, "kv_block_tokens": 16, "max_batch": 4, "decode_step_ms": 5.0}
    engines = json.dumps([shape, {**shape, "prefill_ms_per_token": 0.4, "decode_step_ms": 10.0}])
    oracle = f"http://127.0.0.1:{first + 2}"
    command = [sys.executable, str(BENCH / "fleet_engines.py"), "--port", str(first), "--oracle-port", str(first + 2)]
    command += ["--model", "m", "--engine", engines, "--dialects", "vllm,sglang"]
    with open(tmp_path / "fleet.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:

        def serving() -> bool:
            try:
                return bool(get_json(oracle + "/health", timeout=1))
            except (urllib.error.URLError, OSError):
                return False

        wait_until(serving, 20, "the fleet")
        assert get_json(oracle + "/v1/models")["data"][0]["max_model_len"] == 256 * 16
        body = {"model": "m", "messages": [{"role": "user", "content": "cache me " * 100}], "max_tokens": 4}

        def cached() -> int:
            # vLLM's dialect says so too: the fleet's engines are told to (prompt_tokens_details).
            usage = post_json(oracle + "/v1/chat/completions", body)["usage"]
            return int(usage["prompt_tokens_details"]["cached_tokens"])

        def simulation() -> list[dict[str, int]]:
            return [engine["simulation"] for engine in get_json(oracle + "/fleet/stats").values()]

        def received() -> list[int]:
            return [engine["requests"] for engine in get_json(oracle + "/fleet/stats").values()]

        assert cached() == 0
        assert cached() > 0
        hot = received().index(2)  # the oracle kept the prompt where it was cached
        flushed = post_json(oracle + f"/fleet/flush?engine={hot}", {})
        assert flushed["requests"] == received()
        prompt_tokens = simulation()[hot]["prompt_tokens"]
        assert cached() == 0, "nothing cached before the flush is found"
        assert simulation()[hot]["prompt_tokens"] >= prompt_tokens, "a flush keeps the counters"
        post_json(oracle + f"/fleet/restart?engine={hot}", {})
        assert simulation()[hot]["prompt_tokens"] == 0, "a restart zeroes the counters"
        assert sum(received()) == 3, "the requests each engine received are the benchmark's, kept"
        with pytest.raises(urllib.error.HTTPError) as refused:
            post_json(oracle + "/fleet/flush?engine=2", {})
        assert refused.value.code == 400
    finally:
        stop_process(proc)


def test_router_names_give_policy_weights_events_and_replicas() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import fleet  # bench/ is not a package: importable only from its folder
    finally:
        sys.path.remove(str(BENCH))
    named = fleet.router_named("pdproxy scored:reported=1 kv-events x4")
    assert (named.kind, named.policy, named.kv_events, named.replicas) == ("pdproxy", "scored:reported=1", True, 4)
    plain = fleet.router_named("pdproxy scored:queue=0.5")
    assert (plain.policy, plain.kv_events, plain.replicas) == ("scored:queue=0.5", False, 1)
    assert fleet.router_named("pdproxy scored kv-events") == fleet.ROUTERS["pdproxy scored kv-events"]
    shared = fleet.router_named("pdproxy scored kv-events x4 shared")
    assert (shared.policy, shared.kv_events, shared.replicas, shared.shared) == ("scored", True, 4, True)
    assert not named.shared, "replicas share nothing unless asked"
    lead = fleet.router_named("pdproxy scored kv-events x4 shared lead")
    assert (lead.replicas, lead.shared, lead.lead) == (4, True, True)
    assert not shared.lead, "requests spread over the replicas unless asked"
    sharing = fleet.replica_sharing(3)
    listens = [flags[1] for flags in sharing]
    assert len(set(listens)) == 3
    for flags, mine in zip(sharing, listens, strict=True):
        assert flags[0] == "--replica-listen"
        peers = [flags[i + 1] for i in range(2, len(flags), 2) if flags[i] == "--replica-peer"]
        assert sorted(peers) == sorted(set(listens) - {mine}), "every other replica, never itself"
