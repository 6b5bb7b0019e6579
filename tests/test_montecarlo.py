"""Monte Carlo: the whole engine's output law == sampling the target alone (docs/ALGORITHMS.md).

The toy bundle of tests/toy_lm.py (vocab 5) is run through `spectr_edge.load` and
`generate_ids` many times with fixed seeds; the empirical law of the generated tokens
is compared with the exact law enumerated in NumPy (toy_lm.exact_sequence_law, our
own logits processing, not spectr_edge.sampling) by a chi-square goodness-of-fit test.

What is compared. Each draw generates MAX_NEW_TOKENS = 6 tokens; the test checks the
joint law of tokens 1-3 and, separately, of tokens 4-6 (125 cells each; the exact
window-2 law is the 6-token law summed over tokens 1-3). Why 6: the engine emits token 1
from the prefill and clamps a step's draft length to the remaining budget, so with 3
tokens only one step with draft_len 1 would ever run; with 6 the first step drafts the
full L <= 3 and tokens 4-6 come after one or more commits (cache crops, bonus tokens,
draft catch-up), where a wrong crop or row shows up.

Chi-square test. Cells with expected count < MIN_EXPECTED are pooled into one cell
(merged into the smallest cell if the pool itself is < MIN_EXPECTED); an observation in a
zero-probability cell fails outright. The statistic is compared with the upper
P_VALUE = 1e-4 quantile of chi2(cells - 1), by the Wilson-Hilferty approximation
    chi2_q(df) = df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3,  z = Phi^-1(1 - 1e-4) = 3.719
(within 1% of the exact quantile for df >= 20; checked against mpmath when written:
df = 124 gives 191.4 vs exact 191.3). Seeds are fixed, so a pass or fail is reproducible.

Power. Negative controls must be REJECTED by the same test: the naive multi-draft rule
(rho = 1, docs/ALGORITHMS.md) patched into spectr_edge.selection, correct samples compared
with the target law at a wrong temperature (0.9 for 1.0), and one broken rule per drafter
(a tree without its cache gather, Sequoia without its residual, lookup accepting every
copy, ...). The broken rules are rejected at NEGATIVE_DRAWS = 5,000 draws, fewer than the
CI_DRAWS = 6,000 every positive test uses (the wrong temperature is checked on a CI config's
own draws), so an error of their size cannot hide in a CI run; the slow grid (FULL_DRAWS)
resolves errors about 4x smaller.

CI runs CI_CONFIGS (every k, every L, both temperatures and the filters at least once);
the full grid at FULL_DRAWS draws per config is marked slow.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import pytest

from toy_lm import build_toy_bundle, exact_sequence_law

VOCAB_SIZE = 5                    # the padded id 5 (logit +30) must never be emitted
MAX_NEW_TOKENS = 6
WINDOWS = {"tokens 1-3": slice(0, 3), "tokens 4-6": slice(3, 6)}
P_VALUE = 1e-4
MIN_EXPECTED = 5.0
CI_DRAWS = 6_000                  # 3-8 ms per 6-token draw on 2 cores: 20-50 s per config
FULL_DRAWS = 100_000              # slow grid: ~2 hours on one core
NEGATIVE_DRAWS = 5_000            # rho = 1 gives chi2 ~2-7x the threshold already at 8000 draws
SHORT_PROMPT, LONG_PROMPT = (0,), (2, 0, 3, 1, 4)


@dataclass(frozen=True)
class Config:
    num_candidates: int           # 0 = target only
    draft_len: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    prompt: tuple[int, ...] = SHORT_PROMPT
    draws: int = CI_DRAWS
    seed: int = 0
    draft_stop: float = 0.0       # adaptive draft length (stop on low draft confidence)
    drafter: str | None = None    # None = the draft model; "lookup" | "model+lookup" = prompt lookup
    adaptive: bool = False        # per-step draft length from policy.AdaptiveLength
    tree_budget: int = 0          # a draft tree of this many nodes (sampling: a Sequoia tree; greedy: OPT-Tree)
    penalties: tuple = (0.0, 0.0, 1.0)   # (presence, frequency, repetition), 1.0 = no repetition penalty

    def __str__(self) -> str:
        filters = f"-topk{self.top_k}-topp{self.top_p}" if self.top_k or self.top_p < 1 else ""
        stop = f"-stop{self.draft_stop}" if self.draft_stop else ""
        stop += f"-{self.drafter}" if self.drafter else ""
        stop += "-adaptive" if self.adaptive else ""
        stop += f"-tree{self.tree_budget}" if self.tree_budget else ""
        stop += "-penalties" + "_".join(f"{x:g}" for x in self.penalties) if self.penalties != (0.0, 0.0, 1.0) else ""
        return (f"k{self.num_candidates}-L{self.draft_len}-T{self.temperature}{filters}{stop}"
                f"-prompt{len(self.prompt)}-n{self.draws}")


CI_CONFIGS = [
    Config(0, 1, 1.0),                                      # target only: validates test + exact law
    Config(1, 1, 1.0, seed=1),                              # standard speculative sampling
    Config(2, 2, 1.0, seed=2),
    Config(4, 3, 1.0, seed=3),
    Config(4, 1, 0.7, seed=4),
    Config(2, 3, 0.7, top_k=3, top_p=0.9, seed=5),
    Config(1, 2, 1.0, top_p=0.9, prompt=LONG_PROMPT, seed=6),
    Config(4, 2, 0.7, top_k=3, prompt=LONG_PROMPT, seed=7),
    Config(1, 3, 1.0, seed=8, draft_stop=0.6),              # adaptive draft length
]

_FULL_SETTINGS = [(k, L, t, top_k, top_p, prompt)
                  for k in (1, 2, 4) for L in (1, 2, 3) for t in (1.0, 0.7)
                  for top_k, top_p in ((0, 1.0), (3, 0.9))
                  for prompt in ((SHORT_PROMPT, LONG_PROMPT) if (k, L) == (2, 2) else (SHORT_PROMPT,))]
_FULL_SETTINGS += [(0, 1, t, top_k, top_p, SHORT_PROMPT) for t in (1.0, 0.7) for top_k, top_p in ((0, 1.0), (3, 0.9))]
FULL_GRID = [Config(*setting, draws=FULL_DRAWS, seed=100 + i) for i, setting in enumerate(_FULL_SETTINGS)]


# --------------------------------------------------------------------------- chi-square


def chi2_quantile(df: int, p_value: float = P_VALUE) -> float:
    """Upper p_value quantile of chi2(df), Wilson-Hilferty approximation."""
    z = NormalDist().inv_cdf(1.0 - p_value)
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(counts: Counter, law: dict, n: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the observed counts against n draws of `law`."""
    if any(law.get(cell, 0.0) == 0.0 for cell in counts):
        return math.inf, 1                               # an impossible sequence was emitted
    cells = [(n * p, counts.get(cell, 0)) for cell, p in law.items() if n * p >= MIN_EXPECTED]
    pooled = [(n * p, counts.get(cell, 0)) for cell, p in law.items() if 0 < n * p < MIN_EXPECTED]
    cells.sort()
    if pooled:
        pool = (sum(e for e, _ in pooled), sum(o for _, o in pooled))
        if pool[0] < MIN_EXPECTED and cells:             # too small alone: merge into the smallest cell
            pool = (pool[0] + cells[0][0], pool[1] + cells[0][1])
            cells = cells[1:]
        cells.append(pool)
    stat = sum((o - e) ** 2 / e for e, o in cells)
    return stat, len(cells) - 1


