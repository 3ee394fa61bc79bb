"""Acceptance statistics, and the offline τ (training code path) against the inference path."""

from __future__ import annotations

import pytest
import torch
from test_eval_common import greedy_reference, target_and_drafter

from dflash_trainer.decoding.acceptance import (accept_histogram, committed_by_rounds, conditional_acceptance,
                                                  offline_acceptance, summarize_rounds, tau, tau_uncapped,
                                                  walk_rounds)
from dflash_trainer.decoding.engine import DecodeEngine
from dflash_trainer.decoding.draft import DraftSession
from dflash_trainer.target_model.features import TargetFeatureExtractor

pytestmark = pytest.mark.usefixtures("one_thread")

def test_round_statistics_by_hand():
    """Rounds accepting n = 3, 0, 1, 3, 2 drafts at B = 4: τ_uncapped = 1 + 9/5; P(k accepted | < k
    accepted) = 4/5, 3/4, 2/3; the histogram counts rounds by n. One turn per prompt, its first new
    token the prefill's. Prompt a (cap 12 new tokens): its rounds offer n+1 = 4 and 1 tokens, all
    committed: 1 + 4 + 1 = 6 new tokens, 5 by the rounds. Prompt b (cap 8): its rounds offer 2, 4 and
    3, and after 1 + 2 + 4 = 7 the cap leaves room for 1: 8 new tokens, 2 + 4 + 1 = 7 by the rounds.
    Committed τ pools (5 + 7) / 5 rounds = 12/5; per prompt 5/2 and 7/3."""
    rounds = [3, 0, 1, 3, 2]
    hist = accept_histogram(rounds, 4)
    assert hist == [1, 1, 1, 2]
    assert tau_uncapped(rounds) == pytest.approx(2.8)
    assert conditional_acceptance(hist) == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    accepted, cap = {"a": [3, 0], "b": [1, 3, 2]}, {"a": 12, "b": 8}

    def new_tokens(pid):  # the turn's output: the prefill's token, then each round's offer up to the cap
        out = [0]
        for n in accepted[pid]:
            out += [0] * min(n + 1, cap[pid] - len(out))
        return out

    tokens = {pid: new_tokens(pid) for pid in accepted}
    assert {pid: len(t) for pid, t in tokens.items()} == {"a": 6, "b": 8}
    committed = {pid: committed_by_rounds(t) for pid, t in tokens.items()}
    assert committed == {"a": 5, "b": 7}
    s = summarize_rounds(accepted, committed, 4)
    assert s["tau"] == pytest.approx(12 / 5) and s["tau_uncapped"] == pytest.approx(2.8) and s["rounds"] == 5
    assert s["tau_per_prompt"] == {"a": pytest.approx(5 / 2), "b": pytest.approx(7 / 3)} and s["committed_tokens"] == 12
    assert conditional_acceptance([5, 0, 0, 0]) == [0.0, None, None]
    assert tau(0, 0) is None and tau_uncapped([]) is None
    with pytest.raises(ValueError):
        accept_histogram([4], 4)
    with pytest.raises(ValueError, match="same prompts"):
        summarize_rounds({"a": [1]}, {"b": 2}, 4)


def test_walk_rounds_by_hand():
    """Runs [2, 0, 0, 1, 0] over a 6-token response: anchor 0 commits tokens 1, 2 (drafts) and 3 (the target's),
    anchor 3 commits 4 and 5: 2 rounds, τ 5/2. No run accepted: one round per token. One long run: one round."""
    assert walk_rounds([2, 0, 0, 1, 0]) == 2
    assert walk_rounds([0, 0, 0]) == 3 and walk_rounds([3, 0, 0]) == 1 and walk_rounds([]) == 0
    assert walk_rounds([0, 2, 1, 0]) == 2  # anchors 0 and 1
    with pytest.raises(ValueError, match="≥ 0"):
        walk_rounds([1, -1])


