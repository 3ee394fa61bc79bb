"""Continuous batching over the decoding engine (decoding/stream.py) on tiny random targets: every
prompt's output equals slow greedy decoding and its accepted counts equal a batch-1 decode while rows
are refilled mid-flight (eagerly and through the fixed-span steps CUDA graphs replay), the steady
state is the part before the last refill, and bad input fails before anything decodes."""

from __future__ import annotations

import pytest
import torch
from test_eval_common import greedy_reference, replay_eagerly, target_and_drafter

from dflash_trainer.decoding.engine import PLAIN, SPECULATIVE, DecodeEngine
from dflash_trainer.decoding.stream import decode_stream

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (5, 1, 9, 3, 12, 7, 2, 10, 4)  # 9 prompts of mixed lengths
CAP = 20


def _prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (L,), generator=g).tolist() for L in LENGTHS]


def _engine(bundle, drafter, rows, replayed=False, **kw):
    engine = DecodeEngine(bundle, drafter, rows=rows, max_prompt_tokens=12, max_new_tokens=CAP, eos_ids={2},
                          cuda_graph=False, **kw)
    if replayed:  # what capture_graphs runs (3 warm-ups and the capture, every row done), then fixed-span steps
        replay_eagerly(engine)
    return engine


@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_refilled_rows_decode_as_they_would_alone(kind, replayed):
    """9 prompts through 3 rows: each prompt's tokens and stop equal slow greedy decoding, and its
    accepted drafts per round equal a batch-1 `decode` of it, for plain and speculative decoding.
    Catches a refill that leaves a row's old cache, context, counts or rounds visible to its next
    prompt, or that disturbs the rows still decoding."""
    extra = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=3) if kind == "qwen3" else {}
    bundle, drafter = target_and_drafter(kind, vocab_size=12, block_size=4, **extra)
    prompts = _prompts(12)
    refs = [greedy_reference(bundle, p, CAP, {2}) for p in prompts]
    assert {s for _, s in refs} == {"eos", "length"}  # rows end at different times: refills mid-flight
    alone = _engine(bundle, drafter, rows=1)
    single = [alone.decode([p], speculative=True).accepted[0] for p in prompts]
    engine = _engine(bundle, drafter, rows=3, replayed=replayed)
    for mode in (PLAIN, SPECULATIVE):
        out = decode_stream(engine, prompts, speculative=mode == SPECULATIVE)
        assert list(zip(out.tokens, out.stop)) == refs, mode
        if mode == SPECULATIVE:
            assert out.accepted == single
            assert any(0 < n < 3 for rows in out.accepted for n in rows)  # partial acceptance happened
        else:
            assert out.accepted == [[] for _ in prompts]


def test_steady_state_ends_at_the_last_refill_and_progress_adds_up():
    """With more prompts than rows, the steady state's tokens and seconds are a part of the whole
    (the last prompts still decode after it) and its rate is what `tokens_per_s` gives; the progress
    callback's totals never fall and end at every committed token. With no more prompts than rows
    there is no steady state and the rate is over the whole stream."""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    prompts = _prompts(12)
    engine = _engine(bundle, drafter, rows=3)
    seen: list[int] = []
    out = decode_stream(engine, prompts, speculative=True, on_round=seen.append)
    total = sum(map(len, out.tokens))
    assert 0 < out.steady_tokens < total and 0 < out.steady_s < out.wall_s
    assert out.tokens_per_s() == pytest.approx(out.steady_tokens / out.steady_s)
    assert seen == sorted(seen) and seen[-1] == total
    few = decode_stream(engine, prompts[:3], speculative=False)
    assert few.steady_tokens is None and few.steady_s is None
    assert few.tokens_per_s() == pytest.approx(sum(map(len, few.tokens)) / few.wall_s)


def test_sampled_stream_is_reproducible_and_refills():
    """At T > 0 (speculative sampling; refills draw their first token from the same generator) the same
    seed gives the same outputs, every prompt is answered within the cap, and rows were refilled."""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    prompts = _prompts(12)
    outs = []
    for _ in range(2):
        engine = _engine(bundle, drafter, rows=2, temperature=0.9, generator=torch.Generator().manual_seed(5))
        outs.append(decode_stream(engine, prompts, speculative=True))
    assert outs[0].tokens == outs[1].tokens and outs[0].accepted == outs[1].accepted
    assert all(1 <= len(t) <= CAP for t in outs[0].tokens) and outs[0].steady_tokens is not None


def test_bad_input_fails_before_decoding():
    """No prompts, a too long or empty prompt anywhere in the list, or a speculative stream without a
    drafter: ValueError naming the limit, before any row is prefilled."""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    engine = _engine(bundle, drafter, rows=2)
    with pytest.raises(ValueError, match="no prompts"):
        decode_stream(engine, [], speculative=True)
    for bad in ([[5, 6], [7] * 13], [[5, 6], []]):
        with pytest.raises(ValueError, match="max_prompt_tokens"):
            decode_stream(engine, bad, speculative=False)
    plain_only = DecodeEngine(bundle, None, rows=2, max_prompt_tokens=12, max_new_tokens=4, eos_ids={2},
                              cuda_graph=False)
    with pytest.raises(ValueError, match="needs a drafter"):
        decode_stream(plain_only, [[5, 6]], speculative=True)


@pytest.mark.parametrize("cap", [2, 3, 8])
def test_long_prompts_refilled_after_short_ones_eagerly(cap):
    """Eager steps attend over the slots up to the longest row: a refill with a longer prompt than any
    row held must widen that bound at once. Short prompts that finish first, then long ones, through 2
    rows, under a cap on new tokens: each output equals a batch-1 decode, plain and speculative."""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (1, 1, 12, 12, 11, 12)]
    alone = _engine(bundle, drafter, rows=1)
    engine = _engine(bundle, drafter, rows=2)
    for speculative in (False, True):
        want = [alone.decode([p], speculative=speculative, max_new_tokens=cap) for p in prompts]
        got = decode_stream(engine, prompts, speculative=speculative, max_new_tokens=cap)
        assert got.tokens == [w.tokens[0] for w in want] and got.stop == [w.stop[0] for w in want]
        assert got.accepted == [w.accepted[0] for w in want]


def test_a_prompt_answered_by_eos_at_once_frees_its_row():
    """A prompt whose first token is the end of sequence ends at refill (one token, stop eos) and its row
    takes the next prompt; every output still equals slow greedy decoding."""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    prompts = _prompts(12)
    eos = {greedy_reference(bundle, prompts[4], 1, set())[0][0]}  # prompt 4's first token ends it
    refs = [greedy_reference(bundle, p, CAP, eos) for p in prompts]
    assert refs[4] == ([next(iter(eos))], "eos")
    engine = DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=12, max_new_tokens=CAP, eos_ids=eos,
                          cuda_graph=False)
    for speculative in (False, True):
        out = decode_stream(engine, prompts, speculative=speculative)
        assert list(zip(out.tokens, out.stop)) == refs


def test_steady_window_leaves_out_the_first_wave():
    """With more than 2R prompts the steady window starts at a later look than the stream's start (the
    first R prompts start together): it starts at a progress total past the first look's and its tokens
    run from there to a later total."""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    prompts = _prompts(12) * 2  # 18 prompts, 3 rows: the window starts when the 6th gets a row
    engine = _engine(bundle, drafter, rows=3)
    seen: list[int] = []
    out = decode_stream(engine, prompts, speculative=True, on_round=seen.append)
    assert out.steady_from_tokens in seen and out.steady_from_tokens > seen[0]
    assert out.steady_from_tokens + out.steady_tokens in seen