def window_laws(bundle, cfg: Config, temperature: float | None = None) -> dict[str, dict]:
    """Exact law of each window of the target-only output (6-token law marginalised)."""
    t = cfg.temperature if temperature is None else temperature
    full = exact_sequence_law(bundle, cfg.prompt, MAX_NEW_TOKENS, t, cfg.top_k, cfg.top_p, cfg.penalties)
    laws = {}
    for name, window in WINDOWS.items():
        law = Counter()
        for seq, prob in full.items():
            law[seq[window]] += prob
        laws[name] = dict(law)
    return laws


# --------------------------------------------------------------------------- drawing


@dataclass
class Draws:
    counts: dict[str, Counter]   # window name -> Counter of token tuples
    n: int
    accepted: int
    drafted: int
    target_calls: int
    draft_calls: int
    seconds: float
    scored: int = 0               # tokens the target scored in speculative steps
    steps: int = 0
    lookup_steps: int = 0         # steps that verified a prompt-lookup draft
    undrafted: int = 0            # steps the adaptive length rule decoded plainly
    lookup_tries: int = 0         # lookup steps that verified several candidates as one trie
    guess_steps: int = 0          # lookup steps whose draft was the target's guess head's
    guess_accepted: int = 0
    guess_drafted: int = 0        # guesses those steps drafted (more than one per step: the chain's)


def draw(gen, cfg: Config) -> Draws:
    """cfg.draws independent generations with one seeded generator."""
    rng = np.random.default_rng(cfg.seed)
    counts = {name: Counter() for name in WINDOWS}
    totals = Counter()
    started = time.perf_counter()
    for _ in range(cfg.draws):
        # prompt lookup's candidates are its lookup_candidates; the draft model's are SpecTr's k
        candidates = (dict(lookup_candidates=cfg.num_candidates) if cfg.drafter == "lookup"
                      else dict(num_candidates=cfg.num_candidates))
        res = gen.generate_ids(list(cfg.prompt), max_new_tokens=MAX_NEW_TOKENS, temperature=cfg.temperature,
                               top_k=cfg.top_k, top_p=cfg.top_p, draft_len=cfg.draft_len, draft_stop=cfg.draft_stop,
                               drafter=cfg.drafter, adaptive=cfg.adaptive, tree_budget=cfg.tree_budget, rng=rng,
                               presence_penalty=cfg.penalties[0], frequency_penalty=cfg.penalties[1],
                               repetition_penalty=cfg.penalties[2], **candidates)
        ids = tuple(res.token_ids)
        assert len(ids) == MAX_NEW_TOKENS, ids               # eos_token_ids is empty
        assert all(0 <= t < VOCAB_SIZE for t in ids), f"padding or out-of-range id emitted: {ids}"
        for name, window in WINDOWS.items():
            counts[name][ids[window]] += 1
        s = res.stats
        totals.update(accepted=s.accepted, drafted=s.drafted, target_calls=s.target_calls,
                      draft_calls=s.draft_calls, scored=s.scored, steps=s.steps, lookup_steps=s.lookup_steps,
                      undrafted=s.undrafted, lookup_tries=s.lookup_tries, guess_steps=s.guess_steps,
                      guess_accepted=s.guess_accepted, guess_drafted=s.guess_drafted)
    return Draws(counts, cfg.draws, totals["accepted"], totals["drafted"], totals["target_calls"],
                 totals["draft_calls"], time.perf_counter() - started, totals["scored"], totals["steps"],
                 totals["lookup_steps"], totals["undrafted"], totals["lookup_tries"], totals["guess_steps"],
                 totals["guess_accepted"], totals["guess_drafted"])