def test_tau_of_an_eval_jsons_turns_is_committed_tau():
    """The same two turns as eval JSON per-turn records ({tokens: new tokens, rounds}): committed τ
    (6 − 1 + 8 − 1) / (2 + 3) = 12/5, the eval's `tau`; counting each turn's prefill token too gave
    14/5. benchmarks/recipe_report.py's τ of the first n prompts reads it so (here n = 1: 5/2)."""
    import importlib.util
    from pathlib import Path

    from dflash_trainer.decoding.committed import tau_of_turns

    turns = [{"tokens": 6, "rounds": 2}, {"tokens": 8, "rounds": 3}]
    assert tau_of_turns(turns) == pytest.approx(12 / 5) and tau_of_turns([]) is None
    assert tau_of_turns([{"tokens": 0, "rounds": 0}]) is None
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "recipe_report.py"
    spec = importlib.util.spec_from_file_location("recipe_report", path)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    ev = {"per_prompt": [{"id": "a", "turns": turns[:1]}, {"id": "b", "turns": turns[1:]}]}
    assert report._tau_first(ev, 64) == pytest.approx(12 / 5) and report._tau_first(ev, 1) == pytest.approx(5 / 2)
    assert report._tau_first(None, 64) is None


def test_tau_breakdown_hand_worked():
    """Two MT-Bench-like prompts: "a" (writing) turn 1 = 11 new tokens in 3 rounds (eos), turn 2 = 5 in 1
    (cap); "b" (math) turn 1 = 9 in 4 (cap). Committed tokens are new tokens less one: turn 1 pools
    (10 + 8) / 7, turn 2 4 / 1; ended by eos 10/3, by the cap (4 + 8) / 5; writing (10 + 4) / 4, math 8/4.
    A prompt without a category joins no category group."""
    from dflash_trainer.decoding.committed import breakdown_line, tau_breakdown

    per_prompt = [{"id": "a", "category": "writing", "turns": [{"turn": 0, "tokens": 11, "rounds": 3, "stop": "eos"},
                                                               {"turn": 1, "tokens": 5, "rounds": 1, "stop": "length"}]},
                  {"id": "b", "category": "math", "turns": [{"turn": 0, "tokens": 9, "rounds": 4, "stop": "length"}]},
                  {"id": "c", "turns": []}]
    b = tau_breakdown(per_prompt)
    assert {k: (g["tau"], g["turns"], g["rounds"]) for k, g in b["by_turn"].items()} == {
        "1": (pytest.approx(18 / 7), 2, 7), "2": (4.0, 1, 1)}
    assert b["by_stop"]["eos"]["tau"] == pytest.approx(10 / 3) and b["by_stop"]["length"]["tau"] == pytest.approx(12 / 5)
    assert b["by_category"]["writing"]["tau"] == pytest.approx(14 / 4) and b["by_category"]["math"]["tau"] == 2.0
    assert list(b["by_turn"]) == ["1", "2"] and list(b["by_category"]) == ["writing", "math"]
    assert {k: g["tau"] for k, g in b["by_turn_and_stop"].items()} == {
        "1 eos": pytest.approx(10 / 3), "1 length": 2.0, "2 length": 4.0}
    assert breakdown_line(b) == ("turn 1 2.57 · turn 2 4.00 | ended by eos 3.33 · length 2.40 | writing 3.50 · math 2.00")
    assert breakdown_line(tau_breakdown([{"id": "x", "turns": [{"turn": 0, "tokens": 1, "rounds": 0, "stop": "eos"}]}])) \
        == "turn 1 - | ended by eos -"


def test_committed_tau_counts_only_what_the_turn_kept():
    """The issue's arithmetic: 3 rounds each accepting 4 drafts (+1 bonus: 15 tokens offered) that
    committed 10 tokens: τ = 10/3 ≈ 3.33, while counting each round in full gives 5.0. The bug this
    prevents: τ above what the output holds per verify forward. (In the engine the prefill commits a
    turn's first token, so rounds commit its new tokens less one: the next test.)"""
    assert tau(10, 3) == pytest.approx(10 / 3) and tau_uncapped([4, 4, 4]) == 5.0
    assert committed_by_rounds([7, 8, 9]) == 2 and committed_by_rounds([]) == 0


