"""Prompt-lookup drafting (spectr_edge/lookup.py): what it copies, and how long a draft it verifies.

Losslessness and greedy equality of the engine with lookup drafts are in test_montecarlo.py."""

from __future__ import annotations

import numpy as np
import pytest

from spectr_edge.lookup import PromptLookup
from spectr_edge.policy import DEFAULT_COST_CURVES, CostCurve

FLAT = CostCurve([(1, 1.0), (32, 1.0)])           # verification free: any positive acceptance pays


def test_search_copies_after_the_longest_matching_ngram():
    lk = PromptLookup(FLAT, max_len=8, max_ngram=3)
    ids = [5, 1, 2, 3, 9, 9, 7, 2, 3, 4, 4, 1, 2, 3]
    # the suffix (1, 2, 3) occurred at 1..3, followed by 9 9 7 ...; (2, 3) alone would also match at 7..8
    assert lk.search(ids, 3) == ([9, 9, 7], 3)
    # only a bigram matches: (4, 8) no; (8,) no -> nothing
    assert lk.search([1, 2, 3, 4, 8], 4) == ([], 0)
    assert lk.search([1, 2, 3, 4, 3], 4) == ([4, 3], 1)       # unigram 3, continuation runs to the end


def test_search_prefers_the_latest_match_with_a_full_continuation():
    lk = PromptLookup(FLAT, max_len=8, max_ngram=2, min_ngram=2)
    ids = [1, 2, 7, 7, 1, 2, 8, 8, 0, 1, 2]
    assert lk.search(ids, 2) == ([8, 8], 2)                 # the later match (4..5), it has 2 tokens after it
    assert lk.search(ids, 6) == ([7, 7, 1, 2, 8, 8], 2)     # only the earliest has 6: the longest continuation


def test_cost_curve_interpolates_and_extrapolates():
    c = CostCurve([(1, 2.0), (4, 3.0), (8, 6.0)])          # normalised: c(1) = 1
    assert c(1) == 1.0 and c(4) == pytest.approx(1.5) and c(2) == pytest.approx(1 + 0.5 / 3)
    assert c(12) == pytest.approx(3.0 + 1.5)                 # the last piece's slope, 0.375 per token
    with pytest.raises(ValueError):
        CostCurve([(2, 1.0)])


@pytest.mark.parametrize("quant", sorted(DEFAULT_COST_CURVES))
def test_length_rule_drafts_only_when_it_pays(quant):
    cost = CostCurve.for_quant(quant)
    lk = PromptLookup(cost, max_len=8)
    for n in lk.accepted:                                   # a drafter that is never right: plain decoding
        lk.accepted[n], lk.reached[n] = 0.0, 100.0
    assert lk.best_length(2, 8) == 0
    for n in lk.accepted:                                   # always right: as long as the curve allows
        lk.accepted[n], lk.reached[n] = 100.0, 100.0
    best = lk.best_length(2, 8)
    rate = lambda L: (L + 1) / cost(L + 1)                  # noqa: E731  expected tokens per cost at a = 1
    assert best >= 1 and all(rate(best) >= rate(L) - 1e-9 for L in range(9))


def test_update_moves_the_estimate_and_propose_uses_it():
    lk = PromptLookup(CostCurve.for_quant("int4"), max_len=8, max_ngram=2, min_ngram=1)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert lk.acceptance(2) == 0.5                          # the prior
    first, n = lk.propose(ids, 8)
    assert n == 2 and 1 <= len(first) < 7                   # the steep int4 curve keeps it short at a = 0.5
    for _ in range(20):
        lk.update(2, 4, 4)                                  # every copied token accepted
    assert lk.acceptance(2) > 0.95
    longer, _ = lk.propose(ids, 8)
    assert len(longer) > len(first) and longer == [3, 4, 5, 6, 7, 8, 9, 1][:len(longer)]
    lk = PromptLookup(CostCurve.for_quant("int4"), max_len=8, max_ngram=2, min_ngram=1)
    for _ in range(40):
        lk.update(2, 4, 0)                                  # every copy rejected at its first token
    assert lk.propose(ids, 8)[0] == []                     # the match is there, but drafting would not pay


# --------------------------------------------------------------------------- static next-token table


