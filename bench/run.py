"""One benchmark run: methods x prompts, interleaved, written to bench/results/<date>-<name>/.

    .venv/bin/python bench/run.py --suite default --quick       # a few minutes, for development
    .venv/bin/python bench/run.py --suite precisions            # every target precision, llama.cpp, ORT GenAI
    .venv/bin/python bench/run.py --suite policies --checkout ../other-worktree   # two versions of the code
    .venv/bin/python bench/run.py --suite int4-peers --hide-avx512  # AVX2 kernels only (bench/cpu_mask.py)
    .venv/bin/python bench/run.py --suite int4-peers --hide-avx512 --keep-avx-vnni   # AVX2 and AVX-VNNI
    (the suites are in bench/suites.py)

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
plots (bench/report.py). Plots and tables can be rebuilt from raw.json:
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
import cpu_mask  # noqa: E402
import harness  # noqa: E402
from suites import PROMPTS, suite  # noqa: E402

BENCH = Path(__file__).resolve().parent
PY = sys.executable


GGUF = Path(os.environ.get("SPECTR_GGUF_DIR", "~/.cache/spectr-edge/gguf")).expanduser()
TARGET_GGUF, DRAFT_GGUF = "Qwen2.5-Coder-1.5B-Instruct.gguf", "Qwen2.5-Coder-0.5B-Instruct.gguf"  # models/README.md
ORTGENAI = Path(os.environ.get("ORTGENAI_MODELS", "~/.cache/spectr-edge/peers/ortgenai")).expanduser()
STOP_IDS = "151645,151643"   # spectr-edge's stop ids for Qwen2.5 (<|im_end|>, <|endoftext|>); peers get the same
SETUP = {"llamacpp": "bash bench/peers/llamacpp_setup.sh", "ortgenai": "bash bench/peers/ortgenai_setup.sh"}


def peer_venv(tool: str, args) -> tuple[Path, str]:
    """A peer's environment and the command that sets it up; with --hide-avx512, llama.cpp's AVX2-only build
    (with --keep-avx-vnni, its AVX2 and AVX-VNNI build)."""
    if tool == "llamacpp" and getattr(args, "hide_avx512", False):
        isa = "avx2-vnni" if getattr(args, "keep_avx_vnni", False) else "avx2"
        return BENCH / f".venv-llamacpp-{isa}", f"LLAMACPP_ISA={isa} bash bench/peers/llamacpp_setup.sh"
    return BENCH / f".venv-{tool}", SETUP[tool]


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
        return [PY, str(BENCH / "workers" / "spectr_worker.py"), "--bundle", rest or args.bundle,
                "--provider", args.provider] + threads
    if tool == "hf":   # transformers lives in the project's [export] extra, i.e. this venv
        return [PY, str(BENCH / "workers" / "hf_worker.py"), "--target", str(GGUF / TARGET_GGUF),
                "--draft", str(GGUF / DRAFT_GGUF), "--eos-ids", STOP_IDS, "--threads", str(args.threads or 2)]
    if tool == "llamacpp":
        py = peer_venv(tool, args)[0] / "bin" / "python"
        return [str(py), str(BENCH / "workers" / "llamacpp_worker.py"), "--model", str(GGUF / TARGET_GGUF),
                "--draft", str(GGUF / DRAFT_GGUF), "--eos-ids", STOP_IDS, "--threads", str(args.threads or 2)]
    if tool == "ortgenai":
        py = BENCH / ".venv-ortgenai" / "bin" / "python"
        model, _, draft = rest.partition("+")
        return ([str(py), str(BENCH / "workers" / "ortgenai_worker.py"), "--model", str(ORTGENAI / model)]
                + (["--draft", str(ORTGENAI / draft)] if draft else []) + threads)
    raise SystemExit(f"error: no worker for {key!r}")


def missing_setup(key: str, args) -> str | None:
    """Why a peer worker cannot start (its environment or models are not set up), or None."""
    tool, _, rest = key.partition(":")
    if tool.startswith("spectr@") and not (Path(tool.removeprefix("spectr@")) / "spectr_edge").is_dir():
        return f"{tool.removeprefix('spectr@')} is not a checkout of spectr-edge"
    if tool.startswith("spectr") and rest and not (Path(rest) / "spectr.json").exists():
        if rest.endswith("-full-logits"):
            return (f"{rest} is missing; run `.venv/bin/python bench/full_logits_twin.py "
                    f"{rest.removesuffix('-full-logits')} {rest}`")
        quant = next((q for q in ("int8", "int4", "w8a8") if q in rest), None)
        return (f"{rest} is missing; run `.venv/bin/python bench/quant_twin.py models/default {rest} "
                f"--target-quant {quant}`" if quant else f"{rest} is missing")
    if tool in SETUP and not (peer_venv(tool, args)[0] / "bin" / "python").exists():
        venv, setup = peer_venv(tool, args)
        return f"bench/{venv.name} is missing; run `{setup}`"
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
        self.native_llamacpp = key == "llamacpp" and Path(cmd[0]).parent.parent.name == ".venv-llamacpp"
        self.info: dict | None = None                    # what the worker says of itself once started
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     bufsize=1)
        hello = self._read()
        if not hello.get("ready"):
            raise SystemExit(f"error: worker {key} did not start: {hello}")
        self.info = hello["info"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            status = self.proc.wait()
            hint = ""
            # AMX kernels: llama.cpp's own system info once the worker has said it, before that the CPU's flags
            if self.native_llamacpp and status < 0 and (
                    "AMX_INT8 = 1" in self.info.get("system_info", "") if self.info is not None
                    else "amx_int8" in harness.machine_info().get("cpu_flags", [])):
                hint = ("; llama.cpp's AMX kernels crash on Q4_K_M weights: build without them, "
                        "`LLAMACPP_ISA=native-no-amx bash bench/peers/llamacpp_setup.sh`")
            raise SystemExit(f"error: worker {self.key} exited (status {status}){hint}; see log.txt")
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
        why = missing_setup(key, args)
        if why is None:
            cmd = worker_command(key, args)
            if args.hide_avx512:       # every worker runs the kernels of an AVX2-only CPU
                cmd = cpu_mask.command(cmd, args.keep_avx_vnni)
            try:
                workers[key] = Worker(key, cmd, log)
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
    ap.add_argument("--prompts", default=None,
                    help="first-N | stratified-N | ids-A,B; de:SUBSET answers in German; A+B joins (default per suite)")
    ap.add_argument("--more-prompts", action="append", default=[], metavar="FILE",
                    help="more questions in Spec-Bench's format (bench/write_questions.py), selectable by id")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--provider", default="cpu", help="spectr-edge's execution provider: cpu, cuda, tensorrt")
    ap.add_argument("--tree-bundle", "--int4-bundle", dest="tree_bundle", default=None,
                    help="the int4-target twin the suites compare (default models/default-int4)")
    ap.add_argument("--adapted-bundle", dest="adapted", action="append", default=None,
                    help="adaptation suite: a bundle whose adapted draft to compare (repeat for several; "
                         "default models/default-adapted)")
    ap.add_argument("--all-configs", action="store_true", help="spectr-grid: also the dominated k x L rows")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens: minutes, for development")
    ap.add_argument("--checkout", default=None,
                    help="another checkout of spectr-edge (e.g. a git worktree of an earlier commit): every "
                         "spectr-edge method also runs under its code, tagged [other checkout], interleaved")
    ap.add_argument("--out", default=None, help="output folder (default bench/results/<date>-<name>)")
    ap.add_argument("--hide-avx512", action="store_true",
                    help="run every worker as if this CPU had AVX2 and no AVX-512 (bench/cpu_mask.py); llama.cpp "
                         "from its AVX2-only build (LLAMACPP_ISA=avx2 bench/peers/llamacpp_setup.sh)")
    ap.add_argument("--keep-avx-vnni", action="store_true",
                    help="with --hide-avx512: leave AVX-VNNI visible, as on Intel's client cores since Alder Lake; "
                         "llama.cpp from its AVX2 and AVX-VNNI build (LLAMACPP_ISA=avx2-vnni)")
    args = ap.parse_args(argv)
    if args.keep_avx_vnni and not args.hide_avx512:
        raise SystemExit("error: --keep-avx-vnni only applies with --hide-avx512; add --hide-avx512")
    if args.hide_avx512:
        cpu_mask.check(args.keep_avx_vnni)
    methods = suite(args.suite, args.all_configs, args.tree_bundle, args.adapted)
    if args.checkout:
        checkout = str(Path(args.checkout).resolve())
        methods = [x for m in methods for x in ([m, in_checkout(m, checkout, "other checkout")]
                                                 if m["tool"] == "spectr-edge" else [m])]
    subset = args.prompts or PROMPTS.get(args.suite, "stratified-4")
    if args.quick:
        subset, args.max_new_tokens = (args.prompts or "stratified-1"), 32
    prompts = harness.select_prompts(harness.load_questions(more=args.more_prompts), subset)
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
            "more_prompts": [harness.repo_path(f) for f in args.more_prompts],
            "max_new_tokens": args.max_new_tokens, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": harness.machine_info() | ({"hidden_cpu_features": cpu_mask.hidden(args.keep_avx_vnni)}
                                                 if args.hide_avx512 else {}),
            "workers": {}, "methods": methods, "groups": list(groups),
            "prompts": [{k: p[k] for k in ("id", "category", "task", "language") if k in p} for p in prompts]}
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
                    row = {"prompt_id": p["id"], "category": p["category"], "task": p["task"],
                           "language": p.get("language", "en"), "group": group,
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
