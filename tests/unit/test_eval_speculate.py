"""DFlash speculative decoding on tiny random targets: lossless at T=0, τ of oracle / wrong drafters,
and the output distribution at T>0 (chi-square against the exact target distribution).

Shapes: P prompt tokens, B block size, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from test_eval_common import ScriptedProposer, target_and_drafter
from test_eval_common import one_thread  # noqa: F401  (fixture, used by pytestmark)

from dflash_trainer.evaluation.draft import DraftSession
from dflash_trainer.evaluation.speculate import (TargetSession, generate_plain, generate_speculative, verify_greedy,
                                                 verify_sampling)
from dflash_trainer.target_model.features import TargetFeatureExtractor

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 17, 54, 9], [1, 88], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_untrained_drafter_is_lossless_at_t0(kind):
    """Greedy speculative decoding returns exactly the target's greedy output (whatever the drafter
    proposes): catches a wrong verify offset, a KV cache not cropped after a rejection, or features
    appended for the wrong positions. gemma3 decodes far past its sliding window (4), so a cache
    crop that loses the window's keys would show."""
    bundle, drafter = target_and_drafter(kind, random_weights=False)
    tsess = TargetSession(bundle, drafter.config.target_layer_ids)
    dsess = DraftSession(drafter)
    rounds = 0
    for prompt in PROMPTS:
        for B in (4, 3):
            ref = generate_plain(tsess, prompt, max_new_tokens=30, eos_ids={2})
            spec = generate_speculative(tsess, dsess, prompt, block_size=B, max_new_tokens=30, eos_ids={2})
            assert spec.tokens == ref.tokens
            assert spec.stop == ref.stop
            rounds += len(spec.accepted)
    assert rounds >= 10

def _greedy_sequence(bundle, prompt, n):
    tsess = TargetSession(bundle)
    return prompt + generate_plain(tsess, prompt, max_new_tokens=n, eos_ids=set()).tokens


def test_oracle_drafter_gives_tau_b_and_is_fed_exact_features():
    """A drafter proposing the target's own greedy continuation is accepted in full every round:
    τ = B (each round commits B−1 drafts + the bonus). The loop hands it, in order, exactly the
    features of the committed positions (equal to one plain forward over the whole sequence), and
    anchors every round at the last committed token."""
    bundle, drafter = target_and_drafter(block_size=4)
    B, rounds = 4, 6
    prompt = PROMPTS[0]
    seq = _greedy_sequence(bundle, prompt, 1 + rounds * B + B)
    oracle = ScriptedProposer(seq, bundle.vocab_size, correct=True)
    tsess = TargetSession(bundle, drafter.config.target_layer_ids)
    out = generate_speculative(tsess, oracle, prompt, block_size=B, max_new_tokens=1 + rounds * B, eos_ids=set())
    assert out.tokens == seq[len(prompt):len(prompt) + 1 + rounds * B]
    assert out.accepted == [B - 1] * rounds
    assert 1 + sum(out.accepted) / len(out.accepted) == B
    # anchors: the last committed token at its position
    assert [(t, p) for t, p in oracle.anchors] == [(seq[p], p) for _, p in oracle.anchors]
    assert [p for _, p in oracle.anchors] == [len(prompt) + r * B for r in range(rounds)]
    # features of positions 0 … last anchor − 1, as a single forward over the sequence computes them
    fed = torch.cat(oracle.features)  # [L,k·H]
    L = fed.shape[0]
    ids = torch.tensor([seq[:L]])
    want = TargetFeatureExtractor(bundle, drafter.config.target_layer_ids)(ids, torch.arange(L)[None]).features[0]
    torch.testing.assert_close(fed, want, atol=1e-4, rtol=1e-4)


def test_always_wrong_drafter_gives_tau_one_and_stays_lossless():
    """A drafter that is never right still advances one token per round (the bonus): τ = 1."""
    bundle, _ = target_and_drafter()
    prompt = PROMPTS[1]
    seq = _greedy_sequence(bundle, prompt, 40)
    wrong = ScriptedProposer(seq, bundle.vocab_size, correct=False)
    tsess = TargetSession(bundle, [0, 2])
    out = generate_speculative(tsess, wrong, prompt, block_size=4, max_new_tokens=20, eos_ids=set())
    assert out.tokens == seq[len(prompt):len(prompt) + 20]
    assert out.accepted == [0] * 19  # the first token comes from the prefill


