"""Tokenizer facts for the manifest, read from a model directory without torch or transformers.

    read_tokenizer(dir)          -> TokenizerInfo (vocab, bos/eos, add_bos, chat template, end of turn)
    check_same_vocab(t, d)       ExportError naming the first id where draft and target differ
    vocab_sha256(vocab)          sha256 of json.dumps(sorted(vocab.items())) (docs/BUNDLE.md)
    neutral_tokenizer_json(dir)  tokenizer.json text whose post-processor adds no special tokens

General rules, applied to every source (never by model name), for GGUF conversions such as
SmolLM2's that come out with bos = eos = <|im_start|> and add_bos_token = True:
  * the chat template is rendered on a two-turn conversation; the special token that follows
    a message's content is the end-of-turn token, and it joins the eos ids;
  * if the rendered conversation holds the bos text more than once, bos is a per-turn marker,
    not a sequence start: add_bos_token becomes False (a chat prompt gets exactly one opener);
  * eos ids = generation_config eos ids (else config.json's) + the tokenizer's eos + end of turn,
    except an eos text that is the per-turn bos marker (it is replaced by the end-of-turn token);
  * vocab_size ends before a trailing run of placeholder ids "[PAD<id>]" (llama.cpp fills the gap
    up to the embedding size with them; no text encodes to them), as real Qwen's 151665 < 151936.
The bundle's tokenizer.json adds no special tokens itself: the manifest's add_bos_token is the
only rule, so encode(chat_prompt) yields exactly the prompt's tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spectr_edge.bundle import first_vocab_difference, vocab_sha256  # shared with the load-time check
from spectr_edge.chat_template import ChatTemplate
from spectr_edge.errors import ExportError

_PROBE = [{"role": "user", "content": "SPECTRUSERPROBE"}, {"role": "assistant", "content": "SPECTRASSTPROBE"}]


@dataclass
class TokenizerInfo:
    tokenizer_json: Path
    vocab: dict[str, int]  # token -> id, added tokens included
    vocab_size: int  # max id + 1
    vocab_sha256: str
    bos_token: str | None
    bos_token_id: int | None
    add_bos_token: bool
    eos_token: str | None
    eos_token_ids: list[int]
    pad_token: str | None
    chat_template: str | None
    end_of_turn: str | None
    config: dict  # tokenizer_config.json with the fixes above applied
    notes: list[str]  # what was fixed, for the log


def _vocab_size(vocab: dict[str, int]) -> int:
    """1 + the largest id that is not part of a trailing run of "[PAD<id>]" placeholders."""
    by_id = {i: t for t, i in vocab.items()}
    size = max(by_id) + 1
    while size - 1 in by_id and by_id[size - 1] == f"[PAD{size - 1}]":
        size -= 1
    return size


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except ValueError as e:
        raise ExportError(f"{path} is not valid JSON ({e}); re-export or fix the model directory") from None


def _text(tok) -> str | None:
    """A special token as stored by transformers: a string, an AddedToken dict, or null."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _chat_template(d: Path, cfg: dict) -> str | None:
    tpl = cfg.get("chat_template")
    if tpl is None and (d / "chat_template.jinja").exists():
        tpl = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if tpl is None and (d / "chat_template.json").exists():
        tpl = _json(d / "chat_template.json").get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool, **special) -> str:
    """Render a HF chat template the way transformers does, in the runtime's own environment
    (spectr_edge/chat_template.py), so a template export accepts is one the runtime can render."""
    return ChatTemplate(template).render(messages, add_generation_prompt, **special)


def _end_of_turn(rendered: str, specials: list[str]) -> str | None:
    """The special token written right after a probe message's content (e.g. <|im_end|>)."""
    for probe in ("SPECTRASSTPROBE", "SPECTRUSERPROBE"):
        at = rendered.find(probe)
        if at < 0:
            continue
        rest = rendered[at + len(probe):]
        for tok in sorted(specials, key=len, reverse=True):
            if rest.startswith(tok):
                return tok
    return None


def _post_processor_adds(pp: dict | None, token: str | None) -> bool:
    if not pp or token is None:
        return False
    if pp.get("type") == "Sequence":
        return any(_post_processor_adds(p, token) for p in pp.get("processors", []))
    if pp.get("type") == "TemplateProcessing":
        return any(item.get("SpecialToken", {}).get("id") == token for item in pp.get("single", []))
    return False


def _strip_special(pp: dict | None) -> dict | None:
    """The post-processor without TemplateProcessing steps (those only add special tokens)."""
    if not pp:
        return pp
    if pp.get("type") == "TemplateProcessing":
        return None
    if pp.get("type") == "Sequence":
        kept = [q for q in (_strip_special(p) for p in pp.get("processors", [])) if q]
        return None if not kept else kept[0] if len(kept) == 1 else {**pp, "processors": kept}
    return pp


