"""The decoding options as one validated object (DecodeOptions, resolve), and the checks for every
value that enters from outside (CLI options, API arguments): type and range, once, where it enters. Each failure is an InputError (a ValueError) whose one line names the
field, what it got and the fix.

NumPy integers count as integers and NumPy floats as numbers; bool is never a count; a float is
never silently truncated to an integer.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from dataclasses import dataclass

from .errors import InputError
from .sampling import SamplingParams


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def count(value, name: str, minimum: int = 0, fix: str = "", maximum: int | None = None) -> int:
    """An integer in [minimum, maximum]: int or NumPy integer, not bool, not float."""
    ok = not isinstance(value, bool)
    if ok:
        try:
            value = operator.index(value)
        except TypeError:
            ok = False
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if not ok or value < minimum or (maximum is not None and value > maximum):
        raise InputError(f"{name} must be an integer {bound} (got {_shown(value)})" + (f"; {fix}" if fix else ""))
    return int(value)


def number(value, name: str, fix: str = "", minimum: float | None = None, maximum: float | None = None,
           above: float | None = None) -> float:
    """A finite real number (int, float or NumPy number, not bool) with the given bounds."""
    parts = [f"> {above:g}" if above is not None else (f">= {minimum:g}" if minimum is not None else ""),
             f"<= {maximum:g}" if maximum is not None else ""]
    bound = " and ".join(p for p in parts if p)
    if above is not None and maximum is not None:
        bound = f"in ({above:g}, {maximum:g}]"
    elif minimum is not None and maximum is not None:
        bound = f"in [{minimum:g}, {maximum:g}]"
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not is_number or not math.isfinite(float(value)):
        what = "a finite number" + (f" {bound}" if bound else "")
        raise InputError(f"{name} must be {what} (got {_shown(value)})" + (f"; {fix}" if fix else ""))
    value = float(value)
    if ((minimum is not None and value < minimum) or (maximum is not None and value > maximum)
            or (above is not None and not value > above)):
        raise InputError(f"{name} must be {bound} (got {_shown(value)})" + (f"; {fix}" if fix else ""))
    return value


def flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be true or false (got {_shown(value)})")
    return value


def token_ids(values, vocab_size: int, name: str = "prompt token id") -> list[int]:
    """Token ids: integers in [0, vocab_size) (a float id is refused, not truncated)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InputError(f"the prompt ids must be a sequence of integers (got {type(values).__name__})")
    out = []
    for value in values:
        if isinstance(value, bool):
            raise InputError(f"{name} {value!r} is a bool; pass integers in [0, {vocab_size})")
        try:
            tok = operator.index(value)
        except TypeError:
            raise InputError(f"{name} {_shown(value)} is not an integer; pass integers in [0, {vocab_size})") from None
        if not 0 <= tok < vocab_size:
            raise InputError(f"{name} {tok} is outside the vocabulary [0, {vocab_size})")
        out.append(int(tok))
    return out


def seed(value) -> int | None:
    """None or -1 (llama.cpp's spelling): a fresh random seed; else an integer >= 0."""
    if value is None:
        return None
    value = count(value, "seed", minimum=-1, fix="omit it (or pass -1) for a random seed")
    return None if value == -1 else value


def stop_strings(value) -> tuple[str, ...]:
    """One stop string or a sequence of them (a str is one stop string, never its characters)."""
    from .text import check_text

    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise InputError(f"stop must be a string or a list of strings (got {type(value).__name__})")
    return tuple(check_text(s, "a stop string") for s in value)


def threads(value) -> int | None:
    """Intra-op threads per session: None or 0 = ONNX Runtime's choice, else 1..this machine's cores."""
    if value is None:
        return None
    cores = os.cpu_count() or 1
    value = count(value, "threads", minimum=0, maximum=cores,
                  fix=f"this machine has {cores} cores; omit it (or 0) for ONNX Runtime's choice")
    return value or None


# -- the decoding options, as one validated object ----------------------------------------------------