def test_table_keeps_the_most_common_follower():
    from spectr_edge.ngram_table import NgramTable, build_table

    corpus = np.asarray([1, 2, 1, 2, 1, 3, 4, 1, 3, 1, 2, 5, 6, 5, 7, 5, 7, 8, 9, 8, 0], dtype=np.int64)
    t = NgramTable(build_table(corpus, 10))
    assert t.guess([0, 1]) == (2, 1)           # 1 -> 2 (3 times) over 1 -> 3 (twice); (0, 1) never seen
    assert t.guess([4, 1]) == (3, 2)           # the pair (4, 1) was followed by 3: two tokens beat one
    assert t.guess([6, 5]) == (7, 2)
    assert t.guess([2, 5]) == (6, 2)
    assert t.guess([3, 8]) == (0, 1)           # 8 -> 9 and 8 -> 0 once each: ties go to the smallest id
    assert t.guess([7, 0]) is None             # 0 ends the corpus: nothing ever followed it
    assert t.guess([]) is None


def test_propose_falls_back_to_the_table_only_without_a_match(tmp_path):
    from spectr_edge.ngram_table import NgramTable, build_table

    table = NgramTable(build_table(np.asarray([4, 5, 6, 4, 5, 6]), 10))
    lk = PromptLookup(CostCurve([(1, 1.0), (2, 1.0), (3, 1.5)]), max_len=8, table=table)  # a padded curve
    assert lk.propose([1, 2, 3, 1], 8)[1] == 1              # the text has a match: copied, not the table's
    assert lk.propose([1, 2, 3, 4], 8) == ([5], -1)          # no match in the text: one token from the table
    assert lk.propose([1, 2, 4, 5], 8) == ([6], -2)          # after two known tokens
    assert lk.propose([1, 2, 3, 7], 8) == ([], 0)            # nothing anywhere: a plain step
    for _ in range(30):
        lk.update(-1, 1, 0)                                   # the table's guesses after one token never hold
    assert lk.propose([1, 2, 3, 4], 8) == ([5], -1)          # still free on a padded curve (c(2) = c(1))
    lk = PromptLookup(CostCurve([(1, 1.0), (2, 1.3)]), max_len=8, table=table)
    for _ in range(30):
        lk.update(-1, 1, 0)
    assert lk.propose([1, 2, 3, 4], 8)[0] == []              # where a second token costs, a bad guess is dropped


def test_guess_chain_drafts_as_many_guesses_as_their_acceptance_pays_for():
    """The guess head's chain: as many guesses as the per-position acceptance pays for, starting from
    the export's measured agreement, one guess again once the later positions fail; each position
    keeps its own estimate, and the chain is asked for exactly the guesses drafted."""
    from spectr_edge.lookup import GUESS

    asked = []

    def chain(n):
        asked.append(n)
        return [20 + j for j in range(n)]

    cost = CostCurve([(1, 1.0), (2, 1.0), (3, 1.3), (4, 1.4), (5, 1.5), (9, 1.9)])   # padded, as int4
    text = [1, 2, 3, 4]                                       # nothing to copy: the guesses decide
    lk = PromptLookup(cost, max_len=6, chain_cost=0.01)
    assert lk.propose(text, 8, guess=9, chain=chain) == ([9], GUESS)   # no prior: 0.5 does not pay here
    lk = PromptLookup(cost, max_len=6, chain_cost=0.01, chain_prior=[0.95, 0.9])
    assert lk.key_acceptance((GUESS, 1)) == 0.95 and lk.key_acceptance((GUESS, 4)) == 0.9
    draft, key = lk.propose(text, 8, guess=9, chain=chain)
    assert key == GUESS and draft == [9, 20, 21, 22, 23, 24] and asked[-1] == 5   # the whole chain
    assert lk.propose(text, 3, guess=9, chain=chain)[0] == [9, 20, 21]            # within the step's budget
    for _ in range(20):                                        # only the first guess holds
        draft, _ = lk.propose(text, 8, guess=9, chain=chain)
        lk.update(GUESS, len(draft), min(1, len(draft)))
    assert lk.propose(text, 8, guess=9, chain=chain)[0] == [9]
    assert lk.key_acceptance(GUESS) > 0.9 > 0.5 > lk.key_acceptance((GUESS, 1))   # dropped after a few misses
    assert lk.propose(text, 8, guess=9)[0] == [9]             # no chain graph: one guess, as before


