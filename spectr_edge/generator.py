"""The Python API: `load()` a bundle, then `generate`, `stream` or `generate_ids`."""

from __future__ import annotations

import math
import os
import sys
import time
import zipfile
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .bundle import Bundle, read_bundle
from .engine import DecodeRequest, Engine
from . import options as check
from .errors import BundleError, InputError
from .policy import CostCurve, default_draft_cost
from .onnx_model import OnnxLM
from .sampling import SamplingParams
from .stats import GenerationStats
from .ngram_table import NgramTable
from .text import TextCodec, TextStream

# Best (num_candidates, draft_len, draft_stop) measured for the default bundle on a 2-core CPU
# (bench/RESULTS.md, 2026-11-30). Greedy: k=1 with an adaptive length up to 6 (stop below 0.5
# draft confidence) beat fixed L=3 by 5-7% in its own 10-prompt run and tied it (1.44x vs 1.47x)
# in the 20-prompt grid. Temperature 1.0: k=1 L=3, 1.49x in the 20-prompt grid, vs 1.40x for the
# best k > 1 (k=2 L=2, replicated; trie verification gains ~7% on it, which makes it a tie).
DEFAULT_GREEDY = (1, 6, 0.5)
DEFAULT_SAMPLING = (1, 3, 0.0)
DEFAULT_MAX_NEW_TOKENS = 256

DRAFTERS = ("model", "lookup", "model+lookup")
DEFAULT_ADAPTIVE = False      # policy.AdaptiveLength for k = 1 (per-step length from acceptance and cost)
DEFAULT_LOOKUP_LEN = 8        # llama.cpp / HF copy 10 tokens; the cost rule in lookup.py shortens it per step
# The draft model reads the prompt's latest 64 tokens only. Its prefill of a ~700-token prompt took
# 3.3 s with the int4 0.5B draft (a quarter of the target's): on a RAG prompt with a 21-token answer
# that made the float32 default 0.65-0.72x target-only; with 64 tokens it ran 1.27-1.77x, and on a
# long-answer RAG prompt 64 tokens drafted as well as the whole prompt. Copying a long input
# (summaries) is prompt lookup's job (bench/RESULTS.md section 000).
DEFAULT_DRAFT_WINDOW = 64
# bounds of one step: a step never drafts more tokens, rows or tree nodes than these
MAX_DRAFT_LEN, MAX_CANDIDATES, MAX_TREE = 128, 64, 1024


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


TUNED_KEYS = ("drafter", "num_candidates", "draft_len", "draft_stop", "adaptive", "tree_budget", "draft_window")


def tuned_options(bundle: Bundle, temperature: float) -> dict:
    """The decoding options `spectr-edge tune` chose for this bundle and regime (greedy when
    temperature is 0, else sampling); for an untuned bundle, the built-in choice by what the
    bundle is (builtin_options)."""
    chosen = (bundle.manifest.get("defaults") or {}).get("greedy" if temperature == 0 else "sampling") or {}
    return {k: chosen[k] for k in TUNED_KEYS if k in chosen} or builtin_options(bundle, temperature)


def builtin_options(bundle: Bundle, temperature: float) -> dict:
    """For an untuned bundle with a quantized target: prompt lookup, which `tune` chose for the
    int4, int8 and w8a8 targets on the 2-core CPUs in both regimes (a draft-model step costs half an
    int4 target step and 0.38 of an int8 one there, while verifying copied tokens is nearly
    free; bench/RESULTS.md sections 00 and 00000000). Greedy on other bundles with a draft:
    lookup before the draft model (copies long inputs the windowed draft cannot see: 1.75x and
    never slower per prompt on the float32 default bundle, section 000). Otherwise {}
    (DEFAULT_GREEDY / DEFAULT_SAMPLING)."""
    if bundle.target.quant in ("int4", "int8", "w8a8"):
        return {"drafter": "lookup", "num_candidates": 1}
    if temperature == 0 and bundle.draft is not None:
        return {"drafter": "model+lookup"}
    return {}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InputError(message)


