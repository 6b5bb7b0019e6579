"""The one module that runs the bundle's models on ONNX Runtime: providers and their options,
session options, and a model's forward call.

A model is an exported causal LM with KV-cache I/O (names from the manifest, docs/BUNDLE.md).
`OnnxLM.forward` feeds new tokens after the cached past. Every call goes through I/O binding: the
cache stays on the model's device (kv_cache.py, device.py) and only the logits (and the guess
head's ids) are copied to the host, the same code for the CPU, CUDA and TensorRT.
"""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .bundle import ModelSpec
from .device import device_for, onnxruntime
from .errors import BundleError, ProviderError
from .kv_cache import BufferKVCache, KVCache

PROVIDER_NAMES = ("auto", "cpu", "cuda", "tensorrt")
_ORT = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
        "tensorrt": "TensorrtExecutionProvider"}
_fallback_reported = False
_dlls_preloaded = False
LOGITS_KEEP = "logits_keep"    # the graph input export/logits_keep.py adds


@dataclass(frozen=True)
class TensorRTSettings:
    """What a TensorRT user sets: where built engines are kept (the first build of a 1.5B model takes
    minutes; later sessions load it in seconds), half precision, the builder's workspace, and the
    largest call the shape profile covers (candidate rows x tokens per call)."""
    engine_cache: str = str(Path.home() / ".cache" / "spectr-edge" / "tensorrt")
    fp16: bool = True
    workspace_gb: float = 4.0
    max_rows: int = 8
    max_call_tokens: int = 64


def _gpu_driver_present() -> bool:
    """True when the CUDA driver library loads (onnxruntime-gpu lists CUDA even without a GPU)."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def _preload_gpu_libraries() -> None:
    """Load the CUDA and cuDNN libraries of the `nvidia-*` Python packages before a GPU session
    (onnxruntime-gpu >= 1.21 finds them itself this way; otherwise LD_LIBRARY_PATH must)."""
    global _dlls_preloaded
    ort = onnxruntime()
    if not _dlls_preloaded and hasattr(ort, "preload_dlls"):
        _dlls_preloaded = True
        try:
            ort.preload_dlls()
        except Exception as err:   # no nvidia-* packages: the system's libraries may still serve
            print(f"spectr-edge: note: onnxruntime.preload_dlls() failed ({err}); using the system's CUDA "
                  "libraries", file=sys.stderr)


def available_providers() -> list[str]:
    """Providers usable on this machine, in our spelling, best first."""
    built = set(onnxruntime().get_available_providers())
    usable = []
    if _gpu_driver_present():
        usable += [name for name in ("tensorrt", "cuda") if _ORT[name] in built]
    return usable + ["cpu"]


def resolve_provider(provider: str) -> str:
    """One of PROVIDER_NAMES -> the provider to run (auto: the best available, with a note when
    that is the CPU)."""
    if provider not in PROVIDER_NAMES:
        raise ProviderError(f"unknown provider '{provider}'; choose one of {', '.join(PROVIDER_NAMES)}")
    usable = available_providers()
    if provider == "auto":
        global _fallback_reported
        if usable[0] == "cpu" and not _fallback_reported:
            _fallback_reported = True
            print("spectr-edge: no GPU provider available (TensorRT, CUDA); running on CPU", file=sys.stderr)
        return usable[0]
    if provider not in usable:
        raise ProviderError(f"provider '{provider}' was requested but is not available on this machine "
                            f"(available: {', '.join(usable)}); use --provider auto or cpu")
    return provider


def provider_chain(provider: str) -> list[str]:
    """ONNX Runtime provider list (TensorRT falls back to CUDA, CUDA to CPU per node)."""
    chain = {"tensorrt": ["tensorrt", "cuda", "cpu"], "cuda": ["cuda", "cpu"], "cpu": ["cpu"]}
    return [_ORT[name] for name in chain[resolve_provider(provider)]]


def provider_options(chain: list[str], spec: ModelSpec, trt: TensorRTSettings) -> list:
    """The chain with each provider's options: TensorRT's engine cache, precision, workspace and a
    shape profile covering every call the engine makes (1..max_rows rows, 1..max_call_tokens new
    tokens, a past of 0..context positions); CUDA's copy stream shared with compute."""
    out = []
    for name in chain:
        if name == "TensorrtExecutionProvider":
            Path(trt.engine_cache).mkdir(parents=True, exist_ok=True)
            lo, opt, hi = _profile(spec, trt)
            out.append((name, {"trt_engine_cache_enable": "True", "trt_engine_cache_path": trt.engine_cache,
                               "trt_timing_cache_enable": "True", "trt_fp16_enable": str(trt.fp16),
                               "trt_max_workspace_size": str(int(trt.workspace_gb * 2**30)),
                               "trt_profile_min_shapes": lo, "trt_profile_opt_shapes": opt,
                               "trt_profile_max_shapes": hi}))
        elif name == "CUDAExecutionProvider":
            out.append((name, {"do_copy_in_default_stream": "True"}))
        else:
            out.append(name)
    return out


