"""Batched greedy decoding (evaluation/batched.py) equals the one-sequence loop token for token.

For every prompt of a batch of different lengths, the batched plain and speculative decoders must
return exactly the tokens, the per-round accepted counts and the stop reason of
`speculate.generate_plain` / `generate_speculative` at batch 1 (T = 0), with rows stopping at
different rounds (eos, length) while others go on. A small vocabulary makes random drafters
right often enough that rounds accept 0 … B−1 drafts.
"""

from __future__ import annotations

import pytest
import torch
from test_eval_common import target_and_drafter
from test_eval_common import one_thread  # noqa: F401  (fixture, used by pytestmark)

from dflash_trainer.evaluation.batched import plain_batch, speculative_batch
from dflash_trainer.evaluation.draft import DraftSession
from dflash_trainer.evaluation.speculate import TargetSession, generate_plain, generate_speculative

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    dict(kind="llama", vocab_size=12, block_size=4),
    dict(kind="qwen3", vocab_size=12, block_size=5, layer_types=("sliding_attention", "full_attention"),
         sliding_window=3),
    dict(kind="llama", vocab_size=128, block_size=4),
]


def _prompts(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (L,), generator=g).tolist() for L in (5, 1, 9, 3, 12, 7)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['kind']}-V{c['vocab_size']}-B{c['block_size']}")
def test_batched_equals_batch_one(case):
    case = dict(case)
    kind, B = case.pop("kind"), case["block_size"]
    bundle, drafter = target_and_drafter(kind, **case)
    ids = drafter.config.target_layer_ids
    prompts = _prompts(case["vocab_size"])
    eos = {2}
    tsess, dsess = TargetSession(bundle, ids), DraftSession(drafter)
    for max_new in (1, 6, 25):
        plain = plain_batch(bundle, prompts, max_new_tokens=max_new, eos_ids=eos)
        spec = speculative_batch(bundle, drafter, prompts, block_size=B, max_new_tokens=max_new, eos_ids=eos,
                                 layer_ids=ids)
        for r, p in enumerate(prompts):
            ref = generate_plain(tsess, p, max_new_tokens=max_new, eos_ids=eos)
            one = generate_speculative(tsess, dsess, p, block_size=B, max_new_tokens=max_new, eos_ids=eos)
            assert plain.tokens[r] == ref.tokens and plain.stop[r] == ref.stop
            assert spec.tokens[r] == one.tokens and spec.stop[r] == one.stop
            assert spec.accepted[r] == one.accepted
    if case["vocab_size"] == 12:  # the small vocabulary exercises partial acceptance
        assert any(0 < n < B - 1 for rows in spec.accepted for n in rows)
        assert sum(s == "eos" for s in spec.stop) >= 1 and sum(s == "length" for s in spec.stop) >= 1


def test_batched_evaluate_gives_the_sequential_result():
    """`evaluate(batch_size>1)` (two-turn prompts, the second turn's history from the first turn's
    plain response) reports the same τ, histogram, per-turn tokens and rounds, and offline τ as
    the one-sequence path; T > 0 is refused in batched mode."""
    from test_eval_common import CHATML, word_tokenizer

    from dflash_trainer.evaluation.run import evaluate
    from dflash_trainer.evaluation.suites import EvalPrompt

    bundle, drafter = target_and_drafter(vocab_size=40, block_size=4)
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    prompts = [EvalPrompt(id="one", user_turns=["w10 w11 w12"]),
               EvalPrompt(id="two", user_turns=["w20 w21", "w30 w31 w32 w33"], system="w5 w6"),
               EvalPrompt(id="three", user_turns=["w7", "w8 w9"])]
    seq = evaluate(bundle, drafter, prompts, chat_template=CHATML, max_new_tokens=10)
    bat = evaluate(bundle, drafter, prompts, chat_template=CHATML, max_new_tokens=10, batch_size=2)
    for key in ("tau", "tau_per_prompt", "accept_histogram", "rounds", "tokens", "lossless", "num_turns",
                "offline_tau_exact"):
        assert bat[key] == seq[key], key
    strip = [[{k: v for k, v in t.items() if not k.endswith("per_s")} for t in p["turns"]] for p in seq["per_prompt"]]
    assert strip == [p["turns"] for p in bat["per_prompt"]]
    assert bat["lossless"] is True and bat["num_turns"] == 5 and bat["batch_size"] == 2
    with pytest.raises(ValueError, match="greedy only"):
        evaluate(bundle, drafter, prompts, chat_template=CHATML, temperature=0.5, batch_size=2)


