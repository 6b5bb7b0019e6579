"""Toy language models as real ONNX graphs, packed as a real spectr-edge bundle.

The graphs have the I/O of an optimum decoder export (docs/BUNDLE.md), are tiny
(vocab 5, 2 layers, 1 head, head_dim 4) and are replicated exactly in NumPy, so the
law of any short continuation can be enumerated and compared with the runtime.

The model (per layer l, one head; t_j = token at position j, pos_j = its position id):

    key_j    = EK_l[t_j] + PK_l[pos_j]            # [D]  cached in present.l.key
    value_j  = EV_l[t_j] + PV_l[pos_j]            # [D]  cached in present.l.value
    query_t  = EQ_l[t_t]                          # [D]
    attn_t   = softmax_j(query_t . key_j)         # over j <= t with attention_mask 1
    ctx_l,t  = sum_j attn_t[j] value_j            # [D]
    logits_t = A[t_t] + sum_l ctx_l,t @ B_l + c   # [W],  W = V + 1

Every cached key and value enters the next-token logits, and both carry the position,
so keeping a rejected token in the cache, dropping an accepted one, taking the wrong
row or shifting position_ids all change the output law. Logit column V (the padding
id, not in the tokenizer) gets c[V] = PAD_LOGIT: a runtime that forgets to mask
padding samples it almost always. Embedding tables have W rows so that such an id
can even be fed back without an indexing error (the tests then see it in the output).

Public helpers:
    build_toy_bundle(out_dir, seed_target=, seed_draft=) -> bundle directory
    load_params(bundle_or_model_path) -> ToyParams   (read from the ONNX initializers)
    exact_next_logits / exact_next_probs(params, token_ids)
    process_logits(logits, vocab_size, temperature, top_k, top_p) -> probs [V]
    exact_sequence_law(bundle_or_params, prompt_ids, n_tokens, temperature, top_k, top_p)
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from spectr_edge.bundle import vocab_sha256

OPSET = 17
NUM_LAYERS = 2
HEAD_DIM = 4
CONTEXT_LENGTH = 64
PAD_LOGIT = 30.0  # logit of the padding id V: e^30 dwarfs every real token
NEG_INF_SCORE = -1e9  # attention score of a masked (future or padded) position
# Boundary margin for top-k / top-p: the runtime computes in float32, this reference
# in float64; a kept/removed decision closer than this to its threshold is refused.
DECISION_MARGIN = 1e-5


@dataclass
class ToyParams:
    """Weights of one toy model (float32, as stored in the graph)."""

    vocab_size: int  # V: real tokens
    A: np.ndarray  # [W, W]   logits from the current token
    c: np.ndarray  # [W]      logit bias; c[V] = PAD_LOGIT
    EK: np.ndarray  # [layers, W, D]
    PK: np.ndarray  # [layers, context_length, D]
    EV: np.ndarray  # [layers, W, D]
    PV: np.ndarray  # [layers, context_length, D]
    EQ: np.ndarray  # [layers, W, D]
    B: np.ndarray  # [layers, D, W]

    @property
    def num_layers(self) -> int:
        return self.EK.shape[0]

    @property
    def head_dim(self) -> int:
        return self.EK.shape[2]

    @property
    def logits_width(self) -> int:
        return self.A.shape[1]


# --------------------------------------------------------------------------- weights


def _random_weights(rng: np.random.Generator, vocab_size: int) -> dict[str, np.ndarray]:
    """The random part of a toy model; scales chosen so each term moves the logits by ~1."""
    W, L, D, C = vocab_size + 1, NUM_LAYERS, HEAD_DIM, CONTEXT_LENGTH
    return {
        "A": rng.normal(0.0, 0.8, (W, W)),
        "EK": rng.normal(0.0, 1.0, (L, W, D)),
        "PK": rng.normal(0.0, 0.7, (L, C, D)),
        "EV": rng.normal(0.0, 1.0, (L, W, D)),
        "PV": rng.normal(0.0, 1.0, (L, C, D)),
        "EQ": rng.normal(0.0, 0.8, (L, W, D)),
        "B": rng.normal(0.0, 0.4, (L, D, W)),
    }


def _params(weights: dict[str, np.ndarray], vocab_size: int) -> ToyParams:
    w = {name: np.asarray(x, np.float32).copy() for name, x in weights.items()}
    V = vocab_size
    w["A"][:, V] = 0.0  # the padding logit comes from c alone
    w["B"][:, :, V] = 0.0
    c = np.zeros(V + 1, np.float32)
    c[V] = PAD_LOGIT
    return ToyParams(vocab_size=V, c=c, **w)


def make_params(seed_target: int, seed_draft: int, vocab_size: int = 5,
                draft_closeness: float = 0.85) -> tuple[ToyParams, ToyParams]:
    """Target and draft weights: draft = closeness * target + sqrt(1 - closeness^2) * noise.

    closeness 1 gives draft == target; 0 an independent model of the same scale.
    """
    if not 0.0 <= draft_closeness <= 1.0:
        raise ValueError(f"draft_closeness must be in [0, 1], got {draft_closeness}")
    target = _random_weights(np.random.default_rng(seed_target), vocab_size)
    noise = _random_weights(np.random.default_rng(seed_draft), vocab_size)
    mix = np.sqrt(1.0 - draft_closeness**2)
    draft = {name: draft_closeness * target[name] + mix * noise[name] for name in target}
    return _params(target, vocab_size), _params(draft, vocab_size)


# --------------------------------------------------------------------------- NumPy model


def exact_next_logits(params: ToyParams, token_ids) -> np.ndarray:
    """Logits [W] (float64) for the token after `token_ids` (positions 0..n-1)."""
    ids = np.asarray(token_ids, np.int64)  # [n]
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("token_ids must be a non-empty 1-D sequence")
    pos = np.arange(ids.size)  # [n]
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731  (weights in float64)
    logits = f(params.A)[ids[-1]] + f(params.c)  # [W]
    for l in range(params.num_layers):
        keys = f(params.EK[l])[ids] + f(params.PK[l])[pos]  # [n, D]
        values = f(params.EV[l])[ids] + f(params.PV[l])[pos]  # [n, D]
        scores = keys @ f(params.EQ[l])[ids[-1]]  # [n]
        attn = np.exp(scores - scores.max())
        attn /= attn.sum()  # [n]
        logits = logits + (attn @ values) @ f(params.B[l])  # [D] @ [D, W] -> [W]
    return logits


def exact_next_probs(params: ToyParams, token_ids) -> np.ndarray:
    """Next-token probabilities [V] at temperature 1, padding masked (float64)."""
    return process_logits(exact_next_logits(params, token_ids), params.vocab_size)


def process_logits(logits, vocab_size: int, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> np.ndarray:
    """Reference logits processing -> probabilities [V] (float64).

    padding masked -> temperature -> top-k (keep logits >= k-th largest) -> top-p (HF:
    sort ascending, remove cumulative prob <= 1 - top_p, always keep the largest) ->
    softmax. temperature 0 is greedy: one-hot on the first argmax.
    Raises ValueError when a top-k / top-p decision is within DECISION_MARGIN of its
    threshold (float32 and float64 could then disagree; pick another seed).
    """
    x = np.asarray(logits, np.float64)[:vocab_size].copy()  # [V] padding masked
    if temperature == 0:
        return np.eye(vocab_size)[int(np.argmax(x))]
    x = x / temperature
    if 0 < top_k < vocab_size:
        kth = np.sort(x)[::-1][top_k - 1]
        gaps = np.abs(x - kth)
        if np.any((gaps > 0) & (gaps < DECISION_MARGIN)):
            raise ValueError("top-k threshold within DECISION_MARGIN of a logit")
        x[x < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(x, kind="stable")  # ascending
        sorted_probs = _softmax(x[order])
        cumulative = np.cumsum(sorted_probs)  # [V]
        live = sorted_probs > 0
        if np.any(live & (np.abs(cumulative - (1.0 - top_p)) < DECISION_MARGIN)):
            raise ValueError("top-p cumulative within DECISION_MARGIN of 1 - top_p")
        remove = cumulative <= 1.0 - top_p
        remove[-1] = False  # keep at least the most likely token
        x[order[remove]] = -np.inf
    return _softmax(x)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def penalize(logits, prompt, generated, presence: float = 0.0, frequency: float = 0.0,
             repetition: float = 1.0) -> np.ndarray:
    """Reference penalties (float64): HF's repetition penalty over every token of the prompt and the
    output (positive logits divided by it, others multiplied), then OpenAI's presence and frequency
    penalties over the output's token counts."""
    x = np.asarray(logits, np.float64).copy()
    for t in set(prompt) | set(generated):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(generated):
        x[t] -= presence + frequency * list(generated).count(t)
    return x


