#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, does spectr-edge run on CUDA and TensorRT, is it
# exact there, and how fast is it? One script, one results folder per provider.
#
#   bash bench/gpu_check.sh [BUNDLE]          # default models/default; needs onnxruntime-gpu:
#                                             # pip install 'spectr-edge[gpu]' (CUDA 13 + cuDNN wheels)
#
# 1. providers: what ONNX Runtime offers, and a session of each model on CUDA and on TensorRT;
# 2. exactness on each provider: greedy speculative output (chain, SpecTr rows, draft trees, prompt
#    lookup) equals that provider's own target-only output token for token, and the KV cache never
#    crosses to the host (only logits do);
# 3. speed: bench/run.py --suite gpu on each provider (target-only, chains, SpecTr k = 4 at T=1,
#    OPT-Trees and Sequoia trees of 16-32 nodes), 6 Spec-Bench prompts, 128 tokens.
# TensorRT builds its engines on first use (minutes); they are kept in ~/.cache/spectr-edge/tensorrt.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE="${1:-models/default}"
PY="${PYTHON:-.venv/bin/python}"
OUT="${GPU_CHECK_OUT:-bench/results/$(date +%F)-gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"

"$PY" - "$BUNDLE" "$OUT" <<'PY' 2>&1 | tee "$OUT/exactness.txt"
import json, sys
import onnxruntime as ort
import spectr_edge

bundle, out = sys.argv[1], sys.argv[2]
print("onnxruntime", ort.__version__, ort.get_available_providers())
report = {}
for provider in ("cuda", "tensorrt"):
    try:
        gen = spectr_edge.load(bundle, provider=provider, prefix_cache=False)
    except spectr_edge.SpectrError as err:
        print(f"{provider}: not available: {err}")
        report[provider] = {"error": str(err)}
        continue
    prompt = gen.codec.encode_prompt("Write a Python function that checks whether a number is prime.")
    plain = gen.generate_ids(prompt, max_new_tokens=64, num_candidates=0).token_ids
    rows = {}
    for name, opts in {"chain L=6": dict(draft_len=6), "default": {}, "lookup": dict(drafter="lookup"),
                       "OPT-Tree 16": dict(tree_budget=16, draft_len=6), "branches 3": dict(branches=3)}.items():
        try:
            res = gen.generate_ids(prompt, max_new_tokens=64, **opts)
            rows[name] = {"equal": res.token_ids == plain, "accepted": res.stats.accepted,
                          "tokens_per_call": round(res.stats.tokens_per_target_call, 2)}
        except spectr_edge.SpectrError as err:
            rows[name] = {"error": str(err)}
    moved = gen.target.device.transfers.bytes
    rows["bytes to host per target call"] = moved / max(1, gen.target.calls)
    report[provider] = {"target provider": gen.target.provider, "cases": rows}
    print(provider, json.dumps(report[provider], indent=1))
json.dump(report, open(f"{out}/exactness.json", "w"), indent=1)
PY

for provider in cuda tensorrt; do
  "$PY" bench/run.py --suite gpu --provider "$provider" --bundle "$BUNDLE" --out "$OUT/$provider" || \
    echo "gpu_check: the $provider run failed; see $OUT/$provider/log.txt"
done
echo "gpu_check: results in $OUT"