def test_batched_oracle_rows_stop_mid_round_while_others_go_on(monkeypatch):
    """Rows whose drafter is an oracle accept whole blocks and hit max_new_tokens mid-round while
    always-wrong rows go on for many more rounds: tokens, accepted counts and stops still equal the
    one-sequence loop's, and no row's cache position runs past the cache (a row cut mid-round must
    not advance by the whole round)."""
    from test_eval_common import ScriptedProposer

    import dflash_trainer.evaluation.batched as batched

    B, max_new, eos = 4, 10, {2}
    bundle, drafter = target_and_drafter(vocab_size=40, block_size=B)
    ids = drafter.config.target_layer_ids
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 39, (L,), generator=g).tolist() for L in (12, 3, 7, 5)]
    correct = [True, False, True, False]
    tsess = TargetSession(bundle, ids)
    seqs = [p + generate_plain(tsess, p, max_new_tokens=max_new + 2 * B, eos_ids=set()).tokens for p in prompts]
    V = bundle.vocab_size

    class OracleRows:
        """Batched stand-in for BatchedDraftSession: row r proposes seqs[r] (or always-wrong tokens)."""

        def __init__(self, _drafter, *, rows, max_len, zero_features=False):
            assert rows == len(prompts)
            self.rows, self.max_len = rows, max_len

        def extend(self, features, start, rows=None):
            pass

        def propose(self, anchor_tokens, anchor_pos, span, block_size=None):
            logits = torch.zeros(len(prompts), block_size - 1, V)
            for r, a in enumerate(anchor_pos.tolist()):
                for k in range(1, block_size):
                    tok = seqs[r][a + k] if a + k < len(seqs[r]) else 0
                    logits[r, k - 1, tok if correct[r] else (tok + 1) % V] = 10.0
            return logits

    monkeypatch.setattr(batched, "BatchedDraftSession", OracleRows)
    got = batched.speculative_batch(bundle, drafter, prompts, block_size=B, max_new_tokens=max_new, eos_ids=eos,
                                    layer_ids=ids)
    for r, p in enumerate(prompts):
        one = generate_speculative(tsess, ScriptedProposer(seqs[r], V, correct=correct[r]), p, block_size=B,
                                   max_new_tokens=max_new, eos_ids=eos)
        assert got.tokens[r] == one.tokens and got.accepted[r] == one.accepted and got.stop[r] == one.stop
    assert got.accepted[0][0] == B - 1 and len(got.accepted[1]) > len(got.accepted[0])


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"{c['kind']}-B{c['block_size']}")
def test_fixed_span_rounds_after_idle_rounds_equal_the_bounded_rounds(case):
    """What the CUDA graph replays, checked eagerly: rounds run while every row is done (the warm-up
    and capture, before any prefill) change nothing that later output depends on, and rounds over the
    fixed span max_len − B give the tokens and accepted counts of rounds bounded by the longest row."""
    from dflash_trainer.evaluation.batched_draft import BatchedDraftSession
    from dflash_trainer.evaluation.spec_rounds import SpeculativeRounds
    from dflash_trainer.target_model.batched import BatchedTarget, right_padded

    case = dict(case)
    kind, B = case.pop("kind"), case["block_size"]
    bundle, drafter = target_and_drafter(kind, **case)
    ids = drafter.config.target_layer_ids
    prompts = _prompts(case["vocab_size"], seed=4)
    ref = speculative_batch(bundle, drafter, prompts, block_size=B, max_new_tokens=25, eos_ids={2}, layer_ids=ids)
    toks, lengths = right_padded(prompts, torch.device("cpu"))
    max_len = toks.shape[1] + 25 + B
    state = SpeculativeRounds(BatchedTarget(bundle, rows=len(prompts), max_len=max_len, layer_ids=ids),
                              BatchedDraftSession(drafter, rows=len(prompts), max_len=max_len),
                              block_size=B, max_new_tokens=25, eos_ids={2}, cuda_graph=False)
    for _ in range(3):  # idle rounds, as the capture runs them: every row done, a = 0
        state.round(max_len - B)
    assert bool(state.done.all()) and int(state.count.sum()) == 0
    state.start(toks, lengths)
    for _ in range(30):  # more rounds than needed: finished rows must ride along unchanged
        state.round(max_len - B)
    assert bool(state.done.all())
    counts = state.count.tolist()
    assert [t[:c] for t, c in zip(state.out.tolist(), counts)] == ref.tokens
    assert [r[:k] for r, k in zip(state.accepted.tolist(), state.rounds.tolist())] == ref.accepted
