"""Hostile input, case by case, through the command line (a subprocess, as a user runs it) or the
Python API: every bad value gets one line naming the problem and the fix and exit status 2, or a
defined behaviour; nothing is deleted that is not a bundle; a bundle whose files do not match its
manifest is refused at load time."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import spectr_edge
from spectr_edge.errors import BundleError, InputError, SpectrError
from toy_lm import build_toy_bundle

CLI = [sys.executable, "-m", "spectr_edge.cli"]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return build_toy_bundle(tmp_path_factory.mktemp("hostile") / "bundle", seed_target=61, seed_draft=62)


@pytest.fixture(scope="module")
def gen(toy_dir):
    return spectr_edge.load(toy_dir, provider="cpu", threads=1)


def run_cli(*args, stdin: bytes | None = None, cwd=None):
    res = subprocess.run(CLI + [str(a) for a in args], capture_output=True, input=stdin, timeout=120, cwd=cwd)
    return res.returncode, res.stdout.decode("utf-8", "replace"), res.stderr.decode("utf-8", "replace")


def one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def copy_bundle(toy_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(toy_dir, dst)
    return dst


def edit_manifest(bundle, change) -> None:
    path = bundle / "spectr.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


# -- silent garbage: the bundle's tokenizer is checked against the manifest ---------------------------

def test_a_tokenizer_from_another_model_is_refused_at_load(toy_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    bundle = copy_bundle(toy_dir, tmp_path)
    other = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "v", "w", "x", "y", "z"])},
                                       unk_token="<unk>"))
    other.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other.save(str(bundle / "tokenizer.json"))           # same size, other tokens
    code, out, err = run_cli("generate", "a b", "--bundle", bundle, "--no-chat", "-n", "4")
    one_line_error(code, err, "does not match the bundle's models", "re-export")
    assert out == ""


# -- tracebacks that were: each now one line, or a defined behaviour ----------------------------------

@pytest.mark.parametrize("temperature,extra", [("1e-40", []), ("5e-324", []), ("1e-45", ["--no-draft"])])
def test_a_tiny_temperature_samples_its_limit(toy_dir, temperature, extra):
    """T -> 0+ is the argmax: the draw among the argmax ties, so greedy's tokens here."""
    greedy = json.loads(run_cli("generate", "a b", "--bundle", toy_dir, "-n", "6", "--json", "--no-draft")[1])
    code, out, err = run_cli("generate", "a b", "--bundle", toy_dir, "-n", "6", "--json", "--seed", "3",
                             "--temperature", temperature, *extra)
    assert code == 0, err
    assert json.loads(out)["token_ids"] == greedy["token_ids"]


def test_prompt_bytes_that_are_not_utf8(toy_dir):
    code, _, err = run_cli("generate", b"\xff\xfe hi".decode("utf-8", "surrogateescape"), "--bundle", toy_dir, "-n", "2")
    one_line_error(code, err, "not valid UTF-8", "0xff")
    code, _, err = run_cli("generate", "-", "--bundle", toy_dir, "-n", "2", stdin=b"\xff\xfe hi")
    one_line_error(code, err, "not valid UTF-8")
    code, out, err = run_cli("generate", "-", "--bundle", toy_dir, "-n", "2", stdin="a b".encode())
    assert code == 0, err


def test_seed_minus_one_is_a_random_seed_and_other_negatives_are_refused(toy_dir, gen):
    code, _, err = run_cli("generate", "a b", "--bundle", toy_dir, "-n", "3", "--seed", "-1", "--temperature", "1")
    assert code == 0, err
    assert len(gen.generate_ids([0, 1], max_new_tokens=3, temperature=1.0, seed=-1).token_ids) == 3
    code, _, err = run_cli("generate", "a b", "--bundle", toy_dir, "-n", "3", "--seed", "-2")
    one_line_error(code, err, "seed must be an integer >= -1", "random seed")


@pytest.mark.parametrize("change,needle", [
    (lambda m: m.update(models=5), "models is 5 (an integer); expected an object"),
    (lambda m: m.update(models=None), "models is null; expected an object"),
    (lambda m: m["models"].update(target=5), "models.target is 5 (an integer)"),
    (lambda m: m["models"]["target"].update(file=5), "models.target.file is 5 (an integer); expected a string"),
    (lambda m: m["models"]["target"].update(num_layers="2"), "models.target.num_layers"),
    (lambda m: m["models"]["target"].update(num_layers=True), "models.target.num_layers is true"),
    (lambda m: m["models"]["draft"].pop("head_dim"), "models.draft.head_dim is missing"),
    (lambda m: m["models"]["target"]["inputs"].update(past=[["a"]]), "models.target.inputs.past"),
    (lambda m: m["tokenizer"].update(eos_token_ids="2"), "tokenizer.eos_token_ids"),
    (lambda m: m["tokenizer"].update(vocab_size=-3), "tokenizer.vocab_size is -3"),
    (lambda m: m["models"]["target"].update(quant="int3"), "models.target.quant is \"int3\""),
])
def test_manifest_fields_of_the_wrong_type(toy_dir, tmp_path, change, needle):
    bundle = copy_bundle(toy_dir, tmp_path)
    edit_manifest(bundle, change)
    with pytest.raises(BundleError) as err:
        spectr_edge.load(bundle, provider="cpu")
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    code, _, err_text = run_cli("info", "--bundle", bundle)
    one_line_error(code, err_text, needle)


