"""The step's profiler sections and the time breakdown built from them (telemetry/sections.py,
telemetry/breakdown.py), on CPU: CPU op time stands in for GPU kernel time, through the same
attribution (innermost range; backward by the forward op that made each autograd node)."""

import contextlib
import itertools
import math

import pytest
import torch
from torch.autograd.profiler_util import Kernel

from dflash_trainer.bench.common import BenchShape
from dflash_trainer.bench.step_rig import rig_from_config, rig_from_shape
from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.telemetry.breakdown import SECTIONS, breakdown, format_table, profile_steps
from dflash_trainer.telemetry.sections import SECTION_PREFIX, section
from tests.tiny_targets import tiny_bundle

CPU = torch.device("cpu")



def tiny_rig(seed: int = 0):
    """A training config's step on a tiny random Llama target: 2 rows × 256 tokens, 16 anchors, B = 4."""
    cfg = TrainConfig(seq_len=256, num_layers=2, block_size=4, num_anchors=16, rows_per_step=2, device="cpu",
                      target_layer_ids=[0, 2], mask_token_id=127, seed=seed)
    return rig_from_config(cfg, CPU, tiny_bundle("llama"), num_documents=3)


def test_sections_do_nothing_without_a_profiler():
    """Prevents the marks costing the training step anything (an op, an event, a sync) when nobody
    profiles: outside a profiler a section is a plain nullcontext."""
    assert isinstance(section("drafter_forward"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with section("drafter_forward"):
            torch.ones(2).sum()
    assert any(e.name == SECTION_PREFIX + "drafter_forward" for e in prof.events())


def test_step_under_the_profiler_is_bit_identical():
    """Prevents the profiler ranges changing the math: the same step with the ranges recorded gives
    bit-identical weights, optimizer state and metric sums."""
    plain, profiled = tiny_rig(), tiny_rig()
    for a, b in zip(plain.params, profiled.params):
        assert torch.equal(a, b)
    plain.training_step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled.training_step()
    names = {e.name for e in prof.events()}
    assert {SECTION_PREFIX + s for s in ("target_layers", "target_labels", "blocks", "mask_build", "drafter_forward",
                                         "lm_head_loss", "backward", "optimizer")} <= names
    assert all(torch.equal(a, b) for a, b in zip(plain.params, profiled.params))
    assert torch.equal(plain.acc._sums, profiled.acc._sums)
    assert plain.acc._sums[1] > 0  # Σ w: the step trained on something
    for pa, pb in zip(plain.params, profiled.params):
        sa, sb = plain.opt.state[pa], profiled.opt.state[pb]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_breakdown_covers_every_section_and_sums_to_the_step(one_thread):
    """Prevents a section silently missing (a range not reached, backward not split) and a breakdown
    whose parts do not add up: every section of a step with a target has time, and
    Σ sections + other = the measured step, other = unattributed + idle − overlap."""
    rig = tiny_rig()
    for _ in range(2):
        rig.training_step()
    b, _ = profile_steps(lambda: [rig.training_step() for _ in range(3)], 3, CPU, what="tiny training step")
    secs = b["sections"]
    assert list(secs) == [*SECTIONS, "other"]
    for name in SECTIONS:
        assert secs[name]["ms"] > 0, name  # backward_other: the loss division's backward and the seed gradient
        assert secs[name]["items_per_step"] > 0, name
        assert math.isclose(secs[name]["pct"], 100 * secs[name]["ms"] / b["step_ms"])
    assert secs["drafter_forward"]["items_per_step"] > 20 and secs["backward_drafter"]["items_per_step"] > 20
    total = sum(v["ms"] for v in secs.values())
    assert math.isclose(total, b["step_ms"], rel_tol=1e-9)
    p = b["other_parts"]
    assert math.isclose(secs["other"]["ms"], p["unattributed_ms"] + p["idle_ms"] - p["overlap_ms"], abs_tol=1e-9)
    assert p["overlap_ms"] == pytest.approx(0, abs=1e-6)  # one thread: nothing runs side by side
    assert p["unattributed_ms"] >= 0 and p["idle_ms"] >= 0
    assert b["attributed_ms"] > 0.7 * b["step_ms"]  # the sections hold the step's work
    assert p["unattributed_ms"] < 0.1 * b["step_ms"]
    assert math.isclose(b["backward_ms"], sum(secs[s]["ms"] for s in SECTIONS if s.startswith("backward")))
    table = format_table(b)
    assert "backward_lm_head_loss" in table and "tiny training step" in table


@pytest.mark.parametrize("heavy", ["lm_head", "drafter"])
def test_backward_is_charged_to_its_forward_section(heavy, one_thread):
    """Prevents backward time landing in the wrong bucket (autograd runs it outside the forward ranges):
    with a 65K vocabulary and a 1-layer 64-wide drafter the LM head's backward dominates; with a
    256-token vocabulary and a 3-layer 256-wide drafter the drafter's does. Both splits must follow."""
    if heavy == "lm_head":
        shape = BenchShape(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                           head_dim=16, vocab_size=65536, num_target_layers=6, num_target_features=2, seq_len=256,
                           num_documents=2, num_anchors=32, block_size=4, layer_types="full")
    else:
        shape = BenchShape(hidden_size=256, intermediate_size=1024, num_layers=3, num_heads=8, num_kv_heads=2,
                           head_dim=32, vocab_size=256, num_target_layers=6, num_target_features=2, seq_len=512,
                           num_documents=2, num_anchors=32, block_size=4, layer_types="full")
    rig = rig_from_shape(shape, CPU, loss_impl="autograd")  # the LM head's backward in backward (fused: in forward)
    rig.drafter_step()
    b, _ = profile_steps(lambda: [rig.drafter_step() for _ in range(2)], 2, CPU, what="drafter step")
    s = {k: v["ms"] for k, v in b["sections"].items()}
    assert s["target_layers"] == 0 and s["target_labels"] == 0  # no target model in this rig
    if heavy == "lm_head":
        assert s["lm_head_loss"] > 2 * s["drafter_forward"]
        assert s["backward_lm_head_loss"] > 2 * s["backward_drafter"]
    else:
        assert s["drafter_forward"] > 2 * s["lm_head_loss"]
        assert s["backward_drafter"] > 2 * s["backward_lm_head_loss"]


class _Span:
    def __init__(self, start: float, end: float):
        self.start, self.end = start, end

    def elapsed_us(self) -> float:
        return self.end - self.start


_IDS = itertools.count(1)


class _Ev:
    """The FunctionEvent fields the breakdown reads (times in µs). id: the correlation id (a fresh one
    unless given: the profiler gives every op its own)."""

    def __init__(self, name, start, end, *, cuda=False, thread=1, fwd_thread=0, seq=-1, parent=None, kernels=(),
                 scope=0, id=None):
        self.name, self.time_range, self.thread, self.fwd_thread, self.sequence_nr = name, _Span(start, end), \
            thread, fwd_thread, seq
        self.id = next(_IDS) if id is None else id
        self.device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        self.is_async, self.scope, self.cpu_parent, self.cpu_children = False, scope, parent, []
        self.kernels = [Kernel(k, 0, d) for k, d in kernels]
        if parent is not None:
            parent.cpu_children.append(self)

    @property
    def self_cpu_time_total(self):
        return self.time_range.elapsed_us() - sum(c.time_range.elapsed_us() for c in self.cpu_children)


def test_cuda_attribution_by_hand():
    """Works the CUDA attribution through a trace made by hand: kernels go to the innermost range of the
    op that launched them, backward kernels to the forward range of their node (by sequence number and
    forward thread), a range's GPU span (kineto's gpu_user_annotation) is not work, a kernel no op
    claims is unattributed; other = unattributed + idle − overlap."""
    ev = _Ev
    fwd = ev("dflash/drafter_forward", 0, 100, scope=7)
    loss = ev("dflash/lm_head_loss", 100, 200, scope=7)
    events = [fwd, ev("aten::mm", 10, 20, seq=5, parent=fwd, kernels=[("gemm", 30)]),
              loss, ev("aten::mm", 110, 120, seq=6, parent=loss, kernels=[("gemm2", 50)]),
              ev("aten::add", 210, 215, kernels=[("add", 5)])]
    bw6 = ev("autograd::engine::evaluate_function: MmBackward0", 300, 320, thread=2, fwd_thread=1, seq=6)
    node = ev("MmBackward0", 301, 319, thread=2, fwd_thread=1, seq=6, parent=bw6)
    bw5 = ev("autograd::engine::evaluate_function: MmBackward0", 330, 340, thread=2, fwd_thread=1, seq=5)
    acc = ev("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 345, 350, thread=2)
    events += [bw6, node, ev("aten::mm", 302, 310, thread=2, parent=node, kernels=[("gemm_bw", 40)]),
               bw5, ev("aten::mm", 331, 339, thread=2, parent=bw5, kernels=[("gemm_bw2", 60)]),
               acc, ev("aten::add_", 346, 349, thread=2, parent=acc, kernels=[("acc", 3)])]
    events += [ev(n, s, e, cuda=True) for n, s, e in (("gemm", 1000, 1030), ("gemm2", 1030, 1080), ("add", 1080, 1085),
                                                      ("gemm_bw", 1100, 1140), ("gemm_bw2", 1140, 1200),
                                                      ("acc", 1200, 1203), ("orphan", 1210, 1212))]
    events.append(ev("dflash/drafter_forward", 1000, 1030, cuda=True))  # the range's GPU span: not work
    b = breakdown(events, 1, 0.25, cuda=True, what="by hand")
    ms = {k: round(v["ms"] * 1e3, 6) for k, v in b["sections"].items()}  # µs
    assert ms == {"target_layers": 0, "target_labels": 0, "blocks": 0, "mask_build": 0, "drafter_forward": 30,
                  "lm_head_loss": 50, "backward_drafter": 60, "backward_lm_head_loss": 40, "backward_other": 3,
                  "optimizer": 0, "other": 67}
    parts = {k: round(v * 1e3, 6) for k, v in b["other_parts"].items()}
    assert parts == {"unattributed_ms": 7, "idle_ms": 60, "overlap_ms": 0}  # add + orphan; 250 − 190 busy
    assert b["busy_pct"] == pytest.approx(76.0)
    assert b["sections"]["drafter_forward"]["top"] == [{"name": "gemm", "ms": pytest.approx(0.03)}]


def test_kernel_copies_on_overhead_records_count_once():
    """Prevents a section holding more GPU time than ran (bench step, Qwen3-8B-shaped drafter on an H200:
    optimizer 334.6 ms/step of a 139.4 ms step, 3941 kernels/step for 176 launched): torch hands an op's
    kernels to every CPU event with the op's correlation id, and CUPTI overhead records ("Command Buffer
    Full", made while a launch waits on a full queue) inherit the id of the op they lie in, so each holds a
    copy of all its kernels. Two steps by hand, the second with the host far ahead of the GPU (copies in the
    fused AdamW op and in the forward's matmul) and the optimizer range's GPU span handed to the range as a
    kernel: each section holds its kernels once, the same in both steps, and never more than ran."""
    ev = _Ev
    events = []
    for step, (t, g) in enumerate(((0, 1000), (500, 1100))):
        fwd = ev("dflash/drafter_forward", t, t + 100, scope=7)
        mm = ev("aten::mm", t + 10, t + 90, parent=fwd, kernels=[("gemm", 40)])
        opt = ev("dflash/optimizer", t + 100, t + 300, scope=7,
                 kernels=[("dflash/optimizer", 30)] if step else ())
        adamw = ev("aten::_fused_adamw_", t + 110, t + 290, parent=opt, kernels=[("multi_tensor_apply", 10)] * 3)
        events += [fwd, mm, opt, adamw]
        if step:  # the GPU queue is full: launches wait, CUPTI records the waits inside the launching op
            events += [ev("Command Buffer Full", t + 120 + 40 * i, t + 150 + 40 * i, parent=adamw, id=adamw.id,
                          kernels=[("multi_tensor_apply", 10)] * 3) for i in range(4)]
            events.append(ev("Command Buffer Full", t + 20, t + 80, parent=mm, id=mm.id, kernels=[("gemm", 40)]))
        else:
            events.append(ev("aten::add", t + 300, t + 310, kernels=[("add", 5)]))  # outside every section
        events += [ev(n, s, e, cuda=True) for n, s, e in (("gemm", g, g + 40), ("multi_tensor_apply", g + 40, g + 50),
                                                          ("multi_tensor_apply", g + 50, g + 60),
                                                          ("multi_tensor_apply", g + 60, g + 70))]
    events += [ev("add", 1070, 1075, cuda=True), ev("dflash/optimizer", 1140, 1170, cuda=True)]
    events.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
    b = breakdown(events, 2, 0.2, cuda=True, what="by hand")
    secs = b["sections"]
    ms = {k: round(v["ms"] * 1e3, 6) for k, v in secs.items()}  # µs per step
    assert ms == {"target_layers": 0, "target_labels": 0, "blocks": 0, "mask_build": 0, "drafter_forward": 40,
                  "lm_head_loss": 0, "backward_drafter": 0, "backward_lm_head_loss": 0, "backward_other": 0,
                  "optimizer": 30, "other": 30}
    assert secs["optimizer"]["items_per_step"] == 3 and secs["drafter_forward"]["items_per_step"] == 1
    assert secs["optimizer"]["top"] == [{"name": "multi_tensor_apply", "ms": pytest.approx(0.03)}]
    parts = {k: round(v * 1e3, 6) for k, v in b["other_parts"].items()}
    assert parts == {"unattributed_ms": 2.5, "idle_ms": 27.5, "overlap_ms": 0}  # 145 µs of work in 200
    assert b["attributed_ms"] <= 0.145 / 2 + 1e-12  # never more than the device work
