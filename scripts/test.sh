#!/usr/bin/env bash
# Set up and run the test suite (what CI runs). Extra arguments go to pytest, e.g. -m slow.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- -m "not slow"; fi
exec .venv/bin/python -m pytest -q "$@"
