"""One benchmark run: methods x prompts, interleaved, written to bench/results/<date>-<name>/.

    .venv/bin/python bench/run.py --suite issue3 --name spec-grid          # the SpecTr grid (issue 3)
    .venv/bin/python bench/run.py --suite default --quick                 # a few minutes, for development

Every method runs in a worker process (bench/workers/), one worker per tool configuration
that needs its own loaded models, so peers run in their own environments and each
method's peak resident memory is its worker's. Per prompt every method runs once, in an
order that reverses from prompt to prompt (A B C, C B A, ...), after one warm-up
generation per method, so machine drift hits all alike. The prompt is tokenized once
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
import subprocess
import sys
import threading
import time
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


def spectr_default(temperature: float) -> dict:
    """The shipped defaults (no k/L/stop passed: what `spectr-edge generate` does)."""
    return {"name": f"spectr-edge T={temperature:g} default", "tool": "spectr-edge", "worker": "spectr",
            "config": {"temperature": temperature}, "temperature": temperature, "baseline": False}


def on_bundle(method: dict, bundle: str, tag: str) -> dict:
    """The same method on another bundle (its own worker), named with a tag."""
    return {**method, "name": f"{method['name']} [{tag}]", "worker": f"spectr:{bundle}", "bundle": bundle,
            "baseline": False}


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
    raise SystemExit(f"error: unknown suite {name!r}; use issue3, default or tree")


def worker_command(key: str, args) -> list[str]:
    tool, _, bundle = key.partition(":")
    if tool == "spectr":
        return ([PY, str(BENCH / "workers" / "spectr_worker.py"), "--bundle", bundle or args.bundle]
                + (["--threads", str(args.threads)] if args.threads else []))
    raise SystemExit(f"error: no worker for {key!r}")


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
def encode_prompts(bundle: str, prompts: list[dict]) -> None:
    from spectr_edge.bundle import read_bundle
    from spectr_edge.text import TextCodec
    codec = TextCodec(read_bundle(bundle).tokenizer)
    for p in prompts:
        p["prompt_ids"] = codec.encode_prompt(p["prompt"])


def measurement(answer: dict) -> dict:
    r = answer["result"]
    n = r["new_tokens"]
    out = dict(r)
    out["ms_per_token"] = 1000 * (r["seconds"] - r["ttft_s"]) / (n - 1) if n > 1 else None
    out["tokens_per_s"] = n / r["seconds"] if r["seconds"] > 0 else None
    calls = r.get("target_calls")
    out["tokens_per_call"] = (n - 1) / (calls - 1) if calls and calls > 1 else None
    inside = (r.get("seconds_target") or 0) + (r.get("seconds_draft") or 0)
    out["outside_ort"] = 1 - inside / r["seconds"] if r.get("seconds_target") is not None else None
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="default")
    ap.add_argument("--name", default=None, help="results folder suffix (default: the suite)")
    ap.add_argument("--bundle", default=str(harness.ROOT / "models" / "default"))
    ap.add_argument("--prompts", default=None, help="first-N | stratified-N | ids-A,B (default per suite)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tree-bundle", default=None, help="tree suite: the same bundle with tree masks")
    ap.add_argument("--all-configs", action="store_true", help="issue3: also the dominated k x L rows")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens: minutes, for development")
    ap.add_argument("--out", default=None, help="output folder (default bench/results/<date>-<name>)")
    args = ap.parse_args(argv)
    methods = suite(args.suite, args.all_configs, args.tree_bundle)
    subset = args.prompts or {"issue3": "first-20", "tree": "stratified-1"}.get(args.suite, "stratified-4")
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

    workers: dict[str, Worker] = {}
    for m in methods:
        if m["worker"] not in workers:
            workers[m["worker"]] = Worker(m["worker"], worker_command(m["worker"], args), log)
    rows, peaks = [], {m["name"]: 0 for m in methods}
    from tqdm import tqdm
    try:
        for m in methods:   # warm-up: allocations, kernel selection, first-shape costs
            answer, _ = workers[m["worker"]].request({"id": "warmup", "prompt": prompts[0]["prompt"],
                                                      "prompt_ids": prompts[0]["prompt_ids"], "max_new_tokens": 8,
                                                      "seed": 0, "config": m["config"]})
            if "error" in answer:
                print(f"warning: {m['name']} failed its warm-up: {answer['error']}", file=sys.stderr)
        meta = {"command": " ".join([Path(sys.executable).name] + sys.argv), "suite": args.suite, "subset": subset,
                "max_new_tokens": args.max_new_tokens,
                "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": harness.machine_info(),
                "workers": {k: w.info for k, w in workers.items()}, "methods": methods,
                "prompts": [{k: p[k] for k in ("id", "category", "task")} for p in prompts]}
        bar = tqdm(total=len(prompts) * len(methods), unit="gen", dynamic_ncols=True, file=sys.stderr)
        for i, p in enumerate(prompts):
            order = methods if i % 2 == 0 else methods[::-1]
            for m in order:
                bar.set_postfix_str(f"prompt {p['id']} {m['name']}"[:60])
                req = {"id": f"{p['id']}:{m['name']}", "prompt": p["prompt"], "prompt_ids": p["prompt_ids"],
                       "max_new_tokens": args.max_new_tokens, "seed": 1000 + i, "config": m["config"]}
                answer, peak = workers[m["worker"]].request(req)
                row = {"prompt_id": p["id"], "category": p["category"], "task": p["task"],
                       "prompt_tokens": len(p["prompt_ids"]), "method": m["name"], "tool": m["tool"],
                       "temperature": m["temperature"], "config": m["config"], "peak_rss": peak}
                row.update(measurement(answer) if "result" in answer else {"error": answer["error"]})
                rows.append(row)
                peaks[m["name"]] = max(peaks[m["name"]], peak)
                bar.update()
            # checkpoint after every prompt: an interrupted run keeps its complete prompts
            done = {"meta": {**meta, "prompts": meta["prompts"][:i + 1], "complete": i + 1 == len(prompts)},
                    "rows": rows}
            (out / "raw.json").write_text(json.dumps(done, indent=1))
        bar.close()
    finally:
        for w in workers.values():
            w.close()
    import report
    report.write(out)
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main()
