"""Benchmark worker for llama-cpp-python (peer tool): GGUF models on llama.cpp's CPU backend.

Runs in its own environment (bench/peers/llamacpp_setup.sh builds bench/.venv-llamacpp):
    bench/.venv-llamacpp/bin/python bench/workers/llamacpp_worker.py \
        --model ~/.cache/spectr-edge/gguf/Qwen2.5-Coder-1.5B-Instruct.gguf \
        --draft ~/.cache/spectr-edge/gguf/Qwen2.5-Coder-0.5B-Instruct.gguf --threads 2

Protocol: see spectr_worker.py (JSON lines on stdin / the protocol stream). Written against
llama-cpp-python 0.3.36. Methods, chosen per request by `config`:
  target-only      {"temperature": T, "top_k": 0, "top_p": 1.0}
  prompt lookup    {..., "speculative": "prompt_lookup", "num_pred_tokens": n, "max_ngram_size": 2}
                   (llama_cpp.llama_speculative.LlamaPromptLookupDecoding, the library's own drafter)
  draft model      {..., "speculative": "draft_model", "num_draft": n}
                   (a second Llama on --draft drafting n tokens greedily; the library ships no
                   draft-model drafter, but Llama.generate verifies whatever a LlamaDraftModel returns)
  optional         "lean_prefill": true  -- evaluate the prompt without all-position logits in the
                   speculative modes (the library computes and copies logits for every prompt
                   position whenever a draft_model is set; off by default = the library as shipped)

How 0.3.36 verifies drafts (llama.py, Llama.generate): after each sampled token it calls
draft_model(input_ids) and evaluates [token] + draft in one batch with logits for every position,
then samples the target's own token at each position with the normal sampler chain and keeps
drafts while they equal the sampled token (the first mismatch is replaced by the target's sample).
So the output follows the target's sampling distribution at any temperature (greedy: identical to
target-only), but the random stream differs from target-only at T > 0.

Sampling as plain sampling: min_p=0 (library default 0.05), typical_p=1, repeat_penalty=1,
top_k<=0 = off (llama.cpp top_k returns early for k <= 0), top_p=1 = off, temperature 0 = greedy
sampler. Note llama.cpp's chain order is top_k -> typical -> top_p -> min_p -> temp -> dist, so
top_p is applied to the untempered distribution (differs from spectr-edge/HF when T != 1 and
top_p < 1).

Measurements: seconds from the call to generate (prefill included), ttft_s when the first token
comes out, target_calls = target decode calls (prefill included; Llama.eval calls), drafted =
draft tokens sent for verification, accepted = of them kept, draft_calls = draft-model decode calls.
Tokens are counted up to and including the first end-of-generation token (llama.cpp's EOG set
for the model, unless --eos-ids is given) or max_new_tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spectr_worker import protocol_stream, serve  # noqa: E402

# llama.cpp file types (general.file_type) that matter here
FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
          11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
          17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


class Counter:
    """Per-generation counters filled by the eval wrappers."""

    def __init__(self):
        self.reset(False)

    def reset(self, lean_prefill: bool) -> None:
        self.calls = 0
        self.seconds = 0.0
        self.steps: list[tuple[int, list[int]]] = []   # (position of batch[0], batch) per decode call
        self.lean_prefill = lean_prefill


def wrap_eval(llm, counter: Counter, record_batches: bool) -> None:
    """Count (and time) every Llama.eval call: Llama.generate calls self.eval(tokens) once per
    decode step (llama.py:977), so an instance attribute replaces it for this object only."""
    orig = llm.eval

    def counting_eval(tokens):
        batch = list(tokens)            # generate mutates its list after eval returns
        n_past = llm.n_tokens
        first = counter.calls == 0
        saved = llm._logits_all
        if first and counter.lean_prefill:
            llm._logits_all = False     # the prefill only needs the last position's logits
        t0 = time.perf_counter()
        try:
            orig(tokens)
        finally:
            counter.seconds += time.perf_counter() - t0
            llm._logits_all = saved
        counter.calls += 1
        if record_batches and not first:
            counter.steps.append((n_past, batch))

    llm.eval = counting_eval


def make_draft_model_class(LlamaDraftModel):
    import numpy as np

    class ModelDraft(LlamaDraftModel):
        """Draft tokens with a second (small) Llama, greedily, reusing its KV cache across calls.

        Llama.generate(reset=True) keeps the longest common prefix of its cache and the new input
        (llama.py:917-961), so each call decodes only what changed since the last call (the
        corrected/bonus token, plus the last draft token when all were accepted), then num_draft - 1
        single-token steps. The last drafted token is not decoded until the next call."""

        def __init__(self, llm, is_eog):
            self.llm, self.is_eog = llm, is_eog
            self.num_draft = 4
            self.end = 0                           # prompt length + max_new_tokens
            self.counter = Counter()
            self.seconds = 0.0
            self.proposals = 0
            wrap_eval(llm, self.counter, record_batches=False)

        def new_generation(self, num_draft: int, end: int) -> None:
            self.num_draft, self.end = num_draft, end
            self.llm.reset()                       # no prefix reuse across prompts (fresh cache)
            self.counter.reset(False)
            self.seconds, self.proposals = 0.0, 0

        def __call__(self, input_ids, /, **kwargs):
            t0 = time.perf_counter()
            out: list[int] = []
            # input_ids ends with the newest emitted token; a step emits at most k + 1 tokens, so
            # never draft past max_new_tokens (as spectr-edge and transformers do)
            k = min(self.num_draft, self.end - len(input_ids) - 1)
            if k > 0:
                gen = self.llm.generate(input_ids.tolist(), temp=0.0, top_k=0, top_p=1.0, min_p=0.0,
                                        typical_p=1.0, repeat_penalty=1.0, reset=True)
                for tok in gen:
                    out.append(int(tok))
                    if len(out) >= k or self.is_eog(tok):
                        break
                gen.close()
            self.proposals += 1
            self.seconds += time.perf_counter() - t0
            return np.asarray(out, dtype=np.intc)

    return ModelDraft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="target GGUF")
    ap.add_argument("--draft", default=None, help="draft GGUF (for speculative=draft_model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--flash-attn", action="store_true", help="llama-cpp-python default: off")
    ap.add_argument("--eos-ids", default=None,
                    help="comma-separated stop ids (default: llama.cpp's end-of-generation set for the model)")
    args = ap.parse_args()
    proto = protocol_stream()

    import numpy as np
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

    def load(path):
        # logits_all=True sizes Llama.scores to n_ctx rows (llama.py:484-486): Llama.eval writes every
        # position's logits there whenever a draft_model is set (llama.py:351, 684-690), and with
        # the default n_batch rows any sequence past n_batch tokens fails with a broadcast error.
        # The array is allocated lazily, so unused rows cost no memory. Per request we switch
        # _logits_all back off for target-only generation.
        return Llama(model_path=os.path.expanduser(path), n_ctx=args.n_ctx, n_batch=args.n_batch,
                     n_ubatch=args.n_batch, n_threads=args.threads, n_threads_batch=args.threads,
                     logits_all=True, flash_attn=args.flash_attn, verbose=False)

    llm = load(args.model)
    vocab = llm._model.vocab
    n_vocab = llm.n_vocab()
    eog = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    eos_ids = frozenset(int(x) for x in args.eos_ids.split(",")) if args.eos_ids else frozenset(eog)
    target_counter = Counter()
    wrap_eval(llm, target_counter, record_batches=True)

    drafter = None
    if args.draft:
        draft_llm = load(args.draft)
        if draft_llm.n_vocab() != n_vocab:
            raise SystemExit(f"error: draft vocabulary {draft_llm.n_vocab()} != target {n_vocab}")
        draft_llm._logits_all = False           # the drafter itself never verifies anything
        drafter = make_draft_model_class(LlamaDraftModel)(draft_llm, lambda t: int(t) in eos_ids)

    def describe(m, path):
        meta = m.metadata
        ft = meta.get("general.file_type")
        return {"path": os.path.abspath(os.path.expanduser(path)), "name": meta.get("general.name"),
                "file_type": FTYPES.get(int(ft), ft) if ft is not None else None,
                "size_bytes": os.path.getsize(os.path.expanduser(path))}

    info = {"tool": "llama-cpp-python", "llama_cpp_python": llama_cpp.__version__, "numpy": np.__version__,
            "threads": args.threads, "n_ctx": args.n_ctx, "n_batch": args.n_batch, "flash_attn": args.flash_attn,
            "eos_ids": sorted(eos_ids), "eog_ids_llama_cpp": eog,
            "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
            "models": {"target": describe(llm, args.model)}}
    if args.draft:
        info["models"]["draft"] = describe(drafter.llm, args.draft)

    def handle(req: dict) -> dict:
        c = req["config"]
        max_new = int(req["max_new_tokens"])
        prompt = [int(t) for t in req["prompt_ids"]]
        temp = float(c.get("temperature", 0.0))
        method = c.get("speculative")
        if method is None:
            llm.draft_model, llm._logits_all = None, False
        elif method == "prompt_lookup":
            llm.draft_model = LlamaPromptLookupDecoding(max_ngram_size=int(c.get("max_ngram_size", 2)),
                                                        num_pred_tokens=int(c.get("num_pred_tokens", 10)))
            llm._logits_all = True
        elif method == "draft_model":
            if drafter is None:
                raise ValueError("speculative=draft_model needs the worker started with --draft")
            drafter.new_generation(int(c.get("num_draft", 4)), len(prompt) + max_new)
            llm.draft_model, llm._logits_all = drafter, True
        else:
            raise ValueError(f"unknown speculative method {method!r}")
        target_counter.reset(bool(c.get("lean_prefill", False)) and method is not None)
        llm.set_seed(int(req["seed"]) % 0xFFFFFFFF)   # 0xFFFFFFFF = LLAMA_DEFAULT_SEED = random
        llm.reset()                                    # fresh KV cache: no prefix reuse between prompts

        out: list[int] = []
        stop, ttft = "max_new_tokens", None
        started = time.perf_counter()
        gen = llm.generate(prompt, temp=temp, top_k=int(c.get("top_k", 0)), top_p=float(c.get("top_p", 1.0)),
                           min_p=0.0, typical_p=1.0, repeat_penalty=1.0, frequency_penalty=0.0,
                           presence_penalty=0.0, reset=True)
        for tok in gen:
            if ttft is None:
                ttft = time.perf_counter() - started
            out.append(int(tok))
            if out[-1] in eos_ids:
                stop = "eos"
                break
            if len(out) >= max_new:
                break
        gen.close()
        seconds = time.perf_counter() - started

        res = {"new_tokens": len(out), "seconds": seconds, "ttft_s": ttft if ttft is not None else seconds,
               "target_calls": target_counter.calls, "seconds_target": target_counter.seconds,
               "token_ids": out, "stop_reason": stop}
        if method is not None:
            seq = prompt + out
            width = max((len(b) - 1 for _, b in target_counter.steps), default=0)
            reached, accepted_at = [0] * width, [0] * width
            drafted = accepted = 0
            for n_past, batch in target_counter.steps:    # batch = [last sampled token] + draft
                drafted += len(batch) - 1
                for j in range(1, len(batch)):
                    pos = n_past + j
                    if pos >= len(seq):                   # past the end of what was kept
                        break
                    reached[j - 1] += 1
                    if seq[pos] != batch[j]:
                        break
                    accepted += 1
                    accepted_at[j - 1] += 1
            res.update(drafted=drafted, accepted=accepted, reached=reached, accepted_at=accepted_at,
                       acceptance_per_position=[a / r if r else 0.0 for a, r in zip(accepted_at, reached)])
            if method == "draft_model":
                # seconds_draft: inside the draft's decode calls; seconds_drafting: the whole drafter
                res.update(draft_calls=drafter.counter.calls, seconds_draft=drafter.counter.seconds,
                           seconds_drafting=drafter.seconds, draft_proposals=drafter.proposals)
        return res

    serve(proto, info, handle)


if __name__ == "__main__":
    main()
