"""Replace each layer's unfused attention with ONNX Runtime's GroupQueryAttention kernel.

Why: optimum's export of a grouped-query model (Qwen2: 12 query heads share 2 KV heads)
materialises `repeat_kv` on every call: the whole cache is expanded to one copy per query
head, transposed and scaled before the two attention MatMuls. At a 700-token past that is
~0.6 GB of memory traffic per call for the 1.5B target, more than an int4 target's weights
(the int4 decode went from 47 to 88 ms/token between 60- and 700-token prompts). The
`com.microsoft.GroupQueryAttention` kernel reads the cache in place, takes an additive
`attention_bias` (the tree mask) on top of its causal rule, and accepts multi-token steps
after a past (batch 1), which is all speculative verification needs.

What the rewrite finds, per layer, from the manifest's cache names and not from node names:
the Concat that makes `present.N.key|value` (its second input is the new rotated key / new
value, [batch, kv_heads, new, head_dim]); the first MatMul below `present.N.key` (Q K^T: its
other input is the rotated query, times a scale constant) and the first below
`present.N.value` (P V), whose output runs through Transpose/Reshape into the output
projection. Everything between is replaced by one GroupQueryAttention node whose outputs
take the names of `present.N.key|value` and of the projection's input; the rest is pruned.
The graph must already take the tree mask (export/tree_mask.py): it becomes the bias.
Anything that does not match is an ExportError, and the caller keeps the unfused graph.

Limits of the fused graph (recorded as `"attention": "gqa"` in the manifest): a call with
more than one new token after a past must have batch 1 (tree verification is batch 1; the
replicated k-rows path is not used for such graphs).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from spectr_edge.errors import ExportError

FUSED = "gqa"
_MASK_BIAS = "spectr_attention_bias"
_SEQLENS = "spectr_seqlens_k"
_TOTAL = "spectr_total_seq_len"


def _scalar(graph, name: str, producer: dict) -> float | None:
    """Value of a scalar constant tensor (initializer or Constant node), else None."""
    from onnx import numpy_helper

    for init in graph.initializer:
        if init.name == name:
            arr = numpy_helper.to_array(init)
            return float(arr.reshape(-1)[0]) if arr.size == 1 else None
    node = producer.get(name)
    if node is not None and node.op_type == "Constant":
        arr = numpy_helper.to_array(node.attribute[0].t)
        return float(arr.reshape(-1)[0]) if arr.size == 1 else None
    return None


def _downstream(start: str, consumers: dict, limit: int = 400) -> list:
    """Nodes below `start` in breadth-first order (bounded: attention is a few dozen nodes)."""
    order, seen, todo = [], set(), [start]
    while todo and len(order) < limit:
        t = todo.pop(0)
        for n in consumers[t]:
            if id(n) not in seen:
                seen.add(id(n))
                order.append(n)
                todo.extend(n.output)
    return order


def _first_matmul(start: str, consumers: dict):
    for n in _downstream(start, consumers):
        if n.op_type == "MatMul":
            return n
    return None


def _strip_scale(graph, tensor: str, producer: dict) -> tuple[str, float]:
    """Walk up Mul-by-scalar nodes; returns (unscaled tensor, product of the scalars)."""
    scale = 1.0
    while tensor in producer and producer[tensor].op_type in ("Mul", "Div"):
        node = producer[tensor]
        values = [_scalar(graph, i, producer) for i in node.input]
        if node.op_type == "Mul" and values[1] is not None:
            scale, tensor = scale * values[1], node.input[0]
        elif node.op_type == "Mul" and values[0] is not None:
            scale, tensor = scale * values[0], node.input[1]
        elif node.op_type == "Div" and values[1] is not None:
            scale, tensor = scale / values[1], node.input[0]
        else:
            break
    return tensor, scale


def _key_scale(graph, qk, present_k: str, producer: dict) -> float:
    """Scalar factors applied to the cached keys between present.N.key and the Q K^T MatMul."""
    scale, todo, seen = 1.0, [qk.input[1]], set()
    while todo:
        t = todo.pop()
        if t in seen or t == present_k or t not in producer:
            continue
        seen.add(t)
        node = producer[t]
        if node.op_type in ("Mul", "Div"):
            values = [_scalar(graph, i, producer) for i in node.input]
            if node.op_type == "Mul" and values[0] is not None:
                scale *= values[0]
                todo.append(node.input[1])
                continue
            if values[1] is not None:
                scale = scale * values[1] if node.op_type == "Mul" else scale / values[1]
                todo.append(node.input[0])
                continue
        if node.op_type in ("Transpose", "Reshape", "Expand", "Unsqueeze", "Mul", "Div"):
            todo.append(node.input[0])
    return scale


_PROJECTIONS = ("MatMul", "MatMulNBits", "MatMulInteger", "Gemm")


def _out_projection_input(pv, consumers: dict) -> str:
    """Follow P V's output through Transpose/Reshape to the tensor the output projection reads."""
    tensor = pv.output[0]
    for _ in range(4):
        users = consumers[tensor]
        if len(users) != 1 or users[0].op_type not in ("Transpose", "Reshape"):
            break
        tensor = users[0].output[0]
    if tensor != pv.output[0] and _projection(tensor, consumers) is not None:
        return tensor
    raise ExportError("the attention output does not reach the output projection through Transpose/Reshape; "
                      "this export cannot use the fused attention kernel")


