"""Adapting a bundle's draft to recorded traffic (`spectr-edge adapt`): on a tiny Qwen2 target with a
badly perturbed draft, distilling on recorded generations raises the held-out acceptance, the
adapted draft is installed through the real export path, and the output stays the target's (greedy
token for token, and its law at temperature 1, top-3); a draft that learns nothing is refused and
the bundle left as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest

import spectr_edge
from spectr_edge import recording
from spectr_edge.errors import ExportError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def weak_bundle(tmp_path_factory):
    """The tiny Qwen2 target with a draft that agrees little (tiny_models.build_weak_draft_bundle),
    a recording of 120 greedy generations on a narrow domain (prompts of ids 3-29), and the draft's
    source directory."""
    import tiny_models
    from conftest import _cached_bundle

    bundle = _cached_bundle("tiny-qwen-weak-draft", tiny_models.build_weak_draft_bundle, tmp_path_factory)
    rec = tmp_path_factory.mktemp("recording")
    gen = spectr_edge.load(bundle, provider="cpu", threads=1, record=rec)
    rng = np.random.default_rng(0)
    for _ in range(120):
        gen.generate_ids([int(t) for t in rng.integers(3, 30, 12)], max_new_tokens=24, drafter="none")
    return bundle, rec, tiny_models.weak_draft_source(bundle)


def test_install_needs_a_gain_beyond_the_held_out_noise():
    """adapt installs on the 95% one-sided lower bound of the paired held-out gain, not on its mean:
    a gain on every sequence passes, none fails, and a small mean gain carried by one sequence of 24
    fails (the bootstrap is seeded, so each outcome is fixed)."""
    from spectr_edge_export.adapt import gain_lower_bound

    def side(values):
        return {"per_sequence": values, "weights": [50] * len(values)}

    before = side([1.8] * 24)
    assert gain_lower_bound(before, side([1.9] * 24)) > 0
    assert gain_lower_bound(before, side([1.8] * 24)) == 0.0
    one_lucky = side([1.8] * 23 + [3.0])              # mean gain +0.05, from one sequence
    assert gain_lower_bound(before, one_lucky) <= 0
    mixed = side([1.6, 2.1] * 12)                      # mean gain +0.05, half of the sequences worse
    assert gain_lower_bound(before, mixed) < 0


@pytest.mark.parametrize("bits", [4, 8])
def test_training_rounds_weights_exactly_as_the_quantizer_will(bits):
    """adapt trains against the draft's weights as its re-export will hold them: round_weights gives
    exactly the weights ONNX Runtime's MatMulNBits quantizer stores (zero points, halves rounded away
    from zero, a last block shorter than the others), read back through a real session at float32 compute from an identity input."""
    import onnxruntime as ort
    import torch
    from onnx import helper, numpy_helper

    from spectr_edge_export.adapt import round_weights
    from spectr_edge_export.quantize import _import_nbits, _quiet_root_logger

    k, n, block = 200, 24, 32                                   # 6 full blocks and one of 8 per column
    # multiples of 1/1024: many weights fall exactly halfway between two steps, where the rounding rule shows
    w = (np.random.default_rng(bits).integers(-300, 300, (k, n)) / 1024).astype(np.float32)
    w[:32, 0] = np.abs(w[:32, 0])                               # a block without negatives
    w[32:64, 1] = -np.abs(w[32:64, 1])                          # one without positives
    w[:, 2] = 0.0                                               # a column of zeros
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, [None, k])],
                              [helper.make_tensor_value_info("y", 1, [None, n])], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    q = _import_nbits()(model, bits=bits, block_size=block, is_symmetric=False, accuracy_level=0)
    with _quiet_root_logger():
        q.process()
    assert any(node.op_type == "MatMulNBits" for node in q.model.model.graph.node)
    sess = ort.InferenceSession(q.model.model.SerializeToString(), providers=["CPUExecutionProvider"])
    stored = sess.run(None, {"x": np.eye(k, dtype=np.float32)})[0]            # [k, n]
    mine = round_weights(torch.from_numpy(w.T.copy()), bits, block).numpy().T
    assert np.abs(stored - w).max() > 1e-4                      # the rounding is real ...
    np.testing.assert_allclose(mine, stored, rtol=0, atol=1e-7)  # ... and the same


def test_quant_aware_training_moves_float_weights_and_leaves_the_rest_as_it_was():
    """Inside quantized_weights a tiny Qwen2 computes with every projection and its tied LM head rounded
    (its logits equal those of a copy whose weights were rounded by hand); the trained layer's float
    weights get the straight-through gradient; on exit every weight and the tie are as before."""
    import copy

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spectr_edge_export.adapt import quantized_weights, round_weights

    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      use_sliding_window=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    by_hand = copy.deepcopy(model)
    by_hand.lm_head = torch.nn.Linear(64, 96, bias=False)
    with torch.no_grad():
        for name, m in list(by_hand.model.layers.named_modules()):
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(round_weights(m.weight, 4, 32))
        by_hand.lm_head.weight.copy_(round_weights(model.lm_head.weight, 4, 32))
    ids = torch.tensor([[5, 17, 3, 44, 9, 60]])
    plain = model(input_ids=ids).logits
    with quantized_weights(model, (4, 32), trained_layers=1):
        for p in model.parameters():
            p.requires_grad_(False)
        proj = model.model.layers[2].mlp.down_proj
        master = proj.parametrizations.weight.original
        master.requires_grad_(True)
        rounded = model(input_ids=ids).logits
        torch.testing.assert_close(rounded, by_hand(input_ids=ids).logits, rtol=0, atol=1e-5)
        assert (rounded - plain).abs().max() > 1e-3
        rounded.square().sum().backward()
        assert master.grad is not None and master.grad.abs().sum() > 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    after = model.state_dict()
    assert set(after) == set(original)
    for name, value in original.items():
        assert torch.equal(after[name], value), name


def small_qwen(layers: int):
    """A random tied Qwen2 of `layers` layers, hidden 32, vocabulary 64 (seed 0)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                        use_sliding_window=False))