def test_eos_stops_mid_round_like_plain_decoding():
    """An end-of-sequence token accepted inside a block ends the output there, as plain decoding does."""
    bundle, _ = target_and_drafter()
    prompt = PROMPTS[2]
    seq = _greedy_sequence(bundle, prompt, 20)
    stop_tok = seq[len(prompt) + 6]  # the 7th generated token acts as eos
    oracle = ScriptedProposer(seq, bundle.vocab_size, correct=True)
    tsess = TargetSession(bundle, [0, 2])
    ref = generate_plain(tsess, prompt, max_new_tokens=20, eos_ids={stop_tok})
    out = generate_speculative(tsess, oracle, prompt, block_size=4, max_new_tokens=20, eos_ids={stop_tok})
    assert out.tokens == ref.tokens and out.stop == ref.stop == "eos" and out.tokens[-1] == stop_tok


def test_verify_greedy_leading_run():
    """n counts the leading run only; the bonus is the target's token right after it."""
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == (3, 8)
    assert verify_greedy([5, 9, 7], [5, 6, 7, 8]) == (1, 6)
    assert verify_greedy([4, 6, 7], [5, 6, 7, 8]) == (0, 5)


def test_rejection_sampling_first_token_follows_p():
    """With q ≠ p the first committed token of a round is distributed as p (chi-square, fixed seed),
    and with q = p every draft is accepted."""
    g = torch.Generator().manual_seed(0)
    V, B = 6, 3
    p = torch.softmax(torch.randn(B, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(B - 1, V, generator=g) * 1.5, -1)
    counts = torch.zeros(V)
    draws = 8000
    for _ in range(draws):
        drafts = torch.multinomial(q, 1, generator=g)[:, 0].tolist()
        n, tok = verify_sampling(drafts, q, p, g)
        counts[drafts[0] if n >= 1 else tok] += 1
    assert chisquare(counts.numpy(), (p[0] * draws).numpy()).pvalue > 1e-3
    drafts = torch.multinomial(p[:B - 1], 1, generator=g)[:, 0].tolist()
    assert verify_sampling(drafts, p[:B - 1], p, g)[0] == B - 1


def _exact_joint(bundle, prompt, steps, temperature):
    """Exact distribution of the next `steps` tokens of the target sampled at `temperature`
    (enumerates every prefix; V^steps cells)."""
    V = bundle.vocab_size
    probs = {(): 1.0}
    for _ in range(steps):
        prefixes = list(probs)
        ids = torch.tensor([prompt + list(pre) for pre in prefixes])
        logits = bundle.model(input_ids=ids).logits[:, -1].float()
        nxt = torch.softmax(logits / temperature, -1)
        probs = {pre + (v,): probs[pre] * float(nxt[i, v]) for i, pre in enumerate(prefixes) for v in range(V)}
    return probs


def test_speculative_sampling_matches_target_distribution():
    """At T>0 the tokens of speculative sampling (drafts accepted with min(1, p/q), residual
    resampling, bonus from p) are distributed as the target's own samples: chi-square of the joint
    of generated tokens 2–3 (which go through draft acceptance) and of token 3 against the exact
    distribution, on an 8-token vocabulary, fixed seed."""
    V, T = 8, 0.8
    bundle, drafter = target_and_drafter(vocab_size=V, block_size=3, hidden=32, intermediate=64, num_layers=2,
                                         layer_ids=(0, 1), layer_types=("full_attention",))
    prompt = [1, 5, 3]
    exact = _exact_joint(bundle, prompt, 3, T)
    tsess = TargetSession(bundle, drafter.config.target_layer_ids)
    dsess = DraftSession(drafter)
    g = torch.Generator().manual_seed(1)
    draws = 700
    counts = torch.zeros(V, V)
    for _ in range(draws):
        out = generate_speculative(tsess, dsess, prompt, block_size=3, max_new_tokens=3, eos_ids=set(),
                                   temperature=T, generator=g)
        counts[out.tokens[1], out.tokens[2]] += 1
    want = torch.zeros(V, V)
    for (_, b, c), pr in exact.items():
        want[b, c] += pr
    obs, exp = counts.flatten(), want.flatten() * draws
    small = exp < 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3
    assert chisquare(counts.sum(0).numpy(), (want.sum(0) * draws).numpy()).pvalue > 1e-3


def test_speculative_rejects_bad_arguments():
    bundle, drafter = target_and_drafter()
    tsess, dsess = TargetSession(bundle, [0, 2]), DraftSession(drafter)
    with pytest.raises(ValueError, match="empty prompt"):
        generate_speculative(tsess, dsess, [], block_size=4, max_new_tokens=4, eos_ids=set())
    with pytest.raises(ValueError, match="block_size=5"):
        generate_speculative(tsess, dsess, [1, 2], block_size=5, max_new_tokens=4, eos_ids=set())

