"""The KV cache stays on the model's device: every call binds it by I/O binding, and only the logits
(and the guess head's ids) come back to the host.

GraphDevice is the code a GPU runs (each cache operation a small ONNX Runtime graph on the device);
here it runs on the CPU, so these tests check that path on machines without a GPU: its outputs equal
the CPU's own (NumPy) cache operations token for token and seed for seed, and across whole
generations nothing but logits-shaped arrays is ever copied out of ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import spectr_edge
from spectr_edge.device import GraphDevice, HostDevice
from toy_lm import build_toy_bundle


@pytest.fixture(scope="module")
def toy_tree(tmp_path_factory):
    return build_toy_bundle(tmp_path_factory.mktemp("device") / "tree", seed_target=91, seed_draft=92, tree_mask=True)


@pytest.fixture(scope="module")
def toy_plain(tmp_path_factory):
    return build_toy_bundle(tmp_path_factory.mktemp("device") / "plain", seed_target=93, seed_draft=94)


def on_device(bundle, device):
    gen = spectr_edge.load(bundle, provider="cpu", threads=1)
    gen.target.device = device
    if gen.draft is not None:
        gen.draft.device = device
    return gen


POLICIES = [dict(temperature=0.0), dict(temperature=0.0, num_candidates=0), dict(temperature=1.0, num_candidates=2,
            draft_len=3), dict(temperature=0.7, drafter="lookup"), dict(temperature=0.0, drafter="model+lookup")]
TREE_POLICIES = [dict(temperature=0.0, branches=3, draft_len=3), dict(temperature=0.0, tree_budget=6, draft_len=3),
                 dict(temperature=1.0, tree_budget=6, draft_len=3), dict(temperature=1.0, num_candidates=4, draft_len=2),
                 dict(temperature=1.0, drafter="lookup", lookup_candidates=4)]


@pytest.mark.parametrize("which", ["toy_plain", "toy_tree", "tiny_qwen_bundle"])
def test_device_graphs_decode_like_the_host(request, which):
    """Same tokens and the same number of target calls through the GPU's cache code (GraphDevice on
    the CPU) as through NumPy's, for every policy, greedy and with fixed seeds."""
    bundle = request.getfixturevalue(which)
    host, graph = on_device(bundle, HostDevice()), on_device(bundle, GraphDevice("cpu"))
    policies = POLICIES + (TREE_POLICIES if host.target.takes_tree else [])
    if host.target.spec.min_call_tokens > 1:
        policies = [p for p in policies if p.get("num_candidates", 1) <= 1 and not p.get("tree_budget")]
    drafted = 0
    for prompt in ([1, 2, 3, 1, 2], [4, 0, 3]):
        for policy in policies:
            a = host.generate_ids(prompt, max_new_tokens=20, seed=5, **policy)
            b = graph.generate_ids(prompt, max_new_tokens=20, seed=5, **policy)
            assert b.token_ids == a.token_ids, (which, policy)
            assert b.stats.target_calls == a.stats.target_calls, (which, policy)
            drafted += a.stats.drafted
    assert drafted > 0


def test_only_logits_cross_to_the_host(toy_tree, tiny_qwen_bundle, monkeypatch):
    """Across whole generations (prefill, chains, k rows, tries, draft trees, rollback, gathers) on the
    GPU's code path, every array copied out of ONNX Runtime is a call's logits, guess ids or guess-head
    states: never a
    KV-cache tensor (rank 4), and the device's transfer count says so."""
    fetched = []
    real = ort.OrtValue.numpy

    def numpy(self):
        array = real(self)
        fetched.append(array.shape)
        return array

    monkeypatch.setattr(ort.OrtValue, "numpy", numpy)
    for bundle, policies in ((toy_tree, POLICIES + TREE_POLICIES), (tiny_qwen_bundle, POLICIES)):
        gen = on_device(bundle, GraphDevice("cpu"))
        width = gen.target.spec.logits_width
        before = fetched[:]
        for policy in policies:
            gen.generate_ids([1, 2, 3, 1, 2], max_new_tokens=16, seed=1, **policy)
        new = fetched[len(before):]
        assert new and all(len(shape) <= 3 for shape in new), sorted(set(new))
        state = gen.target.guess_state          # the guess head's state rows, where its chain continues
        widths = {width} | ({state.shape[-1]} if state is not None else set())
        assert all(shape[-1] in widths for shape in new if len(shape) == 3), sorted(set(new))
        moved = gen.target.device.transfers.bytes          # one device object serves both models here
        assert moved == sum(4 * int(np.prod(shape)) for shape in new if len(shape) == 3) + \
            sum(8 * int(np.prod(shape)) for shape in new if len(shape) == 2)


def test_cpu_transfers_are_one_logits_array_per_call(toy_plain):
    """On the CPU's own path too, each call fetches exactly its logits: one array per call."""
    gen = spectr_edge.load(toy_plain, provider="cpu", threads=1)
    res = gen.generate_ids([1, 2, 3], max_new_tokens=24, temperature=1.0, num_candidates=2, draft_len=3, seed=2)
    assert gen.target.device.transfers.calls == gen.target.calls == res.stats.target_calls
    assert gen.draft.device.transfers.calls == gen.draft.calls > 0


def test_the_gather_graph_is_valid_onnx():
    """The runtime writes its one-node gather graphs as protobuf bytes itself (no onnx package): the
    checker accepts them and they gather what np.take gathers."""
    import onnx

    from spectr_edge.device import gather_model

    for dtype, axis in ((np.float32, 2), (np.float16, 0)):
        model = onnx.load_from_string(gather_model(3, dtype, axis))
        onnx.checker.check_model(model)
        assert [n.op_type for n in model.graph.node] == ["Gather"] * 3
    device = GraphDevice("cpu")
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 4)).astype(np.float32)
    got = device.take([device.from_host(x)], np.array([6, 0, 3]), axis=2)[0].numpy()
    assert np.array_equal(got, np.take(x, [6, 0, 3], axis=2))


def test_tensorrt_options_cover_the_engine_calls(tiny_qwen_bundle, tmp_path):
    """TensorRT gets an engine cache, fp16, a workspace and a shape profile from one row of one token
    after an empty past to the largest call the engine makes (checked as strings: no GPU here)."""
    from spectr_edge.bundle import read_bundle
    from spectr_edge.onnx_model import TensorRTSettings, provider_options

    spec = read_bundle(tiny_qwen_bundle).target
    chain = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    trt, cuda, cpu = provider_options(chain, spec, TensorRTSettings(engine_cache=str(tmp_path / "trt"), max_rows=4))
    name, opts = trt
    assert name == "TensorrtExecutionProvider" and opts["trt_fp16_enable"] == "True"
    assert opts["trt_engine_cache_path"] == str(tmp_path / "trt") and (tmp_path / "trt").is_dir()
    lo, hi = opts["trt_profile_min_shapes"], opts["trt_profile_max_shapes"]
    assert f"{spec.input_ids}:1x1" in lo and f"{spec.input_ids}:4x64" in hi
    past = spec.past[0][0]
    assert f"{past}:4x{spec.num_kv_heads}x{spec.context_length}x{spec.head_dim}" in hi
    assert cuda[0] == "CUDAExecutionProvider" and cpu == "CPUExecutionProvider"
