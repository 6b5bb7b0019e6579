"""Adapting a bundle's draft to the traffic it serves (`spectr-edge adapt`): online speculative
decoding's distillation, run on what `--record DIR` kept (spectr_edge/recording.py).

    adapt_bundle(bundle, recording_dir, draft_source=None, minutes=15, layers=4, ...)

1. The records whose vocabulary is the bundle's are split (seeded) into training and held-out parts
   by prompt: every generation of one prompt falls on the same side.
2. The draft's float32 weights are loaded from its source (the preset's GGUF, or --draft-source) and
   its last `layers` decoder layers and final norm are trained (the embeddings and LM head stay
   frozen) to minimize the cross-entropy from the target's recorded top-k distribution (renormalized
   over its k tokens) at every recorded position, plus greedy_weight times the cross-entropy to the
   target's greedy token (its top-1), for at most `minutes`; the generations of 15% of
   the training prompts are set aside, and training keeps the weights of their best loss (after each
   pass, and after the pass the budget cuts short) and stops when it has not improved for two passes.
   A sequence's frozen layers run once: later passes and validations start at the first trained layer
   (FrozenLayers). An int4 or int8 draft is trained through its weights rounded as the
   re-export will round them (quantized_weights: the loss is the quantized draft's, the gradient goes
   straight through to the float weights), so that the gain survives the quantization.
3. The trained draft goes through the export path again: ONNX export and parity check, the bundle
   draft's quantization (kind and block size), tree mask and logits input as the old graph had.
4. The old and the new ONNX drafts are scored on the held-out records, teacher-forced on the recorded
   text: greedy acceptance at each chain position j (the draft's argmax equals the target's at j
   consecutive positions) and at temperature 1 the first position's acceptance (sum of min(p, q) over
   the target's top-k). The new draft is installed only when it accepts more tokens per 6-token chain
   than the old beyond the held-out sample's noise (the 5th percentile of the gain over a seeded
   bootstrap of the held-out sequences is above 0); otherwise the bundle is left as it was.
5. Installing swaps the draft directory and rewrites the manifest, which records what the draft was
   adapted on and both measurements. The target decides the output's law, so whatever the draft
   learned, output stays lossless.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from spectr_edge.errors import ExportError

CHAIN = 6                      # the chain length the acceptance comparison is made for


@dataclass
class Sequence:
    ids: list[int]             # the prompt's last tokens + the recorded tokens
    start: int                 # ids[start] is the first recorded token
    top_ids: np.ndarray        # [n, k] the target's top-k ids over ids[start + i]
    top_p: np.ndarray          # [n, k] their probabilities, renormalized over the k
    top_raw: np.ndarray        # [n, k] their probabilities


def sequences(records, max_context: int) -> list[Sequence]:
    """Records cut to their last max_context tokens (the prompt is cut first)."""
    out = []
    for r in records:
        n = min(len(r.tokens), max_context - 1)
        keep = max_context - n
        prompt = r.prompt[-keep:]
        p = np.exp(r.top_logprobs[:n].astype(np.float64))
        out.append(Sequence(prompt + r.tokens[:n], len(prompt), r.top_ids[:n],
                            (p / p.sum(axis=1, keepdims=True)).astype(np.float32), p.astype(np.float32)))
    return out


def split(records, held_out: float, seed: int, max_context: int):
    """(held-out, validation, training) sequences and the number of prompts. Split by prompt, not by
    generation: samples of one prompt on both sides would measure how well the draft learned those
    prompts, not the traffic they stand for. 15% of the training prompts stop the training."""
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault(tuple(r.prompt), []).append(r)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    n_held = min(len(keys) - 1, max(1, round(held_out * len(keys))))
    rest = keys[n_held:]
    n_val = round(0.15 * len(rest)) if len(rest) >= 8 else 0
    pick = lambda ks: sequences([r for k in ks for r in groups[k]], max_context)    # noqa: E731
    return pick(keys[:n_held]), pick(rest[:n_val]), pick(rest[n_val:]), len(keys)


# -- acceptance of an ONNX draft, teacher-forced ------------------------------------------------------
def chain_acceptance(match: list[np.ndarray], chain: int = CHAIN) -> tuple[list[float], list[float]]:
    """From each sequence's greedy agreement per position: the acceptance at each chain position j
    (all of positions t .. t + j - 1 agree), pooled over the sequences, and each sequence's own
    tokens per chain (what the paired comparison resamples, its positions as weight)."""
    runs = [[np.convolve(m.astype(int), np.ones(j, dtype=int), "valid") == j for j in range(1, min(chain, len(m)) + 1)]
            for m in match]
    per_position = []
    for j in range(chain):
        at_j = [r[j] for r in runs if len(r) > j]
        per_position.append(float(np.mean(np.concatenate(at_j))) if at_j else 0.0)
    return per_position, [sum(float(np.mean(x)) for x in r) for r in runs]


def acceptance(lm, seqs: list[Sequence], vocab_size: int, chain: int = CHAIN) -> dict:
    """Greedy acceptance per chain position and the temperature-1 first-position acceptance of the
    ONNX draft `lm` (an OnnxLM) over held-out sequences."""
    match, overlap = [], []
    for s in seqs:
        logits = lm.forward(np.asarray([s.ids[:-1]], dtype=np.int64), lm.new_cache())[0]   # [T-1, W]
        logits = logits[s.start - 1:, :vocab_size].astype(np.float64)                       # [n, V]
        match.append(logits.argmax(axis=1) == s.top_ids[:, 0])
        q = np.exp(logits - logits.max(axis=1, keepdims=True))
        q /= q.sum(axis=1, keepdims=True)
        overlap.append(np.minimum(s.top_raw, np.take_along_axis(q, s.top_ids.astype(np.int64), axis=1)).sum(axis=1))
    per_position, per_sequence = chain_acceptance(match, chain)
    return {"positions": int(sum(map(len, match))), "greedy_per_position": per_position,
            "greedy_tokens_per_chain": float(sum(per_position)),
            "first_position_t1": float(np.mean(np.concatenate(overlap))) if overlap else 0.0,
            "per_sequence": [round(x, 4) for x in per_sequence], "weights": [len(m) for m in match]}


def gain_lower_bound(before: dict, after: dict, resamples: int = 2000, seed: int = 0) -> float:
    """The 5th percentile of the held-out gain in tokens per chain (after - before, weighted by each
    sequence's positions) over a seeded bootstrap of the held-out sequences: above 0, the adapted
    draft is better on traffic like the held-out records at 95% one-sided confidence."""
    diff = np.asarray(after["per_sequence"]) - np.asarray(before["per_sequence"])
    w = np.asarray(before["weights"], dtype=np.float64)
    if len(diff) == 0 or w.sum() == 0:
        return 0.0
    pick = np.random.default_rng(seed).integers(0, len(diff), size=(resamples, len(diff)))
    means = (diff[pick] * w[pick]).sum(axis=1) / np.maximum(w[pick].sum(axis=1), 1)
    return float(np.percentile(means, 5))


def describe(a: dict) -> str:
    pos = " ".join(f"{x:.2f}" for x in a["greedy_per_position"])
    return (f"greedy acceptance by chain position {pos} ({a['greedy_tokens_per_chain']:.2f} tokens per "
            f"{len(a['greedy_per_position'])}-token chain); temperature 1, first position {a['first_position_t1']:.2f}")


# -- the draft's weight quantization, seen in training -----------------------------------------------
def _int4_block(entry: dict) -> int:
    """Weights per int4 block of a draft's manifest entry (bundles written before the field: 32)."""
    return int(entry.get("quant_block_size", 32))


def weight_rounding(entry: dict) -> tuple[int, int] | None:
    """(bits, weights per block) of the MatMulNBits weights the re-exported draft will have, from its
    manifest entry (export/pipeline.py quantizes it as the old draft was, with zero points); None for a
    float32 or w8a8 draft."""
    from .quantize import INT8_BLOCK_SIZE

    quant = entry.get("quant", "none")
    if quant == "int4":
        return 4, _int4_block(entry)
    if quant == "int8":
        return 8, INT8_BLOCK_SIZE
    return None


def round_weights(w, bits: int, block: int):
    """A torch Linear weight # [out, in] as MatMulNBits holds it (zero points): per block of `block`
    inputs of one output, the range [min(0, lowest), max(0, highest)] in 2**bits - 1 equal steps, the
    zero point rounded onto the grid, each weight to the nearest step (halves away from zero, as ONNX
    Runtime's quantizer rounds). Returns the dequantized weights; a short last block is padded with
    zeros, which leave the range as it is."""
    import torch

    out, k = w.shape
    pad = -k % block
    b = torch.nn.functional.pad(w, (0, pad)).reshape(out, -1, block)
    top = 2 ** bits - 1
    lo, hi = b.amin(-1, keepdim=True).clamp(max=0), b.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / top
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    away = lambda x: torch.sign(x) * torch.floor(x.abs() + 0.5)      # noqa: E731  C's roundf: halves away from 0
    zero = away(-lo / scale).clamp(0, top)
    q = torch.clamp(away(b * (1.0 / scale) + zero), 0, top)
    return ((q - zero) * scale).reshape(out, -1)[:, :k]


def _decoder(model):
    """The decoder stack (embeddings, layers, final norm) of a transformers causal LM."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


@contextmanager
def quantized_weights(model, rounding: tuple[int, int], trained_layers: int = 0):
    """Within it, every matrix product the export quantizes (the decoder layers' projections and the LM
    head) computes with its weights rounded as the re-quantized draft will hold them, so the loss is the
    quantized draft's. The last `trained_layers` layers' weights are rounded at every forward with a
    straight-through gradient (training moves their float weights); the others are rounded once. On
    exit every float weight is back; the export then rounds the trained ones exactly as training saw."""
    import torch
    from torch.nn.utils import parametrize

    bits, block = rounding

    class Rounded(torch.nn.Module):
        def forward(self, w):
            return w + (round_weights(w, bits, block) - w).detach()

    decoder = _decoder(model)
    layers = decoder.layers
    live = [m for layer in layers[len(layers) - trained_layers:] for m in layer.modules()
            if isinstance(m, torch.nn.Linear)] if trained_layers else []
    fixed = [m for layer in layers[:len(layers) - trained_layers] for m in layer.modules()
             if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    saved = []
    try:
        with torch.no_grad():
            for m in fixed + ([head] if head is not None and not tied else []):
                saved.append((m.weight, m.weight.detach().clone()))
                m.weight.copy_(round_weights(m.weight, bits, block))
            if tied:             # the embedding table itself stays float32 (a Gather, not quantized)
                rounded = torch.nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
                rounded.weight.copy_(round_weights(head.weight, bits, block))
                if head.bias is not None:
                    rounded.bias.copy_(head.bias)
                rounded.requires_grad_(False)
                model.set_output_embeddings(rounded)
        for m in live:
            parametrize.register_parametrization(m, "weight", Rounded())
        yield model
    finally:
        for m in live:
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
        with torch.no_grad():
            for weight, value in saved:
                weight.copy_(value)
        if tied:
            model.set_output_embeddings(head)


# -- training ---------------------------------------------------------------------------------------
def _loss(model, s: Sequence, frozen: FrozenLayers | None = None, key=None, greedy_weight: float = 0.0):
    """Cross-entropy from the target's renormalized top-k to the model, over s's recorded positions,
    plus greedy_weight times the cross-entropy to the target's greedy token (its top-1: what greedy
    acceptance asks the draft's argmax to equal). frozen, key: run the model through `frozen`, which keeps s's
    hidden state under `key`."""
    import torch

    ids = torch.tensor([s.ids[:-1]], dtype=torch.long)
    n = len(s.ids) - s.start                  # the recorded positions: no LM head over the prompt's
    logits = (model(input_ids=ids, logits_to_keep=n) if frozen is None else frozen(model, key, ids, n)).logits
    logq = torch.log_softmax(logits[0, -n:].float(), dim=-1)                              # [n, W]
    top = torch.from_numpy(s.top_ids.astype(np.int64))
    picked = logq.gather(1, top)                                                          # [n, k]
    soft = -(torch.from_numpy(s.top_p) * picked).sum(dim=1).mean()
    return soft - greedy_weight * picked[:, 0].mean() if greedy_weight else soft


class FrozenLayers:
    """Training changes the last `layers` decoder layers only, so what the frozen ones below them compute
    for a sequence never changes: the first forward of a sequence keeps the hidden state that enters the
    first trained layer, and later forwards start there (the model's own forward, with the frozen layers
    left out and that state as its input embeddings). The logits are the same computation, bit for bit;
    a pass after the first costs the trained layers and the LM head only. Up to max_bytes of states."""

    def __init__(self, model, layers: int, max_bytes: int = 4 << 30):
        import torch

        decoder = _decoder(model)
        self.decoder, self.all, self.first = decoder, decoder.layers, len(decoder.layers) - layers
        self.trained = torch.nn.ModuleList(list(self.all)[self.first:])     # the stack a kept state enters
        self.states: dict = {}
        self.bytes, self.max_bytes = 0, max_bytes

    def __call__(self, model, key, ids, logits_to_keep: int = 0):
        state = self.states.get(key)
        if state is not None:
            self.decoder.layers = self.trained
            try:
                return model(inputs_embeds=state, logits_to_keep=logits_to_keep)
            finally:
                self.decoder.layers = self.all
        kept = []
        hook = self.all[self.first].register_forward_pre_hook(
            lambda _module, args, kwargs: kept.append((args[0] if args else kwargs["hidden_states"]).detach()),
            with_kwargs=True)
        try:
            out = model(input_ids=ids, logits_to_keep=logits_to_keep)
        finally:
            hook.remove()
        if kept and self.bytes + kept[0].nbytes <= self.max_bytes:
            self.states[key] = kept[0]
            self.bytes += kept[0].nbytes
        return out


def train(model, seqs: list[Sequence], layers: int, minutes: float, lr: float, max_steps: int | None,
          seed: int, log: Callable[[str], None], validation: list[Sequence] = (), patience: int = 2,
          rounding: tuple[int, int] | None = None, greedy_weight: float = 0.0) -> dict:
    """Train the last `layers` decoder layers and the final norm of a transformers causal LM on the
    target's recorded distributions; stops after `minutes` or `max_steps` sequence steps, or when the
    loss on `validation` has not improved for `patience` passes, and keeps the weights of its best
    validation loss (measured after every pass, and once more when the budget ends a pass early: the
    time budget keeps back what one validation takes, so the last partial pass is not lost).
    rounding: (bits, block) of the draft's quantized weights: training and validation see the weights
    so rounded (quantized_weights), so what is learnt survives the re-quantization.
    greedy_weight: the weight of the cross-entropy to the target's greedy token added to the loss (_loss)."""
    with quantized_weights(model, rounding, layers) if rounding else nullcontext():
        report = _train(model, seqs, layers, minutes, lr, max_steps, seed, log, validation, patience,
                        greedy_weight)
    report["rounded_weights"] = {"bits": rounding[0], "block": rounding[1]} if rounding else None
    return report


def _train(model, seqs, layers, minutes, lr, max_steps, seed, log, validation, patience,
           greedy_weight=0.0) -> dict:
    import torch

    torch.manual_seed(seed)
    decoder = _decoder(model)
    blocks = decoder.layers
    if not 1 <= layers <= len(blocks):
        raise ExportError(f"--layers must be in [1, {len(blocks)}] for this draft, got {layers}")
    for p in model.parameters():
        p.requires_grad_(False)
    trained = [p for block in blocks[len(blocks) - layers:] for p in block.parameters()] + list(decoder.norm.parameters())
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    frozen = FrozenLayers(model, layers) if layers < len(blocks) else None
    model.train()
    order, rng = list(range(len(seqs))), random.Random(seed)
    started, steps, losses, deadline, budget = time.perf_counter(), 0, [], minutes * 60, max_steps
    report_every, next_report = 15.0, 15.0
    best, best_state, stale, passes, spent = float("inf"), None, 0, 0, False

    def validate() -> float:
        model.eval()
        with torch.no_grad():
            value = float(np.mean([_loss(model, v, frozen, ("validation", j), greedy_weight).item()
                                   for j, v in enumerate(validation)]))
        model.train()
        return value

    def finish(reason: str) -> dict:
        if best_state is not None:           # the weights of the best validation loss
            with torch.no_grad():
                for p, saved in zip(trained, best_state):
                    p.copy_(saved)
        model.eval()
        return {"steps": steps, "seconds": round(time.perf_counter() - started, 1), "first_loss": round(losses[0], 4),
                "last_loss": round(float(np.mean(losses[-20:])), 4), "layers": layers, "lr": lr, "passes": passes,
                "validation_loss": None if best_state is None else round(best, 4), "stopped": reason,
                "greedy_weight": greedy_weight}

    def check(label: str) -> bool:
        """Validate the weights as they are, keep them if best; whether training should stop."""
        nonlocal best, best_state, stale
        value = validate()
        if value < best:
            best, stale = value, 0
            best_state = [p.detach().clone() for p in trained]
        else:
            stale += 1
        log(f"      {label}: validation loss {value:.3f} (best {best:.3f})")
        return stale >= patience

    if validation:
        best = validate()
        log(f"      validation loss before training {best:.3f} ({len(validation)} generations)")
        deadline -= time.perf_counter() - started          # what the last validation will take
    while True:
        rng.shuffle(order)
        for k, i in enumerate(order):
            loss = _loss(model, seqs[i], frozen, i, greedy_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            steps += 1
            losses.append(loss.item())
            elapsed = time.perf_counter() - started
            if elapsed >= next_report:
                next_report += report_every
                left = (deadline - elapsed) if budget is None else elapsed / steps * (budget - steps)
                log(f"      step {steps}{'/' + str(budget) if budget else ''}: loss {np.mean(losses[-20:]):.3f}, "
                    f"{elapsed:.0f} s, about {max(left, 0):.0f} s left")
            spent = (budget is not None and steps >= budget) or (budget is None and elapsed >= deadline)
            if spent and k + 1 < len(order):
                if validation:                                # the pass the budget cut short
                    check(f"step {steps}, {passes} passes and {k + 1} records")
                return finish("budget")
        passes += 1
        if validation and check(f"pass {passes}"):           # after every pass over the training records
            return finish("validation loss stopped improving")
        if spent:
            return finish("budget")


# -- the whole command ------------------------------------------------------------------------------
def _draft_source(manifest: dict, given: str | None):
    """The draft's source: the one given, or the preset GGUF whose sha256 the manifest names."""
    from . import presets

    if given is not None:
        return given
    source = str(manifest["models"]["draft"].get("source", ""))
    for preset in presets.PRESETS.values():
        spec = preset.draft
        if isinstance(spec, presets.GGUFSpec) and spec.sha256 in source:
            return spec
    raise ExportError("the draft's source is not a preset this version knows; pass --draft-source with the "
                      "Hugging Face directory, GGUF file or hub id the draft was exported from")


def _spec(directory: Path, entry: dict):
    from spectr_edge.bundle import _Fields, _model_spec

    return _model_spec(directory, "draft", _Fields(entry, "models.draft"))


def adapt_bundle(bundle, recording_dir, draft_source: str | None = None, minutes: float = 15.0, layers: int = 4,
                 held_out: float = 0.2, lr: float = 1e-5, max_context: int = 384, max_steps: int | None = None,
                 seed: int = 0, threads: int | None = None, dry_run: bool = False, quant_aware: bool = True,
                 greedy_weight: float = 0.0, log: Callable[[str], None] = print) -> dict:
    """Adapt the bundle's draft on the recorded traffic; install it when it accepts more on held-out
    records. Returns a report (both acceptances, training, installed or not)."""
    from spectr_edge import recording
    from spectr_edge.bundle import bundle_from_manifest, write_manifest
    from spectr_edge.onnx_model import OnnxLM

    from . import tokenizer_fix
    from .pipeline import Progress, _add_tree_mask, _fp32_graph, _place, _probe_ids, _resolve
    from .logits_keep import upgrade_entry
    from .writer import existing_manifest

    if not 0 < held_out < 1:
        raise ExportError(f"--held-out must be a fraction in (0, 1), got {held_out}")
    if not minutes > 0:
        raise ExportError(f"--minutes must be positive, got {minutes}")
    bundle = Path(bundle).expanduser().absolute()
    manifest = existing_manifest(bundle)
    b = bundle_from_manifest(bundle, manifest)
    if b.draft is None:
        raise ExportError(f"{bundle} has no draft model to adapt; export one with --draft")
    records = [r for r in recording.read(recording_dir) if r.vocab_sha256 in (None, b.tokenizer.vocab_sha256)]
    tokens = sum(len(r.tokens) for r in records)
    if len(records) < 4 or tokens < 64:
        raise ExportError(f"{recording_dir} holds {len(records)} generations ({tokens} tokens) recorded with this "
                          "bundle's vocabulary; record at least 4 generations and 64 tokens (--record DIR)")
    if len({tuple(r.prompt) for r in records}) < 2:
        raise ExportError(f"{recording_dir} holds generations of one prompt only; record several prompts")
    held, validation, fit, prompts = split(records, held_out, seed, max_context)
    log(f"{len(records)} recorded generations ({tokens} tokens) of {prompts} prompts: {len(fit)} to train on, "
        f"{len(validation)} to stop training by, {len(held)} held out to compare the drafts")

    old_entry = manifest["models"]["draft"]
    rounding = weight_rounding(old_entry) if quant_aware else None
    # measure, load, train, export, parity, [quantize], [tree mask], measure
    progress = Progress(log, 6 + (old_entry.get("quant", "none") != "none") + bool(old_entry.get("tree_mask")))
    work = bundle.parent / f".{bundle.name}.adapt-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        with progress.step("measuring the current draft on the held-out records"):
            before = acceptance(OnnxLM(b.draft, provider="cpu", threads=threads), held, b.tokenizer.vocab_size)
            log(f"      {describe(before)}")
        with progress.step("loading the draft's float32 weights from its source"):
            src = _resolve(_draft_source(manifest, draft_source), work, "draft", log)
            tok = tokenizer_fix.read_tokenizer(src.dir)
            if tok.vocab_sha256 != b.tokenizer.vocab_sha256:
                raise ExportError(f"the draft source {src.description} has another vocabulary than the bundle; "
                                  "pass the source the bundle's draft was exported from")
            import torch
            from transformers import AutoModelForCausalLM

            if threads:
                torch.set_num_threads(threads)
            model = AutoModelForCausalLM.from_pretrained(str(src.dir), dtype=torch.float32)
        seen = f", seeing its weights rounded to {rounding[0]} bits as the re-export will" if rounding else ""
        with progress.step(f"training the draft's last {layers} layers on the target's distributions{seen} "
                           f"(at most {minutes:g} min)"):
            training = train(model, fit, layers, minutes, lr, max_steps, seed, log, validation, rounding=rounding,
                             greedy_weight=greedy_weight)
            log(f"      {training['steps']} steps, {training['passes']} passes, training loss {training['first_loss']:.3f} "
                f"-> {training['last_loss']:.3f}; stopped: {training['stopped']}")
        adapted_dir = work / "adapted-hf"
        model.save_pretrained(str(adapted_dir))
        del model
        for f in src.dir.iterdir():               # the tokenizer files, as the source had them
            if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                                           "merges.txt", "generation_config.json")):
                shutil.copy2(f, adapted_dir / f.name)
        from .sources import Source

        adapted = Source("hf", adapted_dir, f"{old_entry.get('source', 'the draft')}, adapted on {tokens} recorded "
                                            "tokens")
        stage = work / "stage"
        (stage / "draft").mkdir(parents=True)
        shutil.copy2(b.draft.tokenizer_file or b.tokenizer.file, stage / "draft" / "tokenizer.json")
        ids = _probe_ids(tok, (bundle / "tokenizer.json").read_text(encoding="utf-8"))
        quant = old_entry.get("quant", "none")
        graph = _fp32_graph("draft", adapted, work, progress, ids)
        entry = _place("draft", graph, quant, stage, progress, ids, tok, adapted.description, move=True,
                       block_size=_int4_block(old_entry))
        if old_entry.get("tree_mask"):
            entry = _add_tree_mask("draft", entry, stage, progress, ids, fuse=old_entry.get("attention") == "gqa")
        if old_entry.get("inputs", {}).get("logits_keep"):
            entry = upgrade_entry(stage, "draft", entry, log)
        for key in ("decode_cost", "decode_rows_curve"):      # this machine's measured costs stay valid
            if key in old_entry:
                entry[key] = old_entry[key]
        with progress.step("measuring the adapted draft on the held-out records"):
            after = acceptance(OnnxLM(_spec(stage, entry), provider="cpu", threads=threads), held,
                               b.tokenizer.vocab_size)
            log(f"      {describe(after)}")
        bound = gain_lower_bound(before, after)
        better = bound > 0
        report = {"records": len(records), "tokens": tokens, "train_records": len(fit), "held_out_records": len(held),
                  "training": training, "before": before, "after": after, "gain_lower_bound": round(bound, 4),
                  "installed": bool(better and not dry_run)}
        if not better:
            log(f"not installed: the adapted draft accepts {after['greedy_tokens_per_chain']:.2f} tokens per "
                f"{CHAIN}-token chain on the held-out records against {before['greedy_tokens_per_chain']:.2f} for the "
                f"current one, a gain whose 95% lower bound is {bound:+.3f} (it must be above 0: record more "
                f"traffic); {bundle} is unchanged")
            return report
        if dry_run:
            log(f"dry run: the adapted draft would be installed; {bundle} is unchanged")
            return report
        entry["adapted"] = {"recording": str(Path(recording_dir).absolute()), "generations": len(records),
                            "tokens": tokens, "date": time.strftime("%Y-%m-%d"), "training": training,
                            "held_out_before": before, "held_out_after": after, "gain_lower_bound": round(bound, 4),
                            "previous_source": old_entry.get("source")}
        new_manifest = json.loads(json.dumps(manifest))
        new_manifest["models"]["draft"] = {**entry, "file": "draft/model.onnx",
                                           "tokenizer_file": "draft/tokenizer.json"}
        old = bundle / f".draft.replaced-{os.getpid()}"
        os.replace(bundle / "draft", old)              # the old draft stays until the new one is in place
        try:
            os.replace(stage / "draft", bundle / "draft")
            bundle_from_manifest(bundle, new_manifest)    # the manifest describes the files now in place
        except BaseException:
            shutil.rmtree(bundle / "draft", ignore_errors=True)
            os.replace(old, bundle / "draft")
            raise
        write_manifest(bundle, new_manifest)
        shutil.rmtree(old, ignore_errors=True)
        log(f"{bundle}: adapted draft installed (greedy tokens per {CHAIN}-token chain "
            f"{before['greedy_tokens_per_chain']:.2f} -> {after['greedy_tokens_per_chain']:.2f} on held-out records, "
            f"95% lower bound of the gain {bound:+.3f})")
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