def test_a_budget_that_ends_a_pass_early_keeps_that_partial_pass_if_it_validates_better():
    """Training whose step budget ends 20 records into its second pass: those weights are validated
    then, and kept since they validate better than the first pass's (the report's validation loss is
    theirs, the model ends with them). Before, only whole passes were validated and the first pass's
    weights came back, dropping the partial pass."""
    import re

    import torch

    from spectr_edge_export.adapt import Sequence, _loss, train

    model = small_qwen(2)
    rng = np.random.default_rng(1)

    def seq():                                   # the teacher: the next token is the previous one + 1
        ids = [int(rng.integers(0, 64))]
        for _ in range(15):
            ids.append((ids[-1] + 1) % 64)
        nxt = np.asarray(ids[4:], dtype=np.int32)[:, None]
        top = np.concatenate([nxt, (nxt + 7) % 64], axis=1)                    # [12, 2]
        p = np.tile(np.asarray([[0.99, 0.01]], dtype=np.float32), (len(nxt), 1))
        return Sequence(ids, 4, top, p, p)

    fit, validation = [seq() for _ in range(40)], [seq() for _ in range(6)]
    lines = []
    report = train(model, fit, layers=2, minutes=60, lr=3e-3, max_steps=60, seed=0, log=lines.append,
                   validation=validation)
    assert report["stopped"] == "budget" and report["passes"] == 1 and report["steps"] == 60
    (first,) = [float(m.group(1)) for line in lines if (m := re.search(r"pass 1: validation loss ([0-9.]+)", line))]
    (last,) = [float(m.group(1)) for line in lines
               if (m := re.search(r"step 60, 1 passes and 20 records: validation loss ([0-9.]+)", line))]
    with torch.no_grad():
        now = float(np.mean([_loss(model, v).item() for v in validation]))
    assert last < first - 0.05, (first, last)
    assert report["validation_loss"] == pytest.approx(now, abs=1e-4) and now == pytest.approx(last, abs=1e-3)


def test_the_greedy_term_adds_the_cross_entropy_to_the_targets_top1_and_pulls_the_argmax_to_it():
    """_loss with greedy_weight=w: the soft cross-entropy over the target's top-k plus w times the cross-entropy
    to its first (greedy) token, computed here from the whole model's logits; w=0 is the soft loss alone.
    A gradient step on the greedy term alone raises the draft's log-probability of the greedy tokens."""
    import torch

    from spectr_edge_export.adapt import Sequence, _loss

    model = small_qwen(2)
    rng = np.random.default_rng(3)
    top = rng.integers(0, 64, (10, 4)).astype(np.int32)
    p = rng.dirichlet(np.ones(4), 10).astype(np.float32)
    s = Sequence([int(t) for t in rng.integers(0, 64, 16)], 6, top, p, p)
    with torch.no_grad():
        logq = torch.log_softmax(model(input_ids=torch.tensor([s.ids[:-1]])).logits[0, 5:].double(), dim=-1).numpy()
        soft = _loss(model, s).item()
        mixed = _loss(model, s, greedy_weight=0.5).item()
    rows = np.arange(10)
    expected_soft = -(p * logq[rows[:, None], top]).sum(axis=1).mean()
    expected_greedy = -logq[rows, top[:, 0]].mean()
    assert soft == pytest.approx(expected_soft, abs=1e-5)
    assert mixed == pytest.approx(expected_soft + 0.5 * expected_greedy, abs=1e-5)
    assert _loss(model, s, greedy_weight=0.0).item() == soft

    greedy_only = lambda: (_loss(model, s, greedy_weight=1.0) - _loss(model, s)).item()   # noqa: E731
    before = greedy_only()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (_loss(model, s, greedy_weight=1.0) - _loss(model, s)).backward()
    opt.step()
    assert greedy_only() < before - 1e-3


