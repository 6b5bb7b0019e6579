"""Questions written by a bundle's own model, for recording a domain's traffic on many distinct prompts.

Spec-Bench holds 480 questions, and a deployment's traffic is far more varied than the few hundred of
them a benchmark leaves outside its suite. This asks BUNDLE to write questions over --subjects subjects
of a --domain, several per call, sampled with a fixed seed; keeps the distinct ones and writes them in
Spec-Bench's format (question_id from --first-id, category, turns), which bench/record_rescored.py reads
with --prompts-file and bench/run.py with --more-prompts. Domains:

- `general`: the three kinds the adaptation suite's Spec-Bench prompts are (open questions on a subject,
  short factual questions, grade-school math word problems), over a hundred everyday subjects;
- `internet-support`: what the customers of a home internet provider ask its support assistant (a
  problem they have, or how to do something), on forty of its topics: one deployment's narrow traffic.

    .venv/bin/python bench/write_questions.py --bundle models/default-int4 --out FILE [--domain D --subjects N]
    ... --seed 1 --first-id 21001 --avoid FILE      # more of the same domain: other samples, none of FILE's questions

Prints each call's questions kept and time, and at the end how many were kept of how many written.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

SUBJECTS = (
    "astronomy", "volcanoes", "ocean currents", "the human immune system", "photosynthesis", "genetics",
    "electric cars", "renewable energy", "the Roman Empire", "the French Revolution", "ancient Egypt",
    "the Cold War", "world religions", "classical music", "jazz", "painting", "architecture", "poetry",
    "philosophy of mind", "ethics", "economics", "inflation", "personal finance", "the stock market",
    "cooking", "baking bread", "nutrition", "sleep", "running", "football", "chess", "gardening",
    "beekeeping", "birds", "dogs", "cats", "climate change", "forests", "rivers and lakes", "deserts",
    "the internet", "computer programming", "databases", "cybersecurity", "artificial intelligence",
    "smartphones", "trains", "aviation", "shipping", "city planning", "public health", "vaccines",
    "psychology", "language learning", "grammar", "geography of Europe", "geography of Asia",
    "geography of Africa", "the Americas", "mathematics history", "statistics", "probability",
    "chemistry", "physics of light", "electricity", "magnetism", "weather", "earthquakes", "medicine",
    "dentistry", "law", "elections", "human rights", "film", "television", "video games", "board games",
    "fashion", "textiles", "coffee", "tea", "wine making", "farming", "fishing", "mountains", "islands",
    "museums", "libraries", "schools", "universities", "careers", "job interviews", "small businesses",
    "marketing", "shopping", "housing", "travel planning", "hotels", "festivals", "holidays",
)

KINDS = {
    "open": "Write {n} different questions that people might ask an AI assistant about {subject}. Each "
            "asks for an explanation, advice or a comparison.",
    "qa": "Write {n} different short factual questions about {subject}, each answered by a name, a "
          "number or one sentence.",
    "math_reasoning": "Write {n} different grade-school math word problems about {subject}, each needing "
                      "two to four steps of arithmetic. Do not give the answers.",
}

SUPPORT_TOPICS = (
    "setting up a new router", "the WiFi password", "slow WiFi in some rooms", "mesh WiFi extenders",
    "the internet connection dropping out", "a red or blinking light on the router", "fibre installation",
    "DSL line speed", "cable modem activation", "the monthly bill", "a price increase", "changing the tariff",
    "moving house", "cancelling the contract", "the minimum contract term", "an outage in the area",
    "a technician appointment", "returning old equipment", "port forwarding", "a static IP address", "IPv6",
    "DNS settings", "parental controls", "the guest network", "the landline phone over the internet",
    "TV streaming over the connection", "online gaming latency", "video calls freezing", "the router's admin page",
    "a firmware update", "a factory reset of the router", "the mobile data backup", "the customer account login",
    "direct debit and payment methods", "a late payment reminder", "a speed test result below the contract speed",
    "connecting a printer or smart TV", "smart home devices on the WiFi", "security and a hacked network",
    "working from home with a VPN",
)

DOMAINS = {
    "general": (SUBJECTS, KINDS),
    "internet-support": (SUPPORT_TOPICS, {
        "problem": "Write {n} different messages that customers of a home internet provider send to its support "
                   "assistant about a problem with {subject}. Each describes the customer's situation in one "
                   "sentence and ends with a question.",
        "howto": "Write {n} different questions that customers of a home internet provider ask its support "
                 "assistant about {subject}: how to do something, what it costs, or what their options are.",
    }),
}

LINE = re.compile(r"^\s*(?:\d+[.)]|[-*])\s*(?:\*\*[^*]*\*\*:?\s*)?(.+?)\s*$")


def parse(text: str) -> list[str]:
    """The numbered or bulleted lines of TEXT that are questions, without their numbers or quotes."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        q = m.group(1).strip().strip('"').strip()
        q = re.sub(r"\s*\([^()]*\)\.?$", "", q)        # an answer the model put in brackets after it
        if len(q) >= 20 and q.endswith("?"):                # instructions and worked steps are not questions
            out.append(q)
    return out


