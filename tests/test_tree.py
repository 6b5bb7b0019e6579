"""Tree verification: the trie, the cache gather, the 4D-mask graph rewrite and bundle upgrade.

The output law of the trie path is checked by Monte Carlo in test_montecarlo.py (tree section);
here: exact structure of the trie, exact cache moves, and on a tiny Llama exported through the
real path (without tree masks), that the upgraded bundle decodes token for token like the original.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from spectr_edge.device import GraphDevice, HostDevice
from spectr_edge.kv_cache import KVCache
from spectr_edge.selection import greedy_walk
from spectr_edge.trees import SequoiaShape, TokenTrie


def test_trie_shares_prefixes_and_indexes_rows():
    # root 9; rows (1 2 3), (1 2 4), (5 6 7): nodes 9 | 1 2 3 | 4 | 5 6 7 -> 8 nodes, not 1 + 3 x 3
    trie = TokenTrie(9, np.array([[1, 2, 3], [1, 2, 4], [5, 6, 7]]))
    assert trie.tokens.tolist() == [9, 1, 2, 3, 4, 5, 6, 7]
    assert trie.depth.tolist() == [0, 1, 2, 3, 3, 1, 2, 3]
    assert trie.node_of.tolist() == [[0, 1, 2, 3], [0, 1, 2, 4], [0, 5, 6, 7]]
    # node 4 (token 4) attends to root, 1, 2 and itself; not to its sibling 3 or the other branch
    assert np.flatnonzero(trie.ancestors[4]).tolist() == [0, 1, 2, 4]
    assert np.flatnonzero(trie.ancestors[7]).tolist() == [0, 5, 6, 7]
    assert trie.ancestors[0].tolist() == [True] + [False] * 7


def test_greedy_walk_follows_the_target_argmax_through_leaves():
    # chain 1 2 3 with leaves 7 (depth 1) and 8 (depth 2); the target prefers 1, then 8, then 5
    trie = TokenTrie(0, [[1, 2, 3], [7], [1, 8]])
    logits = np.zeros((trie.tokens.size, 10), dtype=np.float32)
    node = {tuple(k): v for k, v in trie.children.items()}
    logits[0, 1] = 1                        # root -> 1 (on the chain)
    logits[node[(0, 1)], 8] = 1             # after 1 -> 8 (a leaf, not the chain's 2)
    logits[node[(node[(0, 1)], 8)], 5] = 1  # after 8 -> 5 (bonus from the leaf's logits)
    tokens, path = greedy_walk(trie, logits, vocab_size=10)
    assert tokens == [1, 8, 5]
    assert path == [0, node[(0, 1)], node[(node[(0, 1)], 8)]]


def test_trie_row_view_reads_node_logits():
    trie = TokenTrie(0, np.array([[1, 2], [1, 3]]))
    node_logits = np.arange(trie.tokens.size * 2, dtype=np.float32).reshape(-1, 2)   # [N, W=2]
    view = trie.row_view(node_logits)
    assert view[1, 2].tolist() == node_logits[trie.node_of[1, 2]].tolist()           # row 1, depth 2: node 3
    assert trie.node_of[1, 2] == 3 and view[0, 1].tolist() == node_logits[1].tolist()


@pytest.mark.parametrize("device", [HostDevice(), GraphDevice("cpu")], ids=["host", "graph"])
def test_gather_moves_the_path_to_contiguous_positions(device):
    cache = KVCache(device, num_layers=2, num_kv_heads=1, head_dim=1)
    # past 3 positions (values 0, 1, 2) then 5 tree nodes (values 10..14)
    values = np.array([0, 1, 2, 10, 11, 12, 13, 14], dtype=np.float32).reshape(1, 1, 8, 1)

    def fill(signs):
        cache.values = [device.from_host(sign * values) for sign in signs]

    fill([1, -1, 1, -1])
    cache.gather(3, np.array([3, 5, 7]))               # path: root (node 0), node 2, node 4
    k, v = cache.host_layers()[1]
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 10, 12, 14] and v[0, 0, :, 0].tolist() == [0, -1, -2, -10, -12, -14]
    fill([1, 1, 1, 1])
    cache.gather(3, np.array([3, 4]))                  # already contiguous: a crop
    assert cache.host_layers()[0][0][0, 0, :, 0].tolist() == [0, 1, 2, 10, 11]


def test_rewrite_refuses_a_graph_without_attention():
    import onnx
    from onnx import TensorProto, helper

    from spectr_edge_export.tree_mask import add_tree_mask
    from spectr_edge.errors import ExportError

    graph = helper.make_graph(
        [helper.make_node("Cast", ["attention_mask"], ["logits"], to=TensorProto.FLOAT)], "no_attention",
        [helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t"])])
    with pytest.raises(ExportError, match="no Softmax"):
        add_tree_mask(onnx.helper.make_model(graph))


@pytest.fixture(scope="module")
def upgraded(tiny_bundle, tmp_path_factory):
    """A copy of the tiny Llama bundle (exported with --no-tree-mask), upgraded in place by the CLI."""
    from click.testing import CliRunner

    from spectr_edge.cli import main

    manifest = json.loads((tiny_bundle / "spectr.json").read_text())
    assert not any(m.get("tree_mask") for m in manifest["models"].values())
    out = tmp_path_factory.mktemp("upgrade") / "bundle"
    shutil.copytree(tiny_bundle, out)
    result = CliRunner().invoke(main, ["export", "--add-tree-mask", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "target, draft upgraded (tree verification" in result.output
    return out


def test_upgrade_rewrites_graphs_and_manifest(upgraded):
    manifest = json.loads((upgraded / "spectr.json").read_text())
    for role, entry in manifest["models"].items():
        assert entry["tree_mask"] == "tree_attention_mask"
        assert entry["inputs"]["attention_mask"] is None
        assert entry["file"] == f"{role}/model.gqa.onnx"
        assert entry["attention"] == "gqa"                      # fused GroupQueryAttention
        assert entry["rotary"] == "gqa"                         # rotating query and key itself
        assert entry["inputs"]["logits_keep"] == "logits_keep"  # a prefill computes one row of logits
        assert not (upgraded / role / "model.onnx").exists()    # the old graph is gone


def test_upgraded_bundle_decodes_like_the_original(tiny_bundle, upgraded):
    import spectr_edge

    before = spectr_edge.load(tiny_bundle, provider="cpu")
    after = spectr_edge.load(upgraded, provider="cpu")
    assert after.target.takes_tree and not before.target.takes_tree
    assert after.target.in_place and not before.target.in_place    # cache buffers updated in place
    assert after.target.logits_keep and not before.target.logits_keep
    prompt = [5, 6, 7, 8, 9]
    plain = before.generate_ids(prompt, max_new_tokens=32, temperature=0, num_candidates=0).token_ids
    for k, L in ((0, 1), (1, 3), (2, 3), (4, 3)):     # k > 1: the greedy chain + k - 1 leaves per depth
        width = dict(num_candidates=0) if k == 0 else dict(branches=k)
        got = after.generate_ids(prompt, max_new_tokens=32, temperature=0, draft_len=L, **width)
        assert got.token_ids == plain, (k, L)
        assert k < 2 or got.stats.scored > got.stats.steps * (L + 1)   # the leaves were scored
    # sampling, k = 4: the trie path and the replicated path see the same logits (to float rounding)
    # and the same random numbers, so with one seed they pick the same tokens
    for seed in range(3):
        a = before.generate_ids(prompt, max_new_tokens=40, temperature=1.0, num_candidates=4, draft_len=3, seed=seed)
        b = after.generate_ids(prompt, max_new_tokens=40, temperature=1.0, num_candidates=4, draft_len=3, seed=seed)
        assert b.token_ids == a.token_ids, seed
        assert b.stats.scored < a.stats.scored          # the trie shared the root and common prefixes


def test_upgrade_twice_is_a_no_op(upgraded):
    from spectr_edge_export.tree_mask import add_tree_mask_to_bundle

    assert add_tree_mask_to_bundle(upgraded, log=lambda _: None) == []


def test_upgrade_of_a_missing_bundle_is_one_line(tmp_path):
    from click.testing import CliRunner

    from spectr_edge.cli import main

    result = CliRunner().invoke(main, ["export", "--add-tree-mask", "--out", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "is not a bundle" in result.output
    assert "Traceback" not in result.output


def test_new_exports_take_a_tree_mask(tiny_qwen_bundle):
    import spectr_edge

    manifest = json.loads((tiny_qwen_bundle / "spectr.json").read_text())
    assert all(m["tree_mask"] == "tree_attention_mask" for m in manifest["models"].values())
    assert spectr_edge.load(tiny_qwen_bundle, provider="cpu").target.takes_tree


def test_sequoia_shape_keeps_the_highest_valued_nodes():
    # values: root's first child 0.5, its first child 0.25, the root's second child 0.2 (0.1 and deeper left out)
    shape = SequoiaShape(3, 2, accept=(0.5, 0.2))
    assert shape.depth == [0, 1, 2, 1] and shape.children == [2, 1, 0, 0]
    assert shape.child(0, 0) == 1 and shape.child(1, 0) == 2 and shape.child(0, 1) == 3
    assert shape.value == pytest.approx([1.0, 0.5, 0.25, 0.2])     # expected tokens per step: 1.95