def exact_sequence_law(bundle_or_params, prompt_ids, n_tokens: int, temperature: float = 1.0,
                       top_k: int = 0, top_p: float = 1.0, penalties=(0.0, 0.0, 1.0)) -> dict[tuple[int, ...], float]:
    """P(first n_tokens generated = seq) for every seq in V^n_tokens, sampling the TARGET
    alone with processed logits. Zero-probability sequences are included (value 0).
    penalties: (presence, frequency, repetition), applied at each position from its own prefix."""
    params = bundle_or_params
    if not isinstance(params, ToyParams):
        params = load_params(bundle_or_params)
    V, prompt = params.vocab_size, list(prompt_ids)
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def next_probs(prefix: tuple[int, ...]) -> np.ndarray:
        if prefix not in cache:
            logits = exact_next_logits(params, prompt + list(prefix))
            if tuple(penalties) != (0.0, 0.0, 1.0):
                logits = penalize(logits, prompt, prefix, *penalties)
            cache[prefix] = process_logits(logits, V, temperature, top_k, top_p)
        return cache[prefix]

    law = {}
    for seq in itertools.product(range(V), repeat=n_tokens):
        prob = 1.0
        for j in range(n_tokens):
            prob *= next_probs(seq[:j])[seq[j]]
            if prob == 0.0:
                break
        law[seq] = prob
    return law


