"""`dflash-train regenerate` with the target itself answering (TargetResponder over continuous batching, or
HF `generate` for targets the batched path does not implement), on tiny random targets."""

from __future__ import annotations

import json

import pytest
from test_eval_common import CHATML, target_and_drafter, word_tokenizer
from test_regenerate import _run

from dflash_trainer.data.responders import TargetResponder

pytestmark = pytest.mark.usefixtures("one_thread")


def test_target_responder_end_to_end(tmp_path):
    """The real batched generation path on a tiny random target: greedy responses are decoded
    text, user turns untouched, and the same input regenerates identically."""
    bundle, _ = target_and_drafter()
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    respond = TargetResponder(bundle, CHATML, max_new_tokens=6)
    records = [{"messages": [{"role": "user", "content": "w10 w11"}, {"role": "assistant", "content": "w3"},
                             {"role": "user", "content": "w12"}, {"role": "assistant", "content": "w4"}]},
               {"messages": [{"role": "user", "content": "w50 w51 w52 w53 w54"}, {"role": "assistant", "content": "w3"}]}]
    _, report, out = _run(tmp_path, records, respond, suffix=".jsonl", jsonl=True, batch_size=2)
    got = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(got) == 2 and report.failed_by_reason == {} and report.regenerated_turns == 3
    for new, old in zip(got, records):
        assert [m["content"] for m in new["messages"][::2]] == [m["content"] for m in old["messages"][::2]]
        assert all(m["content"].startswith("w") for m in new["messages"][1::2])
    direct = respond([records[1]["messages"][:1]], 0)[0]
    assert direct.error is None and direct.text
    # the generator's counts reach the report (3 turns prefilled, every decode step on the 8 rows)
    g = report.generator
    assert g["prefill_rows"] == 3 and g["row_steps"] == 8 * g["decode_steps"] > 0
    assert sum(g["turn_wait_steps"].values()) == 3 and 0 < report.generator_ratios["occupancy"] <= 1
    assert json.loads(out.with_name(out.name + ".report.json").read_text())["generator"] == g
    # submitted prompts wait as text until the next poll tokenizes them together, in submission order
    respond.submit("a", [{"role": "user", "content": "w7"}])
    respond.submit("b", [{"role": "user", "content": "w8 w9"}])
    assert respond.busy and not respond.gen.busy and [k for k, _ in respond._texts] == ["a", "b"]
    while respond.busy:
        respond.poll()
    assert respond._texts == [] and not respond.gen.busy
    # on the CPU both default off: the kernel needs CUDA, and nothing runs beside the host to overlap
    assert respond.decode_modes == {"row_attention": False, "overlap": False} == report.decode_modes


def test_overlapped_polls_write_the_same_records(tmp_path):
    """With `overlap` (the default on CUDA: each poll returns while its stretch of steps runs, and the
    regenerator renders the next turns meanwhile) the output is byte for byte the one of polls that wait:
    multi-turn records on fewer rows than records, with lookahead."""
    bundle, _ = target_and_drafter(vocab_size=24)
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    records = [{"messages": [m for j in range(1 + i % 3) for m in (
        {"role": "user", "content": " ".join(f"w{4 + (i * 5 + j * 3 + k) % 15}" for k in range(1 + (i + j) % 4))},
        {"role": "assistant", "content": "w3"})]} for i in range(6)]
    outs = []
    for overlap in (False, True):
        respond = TargetResponder(bundle, CHATML, max_new_tokens=5, slots=2, overlap=overlap)
        assert respond.overlaps == overlap
        d = tmp_path / f"overlap-{overlap}"
        d.mkdir()
        _, report, out = _run(d, records, respond, suffix=".jsonl", jsonl=True, batch_size=2, lookahead=2)
        assert report.regenerated_turns == 12 and report.failed_by_reason == {}
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_continuous_responder_equals_hf_generate_greedy():
    """Continuous batching (2 rows for 5 conversations, rows refilled as turns finish) gives each
    conversation exactly HF `generate`'s greedy tokens at batch 1."""
    import torch

    from dflash_trainer.data.render import render_prompt

    bundle, _ = target_and_drafter(vocab_size=24)
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    respond = TargetResponder(bundle, CHATML, max_new_tokens=7, slots=2)
    convs = [[{"role": "user", "content": " ".join(f"w{4 + (i * 3 + j) % 15}" for j in range(i + 1))}]
             for i in range(5)]
    got = respond(convs)
    eos = sorted(respond.eos)
    for conv, r in zip(convs, got):
        ids = torch.tensor([render_prompt(bundle.tokenizer, CHATML, conv)])
        ref = bundle.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=7,
                                    do_sample=False, eos_token_id=eos, pad_token_id=0)[0, ids.shape[1]:].tolist()
        end = next((j for j, t in enumerate(ref) if t in respond.eos), None)
        body = ref if end is None else ref[:end]
        assert r.text == bundle.tokenizer.decode(body, skip_special_tokens=False)
        assert r.finished == (end is not None) and r.num_tokens == (len(ref) if end is None else end + 1)


def test_unsupported_target_falls_back_to_hf_generate():
    """A target outside the batched path's families regenerates through HF generate in waves, with
    the same greedy responses."""
    bundle, _ = target_and_drafter(vocab_size=24)
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    convs = [[{"role": "user", "content": f"w{5 + i} w{9 + i}"}] for i in range(3)]
    fast = TargetResponder(bundle, CHATML, max_new_tokens=6, slots=2)
    bundle.config.model_type = "gemma2"  # pretend: the batched path refuses it
    slow = TargetResponder(bundle, CHATML, max_new_tokens=6, slots=2)
    assert fast.fallback is None and "gemma2" in slow.fallback
    assert [r.text for r in slow(convs)] == [r.text for r in fast(convs)]