DRAFTERS = ("none", "model", "lookup", "model+lookup")
DEFAULT_MAX_NEW_TOKENS = 256
# Best (num_candidates, draft_len, draft_stop) measured for the default bundle on 2-core CPUs: greedy,
# one chain of up to 6 tokens that stops below 0.5 draft confidence; temperature 1, one chain of 3
# (SpecTr k > 1 verifies only ~11% more tokens per call there and costs more; docs/PERFORMANCE.md)
DEFAULT_GREEDY = (1, 6, 0.5)
DEFAULT_SAMPLING = (1, 3, 0.0)
DEFAULT_LOOKUP_LEN = 8        # llama.cpp / HF copy 10 tokens; the cost rule in lookup.py shortens it per step
# The draft model reads the prompt's latest 64 tokens only: its prefill of a ~700-token prompt took
# 3.3 s with the int4 0.5B draft (a quarter of the target's); copying a long input is prompt lookup's job
DEFAULT_DRAFT_WINDOW = 64
# bounds of one step: a step never drafts more tokens, rows or tree nodes than these
MAX_DRAFT_LEN, MAX_CANDIDATES, MAX_TREE = 128, 64, 1024
# the options that make up a decoding policy (what `spectr-edge tune` chooses and stores)
POLICY_KEYS = ("drafter", "num_candidates", "branches", "lookup_candidates", "draft_len", "draft_stop",
               "adaptive", "tree_budget")
TUNED_KEYS = POLICY_KEYS + ("draft_window",)


@dataclass(frozen=True)
class DecodeOptions:
    """Everything one generation decodes with, validated and resolved against the bundle. Each
    option means one thing whatever the others are:

    drafter            none (target only) | model | lookup (prompt lookup) | model+lookup (lookup when the
                       text has a match, the model otherwise)
    num_candidates     SpecTr's k: i.i.d. continuations the draft model samples per step, verified
                       together by k-SEQ (temperature 0: they coincide, one chain is drafted)
    branches           temperature 0, tree targets: the draft's greedy chain plus its next-best
                       branches - 1 tokens at every depth as extra leaves
    lookup_candidates  prompt lookup: copied continuations verified together as one token trie
    draft_len          the most tokens a step drafts per candidate (a draft tree's depth)
    draft_stop         stop drafting once the draft's probability of its own token is below this
    adaptive           choose each step's draft length (0 included) from acceptance and the cost curve
    tree_budget        the draft model drafts a tree of this many nodes (greedy: OPT-Tree; sampling: Sequoia)
    draft_window       the draft model reads the prompt's latest tokens only (0 = all)
    """
    max_new_tokens: int
    sampling: SamplingParams
    drafter: str = "model"
    num_candidates: int = 1
    branches: int = 1
    lookup_candidates: int = 1
    draft_len: int = 6
    draft_stop: float = 0.0
    adaptive: bool = False
    tree_budget: int = 0
    draft_window: int = DEFAULT_DRAFT_WINDOW

    @property
    def lookup_len(self) -> int:
        """The most copied tokens a prompt-lookup step verifies."""
        return self.draft_len if self.drafter == "lookup" else max(self.draft_len, DEFAULT_LOOKUP_LEN)

    @property
    def lookup_ngram(self) -> tuple[int, int]:
        """(min, max) n-gram size prompt lookup matches: with the model to fall back on, a one-token
        match is too weak a signal, unless the adaptive rule weighs each match against the model."""
        return (1, 3) if self.drafter == "lookup" or self.adaptive else (2, 3)


def tuned_options(bundle, temperature: float) -> dict:
    """The decoding policy `spectr-edge tune` chose for this bundle and regime (greedy when
    temperature is 0, else sampling); for an untuned bundle, builtin_options."""
    chosen = (bundle.manifest.get("defaults") or {}).get("greedy" if temperature == 0 else "sampling") or {}
    return {k: chosen[k] for k in TUNED_KEYS if k in chosen} or builtin_options(bundle, temperature)


def builtin_options(bundle, temperature: float) -> dict:
    """For an untuned bundle with a quantized target: prompt lookup, which `tune` chose for the int4,
    int8 and w8a8 targets on 2-core CPUs in both regimes (a draft-model step costs half an int4 target
    step there, while verifying copied tokens is nearly free). Greedy on other bundles with a draft:
    lookup before the draft model (it copies long inputs the windowed draft cannot see). Otherwise {}
    (DEFAULT_GREEDY / DEFAULT_SAMPLING)."""
    if bundle.target.quant in ("int4", "int8", "w8a8"):
        return {"drafter": "lookup", "num_candidates": 1}
    if temperature == 0 and bundle.draft is not None:
        return {"drafter": "model+lookup"}
    return {}


def _given(value, check_fn, *args, **kwargs):
    return None if value is None else check_fn(value, *args, **kwargs)


