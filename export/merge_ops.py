"""Fewer operators per layer: sibling projections in one matrix product, residual adds inside the norms.

Why: on a CPU decode step (one or two rows) every operator costs its launch and its thread-pool
hand-off whatever its size, and a matrix product shares its threads better when it has more
output columns. After export/fuse_rotary.py a Qwen2 layer still runs its query, key and value
projections as three products (plus three bias Adds and the Concat that packs them), its MLP's
gate and up projections as two, and each residual Add before an RMS norm as an operator of its
own. Merged, the int4 1.5B target runs 28 x 6 fewer operators, with bit-identical logits (the
products compute each output column independently).

merge_projections: products that read the same input with constant weights of one kind and one
layout (MatMul [K, N]; or MatMulNBits with the same bits, block size and accuracy level, no bias
or g_idx input; not the guess head's) become one product whose weights are stacked by output column (MatMul along N;
MatMulNBits' packed weights, scales and zero points are stored column by column, so they stack
along their first axis), followed by a Split into the old outputs. Where the split outputs (each
optionally plus a constant bias) only feed one Concat in the same order, as the packed Q, K, V of
GroupQueryAttention do, the Split and Concat go and the biases become one (MatMulNBits' own bias
input, or one Add). Weights used by anything else (a tied LM head) are left alone.

fuse_skip_norms: Add(a, b) -> SimplifiedLayerNormalization becomes ONNX Runtime's
SkipSimplifiedLayerNormalization(a, b), whose fourth output is the sum for the residual path.

New weights are handed to `store` as they are made (writer.WeightsFile appends them to the new
graph's external data), so a float32 1.5B graph is merged holding one layer's weights at a time.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import numpy as np

from .logits_keep import GUESS_HEAD_PREFIX

def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _key(node, inits: dict) -> tuple | None:
    """What products must share to be stacked (None: this node cannot be)."""
    if node.name.startswith(GUESS_HEAD_PREFIX):      # the guess head's products stay its own (guess_head.py)
        return None
    if node.op_type == "MatMul":
        w = inits.get(node.input[1])
        if w is None or len(w.dims) != 2:
            return None
        return ("MatMul", node.input[0], w.data_type, w.dims[0])
    if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
        if len(node.input) > 4 and any(node.input[4:]):        # g_idx or bias: not stacked
            return None
        if not all(i in inits for i in node.input[1:]):
            return None
        a = _attrs(node)
        return ("MatMulNBits", node.input[0], tuple(sorted((k, v) for k, v in a.items() if k != "N")),
                tuple(inits[i].data_type for i in node.input[1:]))
    return None


def _constant(name: str, producer: dict) -> str:
    """The tensor behind Identity nodes (the export reads one initializer through Identity where weights are equal)."""
    while name in producer and producer[name].op_type == "Identity":
        name = producer[name].input[0]
    return name


def _columns(node, inits: dict) -> int:
    return inits[node.input[1]].dims[1] if node.op_type == "MatMul" else _attrs(node)["N"]


def merge_projections(model, read: Callable, store: Callable) -> int:
    """Merge in place (see the module docstring); returns how many groups of products were merged.

    read(tensor) -> np.ndarray: an initializer's values (its external data included);
    store(tensor_proto): takes a new initializer (e.g. writes its bytes out) before it joins the graph.
    """
    from onnx import helper, numpy_helper

    from .fuse_attention import _topological
    from .tree_mask import _prune

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    uses = defaultdict(int)
    for n in graph.node:
        for i in n.input:
            uses[i] += 1
    groups: dict[tuple, list] = defaultdict(list)
    for n in graph.node:
        key = _key(n, inits)
        if key is not None and all(uses[i] == 1 for i in n.input[1:]):
            groups[key].append(n)
    merged = 0
    for key, nodes in groups.items():
        if len(nodes) < 2:
            continue
        name = f"{nodes[0].name or nodes[0].output[0]}_merged"
        widths = [_columns(n, inits) for n in nodes]
        axis = 1 if key[0] == "MatMul" else 0
        stacked = []
        for j in range(1, len(nodes[0].input)):
            t = numpy_helper.from_array(np.concatenate([read(inits[n.input[j]]) for n in nodes], axis=axis),
                                        f"{name}_{j}")
            store(t)
            stacked.append(t)
        out = f"{name}_out"
        if key[0] == "MatMul":
            product = helper.make_node("MatMul", [nodes[0].input[0], stacked[0].name], [out], name=name)
        else:
            product = helper.make_node("MatMulNBits", [nodes[0].input[0]] + [t.name for t in stacked], [out],
                                       name=name, domain="com.microsoft", **dict(_attrs(nodes[0]), N=sum(widths)))
        split = numpy_helper.from_array(np.asarray(widths, np.int64), f"{name}_split")
        graph.initializer.extend(stacked + [split])
        for n in nodes:
            graph.node.remove(n)
        graph.node.extend([product, helper.make_node("Split", [out, split.name], [n.output[0] for n in nodes],
                                                     name=f"{name}_split", axis=-1)])
        merged += 1
        _drop_split_concat(graph, graph.node[len(graph.node) - 2], read, store)    # the graph's copy of product
    if merged:
        _prune(graph)
        used = {i for n in graph.node for i in n.input}
        kept = [t for t in graph.initializer if t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        _topological(graph)
    return merged


def _drop_split_concat(graph, product, read: Callable, store: Callable) -> None:
    """product -> Split -> [+ bias_i] -> Concat(axis -1, same order): the Split and Concat go, the
    biases become one (MatMulNBits' bias input, or one Add after a MatMul)."""
    from onnx import helper, numpy_helper

    split = next(n for n in graph.node if n.op_type == "Split" and n.input[0] == product.output[0])
    consumers = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            consumers[i].append(n)
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    biases, ends = [], []
    for part in split.output:
        readers = consumers[part]
        if len(readers) != 1:
            return
        node = readers[0]
        if node.op_type == "Add":
            bias = _constant(node.input[1] if node.input[0] == part else node.input[0], producer)
            if bias not in inits or len(inits[bias].dims) != 1 or len(consumers[node.output[0]]) != 1:
                return
            biases.append(bias)
            ends.append(node.output[0])
            node = consumers[node.output[0]][0]
        else:
            ends.append(part)
        if node.op_type != "Concat" or _attrs(node).get("axis") not in (-1, 2):
            return
        concat = node
    if list(concat.input) != ends or (biases and len(biases) != len(ends)):
        return
    for n in {id(c): c for part in split.output for c in consumers[part]}.values():
        if n.op_type == "Add":
            graph.node.remove(n)
    graph.node.remove(split)
    graph.node.remove(concat)
    if not biases:
        product.output[0] = concat.output[0]
        return
    bias = numpy_helper.from_array(np.concatenate([read(inits[b]) for b in biases]), f"{product.name}_bias")
    store(bias)
    graph.initializer.append(bias)
    if product.op_type == "MatMulNBits":
        while len(product.input) < 5:
            product.input.append("")
        product.input.append(bias.name)
        product.output[0] = concat.output[0]
    else:
        graph.node.append(helper.make_node("Add", [product.output[0], bias.name], [concat.output[0]],
                                           name=f"{product.name}_add_bias"))


def _rms_norm(graph, mean, producer: dict, consumers: dict, inits: dict) -> tuple | None:
    """(x, gamma, epsilon, y, nodes) for the exported RMS norm around ReduceMean node `mean`:
    x -> Pow(x, 2) -> ReduceMean(-1) -> Add(eps) -> Sqrt -> Div(1, .) -> Mul(x, .) [-> Cast] -> Mul(gamma) = y."""
    from .fuse_attention import _scalar

    def only(tensor: str, op: str):
        readers = consumers.get(tensor, [])
        return readers[0] if len(readers) == 1 and readers[0].op_type == op else None

    power = producer.get(mean.input[0])
    if power is None or power.op_type != "Pow" or _scalar(graph, power.input[1], producer) != 2.0:
        return None
    x = power.input[0]
    axes = _scalar(graph, mean.input[1], producer) if len(mean.input) > 1 else None
    if axes != -1 and _attrs(mean).get("axes") != [-1]:
        return None
    add = only(mean.output[0], "Add")
    sqrt = add and only(add.output[0], "Sqrt")
    div = sqrt and only(sqrt.output[0], "Div")
    if div is None or div.input[1] != sqrt.output[0] or _scalar(graph, div.input[0], producer) != 1.0:
        return None
    eps = _scalar(graph, add.input[1] if add.input[0] == mean.output[0] else add.input[0], producer)
    scale = only(div.output[0], "Mul")
    if eps is None or scale is None or x not in scale.input:
        return None
    nodes = [power, mean, add, sqrt, div, scale]
    last = scale
    cast = only(scale.output[0], "Cast")
    if cast is not None:
        nodes.append(cast)
        last = cast
    weigh = only(last.output[0], "Mul")
    if weigh is None:
        return None
    gamma = _constant(weigh.input[0] if weigh.input[1] == last.output[0] else weigh.input[1], producer)
    if gamma not in inits or len(inits[gamma].dims) != 1:
        return None
    return x, gamma, eps, weigh.output[0], nodes + [weigh]


def fuse_skip_norms(model) -> int:
    """Each exported RMS norm of a residual sum, Add(a, b) [-> Cast] -> RMS norm, becomes ONNX Runtime's
    SkipSimplifiedLayerNormalization(a, b, gamma), whose fourth output is the sum the residual path
    reads; returns how many."""
    from onnx import TensorProto, helper

    from .fuse_attention import _topological
    from .tree_mask import _prune

    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    consumers = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            consumers[i].append(n)
    inits = {t.name: t for t in graph.initializer}
    fused = 0
    for mean in [n for n in graph.node if n.op_type == "ReduceMean"]:
        found = _rms_norm(graph, mean, producer, consumers, inits)
        if found is None:
            continue
        x, gamma, eps, y, nodes = found
        total, cast = x, producer.get(x)
        if cast is not None and cast.op_type == "Cast" and _attrs(cast).get("to") == TensorProto.FLOAT:
            total = cast.input[0]
        add = producer.get(total)
        if (add is None or add.op_type != "Add" or any(i in inits for i in add.input)
                or add.input[0] == add.input[1] or (total != x and len(consumers[total]) != 1)):
            continue
        skip = helper.make_node("SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], gamma],
                                [y, "", "", x], name=f"{mean.name or y}_skip", domain="com.microsoft",
                                epsilon=float(eps))
        for n in nodes + [add] + ([cast] if total != x else []):
            graph.node.remove(n)
        graph.node.append(skip)
        fused += 1
    if fused:
        _prune(graph)
        _topological(graph)
    return fused
