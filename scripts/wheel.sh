#!/usr/bin/env bash
# Builds the wheel users install without a Rust toolchain, and proves it:
#   1. maturin builds a manylinux abi3 wheel (one wheel for every CPython >= 3.11), linked by
#      zig (PyPI's ziglang) against glibc 2.17, so no container is needed;
#   2. auditwheel confirms the platform tag the wheel claims;
#   3. the wheel is installed in a fresh virtual environment with no cargo or rustc on PATH, and
#      `pdproxy serve --demo` answers a chat completion.
# Usage: scripts/wheel.sh [OUT_DIR]   (default dist/; $PYTHON: the Python to build with)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT="${1:-dist}"
TAG=manylinux_2_17_x86_64
fail() { echo "scripts/wheel.sh: $*" >&2; exit 1; }

work=$(mktemp -d)
server=""
cleanup() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# The build tools in a virtual environment of their own, not in the caller's.
"$PYTHON" -m venv "$work/build"
"$work/build/bin/pip" install --quiet --disable-pip-version-check "maturin>=1.14,<2" "ziglang>=0.13" "auditwheel>=6"
start=$(date +%s)
PATH="$work/build/bin:$PATH" maturin build --quiet --release --zig --compatibility manylinux2014 --out "$OUT" >/dev/null
wheel=$(ls -t "$OUT"/pdproxy-*-cp311-abi3-*"$TAG"*.whl | head -1)
echo "scripts/wheel.sh: built $wheel in $(( $(date +%s) - start )) s"
"$work/build/bin/auditwheel" show "$wheel" | tr '\n' ' ' | grep -q "consistent with the following platform tag: \"$TAG\"" \
  || fail "auditwheel does not find $wheel $TAG-compatible: $("$work/build/bin/auditwheel" show "$wheel")"

# A clean environment: a fresh venv, and a PATH without any Rust toolchain on it.
"$PYTHON" -m venv "$work/user"
bare_path="$work/user/bin:/usr/local/bin:/usr/bin:/bin"
if PATH="$bare_path" command -v cargo >/dev/null || PATH="$bare_path" command -v rustc >/dev/null; then
  fail "cargo or rustc is on the bare PATH ($bare_path): the install would not prove anything"
fi
start=$(date +%s)
env -i HOME="$work" PATH="$bare_path" "$work/user/bin/pip" install --quiet --disable-pip-version-check "$wheel"
echo "scripts/wheel.sh: installed in a fresh venv without cargo in $(( $(date +%s) - start )) s"
(cd "$work" && env -i PATH="$bare_path" "$work/user/bin/python" -c \
  "import pdproxy; r = pdproxy.Router(nodes=['127.0.0.1:1']); print('scripts/wheel.sh: embedded router:', r.nodes()[0]['url'])")

port=$("$work/user/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
(cd "$work" && exec env -i HOME="$work" PATH="$bare_path" "$work/user/bin/pdproxy" serve --demo --port "$port" \
  >"$work/serve.log" 2>&1) &
server=$!
# One chat completion, asked while the demo comes up (the venv's own Python: no curl needed).
answer=$(env -i PATH="$bare_path" "$work/user/bin/python" - "$port" "$server" <<'ASK'
import json, os, sys, time, urllib.request
port, server = sys.argv[1], int(sys.argv[2])
body = {"model": "pdproxy-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
deadline = time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            print(r.read().decode())
            break
    except OSError:
        os.kill(server, 0)  # pdproxy exited: stop asking
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
ASK
) || fail "no answer from the installed wheel: $(cat "$work/serve.log")"
echo "$answer" | grep -q '"chat.completion"' || fail "not a chat completion: $answer"
echo "scripts/wheel.sh: the installed wheel serves --demo: $(echo "$answer" | head -c 160)"
