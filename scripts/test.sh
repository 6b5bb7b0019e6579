#!/usr/bin/env bash
# Set up and run the test suite (what CI runs). Extra arguments go to pytest, e.g. -m slow.
# Tests run in one worker process per core, at most 4 (pytest-xdist; work stealing, since the Monte
# Carlo tests take 20-50 s each and would otherwise pile up on one worker); add -n 0 for one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- -m "not slow"; fi
workers=$(nproc); [ "$workers" -gt 4 ] && workers=4
exec .venv/bin/python -m pytest -q -n "$workers" --dist worksteal "$@"
