"""Let a call return the logits of its last few positions only (prefill computes one row, not P).

An exported decoder applies its LM head to every new position: a prompt of P tokens costs P rows
of a [hidden x vocab] matmul (151,936 columns for Qwen2.5: 15% of the 1.5B target's weights, 27%
of the 0.5B draft's) and a [P, vocab] float output, although the prefill needs the last row
only. `add_logits_keep` adds a graph input `logits_keep` (int64 [1]): the call slices the hidden
states to their last `logits_keep` positions before the LM head. Decode and verification calls
feed the number of new tokens (every row, as before); the prefill feeds what it needs.

The input is required (ONNX Runtime's I/O binding cannot feed an input that has a default), and
the runtime feeds it whenever the graph has it, so an in-place upgrade that is interrupted after
the graph and before the manifest still leaves a loadable bundle. Only the graph proto changes
(weights stay in external data). The LM head sees the same rows
as before for the positions it computes, so their logits are the same numbers: a row's
result does not depend on the other rows, except in kernels whose lone-row path rounds
differently (int4/int8 MatMulNBits), which is why the runtime keeps at least
`min_call_tokens` rows (onnx_model.OnnxLM.forward).
"""

from __future__ import annotations

from pathlib import Path

from spectr_edge.errors import ExportError

LOGITS_KEEP_INPUT = "logits_keep"
ALL = 2 ** 62                   # more positions than any call has
_PASS_THROUGH = {"Cast", "Identity"}
_HEAD_OPS = {"MatMul", "MatMulNBits", "Gemm"}
GUESS_HEAD_PREFIX = "/guess_head/"      # export/guess_head.PREFIX


def add_logits_keep(model, logits: str = "logits"):
    """Insert the slice before the LM head of `model` (in place); returns the model.

    The LM head is the MatMul (MatMulNBits, Gemm; or a w8a8 head's quantize-MatMulInteger-rescale
    chain) that produces the `logits` output, possibly through Casts. A graph that already has the input is returned unchanged."""
    from onnx import TensorProto, helper

    graph = model.graph
    if any(i.name == LOGITS_KEEP_INPUT for i in graph.input):
        return model
    readers = head_readers(graph, logits)
    if not readers:
        raise ExportError(f"the graph's '{logits}' output does not come from a MatMul (LM head); "
                          "cannot add the logits_keep input")
    hidden = readers[0].input[0]
    start, sliced = "/logits_keep/start", "/logits_keep/hidden"
    ends, axes = "/logits_keep/ends", "/logits_keep/axes"
    new_nodes = [
        helper.make_node("Constant", [], [ends], name="/logits_keep/EndsConst",
                         value=helper.make_tensor(ends, TensorProto.INT64, [1], [ALL])),
        helper.make_node("Constant", [], [axes], name="/logits_keep/AxesConst",
                         value=helper.make_tensor(axes, TensorProto.INT64, [1], [1])),
        helper.make_node("Neg", [LOGITS_KEEP_INPUT], [start], name="/logits_keep/Neg"),
        helper.make_node("Slice", [hidden, start, ends, axes], [sliced], name="/logits_keep/Slice"),
    ]
    at = min(i for i, n in enumerate(graph.node) if any(n is r for r in readers))
    for j, n in enumerate(new_nodes):
        graph.node.insert(at + j, n)
    # the guess head (export/guess_head.py) reads the LM head's input too and must see the same rows
    followers = [n for n in graph.node if n.name.startswith(GUESS_HEAD_PREFIX) and hidden in n.input]
    for r in readers + followers:
        for i, name in enumerate(r.input):
            if name == hidden:
                r.input[i] = sliced
    graph.input.append(helper.make_tensor_value_info(LOGITS_KEEP_INPUT, TensorProto.INT64, [1]))
    # the logits output's sequence axis is now the kept count, not the input length
    for out in graph.output:
        if out.name == logits and out.type.tensor_type.shape.dim:
            dims = out.type.tensor_type.shape.dim
            if len(dims) == 3:
                dims[1].Clear()
                dims[1].dim_param = "kept_positions"
    return model