def test_stdlib_table_is_reproducible(tmp_path):
    """Built twice from the standard library with the same tokenizer: the same arrays."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "def", "self", "return", "(", ")",
                                                                   ":", "import", "the", "if"])}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    from spectr_edge.ngram_table import NgramTable, write_table

    entries = []
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        entries.append(write_table(tmp_path / sub, path, 10, limit_bytes=400_000))
    assert entries[0] == entries[1] and entries[0]["corpus_tokens"] > 10_000
    a, b = (np.load(tmp_path / sub / entries[0]["file"]) for sub in ("a", "b"))
    assert all(np.array_equal(a[k], b[k]) for k in a.files)
    assert NgramTable.load(tmp_path / "a" / entries[0]["file"]).guess([1]) is not None   # "def" -> something
    json.dumps(entries[0])                                   # a manifest entry


def test_weights_decide_the_most_common_follower():
    """A follower seen less often but with more weight (sampled conversation) wins its key."""
    from spectr_edge.ngram_table import build_table

    ids = np.array([1, 2, 1, 2, 1, 2, 1, 3])                       # 1 -> 2 three times, 1 -> 3 once
    plain = build_table(ids, 10)
    assert plain["next1"][list(plain["keys1"]).index(1)] == 2
    heavy = build_table(ids, 10, weights=np.array([1, 1, 1, 1, 1, 1, 1, 4.0]))
    assert heavy["next1"][list(heavy["keys1"]).index(1)] == 3      # 4 > 3


def test_table_matches_counting_by_hand_at_a_real_vocabulary_size():
    """With ids up to a 151,936-token vocabulary (two-token keys up to V^2, paired with the next id in one
    int64), every key's follower is the one a plain dictionary count picks: largest total weight, then
    smallest id."""
    from collections import defaultdict

    from spectr_edge.ngram_table import build_table

    vocab = 151_936
    rng = np.random.default_rng(5)
    ids = rng.choice(np.array([0, 1, 7, 40_000, vocab - 2, vocab - 1]), size=3_000)   # few ids: many repeats, ties
    weights = rng.choice([1.0, 10.0], size=ids.size)
    table = build_table(ids, vocab, weights)
    for n, keys, nexts in [(1, table["keys1"], table["next1"]), (2, table["keys2"], table["next2"])]:
        totals = defaultdict(float)
        for i in range(n, ids.size):
            key = int(ids[i - 1]) if n == 1 else int(ids[i - 2]) * vocab + int(ids[i - 1])
            totals[key, int(ids[i])] += weights[i]
        best = {}
        for (key, nxt), total in sorted(totals.items()):
            if key not in best or total > best[key][1]:
                best[key] = (nxt, total)
        assert keys.tolist() == sorted(best)
        assert nexts.tolist() == [best[k][0] for k in sorted(best)]


def test_sampled_conversations_follow_the_chat_template(tiny_qwen_bundle):
    """self_text.py: each row is the template's opening text, then user turns and answers joined by the
    template's own hand-over tokens; a seed gives the same text, another seed other text."""
    from spectr_edge.bundle import read_bundle
    from spectr_edge.onnx_model import OnnxLM
    from spectr_edge.self_text import OPENERS, sample_conversations, turn_pieces
    from spectr_edge.text import TextCodec

    b = read_bundle(tiny_qwen_bundle)
    codec = TextCodec(b.tokenizer)
    before, to_answer, to_user = turn_pieces(codec)
    assert codec.tokenizer.decode(to_answer, skip_special_tokens=False) == "<|im_end|>\n<|im_start|>assistant\n"
    assert codec.tokenizer.decode(to_user, skip_special_tokens=False) == "<|im_end|>\n<|im_start|>user\n"
    model = OnnxLM(b.draft, provider="cpu", threads=1)
    sample = lambda seed: sample_conversations(model, codec, b.tokenizer.vocab_size,  # noqa: E731
                                               b.tokenizer.eos_token_ids, 512, batch=4, seed=seed)
    rows = sample(0)
    assert len(rows) == 4 and sum(len(r) - len(before) for r in rows) == 512
    openers = {codec.tokenizer.encode(w, add_special_tokens=False).ids[0] for w in OPENERS}

    def at(row, piece):
        return [i for i in range(len(row) - len(piece) + 1) if row[i:i + len(piece)] == piece]

    for row in rows:
        assert row[:len(before)] == before and row[len(before)] in openers
        row = row[len(before):]
        asks, answers = at(row, to_answer), at(row, to_user)
        assert asks, "every row reaches an answer within MAX_ASK tokens"
        # turns alternate: user (opener ...), to_answer, answer, to_user, opener, ...
        marks = sorted([(i, "a") for i in asks] + [(i, "u") for i in answers])
        assert all(x[1] != y[1] for x, y in zip(marks, marks[1:])) and marks[0][1] == "a"
        for i in answers:
            if i + len(to_user) < len(row):
                assert row[i + len(to_user)] in openers
    assert sample(0) == rows and sample(1) != rows


