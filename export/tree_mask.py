"""Make an exported decoder take a 4D attention mask, for tree verification (docs/ALGORITHMS.md).

An optimum export builds one boolean mask [batch, 1, new, past + new] inside the graph from
the 2D `attention_mask` (causal and padding rules) and every layer's attention reads it.
`add_tree_mask` finds that shared tensor and turns it into a graph input, so the caller
chooses which cached and new positions each new token attends to (a token trie: each node
sees the past and its ancestors). Weights are untouched: only the graph proto changes (a
few MB even for a 1.5B model whose weights live in external data), and the nodes that
built the mask are pruned, so `attention_mask` disappears from the inputs.

How the tensor is found, without relying on node names: the candidates are tensors that
depend on `attention_mask`, not on hidden states (nothing after a MatMul), and lie on the
path of every attention Softmax; the one
closest to the Softmaxes (no other candidate below it) is the shared mask. Anything else
(no Softmax, no single shared tensor, not boolean) is an ExportError that says so.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from spectr_edge.bundle import write_manifest
from spectr_edge.errors import ExportError

from .fuse_attention import FUSED, fuse_attention
from .fuse_rotary import FOLDED, fold_rotary
from .quantize import min_call_tokens, quantizes_activations

TREE_MASK_INPUT = "tree_attention_mask"
QUANTIZED_REL_TOL = 0.05


def _shared_mask(graph, mask_input: str) -> str:
    producer = {o: n for n in graph.node for o in n.output}
    consumers = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            consumers[i].append(n)
    def downstream(starts) -> set[str]:
        seen, todo = set(starts), list(starts)
        while todo:
            for n in consumers[todo.pop()]:
                for o in n.output:
                    if o not in seen:
                        seen.add(o)
                        todo.append(o)
        return seen

    # tensors that depend on the 2D mask but not on hidden states (anything after a matrix product)
    hidden = downstream([o for n in graph.node if n.op_type in ("MatMul", "MatMulNBits", "Gemm") for o in n.output])
    depends = downstream([mask_input]) - hidden
    softmaxes = [n for n in graph.node if n.op_type == "Softmax"]
    if not softmaxes:
        raise ExportError("the graph has no Softmax (fused attention?); tree verification needs an optimum "
                          "export with unfused attention")

    def ancestors(tensor: str) -> set[str]:   # within the mask-derived tensors
        seen, todo = set(), [tensor]
        while todo:
            t = todo.pop()
            if t in seen or t not in depends:
                continue
            seen.add(t)
            if t in producer:
                todo.extend(i for i in producer[t].input if i)
        return seen

    def entries(softmax) -> set[str]:
        """Mask-derived tensors a few nodes above this Softmax: where the mask enters its scores."""
        found, frontier = set(), [softmax.input[0]]
        for _ in range(4):
            nxt = []
            for t in frontier:
                if t in depends:
                    found.add(t)
                elif t in producer:
                    nxt.extend(i for i in producer[t].input if i)
            frontier = nxt
        return found

    per_layer = []
    for s in softmaxes:
        anc = set()
        for e in entries(s):
            anc |= ancestors(e)
        per_layer.append(anc)
    common = set.intersection(*per_layer)
    common.discard(mask_input)
    lowest = [t for t in common if not any(o in common for n in consumers[t] for o in n.output)]
    if len(lowest) != 1:
        raise ExportError(f"could not find the one attention mask all {len(softmaxes)} attention layers share "
                          f"(found {len(lowest)} candidates); this export cannot take a tree mask")
    return lowest[0]


def _prune(graph) -> None:
    """Drop nodes whose outputs reach no graph output, then inputs nothing reads."""
    producer = {o: n for n in graph.node for o in n.output}
    needed, todo = set(), [o.name for o in graph.output]
    keep = set()
    while todo:
        t = todo.pop()
        if t in needed:
            continue
        needed.add(t)
        n = producer.get(t)
        if n is not None and id(n) not in keep:
            keep.add(id(n))
            todo.extend(i for i in n.input if i)
            for a in n.attribute:   # nodes with subgraphs (If/Loop) read outer tensors too
                if a.g is not None and a.g.node:
                    todo.extend(i for sub in a.g.node for i in sub.input if i)
    nodes = [n for n in graph.node if id(n) in keep]
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    inputs = [i for i in graph.input if i.name in used]
    del graph.input[:]
    graph.input.extend(inputs)


def add_tree_mask(model, mask_input: str = "attention_mask") -> tuple[object, bool]:
    """Rewrite an onnx ModelProto in place; returns (model, whether attention_mask is still an input)."""
    from onnx import TensorProto, helper

    graph = model.graph
    if any(i.name == TREE_MASK_INPUT for i in graph.input):
        raise ExportError(f"the graph already takes {TREE_MASK_INPUT}")
    if not any(i.name == mask_input for i in graph.input):
        raise ExportError(f"the graph has no '{mask_input}' input to replace")
    shared = _shared_mask(graph, mask_input)
    producer = {o: n for n in graph.node for o in n.output}
    if producer[shared].op_type not in ("Expand", "And", "Or", "LessOrEqual", "Less", "Equal", "Not", "Greater",
                                        "GreaterOrEqual", "Cast", "Where", "Identity"):
        raise ExportError(f"the shared attention mask {shared} comes from a {producer[shared].op_type} node, "
                          "not a boolean mask; this export cannot take a tree mask")
    for n in graph.node:
        for idx, name in enumerate(n.input):
            if name == shared:
                n.input[idx] = TREE_MASK_INPUT
    graph.input.append(helper.make_tensor_value_info(
        TREE_MASK_INPUT, TensorProto.BOOL, ["batch_size", 1, "sequence_length", "total_sequence_length"]))
    _prune(graph)
    still = any(i.name == mask_input for i in graph.input)
    return model, still


def _session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _run(sess, entry: dict, ids: np.ndarray, past: list | None, tree=None, depth=None) -> tuple:
    """One call of a graph described by a manifest entry; returns (logits [n, W], presents)."""
    inputs, outputs = entry["inputs"], entry["outputs"]
    n, p = len(ids), (0 if past is None else past[0].shape[2])
    feed = {inputs["input_ids"]: ids[None].astype(np.int64),
            inputs["position_ids"]: (p + (np.arange(n) if depth is None else depth))[None].astype(np.int64)}
    if inputs.get("attention_mask"):
        feed[inputs["attention_mask"]] = np.ones((1, p + n), np.int64)
    if inputs.get("logits_keep"):                   # every position's logits (export/logits_keep.py)
        feed[inputs["logits_keep"]] = np.array([n], np.int64)
    if entry.get("tree_mask"):
        mask = np.ones((1, 1, n, p + n), bool)
        mask[0, 0, :, p:] = np.tri(n, dtype=bool) if tree is None else tree
        feed[entry["tree_mask"]] = mask
    shape = (1, entry["num_kv_heads"], 0, entry["head_dim"])
    for layer, (k, v) in enumerate(inputs["past"]):
        feed[k] = past[2 * layer] if past else np.zeros(shape, np.float32)
        feed[v] = past[2 * layer + 1] if past else np.zeros(shape, np.float32)
    names = [outputs["logits"]] + [x for kv in outputs["present"] for x in kv]
    res = sess.run(names, feed)
    return res[0][0].astype(np.float32), res[1:]


def check_tree_graph(original: Path, rewritten: Path, entry: dict, new_entry: dict, ids: np.ndarray) -> str:
    """ExportError unless the rewritten graph scores a causal chain and a token tree like the original.

    ids # [n >= 8]. Chain: all n ids in one call, both graphs. Tree: the first n-3 ids, then
    nodes [r, a, b, c] with r = ids[-3], a = ids[-2] (child of r), b = another token (child of r),
    c = ids[-1] (child of a): r, a, c must score exactly like positions n-3, n-2, n-1 of the chain.
    Returns what was checked, for the log.
    """
    from .onnx_export import parity_tolerance

    ref, _ = _run(_session(original), entry, ids, None)                          # [n, W]
    sess = _session(rewritten)
    chain, _ = _run(sess, new_entry, ids, None)
    _, past = _run(sess, new_entry, ids[:-3], None)
    other = (int(ids[-2]) + 1) % max(2, int(ids.max()) + 1)
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    nodes, _ = _run(sess, new_entry, np.array([ids[-3], ids[-2], other, ids[-1]]), past, tree,
                    np.array([0, 1, 1, 2]))
    diffs = [float(np.abs(chain - ref).max()), float(np.abs(nodes[[0, 1, 3]] - ref[-3:]).max())]
    quantized = _per_call_quantized(rewritten)
    tol = parity_tolerance(ref)
    if quantized:
        # activations quantized per call: a token's logits depend on the call it is in, so the tree
        # cannot match the chain exactly (nor can k rows x L); and a rewritten attention (fused
        # kernel) rounds differently, which moves the int8-quantized activations: the chain is held
        # to a quantization-noise bound (5% of the largest logit; a wrong mask, position or cache
        # moves logits by O(1) of it), the tree is not compared
        diffs[1] = 0.0
        tol = QUANTIZED_REL_TOL * max(1.0, float(np.abs(ref).max()))
    if max(diffs) > tol:
        raise ExportError(f"the rewritten graph {rewritten.name} scores differently from the original "
                          f"(chain {diffs[0]:.2e}, tree {diffs[1]:.2e} > {tol:.2e}); this export cannot take "
                          "a tree mask (use --no-tree-mask)")
    if quantized:
        return (f"chain logits match the original within quantization noise (max diff {diffs[0]:.1e}); tree not "
                "compared exactly: activations are quantized per call")
    return f"chain and tree logits match the original (max diff {max(diffs):.1e})"


def _per_call_quantized(path: Path) -> bool:
    """Whether activations are quantized inside the graph (int8 dynamic, w8a8, or MatMulNBits with
    int8 compute, accuracy_level 4): the kernels then take other paths for other call shapes and a
    token's logits move with the call it is scored in (a 4-node tree vs an 11-token chain moved
    the int4 0.5B draft's logits by 0.23), so only the chain is compared exactly."""
    import onnx

    return quantizes_activations(onnx.load(str(path), load_external_data=False).graph)


