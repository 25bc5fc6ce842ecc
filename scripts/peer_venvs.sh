#!/usr/bin/env bash
# Virtual environments holding the peer routers' own packages, one each (sglang-router also
# installs a console script named `smg`, which collides with the smg package's), for
# scripts/peer_parsers.py and the tests that read command lines with the peers' parsers.
# Idempotent: an environment that already holds its pinned version is kept.
#   scripts/peer_venvs.sh            # into bench/.peers/<router>-venv
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
PEERS=("sglang-router==0.3.2" "smg==1.13.0" "vllm-router==0.1.17")
for pin in "${PEERS[@]}"; do
  name="${pin%%==*}"
  venv="bench/.peers/${name}-venv"
  installed=$([ -x "$venv/bin/python" ] && "$venv/bin/python" -m pip show "$name" 2>/dev/null || true)
  if grep -qx "Version: ${pin##*==}" <<<"$installed"; then
    echo "scripts/peer_venvs.sh: $venv holds $pin"
    continue
  fi
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "$pin"
  echo "scripts/peer_venvs.sh: $venv now holds $pin"
done
