"""The benchmark's suites: which methods (tool x configuration x bundle) one run compares.

A method is a dict: name, tool, worker (the process that runs it, bench/workers/), config (what the
worker is asked: temperature, k, L, ...), temperature, baseline (spectr-edge's target-only of the
run's main bundle), own_baseline (the name of the method it is compared with besides that: a peer's
own target-only, or another bundle's), group (methods that must fit in memory together).

    default      target-only against the shipped defaults, greedy and at temperature 1
    policies     every decoding policy of the engine on the float32 and int4 bundles (defaults, SpecTr
                 k = 2, an OPT-Tree, a Sequoia tree)
    precisions   every target precision's default against its own target-only, llama.cpp's Q4 decode
                 and ORT GenAI's int4 target
    int4-peers   the int4 bundle's default and its draft model against its target-only and llama.cpp's Q4
                 decode (48 prompts)
    int4-tuned   the int4 bundle's default as shipped against a copy tuned on this machine (--int4-bundle,
                 after `spectr-edge tune`), both against the same target-only and llama.cpp's Q4 decode
    spectr-grid  SpecTr's k x L grid, greedy and at temperature 1
    trees        the float32 default chain against OPT-Trees and side leaves (greedy); k = 1 against
                 SpecTr k = 2 and Sequoia trees (temperature 1)
    guess        the int4 bundle with and without the target's guess head
    guess-chain  the int4 bundle's default with the guess head's chain against its twin drafting one guess per
                 step (bench/guess_chain_twin.py: BUNDLE-one-guess), both against the same target-only, and
                 llama.cpp's Q4 decode; --int4-bundle B measures B (any quantized target with a chain)
    guess-training  the int4 bundle's default against a twin whose guess head was trained in another time
                 budget (--int4-bundle B: `spectr-edge export --add-guess-head --guess-head-minutes M --out B`
                 on a twin), both against B's target-only (the same target graph), and llama.cpp's Q4 decode
    prefill      the LM head on the prefill's last position only, against every position (TTFT)
    peers        spectr-edge against ORT GenAI, transformers' assisted generation and llama.cpp
    gpu          target-only, chains, SpecTr k = 4 and draft trees of 16-32 nodes (run with --provider cuda)
    adaptation   the float32 default with its draft and with the draft adapted by bench/draft_adaptation.py
                 (same target: both against the one target-only)
"""

from __future__ import annotations

import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent
MODELS = BENCH.parent / "models"
INT4_BUNDLE = MODELS / "default-int4"               # bench/quant_twin.py --target-quant int4
INT8_BUNDLE = MODELS / "default-int8"               # bench/quant_twin.py --target-quant int8
W8A8_BUNDLE = MODELS / "default-w8a8"               # bench/quant_twin.py --target-quant w8a8
INT4_NOHEAD_BUNDLE = MODELS / "default-int4-nohead"  # the int4 twin without its guess head
INT4_ONE_GUESS_BUNDLE = MODELS / "default-int4-one-guess"   # bench/guess_chain_twin.py: no chain graph
ADAPTED = MODELS / "default-adapted"                # bench/draft_adaptation.py
FULL_LOGITS = MODELS / "default-full-logits"        # bench/full_logits_twin.py
INT4_FULL_LOGITS = MODELS / "default-int4-full-logits"
# new prompts of draft_adaptation.py's domain (German answers; none of them recorded) and of plain traffic
ADAPTATION_PROMPTS = ("de:ids-141,145,149,153,157,381,385,389,393,397,451,457,463,469,475"
                      "+ids-101,161,241,481")
PROMPTS = {"adaptation": ADAPTATION_PROMPTS, "spectr-grid": "first-20", "peers": "stratified-1",
           "policies": "stratified-1", "trees": "stratified-2",
           "int4-peers": "stratified-8", "int4-tuned": "stratified-2", "precisions": "stratified-2",
           "prefill": "stratified-2", "guess": "stratified-8", "guess-chain": "stratified-2",
           "guess-training": "stratified-2"}   # each suite's Spec-Bench prompts (default stratified-4)


# -- methods --------------------------------------------------------------------------------------
def spectr(temperature: float, k: int, L: int = 0, stop: float | None = None, label: str | None = None,
           **config) -> dict:
    """spectr-edge with k candidates of L tokens (k = 0: target-only); more config keys as given."""
    cfg = {"temperature": temperature, "k": k}
    if k:
        cfg["L"] = L
        cfg["stop"] = 0.0 if stop is None else stop
    cfg.update(config)
    if label is None:
        label = "target-only" if k == 0 else f"k={k} L={L}" + (f" draft_stop={stop:g}" if stop else "")
    return {"name": f"spectr-edge T={temperature:g} {label}", "tool": "spectr-edge", "worker": "spectr",
            "config": cfg, "temperature": temperature, "baseline": k == 0}