class Generator:
    """A loaded bundle: target (and draft) sessions, tokenizer, and the decoding engine."""

    def __init__(self, bundle: Bundle, provider: str = "auto", draft_provider: str | None = None,
                 threads: int | None = None, load_draft: bool = True):
        threads = check.threads(threads)
        self.bundle = bundle
        self.codec = TextCodec(bundle.tokenizer)
        self.target = OnnxLM(bundle.target, provider, threads)
        self.draft = None
        if load_draft and bundle.draft is not None:
            self.draft = OnnxLM(bundle.draft, draft_provider or provider, threads, spinning=False)
        target_entry = bundle.manifest["models"]["target"]
        if bundle.target.quant == "int8" and bundle.target.min_call_tokens == 1:
            # int8 exported before stop 16 (quantize_dynamic): one activation scale per call
            print("spectr-edge: warning: this bundle's int8 target quantizes activations per call "
                  "(exported before 2026-12-02), so speculative output can differ from its target-only "
                  "output at near-ties; re-export with --target-quant int8", file=sys.stderr)
        cost = CostCurve.for_quant(bundle.target.quant, target_entry.get("cost_curve"))
        draft_cost, draft_rows = None, None
        if bundle.draft is not None:
            draft_entry = bundle.manifest["models"]["draft"]
            draft_cost = draft_entry.get("decode_cost")   # measured by `tune`
            if draft_cost is None:
                draft_cost = default_draft_cost(bundle.target.size_bytes, bundle.draft.size_bytes)
            draft_rows = CostCurve.for_quant(bundle.draft.quant, draft_entry.get("decode_rows_curve"))
        self.engine = Engine(self.target, self.draft, bundle.tokenizer.vocab_size, cost, draft_cost or 0.15,
                             draft_rows)
        if bundle.lookup_table is not None:
            try:
                self.engine.lookup_table = NgramTable.load(bundle.lookup_table)
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
                raise BundleError(f"the lookup table {bundle.lookup_table} is corrupt ({err}); rebuild it with "
                                  "spectr-edge export --add-lookup-table --out BUNDLE") from None

    # -- the three entry points ---------------------------------------------------------------
    def generate(self, prompt: str, **options) -> GenerationResult:
        """Generate a completion of `prompt` (chat template applied when the bundle has one)."""
        result = GenerationResult("", [])
        for _ in self._stream(prompt, result, **options):
            pass
        return result

    def stream(self, prompt: str, result: GenerationResult | None = None, **options) -> Iterator[str]:
        """Yield pieces of text as they are generated; same options as `generate`.

        Pass a GenerationResult to have it filled in (token ids, text, stats) as the stream runs."""
        yield from self._stream(prompt, result if result is not None else GenerationResult("", []), **options)

    def generate_ids(self, prompt_ids: list[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     seed: int | None = None, rng: np.random.Generator | None = None,
                     num_candidates: int | None = None, draft_len: int | None = None,
                     draft_stop: float | None = None, drafter: str | None = None,
                     adaptive: bool | None = None, tree_budget: int | None = None,
                     draft_window: int | None = None) -> GenerationResult:
        """Generate from raw token ids (no chat template, no stop strings); text is decoded for convenience."""
        result = GenerationResult("", [])
        prompt_ids = check.token_ids(prompt_ids, self.bundle.tokenizer.vocab_size)
        for tokens in self._run(prompt_ids, result.stats, max_new_tokens=max_new_tokens,
                                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, rng=rng,
                                num_candidates=num_candidates, draft_len=draft_len, draft_stop=draft_stop,
                                drafter=drafter, adaptive=adaptive, tree_budget=tree_budget,
                                draft_window=draft_window):
            result.token_ids.extend(tokens)
        result.text = self.codec.decode(result.token_ids)
        return result

    # -- internals ----------------------------------------------------------------------------
    def _stream(self, prompt: str, result: GenerationResult, *, chat: bool | None = None,
                stop: tuple[str, ...] | list[str] = (), **options) -> Iterator[str]:
        if not isinstance(prompt, str):
            raise InputError("the prompt must be a string; use generate_ids for token ids")
        if chat is not None:
            check.flag(chat, "chat")
        text = TextStream(self.codec, check.stop_strings(stop))
        steps = self._run(self.codec.encode_prompt(prompt, chat), result.stats, **options)
        try:
            for tokens in steps:
                result.token_ids.extend(tokens)
                piece = text.push(tokens)
                if piece:
                    yield piece
                if text.stopped:
                    break
        finally:
            steps.close()   # settles the timing stats even when a stop string ended it early
        if text.stopped:
            result.stats.stop_reason = "stop"
            result.token_ids[:] = text.kept_ids()    # the stop string's tokens are not part of the output
        piece = text.flush()
        result.text = text.text
        if piece:
            yield piece

    def _request(self, prompt_ids, max_new_tokens, temperature, top_k, top_p,
                 num_candidates, draft_len, draft_stop, drafter=None, adaptive=None,
                 tree_budget=None, draft_window=None) -> DecodeRequest:
        _check(len(prompt_ids) > 0, "the prompt is empty; pass at least one token")
        max_new_tokens = check.count(max_new_tokens, "max_new_tokens", 1)
        temperature = check.number(temperature, "temperature", minimum=0, fix="use 0 for greedy decoding")
        top_k = check.count(top_k, "top_k", 0, "0 turns it off")
        top_p = check.number(top_p, "top_p", above=0, maximum=1, fix="1 turns it off")
        num_candidates = None if num_candidates is None else check.count(
            num_candidates, "num_candidates", 0, "0 decodes with the target only", maximum=MAX_CANDIDATES)
        draft_len = None if draft_len is None else check.count(draft_len, "draft_len", 1, maximum=MAX_DRAFT_LEN)
        draft_stop = None if draft_stop is None else check.number(draft_stop, "draft_stop", minimum=0, fix="0 turns it off")
        tree_budget = None if tree_budget is None else check.count(tree_budget, "tree_budget", 0,
                                                                    "0 turns the dynamic tree off", maximum=MAX_TREE)
        draft_window = None if draft_window is None else check.count(
            draft_window, "draft_window", 0, "0 lets the draft read the whole prompt")
        adaptive = None if adaptive is None else check.flag(adaptive, "adaptive")
        default_k, default_len, default_stop = DEFAULT_GREEDY if temperature == 0 else DEFAULT_SAMPLING
        _check(drafter is None or drafter in DRAFTERS,
               f"unknown drafter {drafter!r}; use one of {', '.join(DRAFTERS)}")
        tuned = tuned_options(self.bundle, temperature)
        if draft_window is None:       # its own knob: the tuned or built-in window unless the caller sets one
            draft_window = tuned.get("draft_window", DEFAULT_DRAFT_WINDOW)
        _check(isinstance(draft_window, int) and draft_window >= 0,
               f"draft_window must be an integer >= 0 (got {draft_window}); 0 lets the draft read the whole prompt")
        chosen = (num_candidates, draft_len, draft_stop, drafter, adaptive, tree_budget)
        if tuned and all(v is None for v in chosen) and (
                tuned.get("drafter") == "lookup" or not tuned.get("num_candidates", 1) or self.draft is not None):
            # the tuned policy as a whole when the caller chose none of its options (any option they
            # set replaces it, the built-in defaults filling the rest)
            num_candidates, draft_len = tuned.get("num_candidates"), tuned.get("draft_len")
            draft_stop, adaptive, tree_budget = tuned.get("draft_stop"), tuned.get("adaptive"), tuned.get("tree_budget")
            drafter = tuned.get("drafter") if num_candidates != 0 else None
            if drafter == "lookup":     # its own length rule; k > 1: candidates in one trie
                draft_len = None
        if drafter == "lookup":         # prompt lookup alone: no draft model, its own length
            # k > 1: up to k copied candidates in one token trie, which needs a tree-mask target
            _check(num_candidates in (None, 1) or (isinstance(num_candidates, int) and num_candidates > 1
                                                    and self.target.takes_tree),
                   f"prompt lookup drafts several candidates (num_candidates={num_candidates}) only as one "
                   "token trie, and this bundle's target takes no tree mask; leave -k unset or run "
                   "spectr-edge export --add-tree-mask --out BUNDLE")
            num_candidates, default_len = num_candidates or 1, DEFAULT_LOOKUP_LEN
        if num_candidates is None:
            num_candidates = default_k if self.draft is not None else 0
        _check(isinstance(num_candidates, int) and num_candidates >= 0,
               f"num_candidates must be an integer >= 0 (got {num_candidates}); 0 decodes with the target only")
        _check(num_candidates == 0 or drafter == "lookup" or self.draft is not None,
               "this bundle has no draft model (or it was not loaded); use num_candidates=0 / --no-draft, "
               "--draft lookup (prompt lookup needs no draft model), or export a bundle with --draft")
        draft_len = default_len if draft_len is None else draft_len
        _check(isinstance(draft_len, int) and draft_len >= 1, f"draft_len must be an integer >= 1 (got {draft_len})")
        draft_stop = default_stop if draft_stop is None else draft_stop
        _check(0 <= draft_stop < 1, f"draft_stop must be in [0, 1) (got {draft_stop}); 0 turns it off")
        tree_budget = 0 if tree_budget is None else tree_budget
        _check(isinstance(tree_budget, int) and tree_budget >= 0,
               f"tree_budget must be an integer >= 0 (got {tree_budget}); 0 turns the dynamic tree off")
        if tree_budget:
            # model+lookup: a copied draft when the text has a match, else the draft model's tree
            _check(self.draft is not None and drafter in (None, "model", "model+lookup") and num_candidates != 0,
                   "the dynamic draft tree (tree_budget) drafts with the draft model; use --draft model or "
                   "model+lookup, not --draft lookup/--no-draft")
            _check(self.target.takes_tree and self.draft.takes_tree,
                   "the dynamic draft tree needs a bundle whose graphs take a tree mask; run "
                   "spectr-edge export --add-tree-mask --out BUNDLE")
        # a token tree's nodes attend over gaps (the other branches), which changes the attention's
        # rounding; kernels that quantize activations (int4/int8 MatMulNBits, min_call_tokens 2) turn
        # that into greedy flips at near-ties (1.5B int4 target: 3 of 12 tree generations; int8 lookup
        # trie: 4 of 12), so on such a target only chains are verified: one candidate, no tree
        if self.target.spec.min_call_tokens > 1 and (num_candidates > 1 or tree_budget):
            what = "a draft tree (tree_budget)" if tree_budget else f"k = {num_candidates} candidates (a token trie)"
            raise InputError(f"{what} is not bit-exact on this bundle's {self.target.spec.quant} target: its kernels "
                             "quantize activations and a tree changes the attention's rounding; use -k 1 "
                             "(one drafted chain) or --draft lookup")
        vocab = self.bundle.tokenizer.vocab_size
        bad = [i for i in prompt_ids if not 0 <= i < vocab]
        _check(not bad, f"prompt token id {bad[:1]} is outside the vocabulary [0, {vocab})")
        context = self.engine.context_length
        _check(len(prompt_ids) < context, f"the prompt is {len(prompt_ids)} tokens but the context is "
               f"{context}; shorten the prompt")
        return DecodeRequest(tuple(prompt_ids), max_new_tokens,
                             SamplingParams(float(temperature), int(top_k), float(top_p)),
                             num_candidates, draft_len, frozenset(self.bundle.tokenizer.eos_token_ids),
                             float(draft_stop), drafter or "model",
                             draft_len if drafter == "lookup" else max(draft_len, DEFAULT_LOOKUP_LEN),
                             # with the model to fall back on, a one-token match is too weak a signal,
                             # unless the adaptive rule weighs each match against the model
                             (1, 3) if drafter == "lookup" or adaptive else (2, 3),
                             DEFAULT_ADAPTIVE if adaptive is None else bool(adaptive), tree_budget, draft_window)

    def _run(self, prompt_ids, stats: GenerationStats, *, max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
             temperature=0.0, top_k=0, top_p=1.0, seed=None, rng=None, num_candidates=None,
             draft_len=None, draft_stop=None, drafter=None, adaptive=None,
             tree_budget=None, draft_window=None) -> Iterator[list[int]]:
        req = self._request(prompt_ids, max_new_tokens, temperature, top_k, top_p, num_candidates, draft_len,
                            draft_stop, drafter, adaptive, tree_budget, draft_window)
        rng = rng if rng is not None else np.random.default_rng(check.seed(seed))
        stats.prompt_tokens = len(prompt_ids)
        models = [m for m in (self.target, self.draft) if m is not None]
        before = [m.seconds for m in models]
        started = time.perf_counter()
        try:
            for tokens in self.engine.run(req, rng, stats):
                if stats.new_tokens == 0:
                    stats.seconds_first_token = time.perf_counter() - started
                stats.new_tokens += len(tokens)
                yield tokens
        finally:
            stats.seconds_total = time.perf_counter() - started
            stats.seconds_target = self.target.seconds - before[0]
            if self.draft is not None:
                stats.seconds_draft = self.draft.seconds - before[1]


def load(path: str | os.PathLike | None = None, provider: str = "auto", draft_provider: str | None = None,
         threads: int | None = None, load_draft: bool = True) -> Generator:
    """Load a bundle (default: models/default) with the given execution providers."""
    return Generator(read_bundle(path), provider, draft_provider, threads, load_draft)