def check_law(draws: Draws, laws: dict[str, dict]) -> list[str]:
    """Failure messages (empty when every window passes), with the worst cells."""
    failures = []
    for name, law in laws.items():
        stat, df = chi_square(draws.counts[name], law, draws.n)
        limit = chi2_quantile(df)
        if not stat <= limit:
            worst = sorted(law, key=lambda c: -abs(draws.counts[name].get(c, 0) - draws.n * law[c])
                           / math.sqrt(max(draws.n * law[c], 1.0)))[:5]
            cells = ", ".join(f"{c}: observed {draws.counts[name].get(c, 0)} expected {draws.n * law[c]:.1f}"
                              for c in worst)
            failures.append(f"{name}: chi2 {stat:.1f} > {limit:.1f} (df {df}); worst cells {cells}")
    return failures


def chi_square_stats(draws: Draws, laws: dict[str, dict]) -> list[tuple[float, float]]:
    """(statistic, threshold) per window."""
    out = []
    for name, law in laws.items():
        stat, df = chi_square(draws.counts[name], law, draws.n)
        out.append((stat, chi2_quantile(df)))
    return out


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return build_toy_bundle(tmp_path_factory.mktemp("toy_mc"), seed_target=11, seed_draft=12)


@pytest.fixture(scope="module")
def gen(bundle):
    import spectr_edge

    return spectr_edge.load(bundle, provider="cpu", threads=1)


_DRAWS: dict[Config, Draws] = {}   # CI draws, reused by the wrong-temperature control


def cached_draws(gen, cfg: Config) -> Draws:
    if cfg not in _DRAWS:
        _DRAWS[cfg] = draw(gen, cfg)
    return _DRAWS[cfg]


def assert_engine_follows_target(bundle, gen, cfg: Config, draws: Draws) -> None:
    if cfg.num_candidates == 0:
        assert draws.accepted == 0 and draws.draft_calls == 0
    else:  # speculation really happened: drafts were accepted, and some rejected
        assert draws.accepted > 0 and draws.drafted > draws.accepted, (draws.accepted, draws.drafted)
        assert draws.target_calls < draws.n * MAX_NEW_TOKENS      # fewer target calls than tokens
    laws = window_laws(bundle, cfg)
    print(f"{cfg}: {draws.seconds:.0f} s, accepted {draws.accepted}/{draws.drafted}, chi2 (stat, limit) "
          + ", ".join(f"{s:.1f}/{t:.1f}" for s, t in chi_square_stats(draws, laws)))
    failures = check_law(draws, laws)
    assert not failures, f"{cfg}: output law differs from the target's:\n" + "\n".join(failures)


def assert_law_rejected(bundle, cfg: Config, draws: Draws) -> None:
    """Negative controls: the chi-square test must reject the target law in some window."""
    stats = chi_square_stats(draws, window_laws(bundle, cfg))
    assert any(stat > limit for stat, limit in stats), stats


# --------------------------------------------------------------------------- tests


def test_chi_square_machinery_on_exact_samples(bundle):
    """Without the engine: multinomial samples of the exact law pass, of a wrong law fail."""
    cfg = CI_CONFIGS[5]
    laws = window_laws(bundle, cfg)
    wrong = window_laws(bundle, cfg, temperature=0.8)
    rng = np.random.default_rng(0)
    for name, law in laws.items():
        cells = list(law)
        drawn = rng.multinomial(CI_DRAWS, np.array([law[c] for c in cells]) / sum(law.values()))
        counts = Counter({c: int(m) for c, m in zip(cells, drawn) if m})
        stat, df = chi_square(counts, law, CI_DRAWS)
        assert stat <= chi2_quantile(df), (name, stat, df)
        stat, df = chi_square(counts, wrong[name], CI_DRAWS)
        assert stat > chi2_quantile(df), (name, stat, df)
    assert abs(chi2_quantile(124) - 191.28) < 0.5    # exact chi2(124) 0.9999 quantile: 191.28


@pytest.mark.parametrize("cfg", CI_CONFIGS, ids=str)
def test_output_law_equals_target(bundle, gen, cfg):
    assert_engine_follows_target(bundle, gen, cfg, cached_draws(gen, cfg))


@pytest.mark.slow
@pytest.mark.parametrize("cfg", FULL_GRID, ids=str)
def test_output_law_equals_target_full_grid(bundle, gen, cfg):
    assert_engine_follows_target(bundle, gen, cfg, draw(gen, cfg))


def test_negative_control_wrong_temperature(bundle, gen):
    """Correct speculative samples against the law at temperature 0.9 instead of 1.0: rejected."""
    cfg = CI_CONFIGS[3]                               # k=4, L=3, T=1.0
    draws = cached_draws(gen, cfg)
    stats = chi_square_stats(draws, window_laws(bundle, cfg, temperature=0.9))
    assert all(stat > limit for stat, limit in stats), stats


@pytest.mark.parametrize("num_candidates", [2, 4])
def test_negative_control_rho_one(bundle, gen, monkeypatch, num_candidates):
    """Naive multi-draft selection (rho = 1, no K-SEQ division) is not lossless: rejected."""
    from spectr_edge import selection

    def naive_plan(draft_probs, target_probs, num_candidates):
        return selection.plan_at_rho(draft_probs, target_probs, num_candidates, 1.0)

    monkeypatch.setattr(selection, "kseq_rho", naive_plan)
    cfg = Config(num_candidates, 1, 1.0, draws=NEGATIVE_DRAWS, seed=40 + num_candidates)
    draws = draw(gen, cfg)
    assert draws.accepted > 0
    assert_law_rejected(bundle, cfg, draws)


def test_greedy_speculative_equals_target_only(gen):
    """temperature 0: token-for-token equality with plain target greedy decoding."""
    rng = np.random.default_rng(9)
    accepted = drafted = 0
    for trial in range(24):
        prompt = [int(t) for t in rng.integers(0, VOCAB_SIZE, int(rng.integers(1, 6)))]
        plain = gen.generate_ids(prompt, max_new_tokens=16, temperature=0.0, num_candidates=0).token_ids
        for num_candidates, draft_len in ((1, 1), (2, 3), (4, 2), (1, 5)):
            res = gen.generate_ids(prompt, max_new_tokens=16, temperature=0.0, num_candidates=num_candidates,
                                   draft_len=draft_len, seed=trial)
            assert res.token_ids == plain, (prompt, num_candidates, draft_len)
            accepted += res.stats.accepted
            drafted += res.stats.drafted
    assert 0 < accepted < drafted, (accepted, drafted)


