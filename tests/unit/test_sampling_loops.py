"""Sampling by inverse CDF, top-p, and the loop guard (decoding/sampling.py) and their use in
continuous batching: the choice matches the distribution it claims, the nucleus keeps exactly the
tokens it should, a loop is flagged exactly when the tail repeats, and generation stopped by the
guard is a prefix of plain greedy decoding."""

from __future__ import annotations

import pytest
import torch
from test_eval_common import greedy_reference

from dflash_trainer.decoding.continuous import ContinuousGenerator, generate_all, span_ladder
from dflash_trainer.decoding.sampling import check_sampling, pick_tokens, repeated_tail
from tests.tiny_targets import tiny_bundle

pytestmark = pytest.mark.usefixtures("one_thread")


def test_greedy_is_argmax_and_inverse_cdf_by_hand():
    """T = 0 is argmax whatever the uniforms; T = 1 picks the first token whose cumulative
    probability exceeds u (worked by hand for p = [0.1, 0.2, 0.7])."""
    logits = torch.randn(5, 9)
    assert torch.equal(pick_tokens(logits, 0.0), logits.argmax(-1))
    probs = torch.tensor([0.1, 0.2, 0.7])
    rows = probs.log().expand(5, 3)
    u = torch.tensor([0.05, 0.15, 0.31, 0.999, 0.0])
    assert pick_tokens(rows, 1.0, uniforms=u).tolist() == [0, 1, 2, 2, 0]