BREAK_TEMPLATE = ("{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
                  "<{{ m.role }}>{{ m.content | tojson }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


def test_a_template_with_loop_controls_renders_like_transformers(toy_dir, tmp_path):
    bundle = copy_bundle(toy_dir, tmp_path)
    edit_manifest(bundle, lambda m: m["tokenizer"].update(chat_template=BREAK_TEMPLATE))
    gen = spectr_edge.load(bundle, provider="cpu")
    text = gen.codec.render_chat([{"role": "user", "content": "é"}, {"role": "stop", "content": ""},
                                  {"role": "user", "content": "never"}], add_generation_prompt=True)
    assert text == '<user>"é"<a>'                # loopcontrols, and tojson keeps non-ASCII as it is
    code, _, err = run_cli("generate", "a b", "--bundle", bundle, "-n", "2", "--no-chat")
    assert code == 0, err


@pytest.mark.parametrize("template,needle", [
    ("{% for m in messages %}{{ m.content }", "does not compile"),
    ("{{ ''.__class__.__mro__ }}", "chat template"),                                     # the sandbox refuses it
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
])
def test_a_broken_or_refused_template_is_one_line_and_no_chat_still_works(toy_dir, tmp_path, template, needle):
    bundle = copy_bundle(toy_dir, tmp_path)
    edit_manifest(bundle, lambda m: m["tokenizer"].update(chat_template=template))
    code, _, err = run_cli("generate", "a b", "--bundle", bundle, "-n", "2")
    one_line_error(code, err, needle)
    code, _, err = run_cli("generate", "a b", "--bundle", bundle, "-n", "2", "--no-chat")
    assert code == 0, err


# -- wrong results and loose checks ---------------------------------------------------------------------

def test_a_stop_string_is_one_string_not_its_characters(gen):
    full = gen.generate("a b", max_new_tokens=12, chat=False).text
    assert "a" in full                                     # the toy emits its 5 letters
    cut = gen.generate("a b", max_new_tokens=12, chat=False, stop="zq").text
    assert cut == full                                     # "zq" never occurs: nothing is cut
    word = full.split()[2]
    cut = gen.generate("a b", max_new_tokens=12, chat=False, stop=f" {word} ").text
    assert cut == full[:full.index(f" {word} ")]


def test_json_token_ids_agree_with_text_after_a_stop(toy_dir, gen):
    full = gen.generate("a b", max_new_tokens=12, chat=False)
    stop = " " + full.text.split()[3]
    code, out, err = run_cli("generate", "a b", "--bundle", toy_dir, "-n", "12", "--no-chat", "--json", "--stop", stop)
    assert code == 0, err
    res = json.loads(out)
    assert res["text"] == full.text[:full.text.index(stop)]
    assert gen.codec.decode(res["token_ids"]) == res["text"]      # the stop begins on a token boundary here
    assert res["token_ids"] == full.token_ids[:len(res["token_ids"])]


def test_info_and_load_refuse_a_truncated_model_file(toy_dir, tmp_path):
    bundle = copy_bundle(toy_dir, tmp_path)
    model = bundle / "target" / "model.onnx"
    model.write_bytes(model.read_bytes()[:1024])
    code, _, err = run_cli("info", "--bundle", bundle)
    one_line_error(code, err, "corrupt or truncated", "re-export")
    with pytest.raises(BundleError, match="truncated"):
        spectr_edge.load(bundle, provider="cpu")


@pytest.mark.parametrize("threads", ["1000", "-1"])
def test_thread_counts_beyond_the_machine(toy_dir, threads):
    code, _, err = run_cli("generate", "a b", "--bundle", toy_dir, "-n", "2", "--threads", threads)
    one_line_error(code, err, "threads must be an integer in [0,", "cores")


def test_numpy_integers_are_counts_floats_and_bools_are_not(gen):
    res = gen.generate_ids(np.array([0, 1, 2]), max_new_tokens=np.int64(4), top_k=np.int32(0), temperature=np.float32(0))
    assert len(res.token_ids) == 4
    with pytest.raises(InputError, match="prompt token id 1.5 is not an integer"):
        gen.generate_ids([0, 1.5], max_new_tokens=2)
    with pytest.raises(InputError, match="max_new_tokens must be an integer >= 1 \\(got True\\)"):
        gen.generate_ids([0, 1], max_new_tokens=True)
    with pytest.raises(InputError, match="top_p must be a finite number in \\(0, 1\\]"):
        gen.generate_ids([0, 1], max_new_tokens=2, top_p=float("nan"))


def test_input_errors_are_value_errors(gen):
    with pytest.raises(ValueError):
        gen.generate("a b", max_new_tokens=-1)
    with pytest.raises(SpectrError):
        gen.generate("a b", temperature=-1)
    assert issubclass(InputError, ValueError) and issubclass(InputError, SpectrError)
