"""Instructions the proxy executes per request (valgrind's callgrind), for pdproxy plain and with
tenant limits and tracing on: a count that a busy machine does not disturb, unlike CPU time.

    python bench/instructions.py                  # 3000 non-stream requests per variant
    python bench/instructions.py --stream -n 1000
    python bench/instructions.py --only round_robin --baseline DIR   # beside another build
    python bench/instructions.py --only round_robin --floor          # and the floor proxy
    python bench/instructions.py --only plain,round_robin --prompt-tokens 2048   # long prompts

One mock engine, `pdproxy serve --edge-threads 1` under callgrind with instrumentation switched
on only while the measured requests run (after 200 warm-up requests), one keep-alive client.
Needs valgrind (Debian: apt-get install valgrind).
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from features import KEY, otlp_sink, variants
from run import MODEL, chat


def requests(port: int, body: bytes, count: int, key: str | None) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    for _ in range(count):
        connection.request("POST", "/v1/chat/completions", body, headers)
        answer = connection.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"the proxy answered {answer.status}")
    connection.close()


def measure(
    engine: str,
    extra: tuple[str, ...],
    key: str | None,
    body: bytes,
    count: int,
    workdir: Path,
    build: str | None = None,
    floor: bool = False,
) -> float:
    """Instructions per request of every thread of the proxy; ``build``: a directory holding
    another build of the `pdproxy` package, measured instead of the installed one; ``floor``:
    the floor proxy (hyper passing requests through, one thread) instead of pdproxy."""
    port = harness.free_port()
    out = workdir / f"callgrind-{port}.out"
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--instr-atstart=no"]
    if floor:
        upstream = engine.removeprefix("http://")
        served = [str(harness.FLOOR), "--port", str(port), "--upstream", upstream, "--threads", "1"]
    else:
        served = pdproxy_command(port, engine, extra)
    with open(workdir / f"proxy-{port}.log", "w") as log:
        proxy = subprocess.Popen(
            [*valgrind, *served], stdout=log, stderr=subprocess.STDOUT, env=harness.build_env(build)
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                requests(port, body, 1, key)
                break
            except (OSError, RuntimeError, http.client.HTTPException):
                if time.monotonic() > deadline or proxy.poll() is not None:
                    raise RuntimeError(f"the proxy under valgrind did not start: {out}") from None
                time.sleep(0.5)
        requests(port, body, 200, key)
        subprocess.run(["callgrind_control", "-i", "on", str(proxy.pid)], check=True, capture_output=True)
        requests(port, body, count, key)
        subprocess.run(["callgrind_control", "-i", "off", str(proxy.pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-d", str(proxy.pid)], check=True, capture_output=True)
    finally:
        harness.stop(proxy)
    total = 0
    for dump in workdir.glob(f"callgrind-{port}.out*"):
        for line in dump.read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                total += int(line.split()[1])
    return total / count


def pdproxy_command(port: int, engine: str, extra: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pdproxy",
        "serve",
        "--port",
        str(port),
        "--node",
        engine,
        "--log-level",
        "warning",
        "--edge-threads",
        "1",
        *extra,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--requests", type=int, default=3000)
    parser.add_argument("--stream", action="store_true", help="streamed answers (64 events) instead of whole ones")
    parser.add_argument("--only", help="the variants to measure, comma-separated (default: all)")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="also measure another build of the package (DIR/pdproxy/..., e.g. `pip install --target DIR` of "
        "an earlier commit), each variant's row beside the installed build's",
    )
    parser.add_argument(
        "--floor", action="store_true", help="also measure the floor proxy (bench/loadgen/src/bin/floor.rs)"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help="a prompt of about this many tokens (default: two words)"
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (Debian: apt-get install valgrind)")
    body = json.dumps(chat(args.stream, 62 if args.stream else 16, args.prompt_tokens)).encode()
    with (
        tempfile.TemporaryDirectory() as tmp,
        otlp_sink() as sink,
        harness.mock_engines(1, MODEL) as (engine,),
    ):
        every = variants(Path(tmp), sink)
        wanted = args.only.split(",") if args.only else list(every)
        if unknown := [name for name in wanted if name not in every]:
            parser.error(f"unknown variants {unknown}; known: {', '.join(every)}")
        builds = {"": None, " (baseline)": args.baseline} if args.baseline else {"": None}
        measured: dict[str, float] = {}
        for name in wanted:
            extra, headers = every[name]
            for suffix, build in builds.items():
                harness.say(f"{name}{suffix}: {args.requests} requests under callgrind")
                count = measure(engine.url, extra, KEY if headers else None, body, args.requests, Path(tmp), build)
                measured[name + suffix] = count
        if args.floor:
            harness.build_loadgen()
            harness.say(f"floor: {args.requests} requests under callgrind")
            measured["floor"] = measure(engine.url, (), None, body, args.requests, Path(tmp), floor=True)
    reference = "plain" if "plain" in measured else next(iter(measured))
    rows = [f"| variant | instructions per request | vs {reference} |", "|---|---|---|"]
    for name, count in measured.items():
        rows.append(f"| {name} | {count:.0f} | {count / measured[reference]:.2f}x |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