def tree_entry(entry: dict, still_has_mask: bool, fused: bool = False, folded: bool = False) -> dict:
    new = {**entry, "inputs": dict(entry["inputs"]), "tree_mask": TREE_MASK_INPUT}
    if not still_has_mask:
        new["inputs"]["attention_mask"] = None
    if fused:
        new["attention"] = FUSED
    if folded:
        new["rotary"] = FOLDED
    return new


def try_fold_rotary(model, entry: dict, base_dir: Path, log=print) -> bool:
    """fold_rotary in place where the pattern is found; False (and the graph unchanged) where not."""
    import copy

    trial = copy.deepcopy(model)
    try:
        fold_rotary(trial, entry["inputs"]["position_ids"], int(entry["context_length"]), base_dir)
    except ExportError as err:
        log(f"      rotary embedding left outside the attention kernel: {err}")
        return False
    model.CopyFrom(trial)
    return True


def rewrite_graph(src: Path, dst: Path, entry: dict | None = None, fuse: bool = False,
                  log=print, fold: bool = True, merge: bool = True) -> tuple[bool, bool, bool]:
    """Write the tree-mask version of src (same external data, same directory) to dst, atomically.

    A graph that already takes a tree mask keeps it. With fuse (and the manifest entry, for the
    cache names), the attention is also fused (export/fuse_attention.py), with fold and where the
    pattern is found, the rotary embedding folded into it (export/fuse_rotary.py), and with merge the
    projections merged and the residual adds moved into the norms (fewer_ops). Returns (whether
    attention_mask is still an input, whether the attention is fused, whether the rotary is folded).
    """
    import onnx

    from .writer import save_graph_beside

    model = onnx.load(str(src), load_external_data=False)
    if any(i.name == TREE_MASK_INPUT for i in model.graph.input):
        still = any(i.name == "attention_mask" for i in model.graph.input)
    else:
        model, still = add_tree_mask(model)
    folded, weights = False, None
    if fuse:
        fuse_attention(model, entry["inputs"]["past"], entry["outputs"]["present"], int(entry["head_dim"]),
                       int(entry["num_kv_heads"]), TREE_MASK_INPUT)
        folded = fold and try_fold_rotary(model, entry, src.parent, log)
        if merge:
            weights, _ = fewer_ops(model, src, dst, log)
    save_graph_beside(model, src, dst, "tree-mask", weights)
    return still, fuse, folded