# --------------------------------------------------------------------------- tree verification
# The same toy models with a 4D mask input (export/tree_mask.py): k > 1 candidates are scored as one
# token trie in a batch-1 call and the accepted path's cache entries are gathered (docs/ALGORITHMS.md).

TREE_CONFIGS = [
    Config(2, 2, 1.0, seed=20),
    Config(4, 3, 1.0, seed=21),
    Config(4, 2, 0.7, top_k=3, top_p=0.9, prompt=LONG_PROMPT, seed=22),
]


@pytest.fixture(scope="module")
def tree_bundle(tmp_path_factory):
    return build_toy_bundle(tmp_path_factory.mktemp("toy_tree"), seed_target=11, seed_draft=12, tree_mask=True)


@pytest.fixture(scope="module")
def tree_gen(tree_bundle):
    import spectr_edge

    gen = spectr_edge.load(tree_bundle, provider="cpu", threads=1)
    assert gen.target.takes_tree
    return gen


def assert_trie_was_used(cfg: Config, draws: Draws) -> None:
    # replication scores k x (L + 1) tokens per step; a trie shares the root and common prefixes
    assert draws.scored < draws.steps * cfg.num_candidates * (cfg.draft_len + 1), (draws.scored, draws.steps)


@pytest.mark.parametrize("cfg", TREE_CONFIGS, ids=str)
def test_tree_verification_output_law_equals_target(tree_bundle, tree_gen, cfg):
    draws = draw(tree_gen, cfg)
    assert_trie_was_used(cfg, draws)
    assert_engine_follows_target(tree_bundle, tree_gen, cfg, draws)


def test_negative_control_tree_without_gather(tree_bundle, tree_gen, monkeypatch):
    """Committing a trie path by cropping (keeping the first nodes, not the path's) is detected."""
    from spectr_edge.kv_cache import KVCache

    def crop_instead(self, keep, positions):
        self.crop(keep + len(positions))

    monkeypatch.setattr(KVCache, "gather", crop_instead)
    cfg = Config(4, 3, 1.0, draws=NEGATIVE_DRAWS, seed=23)
    draws = draw(tree_gen, cfg)
    assert_trie_was_used(cfg, draws)
    assert_law_rejected(tree_bundle, cfg, draws)


def test_tree_greedy_equals_target_only(tree_gen):
    """Greedy with a tree target: branches = 1 is the chain; more add branches - 1 side leaves per depth."""
    rng = np.random.default_rng(19)
    accepted = leaves = 0
    for trial in range(12):
        prompt = [int(t) for t in rng.integers(0, VOCAB_SIZE, int(rng.integers(1, 6)))]
        plain = tree_gen.generate_ids(prompt, max_new_tokens=16, temperature=0.0, num_candidates=0).token_ids
        for branches, draft_len in ((1, 3), (4, 2), (2, 3), (3, 4)):
            res = tree_gen.generate_ids(prompt, max_new_tokens=16, temperature=0.0, draft_stop=0.0,
                                        branches=branches, draft_len=draft_len)
            assert res.token_ids == plain, (prompt, branches, draft_len)
            accepted += res.stats.accepted
            leaves += res.stats.scored - res.stats.drafted - res.stats.steps   # nodes beyond root + chain
    assert accepted > 0 and leaves > 0, (accepted, leaves)



# Sequoia trees (drafters.SequoiaTree, selection.sequoia_walk): children drawn without replacement, accepted by Sequoia's rule
SEQUOIA_CONFIGS = [
    Config(1, 3, 1.0, seed=24, tree_budget=6),
    Config(1, 2, 0.7, top_k=3, top_p=0.9, prompt=LONG_PROMPT, seed=25, tree_budget=5),
    # prompt lookup's copied draft when the text matches, else a Sequoia tree (--draft model+lookup --tree-budget)
    Config(1, 3, 1.0, prompt=LONG_PROMPT, seed=40, tree_budget=6, drafter="model+lookup"),
]


@pytest.mark.parametrize("cfg", SEQUOIA_CONFIGS, ids=str)
def test_sequoia_tree_output_law_equals_target(tree_bundle, tree_gen, cfg):
    draws = draw(tree_gen, cfg)
    assert draws.scored > draws.steps * (cfg.draft_len + 1)          # wider than one chain: siblings were drawn
    if cfg.drafter == "model+lookup":
        assert draws.lookup_steps > draws.n // 10, draws.lookup_steps  # copied drafts between the trees (14% of draws)
    assert_engine_follows_target(tree_bundle, tree_gen, cfg, draws)


def test_negative_control_sequoia_without_residual(tree_bundle, tree_gen, monkeypatch):
    """Moving on to the next sibling (or the final draw) with q itself instead of the residual
    norm(max(q - p~, 0)) is detected by the same test."""
    from spectr_edge import selection

    monkeypatch.setattr(selection, "sequoia_residual", lambda q, p: q)
    cfg = Config(1, 2, 1.0, draws=NEGATIVE_DRAWS, seed=26, tree_budget=6)
    draws = draw(tree_gen, cfg)
    assert_law_rejected(tree_bundle, cfg, draws)


