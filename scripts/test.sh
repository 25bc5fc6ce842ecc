#!/usr/bin/env bash
# The README's test command: installs what the tests need, then runs them.
#   - system packages, when missing and this user may install them (root or passwordless sudo,
#     apt-get): Debian's chromium and chromium-driver (the dashboard's browser test) and
#     redis-server (the replicas' tests start their own on free ports);
#   - pdproxy with its test extras (pip install ".[test]": builds the Rust extension, release);
#   - the peer routers' packages, one virtual environment each (scripts/peer_venvs.sh), whose
#     parsers the command-line takeover is checked against, and LMDeploy's (bench/peers.py
#     install lmdeploy), whose registration code the compatibility tests run;
#   - `make test` (pytest; arguments are passed on), then `make test-rust` (cargo test: the data
#     plane without Python, and the benchmarks' load generator).
# Prerequisites it checks: Python >= 3.11 ($PYTHON, else python3) and cargo (Rust >= 1.85).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

fail() { echo "scripts/test.sh: $*" >&2; exit 1; }
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  || fail "needs Python >= 3.11 (set PYTHON=/path/to/python3.11 or newer)"
command -v cargo >/dev/null || fail "needs a Rust toolchain >= 1.85 (https://rustup.rs), to build the extension"
command -v make >/dev/null || fail "needs make (the Makefile's targets run the tests)"

missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
command -v redis-server >/dev/null || missing+=(redis-server)
if ((${#missing[@]})); then
  as_root=()
  [ "$(id -u)" = 0 ] || as_root=(sudo -n)
  if command -v apt-get >/dev/null && "${as_root[@]}" true 2>/dev/null; then
    echo "scripts/test.sh: installing ${missing[*]} (apt-get)" >&2
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "scripts/test.sh: ${missing[*]} missing and not installable here (needs apt-get and root):" \
      "the tests that use them will fail" >&2
  fi
fi

where=$("$PYTHON" -c 'import sys; print(sys.prefix, "(a virtual environment)" if sys.prefix != sys.base_prefix else "(not a virtual environment)")')
echo "scripts/test.sh: installing pdproxy and its test tools with $PYTHON into $where" >&2
"$PYTHON" -m pip install --quiet ".[test]" \
  || fail "pip could not install pdproxy; inside a virtual environment it can: $PYTHON -m venv .venv && . .venv/bin/activate"
# The peer routers' own parsers, from PyPI, which the command-line takeover is tested against;
# and LMDeploy's own proxy package, whose registration code the compatibility tests run.
PYTHON="$PYTHON" scripts/peer_venvs.sh
"$PYTHON" bench/peers.py install lmdeploy
# The Makefile's targets: the one place the test commands are written.
make --no-print-directory test PYTHON="$PYTHON" PYTEST_ARGS="$*"
make --no-print-directory test-bench PYTHON="$PYTHON"
make --no-print-directory test-rust