@pytest.mark.parametrize("rounding", [None, (4, 32)])
def test_a_sequence_seen_again_starts_at_the_first_trained_layer_with_the_same_loss_and_gradient(rounding):
    """FrozenLayers: the second forward of a sequence runs the trained layers only, from the hidden state
    the first one kept; its loss and the trained weights' gradient equal the whole model's exactly (also
    with the weights rounded as for an int4 draft), and the model has all its layers afterwards."""
    import torch

    from spectr_edge_export.adapt import FrozenLayers, Sequence, _loss, quantized_weights

    model = small_qwen(4)
    rng = np.random.default_rng(2)
    top = rng.integers(0, 64, (10, 3)).astype(np.int32)
    p = rng.dirichlet(np.ones(3), 10).astype(np.float32)
    s = Sequence([int(t) for t in rng.integers(0, 64, 16)], 6, top, p, p)
    with quantized_weights(model, rounding, 1) if rounding else nullcontext():
        for q in model.parameters():
            q.requires_grad_(False)
        trained = list(model.model.layers[3].parameters())
        for q in trained:
            q.requires_grad_(True)

        def loss_and_grads(*frozen):
            for q in trained:
                q.grad = None
            loss = _loss(model, s, *frozen)
            loss.backward()
            return loss.detach(), [q.grad.clone() for q in trained]

        whole, whole_grads = loss_and_grads()
        frozen = FrozenLayers(model, 1)
        first, first_grads = loss_and_grads(frozen, "a")
        assert set(frozen.states) == {"a"} and frozen.states["a"].shape == (1, 15, 32)
        again, again_grads = loss_and_grads(frozen, "a")
        assert len(model.model.layers) == 4
        assert torch.equal(whole, first) and torch.equal(whole, again)
        for a, b, c in zip(whole_grads, first_grads, again_grads, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
        with torch.no_grad():                          # a trained weight moves: the kept state still serves
            model.model.layers[3].mlp.down_proj.weight.mul_(1.5) if not rounding else \
                model.model.layers[3].mlp.down_proj.parametrizations.weight.original.mul_(1.5)
        assert torch.equal(_loss(model, s).detach(), _loss(model, s, frozen, "a").detach())
        assert not torch.equal(whole, _loss(model, s).detach())


def files_digest(bundle: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(bundle.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(bundle).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def copy_bundle(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def test_adapting_raises_held_out_acceptance_and_output_stays_the_targets(weak_bundle, tmp_path):
    src, rec, draft_dir = weak_bundle
    bundle = copy_bundle(src, tmp_path / "b")
    from spectr_edge_export.adapt import adapt_bundle

    report = adapt_bundle(bundle, rec, draft_source=str(draft_dir), layers=2, lr=3e-3, max_steps=500,
                          threads=1, log=lambda s: None)
    before, after = report["before"], report["after"]
    # the bound this checks: on 576 held-out positions the distilled draft's first-position greedy
    # acceptance is up by at least 0.1 (it starts near 0.15)
    assert report["installed"] and after["greedy_per_position"][0] >= before["greedy_per_position"][0] + 0.1, report
    assert after["first_position_t1"] > before["first_position_t1"]
    manifest = json.loads((bundle / "spectr.json").read_text())
    assert manifest["models"]["draft"]["adapted"]["generations"] == 120
    assert not list(tmp_path.glob(".b.adapt-*")) and not list(bundle.glob(".draft.replaced-*"))

    gen = spectr_edge.load(bundle, provider="cpu", threads=1)
    old = spectr_edge.load(src, provider="cpu", threads=1)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 400, 12)] for _ in range(4)]
    accepted = {}
    for name, g in (("adapted", gen), ("old", old)):
        for p in prompts:
            ref = g.generate_ids(p, max_new_tokens=20, drafter="none").token_ids
            got = g.generate_ids(p, max_new_tokens=20, num_candidates=1, draft_len=4)
            assert got.token_ids == ref                  # greedy: token for token the target's
            accepted[name] = accepted.get(name, 0) + got.stats.accepted
    assert accepted["adapted"] > accepted["old"]

    # temperature 1, top-3: the law of the first three tokens is the target's (chi-square, p = 1e-4)
    from test_montecarlo import chi2_quantile, chi_square

    prompt, n, draws, target = prompts[0], 3, 600, gen.target
    eos = set(gen.bundle.tokenizer.eos_token_ids)
    law = {}

    def expand(toks: list[int], prob: float) -> None:
        """The target's top-3 law over continuations, sequences ending at eos or after n tokens."""
        if len(toks) == n or (toks and toks[-1] in eos):
            law[tuple(toks)] = law.get(tuple(toks), 0.0) + prob
            return
        logits = target.forward(np.asarray([prompt + toks], dtype=np.int64), target.new_cache())[0, -1, :gen.bundle.tokenizer.vocab_size]
        top = np.argsort(-logits)[:3]
        p = np.exp(logits[top] - logits[top].max())
        for tok, q in zip(top, p / p.sum()):
            expand(toks + [int(tok)], prob * float(q))

    expand([], 1.0)
    counts = Counter(tuple(gen.generate_ids(prompt, max_new_tokens=n, temperature=1.0, top_k=3, num_candidates=2,
                                            draft_len=2, seed=s).token_ids) for s in range(draws))
    stat, df = chi_square(counts, law, draws)
    assert stat <= chi2_quantile(df), (stat, df)


def test_an_int4_draft_is_trained_against_its_rounded_weights_and_installed_int4(weak_bundle, tmp_path_factory):
    """The same noisy draft quantized to int4: adapt trains it seeing its weights rounded as the
    re-export rounds them, writes the float weights back, re-quantizes them to int4 and installs a draft
    that accepts more on held-out records (the bound: first-position greedy acceptance up by 0.1)."""
    import tiny_models
    from conftest import _cached_bundle
    from spectr_edge_export.adapt import adapt_bundle

    _, rec, _ = weak_bundle
    src = _cached_bundle("tiny-qwen-weak-int4-draft", tiny_models.build_weak_int4_draft_bundle, tmp_path_factory)
    assert json.loads((src / "spectr.json").read_text())["models"]["draft"]["quant"] == "int4"
    bundle = copy_bundle(src, tmp_path_factory.mktemp("int4") / "b")
    lines = []
    report = adapt_bundle(bundle, rec, draft_source=str(tiny_models.weak_draft_source(src)), layers=2, lr=3e-3,
                          max_steps=900, threads=1, log=lines.append)
    assert any("rounded to 4 bits" in s for s in lines), lines
    before, after = report["before"], report["after"]
    assert report["installed"] and after["greedy_per_position"][0] >= before["greedy_per_position"][0] + 0.1, report
    draft = json.loads((bundle / "spectr.json").read_text())["models"]["draft"]
    assert draft["quant"] == "int4" and draft["quant_block_size"] == 32
    gen = spectr_edge.load(bundle, provider="cpu", threads=1)
    prompt = [5, 17, 3, 44, 9, 60, 7, 12]
    assert (gen.generate_ids(prompt, max_new_tokens=16, draft_len=4).token_ids
            == gen.generate_ids(prompt, max_new_tokens=16, drafter="none").token_ids)


def test_a_draft_that_learns_nothing_is_refused_and_the_bundle_is_unchanged(weak_bundle, tmp_path):
    src, rec, draft_dir = weak_bundle
    bundle = copy_bundle(src, tmp_path / "b")
    before = files_digest(bundle)
    from spectr_edge_export.adapt import adapt_bundle

    lines = []
    report = adapt_bundle(bundle, rec, draft_source=str(draft_dir), layers=1, lr=0.0, max_steps=2, threads=1,
                          log=lines.append)
    assert not report["installed"] and any("not installed" in s for s in lines)
    assert files_digest(bundle) == before
    assert not list(tmp_path.glob(".b.adapt-*"))


def test_adapt_errors_are_one_line(weak_bundle, tmp_path):
    src, rec, draft_dir = weak_bundle
    from spectr_edge_export.adapt import adapt_bundle

    (tmp_path / "few").mkdir()
    lines = (Path(rec) / recording.RECORD_FILE).read_text().splitlines()
    (tmp_path / "few" / recording.RECORD_FILE).write_text("\n".join(lines[:2]) + "\n")
    with pytest.raises(ExportError, match="record at least 4 generations"):
        adapt_bundle(src, tmp_path / "few", draft_source=str(draft_dir), log=lambda s: None)
    with pytest.raises(ExportError, match="not a preset"):
        adapt_bundle(src, rec, max_steps=1, log=lambda s: None)
    cmd = [sys.executable, "-m", "spectr_edge.cli", "adapt", "--bundle", str(src), "--from", str(tmp_path / "none")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "no recording" in done.stderr