def test_dynamic_tree_greedy_equals_target_only(tree_gen):
    """Greedy with a dynamic draft tree (OPT-Tree style, trees.DraftTree): token for token."""
    rng = np.random.default_rng(29)
    accepted = branched = 0
    for trial in range(10):
        prompt = [int(t) for t in rng.integers(0, VOCAB_SIZE, int(rng.integers(1, 6)))]
        plain = tree_gen.generate_ids(prompt, max_new_tokens=16, temperature=0.0, num_candidates=0).token_ids
        for budget, depth, drafter in ((4, 3, None), (8, 4, None), (3, 6, None), (6, 4, "model+lookup")):
            res = tree_gen.generate_ids(prompt, max_new_tokens=16, temperature=0.0, tree_budget=budget,
                                        draft_len=depth, drafter=drafter)
            assert res.token_ids == plain, (prompt, budget, depth, drafter)
            accepted += res.stats.accepted
            branched += res.stats.scored > res.stats.steps * (depth + 1)      # more nodes than one chain
            assert res.stats.scored <= res.stats.steps * (budget + 1)          # never more than the budget
    assert accepted > 0 and branched > 0, (accepted, branched)


def test_dynamic_tree_draft_sees_only_its_own_branch(tree_bundle, tree_gen, monkeypatch):
    """Every draft distribution the tree grows from equals the draft's exact next-token logits for
    that node's own path (toy_lm.exact_next_logits): past masks and positions of a tree drafted
    over several calls are right. Greedy equality alone would not notice a wrong draft tree."""
    from spectr_edge import trees
    from toy_lm import exact_next_logits, load_params

    params = load_params(tree_bundle, "draft")
    seen = []
    original = trees.DraftTree.grow

    def recording(self, frontier, logits):
        for i, node in enumerate(frontier):
            path = [self.tokens[n] for n in reversed([node] + self.ancestors_of(node))] if node else []
            seen.append((self.tokens[0], path, np.array(logits[i])))
        return original(self, frontier, logits)

    monkeypatch.setattr(trees.DraftTree, "grow", recording)
    prompt = [1, 3, 0, 2]
    res = tree_gen.generate_ids(prompt, max_new_tokens=12, temperature=0.0, tree_budget=6, draft_len=3)
    committed = list(prompt) + res.token_ids
    checked = deep = 0
    for root, path, logits in seen:
        # the tree's root is the last committed token of some step: try every such prefix
        for cut in range(len(prompt), len(committed) + 1):
            if committed[cut - 1] != root:
                continue
            ref = exact_next_logits(params, committed[:cut] + path)[:VOCAB_SIZE]
            if np.allclose(logits, ref, atol=1e-4):
                checked += 1
                deep += len(path) > 0
                break
        else:
            raise AssertionError(f"draft logits for tree path {path} match no prefix of the output")
    assert checked == len(seen) and deep > 0, (checked, len(seen), deep)


# --------------------------------------------------------------------------- prompt lookup
# Deterministic drafts copied from the prompt and the output (spectr_edge/lookup.py), verified by the
# one-hot rule; alone, and before the draft model. The 5-token vocabulary makes matches frequent.

LOOKUP_CONFIGS = [
    Config(1, 4, 1.0, prompt=LONG_PROMPT, seed=30, drafter="lookup"),
    Config(1, 2, 0.7, top_k=3, top_p=0.9, prompt=LONG_PROMPT, seed=31, drafter="model+lookup"),
]


@pytest.mark.parametrize("cfg", LOOKUP_CONFIGS, ids=str)
def test_prompt_lookup_output_law_equals_target(bundle, gen, cfg):
    draws = draw(gen, cfg)
    assert draws.lookup_steps > draws.n // 4, draws.lookup_steps     # lookup really drafted, in many draws
    if cfg.drafter == "lookup":
        assert draws.draft_calls == 0
    else:
        assert draws.draft_calls > 0                                   # and the model drafted when it found nothing
    assert_engine_follows_target(bundle, gen, cfg, draws)


@pytest.fixture(scope="module")
def guess_gen(tmp_path_factory):
    """The same toy target and draft, the target graph also outputting a guess-head stand-in."""
    import spectr_edge

    path = build_toy_bundle(tmp_path_factory.mktemp("toy_guess"), seed_target=11, seed_draft=12, guess=True)
    return spectr_edge.load(path, provider="cpu", threads=1)


@pytest.mark.parametrize("cfg", [Config(1, 4, 1.0, prompt=LONG_PROMPT, seed=37, drafter="lookup"),
                                 Config(1, 3, 0.7, top_k=3, prompt=SHORT_PROMPT, seed=38, drafter="lookup")], ids=str)
def test_guess_head_drafts_keep_the_target_law(bundle, guess_gen, cfg):
    """Prompt lookup on a target with a guess head (export/guess_head.py): the head's token is the
    draft whenever the text has no match that is expected to pay more; the law stays the target's.
    The law compared is the toy target's, which the guess output does not change."""
    draws = draw(guess_gen, cfg)
    assert draws.guess_steps > draws.n // 4, draws.guess_steps              # the guess really drafted
    assert 0 < draws.guess_accepted < draws.guess_steps, draws.guess_accepted
    assert_engine_follows_target(bundle, guess_gen, cfg, draws)


@pytest.fixture(scope="module")
def chain_gen(tmp_path_factory):
    """The same toy target and draft, the target graph with a guess-head stand-in and the bundle with a
    chain graph stand-in (toy_lm.chain_graph), so the head drafts several guesses per step."""
    import spectr_edge

    path = build_toy_bundle(tmp_path_factory.mktemp("toy_chain"), seed_target=11, seed_draft=12, guess=True,
                            chain=True)
    return spectr_edge.load(path, provider="cpu", threads=1)


@pytest.mark.parametrize("cfg", [Config(1, 4, 1.0, prompt=SHORT_PROMPT, seed=40, drafter="lookup"),
                                 Config(1, 4, 0.7, top_k=3, prompt=LONG_PROMPT, seed=41, drafter="model+lookup",
                                        adaptive=True)],
                         ids=str)