def head_readers(graph, logits: str = "logits") -> list:
    """The nodes that read the LM head's hidden-state input: the MatMul (MatMulNBits, Gemm) that
    produces `logits` (possibly through Casts), or a w8a8 head's first nodes; [] when not found."""
    producer = {o: n for n in graph.node for o in n.output}
    node = producer.get(logits)
    while node is not None and node.op_type in _PASS_THROUGH:
        node = producer.get(node.input[0])
    if node is not None and node.op_type in _HEAD_OPS:
        return [node]
    return _w8a8_head_readers(graph, node, producer)


def _w8a8_head_readers(graph, node, producer) -> list:
    """For a w8a8 LM head (export/quantize.int8_rowwise: the hidden state is quantized per row, then
    MatMulInteger, then rescaled), the nodes that read the hidden state (its quantization's Abs
    and Div, or its smoothing Mul); [] when `node` is not such a head or its quantized rows feed other matmuls too."""
    if node is None or node.op_type != "Mul" or not node.name.startswith("/int8row/"):
        return []
    chain = node
    for op in ("Mul", "Cast", "MatMulInteger"):
        chain = producer.get(chain.input[0])
        if chain is None or chain.op_type != op:
            return []
    q = chain.input[0]                                   # "/int8row/x<j>/q"
    prefix = q.rsplit("/", 1)[0] + "/"
    if sum(q in n.input for n in graph.node) != 1:
        return []
    first = {n.name: n for n in graph.node if n.name in (prefix + "Smooth", prefix + "Abs")}
    first = first.get(prefix + "Smooth") or first.get(prefix + "Abs")      # smoothed (SmoothQuant) or not
    if first is None:
        return []
    hidden = first.input[0]
    return [n for n in graph.node if n.name.startswith(prefix) and hidden in n.input]


def remove_logits_keep(model):
    """The inverse of add_logits_keep (in place): every position's logits again. For side-by-side
    benchmarks of the two graphs on the same weights (bench/full_logits_twin.py)."""
    graph = model.graph
    sliced = "/logits_keep/hidden"
    slicer = next((n for n in graph.node if n.name == "/logits_keep/Slice"), None)
    if slicer is None:
        return model
    for n in graph.node:
        for i, name in enumerate(n.input):
            if name == sliced:
                n.input[i] = slicer.input[0]
    for n in [n for n in graph.node if n.name.startswith("/logits_keep/")]:
        graph.node.remove(n)
    for i in [i for i in graph.input if i.name == LOGITS_KEEP_INPUT]:
        graph.input.remove(i)
    return model


def rewrite_graph(src: Path, dst: Path, logits: str = "logits", remove: bool = False) -> None:
    """Write src with the logits_keep input (remove: without it) to dst (beside src: same external
    data), atomically."""
    import onnx

    from .writer import save_graph_beside

    model = onnx.load(str(src), load_external_data=False)
    model = remove_logits_keep(model) if remove else add_logits_keep(model, logits)
    save_graph_beside(model, src, dst, "rewritten")


def add_logits_keep_to_bundle(bundle: Path, log=print) -> list[str]:
    """Give every graph of an existing bundle the logits_keep input, in place; returns the roles changed.

    Each graph proto is replaced atomically (the runtime feeds the input whenever the graph has
    it), then the manifest records the input."""
    from spectr_edge.bundle import write_manifest

    from .writer import existing_manifest

    bundle = Path(bundle)
    manifest = existing_manifest(bundle)
    changed = []
    for role, entry in manifest["models"].items():
        if entry["inputs"].get("logits_keep"):
            continue
        new = upgrade_entry(bundle, role, entry, log)
        if new is entry:
            continue
        manifest["models"][role] = new
        write_manifest(bundle, manifest)
        log(f"{role}: calls return the logits of the positions they need only (prefill: the last)")
        changed.append(role)
    return changed


def upgrade_entry(bundle: Path, role: str, entry: dict, log) -> dict:
    """Rewrite a bundle model's graph in place to take the input; its new manifest entry, or
    `entry` itself (logged) when the graph's LM head is not a MatMul and keeps every row."""
    from .onnx_export import model_files

    src = bundle / entry["file"]
    try:
        rewrite_graph(src, src, entry["outputs"]["logits"])
    except ExportError as err:
        log(f"{role}: every position's logits are computed: {err}")
        return entry
    return {**entry, "inputs": {**entry["inputs"], "logits_keep": LOGITS_KEEP_INPUT},
            "size_bytes": sum(f.stat().st_size for f in model_files(src))}