def test_committed_tau_of_the_engine_at_its_cap():
    """A drafter that always agrees with the target (B = 5: 4 drafts accepted every round) decoding
    12 new tokens: the prefill commits 1, the rounds 5, 5 and 1 (the cap): τ = 11/3 ≈ 3.67, τ_uncapped
    = 5.0. Checked through the real engine, whose stopping rule decides what is committed."""
    bundle, drafter = target_and_drafter(vocab_size=8, block_size=5)
    prompt = [1, 5, 3, 6]
    ref = greedy_reference(bundle, prompt, 12 + 5, set())[0]  # past the cap: the last round's drafts
    engine = DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=4, max_new_tokens=12, eos_ids={99})

    def agree(anchor, a, span, B, greedy=False):  # [R,B−1,V] logits whose argmax is the target's greedy continuation
        done = int(a[0]) - len(prompt) + 1  # new tokens committed so far (the anchor is the last)
        return torch.nn.functional.one_hot(torch.tensor([ref[done:done + B - 1]]), 8).float() * 10

    engine.draft.propose = agree
    out = engine.decode([prompt], speculative=True)
    assert out.tokens[0] == ref[:12] and out.accepted[0] == [4, 4, 4]
    s = summarize_rounds({"p": out.accepted[0]}, {"p": committed_by_rounds(out.tokens[0])}, 5)
    assert s["tau"] == pytest.approx(11 / 3) and s["tau_uncapped"] == 5.0


def test_offline_tau_equals_per_anchor_inference():
    """The offline τ (blocks + dense masks + block_loss over [prompt + response]) equals running the
    inference path block by block at every response position and counting the leading run of slots
    that match the target's greedy continuation: training metrics and serving see the same model.
    An 8-token vocabulary makes a random drafter right often enough for the counts to mean something."""
    bundle, drafter = target_and_drafter(vocab_size=8, block_size=4)
    prompt = [1, 5, 3, 6]
    resp = greedy_reference(bundle, prompt, 40, set())[0]
    extractor = TargetFeatureExtractor(bundle, drafter.config.target_layer_ids)
    off = offline_acceptance(drafter, extractor, [(prompt, resp)], anchors_per_pass=7)

    seq = prompt + resp
    T = len(seq)
    tgt = extractor(torch.tensor([seq]), torch.arange(T)[None])
    sess = DraftSession(drafter, rows=1, max_len=T + 4)
    sess.extend(tgt.features[:, :len(prompt)], torch.tensor([0]))
    runs, correct, count = [], [0] * 4, [0] * 4
    for a in range(len(prompt), T - 1):
        pred = sess.propose(torch.tensor([seq[a]]), torch.tensor([a]), a)[0].argmax(-1).tolist()  # slots 1..3
        run, alive = 0, True
        for k in range(1, 4):
            if a + k >= T:
                break
            ok = pred[k - 1] == int(tgt.argmax[0, a + k - 1])
            correct[k] += ok
            count[k] += 1
            alive = alive and ok
            run += alive
        runs.append(run)
        sess.extend(tgt.features[:, a:a + 1], torch.tensor([a]))
    assert off["num_blocks"] == len(runs)
    assert off["tau_exact"] == pytest.approx(1 + sum(runs) / len(runs))
    # decoding's anchors: the first response token, then one past each round's accepted run and bonus token
    i, walked = 0, []
    while i < len(runs):
        walked.append(i)
        i += runs[i] + 1
    assert off["walk_rounds"] == len(walked) == walk_rounds(runs) < len(runs)
    assert off["tau_walk"] == pytest.approx((len(resp) - 1) / len(walked))
    assert off["acc_per_position"] == pytest.approx([correct[k] / count[k] for k in range(1, 4)])
    assert sum(correct) > 0


def test_offline_tau_smaller_block_and_zero_features():
    """An inference block size below the trained one, and zeroed features, run through the same code."""
    bundle, drafter = target_and_drafter(vocab_size=8, block_size=4)
    extractor = TargetFeatureExtractor(bundle, drafter.config.target_layer_ids)
    off = offline_acceptance(drafter, extractor, [([1, 2, 3], [4, 5, 6, 7, 4, 5])], block_size=2, zero_features=True)
    assert len(off["acc_per_position"]) == 1 and off["num_blocks"] == 5
    assert 1.0 <= off["tau_exact"] <= 2.0
