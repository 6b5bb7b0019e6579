"""Tiny offline models for tests: a byte-level BPE tokenizer and random Llama / Qwen2 models.

Everything here is deterministic (fixed torch seeds, fixed training text) and built in
seconds without network access. The models are random but "peaky": the lm_head is
scaled so logits spread over several units and greedy decoding has no near-ties, and
each draft is a truncated, slightly perturbed copy of its target so that speculative
decoding accepts a useful fraction of its proposals.

    make_tokenizer(dir)                    -> PreTrainedTokenizerFast saved in dir
    make_llama(dir, tok_dir, ...)          -> random LlamaForCausalLM saved in dir
    make_qwen(dir, tok_dir, ...)           -> random Qwen2ForCausalLM (tied, padded vocab)
    make_draft(target_dir, dir, ...)       -> truncated + noised copy of a target
"""

from __future__ import annotations

import shutil
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts a few tokens
with a small model and lets the large model check them all in one call; every accepted
token is a token the large model would have produced itself, so the output is unchanged.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10):
    print(i, fibonacci(i))
Edge devices have little memory and few cores, so the runtime keeps one cache per model,
crops it after a rejection and never copies more than it must. Numbers: 0 1 2 3 4 5 6 7 8 9.
The weather today is sunny with a light breeze from the west; tomorrow it may rain.
class Stack:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop()
Hello, world! How are you? I am fine, thank you. What is the capital of France? Paris.
"""


def make_tokenizer(out_dir: Path, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE on TRAINING_TEXT; save it as a PreTrainedTokenizerFast with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        unk_token=None,
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def _load_tokenizer(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def _peaky_(model, logit_std: float, vocab_size: int) -> None:
    """Scale lm_head so logits have std ~logit_std; zero padding rows (ids >= vocab_size)."""
    import torch

    with torch.no_grad():
        w = model.get_output_embeddings().weight  # [logits_width, hidden]
        hidden = w.shape[1]
        w.normal_(0.0, logit_std / hidden**0.5)  # final RMSNorm output has unit RMS
        w[vocab_size:] = 0.0  # padding ids get logit 0, far below the max of hundreds of N(0, std)
        emb = model.get_input_embeddings().weight
        if emb.data_ptr() != w.data_ptr():
            emb.normal_(0.0, 1.0)
            emb[vocab_size:] = 0.0


def _weaken_tail_(model, keep: int, scale: float) -> None:
    """Scale the residual writes of layers >= keep, so a draft made of the first keep layers stays close."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers[keep:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def _save(model, tok, out_dir: Path, eos_id: int) -> Path:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=tok.pad_token_id)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def make_llama(out_dir: Path, tok_dir: Path, num_layers: int = 4, seed: int = 0, logit_std: float = 10.0,
               init_std: float = 0.05) -> Path:
    """Random LlamaForCausalLM: hidden 64, 4 heads / 2 kv heads, untied lm_head, vocab = tokenizer size.

    With these defaults greedy top-1 of make_draft(…, num_layers=2) agrees ~0.9 with it.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _load_tokenizer(tok_dir)
    vocab = len(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id,
        initializer_range=init_std, dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    _peaky_(model, logit_std, vocab)
    return _save(model, tok, out_dir, eos)


def make_qwen(out_dir: Path, tok_dir: Path, num_layers: int = 3, seed: int = 1, logit_std: float = 10.0,
              init_std: float = 0.2, padded_vocab: int = 512, draft_layers: int = 2, tail_scale: float = 0.2) -> Path:
    """Random Qwen2ForCausalLM like the real ones: tied embeddings, logits width > tokenizer size.

    Tied random embeddings make a weak-layer model repeat one token forever, so the layers
    are strong (init_std 0.2) except those after draft_layers (scaled by tail_scale): greedy
    top-1 of make_draft(…, num_layers=draft_layers) then agrees ~0.85 with it.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = _load_tokenizer(tok_dir)
    vocab = len(tok)
    assert padded_vocab > vocab, (padded_vocab, vocab)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(
        vocab_size=padded_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos, use_sliding_window=False,
        initializer_range=init_std, dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    _peaky_(model, logit_std, vocab)
    _weaken_tail_(model, draft_layers, tail_scale)
    return _save(model, tok, out_dir, eos)


def make_draft(target_dir: Path, out_dir: Path, num_layers: int = 2, seed: int = 7, noise: float = 0.02) -> Path:
    """Draft = the target's first num_layers layers, every weight perturbed by relative noise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(target_dir)).save_pretrained(out_dir)
    if (Path(target_dir) / "generation_config.json").exists():
        shutil.copy(Path(target_dir) / "generation_config.json", out_dir / "generation_config.json")
    return out_dir


# ---- bundles -------------------------------------------------------------------------------------

TINY_CONVERSATION_TOKENS = 1024


def build_tiny_bundle(out: Path, work: Path, log=lambda s: None) -> Path:
    """tiny-llama: 4-layer Llama target + 2-layer perturbed-copy draft, both float32.

    Exported with --no-tree-mask (2D attention mask, replicated verification) and without the
    logits_keep input, as bundles made before either existed; tiny-qwen has both, so both
    verification paths and the in-place upgrade (test_tree.py) are covered.
    """
    from spectr_edge_export import export_bundle

    tok = make_tokenizer(work / "tokenizer")
    target = make_llama(work / "llama", tok)
    draft = make_draft(target, work / "llama-draft", num_layers=2)
    return export_bundle(out, target=str(target), draft=str(draft), tree_mask=False, logits_keep=False,
                         lookup_conversation_tokens=0, log=log)


def build_tiny_qwen_bundle(out: Path, work: Path, log=lambda s: None) -> Path:
    """tiny-qwen: 3-layer Qwen2 target (tied, logits width 512 > 400 ids) + 2-layer int8 draft, and
    the target's guess head.

    int8, not int4: block-32 int4 on 64-wide random matrices moves logits by ~1 unit and the
    draft then agrees with the target on under half the tokens (test_export covers int4).
    """
    from spectr_edge_export import export_bundle

    tok = make_tokenizer(work / "tokenizer")
    target = make_qwen(work / "qwen", tok)
    draft = make_draft(target, work / "qwen-draft", num_layers=2)
    # the lookup table gets conversation sampled from the tiny draft (self_text.py), as a real export does
    # and the float32 target gets the guess head that exports give quantized targets (export/guess_head.py)
    return export_bundle(out, target=str(target), draft=str(draft), draft_quant="int8",
                         lookup_conversation_tokens=TINY_CONVERSATION_TOKENS, guess_head=True, log=log)


def weak_draft_source(bundle: Path) -> Path:
    """Where build_weak_draft_bundle keeps its draft's Hugging Face weights (what adapt retrains)."""
    return Path(bundle).with_name(Path(bundle).name + "-draft-source")


def build_weak_draft_bundle(out: Path, work: Path, log=lambda s: None, **quant) -> Path:
    """tiny-qwen's float32 target with a 2-layer draft whose weights carry 40% noise: it agrees with
    the target on under a fifth of the tokens, so adapting it has something to learn. quant: export
    options for the draft (draft_quant, int4_block_size)."""
    from spectr_edge_export import export_bundle

    tok = make_tokenizer(work / "tokenizer")
    target = make_qwen(work / "qwen", tok)
    source = weak_draft_source(out)
    shutil.rmtree(source, ignore_errors=True)
    draft = make_draft(target, source, num_layers=2, noise=0.4, seed=11)
    return export_bundle(out, target=str(target), draft=str(draft), lookup_conversation_tokens=0,
                         guess_head=False, log=log, **quant)


def build_weak_int4_draft_bundle(out: Path, work: Path, log=lambda s: None) -> Path:
    """build_weak_draft_bundle with the draft quantized to int4 (MatMulNBits with zero points) as the
    default bundle's is: what adapt's quantization-aware training is for."""
    return build_weak_draft_bundle(out, work, log, draft_quant="int4", int4_block_size=32)


def source_key(*extra: str) -> str:
    """Hash of the code and package versions a cached test bundle depends on."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    files = [root / "spectr_edge" / "ngram_table.py", root / "spectr_edge" / "self_text.py"]
    for f in [Path(__file__).resolve(), *sorted((root / "export").glob("*.py")), *files]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for pkg in ("torch", "transformers", "optimum-onnx", "onnx", "onnxruntime-gpu", "onnxruntime", "tokenizers"):
        try:
            h.update(f"{pkg}=={version(pkg)}".encode())
        except PackageNotFoundError:
            pass
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:16]
