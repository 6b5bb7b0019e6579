"""Assistant-style text sampled from the bundle's own model: the lookup table's second corpus,
and the text the target's guess head is trained on (export/guess_head.py).

Prompt lookup's static next-token table (ngram_table.py) guesses the token after the last one or
two when the text has nothing to copy. Built from the Python standard library alone, its guesses
match a chat model's answers about 7.5% of the time. This module samples conversations from the
bundle's draft model (the target's family, so the same phrasing: "Here's a", "```python", "In
this example,") and the table counts them with a higher weight than the library's source.

Each of `batch` rows is one running conversation, all rows sharing one batched cache: a user turn
that the model writes itself (it starts from one opener word, then samples at temperature 0.8 with
top-p 0.9), the chat template's tokens that hand over to the assistant, a greedy answer (what a
greedy generation produces), the template's tokens back to the user, and the next opener. Rounds
of at most `ROUND_STEPS` steps bound the context. Nothing here reaches the output law: the table
only proposes tokens that the target verifies.
"""

from __future__ import annotations

import time

import numpy as np

from .onnx_model import OnnxLM
from .text import TextCodec

OPENERS = ("Explain", "Write", "What", "How", "Can", "Please", "Translate", "Summarize", "Why", "Give",
           "Describe", "List", "Compare", "Solve", "Create", "Tell", "Who", "I", "Is", "Help", "Suggest",
           "Calculate", "Imagine", "Which", "Find", "Plan", "Draft", "Convert", "Name", "Should")
ASK_TEMPERATURE, ASK_TOP_P, ASK_TOP = 0.8, 0.9, 64     # the user turn: sampled among the 64 most likely
MAX_ASK, MAX_ANSWER = 96, 512                          # tokens before a turn is cut short
ROUND_STEPS = 512
_MARKS = ("\x02USER1\x03", "\x02ANSWER\x03", "\x02USER2\x03")


def turn_pieces(codec: TextCodec) -> tuple[list[int], list[int], list[int]] | None:
    """Token ids of the chat text before a first user turn, between a user turn and its answer, and
    between an answer and the next user turn; None without a chat template."""
    if not codec.has_chat_template:
        return None
    text = codec.render_chat([{"role": "user", "content": _MARKS[0]},
                              {"role": "assistant", "content": _MARKS[1]},
                              {"role": "user", "content": _MARKS[2]}])
    if not all(text.count(m) == 1 for m in _MARKS):
        return None
    before, rest = text.split(_MARKS[0])
    to_answer, rest = rest.split(_MARKS[1])
    to_user = rest.split(_MARKS[2])[0]
    enc = lambda s: codec.tokenizer.encode(s, add_special_tokens=False).ids  # noqa: E731
    pieces = enc(before), enc(to_answer), enc(to_user)
    return pieces if pieces[1] and pieces[2] else None


def _openers(codec: TextCodec) -> list[int]:
    """The first token of each opener word."""
    return [codec.tokenizer.encode(w, add_special_tokens=False).ids[0] for w in OPENERS]


def sample_conversations(model: OnnxLM, codec: TextCodec, vocab_size: int, eos_ids, num_tokens: int, *,
                         batch: int = 32, seed: int = 0, log=lambda s: None) -> list[list[int]]:
    """About `num_tokens` tokens of conversations, one token list per row and round (each starting
    with the template's opening text). [] when the tokenizer has no chat template."""
    pieces = turn_pieces(codec)
    if pieces is None or num_tokens <= 0:
        return []
    before, to_answer, to_user = pieces
    ends = set(int(e) for e in eos_ids) | {to_answer[0]}
    openers = _openers(codec)
    rng = np.random.default_rng(seed)
    rows_out: list[list[int]] = []
    next_opener, produced, started = 0, 0, time.perf_counter()
    while produced < num_tokens:
        rows = min(batch, max(1, (num_tokens - produced) // 64))
        # a round stays within the model's context (its rotary tables end there, export/fuse_rotary.py)
        steps = min(ROUND_STEPS, model.spec.context_length - len(before) - 1, -(-(num_tokens - produced) // rows))
        cache = model.new_cache()
        model.forward(np.asarray([before], dtype=np.int64), cache, last=1)
        cache.repeat_rows(rows)
        out = [list(before) for _ in range(rows)]
        asking = [True] * rows
        turn = [0] * rows                      # tokens in the current turn
        queue: list[list[int]] = []
        last = None                            # [rows, W] logits after each row's newest token
        for r in range(rows):
            queue.append([openers[next_opener % len(openers)]])
            next_opener += 1
        for _ in range(steps):
            nxt = np.zeros(rows, dtype=np.int64)
            free = [r for r in range(rows) if not queue[r]]
            if free:
                logits = last[free, :vocab_size]                                      # [f, V]
                greedy = np.argmax(logits, axis=1)
                count = min(ASK_TOP, vocab_size - 1)
                top = np.argpartition(-logits, count, axis=1)[:, :count]              # [f, 64]
            for i, r in enumerate(free):
                if asking[r]:
                    cand = top[i]
                    z = logits[i, cand].astype(np.float64) / ASK_TEMPERATURE
                    order = np.argsort(-z)
                    p = np.exp(z[order] - z[order[0]])
                    p /= p.sum()
                    keep = int(np.searchsorted(np.cumsum(p), ASK_TOP_P)) + 1
                    tok = int(cand[order[rng.choice(keep, p=p[:keep] / p[:keep].sum())]])
                else:
                    tok = int(greedy[i])
                turn[r] += 1
                limit = MAX_ASK if asking[r] else MAX_ANSWER
                if tok in ends or turn[r] >= limit:           # the turn ends: hand over to the other side
                    handover = to_answer if asking[r] else to_user
                    queue[r] = list(handover)
                    if not asking[r]:
                        queue[r].append(openers[next_opener % len(openers)])
                        next_opener += 1
                    asking[r], turn[r] = not asking[r], 0
                else:
                    queue[r] = [tok]
            for r in range(rows):
                nxt[r] = queue[r].pop(0)
                out[r].append(int(nxt[r]))
            last = model.forward(nxt[:, None], cache)[:, -1]                         # [rows, W]
        produced += rows * steps
        rows_out.extend(out)
        spent, done = time.perf_counter() - started, min(produced, num_tokens)
        log(f"      sampled {done} of {num_tokens} tokens of conversation ({spent:.0f} s"
            + (f", about {spent * (num_tokens - done) / done:.0f} s left)" if done < num_tokens else ")"))
    return rows_out