# --------------------------------------------------------------------------- ONNX graph


def _layer_names(l: int) -> tuple[str, str, str, str]:
    return (f"past_key_values.{l}.key", f"past_key_values.{l}.value",
            f"present.{l}.key", f"present.{l}.value")


def build_graph(params: ToyParams, name: str, guess: bool = False, chain: bool = False) -> onnx.ModelProto:
    """The toy model as an ONNX graph with optimum-export I/O (see module docstring).

    guess: also output guess_ids # [batch, new] int64, a guess-head stand-in (export/guess_head.py):
    each row's greedy token among the real ids, i.e. "the token after the next repeats it".
    chain: also output guess_state # [batch, new, V], the row's real logits (where chain_graph starts)."""
    D, W = params.head_dim, params.logits_width
    nodes, inits = [], []

    def const(name: str, array) -> str:
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    i64 = lambda v: np.asarray(v, np.int64)  # noqa: E731
    ax0, ax1, ax12 = const("axes_0", i64([0])), const("axes_1", i64([1])), const("axes_12", i64([1, 2]))
    one, zero = const("i64_one", i64(1)), const("i64_zero", i64(0))

    # Mask shared by all layers: allowed[b, 1, s, T] = (j <= past + i) and attention_mask[b, j] == 1
    total = node("Gather", [node("Shape", ["attention_mask"], "mask_shape"), one], "total_len")  # T
    new = node("Gather", [node("Shape", ["input_ids"], "ids_shape"), one], "new_len")  # s
    past = node("Sub", [total, new], "past_len")
    key_idx = node("Unsqueeze", [node("Range", [zero, total, one], "key_range"), ax0], "key_idx")  # [1, T]
    query_idx = node("Unsqueeze", [node("Range", [past, total, one], "query_range"), ax1], "query_idx")  # [s, 1]
    causal = node("LessOrEqual", [key_idx, query_idx], "causal")  # [s, T]
    unmasked = node("Equal", ["attention_mask", one], "unmasked")  # [b, T]
    unmasked = node("Unsqueeze", [unmasked, ax12], "unmasked_4d")  # [b, 1, 1, T]
    allowed = node("And", [causal, unmasked], "allowed")  # [b, 1, s, T]
    neg = const("neg_score", np.float32(NEG_INF_SCORE))

    logits = node("Add", [node("Gather", [const("A", params.A), "input_ids"], "a_logits"),
                          const("c", params.c)], "logits_0")  # [b, s, W]
    for l in range(params.num_layers):
        past_k, past_v, present_k, present_v = _layer_names(l)

        def embed(kind: str, table_tok, table_pos) -> str:  # [b, 1, s, D]
            tok = node("Gather", [const(f"{kind}{l}", table_tok), "input_ids"], f"{kind}{l}_tok")
            if table_pos is not None:
                pos = node("Gather", [const(f"P{kind[-1]}{l}", table_pos), "position_ids"], f"{kind}{l}_pos")
                tok = node("Add", [tok, pos], f"{kind}{l}_sum")
            return node("Unsqueeze", [tok, ax1], f"{kind}{l}_4d")

        key = node("Concat", [past_k, embed("EK", params.EK[l], params.PK[l])], present_k, axis=2)
        value = node("Concat", [past_v, embed("EV", params.EV[l], params.PV[l])], present_v, axis=2)
        query = embed("EQ", params.EQ[l], None)  # [b, 1, s, D]
        key_t = node("Transpose", [key], f"key_t{l}", perm=[0, 1, 3, 2])  # [b, 1, D, T]
        scores = node("MatMul", [query, key_t], f"scores{l}")  # [b, 1, s, T]
        scores = node("Where", [allowed, scores, neg], f"masked_scores{l}")
        attn = node("Softmax", [scores], f"attn{l}", axis=-1)
        ctx = node("MatMul", [attn, value], f"ctx{l}")  # [b, 1, s, D]
        ctx = node("Squeeze", [ctx, ax1], f"ctx3d{l}")  # [b, s, D]
        out = node("MatMul", [ctx, const(f"B{l}", params.B[l])], f"ctx_logits{l}")  # [b, s, W]
        logits = node("Add", [logits, out], "logits" if l == params.num_layers - 1 else f"logits_{l + 1}")

    f32, i64t = TensorProto.FLOAT, TensorProto.INT64
    if guess:
        real = node("Slice", ["logits", const("guess_starts", i64([0])), const("guess_ends", i64([params.vocab_size])),
                              const("guess_axes", i64([2]))], "guess_real_logits")   # [b, s, V]
        node("ArgMax", [real], "guess_ids", axis=-1, keepdims=0)                   # [b, s]
        if chain:
            node("Identity", [real], "guess_state")                                # [b, s, V]
    inputs = [helper.make_tensor_value_info("input_ids", i64t, ["batch", "new"]),
              helper.make_tensor_value_info("attention_mask", i64t, ["batch", "total"]),
              helper.make_tensor_value_info("position_ids", i64t, ["batch", "new"])]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", "new", W])]
    if guess:
        outputs.append(helper.make_tensor_value_info("guess_ids", i64t, ["batch", "new"]))
    if guess and chain:
        outputs.append(helper.make_tensor_value_info("guess_state", f32, ["batch", "new", params.vocab_size]))
    for l in range(params.num_layers):
        past_k, past_v, present_k, present_v = _layer_names(l)
        inputs += [helper.make_tensor_value_info(n, f32, ["batch", 1, "past", D]) for n in (past_k, past_v)]
        outputs += [helper.make_tensor_value_info(n, f32, ["batch", 1, "total", D])
                    for n in (present_k, present_v)]
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="spectr-edge tests/toy_lm.py")
    model.ir_version = 8  # readable by any onnxruntime >= 1.14
    onnx.checker.check_model(model, full_check=True)
    return model