def spectr_default(temperature: float) -> dict:
    """The shipped defaults (no drafting option passed: what `spectr-edge generate` does)."""
    return {"name": f"spectr-edge T={temperature:g} default", "tool": "spectr-edge", "worker": "spectr",
            "config": {"temperature": temperature}, "temperature": temperature, "baseline": False}


def lookup(temperature: float, drafter: str) -> dict:
    """Prompt lookup, alone or before the draft model; default lengths."""
    return {"name": f"spectr-edge T={temperature:g} {drafter}", "tool": "spectr-edge", "worker": "spectr",
            "config": {"temperature": temperature, "drafter": drafter}, "temperature": temperature,
            "baseline": False}


def tree_method(temperature: float, budget: int, depth: int, **config) -> dict:
    """A draft tree of `budget` nodes (greedy: OPT-Tree by path probability; T > 0: Sequoia)."""
    kind = "OPT-Tree" if temperature == 0 else "Sequoia tree"
    prefix = "model+lookup " if config.get("drafter") == "model+lookup" else ""
    return spectr(temperature, 1, depth, label=f"{prefix}{kind} {budget} nodes depth<={depth}", tree=budget, **config)


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


def on_bundle(method: dict, bundle, tag: str) -> dict:
    """The same method on another bundle (its own worker), named with a tag, compared with that
    bundle's own target-only at the same temperature."""
    own = None if method["baseline"] else f"spectr-edge T={method['temperature']:g} target-only [{tag}]"
    return {**method, "name": f"{method['name']} [{tag}]", "worker": f"spectr:{bundle}", "bundle": str(bundle),
            "baseline": False, "own_baseline": own}


def precision_rows(bundle, tag: str) -> list[dict]:
    """Greedy target-only and default on another bundle."""
    return [on_bundle(spectr(0.0, 0), bundle, tag), on_bundle(spectr_default(0.0), bundle, tag)]


LLAMACPP_Q4 = lambda t=0.0: peer("llama.cpp", "llamacpp", "Q4 target-only", t)  # noqa: E731
ORTGENAI_INT4 = lambda t=0.0: peer("ortgenai", "ortgenai:qwen1.5b-int4", "int4 target-only", t)  # noqa: E731


def slow(method: dict) -> dict:
    """ORT GenAI 0.18's speculative decoding at T > 0 runs at ~2-3 s/token on a 2-core CPU (greedy is
    normal): those rows run on the first prompt only."""
    if not method["temperature"]:
        return method
    return {**method, "max_prompts": 1,
            "limit_reason": "ORT GenAI 0.18 speculative sampling takes ~2-3 s/token at T=1 on a 2-core CPU"}


# -- suites ---------------------------------------------------------------------------------------
def peers_suite(int4_bundle) -> list[dict]:
    """spectr-edge against the tools users pick instead, in memory-sized groups: spectr-edge's
    target-only, k = 1 L = 3, the defaults, SpecTr k = 2 / 4; the int4 twin; ORT GenAI (fp32 and int4
    targets, its int4 draft of 4 tokens), transformers' assisted generation (its defaults, and 3
    tokens), llama.cpp (Q4: target-only, its prompt lookup, a 0.5B draft of 3 tokens)."""
    og_d = "ortgenai:qwen1.5b-int4+qwen0.5b-int4"
    ogf, ogf_d = "ortgenai:qwen1.5b-fp32", "ortgenai:qwen1.5b-fp32+qwen0.5b-int4"
    groups: dict[str, list[dict]] = {"main": [], "hf": [], "ortgenai-fp32": [], "ortgenai-fp32-draft": []}
    for t in (0.0, 1.0):
        anchor = spectr(t, 0)
        groups["main"] += [anchor, spectr(t, 1, 3)]
        groups["main"] += [spectr_default(0.0), lookup(0.0, "lookup")] if t == 0 else [spectr(t, 2, 2), spectr(t, 4, 2)]
        q = lambda m: on_bundle(m, int4_bundle, "int4 target")  # noqa: E731
        groups["main"] += [q(spectr(t, 0)), q(spectr(t, 1, 3))] + ([q(lookup(t, "lookup"))] if t == 0 else [])
        groups["main"] += [ORTGENAI_INT4(t),
                           slow(peer("ortgenai", og_d, "int4 + int4 draft, 4 tokens", t,
                                     {"speculative": "draft", "max_draft_tokens": 4}, own="int4 target-only")),
                           LLAMACPP_Q4(t)]
        if t == 0:
            groups["main"].append(
                peer("llama.cpp", "llamacpp", "Q4 prompt lookup", t,
                     {"speculative": "prompt_lookup", "num_pred_tokens": 10, "max_ngram_size": 2}, own="Q4 target-only"))
        groups["main"] += [peer("llama.cpp", "llamacpp", "Q4 + Q4 draft, 3 tokens", t,
                                {"speculative": "draft_model", "num_draft": 3}, own="Q4 target-only")]
        # transformers runs at ~0.4-0.8 s/token: its T=1 rows and the 3-token variant run on 3 prompts
        few = dict(max_prompts=3, limit_reason="transformers takes ~0.4-0.8 s/token; 3 prompts keep the run near an hour")
        groups["hf"] += [anchor, peer("transformers", "hf", "fp32 target-only", t, **(few if t else {})),
                         peer("transformers", "hf", "fp32 assisted (library defaults)", t, {"assistant": True},
                              own="fp32 target-only", **(few if t else {}))]
        if t == 0:
            groups["hf"].append(peer("transformers", "hf", "fp32 assisted, 3 tokens", t,
                                     {"assistant": True, "num_assistant_tokens": 3, "schedule": "constant"},
                                     own="fp32 target-only", **few))
        # spectr-edge's and ORT GenAI's float32 1.5B models (~6.5 GiB each) do not fit three at a time
        groups["ortgenai-fp32"] += [anchor, peer("ortgenai", ogf, "fp32 target-only", t)]
        groups["ortgenai-fp32-draft"] += [anchor, slow(peer("ortgenai", ogf_d, "fp32 + int4 draft, 4 tokens", t,
                                                            {"speculative": "draft", "max_draft_tokens": 4},
                                                            own="fp32 target-only"))]
    return [{**m, "group": g} for g, ms in groups.items() for m in ms]


