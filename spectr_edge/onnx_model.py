"""The one module that talks to ONNX Runtime: providers, session options, and a model's forward call.

A model is an exported causal LM with KV-cache I/O (names from the manifest, see docs/BUNDLE.md).
`OnnxLM.forward` feeds new tokens after the cached past and replaces the cache with `present`.
"""

from __future__ import annotations

import ctypes
import sys
import time

import numpy as np
import onnxruntime as ort

from .bundle import ModelSpec
from .errors import BundleError, ProviderError
from .kv_cache import BufferKVCache, KVCache

PROVIDER_NAMES = ("auto", "cpu", "cuda", "tensorrt")
_ORT = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
        "tensorrt": "TensorrtExecutionProvider"}
_fallback_reported = False
LOGITS_KEEP = "logits_keep"    # the graph input export/logits_keep.py adds


def _gpu_driver_present() -> bool:
    """True when the CUDA driver library loads (onnxruntime-gpu lists CUDA even without a GPU)."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def available_providers() -> list[str]:
    """Providers usable on this machine, in our spelling, best first."""
    built = set(ort.get_available_providers())
    usable = []
    if _gpu_driver_present():
        usable += [name for name in ("tensorrt", "cuda") if _ORT[name] in built]
    return usable + ["cpu"]


def provider_chain(provider: str) -> list[str]:
    """ONNX Runtime provider list for one of PROVIDER_NAMES (TensorRT falls back to CUDA, CUDA to CPU per node)."""
    if provider not in PROVIDER_NAMES:
        raise ProviderError(f"unknown provider '{provider}'; choose one of {', '.join(PROVIDER_NAMES)}")
    usable = available_providers()
    if provider == "auto":
        global _fallback_reported
        if usable[0] == "cpu" and not _fallback_reported:
            _fallback_reported = True
            print("spectr-edge: no GPU provider available (TensorRT, CUDA); running on CPU", file=sys.stderr)
        provider = usable[0]
    elif provider not in usable:
        raise ProviderError(f"provider '{provider}' was requested but is not available on this machine "
                            f"(available: {', '.join(usable)}); use --provider auto or cpu")
    chain = {"tensorrt": ["tensorrt", "cuda", "cpu"], "cuda": ["cuda", "cpu"], "cpu": ["cpu"]}[provider]
    return [_ORT[name] for name in chain]


def _session_options(threads: int | None, spinning: bool) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
    if not spinning:
        # the draft alternates with the target on the same cores: a spinning draft pool steals them
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def call_tokens(spec: ModelSpec, new: int) -> int:
    """How many tokens a batch-1 call scoring `new` tokens really scores: at least min_call_tokens,
    rounded up to a multiple of call_multiple (see ModelSpec; the rest is padding)."""
    want = max(new, spec.min_call_tokens)
    return -(-want // spec.call_multiple) * spec.call_multiple


class OnnxLM:
    """One exported causal LM in one ONNX Runtime session."""

    def __init__(self, spec: ModelSpec, provider: str = "auto", threads: int | None = None,
                 spinning: bool = True):
        self.spec = spec
        chain = provider_chain(provider)
        try:
            self.session = ort.InferenceSession(str(spec.file), _session_options(threads, spinning),
                                                providers=chain)
        except Exception as err:  # onnxruntime raises its own Fail/InvalidProtobuf/NoSuchFile types
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise BundleError(f"the {spec.role} model {spec.file} could not be loaded, it is corrupt or "
                              f"truncated ({first[:200]}); re-export the bundle") from None
        if self.session.get_providers()[0] != chain[0]:
            raise ProviderError(f"onnxruntime could not start {chain[0]} for the {spec.role} model "
                                f"(got {self.session.get_providers()[0]}); use --provider cpu")
        self.provider = chain[0].replace("ExecutionProvider", "")
        self._check_io()
        # fed whenever the graph has it: an upgrade interrupted before its manifest write leaves it undeclared
        names = {i.name for i in self.session.get_inputs()}
        self.logits_keep = spec.logits_keep or (LOGITS_KEEP if LOGITS_KEEP in names else None)
        self._output_names = [spec.logits] + [n for kv in spec.present for n in kv]
        if spec.guess:
            self._output_names.append(spec.guess)
        # guess_ids of the latest call # [batch, rows], aligned with the logits it returned (None
        # without a guess head): row i's guess for the token after the one row i's logits choose
        self.guess: np.ndarray | None = None
        self.dtype = np.float16 if spec.dtype == "float16" else np.float32
        self.seconds = 0.0   # wall time spent inside session.run
        self.calls = 0

    def _check_io(self) -> None:
        spec = self.spec
        have_in = {i.name for i in self.session.get_inputs()}
        have_out = {o.name for o in self.session.get_outputs()}
        want_in = [spec.input_ids] + [n for kv in spec.past for n in kv]
        want_in += [n for n in (spec.attention_mask, spec.tree_mask, spec.logits_keep) if n]
        if spec.position_ids:
            want_in.append(spec.position_ids)
        missing = [n for n in want_in if n not in have_in]
        missing += [n for n in [spec.logits] + [n for kv in spec.present for n in kv] if n not in have_out]
        if spec.guess and spec.guess not in have_out:
            raise BundleError(f"the {spec.role} graph lacks the '{spec.guess}' output its manifest declares; "
                              "re-run spectr-edge export --add-guess-head on the bundle")
        if missing or len(spec.past) != spec.num_layers:
            raise BundleError(f"the {spec.role} graph lacks the expected KV-cache inputs/outputs "
                              f"({', '.join(missing[:3]) or 'layer count'}); export it with a KV cache "
                              "(task text-generation-with-past) via spectr-edge export")

    @property
    def in_place(self) -> bool:
        """Whether caches live in buffers the fused attention updates in place (CPU, "gqa" graphs)."""
        return self.spec.attention == "gqa" and self.provider == "CPU"

    def new_cache(self) -> KVCache | BufferKVCache:
        cls = BufferKVCache if self.in_place else KVCache
        return cls(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, self.dtype)

    @property
    def takes_tree(self) -> bool:
        """Whether the graph takes a 4D attention mask, so one call can score a token tree."""
        return bool(self.spec.tree_mask) and self.spec.position_ids is not None

    def forward(self, input_ids: np.ndarray, cache: KVCache, tree: np.ndarray | None = None,
                depth: np.ndarray | None = None, past_mask: np.ndarray | None = None,
                last: int | None = None) -> np.ndarray:
        """Score `input_ids` # [batch, new] after the cache; returns logits # [batch, new, logits_width].

        last: the caller needs the logits of the last `last` positions only (a prefill needs one);
        graphs with a logits_keep input then skip the LM head for the others and return
        # [batch, r, logits_width] with last <= r <= new (r > last only where the kernels need
        more rows for their numerics, see call_tokens), so index from the end. Other graphs
        return every position.

        The cache must have the same batch; it is replaced by the call's `present` (past + new positions).
        tree # [new, new] bool (batch 1, graphs with a tree mask only): tree[i, j] = new token i
        attends to new token j (its ancestors and itself); depth # [new]: position = past + depth
        (may be negative: a draft tree's nodes sit after other branches in the cache).
        past_mask # [new, past] bool: which cached positions each new token sees (default: all;
        a tree drafted over several calls hides the other branches' cached nodes).
        Without a tree the new tokens are causal, as in plain decoding.
        """
        spec = self.spec
        batch, new = input_ids.shape
        pad = call_tokens(spec, new) - new if batch == 1 else 0
        if pad > 0:
            return self._forward_padded(input_ids, cache, tree, depth, pad, past_mask, last)
        past = cache.length
        feeds = {spec.input_ids: np.ascontiguousarray(input_ids, dtype=np.int64)}
        if self.logits_keep:
            rows = new if last is None else min(new, call_tokens(spec, last) if batch == 1 else last)
            feeds[self.logits_keep] = np.asarray([rows], dtype=np.int64)          # [1]
        if spec.tree_mask:
            if tree is None:
                tree = np.tri(new, dtype=bool)                                  # causal
            mask = np.ones((batch, 1, new, past + new), dtype=bool)             # [batch, 1, new, past + new]
            mask[:, 0, :, past:] = tree
            if past_mask is not None:
                mask[:, 0, :, :past] = past_mask
            feeds[spec.tree_mask] = mask
        elif tree is not None or past_mask is not None:
            raise ValueError("this graph takes no tree mask; export it with one to verify a token tree")
        if spec.attention_mask:
            feeds[spec.attention_mask] = np.ones((batch, past + new), dtype=np.int64)  # [batch, past + new]
        if spec.position_ids:
            offsets = np.arange(new) if depth is None else np.asarray(depth)
            positions = (past + offsets).astype(np.int64)
            feeds[spec.position_ids] = np.broadcast_to(positions, (batch, new)).copy()  # [batch, new]
        if isinstance(cache, BufferKVCache):
            return self._forward_in_place(feeds, cache, new)
        for (k_name, v_name), (k, v) in zip(spec.past, cache.layers):
            feeds[k_name], feeds[v_name] = k, v
        started = time.perf_counter()
        outputs = self.session.run(self._output_names, feeds)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        cache.replace([(outputs[1 + 2 * i], outputs[2 + 2 * i]) for i in range(spec.num_layers)])
        if spec.guess:
            self.guess = outputs[-1]
        return self._checked(outputs[0])

    def _checked(self, logits: np.ndarray) -> np.ndarray:
        """The call's logits, refused when any is NaN or +inf (max propagates both; one pass): corrupt
        weights would otherwise decode as garbage, or fail deep inside sampling."""
        if logits.size and not np.isfinite(logits.max()):
            raise BundleError(f"the {self.spec.role} model {self.spec.file.name} computed non-finite logits (NaN or "
                              "inf): its weights are likely corrupt; re-export the bundle")
        return logits

    def _forward_padded(self, input_ids, cache, tree, depth, pad: int, past_mask=None,
                        last: int | None = None) -> np.ndarray:
        """Score `new` tokens in a call of new + pad rows, then drop the padding's logits and cache.

        For graphs whose kernels take another path (other rounding) for a 1-token call than for
        longer ones, or for the lone last row of an odd-sized call (call_tokens): every call then
        computes the same numerics, so a token's logits do not depend
        on whether it was decoded alone or verified in a block, and greedy equality is exact.
        The padding repeats the last token after the real ones; causal attention keeps the real
        rows from seeing it.
        """
        new = input_ids.shape[1]
        ids = np.concatenate([input_ids, np.repeat(input_ids[:, -1:], pad, axis=1)], axis=1)
        if tree is not None or depth is not None:
            full = np.tri(new + pad, dtype=bool)
            if tree is not None:
                full[:new, :new] = tree
            offsets = np.arange(new) if depth is None else np.asarray(depth)
            depth = np.concatenate([offsets, offsets[-1] + 1 + np.arange(pad)])
            tree = full
        if past_mask is not None:
            past_mask = np.concatenate([past_mask, np.ones((pad, past_mask.shape[1]), dtype=bool)])
        length = cache.length
        logits = self.forward(ids, cache, tree, depth, past_mask, None if last is None else last + pad)
        cache.crop(length + new)
        if self.guess is not None:
            self.guess = self.guess[:, :self.guess.shape[1] - pad]
        return logits[:, :logits.shape[1] - pad]

    def _forward_in_place(self, feeds: dict, cache: BufferKVCache, new: int) -> np.ndarray:
        """One call whose past inputs and present outputs are the same cache buffers (I/O binding).

        The graph's GroupQueryAttention reads positions below past + new (from the tree mask's
        width) and writes the new ones at past..past + new - 1, in place.
        """
        if new > 1 and cache.batch > 1 and cache.length:
            raise ValueError("a fused-attention graph scores several new tokens after a past in batch 1 only")
        cache.reserve(cache.length + new)
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        binding.bind_output(self.spec.logits, "cpu")
        if self.spec.guess:
            binding.bind_output(self.spec.guess, "cpu")
        values = cache.ort_values()
        for i, (k_name, v_name) in enumerate(self.spec.past):
            binding.bind_ortvalue_input(k_name, values[2 * i])
            binding.bind_ortvalue_input(v_name, values[2 * i + 1])
        for i, (k_name, v_name) in enumerate(self.spec.present):
            binding.bind_ortvalue_output(k_name, values[2 * i])
            binding.bind_ortvalue_output(v_name, values[2 * i + 1])
        started = time.perf_counter()
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        logits = outputs[0].numpy()
        if self.spec.guess:
            self.guess = outputs[1].numpy()
        self.seconds += time.perf_counter() - started
        self.calls += 1
        cache.advance(new)
        return self._checked(logits)
