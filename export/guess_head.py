"""A guess head: the target graph also guesses the token after the one its logits choose.

Prompt lookup's drafts are free on targets whose calls score at least two tokens anyway (int4,
int8, w8a8: `min_call_tokens` 2): when the text has nothing to copy, the second slot holds a guess
from a static next-token table (ngram_table.py), right about one time in eight. The target's own
last hidden state knows far more about what comes after its next token (Medusa, Cai et al. 2024,
head 1), the more so when the head also sees which token that next one is (EAGLE, Li et al. 2024).
This module trains such a head for a bundle's target and writes it into the target graph:

    h = the LM head's input (one row per kept position)            # [batch, rows, D]
    x = argmax of the row's logits over the tokenizer's ids         # the token the row chooses greedily
    g = h + SiLU(h A + Emb[x] B + a)                               # one residual block, A, B: [D, D]
    guess_ids = ids[argmax(g E + c)]                               # E: [D, V], the V commonest labels

Emb is the graph's own token embedding table. `guess_ids` # [batch, rows] int64 is a new graph
output: for each row, the guessed token after the token that row's logits choose. The head is
trained on the target's own outputs: conversation sampled from the bundle's draft model
(self_text.py) runs through the target graph, and the label for position t is the target's
greedy choice at position t + 1 (what it would say after its own next token). A, B and E
(initialised from the embedding rows) are fitted by cross-entropy with torch (export extra); the
head's matmuls are 8-bit MatMulNBits with int8 activations, 0.14 ms per call for the 1.5B target.

The head changes no logits: a guess is only ever a draft that the target verifies, so the output
law and greedy equality are untouched whatever it guesses (engine.py uses it as prompt lookup's
one-token draft when the text has no better match; at temperature > 0 the row's sampled token
may differ from x, and the guess is then simply more often rejected).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from spectr_edge.errors import ExportError

from .logits_keep import GUESS_HEAD_PREFIX

GUESS_OUTPUT = "guess_ids"
HEAD_VOCAB = 4096                 # output classes: the commonest labels in the training text
HEAD_TOKENS = 32768               # tokens of sampled conversation to train on (int4 1.5B target, held-out
                                  # agreement: 16,384 -> 0.37, 32,768 -> 0.43; scoring them takes ~7 min)
HEAD_BITS = 8                     # MatMulNBits bits of the head's matmuls
HEAD_ACCURACY_LEVEL = 4           # int8 activations: 0.14 ms for the 1.5B target's head, against 16 ms at
                                  # level 0/1 (ONNX Runtime's 8-bit float path) and 1.2 ms in float32
HEAD_EPOCHS = 6
PREFIX = GUESS_HEAD_PREFIX


def lm_head_input(graph, logits: str) -> str:
    """Name of the hidden state the LM head reads (after logits_keep's slice where present)."""
    from .logits_keep import head_readers
    readers = head_readers(graph, logits)
    if not readers:
        raise ExportError(f"the graph's '{logits}' output does not come from a MatMul (LM head); "
                          "cannot attach a guess head")
    return readers[0].input[0]


def _embedding_name(model, input_ids: str) -> str:
    """The initializer of the token embedding table (the Gather that reads input_ids)."""
    gather = next((n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == input_ids), None)
    if gather is None or not any(t.name == gather.input[0] for t in model.graph.initializer):
        raise ExportError("the target graph has no token embedding table (a Gather of an initializer by the "
                          "input ids); cannot attach a guess head")
    return gather.input[0]


def _embedding(model, input_ids: str, path: Path) -> np.ndarray:
    """The token embedding table # [vocab, D], read from the graph or its external data without
    loading the other weights."""
    from onnx import numpy_helper
    name = _embedding_name(model, input_ids)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    if tensor is None:
        raise ExportError("the target's token embedding is not an initializer; cannot train a guess head")
    if not tensor.external_data:
        return numpy_helper.to_array(tensor).astype(np.float32)
    from .writer import external_bytes
    raw = external_bytes(tensor, path.parent)
    if tensor.data_type != 1:
        raise ExportError("the target's token embedding is not float32; cannot train a guess head")
    return np.frombuffer(raw, np.float32).reshape(list(tensor.dims))


def collect(spec, rows: list[list[int]], vocab_size: int, log=print,
            threads: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hidden # [N, D], labels # [N], chosen # [N]): the target's LM-head input at each position of
    each row but the last, its greedy choice one position later, and its greedy choice at the
    position itself (among the first vocab_size ids). One call per row, empty past."""
    import onnx
    import onnxruntime as ort

    from .writer import save_graph_beside

    model = onnx.load(str(spec.file), load_external_data=False)
    hidden = lm_head_input(model.graph, spec.logits)
    model.graph.output.append(onnx.helper.make_tensor_value_info(hidden, onnx.TensorProto.FLOAT, None))
    probe = spec.file.with_name(spec.file.stem + ".hidden.onnx")
    save_graph_beside(model, spec.file, probe, "probe")
    sess = None
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        sess = ort.InferenceSession(str(probe), opts, providers=["CPUExecutionProvider"])
        hs, ys, chosen, started = [], [], [], time.perf_counter()
        for r, row in enumerate(rows):
            ids = np.asarray(row, dtype=np.int64)
            n = len(ids)
            if n < 3:
                continue
            feed = {spec.input_ids: ids[None]}
            if spec.position_ids:
                feed[spec.position_ids] = np.arange(n, dtype=np.int64)[None]
            if spec.attention_mask:
                feed[spec.attention_mask] = np.ones((1, n), np.int64)
            if spec.tree_mask:
                feed[spec.tree_mask] = np.tri(n, dtype=bool)[None, None]
            if spec.logits_keep:
                feed[spec.logits_keep] = np.asarray([n], np.int64)
            empty = np.zeros((1, spec.num_kv_heads, 0, spec.head_dim), np.float32)
            for k, v in spec.past:
                feed[k], feed[v] = empty, empty
            logits, h = sess.run([spec.logits, hidden], feed)
            greedy = logits[0, :, :vocab_size].argmax(-1)       # [n]: the target's choice after each position
            hs.append(np.asarray(h[0][:-1], dtype=np.float32))
            ys.append(greedy[1:].astype(np.int64))
            chosen.append(greedy[:-1].astype(np.int64))
            if (r + 1) % 16 == 0:
                log(f"      scored {sum(map(len, ys))} positions ({time.perf_counter() - started:.0f} s)")
    finally:
        del sess                                            # before its graph file goes
        probe.unlink(missing_ok=True)
    return np.concatenate(hs), np.concatenate(ys), np.concatenate(chosen)


def train(hidden: np.ndarray, labels: np.ndarray, embedding: np.ndarray, chosen: np.ndarray | None = None,
          vocab: int = HEAD_VOCAB, epochs: int = HEAD_EPOCHS, seed: int = 0, holdout: float = 0.1,
          log=print) -> dict:
    """Fit the head on (hidden # [N, D], labels # [N]); embedding # [vocab_size, D] initialises E and,
    with chosen # [N] (the token each position's row chooses), feeds the block that token's embedding
    through B (EAGLE's idea: the guess knows which token it follows).

    The last `holdout` of the positions are held out: the returned "agreement" is the share of them
    whose guess equals the label (what a greedy generation's guess acceptance would be on such text).
    Returns the numpy parameters A, B (with chosen) # [D, D], a # [D], E # [D, V], c # [V], ids # [V]
    and stats."""
    import torch

    torch.manual_seed(seed)
    n = len(labels)
    cut = n - max(1, int(n * holdout))
    counts = np.bincount(labels[:cut], minlength=len(embedding))
    ids = np.argsort(-counts, kind="stable")[:vocab]
    ids = ids[counts[ids] > 0]
    column = np.full(len(embedding), -1, dtype=np.int64)
    column[ids] = np.arange(len(ids))
    h = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))
    y = torch.from_numpy(column[labels])
    d = h.shape[1]
    # the embedding of each position's chosen token # [N, D] (a copy: the table may be read-only)
    chosen_emb = None if chosen is None else torch.from_numpy(np.asarray(embedding[chosen], dtype=np.float32))
    A = torch.nn.Parameter(torch.zeros(d, d))
    B = torch.nn.Parameter(torch.zeros(d, d))
    a = torch.nn.Parameter(torch.zeros(d))
    E = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(embedding[ids].T, dtype=np.float32)))
    c = torch.nn.Parameter(torch.zeros(len(ids)))
    params = [A, a, E, c] + ([B] if chosen_emb is not None else [])
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)

    def scores(rows):
        x = h[rows]
        pre = x @ A + a
        if chosen_emb is not None:
            pre = pre + chosen_emb[rows] @ B
        return (x + torch.nn.functional.silu(pre)) @ E + c

    train_rows = torch.from_numpy(np.flatnonzero(column[labels[:cut]] >= 0))
    held = torch.arange(cut, n)
    gen = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    agreement = 0.0
    for epoch in range(epochs):
        order = train_rows[torch.randperm(len(train_rows), generator=gen)]
        for i in range(0, len(order), 256):
            batch = order[i:i + 256]
            loss = torch.nn.functional.cross_entropy(scores(batch), y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            guess = ids[scores(held).argmax(-1).numpy()]
        agreement = float(np.mean(guess == labels[cut:]))
        log(f"      epoch {epoch + 1}/{epochs}: held-out agreement {agreement:.3f} "
            f"({time.perf_counter() - started:.0f} s)")
    with torch.no_grad():
        out = {"A": A.numpy().copy(), "a": a.numpy().copy(), "E": E.numpy().copy(), "c": c.numpy().copy(),
               "ids": ids.astype(np.int64), "agreement": agreement, "train_positions": int(cut),
               "heldout_positions": int(n - cut)}
        if chosen_emb is not None:
            out["B"] = B.numpy().copy()
        return out


def head_model(params: dict, bits: int = HEAD_BITS, accuracy_level: int | None = HEAD_ACCURACY_LEVEL):
    """A standalone graph: inputs "hidden" # [batch, rows, D] (and, when params has B, "logits" #
    [batch, rows, W] and "embedding" # [vocab_size, D], whose row for each row's greedy token among
    the first vocab_size ids feeds B) -> output guess_ids # [batch, rows]; names prefixed with
    PREFIX. Its matmuls are `bits`-bit MatMulNBits (0: float)."""
    from onnx import TensorProto, helper, numpy_helper

    p = PREFIX
    d = params["A"].shape[0]
    eagle = "B" in params
    inits = [numpy_helper.from_array(params["A"].astype(np.float32), p + "A"),
             numpy_helper.from_array(params["a"].astype(np.float32), p + "a"),
             numpy_helper.from_array(params["E"].astype(np.float32), p + "E"),
             numpy_helper.from_array(params["c"].astype(np.float32), p + "c"),
             numpy_helper.from_array(params["ids"].astype(np.int64), p + "ids")]
    nodes = [helper.make_node("MatMul", ["hidden", p + "A"], [p + "hA"], name=p + "MatMulA"),
             helper.make_node("Add", [p + "hA", p + "a"], [p + "pre"], name=p + "AddA")]
    inputs = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "rows", d])]
    pre = p + "pre"
    if eagle:
        vocab_size = int(params["vocab_size"])
        inits += [numpy_helper.from_array(params["B"].astype(np.float32), p + "B"),
                  numpy_helper.from_array(np.asarray([0], np.int64), p + "zero"),
                  numpy_helper.from_array(np.asarray([vocab_size], np.int64), p + "vocab_size"),
                  numpy_helper.from_array(np.asarray([2], np.int64), p + "last_axis")]
        nodes += [
            helper.make_node("Slice", ["logits", p + "zero", p + "vocab_size", p + "last_axis"], [p + "real"],
                             name=p + "SliceVocab"),
            helper.make_node("ArgMax", [p + "real"], [p + "chosen"], name=p + "Chosen", axis=-1, keepdims=0),
            helper.make_node("Gather", ["embedding", p + "chosen"], [p + "e"], name=p + "Embed", axis=0),
            helper.make_node("MatMul", [p + "e", p + "B"], [p + "eB"], name=p + "MatMulB"),
            helper.make_node("Add", [p + "pre", p + "eB"], [p + "pre2"], name=p + "AddB"),
        ]
        pre = p + "pre2"
        inputs += [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "rows", "width"]),
                   helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["vocab", d])]
    nodes += [
        helper.make_node("Sigmoid", [pre], [p + "sig"], name=p + "Sigmoid"),
        helper.make_node("Mul", [pre, p + "sig"], [p + "silu"], name=p + "SiLU"),
        helper.make_node("Add", ["hidden", p + "silu"], [p + "g"], name=p + "Residual"),
        helper.make_node("MatMul", [p + "g", p + "E"], [p + "gE"], name=p + "MatMulE"),
        helper.make_node("Add", [p + "gE", p + "c"], [p + "scores"], name=p + "AddC"),
        helper.make_node("ArgMax", [p + "scores"], [p + "column"], name=p + "ArgMax", axis=-1, keepdims=0),
        helper.make_node("Gather", [p + "ids", p + "column"], [GUESS_OUTPUT], name=p + "Gather", axis=0),
    ]
    graph = helper.make_graph(nodes, "guess_head", inputs,
                              [helper.make_tensor_value_info(GUESS_OUTPUT, TensorProto.INT64, ["batch", "rows"])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8                # readable by any onnxruntime the runtime supports
    if not bits:
        return model
    from .quantize import _import_nbits, _quiet_root_logger
    block = 128 if d % 128 == 0 else 32
    q = _import_nbits()(model, bits=bits, block_size=block, is_symmetric=True, accuracy_level=accuracy_level)
    with _quiet_root_logger():
        q.process()
    return q.model.model


def attach(model, head, logits: str, input_ids: str) -> None:
    """Append the head graph's nodes and weights to `model` (in place), reading its LM head's input
    (and its logits output and token embedding table), and add the guess_ids output. A graph that
    already has the output is left unchanged."""
    from onnx import helper

    graph = model.graph
    if any(o.name == GUESS_OUTPUT for o in graph.output):
        return
    names = {"hidden": lm_head_input(graph, logits), "logits": logits,
             "embedding": _embedding_name(model, input_ids)}
    for node in head.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = names.get(name, name)
        graph.node.append(node)
    graph.initializer.extend(head.graph.initializer)
    graph.output.extend(head.graph.output)
    have = {o.domain for o in model.opset_import}
    for o in head.opset_import:
        if o.domain not in have:
            model.opset_import.append(helper.make_opsetid(o.domain, o.version))


def remove(model) -> None:
    """Take the head out again (in place)."""
    graph = model.graph
    for n in [n for n in graph.node if n.name.startswith(PREFIX) or GUESS_OUTPUT in n.output]:
        graph.node.remove(n)
    for t in [t for t in graph.initializer if t.name.startswith(PREFIX)]:
        graph.initializer.remove(t)
    for o in [o for o in graph.output if o.name == GUESS_OUTPUT]:
        graph.output.remove(o)


def write_head(spec, rows: list[list[int]], vocab_size: int, log=print, threads: int | None = None, seed: int = 0,
               vocab: int = HEAD_VOCAB, epochs: int = HEAD_EPOCHS, bits: int = HEAD_BITS,
               follow_chosen: bool = True) -> dict:
    """Train a guess head for the target `spec` (a bundle ModelSpec) on the token rows, write it into
    the target graph in place (any earlier head replaced), and return the manifest entry.
    vocab_size: the tokenizer's ids (logits columns beyond are padding); follow_chosen: the head also
    reads the embedding of the token its row chooses (train's chosen)."""
    import onnx

    from .writer import save_graph_beside

    model = onnx.load(str(spec.file), load_external_data=False)
    remove(model)
    if any(o.name == GUESS_OUTPUT for o in model.graph.output):
        raise ExportError("the target graph's guess head could not be removed; re-export the bundle")
    started = time.perf_counter()
    hidden, labels, chosen = collect(spec, rows, vocab_size, log, threads)
    log(f"      {len(labels)} positions scored by the target ({time.perf_counter() - started:.0f} s)")
    embedding = _embedding(model, spec.input_ids, spec.file)
    params = train(hidden, labels, embedding, chosen if follow_chosen else None, vocab, epochs, seed, log=log)
    params["vocab_size"] = vocab_size
    del hidden, embedding
    attach(model, head_model(params, bits), spec.logits, spec.input_ids)
    save_graph_beside(model, spec.file, spec.file, "guess-head")
    return {"output": GUESS_OUTPUT, "vocab": int(len(params["ids"])), "bits": bits,
            "train_positions": params["train_positions"], "heldout_positions": params["heldout_positions"],
            "heldout_agreement": round(params["agreement"], 4), "epochs": epochs,
            "reads_chosen_token": bool(follow_chosen)}


def record(manifest: dict, entry: dict, target_file: Path) -> None:
    """Declare the head written into `target_file` in the bundle's manifest (in place)."""
    from .onnx_export import model_files

    target = manifest["models"]["target"]
    target["outputs"]["guess"] = GUESS_OUTPUT
    target["size_bytes"] = sum(f.stat().st_size for f in model_files(target_file))
    manifest["guess_head"] = entry


def add_guess_head_to_bundle(bundle, log=print, tokens: int = HEAD_TOKENS, threads: int | None = None) -> dict:
    """Train and attach the target's guess head of an existing bundle, from `tokens` tokens of
    conversation sampled from its draft model (else its target); records it in the manifest."""
    from spectr_edge.bundle import bundle_from_manifest, write_manifest
    from spectr_edge.onnx_model import OnnxLM
    from spectr_edge.self_text import sample_conversations
    from spectr_edge.text import TextCodec

    import importlib.util

    from .writer import existing_manifest

    if importlib.util.find_spec("torch") is None:     # before minutes of sampling, not after
        raise ExportError("training a guess head needs the export extra (torch is missing): "
                          "pip install torch==2.13.0 && pip install -e '.[export]'")
    bundle = Path(bundle)
    manifest = existing_manifest(bundle)
    b = bundle_from_manifest(bundle, manifest)
    sampler = b.draft or b.target
    log(f"      sampling {tokens} tokens of conversation from the {sampler.role} model")
    rows = sample_conversations(OnnxLM(sampler, provider="cpu", threads=threads), TextCodec(b.tokenizer),
                                b.tokenizer.vocab_size, b.tokenizer.eos_token_ids, tokens, seed=1, log=log)
    if not rows:
        raise ExportError("the tokenizer has no chat template, so there is no conversation to train a guess head on")
    entry = write_head(b.target, rows, b.tokenizer.vocab_size, log, threads)
    entry["source"] = f"{sum(map(len, rows))} tokens of conversation sampled from the {sampler.role} model"
    record(manifest, entry, b.target.file)
    write_manifest(bundle, manifest)
    log(f"{bundle}: the target guesses the token after its next one (agreement with its own greedy choice "
        f"on held-out text: {entry['heldout_agreement']:.3f})")
    return entry