def _manifest(bundle) -> dict:
    """The bundle's manifest, {} when it cannot be read (yet)."""
    try:
        return json.loads((Path(bundle) / "spectr.json").read_text())
    except (OSError, ValueError):
        return {}


def _target_quant(bundle) -> str:
    """The bundle's target precision as its manifest names it (int4 when it cannot be read yet)."""
    target = _manifest(bundle).get("models", {}).get("target")
    return target.get("quant", "none") if target else "int4"


def _head_positions(bundle) -> str:
    """"head of N positions": what the bundle's guess head was trained and held out on."""
    head = _manifest(bundle).get("guess_head")
    return f"head of {head['train_positions'] + head['heldout_positions']:,} positions" if head else "no guess head"


def suite(name: str, all_configs: bool = False, other_bundle: str | None = None,
          adapted: list | None = None) -> list[dict]:
    """The methods of suite `name`; other_bundle replaces the int4 twin where a suite uses one; adapted:
    the bundles whose adapted drafts the adaptation suite compares (default models/default-adapted)."""
    int4 = other_bundle or INT4_BUNDLE
    q = lambda m: on_bundle(m, int4, "int4 target")  # noqa: E731
    if name == "default":
        return [spectr(0.0, 0), spectr_default(0.0), spectr(1.0, 0), spectr_default(1.0)]
    if name == "policies":
        return [spectr(0.0, 0), spectr_default(0.0), tree_method(0.0, 8, 6), spectr(1.0, 0), spectr_default(1.0),
                spectr(1.0, 2, 3), tree_method(1.0, 8, 4),
                q(spectr(0.0, 0)), q(spectr_default(0.0)), q(spectr(1.0, 0)), q(spectr_default(1.0))]
    if name == "precisions":
        out = [spectr(0.0, 0), spectr_default(0.0)]
        for bundle, tag in ((INT8_BUNDLE, "int8 target"), (int4, "int4 target"), (W8A8_BUNDLE, "w8a8 target")):
            out += precision_rows(bundle, tag)
        return out + [LLAMACPP_Q4(), ORTGENAI_INT4()]
    if name == "int4-peers":   # + the draft model before prompt lookup, the drafter the default does not use
        return precision_rows(int4, "int4 target") + [q(lookup(0.0, "model+lookup")), LLAMACPP_Q4(), ORTGENAI_INT4()]
    if name == "int4-tuned":    # the tuned copy's default against the shipped one's, one target-only for both
        shipped = on_bundle(spectr_default(0.0), INT4_BUNDLE, "int4 target, as shipped")
        shipped["own_baseline"] = "spectr-edge T=0 target-only [int4 target]"
        return precision_rows(int4, "int4 target") + [shipped, LLAMACPP_Q4()]
    if name == "spectr-grid":   # k in {1,2,4} x L in {2,3,4,6}, greedy and T=1, plus the defaults
        out = [spectr(0.0, 0)] + [spectr(0.0, 1, L) for L in (2, 3, 4, 6)] + [spectr_default(0.0)]
        out += [spectr(1.0, 0)] + [spectr(1.0, 1, L) for L in (2, 3, 4, 6)]
        out += [spectr(1.0, 2, L) for L in (2, 3, 4)] + [spectr(1.0, 4, L) for L in (2, 3)]
        if all_configs:          # dominated in every run so far, and the slowest rows
            out += [spectr(1.0, 2, 6), spectr(1.0, 4, 4), spectr(1.0, 4, 6)]
        return out
    if name == "trees":
        ml = dict(drafter="model+lookup", stop=0.0)
        return [spectr(0.0, 0), spectr_default(0.0), tree_method(0.0, 8, 6, **ml), tree_method(0.0, 12, 6, **ml),
                spectr(0.0, 1, 6, stop=0.5, label="model+lookup side leaves, 2 branches L=6 draft_stop=0.5",
                       drafter="model+lookup", branches=2),
                spectr(1.0, 0), spectr_default(1.0), spectr(1.0, 1, 4), spectr(1.0, 2, 3),
                tree_method(1.0, 8, 4), tree_method(1.0, 12, 5)]
    if name == "guess":         # the int4 bundle with its guess head against its twin without it
        tag_off = "int4 target, no guess head"
        out = []
        for t in ((0.0, 1.0) if all_configs else (0.0,)):
            off = lambda m: on_bundle(m, INT4_NOHEAD_BUNDLE, tag_off)  # noqa: E731
            on = {**q(spectr_default(t)), "own_baseline": f"spectr-edge T={t:g} target-only [{tag_off}]"}
            out += [off(spectr(t, 0)), off(spectr_default(t)), q(spectr(t, 0)), on]
        return out + [LLAMACPP_Q4()]
    if name == "guess-chain":   # the same head's chain against its first guess alone, one target-only for both
        twin = INT4_ONE_GUESS_BUNDLE if other_bundle is None else Path(f"{other_bundle}-one-guess")
        tag = f"{_target_quant(int4)} target"
        one = {**on_bundle(spectr_default(0.0), twin, f"{tag}, one guess per step"),
               "own_baseline": f"spectr-edge T=0 target-only [{tag}]"}
        return precision_rows(int4, tag) + [one, LLAMACPP_Q4()]
    if name == "guess-training":   # two heads of one target: B's (--int4-bundle) and the int4 bundle's
        if other_bundle is None:
            raise SystemExit("error: --suite guess-training compares --int4-bundle B (the int4 bundle's twin with its "
                             "guess head retrained) with the int4 bundle; give --int4-bundle")
        tag = f"{_target_quant(int4)} target"
        own = f"spectr-edge T=0 target-only [{tag}]"
        mine = {**on_bundle(spectr_default(0.0), int4, f"{tag}, {_head_positions(int4)}"), "own_baseline": own}
        theirs = {**on_bundle(spectr_default(0.0), INT4_BUNDLE, f"{tag}, {_head_positions(INT4_BUNDLE)}"),
                  "own_baseline": own}
        return [on_bundle(spectr(0.0, 0), int4, tag), mine, theirs, LLAMACPP_Q4()]
    if name == "prefill":       # the *-full-logits twins of bench/full_logits_twin.py
        return ([spectr(0.0, 0), spectr_default(0.0)] + precision_rows(FULL_LOGITS, "full logits")
                + precision_rows(int4, "int4 target") + precision_rows(INT4_FULL_LOGITS, "int4 target, full logits"))
    if name == "peers":
        return peers_suite(int4)
    if name == "adaptation":
        bundles = [Path(b) for b in adapted or [ADAPTED]]
        tag = lambda b: "adapted draft" if len(bundles) == 1 else f"adapted draft: {b.name}"  # noqa: E731
        return [spectr(0.0, 0), spectr_default(0.0)] + [
            {**on_bundle(spectr_default(0.0), b, tag(b)), "own_baseline": "spectr-edge T=0 target-only"}
            for b in bundles]
    if name == "gpu":           # what a GPU changes: wide verification at about the cost of one decode
        return [spectr(0.0, 0), spectr(0.0, 1, 6), spectr_default(0.0), tree_method(0.0, 16, 6),
                tree_method(0.0, 32, 8), spectr(1.0, 0), spectr(1.0, 1, 4), spectr(1.0, 4, 4),
                tree_method(1.0, 16, 5), tree_method(1.0, 32, 6)]
    raise SystemExit(f"error: unknown suite {name!r}; use one of default, policies, precisions, int4-peers, "
                     "int4-tuned, spectr-grid, trees, guess, guess-chain, guess-training, prefill, peers, gpu, adaptation")
