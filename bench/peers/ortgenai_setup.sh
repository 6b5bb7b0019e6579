#!/usr/bin/env bash
# Peer setup: ONNX Runtime GenAI 0.18.0 in its own venv, plus the Qwen2.5-Coder models for
# bench/workers/ortgenai_worker.py, built with GenAI's own model builder from the same GGUF files
# spectr-edge's bundles come from.
#
#   bash bench/peers/ortgenai_setup.sh        # idempotent: finished steps are skipped
#
# Writes
#   bench/.venv-ortgenai/                      python3.11 venv: onnxruntime-genai + builder deps (~1.5 GB)
#   $OUT/hf/qwen1.5b, $OUT/hf/qwen0.5b         GGUF dequantized to float32 HF folders (intermediate,
#                                              ~7 GB + ~2.5 GB; removed at the end unless KEEP_HF=1)
#   $OUT/qwen1.5b-fp32  qwen1.5b-int4  qwen0.5b-int4   builder output: genai_config.json, model.onnx(.data),
#                                              tokenizer files, and spectr_source.json (provenance)
#   with OUT=~/.cache/spectr-edge/peers/ortgenai
#
# Needs: network to PyPI (onnxruntime-genai 0.18.0 needs onnxruntime>=1.31; the local index has 1.30),
# the project's .venv (scripts/setup.sh: its transformers 4.57 + gguf do the GGUF conversion),
# ~16 GB free RAM for the 1.5B builds (guess: fp32 HF model in torch + the ONNX graph being written).
#
# Why not `builder -i file.gguf`: the builder's GGUF loader (models/loaders/gguf.py) reads each tensor as
# torch.tensor(tensor.data).reshape(...) and its README says "float16/float32 GGUF" only; our GGUFs are
# Q4_K_M (tensors Q4_K, Q6_K, Q5_0, Q8_0), whose raw blocks cannot be reshaped that way. It would also
# need -m <hub name or local HF folder> for config.json and the tokenizer (builder.py get_hf_details).
# So: GGUF -> float32 HF folder with spectr_edge_export.sources.convert_gguf (exactly what spectr-edge's own export
# does, so both tools start from identical dequantized weights) -> builder -i <HF folder>.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PYTHON=${PYTHON:-python3.11}
VENV=$ROOT/bench/.venv-ortgenai
MAIN_PY=$ROOT/.venv/bin/python
GGUF=${SPECTR_GGUF_DIR:-$HOME/.cache/spectr-edge/gguf}
OUT=${ORTGENAI_MODELS:-$HOME/.cache/spectr-edge/peers/ortgenai}
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1   # everything is local
log() { echo "ortgenai-setup: $*" >&2; }

# -- 1. venv (cost: ~2-4 min, mostly unpacking torch; ~1.5 GB) --------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# torch first: ==2.13.0 resolves to the local CPU wheel (/opt/wheels, 2.13.0+cpu), never a CUDA build.
# The builder imports torch unconditionally (builder.py, builders/base.py) even for an HF folder input.
"${PIP[@]}" torch==2.13.0
# onnxruntime-genai 0.18.0 requires numpy>=1.21.6 and onnxruntime>=1.31.0 (plain CPU onnxruntime; it
#   lives only in this venv). onnxruntime is left unpinned (>=1.31.0 resolved to 1.32.0 on PyPI when
#   this was written, untested); the versions printed below go into the worker's info / raw.json.
# transformers 5.18.0, NOT <4.58: the 0.18 builder's builders/base.py does an unguarded
#   `from transformers import (... Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration,
#   Qwen3VLForConditionalGeneration, Lfm2VlForConditionalGeneration ...)`, and qwen3_5 is not in 4.57.6
#   (checked in the 5.18.0 wheel: transformers/models/qwen3_5/ exists). Which minimum 5.x works was not
#   checked; 5.18.0 is on the local index (/opt/pypi-more).
# onnx + onnx_ir: the builder writes through onnx_ir and int4 goes through
#   onnxruntime.quantization.matmul_nbits_quantizer (imports onnx). gguf is not needed here.
"${PIP[@]}" onnxruntime-genai==0.18.0 'onnxruntime>=1.31.0' transformers==5.18.0 onnx onnx_ir tqdm safetensors
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import onnxruntime_genai as og
print("ortgenai-setup: versions:", {p: md.version(p) for p in
      ("onnxruntime-genai", "onnxruntime", "transformers", "torch", "onnx", "onnx_ir", "numpy")},
      "genai commit", og.__commit__)
assert hasattr(og.GeneratorParams, "set_speculative_options") and hasattr(og.Generator, "get_speculative_stats")
EOF
# fail now, not after a conversion, if the builder cannot import (transformers / onnx_ir mismatch).
# (Not `builder --help`: 0.18's help text has a stray '%' that argparse cannot format.)
"$VENV/bin/python" -c "import onnxruntime_genai.models.builder"

# -- 2. GGUF -> float32 HF folders (cost: ~2-4 min for 1.5B, ~1 min for 0.5B; 7 + 2.5 GB on disk) --
[ -x "$MAIN_PY" ] || { log "error: $MAIN_PY missing; run scripts/setup.sh first"; exit 1; }
convert() {  # gguf-name hf-name
  local src=$GGUF/$1 dst=$OUT/hf/$2
  [ -f "$src" ] || { log "error: $src missing"; exit 1; }
  if [ -f "$dst/config.json" ] && [ -f "$dst/tokenizer.json" ]; then log "have $dst"; return; fi
  log "dequantizing $1 -> $dst"
  rm -rf "$dst"
  (cd "$ROOT" && "$MAIN_PY" -c 'import sys; from pathlib import Path; from spectr_edge_export.sources import convert_gguf
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))' "$src" "$dst")
}
convert Qwen2.5-Coder-1.5B-Instruct.gguf qwen1.5b
convert Qwen2.5-Coder-0.5B-Instruct.gguf qwen0.5b

