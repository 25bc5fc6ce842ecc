"""What the KV index (`--kv-events`) holds in memory, and how fast it takes events in: a fleet's
worth of engines' blocks stored into pdproxy's data plane in this process, as the engines'
`BlockStored` events would store them, the process's resident memory read before and after.

    python bench/kv_index_memory.py                       # 8 nodes of 100,000 blocks each
    python bench/kv_index_memory.py --nodes 4 --blocks-per-node 250000

Each node's blocks are its own (no prefix shared between nodes: the most the index can hold
per block), in chains of `--chain` blocks of 16 tokens (the mock engine's tokenizer: 4 bytes
a token, so 64 bytes of text a block, about what 16 tokens of English take). Then every block
is matched once, so the figures include what matching touches.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import pdproxy
from pdproxy.kv_events import chat_template, index_options

BLOCK_TOKENS = 16


def resident_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def token(serial: int) -> int:
    """The mock tokenizer's id of a 4-character token that no other serial number has."""
    chars = bytes(_ALPHABET[(serial >> shift) & 63] for shift in (0, 6, 12, 18))
    return int.from_bytes(chars, "little")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--blocks-per-node", type=int, default=100_000)
    parser.add_argument("--chain", type=int, default=32, help="blocks per stored event (one chain each)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    total = args.nodes * args.blocks_per_node
    router = pdproxy.Router(policy="scored")
    core = router.core
    core.start_kv_index(chat_template("role-tags"), total, **index_options("mock"))  # type: ignore[arg-type]
    nodes = [f"http://10.0.0.{i}:8000" for i in range(args.nodes)]
    for node in nodes:
        core.kv_live(node, 0, True)
    # The events, made before the clock and the memory reading start.
    events = []
    serial = 0
    for n in range(args.nodes):
        for c in range(args.blocks_per_node // args.chain):
            hashes = [(n << 40) + (c << 8) + i for i in range(args.chain)]
            tokens = [token(serial + i) for i in range(args.chain * BLOCK_TOKENS)]
            serial += len(tokens)
            events.append((nodes[n], hashes, tokens))
    gc.collect()
    before = resident_bytes()
    started = time.perf_counter()
    for node, hashes, tokens in events:
        core.kv_stored(node, 0, hashes, None, tokens, BLOCK_TOKENS)
    stored_s = time.perf_counter() - started
    after = resident_bytes()
    stats = core.kv_index_stats()
    blocks = int(stats["blocks"])  # type: ignore[call-overload]
    # Prompts of whole chains (a sample of 2,000 at most), each matched to its every block.
    sample = events[:: max(1, len(events) // 2000)]
    prompts = [
        (node, json.dumps(b"".join(t.to_bytes(4, "little") for t in tokens).decode()).encode())
        for node, _, tokens in sample
    ]
    started = time.perf_counter()
    matched = 0
    for node, prompt in prompts:
        (found,) = core.kv_matched(prompt, [node])
        matched += found or 0
    match_s = (time.perf_counter() - started) / len(prompts)
    figures = {
        "nodes": args.nodes,
        "blocks": blocks,
        "index_bytes": after - before,
        "bytes_per_block": (after - before) / blocks,
        "stored_blocks_per_s": blocks / stored_s,
        "match_us_per_prompt_of_chain": match_s * 1e6,
        "chain_tokens": args.chain * BLOCK_TOKENS,
        "matched_tokens": matched,
    }
    if args.json:
        print(json.dumps(figures))
        return
    print(
        f"{blocks:,} blocks ({args.nodes} nodes x {args.blocks_per_node:,}): "
        f"{(after - before) / 2**20:.0f} MiB resident, {(after - before) / blocks:.0f} bytes a block; "
        f"stored at {blocks / stored_s:,.0f} blocks/s ({args.chain} a event); "
        f"a prompt of {args.chain * BLOCK_TOKENS} tokens matched in {match_s * 1e6:.1f} µs (from Python)"
    )
    assert matched > 0, "the prompts match what was stored"


if __name__ == "__main__":
    main()
