"""Load test of `spectr-edge serve`: concurrent OpenAI clients against one server on 127.0.0.1.

Starts the server as a subprocess, computes every prompt's greedy reference with one request at a
time, then runs `--clients` threads of `--requests` streamed chat requests each (bounded: it stops by
itself after clients x requests, or after --timeout seconds) and checks every answer against its
prompt's reference (nothing lost, nothing mixed up). Reports latency and time to first token (p50,
p95), aggregate tokens/s, and the server's resident memory after request 20 and at the end.

    .venv/bin/python bench/serve_load.py --bundle models/default --clients 8 --requests 20 -n 32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402


def percentile(xs, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=str(BENCH.parent / "models" / "default"))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20, help="requests per client")
    ap.add_argument("--prompts", type=int, default=16, help="distinct Spec-Bench prompts the requests cycle through")
    ap.add_argument("-n", "--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--timeout", type=float, default=3600, help="stop the load after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    import httpx
    import openai
    import psutil

    prompts = [q["prompt"][:600] for q in harness.select_prompts(harness.load_questions(), f"first-{args.prompts}")]
    server = subprocess.Popen([sys.executable, "-m", "spectr_edge.cli", "serve", "--bundle", args.bundle,
                               "--host", "127.0.0.1", "--port", str(args.port), "--max-queue", str(args.clients + 4),
                               "--provider", "cpu"], stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise SystemExit("error: the server did not start: " + (server.stderr.read() if server.poll() else ""))
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        ask = lambda i: [{"role": "user", "content": prompts[i % len(prompts)]}]  # noqa: E731
        print(f"references: {len(prompts)} prompts, one request at a time", flush=True)
        reference = [client.chat.completions.create(model="m", messages=ask(i), max_tokens=args.max_tokens,
                                                    temperature=0).choices[0].message.content
                     for i in range(len(prompts))]
        proc = psutil.Process(server.pid)
        rows, errors, rss = [], [], {}
        lock, deadline, done = threading.Lock(), time.time() + args.timeout, [0]

        def one(client_id: int, j: int) -> None:
            i = client_id * args.requests + j
            started = time.perf_counter()
            first, text = None, ""
            stream = client.chat.completions.create(model="m", messages=ask(i), max_tokens=args.max_tokens,
                                                    temperature=0, stream=True)
            for chunk in stream:
                piece = chunk.choices[0].delta.content if chunk.choices else None
                if piece:
                    first = first or time.perf_counter() - started
                    text += piece
            with lock:
                rows.append({"latency": time.perf_counter() - started, "ttft": first, "ok": text == reference[i % len(prompts)],
                             "chars": len(text)})
                done[0] += 1
                if done[0] in (20, args.clients * args.requests):
                    rss[done[0]] = proc.memory_info().rss

        def worker(client_id: int) -> None:
            for j in range(args.requests):
                if time.time() > deadline:
                    return
                try:
                    one(client_id, j)
                except Exception as err:        # noqa: BLE001 (counted and reported)
                    with lock:
                        errors.append(f"{type(err).__name__}: {err}"[:200])

        print(f"load: {args.clients} clients x {args.requests} requests, {args.max_tokens} tokens each", flush=True)
        started = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        metrics = httpx.get(base + "/metrics").json()
    finally:
        server.terminate()
        server.wait(30)
    lat = [r["latency"] for r in rows]
    ttft = [r["ttft"] for r in rows if r["ttft"] is not None]
    report = {"machine": harness.machine_info(), "bundle": args.bundle, "clients": args.clients,
              "requests": len(rows), "errors": len(errors), "wrong_answers": sum(not r["ok"] for r in rows),
              "latency_p50_s": percentile(lat, 0.5), "latency_p95_s": percentile(lat, 0.95),
              "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95), "wall_s": wall,
              "server_tokens_per_s": metrics["tokens_per_second"], "tokens_per_target_call": metrics["tokens_per_target_call"],
              "rss_mib_after_20": rss.get(20, 0) / 2**20, "rss_mib_at_end": rss.get(len(rows), 0) / 2**20,
              "error_samples": errors[:3]}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    sys.exit(1 if errors or report["wrong_answers"] else 0)


if __name__ == "__main__":
    main()