def neutral_tokenizer_json(d: Path) -> str:
    """d/tokenizer.json with special-token post-processing removed (bos is the manifest's job)."""
    tj = _json(d / "tokenizer.json")
    tj["post_processor"] = _strip_special(tj.get("post_processor"))
    return json.dumps(tj, ensure_ascii=False, indent=2)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def read_tokenizer(d: Path) -> TokenizerInfo:
    """Everything the manifest needs about the tokenizer of model directory d (see module rules)."""
    from tokenizers import Tokenizer

    d = Path(d)
    tj_path = d / "tokenizer.json"
    if not tj_path.exists():
        raise ExportError(f"{d} has no tokenizer.json (a fast tokenizer is required); save the tokenizer with "
                          "AutoTokenizer.from_pretrained(...).save_pretrained(dir)")
    vocab = Tokenizer.from_file(str(tj_path)).get_vocab(with_added_tokens=True)
    cfg = _json(d / "tokenizer_config.json")
    smap = _json(d / "special_tokens_map.json")
    tj = _json(tj_path)
    special = lambda key: _text(cfg.get(key)) or _text(smap.get(key))  # noqa: E731
    bos, eos, pad = special("bos_token"), special("eos_token"), special("pad_token")
    template = _chat_template(d, cfg)
    added_special = [t["content"] for t in tj.get("added_tokens", []) if t.get("special")]
    notes: list[str] = []

    add_bos = cfg.get("add_bos_token")
    if add_bos is None:
        add_bos = _post_processor_adds(tj.get("post_processor"), bos)
    add_bos = bool(add_bos) and bos is not None

    end_of_turn, bos_is_turn_marker = None, False
    if template:
        try:
            rendered = render_chat(template, _PROBE, False, bos_token=bos or "", eos_token=eos or "",
                                   pad_token=pad or "", unk_token="")
            end_of_turn = _end_of_turn(rendered, added_special)
            bos_is_turn_marker = bool(bos) and rendered.count(bos) >= 2
        except Exception as e:  # a template that rejects the probe conversation: no facts from it
            notes.append(f"chat template could not render a probe conversation ({type(e).__name__}: {e})")
    if bos_is_turn_marker and add_bos:
        add_bos = False
        notes.append(f"bos {bos!r} opens every chat turn: add_bos_token set to false")

    gen = _json(d / "generation_config.json")
    eos_ids = _ids(gen.get("eos_token_id")) or _ids(_json(d / "config.json").get("eos_token_id"))
    if eos is not None and eos == bos and bos_is_turn_marker:
        notes.append(f"eos {eos!r} is the turn opener: eos_token set to {end_of_turn!r}")
        eos_ids = [i for i in eos_ids if i != vocab.get(bos)]
        eos = end_of_turn
    if eos is not None and eos in vocab and vocab[eos] not in eos_ids:
        eos_ids.append(vocab[eos])
    if end_of_turn is not None and vocab[end_of_turn] not in eos_ids:
        eos_ids.append(vocab[end_of_turn])
        notes.append(f"end-of-turn {end_of_turn!r} (id {vocab[end_of_turn]}) added to eos ids")
    if eos is None and end_of_turn is not None:
        eos = end_of_turn

    fixed = {k: v for k, v in cfg.items() if k != "added_tokens_decoder"}
    fixed.update(add_bos_token=add_bos, eos_token=eos, chat_template=template)
    for key, text in (("bos_token_id", bos), ("eos_token_id", eos)):
        if key in fixed:
            fixed[key] = vocab.get(text) if text else None
    return TokenizerInfo(
        tokenizer_json=tj_path, vocab=vocab, vocab_size=_vocab_size(vocab), vocab_sha256=vocab_sha256(vocab),
        bos_token=bos, bos_token_id=vocab.get(bos) if bos else None, add_bos_token=add_bos, eos_token=eos,
        eos_token_ids=eos_ids, pad_token=pad, chat_template=template, end_of_turn=end_of_turn, config=fixed,
        notes=notes,
    )


def check_same_vocab(target: TokenizerInfo, draft: TokenizerInfo) -> None:
    """ExportError naming the first id whose token differs between target and draft (same wording as at load)."""
    if target.vocab != draft.vocab:
        raise ExportError(f"draft and target tokenizers differ at {first_vocab_difference(target.vocab, draft.vocab)}; "
                          "export a draft that shares the target's tokenizer")