def _projection(tensor: str, consumers: dict):
    """The output projection reading tensor, directly or through an activation quantizer."""
    for user in consumers[tensor]:
        if user.op_type in _PROJECTIONS:
            return user
        if user.op_type in ("DynamicQuantizeLinear", "QuantizeLinear", "Cast"):
            found = _projection(user.output[0], consumers)
            if found is not None:
                return found
    return None


def _num_heads(graph, tensor: str, consumers: dict, head_dim: int) -> int:
    proj = _projection(tensor, consumers)
    if proj.op_type == "MatMulNBits":
        width = next(a.i for a in proj.attribute if a.name == "K")
    else:
        weights = {i.name: i for i in graph.initializer}
        if proj.input[1] not in weights:
            raise ExportError("cannot read the attention width from the output projection")
        width = int(weights[proj.input[1]].dims[0])
    if width % head_dim:
        raise ExportError(f"attention width {width} is not a multiple of head_dim {head_dim}")
    return width // head_dim


def _topological(graph) -> None:
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        rest = []
        for n in pending:
            if all(i in known for i in n.input):
                ordered.append(n)
                known.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise ExportError("the fused graph has a cycle or a missing tensor; this export cannot be fused")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


def fuse_attention(model, past: list, present: list, head_dim: int, num_kv_heads: int,
                   tree_mask: str) -> object:
    """Rewrite an onnx ModelProto in place (see the module docstring); returns it."""
    from onnx import TensorProto, helper

    from .tree_mask import _prune

    graph = model.graph
    if not any(i.name == tree_mask for i in graph.input):
        raise ExportError(f"the graph must take the tree mask '{tree_mask}' before attention is fused")
    if any(n.op_type == "GroupQueryAttention" for n in graph.node):
        raise ExportError("the graph's attention is already fused")
    producer = {o: n for n in graph.node for o in n.output}
    consumers = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            consumers[i].append(n)

    big = float(np.finfo(np.float32).min)
    shared = [
        helper.make_node("Shape", [tree_mask], ["spectr_mask_shape"]),
        helper.make_node("Constant", [], ["spectr_idx3"], value=helper.make_tensor("v", TensorProto.INT64, [], [3])),
        helper.make_node("Gather", ["spectr_mask_shape", "spectr_idx3"], ["spectr_total64"]),
        helper.make_node("Cast", ["spectr_total64"], [_TOTAL], to=TensorProto.INT32),
        helper.make_node("Constant", [], ["spectr_one32"], value=helper.make_tensor("v", TensorProto.INT32, [], [1])),
        helper.make_node("Sub", [_TOTAL, "spectr_one32"], ["spectr_last32"]),
        helper.make_node("Constant", [], ["spectr_s0"], value=helper.make_tensor("v", TensorProto.INT64, [1], [0])),
        helper.make_node("Constant", [], ["spectr_s1"], value=helper.make_tensor("v", TensorProto.INT64, [1], [1])),
        helper.make_node("Slice", ["spectr_mask_shape", "spectr_s0", "spectr_s1"], ["spectr_batch"]),
        helper.make_node("Expand", ["spectr_last32", "spectr_batch"], [_SEQLENS]),
        helper.make_node("Constant", [], ["spectr_zero_f"], value=helper.make_tensor("v", TensorProto.FLOAT, [], [0.0])),
        helper.make_node("Constant", [], ["spectr_min_f"], value=helper.make_tensor("v", TensorProto.FLOAT, [], [big])),
        helper.make_node("Where", [tree_mask, "spectr_zero_f", "spectr_min_f"], [_MASK_BIAS]),
    ]
    new_nodes = list(shared)
    perm = [0, 2, 1, 3]
    flat = helper.make_node("Constant", [], ["spectr_flat"], value=helper.make_tensor("v", TensorProto.INT64, [3],
                                                                                      [0, 0, -1]))
    new_nodes.append(flat)
    for layer, ((past_k, past_v), (pres_k, pres_v)) in enumerate(zip(past, present)):
        kcat, vcat = producer.get(pres_k), producer.get(pres_v)
        if (kcat is None or vcat is None or kcat.op_type != "Concat" or vcat.op_type != "Concat"
                or list(kcat.input)[:1] != [past_k] or list(vcat.input)[:1] != [past_v] or len(kcat.input) != 2):
            raise ExportError(f"layer {layer}: present.key/value are not Concat(past, new); "
                              "this export cannot use the fused attention kernel")
        qk, pv = _first_matmul(pres_k, consumers), _first_matmul(pres_v, consumers)
        if qk is None or pv is None or qk is pv:
            raise ExportError(f"layer {layer}: no attention MatMuls below the cache; cannot fuse")
        query, q_scale = _strip_scale(graph, qk.input[0], producer)
        scale = q_scale * _key_scale(graph, qk, pres_k, producer)
        out = _out_projection_input(pv, consumers)
        heads = _num_heads(graph, out, consumers, head_dim)
        p = f"spectr_l{layer}_"
        for name, src in (("q", query), ("k", kcat.input[1]), ("v", vcat.input[1])):
            new_nodes.append(helper.make_node("Transpose", [src], [p + name + "_bsnh"], perm=perm))
            new_nodes.append(helper.make_node("Reshape", [p + name + "_bsnh", "spectr_flat"], [p + name + "_bsd"]))
        # the old producers lose these names; GroupQueryAttention takes them over
        producer[out].output[list(producer[out].output).index(out)] = p + "unfused_out"
        kcat.output[0], vcat.output[0] = p + "unfused_k", p + "unfused_v"
        new_nodes.append(helper.make_node(
            "GroupQueryAttention",
            [p + "q_bsd", p + "k_bsd", p + "v_bsd", past_k, past_v, _SEQLENS, _TOTAL, "", "", "", _MASK_BIAS],
            [out, pres_k, pres_v], domain="com.microsoft", name=f"spectr_gqa_{layer}",
            num_heads=heads, kv_num_heads=num_kv_heads, scale=float(scale)))
    graph.node.extend(new_nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _prune(graph)
    _topological(graph)
    if any(i.name == tree_mask for i in graph.input) is False:
        raise ExportError("fusing removed the tree mask input; cannot fuse")
    return model
