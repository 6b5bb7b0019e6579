"""Property-based fuzzing of everything that enters from outside (hypothesis, fixed seeds via the
"fixed-seed" profile in conftest.py, bounded: about a minute in all).

1. `spectr-edge generate` over generated option values (numbers at and beyond every bound, NaN,
   inf, huge, negative; empty and non-UTF-8 strings): exit status 0 or 2, one `error:` line on 2,
   never a traceback, never the last-resort "internal error" line.
2. Manifests mutated field by field (type swaps, missing and extra keys, paths that escape the
   bundle, symlinks out of it): the bundle loads and generates, or loading raises a SpectrError of
   one line.
3. Bundle files corrupted (truncated or bit-flipped graphs, tokenizer, lookup table): load and a
   short generation work, or a SpectrError of one line is raised (at load, or at the first call for
   weights that turn into NaN); never another exception.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

import spectr_edge
from spectr_edge.cli import main
from spectr_edge.errors import SpectrError
from toy_lm import build_toy_bundle

def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    bundle = build_toy_bundle(tmp_path_factory.mktemp("fuzz") / "bundle", seed_target=71, seed_draft=72)
    from spectr_edge.ngram_table import write_table

    manifest = json.loads((bundle / "spectr.json").read_text())
    manifest["lookup_table"] = write_table(bundle, bundle / "tokenizer.json", 5, limit_bytes=20_000)
    (bundle / "spectr.json").write_text(json.dumps(manifest))
    return bundle


# -- 1. the command line ---------------------------------------------------------------------------------

EDGE_NUMBERS = st.sampled_from(["0", "-0", "1", "-1", "2", "1e-45", "5e-324", "1e-40", "0.5", "0.999999", "1.0000001",
                                "nan", "inf", "-inf", "1e308", "99999999999999999999", "-5", "3.7", "", "x", "1_0"])
INTS = st.one_of(st.integers(-3, 70).map(str), st.sampled_from(["12345678901234", "-99999999999", "2.5", "", "nan"]))
TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "a b c", "\udcff\udcfe hi", "a\x00b", "é ü"]))

OPTIONS = {
    "-n": INTS, "--temperature": EDGE_NUMBERS, "--top-k": INTS, "--top-p": EDGE_NUMBERS, "--seed": INTS,
    "-k": INTS, "-L": INTS, "--draft-stop": EDGE_NUMBERS, "--tree-budget": INTS, "--draft-window": INTS,
    "--threads": INTS, "--draft": st.sampled_from(["model", "lookup", "model+lookup", "", "tree"]), "--stop": TEXT,
}
FLAGS = st.sampled_from(["--no-draft", "--json", "--chat", "--no-chat", "--stats", "--adaptive", "--fixed-length"])


@st.composite
def command_lines(draw):
    args = ["generate", draw(TEXT)]
    for name in draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=5, unique=True)):
        args += [name, draw(OPTIONS[name])]
    args += draw(st.lists(FLAGS, max_size=2, unique=True))
    return args


@fuzz(300)
@given(args=command_lines())
def test_generate_never_shows_a_traceback(toy_dir, args):
    if "-n" not in args:
        args += ["-n", "6"]                       # keep each run short; -n itself is fuzzed when drawn
    result = CliRunner().invoke(main, args + ["--bundle", str(toy_dir), "--provider", "cpu"])
    err = result.stderr if result.stderr_bytes is not None else ""
    assert result.exit_code in (0, 2), (args, result.exit_code, err, result.exception)
    assert "Traceback" not in err and "internal error" not in err, (args, err)
    if result.exit_code == 2:
        assert len([line for line in err.splitlines() if line.strip().startswith("error")]) == 1 or \
            "Usage:" in err, (args, err)


# -- 2. manifests mutated field by field -----------------------------------------------------------------

def _paths(obj, prefix=()):
    """Every (path of keys/indices) in a JSON object, depth first."""
    yield prefix
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _paths(value, prefix + (i,))


SWAPS = st.sampled_from([None, 5, -1, 0, 2**63, 1.5, True, "", "x", "../../outside.onnx", "/etc/passwd", [], {},
                         [["a", "b"]], {"file": 5}])


def _load_and_generate(bundle: Path) -> None:
    try:
        gen = spectr_edge.load(bundle, provider="cpu", threads=1)
        gen.generate_ids([0, 1], max_new_tokens=3)
        gen.generate_ids([0, 1], max_new_tokens=3, drafter="lookup")
    except SpectrError as err:
        assert "\n" not in str(err) and str(err), repr(err)


@fuzz(150)
@given(data=st.data())
def test_mutated_manifests_load_or_fail_in_one_line(toy_dir, data):
    manifest = json.loads((toy_dir / "spectr.json").read_text())
    paths = [p for p in _paths(manifest) if p]
    path = data.draw(st.sampled_from(paths))
    action = data.draw(st.sampled_from(["swap", "delete", "extra"]))
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "b"
        shutil.copytree(toy_dir, bundle)
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        if action == "swap":
            parent[key] = data.draw(SWAPS)
        elif action == "delete" and isinstance(parent, dict):
            del parent[key]
        elif isinstance(parent, dict):
            parent[f"extra_{key}"] = data.draw(SWAPS)
        (bundle / "spectr.json").write_text(json.dumps(manifest))
        _load_and_generate(bundle)


@pytest.mark.parametrize("name", ["target/model.onnx", "tokenizer.json", "lookup_table.npz"])
def test_symlinks_out_of_the_bundle_are_refused(toy_dir, tmp_path, name):
    bundle = tmp_path / "b"
    shutil.copytree(toy_dir, bundle)
    outside = tmp_path / "outside"
    shutil.copy(bundle / name, outside)
    (bundle / name).unlink()
    (bundle / name).symlink_to(outside)
    with pytest.raises(SpectrError, match="points outside the bundle"):
        spectr_edge.load(bundle, provider="cpu")


# -- 3. corrupted files ----------------------------------------------------------------------------------

FILES = ["target/model.onnx", "draft/model.onnx", "tokenizer.json", "lookup_table.npz"]


@fuzz(80)
@given(name=st.sampled_from(FILES), how=st.sampled_from(["truncate", "flip"]), where=st.floats(0, 0.999),
       bit=st.integers(0, 7))
def test_corrupted_files_fail_at_load_in_one_line(toy_dir, name, how, where, bit):
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "b"
        shutil.copytree(toy_dir, bundle)
        data = bytearray((bundle / name).read_bytes())
        at = int(where * len(data))
        if how == "truncate":
            data = data[:at]
        else:
            data[at] ^= 1 << bit
        (bundle / name).write_bytes(bytes(data))
        _load_and_generate(bundle)