# -- 3. builder (GenAI's own export; defaults kept: GroupQueryAttention, full logits for every
#       position (no prune_lm_head), which multi-token speculative verification needs) ------------
# int4 options mirror spectr-edge's int4 (export/quantize.py: MatMulNBits block 32, symmetric,
# accuracy_level 4 = int8 activations); they are also the builder's CPU defaults, given explicitly.
# Like spectr-edge, lm_head is quantized and the embedding Gather stays float32 (the builder only
# quantizes Gather with op_types_to_quantize=MatMul/Gather or shared_embeddings=true).
build() {  # out-name hf-name gguf-name precision [extra_options...]
  local name=$1 hf=$OUT/hf/$2 gguf=$GGUF/$3 prec=$4; shift 4
  local dst=$OUT/$name
  if [ -f "$dst/genai_config.json" ] && [ -f "$dst/spectr_source.json" ]; then log "have $dst"; return; fi
  log "building $dst ($prec, cpu)"
  rm -rf "$dst"
  "$VENV/bin/python" -m onnxruntime_genai.models.builder -i "$hf" -o "$dst" -p "$prec" -e cpu \
      -c "$OUT/cache" --extra_options hf_token=false "$@"
  # provenance, read by the worker into its "info" (and so into raw.json)
  "$VENV/bin/python" - "$dst" "$gguf" "$prec" "$*" <<'EOF'
import importlib.metadata as md, json, pathlib, sys
dst, gguf, prec, extra = sys.argv[1:5]
ver = pathlib.Path(gguf + ".verified")
sha = json.loads(ver.read_text()).get("sha256") if ver.exists() else "unknown"
note = {"source": f"{pathlib.Path(gguf).name} (GGUF, dequantized to float32 by spectr_edge_export.sources.convert_gguf), "
                  f"sha256 {sha}",
        "quant": "none" if prec == "fp32" else prec, "precision": prec, "execution_provider": "cpu",
        "builder": f"onnxruntime_genai.models.builder {md.version('onnxruntime-genai')} -p {prec} -e cpu "
                   f"--extra_options hf_token=false {extra}".strip(),
        "builder_transformers": md.version("transformers"), "builder_onnxruntime": md.version("onnxruntime")}
(pathlib.Path(dst) / "spectr_source.json").write_text(json.dumps(note, indent=1) + "\n")
EOF
}
# cost (guesses, 2 cores): fp32 1.5B ~3-6 min, ~7 GB out, peak RAM ~12-14 GB;
#                         int4 1.5B ~5-10 min (RTN quantization of every MatMul), ~2 GB out;
#                         int4 0.5B ~2-3 min, ~0.8 GB out
# ORTGENAI_INT4_ONLY=1: the int4 models only (what --suite precisions and int4-peers compare with)
[ "${ORTGENAI_INT4_ONLY:-0}" = 1 ] || build qwen1.5b-fp32 qwen1.5b Qwen2.5-Coder-1.5B-Instruct.gguf fp32
build qwen1.5b-int4 qwen1.5b Qwen2.5-Coder-1.5B-Instruct.gguf int4 block_size=32 accuracy_level=4 is_symmetric=true
build qwen0.5b-int4 qwen0.5b Qwen2.5-Coder-0.5B-Instruct.gguf int4 block_size=32 accuracy_level=4 is_symmetric=true
rmdir "$OUT/cache" 2>/dev/null || true

# -- 4. static checks for draft pairing (no inference here) ----------------------------------------
# ORT GenAI refuses a target/draft pair whose logits widths or provider lists differ
# ("Target and draft must share the same vocabulary", "... same execution provider").
"$VENV/bin/python" - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
cfg = {n: json.loads((out / n / "genai_config.json").read_text())["model"]
       for n in ("qwen1.5b-fp32", "qwen1.5b-int4", "qwen0.5b-int4")}
for n, m in cfg.items():
    print(f"ortgenai-setup: {n}: type {m['type']}, vocab {m['vocab_size']}, eos {m['eos_token_id']}, "
          f"layers {m['decoder']['num_hidden_layers']}, sliding_window {'sliding_window' in m['decoder']}")
assert len({m["vocab_size"] for m in cfg.values()}) == 1, "vocab sizes differ: no draft pairing"
assert len({json.dumps(m["decoder"]["session_options"].get("provider_options")) for m in cfg.values()}) == 1
assert not any("sliding_window" in m["decoder"] for m in cfg.values()), "sliding KV cache: no speculation"
EOF

if [ "${KEEP_HF:-0}" != 1 ]; then
  log "removing the float32 HF intermediates ($OUT/hf); KEEP_HF=1 keeps them"
  rm -rf "$OUT/hf"
fi
log "done. Workers:"
log "  $VENV/bin/python bench/workers/ortgenai_worker.py --model $OUT/qwen1.5b-fp32 [--threads N]"
log "  $VENV/bin/python bench/workers/ortgenai_worker.py --model $OUT/qwen1.5b-fp32 --draft $OUT/qwen0.5b-int4"