def key(question: str) -> str:
    """What two questions share when they are the same question: lower case, words only."""
    return re.sub(r"\W+", " ", question.lower()).strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=str(harness.ROOT / "models" / "default-int4"),
                    help="the bundle whose model writes the questions")
    ap.add_argument("--out", required=True, type=Path, help="JSONL file to write (Spec-Bench's format)")
    ap.add_argument("--domain", choices=DOMAINS, default="general", help="what the questions are about")
    ap.add_argument("--subjects", type=int, default=None, help="how many of the domain's subjects [default: all]")
    ap.add_argument("--per-call", type=int, default=5, help="questions asked for per call")
    ap.add_argument("--first-id", type=int, default=10001, help="question_id of the first question kept")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--avoid", type=Path, action="append", default=[],
                    help="a questions file whose questions are not kept again (repeatable): to write more of a domain")
    args = ap.parse_args()
    all_subjects, kinds = DOMAINS[args.domain]
    args.subjects = len(all_subjects) if args.subjects is None else args.subjects
    if not 1 <= args.subjects <= len(all_subjects):
        raise SystemExit(f"error: --subjects must be between 1 and {len(all_subjects)} for --domain {args.domain}")
    if args.per_call < 1:
        raise SystemExit("error: --per-call must be at least 1")
    if args.out.exists():
        raise SystemExit(f"error: {args.out} exists; choose another --out or move it away")
    seen = {key(q["prompt"]) for path in args.avoid for q in harness.load_questions(path)}
    avoided = len(seen)

    import spectr_edge

    gen = spectr_edge.load(args.bundle, provider="cpu")
    rows, written, started = [], 0, time.perf_counter()
    step = len(all_subjects) / args.subjects                  # evenly over the list: its neighbours are alike
    subjects = [all_subjects[int(i * step)] for i in range(args.subjects)]
    calls = [(s, k) for s in subjects for k in kinds]
    for i, (subject, kind) in enumerate(calls):
        t0 = time.perf_counter()
        res = gen.generate(kinds[kind].format(n=args.per_call, subject=subject) + " Number them, one per line.",
                           max_new_tokens=48 * args.per_call, temperature=args.temperature,
                           seed=args.seed + i)
        found = parse(res.text)
        written += len(found)
        kept = 0
        for q in found[:args.per_call]:
            if (k := key(q)) in seen:
                continue
            seen.add(k)
            rows.append({"question_id": args.first_id + len(rows), "category": kind, "turns": [q],
                         "subject": subject})
            kept += 1
        print(f"call {i + 1}/{len(calls)}: {subject}, {kind}: {kept} kept, {time.perf_counter() - t0:.1f} s",
              flush=True)
    tmp = args.out.with_name(args.out.name + ".part")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.replace(args.out)
    among = f" (none of them among the {avoided} of --avoid)" if avoided else ""
    print(f"{len(rows)} questions kept of {written} written{among}, in {time.perf_counter() - started:.0f} s: {args.out}")


if __name__ == "__main__":
    main()