def chain_graph(vocab_size: int, seed: int = 0) -> onnx.ModelProto:
    """A stand-in for the guess head's chain graph (export/guess_head.chain_model's I/O): state # [rows, V]
    plus a fixed random row per token is the next state, its argmax the next guess. Any guesses keep the
    output law; these are right often enough, and wrong often enough, for the law tests to see both."""
    rng = np.random.default_rng(seed)
    table = rng.normal(0.0, 1.5, (vocab_size, vocab_size)).astype(np.float32)
    f32, i64t = TensorProto.FLOAT, TensorProto.INT64
    nodes = [helper.make_node("Gather", ["T", "token"], ["step"], axis=0),
             helper.make_node("Add", ["state", "step"], ["next_state"]),
             helper.make_node("ArgMax", ["next_state"], ["next_token"], axis=-1, keepdims=0)]
    graph = helper.make_graph(nodes, "toy_chain",
                              [helper.make_tensor_value_info("state", f32, ["rows", vocab_size]),
                               helper.make_tensor_value_info("token", i64t, ["rows"])],
                              [helper.make_tensor_value_info("next_state", f32, ["rows", vocab_size]),
                               helper.make_tensor_value_info("next_token", i64t, ["rows"])],
                              initializer=[numpy_helper.from_array(table, "T")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def load_params(bundle_or_model_path, role: str = "target") -> ToyParams:
    """ToyParams read back from a bundle's `role` graph (or a model.onnx path)."""
    path = Path(bundle_or_model_path)
    if path.is_dir():
        manifest = json.loads((path / "spectr.json").read_text())
        path = path / manifest["models"][role]["file"]
    w = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    layers = range(sum(1 for n in w if n.startswith("EK")))
    stack = lambda kind: np.stack([w[f"{kind}{l}"] for l in layers])  # noqa: E731
    return ToyParams(vocab_size=int(np.argmax(w["c"])), A=w["A"], c=w["c"], EK=stack("EK"),
                     PK=stack("PK"), EV=stack("EV"), PV=stack("PV"), EQ=stack("EQ"), B=stack("B"))


# --------------------------------------------------------------------------- bundle


def token_strings(vocab_size: int) -> list[str]:
    """Id -> token: "<unk>" is id 0 (a real, generatable token), then "a", "b", ..."""
    return ["<unk>"] + [chr(ord("a") + i) for i in range(vocab_size - 1)]


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(token_strings(vocab_size))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer




def build_toy_bundle(out_dir, *, seed_target: int, seed_draft: int, vocab_size: int = 5,
                     draft_closeness: float = 0.85, tree_mask: bool = False, guess: bool = False,
                     chain: bool = False) -> Path:
    """Write a complete bundle (target + draft graphs, tokenizer, spectr.json) to out_dir.

    tree_mask: both graphs go through export/tree_mask.py (the shared `allowed` mask becomes
    the 4D input tree_attention_mask), so the engine verifies k > 1 candidates as a token trie.
    guess: the target graph also outputs guess_ids (build_graph), declared in the manifest; chain: and
    guess_state, with chain_graph's stand-in as the bundle's guess chain.
    """
    out = Path(out_dir)
    target, draft = make_params(seed_target, seed_draft, vocab_size, draft_closeness)
    tokenizer = build_tokenizer(vocab_size)
    sha = vocab_sha256(tokenizer.get_vocab(with_added_tokens=True))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "chat_template": None}))

    def model_entry(role: str, params: ToyParams) -> dict:
        (out / role).mkdir(exist_ok=True)
        with_guess = guess and role == "target"
        graph = build_graph(params, f"toy_{role}", guess=with_guess, chain=with_guess and chain)
        with_chain = with_guess and chain
        if with_chain:
            onnx.save(chain_graph(vocab_size), str(out / role / "guess_chain.onnx"))
        still_has_mask = True
        if tree_mask:
            from spectr_edge_export.tree_mask import add_tree_mask

            graph, still_has_mask = add_tree_mask(graph)
        onnx.save(graph, str(out / role / "model.onnx"))
        tokenizer.save(str(out / role / "tokenizer.json"))
        past = [list(_layer_names(l)[:2]) for l in range(params.num_layers)]
        present = [list(_layer_names(l)[2:]) for l in range(params.num_layers)]
        return {
            "file": f"{role}/model.onnx",
            "tokenizer_file": f"{role}/tokenizer.json",
            "vocab_sha256": sha,
            "source": f"tests/toy_lm.py {role} (seed_target={seed_target}, seed_draft={seed_draft}, "
                      f"draft_closeness={draft_closeness})",
            "architecture": "toy",
            "quant": "none",
            "dtype": "float32",
            "num_layers": params.num_layers,
            "num_kv_heads": 1,
            "head_dim": params.head_dim,
            "logits_width": params.logits_width,
            "context_length": CONTEXT_LENGTH,
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask" if still_has_mask else None,
                       "position_ids": "position_ids", "past": past},
            "outputs": {"logits": "logits", "present": present, **({"guess": "guess_ids"} if with_guess else {}),
                        **({"guess_state": "guess_state"} if with_chain else {})},
            **({"guess_chain": f"{role}/guess_chain.onnx"} if with_chain else {}),
            "tree_mask": "tree_attention_mask" if tree_mask else False,
            "parity_max_abs_diff": None,
            "size_bytes": (out / role / "model.onnx").stat().st_size,
        }

    manifest = {
        "format": "spectr-edge-bundle",
        "format_version": 1,
        "created_by": "spectr-edge 0.1.0",
        "name": f"toy-v{vocab_size}-t{seed_target}-d{seed_draft}",
        "tokenizer": {
            "file": "tokenizer.json",
            "vocab_size": vocab_size,
            "vocab_sha256": sha,
            "bos_token_id": None,
            "add_bos_token": False,
            "eos_token_ids": [],  # every sequence runs to max_new_tokens
            "chat_template": None,
            "special_tokens": {"bos_token": None, "eos_token": None, "pad_token": None},
        },
        "models": {"target": model_entry("target", target),
                   "draft": model_entry("draft", draft)},
    }
    (out / "spectr.json").write_text(json.dumps(manifest, indent=2))
    return out