def weights_reader(base_dir: Path):
    """A function tensor -> its values, external data read from base_dir (hard-linked files too), through a
    copy of the tensor: the graph's own proto keeps no bytes it did not have."""
    from onnx import TensorProto, numpy_helper

    from .fuse_rotary import _inline

    def read(tensor) -> np.ndarray:
        copy = TensorProto()
        copy.CopyFrom(tensor)
        _inline(copy, base_dir)
        return numpy_helper.to_array(copy)
    return read


def fewer_ops(model, src: Path, dst: Path, log=print):
    """Merge sibling projections and fold residual adds into the norms (export/merge_ops.py), in place.
    Returns (the WeightsFile that holds dst's weights when projections were merged, else None: the
    graph keeps src's external data; how many rewrites were made)."""
    from .merge_ops import fuse_skip_norms, merge_projections
    from .writer import WeightsFile

    weights = WeightsFile(dst)
    try:
        merged = merge_projections(model, weights_reader(src.parent), weights.put)
        norms = fuse_skip_norms(model)
        if merged:
            weights.take_rest(model, src.parent)
    except BaseException:
        weights.discard()
        raise
    if not merged:
        weights.discard()
        weights = None
    if merged or norms:
        log(f"      {merged} groups of projections merged into one matrix product each, {norms} residual adds "
            "folded into their norms")
    return weights, merged + norms


