"""The draft length k per batch size: the engine's rounds of k drafts from a block of k+1 (decoding/engine.py)
stay lossless for every k, k = 0 never calls the drafter, and the speedup table's choice of k
(evaluation/draft_length.py, evaluation/speedup.py) follows the hand-worked cost model.

Shapes: B block size, k draft length (0 … B−1), V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from test_eval_common import ScriptedRows, greedy_reference, target_and_drafter, word_tokenizer

import dflash_trainer.decoding.engine as engine_mod
import dflash_trainer.evaluation.speedup as speedup_mod
from dflash_trainer.decoding.draft import DraftSession
from dflash_trainer.decoding.engine import PLAIN, SPECULATIVE, DecodeEngine
from dflash_trainer.evaluation.draft_length import (best_draft_length, measure_round_costs, predict_draft_lengths,
                                                    tokens_per_round)
from dflash_trainer.evaluation.speedup import speedup_table
from dflash_trainer.target_model.features import TargetFeatureExtractor

pytestmark = pytest.mark.usefixtures("one_thread")

COND = [0.8, 0.7, 0.5]  # c_1 … c_3 of a B = 4 drafter


def test_tokens_per_round_by_hand():
    """E(k) = 1 + c_1 + c_1·c_2 + …: [1, 1.8, 2.36, 2.64] for c = [0.8, 0.7, 0.5]; a position no round
    reached (None) adds nothing. Prevents summing c_i instead of the products (1 + 0.8 + 0.7 = 2.5)."""
    assert [tokens_per_round(COND, k) for k in range(4)] == pytest.approx([1.0, 1.8, 2.36, 2.64])
    assert tokens_per_round([0.5, None, 0.9], 3) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="draft length 4 outside 0 … 3"):
        tokens_per_round(COND, 4)


@pytest.mark.parametrize("round_s,best,speedup", [
    ([10, 14, 15, 16], 3, 2.64 * 10 / 16),  # verify nearly free (small batch): all drafts, 1.65×
    ([10, 12, 16, 22], 1, 1.5),  # E/t = [0.1, 0.15, 0.1475, 0.12]: one draft, 1.5×
    ([10, 20, 24, 28], 0, 1.0),  # E/t = [0.1, 0.09, 0.0983, 0.0943]: plain decoding wins
])
def test_prediction_and_choice_by_hand(round_s, best, speedup):
    """Predicted speedup E(k)·t(0)/t(k) and tokens/s b·E(k)/t(k) per k, and the best k, worked by hand
    for three cost profiles (verify cheap, costly, too costly): catches comparing E(k) alone (always
    the full k) or dividing by t(0) instead of t(k)."""
    pred = predict_draft_lengths(COND, [t / 1000 for t in round_s], batch_size=4)
    assert [p["draft_length"] for p in pred] == [0, 1, 2, 3]
    assert pred[1]["tokens_per_s"] == pytest.approx(4 * 1.8 / (round_s[1] / 1000))
    assert pred[0]["speedup"] == pytest.approx(1.0)
    assert best_draft_length(pred) == best
    assert pred[best]["speedup"] == pytest.approx(speedup)


def test_ties_choose_the_shorter_draft_and_bad_costs_are_refused():
    """Equal predicted speed: the smaller k (less verify work). Costs must be one per k and positive."""
    pred = predict_draft_lengths([0.5, 0.0], [1.0, 1.5, 1.5], batch_size=1)  # E = [1, 1.5, 1.5]
    assert [p["speedup"] for p in pred] == pytest.approx([1.0, 1.0, 1.0]) and best_draft_length(pred) == 0
    with pytest.raises(ValueError, match="one per draft length"):
        predict_draft_lengths(COND, [1.0, 1.0], batch_size=1)
    with pytest.raises(ValueError, match="> 0 seconds"):
        predict_draft_lengths(COND, [1.0, 0.0, 1.0, 1.0], batch_size=1)


def _prompts(vocab, lengths=(5, 1, 9, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (L,), generator=g).tolist() for L in lengths]


@pytest.mark.parametrize("case", [
    dict(kind="llama", vocab_size=12, block_size=4),
    dict(kind="qwen3", vocab_size=12, block_size=5, layer_types=("sliding_attention", "full_attention"),
         sliding_window=3),
], ids=lambda c: f"{c['kind']}-B{c['block_size']}")
def test_every_draft_length_is_lossless(case):
    """Greedy output equals slow greedy decoding at every k = 0 … B−1, one row and three rows at once,
    and no round accepts more than k drafts: catches verifying B tokens against k drafts, features
    written past the verified ones, or a k = 0 decode that is not plain."""
    case = dict(case)
    kind, B = case.pop("kind"), case["block_size"]
    bundle, drafter = target_and_drafter(kind, **case)
    prompts = _prompts(case["vocab_size"], lengths=(5, 1, 9, 3, 12, 7))
    ref = [greedy_reference(bundle, p, 25, {2}) for p in prompts]
    partial = False
    for rows in (1, 3):
        engine = DecodeEngine(bundle, drafter, rows=rows, max_prompt_tokens=12, max_new_tokens=25, eos_ids={2},
                              cuda_graph=False)
        for k in range(B):
            engine.set_draft_length(k)
            for c0 in range(0, len(prompts), rows):
                got = engine.decode(prompts[c0:c0 + rows], speculative=True)
                assert list(zip(got.tokens, got.stop)) == ref[c0:c0 + rows], (rows, k)
                assert all(n <= k for a in got.accepted for n in a)
                assert k > 0 or all(a == [] for a in got.accepted)  # plain decoding has no rounds
                partial |= k > 1 and any(0 < n < k for a in got.accepted for n in a)
    assert partial  # rounds accepting some but not all of the k drafts happened


def test_draft_length_zero_never_calls_the_drafter():
    """k = 0 is plain decoding: no propose, no feature write (the cost a high batch saves)."""
    bundle, drafter = target_and_drafter(vocab_size=12)
    engine = DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=9, max_new_tokens=8, eos_ids={2},
                          cuda_graph=False, draft_length=0)

    def refuse(*_a, **_k):
        raise AssertionError("the drafter was called at draft length 0")
    engine.draft.propose = engine.draft.extend = refuse
    prompts = _prompts(12, lengths=(5, 9))
    got = engine.decode(prompts, speculative=True)
    assert got.tokens == [greedy_reference(bundle, p, 8, {2})[0] for p in prompts] and got.accepted == [[], []]


def test_oracle_drafter_accepts_exactly_k_per_round(monkeypatch):
    """An oracle drafter (always right) at k = 2 of B = 4 commits k + 1 = 3 tokens per round: after
    the prefill's token, rounds of 3 until the cap (1 + 3·4 = 13 tokens in 4 rounds), every
    round accepting 2; the verify forward sees anchor + 2 drafts, never the third."""
    bundle, drafter = target_and_drafter(block_size=4)
    prompt = [1, 17, 54, 9]
    seq = prompt + greedy_reference(bundle, prompt, 20, set())[0]
    monkeypatch.setattr(engine_mod, "DraftSession", ScriptedRows([seq], bundle.vocab_size, [True]))
    engine = DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=4, max_new_tokens=13, eos_ids={999},
                          cuda_graph=False, draft_length=2)
    widths = []
    step = engine.target.step
    monkeypatch.setattr(engine.target, "step", lambda tokens, *a, **kw: (widths.append(tokens.shape[1]),
                                                                         step(tokens, *a, **kw))[1])
    out = engine.decode([prompt], speculative=True)
    assert out.tokens[0] == seq[4:17] and out.accepted == [[2, 2, 2, 2]]
    assert widths == [3, 3, 3, 3]


@pytest.mark.parametrize("k", [1, 2])
def test_draft_length_k_runs_a_block_of_k_plus_one(k):
    """Draft length k is a drafter block of k+1 slots, as vLLM (num_speculative_tokens = k) and SGLang
    (--speculative-num-draft-tokens = k+1) run it: a B = 4 engine at k proposes, round for round, the
    same drafts as an engine built at block size k+1, and decodes the same tokens and accepted counts;
    some of those rounds' drafts differ from the first k of the whole block of 4 at the same state
    (in-block attention is bidirectional), so verifying the first k of the whole block fails here."""
    bundle, drafter = target_and_drafter("qwen3", vocab_size=12, block_size=4)
    prompts = _prompts(12, lengths=(5, 1, 9, 3, 12, 7))
    kw = dict(rows=2, max_prompt_tokens=12, max_new_tokens=20, eos_ids={99}, cuda_graph=False)
    at_k = DecodeEngine(bundle, drafter, draft_length=k, **kw)
    short = DecodeEngine(bundle, drafter, block_size=k + 1, **kw)
    drafts: dict[str, list[torch.Tensor]] = {"at_k": [], "short": [], "whole": []}

    def spy(engine, name):
        propose = engine.draft.propose

        def wrapped(anchor, a, span, block, **kw):
            if name == "at_k":  # the whole block at the same state first (its slots past a+k are rewritten below)
                drafts["whole"].append(propose(anchor, a, span, 4, **kw)[:, :k].argmax(-1))
            logits = propose(anchor, a, span, block, **kw)
            drafts[name].append(logits.argmax(-1))
            return logits
        engine.draft.propose = wrapped

    spy(at_k, "at_k")
    spy(short, "short")
    for c0 in range(0, len(prompts), 2):
        got, want = (e.decode(prompts[c0:c0 + 2], speculative=True) for e in (at_k, short))
        assert got.tokens == want.tokens and got.accepted == want.accepted
    assert len(drafts["at_k"]) == len(drafts["short"]) > 10
    assert all(torch.equal(x, y) for x, y in zip(drafts["at_k"], drafts["short"]))
    assert all(x.shape == (2, k) for x in drafts["at_k"])
    assert any(not torch.equal(x, w) for x, w in zip(drafts["at_k"], drafts["whole"]))


def test_bad_draft_lengths_are_refused():
    """The error names draft_length and the range (0 … B−1, 0 = plain)."""
    bundle, drafter = target_and_drafter(block_size=4)
    with pytest.raises(ValueError, match=r"draft_length=4: must be 0 … 3 \(B−1 for block size 4; 0 = plain"):
        DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=4, max_new_tokens=6, eos_ids={2}, draft_length=4)
    engine = DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=4, max_new_tokens=6, eos_ids={2},
                          cuda_graph=False, block_size=3)
    with pytest.raises(ValueError, match="draft_length=3: must be 0 … 2"):
        engine.set_draft_length(3)
    with pytest.raises(ValueError, match="draft_length=-1"):
        engine.set_draft_length(-1)


def test_round_costs_cover_every_draft_length_and_keep_the_engine():
    """One positive median time per k = 0 … B−1, and the engine's draft length is left as it was."""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    engine = DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=9, max_new_tokens=10, eos_ids={2},
                          cuda_graph=False, draft_length=2)
    costs = measure_round_costs(engine, _prompts(12, lengths=(5, 9)), repeats=2)
    assert len(costs) == 4 and all(t > 0 for t in costs) and engine.k == 2
    with pytest.raises(ValueError, match="repeats=0"):
        measure_round_costs(engine, [[3]], repeats=0)


