"""End to end on exported models: target-only greedy equals transformers' greedy `generate`,
and speculative greedy equals target-only greedy token for token, with tokens really drafted
and accepted (counts asserted). Tiny random models (exported through the real path) and the
real SmolLM2-135M-Instruct bundle."""

from __future__ import annotations

import pytest

import spectr_edge

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Hello, world! How are you?"]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=list(eos_ids) or None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             generation_config=config)
    return out[0, len(prompt_ids):].tolist()


def check_against_transformers(bundle, hf_dir, prompts, max_new_tokens=24, draft_lens=(1, 3, 5)):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype="float32").eval()
    gen = spectr_edge.load(bundle, provider="cpu")
    eos = gen.bundle.tokenizer.eos_token_ids
    drafted = accepted = 0
    for prompt in prompts:
        ids = gen.codec.encode_prompt(prompt, chat=False)
        expected = hf_greedy(model, ids, max_new_tokens, eos)
        plain = gen.generate_ids(ids, max_new_tokens=max_new_tokens, temperature=0, num_candidates=0)
        assert plain.token_ids == expected, f"target-only greedy differs from transformers on {prompt!r}"
        for draft_len in draft_lens:
            spec = gen.generate_ids(ids, max_new_tokens=max_new_tokens, temperature=0, num_candidates=1,
                                    draft_len=draft_len)
            assert spec.token_ids == expected, f"speculative greedy (L={draft_len}) differs on {prompt!r}"
            drafted += spec.stats.drafted
            accepted += spec.stats.accepted
    assert drafted > 0 and 0 < accepted <= drafted     # speculation ran and the draft was useful


def test_tiny_llama_greedy_equals_transformers(tiny_bundle, tiny_llama_dir):
    check_against_transformers(tiny_bundle, tiny_llama_dir, PROMPTS)


def test_tiny_qwen_padded_vocab_greedy_equals_transformers(tiny_qwen_bundle, tiny_qwen_dir):
    # logits width 512 > 400 tokenizer ids, int8 draft
    check_against_transformers(tiny_qwen_bundle, tiny_qwen_dir, PROMPTS)


def test_tiny_sampling_never_emits_padding_and_is_reproducible(tiny_qwen_bundle):
    gen = spectr_edge.load(tiny_qwen_bundle, provider="cpu")
    vocab = gen.bundle.tokenizer.vocab_size
    assert gen.bundle.target.logits_width > vocab
    for k in (0, 1, 3):
        a = gen.generate_ids([5, 6, 7], max_new_tokens=40, temperature=1.5, num_candidates=k, draft_len=3, seed=7)
        b = gen.generate_ids([5, 6, 7], max_new_tokens=40, temperature=1.5, num_candidates=k, draft_len=3, seed=7)
        assert a.token_ids == b.token_ids and all(0 <= t < vocab for t in a.token_ids)


# -- the real SmolLM2-135M-Instruct bundle --------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_hf(smollm2_bundle, tmp_path_factory):
    """The same GGUF loaded by transformers (dequantized to float32), as the export saw it."""
    from transformers import AutoModelForCausalLM

    from spectr_edge_export.presets import PRESETS, cache_root, fetch_gguf

    gguf = fetch_gguf(PRESETS["smollm2"].target, cache_root(), lambda s: None)
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype="float32").eval()


@pytest.mark.real_model
def test_smollm2_chat_answer_is_sensible_and_matches_transformers(smollm2_bundle, smollm2_hf):
    gen = spectr_edge.load(smollm2_bundle, provider="cpu")
    ids = gen.codec.encode_prompt("What is the capital of France?", chat=True)
    im_start = gen.codec.tokenizer.token_to_id("<|im_start|>")
    assert ids[0] == im_start and ids[1] != im_start      # the GGUF bos quirk would double it
    expected = hf_greedy(smollm2_hf, ids, 32, gen.bundle.tokenizer.eos_token_ids)
    plain = gen.generate_ids(ids, max_new_tokens=32, temperature=0, num_candidates=0)
    assert plain.token_ids == expected
    assert "Paris" in plain.text
    spec = gen.generate("What is the capital of France?", max_new_tokens=32, temperature=0,
                        num_candidates=1, draft_len=4)
    assert spec.token_ids == expected and spec.stats.accepted > 0 and spec.stats.drafted > 0


@pytest.mark.real_model
def test_smollm2_speculative_greedy_equals_target_greedy(smollm2_bundle):
    gen = spectr_edge.load(smollm2_bundle, provider="cpu")
    accepted = 0
    for prompt in ["Write a Python function that reverses a string.", "List three colors."]:
        plain = gen.generate(prompt, max_new_tokens=48, temperature=0, num_candidates=0)
        for k, L in [(1, 2), (1, 5), (3, 3)]:       # k > 1 at temperature 0 drafts one candidate
            spec = gen.generate(prompt, max_new_tokens=48, temperature=0, num_candidates=k, draft_len=L)
            assert spec.token_ids == plain.token_ids and spec.text == plain.text
            accepted += spec.stats.accepted
    assert accepted > 0


@pytest.mark.real_model
def test_smollm2_sampling_with_candidates_runs(smollm2_bundle):
    gen = spectr_edge.load(smollm2_bundle, provider="cpu")
    res = gen.generate("Tell me a short story.", max_new_tokens=24, temperature=1.0, top_p=0.95,
                       num_candidates=3, draft_len=3, seed=1)
    assert res.stats.new_tokens > 0 and res.stats.steps > 0 and res.stats.num_candidates == 3
    assert res.text.strip()