def rewrite_checked(src: Path, dst: Path, entry: dict, ids: np.ndarray, fuse: bool = True,
                    log=print, fold: bool = True, merge: bool = True) -> tuple[dict, str]:
    """rewrite_graph + check_tree_graph; when fusing fails (pattern or check), falls back to the
    unfused tree graph and says why. Returns (the new manifest entry, what was checked)."""
    if fuse:
        try:
            still, fused, folded = rewrite_graph(src, dst, entry, fuse=True, log=log, fold=fold, merge=merge)
            new = tree_entry(entry, still, fused, folded)
            return new, check_tree_graph(src, dst, entry, new, ids) + "; attention fused (GroupQueryAttention" + (
                ", rotary embedding inside)" if folded else ")")
        except ExportError as err:
            log(f"      attention left unfused: {err}")
            dst.with_name(dst.name + ".data").unlink(missing_ok=True)    # merged weights of the refused graph
    still, _, _ = rewrite_graph(src, dst)
    new = tree_entry(entry, still)
    return new, check_tree_graph(src, dst, entry, new, ids)


def _fold_in_bundle(bundle: Path, role: str, entry: dict, ids: np.ndarray, log=print,
                    merge: bool = True) -> list[Path] | None:
    """Fold the rotary embedding of a bundle's fused graph into its attention (export/fuse_rotary.py)
    and merge its projections (fewer_ops): the new graph is written beside the old one and checked
    against it, then entry (in place) points at it; returns the old graph's files, for the caller to
    remove once the manifest says so. None where the pattern is not found (nothing changes)."""
    import onnx

    src = bundle / entry["file"]
    model = onnx.load(str(src), load_external_data=False)
    if not try_fold_rotary(model, entry, src.parent, log):
        return None
    log(f"{role}: folding the rotary embedding into the attention kernel ({entry['file']}) ...")
    return _replace_checked(bundle, role, entry, model, src.with_name(src.name.split(".")[0] + ".rotary.onnx"),
                            ids, log, {"rotary": FOLDED}, merge)


def _fewer_ops_in_bundle(bundle: Path, role: str, entry: dict, ids: np.ndarray, log=print) -> list[Path] | None:
    """fewer_ops on a bundle's fused graph made before it existed: written beside it (model.merged.onnx,
    with its own weights file when projections were merged), checked, then entry (in place) points at
    it; returns the old graph's files, or None when there is nothing to merge."""
    import onnx

    src = bundle / entry["file"]
    model = onnx.load(str(src), load_external_data=False)
    base = src.name.split(".")[0]
    dst = src.with_name(base + (".merged.onnx" if src.name != base + ".merged.onnx" else ".fewer.onnx"))
    return _replace_checked(bundle, role, entry, model, dst, ids, log, {}, merge=True)


def _replace_checked(bundle: Path, role: str, entry: dict, model, dst: Path, ids: np.ndarray, log,
                     fields: dict, merge: bool = True) -> list[Path] | None:
    """Save model (rewritten from entry's graph) as dst, after fewer_ops where merge; check it against
    the old graph; point entry (in place) at it. Returns the old graph's files (None: merge found
    nothing and there was no other change to save)."""
    from .onnx_export import model_files
    from .writer import save_graph_beside

    src = bundle / entry["file"]
    weights, rewrites = fewer_ops(model, src, dst, log) if merge else (None, 0)
    if not fields and not rewrites:
        return None
    save_graph_beside(model, src, dst, "rewritten", weights)
    new = {**entry, **fields, "file": dst.relative_to(bundle).as_posix(),
           "size_bytes": sum(f.stat().st_size for f in model_files(dst))}
    try:
        checked = check_tree_graph(src, dst, entry, new, ids)
    except ExportError:
        remove_unreferenced(model_files(dst), src)
        raise
    log(f"{role}: " + checked)
    old = model_files(src)
    entry.clear()
    entry.update(new)
    return old


