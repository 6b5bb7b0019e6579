#!/usr/bin/env bash
# Set up and run the test suite (what CI runs). Extra arguments go to pytest, e.g. -m slow.
# Tests run in one worker process per core, at most 4 (pytest-xdist); add -n 0 for a single process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- -m "not slow"; fi
workers=$(nproc); [ "$workers" -gt 4 ] && workers=4
exec .venv/bin/python -m pytest -q -n "$workers" "$@"
