"""The continuous generator's counts (decoding/gen_counts.py): hand-worked values, the counts of a
real CPU generation against what its steps did, and their sum over a regeneration and its continuation."""

from __future__ import annotations

import pytest

from dflash_trainer.data.regen_report import add_counts, combine
from dflash_trainer.decoding.continuous import ContinuousGenerator
from dflash_trainer.decoding.gen_counts import GenerationCounts, ratios
from tests.tiny_targets import tiny_bundle


def test_counts_and_ratios_by_hand():
    """Two steps of 4 rows: span 256 with rows at bounds 3 and 9 live (needs 4 + 10 slots), then span 512
    with one row at 300 live (301 slots); prefills of 2 × 7 and 1 × 5 tokens; waits 0, 16, 17, 5000."""
    c = GenerationCounts()
    c.step(4, [3, 9], 256)
    c.step(4, [300], 512)
    c.prefill(2, 7)
    c.prefill(1, 5)
    for w in (0, 16, 17, 5000):
        c.waited(w)
    d = c.as_dict()
    assert d == {"decode_steps": 2, "row_steps": 8, "live_row_steps": 3, "attended_slot_steps": 4 * 256 + 4 * 512,
                 "needed_slot_steps": 14 + 301, "prefill_forwards": 2, "prefill_rows": 3, "prefill_padded_tokens": 19,
                 "device_wait_ms": 0, "span_steps": {"256": 1, "512": 1}, "turn_wait_steps": {"0": 1, "16": 1, "64": 1, "more": 1}}
    r = ratios(d)
    assert r == {"occupancy": 0.375, "span_efficiency": round(315 / 3072, 4), "mean_span": 384.0,
                 "mean_live_rows": 1.5, "rows": 4.0, "mean_prefill_rows": 1.5}
    assert ratios(GenerationCounts().as_dict()) == {}
    c.step(4, [], 256, attended=1)  # the eager step attends what it needs, counted under its ladder span
    assert c.attended_slot_steps == 3072 + 4 and c.span_steps["256"] == 2


def _generate(eos, prompts, sync_every, overlap=False):
    bundle = tiny_bundle("llama", vocab_size=12)
    gen = ContinuousGenerator(bundle, slots=2, max_prompt_tokens=10, max_new_tokens=6, eos_ids=eos,
                              sync_every=sync_every, overlap=overlap)
    for i, p in enumerate(prompts):
        gen.submit(i, p)
    got = {}
    while gen.busy:
        got.update((f.key, f.tokens) for f in gen.poll())
    return gen, got


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("eos", [{99}, {2, 5, 7}])
def test_live_counts_are_the_steps_each_sequence_generated(one_thread, eos, overlap):
    """A sequence of n tokens was live for n - 1 decode steps (the first token comes from its prefill),
    at bounds prompt length + 0 … n - 2: live_row_steps and needed_slot_steps are exactly those sums,
    also when sequences end between two looks of the host (sync_every 4; eos {2, 5, 7} ends them early)."""
    prompts = [[3, 4], [5, 6, 7], [8], [9, 3, 4, 6]]
    gen, got = _generate(eos, prompts, sync_every=4, overlap=overlap)  # exact with polls that overlap too
    d = gen.counts.as_dict()
    assert d["live_row_steps"] == sum(len(t) - 1 for t in got.values())
    assert d["needed_slot_steps"] == sum(len(prompts[k]) + i + 1 for k, t in got.items() for i in range(len(t) - 1))
    if eos == {2, 5, 7}:
        assert any(len(t) < 6 for t in got.values()) and d["live_row_steps"] < d["row_steps"] - 4


def test_counts_of_a_real_generation(one_thread):
    """3 prompts on 2 rows of a tiny target (eager, CPU): every step counted with all rows, live rows
    ≤ rows, attended = rows × the exact need (eager), needed ≤ attended; 3 prompts waited, the third
    until a row freed (more than 0 steps), and the prefill covered every prompt once."""
    gen, got = _generate({99}, [[3, 4], [5, 6, 7], [8]], sync_every=2)
    assert sorted(got) == [0, 1, 2] and all(len(t) == 6 for t in got.values())  # eos never hit: 6 tokens each
    d = gen.counts.as_dict()
    assert d["decode_steps"] == gen.steps and d["row_steps"] == 2 * gen.steps
    assert sum(d["span_steps"].values()) == gen.steps
    assert 0 < d["live_row_steps"] <= d["row_steps"] and 0 < d["needed_slot_steps"] <= d["attended_slot_steps"]
    assert d["prefill_rows"] == 3 and sum(d["turn_wait_steps"].values()) == 3
    assert d["turn_wait_steps"]["0"] == 2 and sum(v for k, v in d["turn_wait_steps"].items() if k != "0") == 1
    r = ratios(d)
    assert 0 < r["occupancy"] <= 1 and 0 < r["span_efficiency"] <= 1


def test_counts_add_up_over_a_continuation():
    """`combine` sums the counts (nested histograms too) and draws the ratios from the sum."""
    a, b = GenerationCounts(), GenerationCounts()
    a.step(2, [1, 2], 256)
    a.waited(3)
    b.step(2, [7], 512)
    b.waited(3)
    b.waited(70)
    total = add_counts(a.as_dict(), b.as_dict())
    assert total["decode_steps"] == 2 and total["span_steps"] == {"256": 1, "512": 1}
    assert total["turn_wait_steps"] == {"16": 2, "256": 1}
    first = {"records_read": 3, "stopped_at_max_seconds": True, "next_record": 3, "generated_tokens": 10, "wall_s": 1.0,
             "generator": a.as_dict()}
    more = {"records_read": 2, "first_record": 3, "generated_tokens": 10, "wall_s": 1.0, "generator": b.as_dict()}
    merged = combine(first, more)
    assert merged["generator"] == total
    assert merged["generator_ratios"] == ratios(total) and merged["generator_ratios"]["occupancy"] == pytest.approx(0.75)
    old = combine({**first, "generator": {}}, more)  # a report from before the counts existed
    assert old["generator"] == b.as_dict()


def test_decode_modes_are_merged_not_summed():
    """A continuation's report keeps how its decode steps ran (booleans, not counts): a mode both parts ran
    alike as it was, "mixed" where they differ; a part from before the field existed leaves the other's."""
    modes = {"row_attention": True, "overlap": True}
    first = {"records_read": 3, "stopped_at_max_seconds": True, "next_record": 3, "wall_s": 1.0}
    more = {"records_read": 2, "first_record": 3, "wall_s": 1.0}
    half = {"row_attention": True, "overlap": False}
    assert combine({**first, "decode_modes": half}, {**more, "decode_modes": modes})["decode_modes"] == \
        {"row_attention": True, "overlap": "mixed"}
    assert combine({**first, "decode_modes": modes}, {**more, "decode_modes": modes})["decode_modes"] == modes
    assert combine({**first, "decode_modes": modes}, more)["decode_modes"] == modes
