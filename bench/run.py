"""One benchmark run: methods x prompts, interleaved, written to bench/results/<date>-<name>/.

    .venv/bin/python bench/run.py --suite issue3 --name spec-grid          # the SpecTr grid (issue 3)
    .venv/bin/python bench/run.py --suite default --quick                 # a few minutes, for development
    .venv/bin/python bench/run.py --suite peers                           # spectr-edge vs ORT GenAI, HF, llama.cpp
    .venv/bin/python bench/run.py --suite adaptive                        # length rules, float32 and int4 targets
    .venv/bin/python bench/run.py --suite cpu                             # issue 6's bars: int4 per category vs peers
    .venv/bin/python bench/run.py --suite int4-calls                      # int4: padded vs 1-token calls, two layouts
    .venv/bin/python bench/run.py --suite int4-wide                       # int4 default vs target-only, llama.cpp: 48 prompts
    .venv/bin/python bench/run.py --suite quant-wide                      # the same + the int8 twin's t-o and default
    .venv/bin/python bench/run.py --suite precisions                      # float32, int8, int4: default vs own target-only
    .venv/bin/python bench/run.py --suite w8a8                            # the same + w8a8, llama.cpp Q4, ORT GenAI int4
    .venv/bin/python bench/run.py --suite guess                           # int4 with and without the guess head, 48 prompts
    .venv/bin/python bench/run.py --suite trees                           # issue 5: draft trees, tuned defaults
    .venv/bin/python bench/run.py --suite issue5                          # issue 5 float32: chain vs trees, T=0 and T=1
    .venv/bin/python bench/run.py --suite length                          # float32: model+lookup drafts of 6, 8, 10 tokens
    .venv/bin/python bench/run.py --suite prefill                         # LM head on the last position vs all (TTFT)

Every method runs in a worker process (bench/workers/), one worker per tool configuration
that needs its own loaded models, so peers run in their own environments and each
method's peak resident memory is its worker's. Per prompt every method runs once, in an
order that reverses from prompt to prompt (A B C, C B A, ...), after one warm-up
generation per method, so machine drift hits all alike. A suite too large for memory at
once (the peers suite: four float32 1.5B models would not fit in 24 GiB) runs in groups,
one after the other; every group carries spectr-edge's target-only methods as its anchor,
and speedups pair each row with the anchor of its own group and prompt. The prompt is tokenized once
(the bundle's chat template) and every method gets the same token ids.

Output: raw.json (meta: command, machine, versions, prompts; rows: one per generation,
token ids included), table.md (per method: TTFT, ms/token median and p90, tokens/s,
speedup vs target-only of the same run and temperature, tokens per target call,
acceptance, peak RSS, time outside ONNX Runtime; per Spec-Bench task speedups) and PNG
plots (bench/plots.py). Plots and tables can be rebuilt from raw.json:
    .venv/bin/python bench/report.py bench/results/<dir>
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

BENCH = Path(__file__).resolve().parent
PY = sys.executable


# -- methods --------------------------------------------------------------------------------------
def spectr(temperature: float, k: int, L: int = 0, stop: float | None = None, label: str | None = None) -> dict:
    cfg = {"temperature": temperature, "k": k}
    if k:
        cfg["L"] = L
        cfg["stop"] = 0.0 if stop is None else stop
    if label is None:
        label = "target-only" if k == 0 else f"k={k} L={L}" + (f" stop {stop:g}" if stop else "")
    return {"name": f"spectr-edge T={temperature:g} {label}", "tool": "spectr-edge", "worker": "spectr",
            "config": cfg, "temperature": temperature, "baseline": k == 0}


def lookup(temperature: float, drafter: str) -> dict:
    """Prompt lookup (spectr_edge/lookup.py), alone or before the draft model; default lengths."""
    return {"name": f"spectr-edge T={temperature:g} {drafter}", "tool": "spectr-edge", "worker": "spectr",
            "config": {"temperature": temperature, "drafter": drafter}, "temperature": temperature,
            "baseline": False}


def model_lookup(L: int, stop: float = 0.5, window: int | None = None) -> dict:
    """Greedy prompt lookup before the draft model (k = 1, up to L tokens); window = the draft's
    context window (None: the bundle's default)."""
    label = f"model+lookup k=1 L={L} stop {stop:g}"
    if window is not None:
        label += f", draft window {window or 'whole prompt'}"
    config = {"temperature": 0.0, "drafter": "model+lookup", "k": 1, "L": L, "stop": stop}
    return {**spectr(0.0, 1, L, stop=stop, label=label),
            "config": config if window is None else {**config, "window": window}}


def spectr_default(temperature: float) -> dict:
    """The shipped defaults (no k/L/stop passed: what `spectr-edge generate` does)."""
    return {"name": f"spectr-edge T={temperature:g} default", "tool": "spectr-edge", "worker": "spectr",
            "config": {"temperature": temperature}, "temperature": temperature, "baseline": False}


def peer(tool: str, worker: str, label: str, temperature: float, config: dict | None = None,
         own: str | None = None, max_prompts: int | None = None, limit_reason: str = "") -> dict:
    """A peer tool's method; `own` = the label of that tool's own target-only at this temperature."""
    name = lambda lab: f"{tool} T={temperature:g} {lab}"  # noqa: E731
    m = {"name": name(label), "tool": tool, "worker": worker, "temperature": temperature,
         "config": {"temperature": temperature, **(config or {})}, "baseline": False,
         "own_baseline": name(own) if own else None}
    if max_prompts:
        m.update(max_prompts=max_prompts, limit_reason=limit_reason)
    return m


def slow(method: dict) -> dict:
    """ORT GenAI 0.18's speculative decoding at T > 0 runs at ~2-3 s/token here (smoke run of
    2026-11-30; greedy is normal): those rows run on the first prompt only."""
    if not method["temperature"]:
        return method
    return {**method, "max_prompts": 1,
            "limit_reason": "ORT GenAI 0.18 speculative sampling takes ~2-3 s/token at T=1 on this CPU"}


def peers_suite(int4_bundle: str | None = None) -> list[dict]:
    """Issue 4's comparison, in three memory-sized groups (see the module docstring).

    spectr-edge (the --bundle; tree masks on, so k > 1 verifies a trie): target-only, k=1 at its
    best L (3 in the issue-3 grid), the greedy default, SpecTr k=2/4 at their best L. Peers on the
    same two GGUF files: ORT GenAI (its builder, fp32 and int4 targets, int4 draft, 4 draft
    tokens as in issue 6), HF transformers assisted generation (its defaults, and 3 tokens = our
    L), llama.cpp (Q4 GGUF as shipped: target-only, its prompt lookup, a 0.5B draft of 3 tokens).
    """
    og, og_d = "ortgenai:qwen1.5b-int4", "ortgenai:qwen1.5b-int4+qwen0.5b-int4"
    ogf, ogf_d = "ortgenai:qwen1.5b-fp32", "ortgenai:qwen1.5b-fp32+qwen0.5b-int4"
    groups: dict[str, list[dict]] = {"main": [], "hf": [], "ortgenai-fp32": [], "ortgenai-fp32-draft": []}
    for t in (0.0, 1.0):
        anchor = spectr(t, 0)
        # (greedy k > 1 side leaves, lookup at T=1 and model+lookup are left out to keep the run near an
        # hour: the tree run of section 2 and the smoke run had them no faster than the rows kept)
        groups["main"] += [anchor, spectr(t, 1, 3)]
        groups["main"] += [spectr_default(0.0), lookup(0.0, "lookup")] if t == 0 else [spectr(t, 2, 2), spectr(t, 4, 2)]
        # the same bundle with an int4 target (bench/quant_twin.py): lossless with respect to that target
        q = lambda m: {**on_bundle(m, int4_bundle or str(INT4_BUNDLE), "int4 target"),  # noqa: E731
                       "own_baseline": None if m["baseline"] else f"spectr-edge T={t:g} target-only [int4 target]"}
        groups["main"] += [q(spectr(t, 0)), q(spectr(t, 1, 3))] + ([q(lookup(t, "lookup"))] if t == 0 else [])
        groups["main"] += [
            peer("ortgenai", og, "int4 target-only", t),
            slow(peer("ortgenai", og_d, "int4 + int4 draft, 4 tokens", t,
                      {"speculative": "draft", "max_draft_tokens": 4}, own="int4 target-only")),
            peer("llama.cpp", "llamacpp", "Q4 target-only", t)]
        if t == 0:
            groups["main"].append(
                peer("llama.cpp", "llamacpp", "Q4 prompt lookup", t,
                     {"speculative": "prompt_lookup", "num_pred_tokens": 10, "max_ngram_size": 2}, own="Q4 target-only"))
        groups["main"] += [
            peer("llama.cpp", "llamacpp", "Q4 + Q4 draft, 3 tokens", t, {"speculative": "draft_model", "num_draft": 3},
                 own="Q4 target-only")]
        # transformers runs at ~0.4-0.8 s/token: its T=1 rows and the 3-token variant run on 3 prompts
        few = dict(max_prompts=3, limit_reason="transformers takes ~0.4-0.8 s/token; 3 prompts keep the run near an hour")
        groups["hf"] += [anchor, peer("transformers", "hf", "fp32 target-only", t, **(few if t else {})),
                         peer("transformers", "hf", "fp32 assisted (library defaults)", t, {"assistant": True},
                              own="fp32 target-only", **(few if t else {}))]
        if t == 0:
            groups["hf"].append(peer("transformers", "hf", "fp32 assisted, 3 tokens", t,
                                     {"assistant": True, "num_assistant_tokens": 3, "schedule": "constant"},
                                     own="fp32 target-only", **few))
        # two groups: spectr-edge's and ORT GenAI's float32 1.5B models (~6.5 GiB each) do not fit three at a time
        groups["ortgenai-fp32"] += [anchor, peer("ortgenai", ogf, "fp32 target-only", t)]
        groups["ortgenai-fp32-draft"] += [anchor, slow(peer("ortgenai", ogf_d, "fp32 + int4 draft, 4 tokens", t,
                                                            {"speculative": "draft", "max_draft_tokens": 4},
                                                            own="fp32 target-only"))]
    return [{**m, "group": g} for g, ms in groups.items() for m in ms]


def on_bundle(method: dict, bundle: str, tag: str) -> dict:
    """The same method on another bundle (its own worker), named with a tag."""
    return {**method, "name": f"{method['name']} [{tag}]", "worker": f"spectr:{bundle}", "bundle": bundle,
            "baseline": False}


def precision_rows(bundle, tag: str) -> list[dict]:
    """Greedy target-only and default on another bundle, the default against that target-only."""
    own = f"spectr-edge T=0 target-only [{tag}]"
    return [{**on_bundle(spectr(0.0, 0), str(bundle), tag), "own_baseline": None},
            {**on_bundle(spectr_default(0.0), str(bundle), tag), "own_baseline": own}]


def suite(name: str, all_configs: bool = False, other_bundle: str | None = None) -> list[dict]:
    if name == "issue3":   # issue 3's grid: k in {1,2,4} x L in {2,3,4,6}, greedy and T=1, plus the defaults
        out = [spectr(0.0, 0)] + [spectr(0.0, 1, L) for L in (2, 3, 4, 6)] + [spectr_default(0.0)]
        # k=2 L=6, k=4 L=4 and k=4 L=6 are left out: dominated in the 10-prompt sweep of 2026-11-30
        # (1.01x, 1.07x, 0.84x) and the slowest rows; add them back with --all-configs
        out += [spectr(1.0, 0)] + [spectr(1.0, 1, L) for L in (2, 3, 4, 6)]
        out += [spectr(1.0, 2, L) for L in (2, 3, 4)] + [spectr(1.0, 4, L) for L in (2, 3)]
        if all_configs:
            out += [spectr(1.0, 2, 6), spectr(1.0, 4, 4), spectr(1.0, 4, 6)]
        return out
    if name == "default":   # what a user compares: target-only vs the shipped defaults
        return [spectr(0.0, 0), spectr_default(0.0), spectr(1.0, 0), spectr_default(1.0)]
    if name == "tree":      # replicated (--bundle) vs trie verification (--tree-bundle: same weights, 4D mask)
        if not other_bundle:
            raise SystemExit("error: the tree suite compares --bundle with --tree-bundle; pass both")
        tree = lambda m: on_bundle(m, other_bundle, "trie")  # noqa: E731
        # greedy k > 1 on a tree bundle = the chain + k - 1 side leaves per depth (engine._greedy_tree_step)
        return [spectr(0.0, 0), tree(spectr(0.0, 0)), spectr(0.0, 1, 3), tree(spectr(0.0, 2, 3)),
                tree(spectr(0.0, 3, 4)), spectr(1.0, 0), spectr(1.0, 2, 2), tree(spectr(1.0, 2, 2)),
                spectr(1.0, 4, 3), tree(spectr(1.0, 4, 3))]
    if name == "peers":
        return peers_suite(other_bundle)
    if name == "adaptive":  # issue 6: length rules on the float32 and int4 targets (tune both bundles first)
        q = lambda m: {**on_bundle(m, other_bundle or str(INT4_BUNDLE), "int4 target"),  # noqa: E731
                       "own_baseline": None if m["baseline"] else "spectr-edge T=0 target-only [int4 target]"}
        adaptive = adaptive_method
        return [spectr(0.0, 0), spectr_default(0.0), adaptive(6, 0.5),
                q(spectr(0.0, 0)), q(adaptive(6)), q(adaptive(6, 0.5)), q(lookup(0.0, "lookup"))]
    if name == "int4-calls":  # int4 targets: padded vs 1-token calls, block 128 with zero points vs block 32
        int4 = [m for m in cpu_suite(other_bundle) if "int4" in m["name"] and "T=1" not in m["name"]
                and m["tool"] == "spectr-edge"]
        own = "spectr-edge T=0 target-only [int4 target]"
        hybrid = {**lookup(0.0, "model+lookup"), "name": "spectr-edge T=0 model+lookup adaptive",
                  "config": {"temperature": 0.0, "drafter": "model+lookup", "k": 1, "L": 6, "adaptive": True}}
        extra = [{**on_bundle(m, other_bundle or str(INT4_BUNDLE), "int4 target"), "own_baseline": own}
                 for m in (lookup(0.0, "lookup"), hybrid)]   # tune's two closest greedy choices
        return int4[:3] + extra + int4[3:]
    if name == "cpu":       # issue 6's bars: int4 target per category, against ORT GenAI and llama.cpp, greedy
        return cpu_suite(other_bundle)
    if name in ("int4-wide", "quant-wide"):  # issue 6's int4 bars on 48 prompts: target-only, the default,
        # llama.cpp, ORT GenAI's int4 target alone (its fastest int4 configuration in every run so far;
        # with its 0.5B draft it was 0.73x of that in section 000000); --all-configs adds the draft row.
        # quant-wide adds the int8 twin's target-only and default (the moonshot: the fastest lossless
        # configuration against llama.cpp's Q4 decode)
        int4, og = cpu_suite(other_bundle), "ortgenai:qwen1.5b-int4"
        out = int4[:2]
        if name == "quant-wide":   # + prompt lookup with 4 candidates in one trie (int8's flat cost curve)
            trie = {**lookup(0.0, "lookup"), "name": "spectr-edge T=0 lookup, 4 candidates in one trie",
                    "config": {"temperature": 0.0, "drafter": "lookup", "k": 4}}
            out += precision_rows(INT8_BUNDLE, "int8 target") + [
                {**on_bundle(trie, str(INT8_BUNDLE), "int8 target"),
                 "own_baseline": "spectr-edge T=0 target-only [int8 target]"}]
        out += [peer("llama.cpp", "llamacpp", "Q4 target-only", 0.0), peer("ortgenai", og, "int4 target-only", 0.0)]
        if all_configs:
            out.append(peer("ortgenai", og + "+qwen0.5b-int4", "int4 + int4 draft, 4 tokens", 0.0,
                            {"speculative": "draft", "max_draft_tokens": 4}, own="int4 target-only"))
        return out
    if name in ("precisions", "w8a8"):  # issue 6's never-slower check: each target precision's default vs its
        # own target-only; w8a8 adds the int8-weights-and-activations twin, llama.cpp's Q4 and ORT GenAI's int4
        out = [spectr(0.0, 0), spectr_default(0.0)]
        for bundle, tag in ((INT8_BUNDLE, "int8 target"), (other_bundle or INT4_BUNDLE, "int4 target")):
            out += precision_rows(bundle, tag)
        if name == "w8a8":
            out += precision_rows(W8A8_BUNDLE, "w8a8 target")
            out += [peer("llama.cpp", "llamacpp", "Q4 target-only", 0.0),
                    peer("ortgenai", "ortgenai:qwen1.5b-int4", "int4 target-only", 0.0)]
        return out
    if name == "guess":     # the target's guess head (export/guess_head.py): the int4 bundle with it against
        # its twin without it (same weights, bench/README), greedy; T=1 too with --all-configs; llama.cpp's Q4
        tag_off = "int4 target, no guess head"
        out = []
        for t in ((0.0, 1.0) if all_configs else (0.0,)):
            own = f"spectr-edge T={t:g} target-only [{tag_off}]"
            out += [{**on_bundle(spectr(t, 0), str(INT4_NOHEAD_BUNDLE), tag_off), "own_baseline": None},
                    {**on_bundle(spectr_default(t), str(INT4_NOHEAD_BUNDLE), tag_off), "own_baseline": own},
                    {**on_bundle(spectr(t, 0), other_bundle or str(INT4_BUNDLE), "int4 target"), "own_baseline": own},
                    {**on_bundle(spectr_default(t), other_bundle or str(INT4_BUNDLE), "int4 target"),
                     "own_baseline": own}]
        return out + [peer("llama.cpp", "llamacpp", "Q4 target-only", 0.0)]
    if name == "trees":     # issue 5: draft trees and the tuned defaults, greedy and T=1 (tune both bundles first)
        return trees_suite(other_bundle)
    if name == "issue5":    # issue 5's table on one machine: the float32 default chain against draft trees
        # (lookup before them) and the chain with side leaves, greedy; SpecTr k = 2 and Sequoia trees against
        # the best k = 1 lengths at T=1 (tree bundles: one batch-1 call per step)
        ml = lambda label, **c: {**spectr(0.0, 1, 6, label=f"model+lookup {label}"),  # noqa: E731
                                 "config": {"temperature": 0.0, "drafter": "model+lookup", "k": 1, "L": 6, **c}}
        return [spectr(0.0, 0), spectr_default(0.0), ml("OPT-Tree 8 nodes depth<=6", stop=0.0, tree=8),
                ml("OPT-Tree 12 nodes depth<=6", stop=0.0, tree=12),
                ml("k=2 L=6 stop 0.5 (side leaves)", k=2, stop=0.5),
                spectr(1.0, 0), spectr_default(1.0), spectr(1.0, 1, 4), spectr(1.0, 2, 3),
                tree_method(1.0, 8, 4), tree_method(1.0, 12, 5)]
    if name == "policies":  # one row per decoding policy the engine has, float32 and int4 bundles: the
        # defaults, SpecTr k = 2, an OPT-Tree and a Sequoia tree (with --checkout: each also run by another
        # checkout of the code, for identical outputs and target calls, and speed side by side)
        q = lambda m: {**on_bundle(m, other_bundle or str(INT4_BUNDLE), "int4 target"),  # noqa: E731
                       "own_baseline": None if m["baseline"] else f"spectr-edge T={m['temperature']:g} target-only [int4 target]"}
        return [spectr(0.0, 0), spectr_default(0.0), tree_method(0.0, 8, 6), spectr(1.0, 0), spectr_default(1.0),
                spectr(1.0, 2, 3), tree_method(1.0, 8, 4),
                q(spectr(0.0, 0)), q(spectr_default(0.0)), q(spectr(1.0, 0)), q(spectr_default(1.0))]
    if name == "window":    # issue 6, float32 target: lookup before the model, and the draft's context window
        return [spectr(0.0, 0), model_lookup(6, window=64), model_lookup(6, window=0)]
    if name == "length":    # issue 5, float32 target: longer model+lookup drafts now that the draft is cheaper
        return [spectr(0.0, 0), spectr_default(0.0), model_lookup(8), model_lookup(10)]
    if name == "prefill":   # the prefill's LM head on the last position only vs every position (the
        # *-full-logits twins of bench/full_logits_twin.py): time to first token, float32 and int4 targets
        out = [spectr(0.0, 0), spectr_default(0.0)] + precision_rows(FULL_LOGITS, "full logits")
        out += precision_rows(other_bundle or INT4_BUNDLE, "int4 target")
        return out + precision_rows(INT4_FULL_LOGITS, "int4 target, full logits")
    raise SystemExit(f"error: unknown suite {name!r}; use issue3, default, tree, peers, adaptive, cpu, int4-calls, "
                     "int4-wide, quant-wide, precisions, w8a8, guess, trees, issue5, window, length or prefill")


def tree_method(temperature: float, budget: int, depth: int) -> dict:
    """A draft tree of `budget` nodes (greedy: OPT-Tree by path probability; T > 0: Sequoia)."""
    kind = "OPT-Tree" if temperature == 0 else "Sequoia tree"
    return {**spectr(temperature, 1, depth, label=f"{kind} {budget} nodes depth<={depth}"),
            "config": {"temperature": temperature, "k": 1, "L": depth, "stop": 0.0, "tree": budget}}


def trees_suite(int4_bundle: str | None = None) -> list[dict]:
    """Issue 5 on the float32 bundle: the tuned default against the fixed policies and the draft
    trees, greedy and T=1; plus the int4 twin's target-only and tuned default (issue 6)."""
    q = lambda m: {**on_bundle(m, int4_bundle or str(INT4_BUNDLE), "int4 target"),  # noqa: E731
                   "own_baseline": None if m["baseline"] else "spectr-edge T=0 target-only [int4 target]"}
    # "default" is what tune chose (raw.json's worker info has the manifest): on the tuned float32
    # bundle an OPT-Tree of 12 nodes (greedy) and a Sequoia tree of 8 (T=1); tree_method() rows
    # give the trees explicitly for an untuned bundle
    return [spectr(0.0, 0), spectr_default(0.0), spectr(0.0, 1, 6, stop=0.5), spectr(0.0, 3, 4),
            spectr(1.0, 0), spectr_default(1.0), spectr(1.0, 1, 3), spectr(1.0, 1, 4), spectr(1.0, 2, 2),
            q(spectr(0.0, 0)), q(spectr_default(0.0))]


def adaptive_method(L: int, stop: float = 0.0) -> dict:
    return {**spectr(0.0, 1, L, label=f"adaptive L<={L}" + (f" stop {stop:g}" if stop else "")),
            "config": {"temperature": 0.0, "k": 1, "L": L, "stop": stop, "adaptive": True}}


def cpu_suite(int4_bundle: str | None = None) -> list[dict]:
    """Issue 6's bars in one run, one group: every target precision's default against its own
    target-only, per category. The int4 bundle (block 128 with zero points, the export default
    since stop 12) greedy and T=1, plus a 1-token-call reference (plain ONNX Runtime decoding,
    other numerics than the padded calls), and its default with stop 13's library-only lookup table;
    the stop-11 int4 bundle (block 32, symmetric); the float32
    bundle; ORT GenAI's int4 target alone and with its draft; llama.cpp's Q4 decode. Tune the
    bundles first (spectr-edge tune)."""
    def q(m: dict, bundle: str = "", tag: str = "int4 target") -> dict:
        t = m["temperature"]
        return {**on_bundle(m, bundle or int4_bundle or str(INT4_BUNDLE), tag),
                "own_baseline": None if m["baseline"] else f"spectr-edge T={t:g} target-only [{tag}]"}
    og, og_d = "ortgenai:qwen1.5b-int4", "ortgenai:qwen1.5b-int4+qwen0.5b-int4"
    unpadded = {**spectr(0.0, 0, label="target-only, 1-token calls"), "baseline": False,
                "config": {"temperature": 0.0, "k": 0, "unpadded": True}}
    b32 = lambda m: q(m, str(INT4_B32_BUNDLE), "int4 block-32 target")  # noqa: E731
    # the int4 bundle of stop 13, whose lookup table had library source only (weights hard-linked):
    # what the sampled conversation in the table changed
    stdtable = [{**q(spectr_default(0.0), str(INT4_STDTABLE_BUNDLE), "int4 target, library-only table"),
                 "own_baseline": "spectr-edge T=0 target-only [int4 target]"}] if INT4_STDTABLE_BUNDLE.exists() else []
    return [q(spectr(0.0, 0)), q(spectr_default(0.0))] + stdtable + [q(unpadded),
            q(spectr(1.0, 0)), q(spectr_default(1.0)),
            b32(spectr(0.0, 0)), b32(spectr_default(0.0)),
            peer("ortgenai", og, "int4 target-only", 0.0),
            peer("ortgenai", og_d, "int4 + int4 draft, 4 tokens", 0.0, {"speculative": "draft", "max_draft_tokens": 4},
                 own="int4 target-only"),
            peer("llama.cpp", "llamacpp", "Q4 target-only", 0.0),
            spectr(0.0, 0), spectr_default(0.0)]
    # stop 13's row of the float32 target with the block-32 draft (models/default-draft-b32,
    # RESULTS section 00000) is gone: a second float32 worker beside the library-only-table int4
    # worker ran this 24 GiB machine out of memory


GGUF = Path(os.environ.get("SPECTR_GGUF_DIR", "~/.cache/spectr-edge/gguf")).expanduser()
TARGET_GGUF, DRAFT_GGUF = "Qwen2.5-Coder-1.5B-Instruct.gguf", "Qwen2.5-Coder-0.5B-Instruct.gguf"  # models/README.md
ORTGENAI = Path(os.environ.get("ORTGENAI_MODELS", "~/.cache/spectr-edge/peers/ortgenai")).expanduser()
STOP_IDS = "151645,151643"   # spectr-edge's stop ids for Qwen2.5 (<|im_end|>, <|endoftext|>); peers get the same
INT4_BUNDLE = BENCH.parent / "models" / "default-int4"
INT8_BUNDLE = BENCH.parent / "models" / "default-int8"     # bench/quant_twin.py --target-quant int8
W8A8_BUNDLE = BENCH.parent / "models" / "default-w8a8"     # bench/quant_twin.py --target-quant w8a8
FULL_LOGITS = BENCH.parent / "models" / "default-full-logits"            # bench/full_logits_twin.py
INT4_FULL_LOGITS = BENCH.parent / "models" / "default-int4-full-logits"
INT4_B32_BUNDLE = BENCH.parent / "models" / "default-int4-b32"   # the int4 layout before stop 12
INT4_STDTABLE_BUNDLE = BENCH.parent / "models" / "default-int4-stdtable"   # models/default-int4 before stop 14
INT4_NOHEAD_BUNDLE = BENCH.parent / "models" / "default-int4-nohead"   # models/default-int4 without its guess head
SETUP = {"llamacpp": "bash bench/peers/llamacpp_setup.sh", "ortgenai": "bash bench/peers/ortgenai_setup.sh"}


def in_checkout(method: dict, checkout: str, tag: str) -> dict:
    """The same spectr-edge method run by another checkout of the code (its worker and package)."""
    bundle = method.get("bundle", "")
    base = method["name"]
    own = method.get("own_baseline")
    return {**method, "name": f"{base} [{tag}]", "worker": f"spectr@{checkout}:{bundle}", "baseline": False,
            "own_baseline": f"{own} [{tag}]" if own else (None if method["baseline"] else
                                                          f"spectr-edge T={method['temperature']:g} target-only [{tag}]"),
            "checkout": checkout}


def worker_command(key: str, args) -> list[str]:
    tool, _, rest = key.partition(":")
    threads = ["--threads", str(args.threads)] if args.threads else []
    if tool.startswith("spectr@"):     # another checkout: its own worker and package (PYTHONPATH below)
        checkout = Path(tool.removeprefix("spectr@"))
        return ["env", f"PYTHONPATH={checkout}", PY, str(checkout / "bench" / "workers" / "spectr_worker.py"),
                "--bundle", rest or args.bundle] + threads
    if tool == "spectr":
        return [PY, str(BENCH / "workers" / "spectr_worker.py"), "--bundle", rest or args.bundle] + threads
    if tool == "hf":   # transformers lives in the project's [export] extra, i.e. this venv
        return [PY, str(BENCH / "workers" / "hf_worker.py"), "--target", str(GGUF / TARGET_GGUF),
                "--draft", str(GGUF / DRAFT_GGUF), "--eos-ids", STOP_IDS, "--threads", str(args.threads or 2)]
    if tool == "llamacpp":
        py = BENCH / ".venv-llamacpp" / "bin" / "python"
        return [str(py), str(BENCH / "workers" / "llamacpp_worker.py"), "--model", str(GGUF / TARGET_GGUF),
                "--draft", str(GGUF / DRAFT_GGUF), "--eos-ids", STOP_IDS, "--threads", str(args.threads or 2)]
    if tool == "ortgenai":
        py = BENCH / ".venv-ortgenai" / "bin" / "python"
        model, _, draft = rest.partition("+")
        return ([str(py), str(BENCH / "workers" / "ortgenai_worker.py"), "--model", str(ORTGENAI / model)]
                + (["--draft", str(ORTGENAI / draft)] if draft else []) + threads)
    raise SystemExit(f"error: no worker for {key!r}")


def missing_setup(key: str) -> str | None:
    """Why a peer worker cannot start (its environment or models are not set up), or None."""
    tool, _, rest = key.partition(":")
    if tool.startswith("spectr@") and not (Path(tool.removeprefix("spectr@")) / "spectr_edge").is_dir():
        return f"{tool.removeprefix('spectr@')} is not a checkout of spectr-edge"
    if tool.startswith("spectr") and rest and not (Path(rest) / "spectr.json").exists():
        if rest.endswith("-full-logits"):
            return (f"{rest} is missing; run `.venv/bin/python bench/full_logits_twin.py "
                    f"{rest.removesuffix('-full-logits')} {rest}`")
        quant = next((q for q in ("int8", "int4") if q in rest), None)
        return (f"{rest} is missing; run `.venv/bin/python bench/quant_twin.py models/default {rest} "
                f"--target-quant {quant}`" if quant else f"{rest} is missing")
    if tool in SETUP and not (BENCH / f".venv-{tool}" / "bin" / "python").exists():
        return f"bench/.venv-{tool} is missing; run `{SETUP[tool]}`"
    if tool == "ortgenai":
        for part in rest.split("+"):
            if not (ORTGENAI / part / "genai_config.json").exists():
                return f"{ORTGENAI / part} is missing; run `{SETUP[tool]}`"
    if tool in ("hf", "llamacpp") and not (GGUF / TARGET_GGUF).exists():
        return f"{GGUF / TARGET_GGUF} is missing; run scripts/setup.sh"
    return None


# -- worker processes -------------------------------------------------------------------------------
class Worker:
    def __init__(self, key: str, cmd: list[str], log):
        self.key = key
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     bufsize=1)
        hello = self._read()
        if not hello.get("ready"):
            raise SystemExit(f"error: worker {key} did not start: {hello}")
        self.info = hello["info"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: worker {self.key} exited (status {self.proc.wait()}); see log.txt")
        return json.loads(line)

    def request(self, req: dict) -> tuple[dict, int]:
        """Send one request; returns the answer and the worker's peak RSS (bytes) while it ran."""
        import psutil
        peak = [0]
        done = threading.Event()
        proc = psutil.Process(self.proc.pid)

        def watch():
            while not done.is_set():
                try:
                    peak[0] = max(peak[0], proc.memory_info().rss)
                except psutil.Error:
                    return
                done.wait(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        done.set()
        watcher.join()
        return answer, peak[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# -- the run ----------------------------------------------------------------------------------------
def start_workers(members: list[dict], args, log) -> tuple[dict, dict]:
    """Start the workers a group needs; a peer that cannot start becomes a reason in the table."""
    workers, unavailable = {}, {}
    for key in dict.fromkeys(m["worker"] for m in members):
        why = missing_setup(key)
        if why is None:
            try:
                workers[key] = Worker(key, worker_command(key, args), log)
            except SystemExit as err:   # the worker printed its traceback into log.txt
                why = str(err).removeprefix("error: ")
        if why is not None:
            print(f"warning: {key}: {why}; its rows are reported as not run", file=sys.stderr)
            unavailable[key] = f"not run: {why}"
    return workers, unavailable


def warm_up(members, workers, unavailable, prompt) -> None:
    """One short generation per method: allocations, kernel selection, first-shape costs."""
    for m in members:
        if m["worker"] in unavailable:
            continue
        answer, _ = workers[m["worker"]].request({"id": "warmup", "prompt": prompt["prompt"],
                                                  "prompt_ids": prompt["prompt_ids"], "max_new_tokens": 8,
                                                  "seed": 0, "config": m["config"]})
        if "error" in answer:
            print(f"warning: {m['name']} failed its warm-up: {answer['error']}", file=sys.stderr)


def encode_prompts(bundle: str, prompts: list[dict]) -> None:
    from spectr_edge.bundle import read_bundle
    from spectr_edge.text import TextCodec
    codec = TextCodec(read_bundle(bundle).tokenizer)
    for p in prompts:
        p["prompt_ids"] = codec.encode_prompt(p["prompt"])


def measurement(answer: dict, tool: str = "spectr-edge") -> dict:
    r = answer["result"]
    n = r["new_tokens"]
    out = dict(r)
    out["ms_per_token"] = 1000 * (r["seconds"] - r["ttft_s"]) / (n - 1) if n > 1 else None
    out["tokens_per_s"] = n / r["seconds"] if r["seconds"] > 0 else None
    calls = r.get("target_calls")
    out["tokens_per_call"] = (n - 1) / (calls - 1) if calls and calls > 1 else None
    inside = (r.get("seconds_target") or 0) + (r.get("seconds_draft") or 0)
    # only spectr-edge times its ONNX Runtime calls; a peer's seconds_target is its own forward time
    out["outside_ort"] = (1 - inside / r["seconds"] if tool == "spectr-edge" and r.get("seconds_target") is not None
                          else None)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="default")
    ap.add_argument("--name", default=None, help="results folder suffix (default: the suite)")
    ap.add_argument("--bundle", default=str(harness.ROOT / "models" / "default"))
    ap.add_argument("--prompts", default=None, help="first-N | stratified-N | ids-A,B (default per suite)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tree-bundle", default=None,
                    help="tree suite: the same bundle with tree masks; peers suite: the int4-target twin "
                         "(default models/default-int4)")
    ap.add_argument("--all-configs", action="store_true", help="issue3: also the dominated k x L rows")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens: minutes, for development")
    ap.add_argument("--checkout", default=None,
                    help="another checkout of spectr-edge (e.g. a git worktree of an earlier commit): every "
                         "spectr-edge method also runs under its code, tagged [other checkout], interleaved")
    ap.add_argument("--out", default=None, help="output folder (default bench/results/<date>-<name>)")
    args = ap.parse_args(argv)
    methods = suite(args.suite, args.all_configs, args.tree_bundle)
    if args.checkout:
        checkout = str(Path(args.checkout).resolve())
        methods = [x for m in methods for x in ([m, in_checkout(m, checkout, "other checkout")]
                                                 if m["tool"] == "spectr-edge" else [m])]
    subset = args.prompts or {"issue3": "first-20", "tree": "stratified-1", "peers": "stratified-1",
                               "adaptive": "stratified-1", "cpu": "stratified-2", "window": "stratified-2",
                               "int4-calls": "stratified-2", "length": "stratified-2",
                               "trees": "stratified-1", "issue5": "stratified-2", "int4-wide": "stratified-8", "quant-wide": "stratified-8",
                               "precisions": "stratified-2", "w8a8": "stratified-2", "prefill": "stratified-2",
                               "guess": "stratified-8", "policies": "stratified-1"}.get(
        args.suite, "stratified-4")
    if args.quick:
        subset, args.max_new_tokens = (args.prompts or "stratified-1"), 32
    prompts = harness.select_prompts(harness.load_questions(), subset)
    if args.quick:
        prompts = prompts[:2]
    name = args.name or args.suite + ("-quick" if args.quick else "")
    out = Path(args.out) if args.out else BENCH / "results" / f"{datetime.date.today()}-{name}"
    out.mkdir(parents=True, exist_ok=True)
    encode_prompts(args.bundle, prompts)
    log = open(out / "log.txt", "a")
    log.write(f"\n== {datetime.datetime.now().isoformat(timespec='seconds')} {' '.join(sys.argv)}\n")
    log.flush()

    groups: dict[str, list[dict]] = {}
    for m in methods:
        groups.setdefault(m.get("group", "main"), []).append(m)
    meta = {"command": " ".join([Path(sys.executable).name] + sys.argv), "suite": args.suite, "subset": subset,
            "max_new_tokens": args.max_new_tokens, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": harness.machine_info(), "workers": {}, "methods": methods, "groups": list(groups),
            "prompts": [{k: p[k] for k in ("id", "category", "task")} for p in prompts]}
    rows: list[dict] = []
    from tqdm import tqdm
    bar = tqdm(total=len(prompts) * len(methods), unit="gen", dynamic_ncols=True, file=sys.stderr)
    for gi, (group, members) in enumerate(groups.items()):
        workers, unavailable = start_workers(members, args, log)
        meta["workers"].update({k: w.info for k, w in workers.items()})
        try:
            warm_up(members, workers, unavailable, prompts[0])
            for i, p in enumerate(prompts):
                order = members if i % 2 == 0 else members[::-1]
                for m in order:
                    bar.set_postfix_str(f"{group}: prompt {p['id']} {m['name']}"[:70])
                    row = {"prompt_id": p["id"], "category": p["category"], "task": p["task"], "group": group,
                           "prompt_tokens": len(p["prompt_ids"]), "method": m["name"], "tool": m["tool"],
                           "temperature": m["temperature"], "config": m["config"], "peak_rss": 0}
                    if m["worker"] in unavailable:
                        row["error"] = unavailable[m["worker"]]
                    elif i >= m.get("max_prompts", len(prompts)):   # too slow to run on every prompt
                        row["error"] = f"not run after {m['max_prompts']} prompts: {m['limit_reason']}"
                    else:
                        req = {"id": f"{p['id']}:{m['name']}", "prompt": p["prompt"], "prompt_ids": p["prompt_ids"],
                               "max_new_tokens": args.max_new_tokens, "seed": 1000 + i, "config": m["config"]}
                        try:
                            answer, row["peak_rss"] = workers[m["worker"]].request(req)
                        except SystemExit as err:   # the worker died (e.g. out of memory): its rows say so
                            unavailable[m["worker"]] = f"worker crashed at prompt {p['id']}: {err}"
                            answer = {"error": unavailable[m["worker"]]}
                        row.update(measurement(answer, m["tool"]) if "result" in answer else {"error": answer["error"]})
                    rows.append(row)
                    bar.update()
                # checkpoint after every prompt: an interrupted run keeps its complete prompts and groups
                last = gi + 1 == len(groups) and i + 1 == len(prompts)
                (out / "raw.json").write_text(json.dumps({"meta": {**meta, "complete": last}, "rows": rows}, indent=1))
        finally:
            for w in workers.values():
                w.close()
    bar.close()
    import report
    report.write(out)
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main()