def add_tree_mask_to_bundle(bundle: Path, log=print, fuse: bool = True, fold: bool = True,
                            merge: bool = True) -> list[str]:
    """Upgrade an existing bundle in place: every graph gets a tree mask and (fuse) fused attention,
    (fold) with the rotary embedding inside the attention kernel, also for graphs fused before that
    existed (model.rotary.onnx), and (merge) merged projections and residual adds inside the norms,
    also for graphs fused and folded before that existed (model.merged.onnx, with its own weights).

    Each model's new graph is written beside the old one (model.gqa.onnx, or model.tree.onnx
    when not fused; the weights in external data are shared, or written anew beside it when
    projections are merged), checked, then the manifest is switched to it atomically and the old
    graph's files removed, so an interruption at any point leaves a loadable bundle. Then every graph gets the logits_keep input (export/logits_keep.py).
    Returns the roles changed.
    """
    import os

    from .onnx_export import model_files
    from .writer import existing_manifest, remove_unreferenced

    bundle = Path(bundle)
    manifest_path = bundle / "spectr.json"
    manifest = existing_manifest(bundle)
    changed = []
    ids = (np.arange(11) * 7919 + 13) % int(manifest["tokenizer"]["vocab_size"])   # the probe every check scores
    for role, entry in manifest["models"].items():
        if role == "target" and entry.get("min_call_tokens", 1) < min_call_tokens(bundle / entry["file"]):
            entry["min_call_tokens"] = min_call_tokens(bundle / entry["file"])      # bundles made before it
            log(f"{role}: every call scores >= {entry['min_call_tokens']} tokens (int4 kernel numerics)")
            write_manifest(manifest_path.parent, manifest)
        if entry.get("tree_mask") and entry.get("attention") == FUSED and fold and entry.get("rotary") != FOLDED:
            old = _fold_in_bundle(bundle, role, entry, ids, log, merge)
            if old is not None:
                write_manifest(manifest_path.parent, manifest)
                remove_unreferenced(old, bundle / entry["file"])
                changed.append(role)
            continue
        if entry.get("tree_mask") and entry.get("attention") == FUSED and fuse:
            old = _fewer_ops_in_bundle(bundle, role, entry, ids, log) if merge else None
            if old:
                write_manifest(manifest_path.parent, manifest)
                remove_unreferenced(old, bundle / entry["file"])
                changed.append(role)
            else:
                log(f"{role}: already takes a tree mask with fused attention")
            continue
        if entry.get("tree_mask") and not fuse:
            log(f"{role}: already takes a tree mask")
            continue
        if not entry["inputs"].get("position_ids"):
            raise ExportError(f"the {role} graph has no position_ids input; a tree needs explicit positions")
        src = bundle / entry["file"]
        base = src.name.split(".")[0]
        dst = src.with_name(base + (".gqa.onnx" if fuse else ".tree.onnx"))
        if dst == src:
            continue
        log(f"{role}: rewriting {entry['file']} to take a 4D attention mask"
            + (" and fused attention" if fuse else "") + " ...")
        new_entry, checked = rewrite_checked(src, dst, entry, ids, fuse=fuse, log=log, fold=fold, merge=merge)
        if new_entry.get("attention") != FUSED and entry.get("tree_mask"):
            dst.unlink(missing_ok=True)      # fusing failed and the graph already had its tree mask
            continue
        if new_entry.get("attention") != FUSED and fuse:
            fallback = src.with_name(base + ".tree.onnx")
            os.replace(dst, fallback)
            dst = fallback
        new_entry["file"] = dst.relative_to(bundle).as_posix()
        log(f"{role}: " + checked)
        old_files = model_files(src)
        manifest["models"][role] = new_entry
        write_manifest(manifest_path.parent, manifest)
        if src != dst:
            remove_unreferenced(old_files, dst)
        changed.append(role)
    from .logits_keep import add_logits_keep_to_bundle
    for role in add_logits_keep_to_bundle(bundle, log):
        if role not in changed:
            changed.append(role)
    return changed
