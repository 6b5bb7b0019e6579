"""Embedding spectr-edge in applications: chat messages, prefix reuse across calls, several threads
and asyncio on one Generator, and the OpenAI-compatible server, driven by the official `openai`
client against a real server on 127.0.0.1 (tiny bundles exported through the real path)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter

import numpy as np
import pytest

import spectr_edge
from spectr_edge.errors import InputError
from spectr_edge.prefix_cache import PrefixCache
from toy_lm import build_toy_bundle, exact_sequence_law

CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def qwen(tiny_qwen_bundle):
    return spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1)


@pytest.fixture(scope="module")
def qwen_fresh(tiny_qwen_bundle):
    """The same bundle without prefix reuse: every call prefills its whole prompt."""
    return spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1, prefix_cache=False)


# -- chat and prefix reuse ---------------------------------------------------------------------------

def test_chat_renders_messages_with_the_template_and_reuses_the_conversation(qwen, qwen_fresh):
    first = qwen.chat(CONVERSATION, max_new_tokens=12)
    assert first.token_ids == qwen_fresh.chat(CONVERSATION, max_new_tokens=12).token_ids
    turn2 = CONVERSATION + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And two more?"}]
    again = qwen.chat(turn2, max_new_tokens=12)
    assert again.stats.cached_tokens > len(qwen.codec.encode_chat(CONVERSATION)) - 2   # the first turn came from the cache
    assert again.token_ids == qwen_fresh.chat(turn2, max_new_tokens=12).token_ids       # and changed nothing
    parts = [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]
    assert qwen.chat([CONVERSATION[0], {"role": "user", "content": parts}], max_new_tokens=12).token_ids == \
        first.token_ids


@pytest.mark.parametrize("options", [dict(), dict(num_candidates=0), dict(drafter="lookup"),
                                     dict(draft_len=3, draft_window=0), dict(draft_len=2, draft_stop=0.0)])
def test_greedy_with_prefix_reuse_equals_without(qwen, qwen_fresh, options):
    """Token for token, with the target's cache (and the draft's, window 0) reused: prompts that extend
    a previous prompt and its output, and one that branches off earlier."""
    rng = np.random.default_rng(1)
    base = [int(t) for t in rng.integers(3, 400, 24)]
    first = qwen.generate_ids(base, max_new_tokens=10, **options)
    for prompt in (base + first.token_ids + [7, 8, 9], base[:12] + [5, 6], base + first.token_ids[:4]):
        got = qwen.generate_ids(prompt, max_new_tokens=10, **options)
        assert got.stats.cached_tokens > 0
        assert got.token_ids == qwen_fresh.generate_ids(prompt, max_new_tokens=10, **options).token_ids, prompt


def test_prefix_cache_is_bounded_and_can_be_turned_off(tiny_qwen_bundle):
    small = PrefixCache(max_entries=2)
    gen = spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1, prefix_cache=small)
    for start in (10, 50, 90, 130):
        gen.generate_ids(list(range(start, start + 20)), max_new_tokens=4)
    assert len(small) == 2 and small.nbytes > 0
    assert gen.generate_ids(list(range(10, 31)), max_new_tokens=4).stats.cached_tokens == 0   # evicted
    assert gen.generate_ids(list(range(130, 151)), max_new_tokens=4).stats.cached_tokens == 20
    tight = PrefixCache(max_bytes=small.nbytes // 4)                                           # too small for one
    gen = spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1, prefix_cache=tight)
    gen.generate_ids(list(range(10, 30)), max_new_tokens=4)
    assert len(tight) == 0
    off = spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1, prefix_cache=False)
    off.generate_ids(list(range(10, 30)), max_new_tokens=4)
    assert off.generate_ids(list(range(10, 31)), max_new_tokens=4).stats.cached_tokens == 0


def test_sampling_with_prefix_reuse_keeps_the_target_law(tmp_path):
    """Monte Carlo on the toy LM (tests/toy_lm.py): each draw first generates from a prompt the next one
    extends (its cache and the draft's are kept), then samples 6 tokens after the longer prompt, which
    reuses all of it but the last token. The law of those 6 tokens is compared with the exact law by
    chi-square at p = 1e-4 (as test_montecarlo.py: tokens 1-3 and 4-6, its CI_DRAWS draws)."""
    from test_montecarlo import CI_DRAWS, MAX_NEW_TOKENS, WINDOWS, chi2_quantile, chi_square

    bundle = build_toy_bundle(tmp_path / "toy", seed_target=11, seed_draft=12)
    gen = spectr_edge.load(bundle, provider="cpu", threads=1)
    prompt, draws = (2, 0, 3, 1, 4), CI_DRAWS
    rng = np.random.default_rng(70)
    counts = {name: Counter() for name in WINDOWS}
    reused = 0
    for _ in range(draws):
        gen.generate_ids(list(prompt[:-1]) + [0], max_new_tokens=2, temperature=1.0, rng=rng, draft_window=0)
        res = gen.generate_ids(list(prompt), max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, num_candidates=2,
                               draft_len=2, rng=rng, draft_window=0)
        reused += res.stats.cached_tokens == len(prompt) - 1
        for name, window in WINDOWS.items():
            counts[name][tuple(res.token_ids)[window]] += 1
    assert reused == draws
    full = exact_sequence_law(bundle, prompt, MAX_NEW_TOKENS, 1.0)
    for name, window in WINDOWS.items():
        law = Counter()
        for seq, p in full.items():
            law[seq[window]] += p
        stat, df = chi_square(counts[name], dict(law), draws)
        assert stat <= chi2_quantile(df), (name, stat, df)


# -- threads and asyncio -----------------------------------------------------------------------------

def test_one_generator_from_several_threads(qwen, qwen_fresh):
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 400, 16)] for i in range(6)]
    want = {i: qwen_fresh.generate_ids(p, max_new_tokens=12, temperature=0.8, seed=i).token_ids
            for i, p in enumerate(prompts)}
    got, errors = {}, []

    def work(i):
        try:
            for _ in range(3):
                got[i] = qwen.generate_ids(prompts[i], max_new_tokens=12, temperature=0.8, seed=i).token_ids
        except Exception as err:          # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and got == want


def test_async_api_matches_the_blocking_one(qwen, qwen_fresh):
    want = qwen_fresh.chat(CONVERSATION, max_new_tokens=10).text

    async def main():
        pieces = [p async for p in qwen.achat_stream(CONVERSATION, max_new_tokens=10)]
        whole = await qwen.agenerate("hello there", max_new_tokens=6)
        return "".join(pieces), whole

    text, whole = asyncio.run(main())
    assert text == want and len(whole.token_ids) == 6


def test_bad_messages_are_one_line_value_errors(qwen):
    for bad, needle in [([], "non-empty list"), ([{"role": "robot", "content": "x"}], "robot"),
                        ([{"content": "x"}], "role"), ([{"role": "user", "content": [{"type": "image_url"}]}], "text only")]:
        with pytest.raises(InputError, match=needle):
            qwen.chat(bad)


# -- the OpenAI-compatible server --------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_qwen_bundle):
    """The real server (uvicorn) on 127.0.0.1 in a background thread of this process."""
    import uvicorn

    from spectr_edge.server import ServerSettings, create_app

    gen = spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1)
    port = _free_port()
    app = create_app(gen, ServerSettings(model_name="tiny", max_queue=1, max_tokens=64, max_body_bytes=4096))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", gen
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def test_server_chat_completion_equals_the_generator(server, client, qwen_fresh):
    res = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=12, temperature=0)
    want = qwen_fresh.chat(CONVERSATION, max_new_tokens=12)
    assert res.choices[0].message.content == want.text and res.choices[0].message.role == "assistant"
    assert res.usage.completion_tokens == len(want.token_ids) and res.choices[0].finish_reason in ("length", "stop")
    assert res.usage.prompt_tokens == len(qwen_fresh.codec.encode_chat(CONVERSATION))
    again = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=12, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == want.text


def test_server_streams_and_completes(server, client, qwen_fresh):
    chunks = list(client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == qwen_fresh.chat(CONVERSATION, max_new_tokens=12).text
    assert chunks[-1].usage.completion_tokens == 12
    done = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0)
    assert done.choices[0].text == qwen_fresh.generate("hello world", chat=False, max_new_tokens=8).text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="hello world", max_tokens=8, temperature=0, stream=True))
    assert streamed == done.choices[0].text
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_server_stop_strings_and_sampling_options(server, client, qwen_fresh):
    full = qwen_fresh.generate("count: one two", chat=False, max_new_tokens=16).text
    stop = full.split()[2] if len(full.split()) > 2 else full[3:5]
    res = client.completions.create(model="tiny", prompt="count: one two", max_tokens=16, temperature=0, stop=[stop])
    assert res.choices[0].text == full[:full.index(stop)] and res.choices[0].finish_reason == "stop"
    a = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=8, temperature=1.0, seed=4,
                                       top_p=0.9, presence_penalty=0.5, extra_body={"top_k": 20,
                                                                                   "speculation": {"draft_len": 2}})
    b = qwen_fresh.chat(CONVERSATION, max_new_tokens=8, temperature=1.0, seed=4, top_p=0.9, presence_penalty=0.5,
                        top_k=20, draft_len=2)
    assert a.choices[0].message.content == b.text


def test_server_errors_are_openai_json(server, client):
    import httpx
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CONVERSATION, temperature=-1)
    assert "temperature" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:                       # over the context (512 positions)
        client.completions.create(model="tiny", prompt="word " * 600, max_tokens=4)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=CONVERSATION, n=2)
    url = server[0]
    big = httpx.post(url + "/v1/completions", content=json.dumps({"prompt": "x" * 5000}),
                     headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    bad = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_a_disconnected_stream_stops_its_generation_and_the_queue_is_bounded(server):
    import httpx

    url, gen = server
    before = httpx.get(url + "/metrics").json()
    body = {"model": "tiny", "messages": CONVERSATION, "max_tokens": 64, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            next(r.iter_lines())                                  # the first event, then hang up
    for _ in range(100):
        after = httpx.get(url + "/metrics").json()
        if after["cancelled"] > before["cancelled"] and not after["generating"]:
            break
        time.sleep(0.05)
    assert after["cancelled"] == before["cancelled"] + 1 and not after["generating"]

    # max_queue=1: while one request generates and one waits, a third is refused with 429
    with gen._lock:                                               # hold the models: requests queue up
        codes = []

        def post():
            codes.append(httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code)

        workers = [threading.Thread(target=post) for _ in range(3)]
        for w in workers:
            w.start()
            time.sleep(0.3)
        assert 429 in codes
    for w in workers:
        w.join(60)
    assert sorted(codes) == [200, 200, 429]


def test_the_serve_command_starts_answers_records_and_stops(tiny_qwen_bundle, tmp_path):
    """`spectr-edge serve` as a user starts it (a subprocess on 127.0.0.1), with --record: one chat
    request answered as the Generator answers it, one recorded line, then SIGTERM ends it."""
    import signal
    import subprocess
    import sys

    import httpx
    import openai

    from spectr_edge import recording

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spectr_edge.cli", "serve", "--bundle", str(tiny_qwen_bundle),
                             "--port", str(port), "--provider", "cpu", "--threads", "1", "--model-name", "tiny",
                             "--record", str(tmp_path / "rec")], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        res = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=8, temperature=0)
        want = spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1).chat(CONVERSATION, max_new_tokens=8)
        assert res.choices[0].message.content == want.text
        (rec,) = list(recording.read(tmp_path / "rec"))
        assert rec.tokens[:len(want.token_ids)] == want.token_ids
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
