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
    rotary: str = "unfused"               # "gqa": the attention kernel rotates query and key itself (from position_ids,
                                          # except on a call with an empty cache: positions 0 .. n - 1 there)
    min_call_tokens: int = 1              # 2: the kernels round a 1-token call differently (int4 MatMulNBits
                                          # with int8 activations), so every call scores >= 2 tokens
    call_multiple: int = 1                # 2: they also round a lone last row of an odd-sized call so
                                          # (block 128 with zero points): batch-1 calls score an even count
    logits_keep: str | None = None        # int64 [1] input: the call returns the logits of its last n positions
                                          # only (export/logits_keep.py); None: every position's
    guess: str | None = None              # int64 [batch, rows] output: per logits row, the guessed token after the
                                          # one that row chooses (export/guess_head.py); None: no guess head
    guess_state: str | None = None        # float [batch, rows, D] output: the guess head's state per row, where
                                          # its chain graph continues (None: one guess per row only)
    guess_chain: Path | None = None       # the chain graph: (state, token) -> (next state, next guessed token)


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


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               dict: "an object", list: "a list"}


class _Fields:
    """Typed reads of one JSON object of the manifest: the manifest's one schema, checked field by
    field where it is read. Every error names the field (models.target.num_layers), what it holds
    and what it should hold, and the fix."""

    def __init__(self, obj, where: str):
        if not isinstance(obj, dict):
            raise self._error(where, obj, "an object")
        self.obj, self.where = obj, where

    @staticmethod
    def _error(where: str, value, expected: str) -> BundleError:
        held = "missing" if value is _MISSING else f"{_describe(value)}"
        return BundleError(f"spectr.json field {where} is {held}; expected {expected}; "
                           "the bundle is corrupt, re-export it")

    def _get(self, key: str, required: bool):
        value = self.obj.get(key, _MISSING)
        if value is _MISSING and required:
            raise self._error(f"{self.where}.{key}", value, "a value")
        return value

    def get(self, key: str, kind: type, required: bool = True, default=None, minimum: int | None = None,
            nullable: bool = False):
        """The field `key` of type `kind` (bool is never an int here); `default` when absent (or null
        and nullable)."""
        value = self._get(key, required)
        if value is _MISSING or (value is None and (nullable or not required)):
            return default
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if ok and minimum is not None and value < minimum:
            ok = False
        if not ok:
            expected = _TYPE_NAMES.get(kind, kind.__name__) + (f" >= {minimum}" if minimum is not None else "")
            raise self._error(f"{self.where}.{key}", value, expected + (" or null" if nullable else ""))
        return value

    def sub(self, key: str, required: bool = True) -> "_Fields | None":
        value = self._get(key, required)
        if value is _MISSING or (value is None and not required):
            return None
        return _Fields(value, f"{self.where}.{key}")

    def name(self, key: str, required: bool = True) -> str | None:
        """A graph input/output name: a non-empty string."""
        value = self.get(key, str, required=required, nullable=not required)
        if value is not None and not value:
            raise self._error(f"{self.where}.{key}", value, "the name of one of the graph's inputs or outputs")
        return value

    def name_pairs(self, key: str) -> tuple[tuple[str, str], ...]:
        """Per layer (key name, value name)."""
        value = self.get(key, list)
        if not value or not all(isinstance(kv, list) and len(kv) == 2 and all(isinstance(n, str) and n for n in kv)
                                for kv in value):
            raise self._error(f"{self.where}.{key}", value, "a list of [key name, value name] pairs, one per layer")
        return tuple((k, v) for k, v in value)

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.get(key, list, required=False, default=[])
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
            raise self._error(f"{self.where}.{key}", value, "a list of token ids")
        return tuple(value)


_MISSING = object()


def _describe(value) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else type(value).__name__
    kind = "null" if value is None else _TYPE_NAMES.get(type(value), type(value).__name__)
    return text if value is None else f"{text[:40]} ({kind})"


def _model_spec(bundle: Path, role: str, f: _Fields) -> ModelSpec:
    where = f.where
    model_file = _inside(bundle, f.get("file", str), f"{where}.file")
    if not model_file.is_file():
        raise BundleError(f"the {role} model file {model_file} is missing; re-export the bundle")
    inputs, outputs = f.sub("inputs"), f.sub("outputs")
    tok = f.get("tokenizer_file", str, required=False)
    tree_mask = _tree_mask(f.obj.get("tree_mask"), where)
    spec = ModelSpec(
        role=role, file=model_file,
        tokenizer_file=_inside(bundle, tok, f"{where}.tokenizer_file") if tok else None,
        vocab_sha256=f.get("vocab_sha256", str, required=False),
        quant=_choice(f, "quant", ("none", "int8", "int4", "w8a8"), "none"),
        dtype=_choice(f, "dtype", ("float32", "float16"), "float32"),
        num_layers=f.get("num_layers", int, minimum=1), num_kv_heads=f.get("num_kv_heads", int, minimum=1),
        head_dim=f.get("head_dim", int, minimum=1), logits_width=f.get("logits_width", int, minimum=1),
        context_length=f.get("context_length", int, minimum=2),
        input_ids=inputs.name("input_ids"),
        attention_mask=inputs.name("attention_mask", required=not tree_mask),
        position_ids=inputs.name("position_ids", required=False),
        past=inputs.name_pairs("past"), logits=outputs.name("logits"), present=outputs.name_pairs("present"),
        tree_mask=tree_mask, source=str(f.obj.get("source", "")),
        size_bytes=f.get("size_bytes", int, required=False, minimum=0),
        attention=_attention(f.obj.get("attention"), tree_mask, where),
        rotary=_rotary(f.obj.get("rotary"), f.obj.get("attention"), where),
        min_call_tokens=f.get("min_call_tokens", int, required=False, default=1, minimum=1),
        call_multiple=f.get("call_token_multiple", int, required=False, default=1, minimum=1),
        logits_keep=inputs.name("logits_keep", required=False),
        guess=outputs.name("guess", required=False),
        guess_state=outputs.name("guess_state", required=False),
        guess_chain=_guess_chain(bundle, f),
    )
    if len(spec.past) != spec.num_layers or len(spec.present) != spec.num_layers:
        raise BundleError(f"spectr.json {where} declares {spec.num_layers} layers but {len(spec.past)} past and "
                          f"{len(spec.present)} present pairs; the bundle is corrupt, re-export it")
    _check_file_sizes(bundle, role, f, model_file)
    return spec


