#!/usr/bin/env bash
# The main job on a new machine: set up, build the default bundle if it is missing, generate with stats.
# Usage: bash scripts/run.sh ["prompt"] [more spectr-edge generate options]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -f models/default/spectr.json ]; then
  echo "building the default bundle (Qwen2.5-Coder 1.5B float32 target + 0.5B int4 draft): ~15 min on 2 cores with the weights' download, 16 GB RAM" >&2
  .venv/bin/spectr-edge export --preset qwen2.5-coder --out models/default
fi
prompt="${1:-Write a Python function that returns the n-th Fibonacci number.}"
shift || true
.venv/bin/spectr-edge generate --stats "$prompt" "$@"