def test_guess_chain_drafts_keep_the_target_law(bundle, chain_gen, cfg):
    """The guess head's chain (several guesses per step, as many as its per-position acceptance pays
    for) is a deterministic draft verified by the one-hot rule: the law stays the target's. Bound:
    chi-square at p = 1e-4 per window, as every law test here."""
    draws = draw(chain_gen, cfg)
    assert draws.guess_steps > draws.n // 4, draws.guess_steps
    assert draws.guess_drafted > 1.3 * draws.guess_steps, (draws.guess_drafted, draws.guess_steps)  # chains drafted
    assert 0 < draws.guess_accepted < draws.guess_drafted, draws.guess_accepted
    assert_engine_follows_target(bundle, chain_gen, cfg, draws)


def test_negative_control_guess_chain_accepted_outright(bundle, chain_gen, monkeypatch):
    """Accepting the chain's guesses outright (instead of w.p. q(x)) is detected by the same test."""
    from spectr_edge import selection

    monkeypatch.setattr(selection, "deterministic_select", lambda candidate, target_probs, rng: (int(candidate), True))
    cfg = Config(1, 4, 1.0, prompt=SHORT_PROMPT, draws=NEGATIVE_DRAWS, seed=42, drafter="lookup")
    draws = draw(chain_gen, cfg)
    assert draws.guess_drafted > draws.guess_steps > 0
    assert_law_rejected(bundle, cfg, draws)


def test_negative_control_guess_accepted_outright(bundle, guess_gen, monkeypatch):
    """Accepting the guess outright (instead of w.p. q(x)) is detected by the same test."""
    from spectr_edge import selection

    monkeypatch.setattr(selection, "deterministic_select", lambda candidate, target_probs, rng: (int(candidate), True))
    cfg = Config(1, 3, 0.7, top_k=3, prompt=SHORT_PROMPT, draws=NEGATIVE_DRAWS, seed=39, drafter="lookup")
    draws = draw(guess_gen, cfg)
    assert draws.guess_steps > 0
    assert_law_rejected(bundle, cfg, draws)


def test_negative_control_lookup_accepting_every_copy(bundle, gen, monkeypatch):
    """Accepting a copied token outright (instead of w.p. q(x)) is detected by the same test."""
    from spectr_edge import selection

    monkeypatch.setattr(selection, "deterministic_select", lambda candidate, target_probs, rng: (int(candidate), True))
    cfg = Config(1, 4, 1.0, prompt=LONG_PROMPT, draws=NEGATIVE_DRAWS, seed=32, drafter="lookup")
    draws = draw(gen, cfg)
    assert draws.lookup_steps > 0
    assert_law_rejected(bundle, cfg, draws)


def test_lookup_trie_output_law_equals_target(tree_bundle, tree_gen):
    """--draft lookup -k 4 on a tree bundle: up to 4 copied candidates verified as one trie, each
    position's token drawn from the target's own q at its node. Bound: chi-square at p = 1e-4 per
    window, as every law test here."""
    cfg = Config(4, 4, 1.0, top_k=3, prompt=LONG_PROMPT, seed=34, drafter="lookup")
    draws = draw(tree_gen, cfg)
    assert draws.lookup_steps > draws.n // 4 and draws.draft_calls == 0
    assert draws.lookup_tries > draws.n // 4, draws.lookup_tries      # several candidates in one trie, often
    assert_engine_follows_target(tree_bundle, tree_gen, cfg, draws)


def test_negative_control_lookup_trie_following_every_copy(tree_bundle, tree_gen, monkeypatch):
    """A trie walk that takes a copied child outright (instead of drawing from q) is detected."""
    from spectr_edge import selection

    def follow_copies(trie, node_logits, choose):
        node, out, path = 0, [], [0]
        while True:
            kids = [tok for (parent, tok) in trie.children if parent == node]
            tok = kids[0] if kids else choose(node_logits[node])
            out.append(tok)
            if not kids:
                return out, path
            node = trie.children[(node, tok)]
            path.append(node)

    monkeypatch.setattr(selection, "target_walk", follow_copies)
    cfg = Config(4, 4, 1.0, top_k=3, prompt=LONG_PROMPT, draws=NEGATIVE_DRAWS, seed=36, drafter="lookup")
    draws = draw(tree_gen, cfg)
    assert draws.lookup_tries > 0
    assert_law_rejected(tree_bundle, cfg, draws)


def test_lookup_trie_greedy_equals_target_only(tree_gen):
    rng = np.random.default_rng(35)
    tries = 0
    for trial in range(16):
        prompt = [int(t) for t in rng.integers(0, VOCAB_SIZE, int(rng.integers(3, 12)))]
        plain = tree_gen.generate_ids(prompt, max_new_tokens=20, temperature=0.0, num_candidates=0).token_ids
        for k in (2, 4, 8):
            res = tree_gen.generate_ids(prompt, max_new_tokens=20, temperature=0.0, drafter="lookup", lookup_candidates=k)
            assert res.token_ids == plain, (prompt, k)
            tries += res.stats.lookup_tries
    assert tries > 0


def test_prompt_lookup_greedy_equals_target_only(gen, tree_gen):
    """temperature 0: lookup alone and lookup + model give target greedy token for token."""
    rng = np.random.default_rng(33)
    lookup_steps = accepted = 0
    for trial in range(16):
        prompt = [int(t) for t in rng.integers(0, VOCAB_SIZE, int(rng.integers(3, 12)))]
        for g in (gen, tree_gen):
            plain = g.generate_ids(prompt, max_new_tokens=20, temperature=0.0, num_candidates=0).token_ids
            for drafter, draft_len in (("lookup", 8), ("lookup", 2), ("model+lookup", 3)):
                res = g.generate_ids(prompt, max_new_tokens=20, temperature=0.0, drafter=drafter, draft_len=draft_len)
                assert res.token_ids == plain, (prompt, drafter, draft_len)
                lookup_steps += res.stats.lookup_steps
                accepted += res.stats.lookup_accepted
    assert lookup_steps > 0 and accepted > 0, (lookup_steps, accepted)


