#!/usr/bin/env bash
# Create or update .venv: the runtime, the export extra (torch CPU, transformers, optimum-onnx) and dev tools.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# torch first, pinned to the CPU build on this machine's disk, so nothing pulls a CUDA build of several GB
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[export,dev,bench]'
# exactly one ONNX Runtime: the package depends on onnxruntime-gpu (x86_64) or onnxruntime (elsewhere)
if .venv/bin/python -m pip show -q onnxruntime-gpu >/dev/null 2>&1 && .venv/bin/python -m pip show -q onnxruntime >/dev/null 2>&1; then
  echo "setup: both onnxruntime and onnxruntime-gpu are installed; removing onnxruntime" >&2
  .venv/bin/python -m pip uninstall -q -y onnxruntime
  .venv/bin/python -m pip install -q --force-reinstall --no-deps onnxruntime-gpu
fi
