#!/usr/bin/env bash
# Create or update .venv: the runtime with the CPU ONNX Runtime, the export extra (torch CPU, transformers,
# optimum-onnx), test and benchmark tools.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# torch first, pinned to the CPU build on this machine's disk, so nothing pulls a CUDA build of several GB
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[cpu,export,serve,dev,bench]'
# exactly one ONNX Runtime: a venv made before the [cpu] extra may still hold the GPU build
if .venv/bin/python -m pip show -q onnxruntime-gpu >/dev/null 2>&1; then
  echo "setup: replacing onnxruntime-gpu with the CPU build onnxruntime" >&2
  .venv/bin/python -m pip uninstall -q -y onnxruntime-gpu
  .venv/bin/python -m pip install -q --disable-pip-version-check --force-reinstall --no-deps onnxruntime
fi
