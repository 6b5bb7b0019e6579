"""Benchmark worker for Hugging Face transformers (peer tool): PyTorch on the CPU, assisted generation.

    .venv/bin/python bench/workers/hf_worker.py \
        --target ~/.cache/spectr-edge/gguf/Qwen2.5-Coder-1.5B-Instruct.gguf \
        --draft ~/.cache/spectr-edge/gguf/Qwen2.5-Coder-0.5B-Instruct.gguf --threads 2

The GGUF files are dequantized to float32 at load (transformers' GGUF loader needs the `gguf`
package >= 0.10.0 and `accelerate`; both are in .venv), the same weights our ONNX float32 target
was exported from. Written against transformers 4.57 / torch 2.x. Protocol: see spectr_worker.py.

Methods, chosen per request by `config` (temperature, top_k, top_p as for every worker):
  target-only      {}
  assisted         {"assistant": true, "num_assistant_tokens": n | null, "schedule": "constant" |
                    "heuristic" | "heuristic_transient", "confidence_threshold": x}
                   (null/absent: the library defaults, 20 tokens, schedule "constant", threshold 0.4;
                   0 turns the confidence stop off. These live on the assistant's generation_config,
                   which generate() mutates -- the heuristic schedule writes back its token count --
                   so every request sets them again and prompts stay independent.)
  prompt lookup    {"prompt_lookup": n, "max_ngram": m}   (m absent: the library's 2)

Temperature 0 is greedy (do_sample=False); otherwise do_sample=True with temperature, top_k
(0 = off) and top_p (1.0 = off). With an assistant and do_sample the library runs speculative
sampling (accept/reject on the two distributions); prompt lookup samples the target and keeps the
drafts that match. Measurements: seconds = the whole generate() call, ttft_s = when the first new
token reaches the streamer (in assisted generation that is after the first draft-and-verify round:
the prompt and the first candidates go through the target in one call), target_calls = target
forward calls (a forward pre-hook), draft_calls = assistant forward calls, drafted/accepted from
the library's candidate-strategy update (it gets the number of matches each round).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spectr_worker import protocol_stream, serve  # noqa: E402


class FirstTokenTimer:
    """A minimal streamer: generate() puts the prompt first, then every batch of new tokens."""

    def __init__(self):
        self.puts = 0
        self.first = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class ForwardMeter:
    """Counts and times a module's forward calls with a pre-hook and a post-hook."""

    def __init__(self, module):
        self.calls, self.seconds, self._t0 = 0, 0.0, None
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def reset(self) -> None:
        self.calls, self.seconds, self._t0 = 0, 0.0, None

    def _pre(self, module, args):
        self.calls += 1
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True, help="target GGUF")
    ap.add_argument("--draft", default=None, help="assistant GGUF (for assistant=true)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eos-ids", default=None,
                    help="comma-separated stop ids (default: the target's generation_config eos_token_id)")
    args = ap.parse_args()
    proto = protocol_stream()

    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    def load(path):
        path = os.path.abspath(os.path.expanduser(path))
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32, local_files_only=True)
        return model.eval(), path

    target, target_path = load(args.target)
    gen_cfg = target.generation_config
    if args.eos_ids:
        eos_ids = [int(x) for x in args.eos_ids.split(",")]
    else:
        e = gen_cfg.eos_token_id
        eos_ids = [int(x) for x in (e if isinstance(e, (list, tuple)) else [e]) if x is not None]
    if not eos_ids:
        raise SystemExit("error: the target has no eos_token_id; pass --eos-ids")
    pad_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else eos_ids[0]
    t_meter = ForwardMeter(target)

    assistant, a_meter, draft_path, a_defaults = None, None, None, {}
    if args.draft:
        assistant, draft_path = load(args.draft)
        a_meter = ForwardMeter(assistant)
        a_defaults = {k: getattr(assistant.generation_config, k) for k in
                      ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}

    # drafted / accepted: generate() builds a candidate generator per call and reports every
    # round's number of matches to its update_candidate_strategy(input_ids, logits, n_matches)
    rounds: list[tuple[int, int]] = []
    make_candidates = target._get_candidate_generator

    def recording_candidate_generator(*a, **k):
        cg = make_candidates(*a, **k)
        update = cg.update_candidate_strategy

        def record(input_ids, scores, num_matches):
            rounds.append((int(scores.shape[1]) - 1, int(num_matches)))
            return update(input_ids, scores, num_matches)

        cg.update_candidate_strategy = record
        return cg

    target._get_candidate_generator = recording_candidate_generator

    def describe(model, path):
        return {"path": path, "size_bytes": os.path.getsize(path), "dtype": str(next(model.parameters()).dtype),
                "num_layers": model.config.num_hidden_layers, "vocab_size": model.config.vocab_size,
                "tie_word_embeddings": model.config.tie_word_embeddings,
                "attn_implementation": getattr(model.config, "_attn_implementation", None)}

    info = {"tool": "transformers", "transformers": transformers.__version__, "torch": torch.__version__,
            "numpy": np.__version__, "threads": torch.get_num_threads(), "eos_ids": eos_ids, "pad_id": pad_id,
            "models": {"target": describe(target, target_path)}}
    try:
        from importlib.metadata import version
        info["gguf"] = version("gguf")
    except Exception:  # noqa: BLE001 -- only a label
        pass
    if assistant is not None:
        info["models"]["draft"] = describe(assistant, draft_path)
        info["assistant_defaults"] = {k: v for k, v in a_defaults.items()}

    def handle(req: dict) -> dict:
        c = req["config"]
        max_new = int(req["max_new_tokens"])
        prompt = [int(t) for t in req["prompt_ids"]]
        temp = float(c.get("temperature", 0.0))
        kw = dict(max_new_tokens=max_new, eos_token_id=eos_ids, pad_token_id=pad_id, use_cache=True)
        if temp > 0:
            kw.update(do_sample=True, temperature=temp, top_k=int(c.get("top_k", 0)), top_p=float(c.get("top_p", 1.0)))
        else:
            kw.update(do_sample=False)
        method = None
        if c.get("assistant"):
            if assistant is None:
                raise ValueError("assistant=true needs the worker started with --draft")
            g = assistant.generation_config
            n = c.get("num_assistant_tokens")
            g.num_assistant_tokens = a_defaults["num_assistant_tokens"] if n is None else int(n)
            g.num_assistant_tokens_schedule = c.get("schedule") or a_defaults["num_assistant_tokens_schedule"]
            th = c.get("confidence_threshold")
            g.assistant_confidence_threshold = a_defaults["assistant_confidence_threshold"] if th is None else float(th)
            kw["assistant_model"] = assistant
            method = "assistant"
        elif c.get("prompt_lookup"):
            kw["prompt_lookup_num_tokens"] = int(c["prompt_lookup"])
            if c.get("max_ngram"):
                kw["max_matching_ngram_size"] = int(c["max_ngram"])
            method = "prompt_lookup"

        input_ids = torch.tensor([prompt], dtype=torch.long)
        attention_mask = torch.ones_like(input_ids)
        streamer = FirstTokenTimer()
        t_meter.reset()
        if a_meter is not None:
            a_meter.reset()
        rounds.clear()
        torch.manual_seed(int(req["seed"]))
        started = time.perf_counter()
        out = target.generate(input_ids=input_ids, attention_mask=attention_mask, streamer=streamer, **kw)
        seconds = time.perf_counter() - started

        new = out[0, len(prompt):].tolist()[:max_new]
        stop = "max_new_tokens"
        for i, tok in enumerate(new):
            if tok in eos_ids:
                new, stop = new[:i + 1], "eos"
                break
        ttft = streamer.first - started if streamer.first is not None else seconds
        res = {"new_tokens": len(new), "seconds": seconds, "ttft_s": ttft, "target_calls": t_meter.calls,
               "seconds_target": t_meter.seconds, "token_ids": new, "stop_reason": stop}
        if method is not None:
            width = max((n for n, _ in rounds), default=0)
            reached, accepted_at = [0] * width, [0] * width
            for n_cand, n_match in rounds:
                for j in range(min(n_cand, n_match + 1)):
                    reached[j] += 1
                for j in range(min(n_cand, n_match)):
                    accepted_at[j] += 1
            res.update(drafted=sum(n for n, _ in rounds), accepted=sum(m for _, m in rounds), rounds=len(rounds),
                       reached=reached, accepted_at=accepted_at,
                       acceptance_per_position=[a / r if r else 0.0 for a, r in zip(accepted_at, reached)])
        if method == "assistant":
            res.update(draft_calls=a_meter.calls, seconds_draft=a_meter.seconds,
                       num_assistant_tokens_after=float(assistant.generation_config.num_assistant_tokens))
        return res

    serve(proto, info, handle)


if __name__ == "__main__":
    main()