def test_table_measures_the_chosen_draft_length(monkeypatch):
    """With round costs that make one draft the best (t = [10, 10.5, 40, 40] ms), the table predicts
    from its own measured acceptance, chooses k = 1, then decodes and times k = 1 on the same rows,
    losslessly; the record keeps the full-k speedup beside it. Without patched costs (real CPU
    timings) the chosen k is still the best of the record's predictions."""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    prompts = _prompts(12, lengths=(5, 1, 9, 3, 12, 7))
    real = speedup_table(bundle, drafter, prompts, [1, 2], max_new_tokens=10, cuda_graph=False, cost_repeats=2)
    for r in real:
        assert r["chosen_draft_length"] == best_draft_length(r["predicted"]) and len(r["round_s"]) == 4
        assert r["chosen_lossless"] is True and r["full_draft_length"] == 3
    monkeypatch.setattr(speedup_mod, "measure_round_costs", lambda *a, **k: [0.010, 0.0105, 0.040, 0.040])
    (rec,) = speedup_table(bundle, drafter, prompts, [2], max_new_tokens=25, cuda_graph=False)
    c1 = rec["conditional_accept_per_position"][0]
    assert c1 > 0.05  # so one draft (5 % dearer than a plain step) pays: (1 + c1) / 1.05 > 1
    assert rec["chosen_draft_length"] == 1
    assert rec["chosen_predicted_speedup"] == pytest.approx((1 + c1) * 0.010 / 0.0105)
    assert rec["predicted"][1]["tokens_per_s"] == pytest.approx(2 * (1 + c1) / 0.0105)
    assert rec["chosen_lossless"] is True and 1.0 <= rec["chosen_tau"] <= 2.0
    assert rec["chosen_speedup"] > 0 and rec["speedup"] == pytest.approx(
        rec["speculative_tokens_per_s"] / rec["plain_tokens_per_s"])


