"""Continuous batching (decoding/continuous.py): with fewer rows than prompts, rows are refilled as
sequences finish, and every sequence equals slow greedy decoding (no cache; test_eval_common.greedy_reference),
eos kept, `finished` telling eos from length; too-long prompts come back as errors."""

from __future__ import annotations

import pytest
import torch
from test_eval_common import greedy_reference

from dflash_trainer.decoding.continuous import ContinuousGenerator
from tests.tiny_targets import tiny_bundle

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind,slots,sync_every", [("llama", 2, 3), ("qwen3", 3, 1), ("llama", 8, 16)])
def test_every_sequence_equals_greedy_decoding(kind, slots, sync_every, overlap):
    bundle = tiny_bundle(kind, vocab_size=12)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (4, 1, 9, 6, 2, 11, 3)]
    gen = ContinuousGenerator(bundle, slots=slots, max_prompt_tokens=10, max_new_tokens=9, eos_ids={2},
                              sync_every=sync_every, prefill_tokens=12, overlap=overlap)
    for i, p in enumerate(prompts):
        gen.submit(i, p)
    got = {}
    while gen.busy:
        for f in gen.poll():
            got[f.key] = f
    assert sorted(got) == list(range(len(prompts)))
    kinds = set()
    for i, p in enumerate(prompts):
        if len(p) > 10:
            assert got[i].error == "prompt_too_long" and got[i].tokens == []
            continue
        ref_tokens, ref_stop = greedy_reference(bundle, p, 9, {2})
        assert got[i].tokens == ref_tokens, i
        assert got[i].finished == (ref_stop == "eos")
        kinds.add(ref_stop)
    assert kinds == {"eos", "length"}


def test_freed_rows_never_poison_the_next_sequence_of_a_sliding_window_target():
    """Prevents NaN keys from a free row: a row freed at a late position keeps stepping while the
    attended span follows the shorter sequences of the other rows; if its position stayed past the
    span, its sliding-window layer would see no key, write NaN into its cache and the next sequence
    in that row would decode garbage. Every sequence must equal one-sequence greedy decoding."""
    bundle = tiny_bundle("qwen3", vocab_size=12, num_layers=2, sliding_window=3,
                         layer_types=["sliding_attention", "full_attention"])
    gen = ContinuousGenerator(bundle, slots=3, max_prompt_tokens=30, max_new_tokens=40, eos_ids={99}, sync_every=2)
    prompts = {"a": [3], "b": [5], "c": [6], "s0": [4], "s1": [7], "L": [3, 4, 5, 6, 7, 8, 9, 10] * 3}
    got = {}

    def drain():
        while gen.busy:
            got.update((f.key, f.tokens) for f in gen.poll())

    for k in "abc":  # all three rows end at position 40
        gen.submit(k, prompts[k])
    drain()
    gen.submit("s0", prompts["s0"])  # row 0 runs with small spans while rows 1 and 2 are free
    gen.poll()
    gen.submit("s1", prompts["s1"])
    gen.submit("L", prompts["L"])  # a long prompt stretches the span over the free rows' old positions
    drain()
    for k, p in prompts.items():
        assert got[k] == greedy_reference(bundle, p, 40, {99})[0], k


def test_poll_launches_the_next_stretch_and_collects_it_on_the_next_call():
    """With `overlap`, `poll` returns while its stretch of `sync_every` steps is queued on the device (the
    caller's work on the results overlaps it): the first call prefills and runs the stretch but hands back
    nothing; the next collects the finished sequence and refills its row at once from the queue (one
    row: "b" starts in the second stretch, not the third); the last launches nothing and leaves the
    generator idle. Each sequence equals greedy decoding."""
    bundle = tiny_bundle("llama", vocab_size=12)
    gen = ContinuousGenerator(bundle, slots=1, max_prompt_tokens=10, max_new_tokens=4, eos_ids={99}, sync_every=5,
                              overlap=True)
    gen.submit("a", [3, 4, 5])
    gen.submit("b", [6])
    assert gen.poll() == [] and gen.keys == ["a"] and gen.steps == 5 and gen.in_flight and gen.busy
    first = gen.poll()  # collects "a" (4 tokens after 3 steps), prefills "b" into the freed row, launches 5 steps
    assert [f.key for f in first] == ["a"] and gen.keys == ["b"] and gen.steps == 10 and gen.in_flight
    second = gen.poll()
    assert [f.key for f in second] == ["b"] and gen.steps == 10 and not gen.in_flight and not gen.busy
    assert first[0].tokens == greedy_reference(bundle, [3, 4, 5], 4, {99})[0]
    assert second[0].tokens == greedy_reference(bundle, [6], 4, {99})[0]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_row_attention_kernel_decodes_as_greedy(kind):
    """Each row attending only its own slots (decoding/row_attention.py; under TRITON_INTERPRET=1 the
    Triton kernel, else its torch reference) gives every sequence of slow greedy decoding, rows refilled,
    a sliding-window target included (qwen3: windows of 3 on its first layer)."""
    extra = dict(num_layers=2, sliding_window=3, layer_types=["sliding_attention", "full_attention"]) \
        if kind == "qwen3" else {}
    bundle = tiny_bundle(kind, vocab_size=12, **extra)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (4, 1, 9, 6, 2, 3)]
    gen = ContinuousGenerator(bundle, slots=3, max_prompt_tokens=10, max_new_tokens=9, eos_ids={2}, sync_every=2,
                              row_attention=True)
    assert gen.spans == [gen.max_len]  # one span: each row reads its own slots
    for i, p in enumerate(prompts):
        gen.submit(i, p)
    got = {}
    while gen.busy:
        got.update((f.key, f.tokens) for f in gen.poll())
    for i, p in enumerate(prompts):
        assert got[i] == greedy_reference(bundle, p, 9, {2})[0], i
    c = gen.counts
    assert c.attended_slot_steps < c.row_steps * gen.max_len  # not the whole cache each step
