"""The Python API: `load()` a bundle, then `generate` / `stream` a prompt, `chat` / `chat_stream` a
conversation (OpenAI-style messages), `generate_ids` raw token ids; `agenerate`, `astream`, `achat`,
`achat_stream` for asyncio applications.

One Generator may be used from several threads: generations take turns (a lock is held from a
generation's first step to its end), so each sees the models alone. Between generations it keeps
the KV caches of the latest ones (prefix_cache.py): a conversation's next turn prefills only what
it adds."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import zipfile
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from . import options as check
from .bundle import Bundle, read_bundle
from .engine import Engine
from .errors import BundleError, InputError
from .huge_pages import back_with_huge_pages
from .ngram_table import NgramTable
from .onnx_model import OnnxLM, TensorRTSettings
from .options import DEFAULT_MAX_NEW_TOKENS, DecodeOptions, resolve, tuned_options  # noqa: F401 (API)
from .policy import CostCurve, default_draft_cost
from .prefix_cache import PrefixCache
from .recording import Recorder
from .stats import GenerationStats
from .text import TextCodec, TextStream


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


class Generator:
    """A loaded bundle: target (and draft) sessions, tokenizer, and the decoding engine.

    Options of generate / stream / generate_ids (docs/OPTIONS.md): max_new_tokens, temperature,
    top_k, top_p, seed (or rng), and the speculation options of DecodeOptions: drafter,
    num_candidates, branches, lookup_candidates, draft_len, draft_stop, adaptive, tree_budget,
    draft_window. Unset speculation options come from the bundle (what `spectr-edge tune` chose, else
    built-in defaults)."""

    def __init__(self, bundle: Bundle, provider: str = "auto", draft_provider: str | None = None,
                 threads: int | None = None, load_draft: bool = True, tensorrt: TensorRTSettings | None = None,
                 prefix_cache: bool | PrefixCache = True, record: str | os.PathLike | Recorder | None = None,
                 huge_pages: bool | None = None):
        threads = check.threads(threads)
        # by default only for quantized targets: their decode gains most, and a float32 target's 6 GB take
        # 7-10 s to move for <= 1.05x
        huge_pages = bundle.target.quant != "none" if huge_pages is None else check.flag(huge_pages, "huge_pages")
        self.bundle = bundle
        self.codec = TextCodec(bundle.tokenizer)
        self.target = OnnxLM(bundle.target, provider, threads, tensorrt=tensorrt)
        self.draft = None
        if load_draft and bundle.draft is not None:
            self.draft = OnnxLM(bundle.draft, draft_provider or provider, threads, spinning=False, tensorrt=tensorrt)
        if huge_pages and "CPU" in (self.target.provider, getattr(self.draft, "provider", None)):
            back_with_huge_pages()      # the CPU sessions' weights in 2 MiB pages (huge_pages.py)
        target_entry = bundle.manifest["models"]["target"]
        cost = CostCurve.for_quant(bundle.target.quant, target_entry.get("cost_curve"))
        draft_cost, draft_rows = None, None
        if bundle.draft is not None:
            draft_entry = bundle.manifest["models"]["draft"]
            draft_cost = draft_entry.get("decode_cost")   # measured by `tune`
            if draft_cost is None:
                draft_cost = default_draft_cost(bundle.target.size_bytes, bundle.draft.size_bytes)
            draft_rows = CostCurve.for_quant(bundle.draft.quant, draft_entry.get("decode_rows_curve"))
        self.engine = Engine(self.target, self.draft, bundle.tokenizer.vocab_size, cost, draft_cost or 0.15,
                             draft_rows)
        self.engine.eos_ids = frozenset(bundle.tokenizer.eos_token_ids)
        # keep the latest generations' caches (True: the defaults; a PrefixCache: its bounds; False: none)
        self.engine.prefixes = prefix_cache if isinstance(prefix_cache, PrefixCache) else \
            (PrefixCache() if check.flag(prefix_cache, "prefix_cache") else None)
        if record is not None:          # opt-in: the target's top-k log-probabilities of every generation
            self.engine.recorder = record if isinstance(record, Recorder) else \
                Recorder(record, bundle.tokenizer.vocab_size, bundle.tokenizer.vocab_sha256)
        self._lock = threading.Lock()
        head = bundle.manifest.get("guess_head")
        chain = head.get("chain") if isinstance(head, dict) else None
        agreement = chain.get("heldout_agreement") if isinstance(chain, dict) else None
        if self.target.chain is not None and isinstance(agreement, list) and \
                all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in agreement):
            self.engine.chain_prior = [float(a) for a in agreement]
        if bundle.lookup_table is not None:
            try:
                self.engine.lookup_table = NgramTable.load(bundle.lookup_table)
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
                raise BundleError(f"the lookup table {bundle.lookup_table} is corrupt ({err}); rebuild it with "
                                  "spectr-edge export --add-lookup-table --out BUNDLE") from None

    # -- the three entry points ---------------------------------------------------------------
    def generate(self, prompt: str, **options) -> GenerationResult:
        """Generate a completion of `prompt` (chat template applied when the bundle has one)."""
        result = GenerationResult("", [])
        for _ in self._stream(prompt, result, **options):
            pass
        return result

    def stream(self, prompt: str, result: GenerationResult | None = None, **options) -> Iterator[str]:
        """Yield pieces of text as they are generated; same options as `generate`.

        Pass a GenerationResult to have it filled in (token ids, text, stats) as the stream runs."""
        yield from self._stream(prompt, result if result is not None else GenerationResult("", []), **options)

    def chat(self, messages: list[dict], **options) -> GenerationResult:
        """The assistant's next message after `messages` ([{"role": "system" | "user" | "assistant",
        "content": str}, ...], rendered with the bundle's chat template); same options as `generate`."""
        result = GenerationResult("", [])
        for _ in self._text(self._chat_ids(messages), result, **options):
            pass
        return result

    def chat_stream(self, messages: list[dict], result: GenerationResult | None = None, **options) -> Iterator[str]:
        """`chat` as pieces of text as they are generated."""
        yield from self._text(self._chat_ids(messages), result if result is not None else GenerationResult("", []),
                              **options)

    # -- asyncio: the same calls, each step run in a worker thread ------------------------------
    async def agenerate(self, prompt: str, **options) -> GenerationResult:
        result = GenerationResult("", [])
        async for _ in self.astream(prompt, result, **options):
            pass
        return result

    def astream(self, prompt: str, result: GenerationResult | None = None, **options):
        return _async_iter(self.stream(prompt, result, **options))

    async def achat(self, messages: list[dict], **options) -> GenerationResult:
        result = GenerationResult("", [])
        async for _ in self.achat_stream(messages, result, **options):
            pass
        return result

    def achat_stream(self, messages: list[dict], result: GenerationResult | None = None, **options):
        return _async_iter(self.chat_stream(messages, result, **options))

    def generate_ids(self, prompt_ids: list[int], **options) -> GenerationResult:
        """Generate from raw token ids (no chat template, no stop strings); text is decoded for convenience."""
        result = GenerationResult("", [])
        prompt_ids = check.token_ids(prompt_ids, self.bundle.tokenizer.vocab_size)
        for tokens in self._run(prompt_ids, result.stats, **options):
            result.token_ids.extend(tokens)
        result.text = self.codec.decode(result.token_ids)
        return result

    def options(self, **options) -> DecodeOptions:
        """The DecodeOptions a generation with these options would use (checked and resolved)."""
        return resolve(self.bundle, has_draft=self.draft is not None, target_tree=self.target.takes_tree,
                       draft_tree=self.draft is not None and self.draft.takes_tree,
                       min_call_tokens=self.target.spec.min_call_tokens, **options)

    # -- internals ----------------------------------------------------------------------------
    def _stream(self, prompt: str, result: GenerationResult, *, chat: bool | None = None,
                **options) -> Iterator[str]:
        if not isinstance(prompt, str):
            raise InputError("the prompt must be a string; use generate_ids for token ids")
        if chat is not None:
            check.flag(chat, "chat")
        yield from self._text(self.codec.encode_prompt(prompt, chat), result, **options)

    def _chat_ids(self, messages) -> list[int]:
        return self.codec.encode_chat(check.messages(messages))

    def _text(self, prompt_ids: list[int], result: GenerationResult, *, stop: tuple[str, ...] | list[str] | str = (),
              **options) -> Iterator[str]:
        """Generate after prompt_ids, as text pieces that are safe to show (stop strings held back)."""
        text = TextStream(self.codec, check.stop_strings(stop))
        steps = self._run(prompt_ids, result.stats, **options)
        try:
            for tokens in steps:
                result.token_ids.extend(tokens)
                piece = text.push(tokens)
                if piece:
                    yield piece
                if text.stopped:
                    break
        finally:
            steps.close()   # settles the timing stats even when a stop string ended it early
        if text.stopped:
            result.stats.stop_reason = "stop"
            result.token_ids[:] = text.kept_ids()    # the stop string's tokens are not part of the output
        piece = text.flush()
        result.text = text.text
        if piece:
            yield piece

    def _run(self, prompt_ids: list[int], stats: GenerationStats, *, seed=None,
             rng: np.random.Generator | None = None, **options) -> Iterator[list[int]]:
        if not prompt_ids:
            raise InputError("the prompt is empty; pass at least one token")
        opts = self.options(**options)
        context = self.engine.context_length
        if len(prompt_ids) >= context:
            raise InputError(f"the prompt is {len(prompt_ids)} tokens but the context is {context}; "
                             "shorten the prompt")
        rng = rng if rng is not None else np.random.default_rng(check.seed(seed))
        stats.prompt_tokens = len(prompt_ids)
        with self._lock:                 # one generation at a time on these sessions and caches
            models = [m for m in (self.target, self.draft) if m is not None]
            before = [m.seconds for m in models]
            started = time.perf_counter()
            steps = self.engine.run(prompt_ids, opts, rng, stats)
            try:
                for tokens in steps:
                    if stats.new_tokens == 0:
                        stats.seconds_first_token = time.perf_counter() - started
                    stats.new_tokens += len(tokens)
                    yield tokens
            finally:
                steps.close()            # the engine keeps this generation's caches for the next prompt
                stats.seconds_total = time.perf_counter() - started
                stats.seconds_target = self.target.seconds - before[0]
                if self.draft is not None:
                    stats.seconds_draft = self.draft.seconds - before[1]