def test_greedy_logits_stay_in_the_model_dtype_with_the_same_argmax():
    """A greedy round takes argmaxes only, so at bf16 the target's step and the drafter's proposal skip the
    [R,n,V] fp32 copy: the bf16 logits are exactly the values the fp32 ones copy (target: the same tensor
    before `.float()`; drafter: the plain LM head), so every argmax is the same. A drafter with a logit
    softcap keeps the fp32 path (its transform in bf16 could tie distinct logits)."""
    bundle, drafter = target_and_drafter("qwen3", vocab_size=40, block_size=4)
    bundle.model.to(torch.bfloat16)
    drafter.to(torch.bfloat16)
    engine = DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=9, max_new_tokens=6, eos_ids={99},
                          cuda_graph=False)
    engine.start(_prompts(40, lengths=(5, 9)), speculative=True)
    tokens = torch.randint(3, 39, (2, 4), generator=torch.Generator().manual_seed(2))
    exact, fast = (engine.target.step(tokens, engine.a, 13, greedy=g)[0] for g in (False, True))
    assert exact.dtype == torch.float32 and fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), exact, rtol=0, atol=0)
    sess = engine.draft
    exact, fast = (sess.propose(engine.anchor, engine.a, 9, 4, greedy=g) for g in (False, True))
    assert exact.dtype == torch.float32 and fast.dtype == torch.bfloat16 and fast.shape == exact.shape == (2, 3, 40)
    torch.testing.assert_close(fast.float(), exact, rtol=0, atol=0)
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))
    sess.drafter.config = sess.drafter.config.model_copy(update={"logit_softcap": 0.5})  # the logits function reads it
    assert sess.propose(engine.anchor, engine.a, 9, 4, greedy=True).dtype == torch.float32


