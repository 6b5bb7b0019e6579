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

Training fits a time budget (HEAD_MINUTES, `--guess-head-minutes`): conversation is sampled and
scored by the target in rounds while 1 - TRAIN_SHARE of it lasts (gather; each round cut to what
the time left pays for at the rate measured so far, at most HEAD_TOKENS in all), and the epochs
stop where the budget ends, so a faster machine trains on more text in the same time.

With a chain (CHAIN_DEPTH > 0) the head also returns its state g (`guess_state` # [batch, rows, D]),
and a small graph beside the target graph (CHAIN_FILE, chain_model) continues from it one guess at
a time, a recurrent draft head in the manner of ReDrafter (Cheng et al. 2024):

    g' = g + SiLU(g A2 + Emb[x'] B2 + a2)                          # x': the token just guessed
    next guess = ids[argmax(g' E + c)]                             # the head's own output layer

A2, B2 and a2 are trained with the head, unrolled CHAIN_DEPTH positions on the target's own greedy
tokens (on the accepted path the guessed tokens are those tokens); the held-out agreement at each
chain position, given the earlier ones, goes into the manifest as the runtime's prior.

The head changes no logits: a guess is only ever a draft that the target verifies, so the output
law and greedy equality are untouched whatever it guesses (engine.py uses it as prompt lookup's
one-token draft when the text has no better match; at temperature > 0 the row's sampled token
may differ from x, and the guess is then simply more often rejected).
"""

from __future__ import annotations

import itertools
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from spectr_edge.errors import ExportError

from .logits_keep import GUESS_HEAD_PREFIX

GUESS_OUTPUT = "guess_ids"
STATE_OUTPUT = "guess_state"      # the head's state g per row, where the chain graph starts
CHAIN_FILE = "guess_chain.onnx"   # the chain graph, beside the target graph
CHAIN_DEPTH = 3                   # chain positions trained after the first guess
HEAD_VOCAB = 4096                 # output classes: the commonest labels in the training text
HEAD_TOKENS = 32768               # at most this many tokens of conversation to train on (int4 1.5B target on
                                  # 2 Zen 3 cores, held-out agreement: 17,072 in 15 min -> 0.351; 34,304 -> 0.393)
HEAD_MINUTES = 15.0               # time budget of training a head at export: getting and scoring text, training
TRAIN_SHARE = 0.2                 # of it kept for training (the 1.5B int4 target on 2 Zen 3 cores: 6 epochs took
                                  # 0.19 of the time)
ROUND_TOKENS = 4096               # conversation got and scored per round
ROUND_ROWS = 8                    # rows sampled at once in a round (of 512 tokens each): 13.7 ms per token for the
                                  # 0.5B float32 draft on 2 Zen 3 cores, against 12.4 with 32 rows
MIN_ROUND_TOKENS = 256            # a shorter last round is not started
HEAD_BITS = 8                     # MatMulNBits bits of the head's matmuls
HEAD_ACCURACY_LEVEL = 4           # int8 activations: 0.14 ms for the 1.5B target's head, against 16 ms at
                                  # level 0/1 (ONNX Runtime's 8-bit float path) and 1.2 ms in float32
HEAD_EPOCHS = 6
LR = 1e-3                         # AdamW's, falling to 0 along a cosine (held-out agreement on 13,024 positions
                                  # of the 1.5B int4 target: 0.325 against 0.293 at a constant 1e-3)
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


@contextmanager
def _scorer(spec, vocab_size: int, threads: int | None = None):
    """score(row) -> (hidden # [n, D], greedy # [n]): the target's LM-head input at each position of a
    token row and its greedy choice there (among the first vocab_size ids), i.e. the token it would
    say next. One call per row, empty past; the probe graph (the target graph with its hidden state
    as an extra output) exists only inside the block."""
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

        def score(row: list[int]) -> tuple[np.ndarray, np.ndarray]:
            ids = np.asarray(row, dtype=np.int64)
            n = len(ids)
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
            return np.asarray(h[0], dtype=np.float32), logits[0, :, :vocab_size].argmax(-1).astype(np.int64)

        yield score
    finally:
        del sess                                            # before its graph file goes
        probe.unlink(missing_ok=True)


def first_rows(rows, tokens: int) -> list[list[int]]:
    """The leading rows of `rows` (a list, or an iterator that is advanced) holding at least `tokens`
    tokens, whole rows (the last may overshoot); all of them if they hold fewer."""
    take, total = [], 0
    if tokens <= 0:
        return take
    for row in rows:
        take.append(row)
        total += len(row)
        if total >= tokens:
            break
    return take


def rows_from(rows: list[list[int]]):
    """next_rows for gather from token rows already at hand: each call takes the next first_rows for
    the tokens asked for; [] once they are used up."""
    it = iter(rows)
    return lambda tokens, _round: first_rows(it, tokens)


def gather(spec, next_rows, vocab_size: int, seconds: float, max_tokens: int = HEAD_TOKENS, log=print,
           threads: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row of at least 3 tokens: (hidden # [n, D], greedy # [n]) (_scorer's), for rows from
    next_rows(tokens, round) (sampled on demand, or rows_from's), in rounds of ROUND_TOKENS until
    max_tokens are scored or `seconds` are spent. Each round after the first is cut to what the time
    left pays for at the rate measured so far (getting and scoring rows), so the time is kept without
    rows got and left unscored; the first round always runs."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    started, scored, cost = time.perf_counter(), 0, None
    with _scorer(spec, vocab_size, threads) as score:
        for r in itertools.count():
            left = seconds - (time.perf_counter() - started)
            want = min(ROUND_TOKENS, max_tokens - scored)
            if cost is not None:
                want = min(want, int(left / cost))
            if want < MIN_ROUND_TOKENS and (out or want <= 0):
                break
            rows = next_rows(want, r)
            if not rows:
                break
            for row in rows:
                if len(row) >= 3:
                    out.append(score(row))
                    scored += len(row)
            spent = time.perf_counter() - started
            cost = spent / max(scored, 1)
            ahead = min(max_tokens - scored, max(0.0, seconds - spent) / cost)
            log(f"      {scored} positions of conversation scored by the target ({spent:.0f} s, "
                + (f"about {ahead * cost:.0f} s left)" if ahead >= MIN_ROUND_TOKENS else "done)"))
    return out


def chain_examples(scored: list[tuple[np.ndarray, np.ndarray]], depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hidden # [N, D], tokens # [N, depth + 1], labels # [N, depth + 1]) from gather's rows: for
    position t of a row, its hidden state; tokens[:, j] = the target's greedy token at t + 1 + j
    (the token the head reads at chain position j: the first is the one the row chooses, then each
    earlier label); labels[:, j] = the greedy token at t + 2 + j, -1 past the row's end. Positions
    whose first label is past the end are left out."""
    hs, xs, ys = [], [], []
    for h, greedy in scored:
        n = len(greedy)
        if n < 2:
            continue
        padded = np.concatenate([greedy, np.full(depth + 1, -1, dtype=np.int64)])
        t = np.arange(n - 1)
        hs.append(h[:n - 1])
        xs.append(padded[t[:, None] + np.arange(depth + 1)])
        ys.append(padded[t[:, None] + 1 + np.arange(depth + 1)])
    return np.concatenate(hs), np.concatenate(xs), np.concatenate(ys)


def train(hidden: np.ndarray, labels: np.ndarray, embedding: np.ndarray, chosen: np.ndarray | None = None,
          vocab: int = HEAD_VOCAB, epochs: int = HEAD_EPOCHS, seed: int = 0, holdout: float = 0.1,
          log=print, chain: np.ndarray | None = None, deadline: float | None = None) -> dict:
    """Fit the head on (hidden # [N, D], labels # [N]); embedding # [vocab_size, D] initialises E and,
    with chosen # [N] (the token each position's row chooses), feeds the block that token's embedding
    through B (EAGLE's idea: the guess knows which token it follows).

    chain # [N, J] (optional): the target's greedy tokens after each label (-1 past a row's end): the
    chain block (A2, B2, a2) is trained too, unrolled J times from the head's state g with the
    target's own tokens fed back (chain_examples' layout: chain[:, j] follows the label or chain[:, j-1]).
    Every chain position's cross-entropy counts alike, and gradients flow through the unrolled states
    into A2, B2 and a2 only (training the shared block and output layer on them too cost the first
    guess 0.03 of held-out agreement on the 1.5B int4 target: 0.393 -> 0.360).

    deadline (time.perf_counter()): after the first epoch, only the epochs that end before it at that
    epoch's pace are run (the learning rate's cosine spans them); "epochs" says how many ran.

    The last `holdout` of the positions are held out: "agreement" is the share of them whose guess
    equals the label (what a greedy generation's guess acceptance would be on such text), and
    "chain_agreement"[j] the share of chain position j's guesses that equal the target's token, among
    the held-out positions whose earlier guesses were all right (the acceptance of a drafted chain's
    position j + 2 given the positions before it, under greedy verification).
    Returns the numpy parameters A, B (with chosen) # [D, D], a # [D], E # [D, V], c # [V], ids # [V]
    (and A2, B2 # [D, D], a2 # [D] with chain) and stats."""
    import torch

    torch.manual_seed(seed)
    n = len(labels)
    cut = n - max(1, int(n * holdout))
    counts = np.bincount(labels[:cut], minlength=len(embedding))
    ids = np.argsort(-counts, kind="stable")[:vocab]
    ids = ids[counts[ids] > 0]
    column = np.full(len(embedding) + 1, -1, dtype=np.int64)      # the last entry: -1 (past a row's end)
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
    depth = 0 if chain is None else chain.shape[1]
    if depth:
        A2, B2, a2 = (torch.nn.Parameter(torch.zeros(d, d)), torch.nn.Parameter(torch.zeros(d, d)),
                      torch.nn.Parameter(torch.zeros(d)))
        params += [A2, B2, a2]
        head_emb = torch.from_numpy(np.ascontiguousarray(embedding[ids], dtype=np.float32))   # [V, D]
        # chain position j reads the previous label's column (the head's own vocabulary) and predicts chain[:, j]
        fed = torch.from_numpy(column[np.concatenate([labels[:, None], chain[:, :-1]], axis=1)])   # [N, J]
        want = torch.from_numpy(column[chain])                                                      # [N, J]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)

    def states(rows):
        x = h[rows]
        pre = x @ A + a
        if chosen_emb is not None:
            pre = pre + chosen_emb[rows] @ B
        return x + torch.nn.functional.silu(pre)

    def chain_scores(g, rows):
        """Scores # [J, rows, V] of the unrolled chain from states g. The head's own block and output
        layer are read, not trained, here: the chain's loss moves A2, B2 and a2 only, so the first
        guess is trained exactly as without a chain."""
        out, g, e_out, c_out = [], g.detach(), E.detach(), c.detach()
        for j in range(depth):      # the fed tokens' rows times B2 (not the whole table: 16x less work)
            g = g + torch.nn.functional.silu(g @ A2 + head_emb[fed[rows, j].clamp(min=0)] @ B2 + a2)
            out.append(g @ e_out + c_out)
        return out

    def loss_of(batch):
        g = states(batch)
        loss = torch.nn.functional.cross_entropy(g @ E + c, y[batch])
        if depth:
            outs = chain_scores(g, batch)
            for j, s in enumerate(outs):
                w = want[batch, j]
                keep = (w >= 0) & (fed[batch, j] >= 0)
                if keep.any():
                    loss = loss + torch.nn.functional.cross_entropy(s[keep], w[keep])
        return loss

    train_rows = torch.from_numpy(np.flatnonzero(column[labels[:cut]] >= 0))
    held = torch.arange(cut, n)
    gen = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    agreement, chain_agreement, ran = 0.0, [], 0
    batches = -(-len(train_rows) // 256)
    planned = epochs        # the learning rate falls from LR to 0 along a cosine over the planned epochs' steps
    for epoch in range(epochs):
        if epoch == 1 and deadline is not None:       # as many epochs as the budget holds at the first one's pace
            pace = time.perf_counter() - started
            planned = max(1, min(epochs, 1 + int((deadline - time.perf_counter()) / pace)))
        if epoch >= planned:
            log(f"      stopped after {epoch} of {epochs} epochs: the time budget is spent")
            break
        ran = epoch + 1
        order = train_rows[torch.randperm(len(train_rows), generator=gen)]
        for i in range(0, len(order), 256):
            batch = order[i:i + 256]
            step = epoch * batches + i // 256
            for group in opt.param_groups:
                group["lr"] = LR * 0.5 * (1 + np.cos(np.pi * min(1.0, step / (planned * batches))))
            loss = loss_of(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            g = states(held)
            guess = ids[(g @ E + c).argmax(-1).numpy()]
            right = guess == labels[cut:]
            agreement = float(np.mean(right))
            chain_agreement = []
            if depth:
                outs = chain_scores(g, held)
                for j, s in enumerate(outs):
                    truth = chain[cut:, j]
                    reached = right & (truth >= 0)
                    hit = ids[s.argmax(-1).numpy()] == truth
                    chain_agreement.append(float(hit[reached].mean()) if reached.any() else 0.0)
                    right = reached & hit
        log(f"      epoch {epoch + 1}/{epochs}: held-out agreement {agreement:.3f}"
            + (", chain " + " ".join(f"{x:.2f}" for x in chain_agreement) if depth else "")
            + f" ({time.perf_counter() - started:.0f} s, about "
              f"{(time.perf_counter() - started) * (max(planned, epoch + 1) - epoch - 1) / (epoch + 1):.0f} s left)")
    with torch.no_grad():
        out = {"A": A.numpy().copy(), "a": a.numpy().copy(), "E": E.numpy().copy(), "c": c.numpy().copy(),
               "ids": ids.astype(np.int64), "agreement": agreement, "epochs": ran, "train_positions": int(cut),
               "heldout_positions": int(n - cut)}
        if chosen_emb is not None:
            out["B"] = B.numpy().copy()
        if depth:
            out.update(A2=A2.numpy().copy(), a2=a2.numpy().copy(), EB2=(head_emb @ B2).numpy().copy(),
                       chain_agreement=chain_agreement)
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
    outputs = [helper.make_tensor_value_info(GUESS_OUTPUT, TensorProto.INT64, ["batch", "rows"])]
    if "A2" in params:      # a chain continues from the state: the graph returns it
        nodes.append(helper.make_node("Identity", [p + "g"], [STATE_OUTPUT], name=p + "State"))
        outputs.append(helper.make_tensor_value_info(STATE_OUTPUT, TensorProto.FLOAT, ["batch", "rows", d]))
    return _finish(helper.make_graph(nodes, "guess_head", inputs, outputs, inits), d, bits, accuracy_level)


def _finish(graph, d: int, bits: int, accuracy_level: int | None):
    """The model of `graph`, its MatMuls `bits`-bit MatMulNBits (0: float)."""
    from onnx import helper

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


def chain_model(params: dict, vocab_size: int, bits: int = HEAD_BITS,
                accuracy_level: int | None = HEAD_ACCURACY_LEVEL):
    """The chain graph, run by the runtime once per further guess: inputs "state" # [rows, D] (the
    head's g, or the previous chain step's) and "token" # [rows] int64 (the token just guessed) ->
    "next_state" # [rows, D] and "next_token" # [rows] int64:

        g' = g + SiLU(g A2 + EB2[col(token)] + a2)        # EB2 = Emb[ids] B2: [V, D], col: id -> column
        next_token = ids[argmax(g' E + c)]

    E and c are the head's own output layer. A2 and E are `bits`-bit MatMulNBits (0: float)."""
    from onnx import TensorProto, helper, numpy_helper

    d = params["A2"].shape[0]
    column = np.zeros(vocab_size, dtype=np.int64)        # a token outside the head's vocabulary reads row 0
    column[params["ids"]] = np.arange(len(params["ids"]))
    inits = [numpy_helper.from_array(params["A2"].astype(np.float32), "A2"),
             numpy_helper.from_array(params["a2"].astype(np.float32), "a2"),
             numpy_helper.from_array(params["EB2"].astype(np.float32), "EB2"),
             numpy_helper.from_array(params["E"].astype(np.float32), "E"),
             numpy_helper.from_array(params["c"].astype(np.float32), "c"),
             numpy_helper.from_array(params["ids"].astype(np.int64), "ids"),
             numpy_helper.from_array(column, "column_of")]
    nodes = [helper.make_node("Gather", ["column_of", "token"], ["col"], name="Column", axis=0),
             helper.make_node("Gather", ["EB2", "col"], ["e"], name="Embed", axis=0),
             helper.make_node("MatMul", ["state", "A2"], ["gA"], name="MatMulA2"),
             helper.make_node("Add", ["gA", "a2"], ["gA_a"], name="AddA2"),
             helper.make_node("Add", ["gA_a", "e"], ["pre"], name="AddE"),
             helper.make_node("Sigmoid", ["pre"], ["sig"], name="Sigmoid"),
             helper.make_node("Mul", ["pre", "sig"], ["silu"], name="SiLU"),
             helper.make_node("Add", ["state", "silu"], ["next_state"], name="Residual"),
             helper.make_node("MatMul", ["next_state", "E"], ["gE"], name="MatMulE"),
             helper.make_node("Add", ["gE", "c"], ["scores"], name="AddC"),
             helper.make_node("ArgMax", ["scores"], ["next_col"], name="ArgMax", axis=-1, keepdims=0),
             helper.make_node("Gather", ["ids", "next_col"], ["next_token"], name="Token", axis=0)]
    graph = helper.make_graph(
        nodes, "guess_chain",
        [helper.make_tensor_value_info("state", TensorProto.FLOAT, ["rows", d]),
         helper.make_tensor_value_info("token", TensorProto.INT64, ["rows"])],
        [helper.make_tensor_value_info("next_state", TensorProto.FLOAT, ["rows", d]),
         helper.make_tensor_value_info("next_token", TensorProto.INT64, ["rows"])], inits)
    return _finish(graph, d, bits, accuracy_level)


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
    for o in [o for o in graph.output if o.name in (GUESS_OUTPUT, STATE_OUTPUT)]:
        graph.output.remove(o)


def write_head(spec, next_rows, vocab_size: int, log=print, threads: int | None = None, seed: int = 0,
               vocab: int = HEAD_VOCAB, epochs: int = HEAD_EPOCHS, bits: int = HEAD_BITS,
               follow_chosen: bool = True, chain_depth: int = CHAIN_DEPTH, minutes: float = HEAD_MINUTES,
               max_tokens: int = HEAD_TOKENS) -> dict:
    """Train a guess head for the target `spec` (a bundle ModelSpec) on rows of conversation from
    next_rows (gather's; rows_from(rows) for rows at hand), write it into the target graph in place
    (any earlier head replaced), and return the manifest entry.
    minutes: the time budget: gather gets and scores rows (at most max_tokens) for 1 - TRAIN_SHARE of
    it, training stops its epochs at its end. vocab_size: the tokenizer's ids (logits columns beyond
    are padding); follow_chosen: the head also reads the embedding of the token its row chooses
    (train's chosen); chain_depth: chain positions trained after the first guess (0: no chain graph;
    needs follow_chosen), written as CHAIN_FILE beside the target graph."""
    import onnx

    from .writer import save_graph_beside

    model = onnx.load(str(spec.file), load_external_data=False)
    remove(model)
    if any(o.name == GUESS_OUTPUT for o in model.graph.output):
        raise ExportError("the target graph's guess head could not be removed; re-export the bundle")
    chain_depth = chain_depth if follow_chosen else 0
    started = time.perf_counter()
    budget = minutes * 60
    scored = gather(spec, next_rows, vocab_size, budget * (1 - TRAIN_SHARE), max_tokens, log, threads)
    if not scored:
        raise ExportError("no conversation of at least 3 tokens to train the guess head on")
    tokens_read = sum(len(g) for _, g in scored)
    hidden, tokens, labels = chain_examples(scored, chain_depth)
    del scored
    log(f"      {len(labels)} positions scored by the target ({time.perf_counter() - started:.0f} s)")
    embedding = _embedding(model, spec.input_ids, spec.file)
    params = train(hidden, labels[:, 0], embedding, tokens[:, 0] if follow_chosen else None, vocab, epochs, seed,
                   log=log, chain=labels[:, 1:] if chain_depth else None, deadline=started + budget)
    params["vocab_size"] = vocab_size
    del hidden, embedding
    chain_file = spec.file.with_name(CHAIN_FILE)
    if chain_depth:       # first the new chain graph (the manifest names it only once the head is written)
        tmp = chain_file.with_name(CHAIN_FILE + f".partial-{os.getpid()}")
        try:
            onnx.save(chain_model(params, vocab_size, bits), str(tmp))
            os.replace(tmp, chain_file)
        finally:
            tmp.unlink(missing_ok=True)
    attach(model, head_model(params, bits), spec.logits, spec.input_ids)
    save_graph_beside(model, spec.file, spec.file, "guess-head")
    if not chain_depth:
        chain_file.unlink(missing_ok=True)
    entry = {"output": GUESS_OUTPUT, "vocab": int(len(params["ids"])), "bits": bits,
             "train_positions": params["train_positions"], "heldout_positions": params["heldout_positions"],
             "heldout_agreement": round(params["agreement"], 4), "epochs": params["epochs"],
             "tokens": tokens_read, "minutes": round((time.perf_counter() - started) / 60, 1),
             "reads_chosen_token": bool(follow_chosen)}
    if chain_depth:
        entry["chain"] = {"file": CHAIN_FILE, "state_output": STATE_OUTPUT, "trained_positions": chain_depth,
                          "heldout_agreement": [round(x, 4) for x in params["chain_agreement"]]}
    return entry


def record(manifest: dict, entry: dict, target_file: Path) -> None:
    """Declare the head written into `target_file` (and its chain graph beside it) in the bundle's
    manifest (in place)."""
    from .onnx_export import model_files

    target = manifest["models"]["target"]
    target["outputs"]["guess"] = GUESS_OUTPUT
    target["outputs"].pop("guess_state", None)
    target.pop("guess_chain", None)
    if "chain" in entry:
        target["outputs"]["guess_state"] = STATE_OUTPUT
        target["guess_chain"] = f"{target_file.parent.name}/{entry['chain']['file']}"
    target["size_bytes"] = sum(f.stat().st_size for f in model_files(target_file))
    manifest["guess_head"] = entry


def add_guess_head_to_bundle(bundle, log=print, tokens: int = HEAD_TOKENS, threads: int | None = None,
                             minutes: float = HEAD_MINUTES) -> dict:
    """Train and attach the target's guess head of an existing bundle, on conversation sampled from its
    draft model (else its target) as it goes, in rounds, for about `minutes` in all (at most `tokens`
    tokens; write_head); records it in the manifest."""
    from spectr_edge.bundle import bundle_from_manifest, write_manifest
    from spectr_edge.onnx_model import OnnxLM
    from spectr_edge.self_text import sample_conversations, turn_pieces
    from spectr_edge.text import TextCodec

    import importlib.util

    from .writer import existing_manifest

    if importlib.util.find_spec("torch") is None:     # before minutes of sampling, not after
        raise ExportError("training a guess head needs the export extra (torch is missing): "
                          "pip install torch==2.13.0 && pip install -e '.[export]'")
    bundle = Path(bundle)
    manifest = existing_manifest(bundle)
    b = bundle_from_manifest(bundle, manifest)
    codec = TextCodec(b.tokenizer)
    if turn_pieces(codec) is None:
        raise ExportError("the tokenizer has no chat template, so there is no conversation to train a guess head on")
    sampler = b.draft or b.target
    model = OnnxLM(sampler, provider="cpu", threads=threads)
    log(f"      sampling conversation from the {sampler.role} model and scoring it with the target, "
        f"{minutes:g} minutes in all with the training (at most {tokens} tokens)")

    def next_rows(n: int, r: int) -> list[list[int]]:
        return sample_conversations(model, codec, b.tokenizer.vocab_size, b.tokenizer.eos_token_ids, n,
                                    batch=ROUND_ROWS, seed=1 + r)

    entry = write_head(b.target, next_rows, b.tokenizer.vocab_size, log, threads, minutes=minutes, max_tokens=tokens)
    entry["source"] = f"{entry['tokens']} tokens of conversation sampled from the {sampler.role} model"
    record(manifest, entry, b.target.file)
    write_manifest(bundle, manifest)
    log(f"{bundle}: the target guesses the token after its next one (agreement with its own greedy choice "
        f"on held-out text: {entry['heldout_agreement']:.3f}; {entry['minutes']} min)")
    return entry