def _guess_chain(bundle: Path, f: _Fields) -> Path | None:
    rel = f.get("guess_chain", str, required=False)
    if rel is None:
        return None
    path = _inside(bundle, rel, f"{f.where}.guess_chain")
    if not path.is_file():
        raise BundleError(f"the guess head's chain graph {path} is missing; re-run spectr-edge export "
                          "--add-guess-head on the bundle")
    if "guess_state" not in f.obj.get("outputs", {}):
        raise BundleError(f"spectr.json {f.where}.guess_chain needs the outputs.guess_state it continues from; "
                          "re-run spectr-edge export --add-guess-head on the bundle")
    return path


def _choice(f: _Fields, key: str, allowed: tuple[str, ...], default: str) -> str:
    value = f.get(key, str, required=False, default=default)
    if value not in allowed:
        raise f._error(f"{f.where}.{key}", value, "one of " + ", ".join(allowed))
    return value


def _check_file_sizes(bundle: Path, role: str, f: _Fields, model_file: Path) -> None:
    """The model's directory holds at least `size_bytes` (the graph and its external weights, as
    the export recorded them): a truncated copy fails here, before ONNX Runtime reads it."""
    expected = f.get("size_bytes", int, required=False)
    if expected is None:
        return
    files = [p for p in model_file.parent.iterdir() if p.is_file() and p.suffix not in (".json", ".txt")]
    found = sum(p.stat().st_size for p in files)
    if found < expected:
        raise BundleError(f"the {role} model {model_file} and its weights hold {found} bytes but spectr.json "
                          f"records {expected}: a file is corrupt or truncated; re-export the bundle")


def _attention(value, tree_mask, where: str) -> str:
    if value in (None, "unfused"):
        return "unfused"
    if value != "gqa" or not tree_mask:
        raise BundleError(f"spectr.json {where}.attention is {value!r}; expected 'unfused', or 'gqa' on a graph "
                          "with a tree mask (re-export the bundle)")
    return value


def _rotary(value, attention, where: str) -> str:
    if value in (None, "unfused"):
        return "unfused"
    if value != "gqa" or attention != "gqa":
        raise BundleError(f"spectr.json {where}.rotary is {value!r}; expected 'unfused', or 'gqa' on a graph with "
                          "fused attention (re-export the bundle)")
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


def _tokenizer_spec(bundle: Path, f: _Fields) -> TokenizerSpec:
    tok_file = _inside(bundle, f.get("file", str), "tokenizer.file")
    if not tok_file.is_file():
        raise BundleError(f"the tokenizer file {tok_file} is missing; re-export the bundle")
    special = f.get("special_tokens", dict, required=False, default={})
    if not all(isinstance(v, str) or v is None for v in special.values()):
        raise f._error("tokenizer.special_tokens", special, "an object of token strings")
    return TokenizerSpec(
        file=tok_file, vocab_size=f.get("vocab_size", int, minimum=1),
        vocab_sha256=f.get("vocab_sha256", str, required=False),
        bos_token_id=f.get("bos_token_id", int, required=False, minimum=0, nullable=True),
        add_bos_token=f.get("add_bos_token", bool, required=False, default=False),
        eos_token_ids=f.int_list("eos_token_ids"),
        chat_template=f.get("chat_template", str, required=False, nullable=True) or None,
        special_tokens=dict(special),
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
    top = _Fields(manifest, "(top level)")
    models = top.sub("models")
    models.where = "models"
    target = _model_spec(bundle, "target", models.sub("target"))
    draft_fields = models.sub("draft", required=False)
    draft = _model_spec(bundle, "draft", draft_fields) if draft_fields is not None and draft_fields.obj else None
    tokenizer = top.sub("tokenizer")
    tokenizer.where = "tokenizer"
    b = Bundle(path=bundle, name=str(manifest.get("name", bundle.name)),
               tokenizer=_tokenizer_spec(bundle, tokenizer),
               target=target, draft=draft, manifest=manifest, lookup_table=_lookup_table(bundle, manifest))
    _check_shared_vocabulary(b)
    return b


def check_tokenizer(spec: TokenizerSpec, vocab: dict[str, int]) -> None:
    """The bundle's tokenizer.json is the one its models were exported with: the manifest's
    vocabulary fingerprint and size. A tokenizer copied from another model would otherwise turn
    every generation into fluent-looking nonsense."""
    if spec.vocab_sha256 and vocab_sha256(vocab) != spec.vocab_sha256:
        raise BundleError(f"the tokenizer {spec.file} does not match the bundle's models (its vocabulary "
                          "fingerprint differs from spectr.json's tokenizer.vocab_sha256); restore the "
                          "exported tokenizer.json or re-export the bundle")
    size = max(vocab.values(), default=-1) + 1
    if size < spec.vocab_size:
        raise BundleError(f"the tokenizer {spec.file} has {size} ids but spectr.json says {spec.vocab_size}; "
                          "restore the exported tokenizer.json or re-export the bundle")
