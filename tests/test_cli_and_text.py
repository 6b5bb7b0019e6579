"""The command line as a user runs it (subprocess), streaming text decode, stop strings,
and the promise that the runtime never imports torch/transformers/optimum."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from spectr_edge.bundle import TokenizerSpec
from spectr_edge.text import TextCodec, TextStream
from toy_lm import build_toy_bundle

CLI = [sys.executable, "-m", "spectr_edge.cli"]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return build_toy_bundle(tmp_path_factory.mktemp("toy") / "bundle", seed_target=21, seed_draft=22)


def run_cli(*args, stdin=None):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, input=stdin, timeout=120)


def test_generate_streams_text_and_prints_stats(toy_dir):
    res = run_cli("generate", "a b c", "--bundle", str(toy_dir), "--provider", "cpu", "-n", "8", "--stats")
    assert res.returncode == 0, res.stderr
    words = res.stdout.split()
    assert len(words) == 8 and set(words) <= set("abcde")
    assert "time to first token" in res.stderr and "tokens per target call" in res.stderr


def test_generate_json_and_no_draft(toy_dir):
    res = run_cli("generate", "a b", "--bundle", str(toy_dir), "--provider", "cpu", "-n", "5", "--json",
                  "--no-draft")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["token_ids"]) == 5 and out["stats"]["num_candidates"] == 0 and out["stats"]["draft_calls"] == 0
    spec = json.loads(run_cli("generate", "a b", "--bundle", str(toy_dir), "--provider", "cpu", "-n", "5",
                              "--json", "-k", "1", "-L", "3").stdout)
    assert spec["token_ids"] == out["token_ids"] and spec["stats"]["draft_calls"] > 0   # greedy equality
    plain_pages = run_cli("generate", "a b", "--bundle", str(toy_dir), "--provider", "cpu", "-n", "5", "--json",
                          "-k", "1", "-L", "3", "--no-huge-pages")
    assert plain_pages.returncode == 0, plain_pages.stderr
    assert json.loads(plain_pages.stdout)["token_ids"] == out["token_ids"]


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-2"], "top_k must be an integer >= 0"),
    (["-n", "0"], "max_new_tokens must be an integer >= 1"),
    (["-L", "0"], "draft_len must be an integer in [1, 128]"),
    (["-k", "-1"], "num-candidates"),
    (["--provider", "npu"], "npu"),
    (["--chat"], "no chat template"),
    (["--draft", "lookup", "-k", "2"], "lookup_candidates=2 (--lookup-candidates 2)"),   # the old spelling
    (["--draft", "lookup", "--lookup-candidates", "2"], "only as one token trie"),       # no tree mask here
    (["--branches", "3"], "branches needs a bundle whose target takes a tree mask"),
    (["--draft", "lookup", "--no-draft"], "contradict each other"),
    (["--draft", "copy"], "copy"),
    (["--draft-window", "-3"], "draft_window must be an integer >= 0"),
])
def test_bad_options_give_one_line_errors(toy_dir, args, message):
    res = run_cli("generate", "a b", "--bundle", str(toy_dir), "-n", "3", *args)
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


def test_prompt_lookup_from_the_command_line(toy_dir):
    """--draft lookup needs no draft model and gives target greedy; its stats line says what it did."""
    plain = json.loads(run_cli("generate", "a b a b a b", "--bundle", str(toy_dir), "--provider", "cpu", "-n", "12",
                               "--json", "--no-draft").stdout)
    res = run_cli("generate", "a b a b a b", "--bundle", str(toy_dir), "--provider", "cpu", "-n", "12", "--json",
                  "--draft", "lookup")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["token_ids"] == plain["token_ids"]
    assert out["stats"]["draft_calls"] == 0 and out["stats"]["lookup_steps"] > 0
    res = run_cli("generate", "a b a b a b", "--bundle", str(toy_dir), "--provider", "cpu", "-n", "12", "--stats",
                  "--draft", "model+lookup")
    assert res.returncode == 0 and "prompt lookup:" in res.stderr, res.stderr


def test_lookup_candidates_as_one_trie_from_the_command_line(tmp_path):
    """--draft lookup --lookup-candidates 4 on a bundle whose target takes a tree mask: target greedy, and --stats says
    how many steps verified several copied candidates as one trie."""
    tree_dir = build_toy_bundle(tmp_path / "tree", seed_target=21, seed_draft=22, tree_mask=True)
    args = ["generate", "a b c a b d a b", "--bundle", str(tree_dir), "--provider", "cpu", "-n", "24"]
    plain = json.loads(run_cli(*args, "--json", "--no-draft").stdout)
    res = run_cli(*args, "--json", "--draft", "lookup", "--lookup-candidates", "4")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["token_ids"] == plain["token_ids"] and out["stats"]["lookup_tries"] > 0, out["stats"]
    res = run_cli(*args, "--stats", "--draft", "lookup", "--lookup-candidates", "4")
    assert res.returncode == 0 and "as one trie" in res.stderr, res.stderr


def test_add_lookup_table_upgrades_a_bundle(toy_dir, tmp_path):
    """export --add-lookup-table writes the table and its manifest entry; generation still gives target greedy."""
    import shutil

    bundle = tmp_path / "upgraded"
    shutil.copytree(toy_dir, bundle)
    res = run_cli("export", "--add-lookup-table", "--out", str(bundle), "--lookup-conversation-tokens", "256")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((bundle / "spectr.json").read_text())
    assert (bundle / manifest["lookup_table"]["file"]).is_file() and "standard library" in res.stdout
    # the toy tokenizer has no chat template: no conversation to sample, and export says so
    assert "conversation_tokens" not in manifest["lookup_table"] and "no chat template" in res.stdout
    plain = json.loads(run_cli("generate", "a b c", "--bundle", str(bundle), "--provider", "cpu", "-n", "10",
                               "--json", "--no-draft").stdout)
    looked = json.loads(run_cli("generate", "a b c", "--bundle", str(bundle), "--provider", "cpu", "-n", "10",
                                "--json", "--draft", "lookup").stdout)
    assert looked["token_ids"] == plain["token_ids"]
    res = run_cli("export", "--add-lookup-table", "--out", str(tmp_path / "nothing"))
    assert res.returncode == 2 and "was not found" in res.stderr and "Traceback" not in res.stderr


def test_missing_bundle_and_empty_prompt(toy_dir, tmp_path):
    res = run_cli("generate", "hi", "--bundle", str(tmp_path / "missing"))
    assert res.returncode == 2 and res.stderr.startswith("error: a bundle was not found")
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    res = run_cli("generate", "", "--bundle", str(toy_dir), "--provider", "cpu")
    assert res.returncode == 2 and "prompt is empty" in res.stderr


def test_info(toy_dir):
    res = run_cli("info", "--bundle", str(toy_dir))
    assert res.returncode == 0, res.stderr
    assert "target:" in res.stdout and "draft:" in res.stdout and "providers on this machine: " in res.stdout


def test_runtime_never_imports_torch(toy_dir):
    code = (
        "import sys\n"
        "from spectr_edge.cli import main\n"
        f"sys.argv = ['spectr-edge', 'generate', 'a b', '--bundle', {str(toy_dir)!r}, '-n', '4', '-k', '2',"
        " '--temperature', '1', '--seed', '1']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "bad = [m for m in ('torch', 'transformers', 'optimum') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('clean')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("clean"), res.stderr


# -- streaming decode and stop strings, with a real byte-level BPE tokenizer ------------------------
@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"])
    tok.train_from_iterator(["hello world, streaming text one token at a time. " * 20], trainer)
    path = Path(tmp_path_factory.mktemp("tok")) / "tokenizer.json"
    tok.save(str(path))
    spec = TokenizerSpec(file=path, vocab_size=tok.get_vocab_size(), vocab_sha256=None, bos_token_id=None,
                         add_bos_token=False, eos_token_ids=(0,), chat_template=None, special_tokens={})
    return TextCodec(spec)


def test_stream_decodes_multibyte_characters_across_tokens(codec):
    text = "héllo wörld — naïve 日本語 🙂 done"
    ids = codec.tokenizer.encode(text, add_special_tokens=False).ids
    stream = TextStream(codec)
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)   # never a half character on screen


def test_stop_string_is_cut_and_never_shown(codec):
    text = "hello world STOP after the stop"
    ids = codec.tokenizer.encode(text, add_special_tokens=False).ids
    stream = TextStream(codec, stop=("STOP",))
    shown = ""
    for i in ids:
        shown += stream.push([i])
        if stream.stopped:
            break
    shown += stream.flush()
    assert stream.stopped and shown == "hello world " and stream.text == "hello world "


def test_partial_stop_prefix_is_released_when_it_does_not_match(codec):
    text = "a ST b STO c"
    ids = codec.tokenizer.encode(text, add_special_tokens=False).ids
    stream = TextStream(codec, stop=("STOP",))
    shown = "".join(stream.push([i]) for i in ids) + stream.flush()
    assert not stream.stopped and shown == text


def test_llama_cpp_style_aliases_and_prompt_sources(toy_dir, tmp_path):
    """--temp, --draft-max, --draft-p-min, -p/--prompt and -f/--file mean what they mean in llama.cpp."""
    base = ["--bundle", str(toy_dir), "--provider", "cpu", "-n", "8", "--json"]
    want = json.loads(run_cli("generate", "a b c", *base, "--temperature", "0", "-L", "3", "--draft-stop", "0.2").stdout)
    got = json.loads(run_cli("generate", "-p", "a b c", *base, "--temp", "0", "--draft-max", "3",
                             "--draft-p-min", "0.2").stdout)
    assert got["token_ids"] == want["token_ids"] and got["stats"]["draft_len"] == 3
    (tmp_path / "prompt.txt").write_text("a b c")
    assert json.loads(run_cli("generate", "-f", str(tmp_path / "prompt.txt"), *base).stdout)["token_ids"] == \
        want["token_ids"]
    res = run_cli("generate", "a b", "-p", "c d", *base)
    assert res.returncode == 2 and "give the prompt once" in res.stderr and "Traceback" not in res.stderr


def test_interactive_chat_keeps_the_conversation(tiny_qwen_bundle):
    res = subprocess.run(CLI + ["chat", "--bundle", str(tiny_qwen_bundle), "--provider", "cpu", "-n", "6", "--stats",
                                "--system", "Be brief."], input="hello\nand again\n/exit\n", capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    reused = [int(line.rsplit(":", 1)[1]) for line in res.stderr.splitlines() if "reused from the cache" in line]
    assert len(reused) == 2 and reused[0] == 0 and reused[1] > 10, res.stderr
