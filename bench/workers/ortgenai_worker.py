"""Benchmark worker for ONNX Runtime GenAI 0.18 (peer comparison); same protocol as spectr_worker.py.

    bench/.venv-ortgenai/bin/python bench/workers/ortgenai_worker.py --model DIR [--draft DIR] [--threads N]

--model is a folder written by the ORT GenAI model builder (genai_config.json + model.onnx), see
bench/peers/ortgenai_setup.sh. With --draft, a second builder folder is attached as the draft: the
target's genai_config gets a "model.draft" section (the draft's own "model.decoder" block), which is
how 0.18 turns on draft-model speculative decoding (docs/speculative_decoding.md upstream; in the
wheel: "model.draft.filename is not set in genai_config.json."). The config is overlaid in memory;
nothing on disk changes. While a draft is configured every generation is speculative, and n-gram
decoding is refused ("N-gram decoding cannot be combined with draft-model speculative decoding."),
so target-only and n-gram rows need a worker started without --draft.

config keys: temperature (0 = greedy), top_k (0 = off), top_p (1.0 = off), and
  nothing more                           target only (worker without --draft)
  {"speculative": "draft", "max_draft_tokens": K}                  (worker with --draft)
  {"speculative": "ngram", "ngram_size": N, "max_draft_tokens": K} (worker without --draft)
  optional with either: "min_adaptive_k" (0 = fixed K), "cooldown" (bool), and for n-gram
  "ngram_chained_lookup" (bool); they go to GeneratorParams.set_speculative_options unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spectr_worker import protocol_stream, serve  # noqa: E402  (stdlib only at import time)

SPEC_KEYS = {"max_draft_tokens": int, "ngram_size": int, "min_adaptive_k": int,
             "ngram_chained_lookup": bool, "cooldown": bool}
CONFIG_KEYS = {"temperature", "top_k", "top_p", "speculative"} | set(SPEC_KEYS)


def read_genai_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "genai_config.json"), encoding="utf-8") as f:
        return json.load(f)


def source_note(model_dir: str) -> dict:
    """What ortgenai_setup.sh recorded about a built folder (GGUF, precision, builder), if anything."""
    path = os.path.join(model_dir, "spectr_source.json")
    if not os.path.exists(path):
        return {"dir": model_dir}
    with open(path, encoding="utf-8") as f:
        return {"dir": model_dir, **json.load(f)}


def build_config(og, model_dir: str, draft_dir: str | None, threads: int | None):
    """og.Config for the target, with the thread count and (optionally) the draft overlaid."""
    config = og.Config(model_dir)
    session = {"intra_op_num_threads": threads} if threads else {}
    overlay: dict = {"model": {"decoder": {"session_options": session}}} if session else {"model": {}}
    if draft_dir:
        draft = read_genai_config(draft_dir)["model"]["decoder"]
        # GenAI joins config_dir + "/" + filename as plain strings, so the draft's file must be given
        # relative to the target's folder; its model.onnx.data is then found beside it.
        draft["filename"] = os.path.relpath(os.path.join(os.path.abspath(draft_dir), draft["filename"]),
                                            os.path.abspath(model_dir))
        draft.setdefault("session_options", {}).update(session)
        overlay["model"]["draft"] = draft
    if overlay["model"]:
        config.overlay(json.dumps(overlay))
    return config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="ORT GenAI model folder (target)")
    ap.add_argument("--draft", default=None, help="ORT GenAI model folder used as the draft model")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    proto = protocol_stream()

    import numpy as np
    import onnxruntime
    import onnxruntime_genai as og

    model = og.Model(build_config(og, args.model, args.draft, args.threads))
    eos = read_genai_config(args.model)["model"]["eos_token_id"]
    eos_ids = frozenset([eos] if isinstance(eos, int) else eos)
    info = {"tool": "onnxruntime-genai", "onnxruntime_genai": og.__version__,
            "onnxruntime_genai_commit": getattr(og, "__commit__", None), "onnxruntime": onnxruntime.__version__,
            "numpy": np.__version__, "provider": "cpu", "threads": args.threads or "onnxruntime default",
            "eos_token_ids": sorted(eos_ids),
            "models": {"target": source_note(args.model), **({"draft": source_note(args.draft)} if args.draft else {})}}

    def handle(req: dict) -> dict:
        c = req["config"]
        unknown = set(c) - CONFIG_KEYS
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)} for onnxruntime-genai")
        mode = c.get("speculative")
        if mode not in (None, "draft", "ngram"):
            raise ValueError(f"speculative must be 'draft' or 'ngram', not {mode!r}")
        if mode == "draft" and not args.draft:
            raise ValueError("speculative 'draft' needs a worker started with --draft")
        if args.draft and mode != "draft":
            raise ValueError("this worker has a draft model, which ORT GenAI uses on every generation; "
                             "target-only and n-gram rows need a worker started without --draft")
        if mode == "ngram" and not c.get("ngram_size"):
            raise ValueError("speculative 'ngram' needs ngram_size (2..16)")

        prompt = np.asarray(req["prompt_ids"], dtype=np.int32)   # already chat-templated ids, 1-D
        n_prompt, max_new = len(prompt), int(req["max_new_tokens"])
        temperature = float(c.get("temperature", 0.0))
        params = og.GeneratorParams(model)
        # Every search option is set explicitly: the builder copies generation_config.json defaults
        # (top_k=50, sometimes repetition_penalty, do_sample) into genai_config.json's "search".
        search = dict(max_length=n_prompt + max_new, min_length=0, num_beams=1, num_return_sequences=1,
                      repetition_penalty=1.0, no_repeat_ngram_size=0, random_seed=int(req["seed"]))
        if temperature > 0:
            # GenAI: top_k > 1 restricts, top_p in (0, 1) restricts; top_k=0 with top_p=1.0 samples
            # from the full tempered distribution (its TopP path with p = 1).
            search.update(do_sample=True, temperature=temperature, top_k=int(c.get("top_k", 0) or 0),
                          top_p=float(c.get("top_p", 1.0) or 1.0))
        else:
            search.update(do_sample=False)
        params.set_search_options(**search)
        spec = {k: t(c[k]) for k, t in SPEC_KEYS.items() if k in c}
        if mode and spec:
            params.set_speculative_options(**spec)

        # Timed from the generator's creation (KV state) through prefill (append_tokens) to the
        # last token; ttft is when the sequence first grows past the prompt. Standard decoding takes
        # token 1 from the prefill logits; a speculative generator may already run a whole
        # draft+verify round in that first generate_next_token, which is then part of its ttft.
        t0 = time.perf_counter()
        gen = og.Generator(model, params)
        gen.append_tokens(prompt)
        ttft = None
        while not gen.is_done():
            gen.generate_next_token()
            if ttft is None and gen.token_count() > n_prompt:
                ttft = time.perf_counter() - t0
        seconds = time.perf_counter() - t0

        tokens = [int(t) for t in gen.get_sequence(0)[n_prompt:]][:max_new]
        stop_reason = "max_new_tokens" if len(tokens) >= max_new else "context"
        hidden_eos = False
        for i, tok in enumerate(tokens):
            if tok in eos_ids:   # eos counts as generated, as in spectr-edge; nothing after it is shown
                tokens, stop_reason = tokens[:i + 1], "eos"
                break
        else:
            # 0.18 ends on eos without putting it in the sequence (seen with Qwen2.5: 17 tokens where
            # llama.cpp and spectr-edge give the same 17 plus <|im_end|>). The eos step was run and
            # timed, so it is counted, as the other tools count theirs.
            if stop_reason == "context":   # done before max_new_tokens: it stopped on eos
                stop_reason, hidden_eos = "eos", True
        out = {"new_tokens": len(tokens) + hidden_eos, "seconds": seconds,
               "ttft_s": ttft if ttft is not None else seconds, "token_ids": tokens, "stop_reason": stop_reason,
               "eos_not_in_sequence": hidden_eos}
        if mode:
            # plain JSON (the histogram may come back as an array); the whole snapshot goes in the row
            s = json.loads(json.dumps(dict(gen.get_speculative_stats()),
                                      default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))
            # The prompt's forward pass (append_tokens -> State::Run) is outside the strategy's
            # counters, hence the +1 on target (and, with a draft model, draft) calls. (Read in the
            # upstream source at 0.16-dev, generators.cpp / speculative_decoding.cpp; not re-checked
            # against the 0.18 binary.)
            out.update(target_calls=1 + int(s.get("target_forward_passes", 0)),
                       draft_calls=(1 + int(s.get("draft_forward_passes", 0))) if mode == "draft" else 0,
                       drafted=int(s.get("draft_tokens_proposed", 0)), accepted=int(s.get("draft_tokens_accepted", 0)),
                       steps=int(s.get("rounds", 0)), speculative_stats=s)
        else:
            out["target_calls"] = len(tokens)   # prefill gives token 1, one forward per later token
        del gen
        return out

    serve(proto, info, handle)


if __name__ == "__main__":
    main()
