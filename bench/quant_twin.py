"""A twin of a bundle whose target is quantized, for side-by-side benchmarks.

    .venv/bin/python bench/quant_twin.py models/default models/default-int4 --target-quant int4

Copies SRC's small files into DST, hard-links the draft's weights, and writes DST's target as
the quant-bit version of SRC's target graph (export/quantize.py: the same quantizer as
`spectr-edge export --target-quant`; tree-mask input kept). The manifest's target entry then
says which precision it is, and spectr-edge's lossless promise for DST is with respect to that
quantized target. Re-exporting from the GGUF with `spectr-edge export --target-quant int4`
gives the same graph; this skips the ~3-minute float32 export. Peak memory of the int4
quantizer on the 1.5B target: ~22 GB: run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spectr_edge_export import onnx_export, quantize  # noqa: E402
from harness import link_or_copy  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--target-quant", choices=["int8", "int4", "w8a8"], default="int4")
    ap.add_argument("--block-size", type=int, default=quantize.INT4_BLOCK_SIZE, help="int4: weights per scale")
    ap.add_argument("--symmetric", action="store_true", help="int4: no zero points (symmetric blocks)")
    args = ap.parse_args(argv)
    src, dst = Path(args.src).resolve(), Path(args.dst)
    if dst.exists():
        raise SystemExit(f"error: {dst} exists; remove it first")
    manifest = json.loads((src / "spectr.json").read_text())
    target = manifest["models"]["target"]
    if target.get("quant", "none") != "none":
        raise SystemExit(f"error: {src}'s target is already {target['quant']}")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    # everything but the manifest and the float32 target graph and data, which are replaced
    skip = {f.resolve() for f in onnx_export.model_files(src / target["file"])} | {(src / "spectr.json").resolve()}
    link_or_copy(src, tmp, skip)
    out_file = tmp / target["file"]
    out_file.parent.mkdir(parents=True, exist_ok=True)
    print(f"quantizing {src / target['file']} to {args.target_quant} ...", flush=True)
    calibration = None
    if args.target_quant == "w8a8":   # activation statistics for the smoothing (SmoothQuant)
        calibration = quantize.calibration_ids(src / target.get("tokenizer_file", manifest["tokenizer"]["file"]))
    quantize.quantize(src / target["file"], out_file, args.target_quant, args.block_size,
                      symmetric=args.symmetric or quantize.INT4_SYMMETRIC, calibration=calibration)
    if args.target_quant == "int4":
        target["quant_block_size"] = args.block_size
        target["quant_symmetric"] = args.symmetric or quantize.INT4_SYMMETRIC
    target.update(quant=args.target_quant,
                  size_bytes=sum(f.stat().st_size for f in onnx_export.model_files(out_file)))
    target.pop("parity_max_abs_diff", None)   # measured for the float32 graph, not this one
    # tune's results (cost curves, draft costs relative to the target, chosen defaults) were measured
    # with the float32 target: run `spectr-edge tune --bundle DST` for this one
    if manifest.get("guess_head"):   # its head still reads this target's hidden states, but learned SRC's
        print(f"note: the guess head was trained on {src}'s target; train one for this target with "
              f"spectr-edge export --add-guess-head --out {dst}", flush=True)
    for key in ("tuning", "defaults"):
        manifest.pop(key, None)
    target.pop("cost_curve", None)
    for key in ("decode_cost", "decode_rows_curve"):
        manifest["models"].get("draft", {}).pop(key, None)
    if quantize.min_call_tokens(out_file) > 1:
        target["min_call_tokens"] = quantize.min_call_tokens(out_file)   # int4: same numerics in every call
        target["call_token_multiple"] = quantize.call_token_multiple(out_file)
    manifest["name"] = f"{manifest.get('name', src.name)}-target-{args.target_quant}"
    (tmp / "spectr.json").write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, dst)
    print(f"{dst}: target {args.target_quant} ({target['size_bytes'] / 2**20:.0f} MiB), draft and tokenizer "
          f"from {src}")


if __name__ == "__main__":
    main()
