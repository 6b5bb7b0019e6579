"""Reading and validating a bundle's manifest (spectr.json); see docs/BUNDLE.md.

Everything about a model comes from the manifest, never from a file name. Anything that
would fail later (missing files, paths outside the bundle, vocabulary mismatch) fails here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import BundleError

FORMAT = "spectr-edge-bundle"
FORMAT_VERSION = 1
DEFAULT_BUNDLE = Path("models") / "default"
BUILD_DEFAULT_HINT = "build it with: spectr-edge export --preset qwen2.5-coder --out models/default"


@dataclass(frozen=True)
class TokenizerSpec:
    file: Path
    vocab_size: int
    vocab_sha256: str | None
    bos_token_id: int | None
    add_bos_token: bool
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: dict


@dataclass(frozen=True)
class ModelSpec:
    role: str                      # "target" or "draft"
    file: Path
    tokenizer_file: Path | None
    vocab_sha256: str | None
    quant: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    logits_width: int
    context_length: int
    input_ids: str
    attention_mask: str | None            # None when the graph takes tree_mask instead
    position_ids: str | None
    past: tuple[tuple[str, str], ...]      # per layer (key name, value name)
    logits: str
    present: tuple[tuple[str, str], ...]
    tree_mask: str | None                 # name of the 4D bool mask input [batch, 1, new, past + new]
    source: str
    size_bytes: int | None
    attention: str = "unfused"            # "gqa": fused GroupQueryAttention, cache buffers updated in place
    min_call_tokens: int = 1              # 2: the kernels round a 1-token call differently (int4 MatMulNBits
                                          # with int8 activations), so every call scores >= 2 tokens
    call_multiple: int = 1                # 2: they also round a lone last row of an odd-sized call so
                                          # (block 128 with zero points): batch-1 calls score an even count
    logits_keep: str | None = None        # int64 [1] input: the call returns the logits of its last n positions
                                          # only (export/logits_keep.py); None: every position's
    guess: str | None = None              # int64 [batch, rows] output: per logits row, the guessed token after the
                                          # one that row chooses (export/guess_head.py); None: no guess head


@dataclass(frozen=True)
class Bundle:
    path: Path
    name: str
    tokenizer: TokenizerSpec
    target: ModelSpec
    draft: ModelSpec | None
    manifest: dict
    lookup_table: Path | None = None      # prompt lookup's static next-token table (ngram_table.py)


def default_bundle_path() -> Path:
    """$SPECTR_EDGE_BUNDLE, else ./models/default, else models/default beside the source checkout."""
    env = os.environ.get("SPECTR_EDGE_BUNDLE")
    if env:
        return Path(env)
    if (DEFAULT_BUNDLE / "spectr.json").exists():
        return DEFAULT_BUNDLE
    beside_checkout = Path(__file__).resolve().parent.parent / DEFAULT_BUNDLE
    if (beside_checkout / "spectr.json").exists():
        return beside_checkout
    return DEFAULT_BUNDLE


def write_manifest(bundle: str | os.PathLike, manifest: dict) -> None:
    """Replace a bundle's spectr.json atomically (a temporary file beside it, then os.replace)."""
    path = Path(bundle) / "spectr.json"
    tmp = path.with_name(f".spectr.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _inside(bundle: Path, rel: str, what: str) -> Path:
    path = (bundle / rel).resolve()
    if not path.is_relative_to(bundle.resolve()):
        raise BundleError(f"manifest entry {what} = '{rel}' points outside the bundle {bundle}; "
                          "re-export the bundle (spectr-edge export)")
    return path


def _require(d: dict, key: str, where: str):
    if key not in d:
        raise BundleError(f"spectr.json has no '{key}' in {where}; the bundle is corrupt, re-export it")
    return d[key]


def _model_spec(bundle: Path, role: str, m: dict) -> ModelSpec:
    where = f"models.{role}"
    model_file = _inside(bundle, _require(m, "file", where), f"{where}.file")
    if not model_file.is_file():
        raise BundleError(f"the {role} model file {model_file} is missing; re-export the bundle")
    inputs, outputs = _require(m, "inputs", where), _require(m, "outputs", where)
    tok = m.get("tokenizer_file")
    try:
        return ModelSpec(
            role=role, file=model_file,
            tokenizer_file=_inside(bundle, tok, f"{where}.tokenizer_file") if tok else None,
            vocab_sha256=m.get("vocab_sha256"), quant=m.get("quant", "none"),
            dtype=m.get("dtype", "float32"), num_layers=int(_require(m, "num_layers", where)),
            num_kv_heads=int(_require(m, "num_kv_heads", where)), head_dim=int(_require(m, "head_dim", where)),
            logits_width=int(_require(m, "logits_width", where)),
            context_length=int(_require(m, "context_length", where)),
            input_ids=_require(inputs, "input_ids", f"{where}.inputs"),
            attention_mask=inputs.get("attention_mask") if m.get("tree_mask") else
            _require(inputs, "attention_mask", f"{where}.inputs"),
            position_ids=inputs.get("position_ids"),
            past=tuple((k, v) for k, v in _require(inputs, "past", f"{where}.inputs")),
            logits=_require(outputs, "logits", f"{where}.outputs"),
            present=tuple((k, v) for k, v in _require(outputs, "present", f"{where}.outputs")),
            tree_mask=_tree_mask(m.get("tree_mask"), where), source=str(m.get("source", "")),
            size_bytes=m.get("size_bytes"), attention=_attention(m.get("attention"), m.get("tree_mask"), where),
            min_call_tokens=int(m.get("min_call_tokens", 1)),
            call_multiple=max(1, int(m.get("call_token_multiple", 1))),
            logits_keep=_input_name(inputs.get("logits_keep"), f"{where}.inputs.logits_keep"),
            guess=_input_name(outputs.get("guess"), f"{where}.outputs.guess"),
        )
    except (TypeError, ValueError) as err:
        raise BundleError(f"spectr.json entry {where} is malformed ({err}); re-export the bundle") from None


def _attention(value, tree_mask, where: str) -> str:
    if value in (None, "unfused"):
        return "unfused"
    if value != "gqa" or not tree_mask:
        raise BundleError(f"spectr.json {where}.attention is {value!r}; expected 'unfused', or 'gqa' on a graph "
                          "with a tree mask (re-export the bundle)")
    return value


def _input_name(value, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BundleError(f"spectr.json {where} is {value!r}; expected the name of one of the graph's inputs or outputs, "
                          "re-export the bundle")
    return value


def _tree_mask(value, where: str) -> str | None:
    if value in (None, False):
        return None
    if not isinstance(value, str) or not value:
        raise BundleError(f"spectr.json {where}.tree_mask is {value!r}; expected false or the name of the "
                          "4D mask input (re-export the bundle, or run spectr-edge export --add-tree-mask)")
    return value


def _lookup_table(bundle: Path, manifest: dict) -> Path | None:
    entry = manifest.get("lookup_table")
    if not entry:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
        raise BundleError("spectr.json lookup_table is malformed; rebuild it with "
                          "spectr-edge export --add-lookup-table --out BUNDLE")
    path = _inside(bundle, entry["file"], "lookup_table.file")
    if not path.is_file():
        raise BundleError(f"the lookup table {path} is missing; rebuild it with "
                          "spectr-edge export --add-lookup-table --out BUNDLE")
    return path


def _tokenizer_spec(bundle: Path, t: dict) -> TokenizerSpec:
    tok_file = _inside(bundle, _require(t, "file", "tokenizer"), "tokenizer.file")
    if not tok_file.is_file():
        raise BundleError(f"the tokenizer file {tok_file} is missing; re-export the bundle")
    return TokenizerSpec(
        file=tok_file, vocab_size=int(_require(t, "vocab_size", "tokenizer")),
        vocab_sha256=t.get("vocab_sha256"), bos_token_id=t.get("bos_token_id"),
        add_bos_token=bool(t.get("add_bos_token", False)),
        eos_token_ids=tuple(int(i) for i in t.get("eos_token_ids", [])),
        chat_template=t.get("chat_template"), special_tokens=dict(t.get("special_tokens") or {}),
    )


def vocab_sha256(vocab: dict[str, int]) -> str:
    """The manifest's vocabulary fingerprint: sha256 of the sorted token->id map."""
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


def first_vocab_difference(target_vocab: dict[str, int], draft_vocab: dict[str, int]) -> str:
    """Describe the first id at which two token->id maps differ."""
    t_by_id = {i: s for s, i in target_vocab.items()}
    d_by_id = {i: s for s, i in draft_vocab.items()}
    for i in sorted(set(t_by_id) | set(d_by_id)):
        if t_by_id.get(i) != d_by_id.get(i):
            return f"id {i}: target {t_by_id.get(i)!r} vs draft {d_by_id.get(i)!r}"
    return "the vocabularies have the same tokens but different fingerprints"


def _check_shared_vocabulary(b: Bundle) -> None:
    """Draft and target must map tokens to ids identically (padding beyond vocab_size is fine)."""
    if b.draft is None:
        return
    t, d = b.target, b.draft
    for spec in (t, d):
        if spec.logits_width < b.tokenizer.vocab_size:
            raise BundleError(f"the {spec.role} model's logits width {spec.logits_width} is smaller than the "
                              f"tokenizer's {b.tokenizer.vocab_size} tokens; it was exported with another tokenizer")
    if t.vocab_sha256 and d.vocab_sha256 and t.vocab_sha256 == d.vocab_sha256:
        return
    if t.tokenizer_file is None or d.tokenizer_file is None:
        if t.vocab_sha256 != d.vocab_sha256:
            raise BundleError("draft and target vocabularies differ (fingerprints do not match); "
                              "export a draft that shares the target's tokenizer")
        return
    from tokenizers import Tokenizer
    tv = Tokenizer.from_file(str(t.tokenizer_file)).get_vocab(with_added_tokens=True)
    dv = Tokenizer.from_file(str(d.tokenizer_file)).get_vocab(with_added_tokens=True)
    if tv != dv:
        raise BundleError(f"draft and target tokenizers differ at {first_vocab_difference(tv, dv)}; "
                          "export a draft that shares the target's tokenizer")


def read_bundle(path: str | os.PathLike | None = None) -> Bundle:
    """Read and validate a bundle directory; raises BundleError with a one-line fix."""
    is_default = path is None
    bundle = Path(path) if path is not None else default_bundle_path()
    manifest_path = bundle / "spectr.json"
    if not manifest_path.is_file():
        hint = BUILD_DEFAULT_HINT if is_default else "build one with: spectr-edge export ... --out DIR"
        what = "the default bundle" if is_default else "a bundle"
        raise BundleError(f"{what} was not found at {bundle} (no spectr.json); {hint}")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleError(f"{manifest_path} is not valid JSON ({err}); re-export the bundle") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{manifest_path} is not a spectr-edge manifest; re-export the bundle")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BundleError(f"{manifest_path} has format version {manifest.get('format_version')}, this "
                          f"spectr-edge reads version {FORMAT_VERSION}; re-export the bundle")
    return bundle_from_manifest(bundle, manifest)


def bundle_from_manifest(bundle: Path, manifest: dict) -> Bundle:
    """The Bundle that `manifest` describes for the files in `bundle` (read_bundle's checks after the JSON)."""
    bundle = Path(bundle)
    models = _require(manifest, "models", "the manifest")
    target = _model_spec(bundle, "target", _require(models, "target", "models"))
    draft = _model_spec(bundle, "draft", models["draft"]) if models.get("draft") else None
    b = Bundle(path=bundle, name=str(manifest.get("name", bundle.name)),
               tokenizer=_tokenizer_spec(bundle, _require(manifest, "tokenizer", "the manifest")),
               target=target, draft=draft, manifest=manifest, lookup_table=_lookup_table(bundle, manifest))
    _check_shared_vocabulary(b)
    return b