# --------------------------------------------------------------------------- adaptive draft length
# policy.AdaptiveLength picks each step's length (0 = a plain step) from the generation's own accept /
# reject counts. The toy draft is as large as the toy target (draft cost 1.0 by weight bytes), which
# would make it never draft; a cost of 0.05 per drafted token makes lengths vary from step to step.


def test_adaptive_length_output_law_equals_target(bundle, gen, monkeypatch):
    monkeypatch.setattr(gen.engine, "draft_cost", 0.05)
    cfg = Config(1, 3, 1.0, prompt=LONG_PROMPT, seed=40, adaptive=True)
    draws = draw(gen, cfg)
    assert draws.undrafted > 0 and draws.steps > draws.n    # the rule chose plain steps at times, and drafts
    assert_engine_follows_target(bundle, gen, cfg, draws)


def test_adaptive_length_greedy_equals_target_only(gen, monkeypatch):
    rng = np.random.default_rng(41)
    for cost in (0.05, 0.5, 2.0):                         # drafts often, sometimes, only when probing
        monkeypatch.setattr(gen.engine, "draft_cost", cost)
        for trial in range(8):
            prompt = [int(t) for t in rng.integers(0, VOCAB_SIZE, int(rng.integers(1, 6)))]
            plain = gen.generate_ids(prompt, max_new_tokens=24, temperature=0.0, num_candidates=0).token_ids
            res = gen.generate_ids(prompt, max_new_tokens=24, temperature=0.0, num_candidates=1, draft_len=4,
                                   adaptive=True, draft_stop=0.0)
            assert res.token_ids == plain, (prompt, cost)


# --------------------------------------------------------------------------- static lookup table
# When the text has no match, a bundle's next-token table (spectr_edge/ngram_table.py) proposes one
# token. Here the text search is switched off so that every lookup step is a table guess; the table
# comes from a random corpus over the toy vocabulary, so its guesses are right only sometimes.


@pytest.fixture
def table_gen(gen, monkeypatch):
    from spectr_edge.lookup import PromptLookup
    from spectr_edge.ngram_table import NgramTable, build_table

    corpus = np.random.default_rng(50).integers(0, VOCAB_SIZE, 400)
    monkeypatch.setattr(gen.engine, "lookup_table", NgramTable(build_table(corpus, VOCAB_SIZE)))
    monkeypatch.setattr(PromptLookup, "search", lambda self, ids, limit: ([], 0))
    return gen


def test_lookup_table_output_law_equals_target(bundle, table_gen):
    cfg = Config(1, 4, 1.0, prompt=LONG_PROMPT, seed=51, drafter="lookup")
    draws = draw(table_gen, cfg)
    assert draws.lookup_steps > draws.n, draws.lookup_steps          # the table drafted in most steps
    assert draws.accepted > 0 and draws.accepted < draws.drafted     # right sometimes, wrong sometimes
    assert_engine_follows_target(bundle, table_gen, cfg, draws)


def test_lookup_table_greedy_equals_target_only(table_gen):
    rng = np.random.default_rng(52)
    steps = accepted = 0
    for trial in range(12):
        prompt = [int(t) for t in rng.integers(0, VOCAB_SIZE, int(rng.integers(1, 8)))]
        plain = table_gen.generate_ids(prompt, max_new_tokens=20, temperature=0.0, num_candidates=0).token_ids
        res = table_gen.generate_ids(prompt, max_new_tokens=20, temperature=0.0, drafter="lookup")
        assert res.token_ids == plain, prompt
        steps += res.stats.lookup_steps
        accepted += res.stats.lookup_accepted
    assert steps > 12 and 0 < accepted < steps, (steps, accepted)


# --------------------------------------------------------------------------- draft context window
# The draft reads only the prompt's latest `draft_window` tokens (its positions start there). What it
# drafts changes, the output law and greedy output must not.


def _first_draft_feed(gen, monkeypatch, fed: list[int] | None = None) -> list[int]:
    """Record how many tokens each generation's first draft call is fed (the draft's prefill)."""
    fed, real = ([] if fed is None else fed), gen.draft.forward

    def forward(input_ids, cache, *args, **kwargs):
        if cache.length == 0:
            fed.append(int(input_ids.shape[1]))
        return real(input_ids, cache, *args, **kwargs)

    monkeypatch.setattr(gen.draft, "forward", forward)
    return fed


@pytest.mark.parametrize("cfg", [Config(2, 2, 1.0, prompt=LONG_PROMPT, seed=53),
                                 Config(1, 3, 0.7, top_k=3, prompt=LONG_PROMPT, seed=54, tree_budget=6)], ids=str)
def test_draft_window_output_law_equals_target(bundle, gen, tree_bundle, tree_gen, cfg, monkeypatch):
    g, b = (tree_gen, tree_bundle) if cfg.tree_budget else (gen, bundle)
    fed = _first_draft_feed(g, monkeypatch)
    original = g.generate_ids
    monkeypatch.setattr(g, "generate_ids", lambda *a, **k: original(*a, draft_window=2, **k))
    draws = draw(g, cfg)
    assert fed and set(fed) == {3}, set(fed)        # 2 prompt tokens + the first generated one
    assert_engine_follows_target(b, g, cfg, draws)


