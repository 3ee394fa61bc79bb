"""Where a training step's time goes: a per-section breakdown from a torch profiler trace.

`profile_steps(run, n, device)` runs `run()` (which performs n training steps) once under
torch.profiler and returns `breakdown(...)` of it: milliseconds per step for each section of
telemetry/sections.py, with backward split by forward section, and "other" = the measured step
time less their sum. Benchmarks (`bench step`, `bench colocated`) and a training run
(`profile_at_step`, training/run_profile.py) use it; the step itself gets no host sync (the
profiler window is synchronized once before and once after the n steps).

Sections reported (ms per step; `pct` of the measured step time):
  target_layers, target_labels, blocks, mask_build, drafter_forward, lm_head_loss   forward ranges
  backward_drafter       backward of the ops that ran inside drafter_forward
  backward_lm_head_loss  backward of the ops that ran inside lm_head_loss
  backward_other         the rest of `.backward()` (the loss division, gradient accumulation, seed)
  optimizer              gradient clip + AdamW
  other                  step − Σ sections = unattributed + idle − overlap (other_parts, exact):
    unattributed_ms  work launched outside every section (metric sums, copies of the input rows, …)
    idle_ms          step time with nothing running (GPU: no kernel; CPU: Python between ops)
    overlap_ms       time two pieces of work ran at once, counted in both (co-located: the target's
                     side stream beside the drafter step)

Time kind. CUDA: GPU time of the kernels, copies and memsets each section launched. The profiler
links every device event to the CPU op that launched it (correlation id) and the op lies inside the
innermost `dflash/*` range on its thread. Backward runs on autograd's threads, outside those
ranges: a kernel launched inside `autograd::engine::evaluate_function: <Node>` belongs to that
node, the node to the forward op that created it (same sequence number on the forward thread), and
that op to its forward range. CPU (tests, CPU runs): self time of every CPU op (its duration less
its children's), attributed the same way.

Each device event counts once. torch gives an op's kernels (`FunctionEvent.kernels`) to every CPU
event carrying the op's correlation id (`FunctionEvent.id`), and not only the op carries it: a CUPTI
overhead record ("Command Buffer Full": a launch waited for room in a full launch queue) has no id of
its own, inherits the id of the op it lies in, and so holds a copy of all that op's kernels, once per
record (a host far ahead of the GPU makes dozens per step in a foreach/fused AdamW op). So per
correlation id only the first event in start order is counted (the op: it encloses its copies), and,
as in `device_work`, device events named as a user range are not work: the sections never hold more
than the device work.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.telemetry.sections import SECTION_PREFIX

SECTIONS = ("target_layers", "target_labels", "blocks", "mask_build", "drafter_forward", "lm_head_loss",
            "backward_drafter", "backward_lm_head_loss", "backward_other", "optimizer")
BACKWARD_OF = {"drafter_forward": "backward_drafter", "lm_head_loss": "backward_lm_head_loss"}
_EVAL = "autograd::engine::evaluate_function: "
_TOP = 5  # names listed per section
_USER_SCOPE = 7  # at::RecordScope::USER_SCOPE: record_function ranges


def _context(ev: Any) -> tuple[str, Any] | None:
    """The innermost marker around CPU event `ev` (itself included), walking up its parents:
    ("backward", evaluate_function event) or ("range", section name) or None."""
    node = ev
    while node is not None:
        name = node.name
        if name.startswith(_EVAL):
            return "backward", node
        if name.startswith(SECTION_PREFIX):
            return "range", name[len(SECTION_PREFIX):]
        node = node.cpu_parent
    return None


class _Resolver:
    """Maps a CPU event to its reported section (None = outside every section)."""

    def __init__(self, cpu_events: list[Any]):
        # forward ops carry the sequence number of the autograd node they create; (thread, seq) is
        # unique within a trace (the counter only grows per thread)
        self.forward: dict[tuple[int, int], str | None] = {}
        for ev in cpu_events:
            if ev.sequence_nr >= 0 and not ev.name.startswith(_EVAL):
                ctx = _context(ev)
                if ctx is None or ctx[0] == "range":
                    self.forward.setdefault((ev.thread, ev.sequence_nr), ctx and ctx[1])

    def section_of(self, ev: Any) -> str | None:
        ctx = _context(ev)
        if ctx is None:
            return None
        kind, what = ctx
        if kind == "backward":
            fwd = self.forward.get((what.fwd_thread, what.sequence_nr)) if what.sequence_nr >= 0 else None
            return BACKWARD_OF.get(fwd, "backward_other")
        return "backward_other" if what == "backward" else what


def device_work(events: Any) -> list[Any]:
    """The device events that are work: kernels, copies, memsets. The profiler also lists, as CUDA
    events, a span per user range (`record_function`) and stream covering that range's kernels
    (kineto's gpu_user_annotation, named as the range): those are left out, or a range would count
    its kernels twice and the gaps between them as busy."""
    user_ranges = {e.name for e in events
                   if e.device_type == torch.autograd.DeviceType.CPU and e.scope == _USER_SCOPE}
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False) and e.name not in user_ranges]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def breakdown(events: Any, num_steps: int, window_ms: float, *, cuda: bool, what: str,
              unprofiled_step_ms: float | None = None) -> dict[str, Any]:
    """The JSON-ready breakdown of `num_steps` steps that took `window_ms` in all.

    events: `prof.events()` of a torch.profiler run over exactly those steps. cuda: attribute GPU
    kernel time (True) or CPU op self time (False). what: one line saying what a step is here.
    unprofiled_step_ms: the same step's time measured without the profiler (shown beside it: the
    profiler's host overhead can leave the GPU idle where it otherwise is not).
    """
    assert num_steps > 0 and window_ms > 0, (num_steps, window_ms)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    resolver = _Resolver(cpu)
    us: dict[str | None, float] = defaultdict(float)
    count: dict[str | None, int] = defaultdict(int)
    names: dict[str | None, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    if cuda:
        device = device_work(events)
        intervals = [(e.time_range.start, e.time_range.end) for e in device]
        total_us = sum(e - s for s, e in intervals)
        user_ranges = {e.name for e in cpu if e.scope == _USER_SCOPE}
        owners: set[int] = set()  # correlation ids whose kernels are counted (module docstring)
        for ev in sorted(cpu, key=lambda e: (e.time_range.start, -e.time_range.end)):
            if ev.kernels and ev.id not in owners:
                owners.add(ev.id)
                sec = resolver.section_of(ev)
                for k in ev.kernels:
                    if k.name in user_ranges:
                        continue
                    us[sec] += k.duration
                    count[sec] += 1
                    names[sec][k.name] += k.duration
        unattributed_us = total_us - sum(v for k, v in us.items() if k is not None)
    else:
        intervals = [(e.time_range.start, e.time_range.end) for e in cpu if e.cpu_parent is None]
        total_us = sum(e - s for s, e in intervals)
        for ev in cpu:
            sec = resolver.section_of(ev)
            own = ev.self_cpu_time_total  # its duration less its children's
            us[sec] += own
            count[sec] += 1
            names[sec][ev.name] += own
        unattributed_us = us[None]
    union_us = _union_us(intervals)
    n, step_ms = num_steps, window_ms / num_steps
    sections: dict[str, dict[str, Any]] = {}
    for sec in SECTIONS:
        ms = us.get(sec, 0.0) / 1e3 / n
        top = sorted(names.get(sec, {}).items(), key=lambda kv: -kv[1])[:_TOP]
        sections[sec] = {"ms": ms, "pct": 100 * ms / step_ms, "items_per_step": count.get(sec, 0) / n,
                         "top": [{"name": k[:100], "ms": v / 1e3 / n} for k, v in top]}
    attributed = sum(v["ms"] for v in sections.values())
    other = step_ms - attributed
    sections["other"] = {"ms": other, "pct": 100 * other / step_ms}
    return {
        "what": what,
        "time_kind": "cuda_kernel" if cuda else "cpu_op_self",
        "profiled_steps": n,
        "step_ms": step_ms,
        "unprofiled_step_ms": unprofiled_step_ms,
        "sections": sections,
        "forward_ms": sum(sections[s]["ms"] for s in SECTIONS[:6]),
        "backward_ms": sum(sections[s]["ms"] for s in SECTIONS if s.startswith("backward")),
        "attributed_ms": attributed,
        "other_parts": {"unattributed_ms": unattributed_us / 1e3 / n, "idle_ms": step_ms - union_us / 1e3 / n,
                        "overlap_ms": (total_us - union_us) / 1e3 / n},
        "busy_pct": 100 * union_us / 1e3 / window_ms,
    }


def profile_steps(run: Callable[[], None], num_steps: int, device: torch.device, *, what: str,
                  trace: str | Path | None = None, unprofiled_step_ms: float | None = None
                  ) -> tuple[dict[str, Any], Any]:
    """Run `run()` (which performs `num_steps` steps) once under torch.profiler; returns
    (`breakdown(...)`, the profiler). CUDA: the device is synchronized before the window and at its
    end (so work still queued on side streams counts), and the window is timed with CUDA events;
    CPU: host clock. trace: also write a Chrome trace (chrome://tracing, Perfetto) there."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)  # intentional host sync: the window holds only its own steps
    with torch.profiler.profile(activities=activities) as prof:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)  # intentional host sync: the window ends when every stream is done
            end.record()
            torch.cuda.synchronize(device)  # intentional host sync: read the events
            window_ms = start.elapsed_time(end)
        else:
            window_ms = (time.perf_counter() - t0) * 1e3
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return breakdown(prof.events(), num_steps, window_ms, cuda=cuda, what=what,
                     unprofiled_step_ms=unprofiled_step_ms), prof


def format_table(b: dict[str, Any]) -> str:
    """The breakdown as a printable table: one line per section (ms per step, % of the step,
    kernels or ops per step, the largest item), then the step and the parts of "other"."""
    kind = "GPU kernel time" if b["time_kind"] == "cuda_kernel" else "CPU op time"
    items = "kernels" if b["time_kind"] == "cuda_kernel" else "ops"
    lines = [f"step time by section: {b['what']} ({kind}, mean of {b['profiled_steps']} profiled steps)",
             f"{'section':<22}{'ms/step':>10}{'% step':>8}{items:>9}  largest"]
    for name, v in b["sections"].items():
        top = v.get("top") or []
        big = f"{top[0]['name'][:48]} {top[0]['ms']:.2f} ms" if top else ""
        n = f"{v['items_per_step']:.0f}" if "items_per_step" in v else ""
        lines.append(f"{name:<22}{v['ms']:>10.2f}{v['pct']:>8.1f}{n:>9}  {big}")
    lines.append(f"{'step (profiled)':<22}{b['step_ms']:>10.2f}{100.0:>8.1f}")
    p = b["other_parts"]
    lines.append(f"other = unattributed {p['unattributed_ms']:.2f} + idle {p['idle_ms']:.2f} − overlap "
                 f"{p['overlap_ms']:.2f} ms; busy {b['busy_pct']:.1f} %")
    if b.get("unprofiled_step_ms") is not None:
        lines.append(f"the same step without the profiler: {b['unprofiled_step_ms']:.2f} ms")
    return "\n".join(lines)
