"""The benchmark's arithmetic (bench/report.py, bench/harness.py) on hand-made measurements.

Nothing here is timed: the ms/token values are fixed numbers fed to the report, and the
assertions check its medians and ratios.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import harness  # noqa: E402
import report  # noqa: E402


def _raw():
    methods = [{"name": "base", "tool": "spectr-edge", "temperature": 0.0, "config": {"k": 0}, "baseline": True},
               {"name": "spec", "tool": "spectr-edge", "temperature": 0.0, "config": {"k": 1, "L": 3},
                "baseline": False}]
    prompts = [{"id": 1, "category": "writing", "task": "mt_bench"}, {"id": 2, "category": "rag", "task": "rag"},
               {"id": 3, "category": "rag", "task": "rag"}]
    ms = {("base", 1): 200.0, ("spec", 1): 100.0,      # 2.0x
          ("base", 2): 150.0, ("spec", 2): 100.0,      # 1.5x
          ("base", 3): 120.0, ("spec", 3): 120.0}      # 1.0x
    rows = []
    for (m, pid), v in ms.items():
        rows.append({"method": m, "prompt_id": pid, "ms_per_token": v, "ttft_s": 0.5, "tokens_per_s": 1000 / v,
                     "peak_rss": 2**30, "outside_ort": 0.01, "accepted": 6 if m == "spec" else 0,
                     "drafted": 9 if m == "spec" else 0, "tokens_per_call": 2.0 if m == "spec" else 1.0,
                     "reached": [3, 2, 1] if m == "spec" else [], "accepted_at": [2, 1, 0] if m == "spec" else []})
    rows.append({"method": "spec", "prompt_id": 4, "error": "boom", "peak_rss": 0})   # a failed generation
    meta = {"methods": methods, "prompts": prompts, "command": "x", "subset": "ids-1,2,3", "max_new_tokens": 8,
            "date": "today", "machine": {"git_commit": None}}
    return {"meta": meta, "rows": rows}


def test_speedup_is_the_median_of_per_prompt_ratios():
    table = {t["method"]: t for t in report.summary(_raw())}
    assert table["spec"]["speedup"] == pytest.approx(1.5)          # median of 2.0, 1.5, 1.0
    assert table["base"]["speedup"] == pytest.approx(1.0)
    assert table["spec"]["ms_per_token"] == pytest.approx(100.0)
    assert table["spec"]["acceptance"] == pytest.approx(18 / 27)   # accepted / drafted summed over prompts
    assert table["spec"]["acceptance_by_position"] == pytest.approx([2 / 3, 1 / 2, 0.0])
    assert table["spec"]["errors"] == ["boom"] and table["spec"]["prompts"] == 3


def test_specbench_overall_is_the_ratio_of_mean_tokens_per_second():
    table = {t["method"]: t for t in report.summary(_raw())}
    # tokens/s: base 5, 6.67, 8.33 (mean 6.67); spec 10, 10, 8.33 (mean 9.44): 28.33 / 20 = 1.4167,
    # not the median of per-prompt ratios (1.5) nor their mean (1.5)
    assert table["spec"]["specbench_overall"] == pytest.approx((10 + 10 + 1000 / 120) / (5 + 1000 / 150 + 1000 / 120))
    assert table["base"]["specbench_overall"] is None
    assert "| 1.42x |" in report.markdown(_raw())


def test_per_task_speedups():
    by_task = report.per_task(_raw())["spec"]
    assert by_task["mt_bench"] == pytest.approx(2.0)
    assert by_task["rag"] == pytest.approx(1.25)                   # median of 1.5 and 1.0


def test_markdown_names_failures_and_tasks():
    text = report.markdown(_raw())
    assert "| spec (failed: boom) | 3 |" in text and "| spec | 2.00 | 1.25 |" in text


def test_by_language_splits_the_table_when_prompts_asked_for_another_language():
    assert report.by_language(_raw()) == []                        # one language: no such table
    raw = _raw()
    raw["meta"]["prompts"][0]["language"] = "de"                   # prompt 1 answered in German
    lines = report.by_language(raw)
    # German: prompt 1 alone (2.0x, first position 2/3); as asked: prompts 2 and 3 (median of 1.5 and 1.0)
    assert "| spec | de | 1 | 100.0 | 2.00x | 2.00 | 0.667 | 0.667 |" in lines
    assert "| spec | as asked | 2 | 110.0 | 1.25x | 2.00 | 0.667 | 0.667 |" in lines
    assert "| base | de | 1 | 200.0 | 1.00x | 1.00 | - | - |" in lines


def test_stratified_subset_takes_each_task_and_spreads_mt_bench():
    if not harness.PROMPTS_FILE.is_file():
        pytest.skip(f"Spec-Bench prompts not beside the checkout ({harness.PROMPTS_FILE})")
    questions = harness.load_questions()
    chosen = harness.select_prompts(questions, "stratified-2")
    assert [q["task"] for q in chosen] == [t for t in harness.TASKS for _ in range(2)]
    assert [q["category"] for q in chosen[:2]] == ["writing", "roleplay"]   # round-robin over MT-bench
    assert len({q["id"] for q in chosen}) == 12
    assert [q["id"] for q in harness.select_prompts(questions, "first-3")] == [81, 82, 83]
    with pytest.raises(SystemExit, match="unknown prompt subset"):
        harness.select_prompts(questions, "random-3")


def test_language_prefix_asks_for_the_answer_in_it_and_plus_joins_subsets():
    if not harness.PROMPTS_FILE.is_file():
        pytest.skip(f"Spec-Bench prompts not beside the checkout ({harness.PROMPTS_FILE})")
    questions = harness.load_questions()
    plain = {q["id"]: q["prompt"] for q in questions}
    chosen = harness.select_prompts(questions, "de:ids-381,391+ids-91")
    assert [(q["id"], q.get("language")) for q in chosen] == [(381, "de"), (391, "de"), (91, None)]
    assert chosen[0]["prompt"] == plain[381] + "\n\nBitte antworte auf Deutsch."
    assert chosen[2]["prompt"] == plain[91]
    raw = _raw()
    raw["meta"]["prompts"] = [{**p, "language": "de"} if p["id"] == 2 else p for p in raw["meta"]["prompts"]]
    assert 'Prompts 2 end with "Bitte antworte auf Deutsch." (answers in de).' in report.markdown(raw)
    with pytest.raises(SystemExit, match="names a question twice"):
        harness.select_prompts(questions, "de:ids-381+ids-381")
    with pytest.raises(SystemExit, match="unknown answer language 'xx'"):
        harness.select_prompts(questions, "xx:ids-381")


def test_written_questions_keep_only_questions_and_load_like_spec_bench(tmp_path):
    import write_questions
    text = ('Here are some questions:\n1. "Why do rivers meander across flat plains?"\n'
            "2) How many moons does Mars have? (2).\n3. Count the first five stars.\n"
            "- **Question 4:** What makes a good loaf of sourdough bread?\n5. Why?\n"
            "A line without a number, ending in a question mark?")
    assert write_questions.parse(text) == ["Why do rivers meander across flat plains?",
                                           "How many moons does Mars have?",
                                           "What makes a good loaf of sourdough bread?"]
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"question_id": 10001, "category": "qa", "turns": ["How many moons does Mars have?"],
                                "subject": "astronomy"}) + "\n")
    chosen = harness.select_prompts(harness.load_questions(path), "de:first-1")
    assert chosen == [{"id": 10001, "category": "qa", "task": "qa", "language": "de",
                       "prompt": "How many moons does Mars have?\n\nBitte antworte auf Deutsch."}]
    # run.py --more-prompts: the written questions beside Spec-Bench's, chosen together by id; ids stay unique
    support = tmp_path / "support.jsonl"
    support.write_text(json.dumps({"question_id": 20001, "category": "howto", "turns": ["How do I reset my router?"],
                                   "subject": "a factory reset of the router"}) + "\n")
    both = harness.select_prompts(harness.load_questions(path, more=[support]), "de:ids-20001+ids-10001")
    assert [(q["id"], q["task"], q.get("language")) for q in both] == [(20001, "howto", "de"), (10001, "qa", None)]
    with pytest.raises(SystemExit, match="share question ids"):
        harness.load_questions(path, more=[path])
    # the run's raw.json names such a file relative to the checkout, so that another clone finds it
    assert harness.repo_path(harness.ROOT / "bench" / "q.jsonl") == "bench/q.jsonl"
    assert harness.repo_path(support) == str(support.resolve())
    # --avoid: the same question, differently cased and punctuated, is the same question; another is not
    assert write_questions.key("How do I reset my router?") == write_questions.key("how do I reset my  router")
    assert write_questions.key("How do I reset my router?") != write_questions.key("How do I reset my modem?")
    assert set(write_questions.DOMAINS) == {"general", "internet-support"}
    assert all("{n}" in k and "{subject}" in k for _, kinds in write_questions.DOMAINS.values() for k in kinds.values())


def _grouped_raw():
    """Three groups run one after the other; the anchor ('base') runs in each, and the machine is
    slower in groups b and c (base 300 and 250 ms instead of 200), which group pairing must cancel."""
    anchor = {"name": "base", "tool": "spectr-edge", "temperature": 0.0, "config": {"k": 0}, "baseline": True}
    methods = [{**anchor, "group": "a"},
               {"name": "spec", "tool": "spectr-edge", "temperature": 0.0, "config": {}, "baseline": False, "group": "a"},
               {**anchor, "group": "b"},
               {"name": "peer plain", "tool": "peer", "temperature": 0.0, "config": {}, "baseline": False,
                "group": "b", "own_baseline": None},
               {"name": "peer spec", "tool": "peer", "temperature": 0.0, "config": {}, "baseline": False,
                "group": "b", "own_baseline": "peer plain"},
               {**anchor, "group": "c"},
               {"name": "peer spec 2", "tool": "peer", "temperature": 0.0, "config": {}, "baseline": False,
                "group": "c", "own_baseline": "peer plain"}]
    ms = {("a", "base"): 200.0, ("a", "spec"): 100.0,
          ("b", "base"): 300.0, ("b", "peer plain"): 150.0, ("b", "peer spec"): 200.0,
          ("c", "base"): 250.0, ("c", "peer spec 2"): 50.0}
    rows = [{"method": m, "group": g, "prompt_id": 1, "ms_per_token": v, "ttft_s": 0.1, "tokens_per_s": 1000 / v,
             "peak_rss": 0} for (g, m), v in ms.items()]
    meta = {"methods": methods, "prompts": [{"id": 1, "category": "rag", "task": "rag"}], "command": "x",
            "subset": "ids-1", "max_new_tokens": 8, "date": "today", "machine": {"git_commit": None},
            "groups": ["a", "b"]}
    return {"meta": meta, "rows": rows}


def test_grouped_runs_pair_each_row_with_its_own_groups_anchor():
    raw = _grouped_raw()
    table = {t["method"]: t for t in report.summary(raw)}
    assert list(table) == ["base", "spec", "peer plain", "peer spec", "peer spec 2"]   # the anchor listed once
    assert table["base"]["prompts"] == 3 and table["base"]["speedup"] == pytest.approx(1.0)
    assert table["spec"]["speedup"] == pytest.approx(2.0)        # 200 / 100, group a
    assert table["peer plain"]["speedup"] == pytest.approx(2.0)  # 300 / 150, group b (not 200 / 150)
    assert table["peer spec"]["speedup"] == pytest.approx(1.5)
    assert table["peer spec"]["vs_own"] == pytest.approx(0.75)   # 150 / 200: slower than its own target-only
    assert table["spec"]["vs_own"] is None
    # own baseline in another group: (250 / 50) / (300 / 150) = 5.0 / 2.0, through both groups' anchors
    assert table["peer spec 2"]["speedup"] == pytest.approx(5.0)
    assert table["peer spec 2"]["vs_own"] == pytest.approx(2.5)
    text = report.markdown(raw)
    assert "vs its own target-only |" in text and "| 0.75x |" in text and "Run in groups" in text


def test_check_greedy_compares_each_bundle_with_its_own_target_only():
    import check_greedy

    def row(method, k, ids, accepted=0):
        return {"method": method, "tool": "spectr-edge", "temperature": 0.0, "prompt_id": 7,
                "config": {"temperature": 0.0, **({"k": k} if k is not None else {"drafter": "lookup"})},
                "token_ids": ids, "accepted": accepted}

    rows = [row("spectr-edge T=0 target-only", 0, [1, 2, 3]),
            row("spectr-edge T=0 target-only [int4 target]", 0, [1, 2, 4]),
            row("spectr-edge T=0 k=1 L=3", 1, [1, 2, 3], 2),
            row("spectr-edge T=0 lookup [int4 target]", None, [1, 2, 4], 1)]
    assert check_greedy.check_rows(rows) == (2, 2, [])
    rows.append(row("spectr-edge T=0 k=1 L=3 [int4 target]", 1, [1, 2, 3], 1))   # fp32's tokens: a difference
    compared, accepting, failures = check_greedy.check_rows(rows)
    assert compared == 3 and len(failures) == 1 and "first difference at token 2" in failures[0]
    # a 1-token-call reference row (other numerics) is neither the target-only to compare with nor compared
    unpadded = row("spectr-edge T=0 target-only, 1-token calls [int4 target]", 0, [1, 2, 5])
    unpadded["config"]["unpadded"] = True
    assert check_greedy.check_rows(rows + [unpadded]) == (compared, accepting, failures)
    # a tag without a target-only of its own (another draft, same target) is compared with the untagged one
    other_draft = row("spectr-edge T=0 default [block-32 draft]", None, [1, 2, 3], 2)
    assert check_greedy.check_rows(rows + [other_draft]) == (compared + 1, accepting + 1, failures)
    other_draft["token_ids"] = [1, 2, 4]
    assert len(check_greedy.check_rows(rows + [other_draft])[2]) == 2
    # "[int4 target, library-only table]": another drafting of the "int4 target" bundle, compared with its target-only
    variant = row("spectr-edge T=0 default [int4 target, library-only table]", None, [1, 2, 4], 1)
    assert check_greedy.check_rows(rows + [variant]) == (compared + 1, accepting + 1, failures)
    variant["token_ids"] = [1, 2, 3]
    assert len(check_greedy.check_rows(rows + [variant])[2]) == 2