def test_draft_window_greedy_equals_target_only(gen, tree_gen, monkeypatch):
    rng = np.random.default_rng(55)
    fed = _first_draft_feed(tree_gen, monkeypatch, _first_draft_feed(gen, monkeypatch))
    for trial in range(8):
        prompt = [int(t) for t in rng.integers(0, VOCAB_SIZE, int(rng.integers(4, 12)))]
        for g in (gen, tree_gen):
            plain = g.generate_ids(prompt, max_new_tokens=16, temperature=0.0, num_candidates=0).token_ids
            options = [dict(num_candidates=1, draft_len=3), dict(num_candidates=1, draft_len=4, draft_stop=0.5)]
            if g is tree_gen:
                options += [dict(num_candidates=3, draft_len=3), dict(num_candidates=1, draft_len=3, tree_budget=6)]
            for opts in options:
                for window in (1, 3):
                    res = g.generate_ids(prompt, max_new_tokens=16, temperature=0.0, draft_window=window, **opts)
                    assert res.token_ids == plain, (prompt, opts, window)
    assert 2 in fed and 4 in fed


# --------------------------------------------------------------------------- model + lookup, adaptive
# With the adaptive rule, each step takes the lookup match or the draft model, whichever is expected to
# yield more per unit of time (one-token matches included).


def test_adaptive_model_plus_lookup_output_law_equals_target(bundle, gen, monkeypatch):
    monkeypatch.setattr(gen.engine, "draft_cost", 0.05)
    cfg = Config(1, 3, 1.0, prompt=LONG_PROMPT, seed=56, drafter="model+lookup", adaptive=True)
    draws = draw(gen, cfg)
    assert draws.lookup_steps > 0 and draws.draft_calls > 0, (draws.lookup_steps, draws.draft_calls)
    assert_engine_follows_target(bundle, gen, cfg, draws)


def test_adaptive_model_plus_lookup_greedy_equals_target_only(gen, tree_gen, monkeypatch):
    rng = np.random.default_rng(57)
    used = Counter()
    for g in (gen, tree_gen):
        monkeypatch.setattr(g.engine, "draft_cost", 0.05)
        for trial in range(8):
            prompt = [int(t) for t in rng.integers(0, VOCAB_SIZE, int(rng.integers(2, 10)))]
            plain = g.generate_ids(prompt, max_new_tokens=20, temperature=0.0, num_candidates=0).token_ids
            res = g.generate_ids(prompt, max_new_tokens=20, temperature=0.0, drafter="model+lookup",
                                 num_candidates=1, draft_len=3, adaptive=True)
            assert res.token_ids == plain, prompt
            used.update(lookup=res.stats.lookup_steps, model=res.stats.draft_calls)
    assert used["lookup"] > 0 and used["model"] > 0, used


# --------------------------------------------------------------------------- penalties
# presence / frequency (OpenAI) and repetition (HF) penalties, applied to target and draft alike at
# every drafted position from the tokens before it (sampling.TokenHistory): the output is the law of
# the penalised target, which toy_lm.penalize computes independently.

PENALTY_CONFIGS = [
    Config(2, 2, 1.0, prompt=LONG_PROMPT, seed=60, penalties=(0.4, 0.3, 1.3)),
    Config(1, 3, 0.7, top_k=3, seed=61, penalties=(0.0, 0.5, 1.0), drafter="model+lookup"),
    Config(1, 4, 1.0, prompt=LONG_PROMPT, seed=62, penalties=(0.6, 0.0, 1.5), drafter="lookup"),
]


@pytest.mark.parametrize("cfg", PENALTY_CONFIGS, ids=str)
def test_penalised_output_law_equals_the_penalised_target(bundle, gen, cfg):
    assert_engine_follows_target(bundle, gen, cfg, draw(gen, cfg))


def test_penalised_trees_keep_the_law(tree_bundle, tree_gen):
    cfg = Config(1, 3, 1.0, seed=63, tree_budget=6, penalties=(0.3, 0.3, 1.2))
    draws = draw(tree_gen, cfg)
    assert draws.scored > draws.steps * (cfg.draft_len + 1)            # siblings were drawn
    assert_engine_follows_target(tree_bundle, tree_gen, cfg, draws)


def test_negative_control_penalties_from_the_committed_text_only(bundle, gen, monkeypatch):
    """Penalising every drafted position as if it came right after the committed text (ignoring the
    drafted tokens before it) is not the penalised target's law: rejected."""
    from spectr_edge.sampling import TokenHistory

    real = TokenHistory.penalize
    monkeypatch.setattr(TokenHistory, "penalize", lambda self, logits, params, path=(): real(self, logits, params))
    cfg = Config(1, 3, 1.0, prompt=LONG_PROMPT, draws=NEGATIVE_DRAWS, seed=64, penalties=(2.0, 2.0, 1.0))
    draws = draw(gen, cfg)
    assert draws.accepted > 0
    assert_law_rejected(bundle, cfg, draws)


def test_penalised_greedy_equals_penalised_target_only(gen, tree_gen):
    rng = np.random.default_rng(65)
    accepted = 0
    for trial in range(8):
        prompt = [int(t) for t in rng.integers(0, VOCAB_SIZE, int(rng.integers(2, 8)))]
        pen = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4)
        for g in (gen, tree_gen):
            plain = g.generate_ids(prompt, max_new_tokens=16, temperature=0.0, num_candidates=0, **pen).token_ids
            for opts in (dict(draft_len=3), dict(drafter="lookup"), dict(drafter="model+lookup", draft_len=4)) + \
                    ((dict(tree_budget=6, draft_len=3), dict(branches=3, draft_len=3)) if g is tree_gen else ()):
                res = g.generate_ids(prompt, max_new_tokens=16, temperature=0.0, **opts, **pen)
                assert res.token_ids == plain, (prompt, opts)
                accepted += res.stats.accepted
    assert accepted > 0