def test_sampled_rounds_keep_fp32_logits():
    """At T > 0 the round's softmaxes need fp32: a bf16 engine passes greedy=False to the drafter and the
    verify (their logits come back fp32), while its plain steps, always greedy, pass greedy=True; at T = 0
    rounds pass greedy=True."""
    bundle, drafter = target_and_drafter("qwen3", vocab_size=40, block_size=4)
    bundle.model.to(torch.bfloat16)
    drafter.to(torch.bfloat16)
    for temperature, want in ((0.8, False), (0.0, True)):
        engine = DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=9, max_new_tokens=8, eos_ids={99},
                              cuda_graph=False, temperature=temperature)
        seen = {"propose": [], "verify": [], "plain": []}
        propose, step = engine.draft.propose, engine.target.step

        def spy_propose(*a, greedy=False, **kw):
            out = propose(*a, greedy=greedy, **kw)
            seen["propose"].append((greedy, out.dtype))
            return out

        def spy_step(tokens, *a, greedy=False, **kw):
            out = step(tokens, *a, greedy=greedy, **kw)
            seen["verify" if tokens.shape[1] > 1 else "plain"].append((greedy, out[0].dtype))
            return out
        engine.draft.propose, engine.target.step = spy_propose, spy_step
        engine.decode(_prompts(40, lengths=(5, 9)), speculative=True)
        engine.decode(_prompts(40, lengths=(5, 9)), speculative=False)
        dtype = torch.bfloat16 if want else torch.float32
        assert seen["propose"] and set(seen["propose"]) == {(want, dtype)}
        assert seen["verify"] and set(seen["verify"]) == {(want, dtype)}
        assert seen["plain"] and set(seen["plain"]) == {(True, torch.bfloat16)}



def test_a_new_draft_length_recaptures_only_the_round(monkeypatch):
    """`set_draft_length` replaces the speculative round's graph (its own pool) and keeps the plain step's,
    which does not depend on k; k = 0 drops the round's graph. Each mode is captured alone (one pool each).
    (capture_graphs recorded here; tests/gpu/test_draft_length_cuda.py replays real graphs.)"""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    captured = []

    def fake_capture(device, steps, *, warmups, reset):
        captured.append(sorted(steps))
        return {mode: object() for mode in steps}
    monkeypatch.setattr(engine_mod, "capture_graphs", fake_capture)
    engine = DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=9, max_new_tokens=8, eos_ids={2},
                          cuda_graph=False)
    engine.graphed = True  # as on CUDA
    engine.graphs = engine._capture(engine.graph_steps())
    assert captured == [[PLAIN], [SPECULATIVE]]
    plain, round_graph = engine.graphs[PLAIN], engine.graphs[SPECULATIVE]
    engine.set_draft_length(2)
    assert captured[2:] == [[SPECULATIVE]] and engine.graphs[PLAIN] is plain
    assert engine.graphs[SPECULATIVE] is not round_graph
    engine.set_draft_length(0)
    assert len(captured) == 3 and set(engine.graphs) == {PLAIN} and engine.graphs[PLAIN] is plain
