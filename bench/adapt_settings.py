"""`spectr-edge adapt`'s training settings side by side on one recording, before any export: each
setting trains the draft's float32 PyTorch weights on adapt's own split of the recording (the same
seeded split by prompt) and prints the validation loss per pass and the greedy acceptance by chain
position, teacher-forced, before and after: on the generations that stop training (`--on validation`,
the default) or on adapt's held-out ones (`--on held-out`). Choose settings on the first: the held-out
generations decide adapt's install, and a setting picked for them would make that decision optimistic.

    .venv/bin/python bench/adapt_settings.py --from models/default-adapted.recording 4,1e-5,2 4,1e-5,2,rounded

Each setting is LAYERS,LR,PASSES[,rounded][,greedy=W] (the last LAYERS decoder layers trained, AdamW at LR,
PASSES passes, the weights of the best validation loss kept; `rounded`: training sees the weights rounded
as the bundle's int4 or int8 draft holds them, adapt's default; `greedy=W`: W times the cross-entropy to the
target's greedy token is added to the loss). Acceptance is printed with float32 weights and
with the weights so rounded (what the re-exported draft computes, up to its int8 activations). Needs the export extra (torch, transformers); about 3 min a pass for 4 layers on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def greedy_acceptance(model, seqs, rounding=None) -> list[float]:
    """adapt's greedy acceptance by chain position, for a PyTorch draft (its weights rounded as the
    bundle's quantized draft holds them, with rounding)."""
    import contextlib

    import torch

    from export import adapt

    with torch.no_grad(), adapt.quantized_weights(model, rounding) if rounding else contextlib.nullcontext():
        match = [model(input_ids=torch.tensor([s.ids[:-1]])).logits[0, s.start - 1:].float().numpy().argmax(axis=1)
                 == s.top_ids[:, 0] for s in seqs]
    return adapt.chain_acceptance(match)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="recording", required=True, help="the recording directory")
    ap.add_argument("--bundle", default=str(ROOT / "models" / "default"), help="whose draft to train")
    ap.add_argument("--hf", type=Path, default=Path("/tmp/spectr-edge-draft-hf"),
                    help="where the draft's float32 weights are converted to (kept between runs)")
    ap.add_argument("--on", choices=("validation", "held-out"), default="validation",
                    help="the generations acceptance is measured on [default: validation]")
    ap.add_argument("settings", nargs="+", help="LAYERS,LR,PASSES[,rounded][,greedy=W]")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from export import adapt, presets, sources
    from spectr_edge import recording

    torch.set_num_threads(2)
    if not (args.hf / "config.json").exists():
        manifest = json.loads((Path(args.bundle) / "spectr.json").read_text())
        gguf = presets.fetch_gguf(adapt._draft_source(manifest, None), presets.cache_root(), print)
        sources.convert_gguf(gguf, args.hf)
    held, validation, fit, _ = adapt.split(list(recording.read(args.recording)), 0.2, 0, 384)
    print(f"{len(fit)} generations to train on, {len(validation)} to stop by, {len(held)} held out; "
          f"acceptance measured on the {args.on} ones")
    measured = held if args.on == "held-out" else validation
    rounding = adapt.weight_rounding(json.loads((Path(args.bundle) / "spectr.json").read_text())["models"]["draft"])
    show = lambda a: f"{' '.join(f'{x:.3f}' for x in a)} ({sum(a):.2f} per chain)"   # noqa: E731
    for setting in args.settings:
        layers, lr, passes, *mode = setting.split(",")
        aware = "rounded" in mode
        weights = [m for m in mode if m.startswith("greedy=")]
        if len(mode) != aware + len(weights) or len(weights) > 1:
            raise SystemExit(f"{setting}: the fields after PASSES can only be 'rounded' and 'greedy=W'")
        greedy_weight = float(weights[0].split("=", 1)[1]) if weights else 0.0
        if aware and rounding is None:
            raise SystemExit(f"{setting}: the bundle's draft is not int4 or int8, there is nothing to round")
        model = AutoModelForCausalLM.from_pretrained(str(args.hf), dtype=torch.float32).eval()
        before = greedy_acceptance(model, measured)
        before_q = greedy_acceptance(model, measured, rounding) if rounding else None
        started = time.perf_counter()
        # the budget ends with the last pass: its validation runs, and the best validated weights are kept
        training = adapt.train(model, fit, int(layers), 600.0, float(lr), int(passes) * len(fit), 0,
                               lambda s: print(s, flush=True) if "pass" in s or "before" in s else None,
                               validation, patience=int(passes), rounding=rounding if aware else None,
                               greedy_weight=greedy_weight)
        after = greedy_acceptance(model, measured)
        print(f"{setting}: {time.perf_counter() - started:.0f} s, validation loss {training['validation_loss']}; "
              f"{args.on} greedy acceptance, float32 weights: {show(before)} -> {show(after)}", flush=True)
        if rounding:
            after_q = greedy_acceptance(model, measured, rounding)
            print(f"{setting}: weights rounded to {rounding[0]} bits in blocks of {rounding[1]}: "
                  f"{show(before_q)} -> {show(after_q)}", flush=True)


if __name__ == "__main__":
    main()