def _profile(spec: ModelSpec, trt: TensorRTSettings) -> tuple[str, str, str]:
    """TensorRT shape profile strings "name:dims,..." (min, opt, max) for the graph's dynamic inputs."""
    ctx = spec.context_length
    shapes = {"min": (1, 1, 0), "opt": (1, 8, 512), "max": (trt.max_rows, trt.max_call_tokens, ctx)}
    out = []
    for rows, new, past in shapes.values():
        total = past + new
        dims = {spec.input_ids: (rows, new)}
        if spec.position_ids:
            dims[spec.position_ids] = (rows, new)
        if spec.attention_mask:
            dims[spec.attention_mask] = (rows, total)
        if spec.tree_mask:
            dims[spec.tree_mask] = (rows, 1, new, total)
        cache_len = ctx if spec.attention == "gqa" else past
        for k, v in spec.past:
            dims[k] = dims[v] = (rows, spec.num_kv_heads, cache_len, spec.head_dim)
        out.append(",".join(f"{n}:{'x'.join(map(str, d))}" for n, d in dims.items()))
    return tuple(out)


def _session_options(threads: int | None, spinning: bool):
    ort = onnxruntime()
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
    """One exported causal LM in one ONNX Runtime session, its caches on the session's device."""

    def __init__(self, spec: ModelSpec, provider: str = "auto", threads: int | None = None,
                 spinning: bool = True, tensorrt: TensorRTSettings | None = None):
        self.spec = spec
        chain = provider_chain(provider)
        if chain[0] != _ORT["cpu"]:
            _preload_gpu_libraries()
        try:
            self.session = onnxruntime().InferenceSession(str(spec.file), _session_options(threads, spinning),
                                                providers=provider_options(chain, spec, tensorrt or TensorRTSettings()))
        except Exception as err:  # onnxruntime raises its own Fail/InvalidProtobuf/NoSuchFile types
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise BundleError(f"the {spec.role} model {spec.file} could not be loaded, it is corrupt or "
                              f"truncated ({first[:200]}); re-export the bundle") from None
        if self.session.get_providers()[0] != chain[0]:
            raise ProviderError(f"onnxruntime could not start {chain[0]} for the {spec.role} model "
                                f"(got {self.session.get_providers()[0]}); use --provider cpu")
        self.provider = chain[0].replace("ExecutionProvider", "")
        self.device = device_for("cpu" if chain[0] == _ORT["cpu"] else "cuda", chain)
        self._check_io()
        # fed whenever the graph has it: an upgrade interrupted before its manifest write leaves it undeclared
        names = {i.name for i in self.session.get_inputs()}
        self.logits_keep = spec.logits_keep or (LOGITS_KEEP if LOGITS_KEEP in names else None)
        self._past = [n for kv in spec.past for n in kv]
        self._present = [n for kv in spec.present for n in kv]
        # guess_ids of the latest call # [batch, rows], aligned with the logits it returned (None
        # without a guess head): row i's guess for the token after the one row i's logits choose
        self.guess: np.ndarray | None = None
        # the head's state per row of the latest call # [batch, rows, D], where its chain continues
        self.guess_state: np.ndarray | None = None
        self.chain = GuessChain(spec.guess_chain) if spec.guess_chain and spec.guess_state else None
        self.dtype = np.float16 if spec.dtype == "float16" else np.float32
        self.seconds = 0.0   # wall time spent inside session runs
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
        for declared in (spec.guess, spec.guess_state):
            if declared and declared not in have_out:
                raise BundleError(f"the {spec.role} graph lacks the '{declared}' output its manifest declares; "
                                  "re-run spectr-edge export --add-guess-head on the bundle")
        if missing or len(spec.past) != spec.num_layers:
            raise BundleError(f"the {spec.role} graph lacks the expected KV-cache inputs/outputs "
                              f"({', '.join(missing[:3]) or 'layer count'}); export it with a KV cache "
                              "(task text-generation-with-past) via spectr-edge export")

    @property
    def in_place(self) -> bool:
        """Whether caches live in buffers the fused attention updates in place ("gqa" graphs)."""
        return self.spec.attention == "gqa"

    def new_cache(self) -> KVCache | BufferKVCache:
        geometry = (self.device, self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, self.dtype)
        if self.in_place:
            return BufferKVCache(*geometry, max_capacity=self.spec.context_length)
        return KVCache(*geometry)

    @property
    def takes_tree(self) -> bool:
        """Whether the graph takes a 4D attention mask, so one call can score a token tree."""
        return bool(self.spec.tree_mask) and self.spec.position_ids is not None

    def guess_after(self, row: int, batch_row: int = 0) -> int | None:
        """The guess head's token for after the token that `row` of the latest call chose."""
        guess = self.guess
        if guess is None or not -guess.shape[1] <= row < guess.shape[1]:
            return None
        return int(guess[batch_row, row])

    def chain_after(self, row: int, guess: int, batch_row: int = 0):
        """The guess head's further guesses after `guess` (guess_after(row)), as a function of how many
        are wanted (computed on first need, each once); None without a chain graph."""
        if self.chain is None or self.guess_state is None:
            return None
        return self.chain.after(self.guess_state[batch_row, row], guess)

    def forward(self, input_ids: np.ndarray, cache: KVCache | BufferKVCache, tree: np.ndarray | None = None,
                depth: np.ndarray | None = None, past_mask: np.ndarray | None = None,
                last: int | None = None) -> np.ndarray:
        """Score `input_ids` # [batch, new] after the cache; returns logits # [batch, new, logits_width].

        last: the caller needs the logits of the last `last` positions only (a prefill needs one);
        graphs with a logits_keep input then skip the LM head for the others and return
        # [batch, r, logits_width] with last <= r <= new (r > last only where the kernels need
        more rows for their numerics, see call_tokens), so index from the end. Other graphs
        return every position.

        The cache must have the same batch; it then holds past + new positions.
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
        if self.in_place and new > 1 and cache.batch > 1 and cache.length:
            raise ValueError("a fused-attention graph scores several new tokens after a past in batch 1 only")
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
            if spec.rotary == "gqa" and past == 0 and not np.array_equal(offsets, np.arange(new)):
                raise ValueError("this graph's attention kernel places a call with an empty cache at positions "
                                 "0 .. n - 1; score a tree after a past")
            positions = (past + offsets).astype(np.int64)
            feeds[spec.position_ids] = np.broadcast_to(positions, (batch, new)).copy()  # [batch, new]
        return self._run(feeds, cache, new)

    def _run(self, feeds: dict, cache, new: int) -> np.ndarray:
        """One call through I/O binding: small inputs from the host, the cache bound on the device
        (read as past, written as present), logits (and guess ids) copied back."""
        binding = cache.binding(self.session, self._past, self._present, new)
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        binding.bind_output(self.spec.logits, self.device.kind, self.device.device_id)
        if self.spec.guess:
            binding.bind_output(self.spec.guess, self.device.kind, self.device.device_id)
        if self.chain is not None:
            binding.bind_output(self.spec.guess_state, self.device.kind, self.device.device_id)
        started = time.perf_counter()
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()       # in binding order: the presents, then logits (and guess ids)
        n = len(self._present)
        logits = self.device.fetch(outputs[n])
        if self.spec.guess:
            self.guess = self.device.fetch(outputs[n + 1])
        if self.chain is not None:
            self.guess_state = self.device.fetch(outputs[-1])
        self.seconds += time.perf_counter() - started
        self.calls += 1
        cache.commit(new)
        return self._checked(logits)

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
        computes the same numerics, so a token's logits do not depend on whether it was decoded
        alone or verified in a block, and greedy equality is exact. The padding repeats the last
        token after the real ones; causal attention keeps the real rows from seeing it.
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
        if self.guess_state is not None:
            self.guess_state = self.guess_state[:, :self.guess_state.shape[1] - pad]
        return logits[:, :logits.shape[1] - pad]


class GuessChain:
    """The guess head's chain graph (export/guess_head.py): from the head's state at a row and the
    token it guessed, the next guess and state, one small call per token (its 8-bit matmuls read
    about 7 MB for the 1.5B target: 0.5 ms on one core of an AMD EPYC Zen 3). It runs on the CPU, one thread: a call is too small to share."""

    def __init__(self, path: Path):
        ort = onnxruntime()
        opts = _session_options(1, False)
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=[_ORT["cpu"]])
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise BundleError(f"the guess head's chain graph {path} could not be loaded, it is corrupt or truncated "
                              f"({first[:200]}); re-run spectr-edge export --add-guess-head on the bundle") from None
        self.bytes = path.stat().st_size
        self.seconds = 0.0
        self.calls = 0

    def after(self, state: np.ndarray, guess: int):
        """A function n -> the n guesses after `guess` (a list; computed once, extended on demand)."""
        tokens: list[int] = []
        current = [np.ascontiguousarray(state, dtype=np.float32)[None], np.asarray([guess], dtype=np.int64)]

        def upto(n: int) -> list[int]:
            while len(tokens) < n:
                started = time.perf_counter()
                current[:] = self.session.run(None, {"state": current[0], "token": current[1]})
                self.seconds += time.perf_counter() - started
                self.calls += 1
                tokens.append(int(current[1][0]))
            return tokens[:n]

        return upto