async def _async_iter(sync_iter):
    """An async iterator over a blocking one: each next() runs in a worker thread, so the event loop
    serves other requests meanwhile; closing it (a client gone) stops the generation between steps."""
    done = object()
    try:
        while True:
            item = await asyncio.to_thread(next, sync_iter, done)
            if item is done:
                return
            yield item
    finally:
        await asyncio.to_thread(sync_iter.close)


def load(path: str | os.PathLike | None = None, provider: str = "auto", draft_provider: str | None = None,
         threads: int | None = None, load_draft: bool = True, tensorrt: TensorRTSettings | None = None,
         prefix_cache: bool | PrefixCache = True, record: str | os.PathLike | Recorder | None = None,
         huge_pages: bool | None = None) -> Generator:
    """Load a bundle (default: models/default) with the given execution providers (per model: the draft
    may run on another device than the target); tensorrt: engine cache, fp16, workspace; prefix_cache:
    keep recent generations' KV caches for prompts that extend them (False: off; a PrefixCache: its
    bounds); record: a directory where every generation's token ids and the target's top-k
    log-probabilities are appended (recording.py: the teacher signal a draft can be adapted on), or a
    Recorder; huge_pages: hold the CPU sessions' weights in 2 MiB pages (Linux 6.1+, best effort;
    huge_pages.py; None, the default: for quantized targets only)."""
    return Generator(read_bundle(path), provider, draft_provider, threads, load_draft, tensorrt, prefix_cache,
                     record, huge_pages)