def test_sampling_matches_softmax_at_temperature():
    """20,000 draws from one row of logits at T = 0.7: every frequency is within 5 standard
    deviations of softmax(logits / 0.7)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20_000
    picks = pick_tokens(logits.expand(n, 6), 0.7, uniforms=torch.rand(n, generator=g))
    freq = torch.bincount(picks, minlength=6).double() / n
    p = torch.softmax(logits.double() / 0.7, -1)
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-4).all(), (freq, p)


@pytest.mark.parametrize("top_p,kept", [(0.7, [0, 1]), (0.5, [0]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_nucleus(top_p, kept):
    """p = [0.5, 0.3, 0.15, 0.05] (shuffled in the vocabulary): the nucleus is the smallest set of
    most likely tokens whose mass reaches top_p; draws follow the renormalized nucleus."""
    p = torch.tensor([0.15, 0.5, 0.05, 0.3])  # vocabulary order; ranks: 1, 3, 0, 2
    rank_to_token = [1, 3, 0, 2]
    g = torch.Generator().manual_seed(1)
    n = 20_000
    picks = pick_tokens(p.log().expand(n, 4), 1.0, top_p, uniforms=torch.rand(n, generator=g))
    freq = torch.bincount(picks, minlength=4).double() / n
    want = torch.zeros(4, dtype=torch.double)
    for r in kept:
        want[rank_to_token[r]] = p[rank_to_token[r]]
    want /= want.sum()
    assert ((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-4).all(), (freq, want)
    assert (freq[want == 0] == 0).all()


def test_sampling_settings_are_checked():
    with pytest.raises(ValueError, match="temperature"):
        check_sampling(-0.1, 1.0)
    with pytest.raises(ValueError, match="top_p"):
        check_sampling(0.7, 0.0)
    with pytest.raises(ValueError, match="uniforms"):
        pick_tokens(torch.randn(2, 3), 0.5)


def _repeats_reference(row: list[int], count: int, n: int) -> bool:
    """Plain loop: do the last n of the first count tokens occur at an earlier start?"""
    if count <= n:
        return False
    tail = row[count - n:count]
    return any(row[j:j + n] == tail for j in range(count - n))


def test_repeated_tail_by_hand_and_against_a_loop():
    """Hand-worked rows (a period-3 loop, a period-1 loop, no loop, stale tokens past the count,
    an overlapping period-2 loop), then 300 random rows against a plain Python loop."""
    out = torch.tensor([
        [1, 2, 3, 1, 2, 3, 0, 0],
        [7, 7, 7, 7, 0, 0, 0, 0],
        [1, 2, 3, 4, 5, 6, 0, 0],
        [1, 2, 3, 1, 2, 3, 1, 2],  # only 4 counted: the repeat lies past the count
        [1, 2, 1, 2, 1, 0, 0, 0],
    ])
    count = torch.tensor([6, 4, 6, 4, 5])
    assert repeated_tail(out, count, 3).tolist() == [True, True, False, False, True]  # 1 2 1 | 2 1: 3 + 2 tokens
    assert repeated_tail(out, count, 2).tolist() == [True, True, False, False, True]
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 3, (300, 24), generator=g)
    counts = torch.randint(0, 25, (300,), generator=g)
    for n in (2, 4, 6):
        got = repeated_tail(rows, counts, n).tolist()
        want = [_repeats_reference(r, int(c), n) for r, c in zip(rows.tolist(), counts)]
        assert got == want
    with pytest.raises(ValueError, match="n-gram"):
        repeated_tail(out, count, 0)


def test_span_ladder():
    assert span_ladder(100) == [100]
    assert span_ladder(256) == [256]
    assert span_ladder(1536) == [256, 512, 768, 1024, 1280, 1536]
    assert span_ladder(600) == [256, 512, 600]


def test_loop_guard_stops_greedy_decoding_at_its_first_repeat():
    """Each sequence stopped by the guard is a prefix of plain greedy decoding that ends with a
    repeat (checked by the plain loop), and the guard fired no later than sync_every steps after
    the first repeat; sequences it did not stop equal greedy decoding."""
    bundle = tiny_bundle("llama", vocab_size=12)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (4, 2, 7, 5, 3, 6)]
    n, sync = 3, 2
    gen = ContinuousGenerator(bundle, slots=3, max_prompt_tokens=8, max_new_tokens=40, eos_ids={2},
                              sync_every=sync, loop_ngram=n)
    got = generate_all(gen, prompts)
    looped = 0
    for p, f in zip(prompts, got):
        ref = greedy_reference(bundle, p, 40, {2})[0]
        if not f.looped:
            assert f.tokens == ref
            continue
        looped += 1
        assert not f.finished and f.tokens == ref[:len(f.tokens)]
        first = next(c for c in range(1, len(ref) + 1) if _repeats_reference(ref, c, n))
        assert first <= len(f.tokens) < first + sync
    assert looped >= 2  # tiny random targets loop quickly; the test must exercise the guard


def test_sampled_generation_is_seeded():
    """T > 0: the same seed gives the same tokens, another seed other tokens."""
    bundle = tiny_bundle("qwen3", vocab_size=12)
    prompts = [[3, 4, 5], [6], [7, 8, 9, 10], [5, 5]]

    def run(seed):
        gen = ContinuousGenerator(bundle, slots=2, max_prompt_tokens=6, max_new_tokens=12, eos_ids={2},
                                  temperature=0.9, top_p=0.9, generator=torch.Generator().manual_seed(seed),
                                  sync_every=4)
        return [f.tokens for f in generate_all(gen, prompts)]

    a, b, c = run(0), run(0), run(1)
    assert a == b and a != c


def test_sampled_generation_draws_one_fresh_uniform_per_step():
    """Replays one row by hand: the first token from the prefill logits and one uniform, then each
    stretch of sync_every steps from [sync_every, rows] uniforms drawn at once, one per step in
    order (a step counter that stopped advancing would reuse a uniform and fail this)."""
    bundle = tiny_bundle("llama", vocab_size=12)
    prompt, n_new, sync, temp, top_p = [3, 5, 7], 11, 4, 1.3, 0.95
    gen = ContinuousGenerator(bundle, slots=1, max_prompt_tokens=4, max_new_tokens=n_new, eos_ids={99},
                              temperature=temp, top_p=top_p, generator=torch.Generator().manual_seed(3), sync_every=sync)
    got = generate_all(gen, [prompt])[0].tokens

    g = torch.Generator().manual_seed(3)

    def last_logits(seq):
        with torch.no_grad():
            return bundle.model(torch.tensor([seq])).logits[:, -1].float()  # [1,V]

    want = [int(pick_tokens(last_logits(prompt), temp, top_p, torch.rand(1, generator=g))[0])]
    while len(want) < n_new:
        noise = torch.rand((sync, 1), generator=g)
        for i in range(sync):
            if len(want) < n_new:
                want.append(int(pick_tokens(last_logits(prompt + want), temp, top_p, noise[i])[0]))
    assert got == want
    assert len(set(got)) > 3  # a sampled sequence, not a constant one


def test_shortest_first_starts_the_shortest_prompts_and_changes_no_output():
    """With more prompts queued than rows, free rows take the shortest waiting prompts (long ones
    wait); every sequence still equals plain greedy decoding."""
    bundle = tiny_bundle("llama", vocab_size=12)
    g = torch.Generator().manual_seed(6)
    lengths = (9, 2, 7, 1, 5, 3)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in lengths]
    gen = ContinuousGenerator(bundle, slots=2, max_prompt_tokens=10, max_new_tokens=6, eos_ids={2},
                              sync_every=2, shortest_first=True)
    for i, p in enumerate(prompts):
        gen.submit(i, p)
    started = []
    got = {}
    while gen.busy:
        before = set(k for k in gen.keys if k is not None)
        done = gen.poll()
        started += [k for k in gen.keys if k is not None and k not in before and k not in started]
        started += [f.key for f in done if f.key not in started]  # started and finished within one poll
        got.update((f.key, f.tokens) for f in done)
    assert set(started[:2]) == {3, 1} and started[2] == 5  # lengths 1 and 2 first, then 3
    for i, p in enumerate(prompts):
        assert got[i] == greedy_reference(bundle, p, 6, {2})[0]


def test_cache_attention_equals_sdpa():
    """The batched-matmul attention of the cache steps, given the additive mask (0 / −inf) the steps
    build, equals SDPA with the same boolean mask (fp32, odd sizes, strided key/value views of a
    longer cache, GQA-folded query rows)."""
    from dflash_trainer.decoding.static_layer import cache_attention

    g = torch.Generator().manual_seed(7)
    m, hkv, M, K, D, S = 3, 2, 5, 13, 8, 20
    q = torch.randn(m, hkv, M, D, generator=g)
    cache_k, cache_v = torch.randn(m, hkv, S, D, generator=g), torch.randn(m, hkv, S, D, generator=g)
    keys, values = cache_k[:, :, :K], cache_v[:, :, :K]
    visible = torch.rand(m, 1, M, K, generator=g) < 0.6
    visible[..., 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=0.3)
    additive = torch.where(visible, 0.0, float("-inf"))
    torch.testing.assert_close(cache_attention(q, keys, values, additive, 0.3), ref, atol=1e-6, rtol=1e-5)