@pytest.mark.parametrize("quant, has_draft, temperature, expected", [
    ("int4", True, 0.0, {"drafter": "lookup", "num_candidates": 1}),
    ("int8", True, 1.0, {"drafter": "lookup", "num_candidates": 1}),
    ("int8", False, 0.0, {"drafter": "lookup", "num_candidates": 1}),
    ("none", True, 0.0, {"drafter": "model+lookup"}),
    ("none", True, 1.0, {}),
    ("none", False, 0.0, {}),
])
def test_untuned_bundles_get_the_builtin_choice_and_tuned_ones_theirs(quant, has_draft, temperature, expected):
    from types import SimpleNamespace

    from spectr_edge.generator import tuned_options
    bundle = SimpleNamespace(target=SimpleNamespace(quant=quant), draft=object() if has_draft else None,
                             manifest={})
    assert tuned_options(bundle, temperature) == expected
    bundle.manifest = {"defaults": {"greedy": {"drafter": "model", "draft_len": 3, "unknown": 1},
                                    "sampling": {"drafter": "model", "num_candidates": 2}}}
    assert tuned_options(bundle, temperature) == ({"drafter": "model", "draft_len": 3} if temperature == 0
                                                  else {"drafter": "model", "num_candidates": 2})


# --------------------------------------------------------------------------- several candidates, one trie


def test_candidates_are_distinct_continuations_primary_first():
    lk = PromptLookup(FLAT, max_len=8, max_ngram=2, min_ngram=1)
    ids = [1, 2, 7, 7, 1, 2, 8, 8, 3, 2, 9, 1, 2]
    cands = lk.candidates(ids, 2, count=8)
    assert cands[0] == (lk.search(ids, 2)[0], 2) == ([8, 8], 2)        # what propose() would copy
    # the other (1, 2) match, then the unigram 2's other continuations (9 1; 7 7 / 8 8 already in)
    assert cands[1:] == [([7, 7], ("alt", 2)), ([9, 1], ("alt", 1))]
    assert lk.candidates(ids, 2, count=2) == cands[:2]
    assert lk.candidates([1, 2, 3], 4, count=4) == []                   # nothing earlier matches, no table


def test_trie_keeps_the_nodes_that_pay():
    lk = PromptLookup(FLAT, max_len=8, max_ngram=2, min_ngram=1)
    ids = [1, 2, 7, 7, 1, 2, 8, 8, 3, 2, 9, 1, 2]
    rows, verified = lk.propose_trie(ids, 2, count=8)
    assert sorted(rows) == [[7, 7], [8, 8], [9, 1]]                       # free verification: everything
    assert [held for _, _, held in verified] == [2, 2, 2]
    steep = CostCurve([(1, 1.0), (2, 1.2), (3, 2.4), (8, 8.0)])
    lk = PromptLookup(steep, max_len=8, max_ngram=2, min_ngram=1)
    rows, verified = lk.propose_trie(ids, 2, count=8)
    assert rows == [[8]]                # at the prior 0.5: one node pays (1.5 / 1.2), a second does not
    assert [held for _, _, held in verified] == [1, 0, 0]
    lk.update_trie(verified, [8, 5])                                    # the copied 8 was right
    assert lk.acceptance(2) == pytest.approx(2 / 3) and lk.key_acceptance(("alt", 2)) == 0.5
    for _ in range(20):
        lk.update_trie([([8, 8], 2, 1)], [4])                           # then always wrong
    assert lk.propose_trie(ids, 2, count=8)[0] == [[7]]                 # the likeliest now: an alternative
    for _ in range(20):
        lk.update_trie([([7, 7], ("alt", 2), 1), ([9, 1], ("alt", 1), 1)], [4])
    assert lk.propose_trie(ids, 2, count=8)[0] == []                    # none pays: a plain step


def test_table_chain_joins_the_trie(tmp_path):
    from spectr_edge.ngram_table import NgramTable, build_table

    table = NgramTable(build_table(np.asarray([4, 5, 6, 4, 5, 6]), 10))
    lk = PromptLookup(FLAT, max_len=8, table=table)
    assert lk.candidates([1, 2, 3, 4], 3, count=4) == [([5, 6, 4], -1)]     # no text match: the table's chain
    cands = lk.candidates([4, 1, 2, 4], 3, count=4)                         # 4 occurred before: copied first
    assert cands == [([1, 2, 4], 1), ([5, 6, 4], ("alt", -1))]