def resolve(bundle, *, has_draft: bool, target_tree: bool, draft_tree: bool, min_call_tokens: int,
            max_new_tokens=DEFAULT_MAX_NEW_TOKENS, temperature=0.0, top_k=0, top_p=1.0, presence_penalty=0.0,
            frequency_penalty=0.0, repetition_penalty=1.0, drafter=None,
            num_candidates=None, branches=None, lookup_candidates=None, draft_len=None, draft_stop=None,
            adaptive=None, tree_budget=None, draft_window=None) -> DecodeOptions:
    """The DecodeOptions of one generation: each given value checked (type, range), then the policy
    the caller chose, else the tuned one (when the caller set none of POLICY_KEYS), else the built-in
    defaults; combinations the bundle cannot run are refused in one line naming the fix."""
    max_new_tokens = count(max_new_tokens, "max_new_tokens", 1)
    temperature = number(temperature, "temperature", minimum=0, fix="use 0 for greedy decoding")
    sampling = SamplingParams(temperature, count(top_k, "top_k", 0, "0 turns it off"),
                              number(top_p, "top_p", above=0, maximum=1, fix="1 turns it off"),
                              number(presence_penalty, "presence_penalty", minimum=-2, maximum=2, fix="0 turns it off"),
                              number(frequency_penalty, "frequency_penalty", minimum=-2, maximum=2,
                                     fix="0 turns it off"),
                              number(repetition_penalty, "repetition_penalty", above=0, fix="1 turns it off"))
    if drafter is not None and drafter not in DRAFTERS:
        raise InputError(f"unknown drafter {drafter!r}; use one of {', '.join(DRAFTERS)}")
    num_candidates = _given(num_candidates, count, "num_candidates", 0, "0 decodes with the target only",
                            maximum=MAX_CANDIDATES)
    branches = _given(branches, count, "branches", 1, "1 drafts the chain alone", maximum=MAX_CANDIDATES)
    lookup_candidates = _given(lookup_candidates, count, "lookup_candidates", 1, maximum=MAX_CANDIDATES)
    draft_len = _given(draft_len, count, "draft_len", 1, maximum=MAX_DRAFT_LEN)
    draft_stop = _given(draft_stop, number, "draft_stop", minimum=0, fix="0 turns it off")
    adaptive = _given(adaptive, flag, "adaptive")
    tree_budget = _given(tree_budget, count, "tree_budget", 0, "0 turns the draft tree off", maximum=MAX_TREE)
    draft_window = _given(draft_window, count, "draft_window", 0, "0 lets the draft read the whole prompt")

    greedy = sampling.greedy
    default_k, default_len, default_stop = DEFAULT_GREEDY if greedy else DEFAULT_SAMPLING
    tuned = tuned_options(bundle, temperature)
    if draft_window is None:       # its own knob: the tuned or built-in window unless the caller sets one
        draft_window = count(tuned.get("draft_window", DEFAULT_DRAFT_WINDOW), "tuned draft_window", 0)
    chosen = (drafter, num_candidates, branches, lookup_candidates, draft_len, draft_stop, adaptive, tree_budget)
    if tuned and all(v is None for v in chosen) and (
            tuned.get("drafter") == "lookup" or not tuned.get("num_candidates", 1) or has_draft):
        # the tuned policy as a whole when the caller chose none of its options (any option they
        # set replaces it, the built-in defaults filling the rest)
        num_candidates, branches = tuned.get("num_candidates"), tuned.get("branches")
        lookup_candidates, draft_len = tuned.get("lookup_candidates"), tuned.get("draft_len")
        draft_stop, adaptive, tree_budget = tuned.get("draft_stop"), tuned.get("adaptive"), tuned.get("tree_budget")
        drafter = tuned.get("drafter") if num_candidates != 0 else "none"
        if drafter == "lookup":     # its own length rule
            draft_len = None
    if num_candidates is None and drafter is None and not has_draft:
        num_candidates = 0                       # a bundle without a draft decodes with its target alone
    if drafter == "none" or num_candidates == 0:
        if drafter not in (None, "none"):
            raise InputError(f"num_candidates=0 (target only) contradicts drafter={drafter!r}; pick one")
        return DecodeOptions(max_new_tokens, sampling, "none", 0, draft_window=draft_window)
    if drafter == "lookup":
        if num_candidates not in (None, 1):
            raise InputError(f"num_candidates is SpecTr's k for the draft model; prompt lookup's copied "
                             f"candidates are lookup_candidates={num_candidates} (--lookup-candidates "
                             f"{num_candidates})")
        num_candidates, default_len = 1, DEFAULT_LOOKUP_LEN
    elif lookup_candidates not in (None, 1):
        raise InputError("lookup_candidates (copied candidates in one trie) needs drafter='lookup' "
                         "(--draft lookup)")
    if drafter is None:
        drafter = "model"
    if num_candidates is None:
        num_candidates = default_k
    uses_model = drafter in ("model", "model+lookup")
    if uses_model and not has_draft:
        raise InputError("this bundle has no draft model (or it was not loaded); use num_candidates=0 / "
                         "--no-draft, --draft lookup (prompt lookup needs no draft model), or export a bundle "
                         "with --draft")
    draft_len = default_len if draft_len is None else draft_len
    draft_stop = default_stop if draft_stop is None else draft_stop
    if not draft_stop < 1:
        raise InputError(f"draft_stop must be in [0, 1) (got {draft_stop:g}); 0 turns it off")
    branches, lookup_candidates = branches or 1, lookup_candidates or 1
    tree_budget = tree_budget or 0
    if branches > 1:
        if not greedy:
            raise InputError("branches (the draft's next-best tokens as extra leaves) applies at temperature 0; "
                             "at temperature > 0 use num_candidates (SpecTr's k) or tree_budget (a Sequoia tree)")
        if not target_tree:
            raise InputError("branches needs a bundle whose target takes a tree mask; run "
                             "spectr-edge export --add-tree-mask --out BUNDLE")
        if tree_budget:
            raise InputError("give either branches (side leaves on the draft's chain) or tree_budget "
                             "(a draft tree), not both")
    if lookup_candidates > 1 and not target_tree:
        raise InputError(f"prompt lookup verifies several candidates (lookup_candidates={lookup_candidates}) only "
                         "as one token trie, and this bundle's target takes no tree mask; leave it unset or run "
                         "spectr-edge export --add-tree-mask --out BUNDLE")
    if adaptive and uses_model and (tree_budget or branches > 1 or (num_candidates > 1 and not greedy)):
        raise InputError("adaptive chooses the length of one drafted chain; it does not combine with "
                         "tree_budget, branches or num_candidates > 1")
    if tree_budget:
        if not uses_model:
            raise InputError("the draft tree (tree_budget) drafts with the draft model; use --draft model or "
                             "model+lookup, not --draft lookup/--no-draft")
        if not (target_tree and draft_tree):
            raise InputError("the draft tree needs a bundle whose graphs take a tree mask; run "
                             "spectr-edge export --add-tree-mask --out BUNDLE")
    # a token tree's nodes attend over gaps (the other branches), which changes the attention's
    # rounding; kernels that quantize activations (int4/int8 MatMulNBits, min_call_tokens 2) turn that
    # into greedy flips at near-ties, so on such a target only chains are verified
    if min_call_tokens > 1:
        what = ("a draft tree (tree_budget)" if tree_budget else f"branches = {branches}" if branches > 1 else
                f"lookup_candidates = {lookup_candidates} (a token trie)" if lookup_candidates > 1 else
                f"k = {num_candidates} candidates (a token trie)" if num_candidates > 1 and not greedy else None)
        if what:
            raise InputError(f"{what} is not bit-exact on this bundle's quantized target: its kernels quantize "
                             "activations and a tree changes the attention's rounding; use -k 1 (one drafted "
                             "chain) or --draft lookup")
    return DecodeOptions(max_new_tokens, sampling, drafter, num_candidates, branches, lookup_candidates,
                         draft_len, float(draft_stop), bool(adaptive), tree_budget, draft_window)


ROLES = ("system", "developer", "user", "assistant", "tool")


def messages(value) -> list[dict]:
    """OpenAI-style chat messages: a non-empty list of {"role", "content"}; content a string or a list
    of {"type": "text", "text": ...} parts (joined). Returns plain {"role", "content": str} dicts."""
    from .text import check_text

    if not isinstance(value, (list, tuple)) or not value:
        raise InputError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InputError(f"messages[{i}] must be an object with a \"role\" ({', '.join(ROLES)}) and a \"content\"")
        if m["role"] not in ROLES:
            raise InputError(f"messages[{i}].role is {m['role']!r}; use one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InputError(f"messages[{i}].content parts must be {{\"type\": \"text\", \"text\": ...}} "
                                 "(this model reads text only)")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        out.append({"role": m["role"], "content": check_text(content, f"messages[{i}].content")})
    return out
