"""`dflash-train bench colocated`: target and drafter on one GPU, against their standalone speeds.

Target: a random-weight Qwen3-8B-shaped model (bench.pipeline.qwen3_8b_fields) in bf16 on the GPU.
Drafter: bench.common.BenchShape (the reference configuration). All in one process:

  target_standalone_tok_per_s   target forward + greedy labels on one row (CUDA events, median)
  drafter_standalone_tok_per_s  one drafter training step (anchors → AdamW) on fixed features,
                                the same `train_step` every layout uses (CUDA events, median)
  serial_bound_tok_per_s        1 / (1/target + 1/drafter): both back to back, no bubbles
  end_to_end_tok_per_s          the real co-located `train()` loop (data loading, target feed,
                                step, scheduler, logging) over its logged intervals after warm-up
  ratio_end_to_end_over_serial  ≥ 1 means no orchestration bubbles (> 1: the overlap gains)
  gpu_busy_pct                  union of kernel intervals / span of a profiled stretch of the same
                                feed + step loop
  breakdown                     that stretch's time per step by section (telemetry/breakdown.py): the
                                target forward (layers, labels) on its side stream, the drafter step's
                                sections, and other = unattributed + idle − overlap, where overlap is
                                the target's kernels running beside the drafter's
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.bench.common import BenchShape
from dflash_trainer.telemetry.timing import times_ms
from dflash_trainer.bench.pipeline import bench_run_config, qwen3_8b_fields, steady_rate


def bench_colocated(out: Path, *, steps: int = 40, warmup_steps: int = 10, log_every: int = 5, probe_iters: int = 8,
                    profile_steps: int = 6, overlap: bool = True, shape: BenchShape | None = None,
                    target_fields: dict[str, Any] | None = None, cpu: bool = False,
                    target_attention: str = "auto", target_compile: bool = True,
                    trace: str | None = None, fp8: str = "off") -> dict[str, Any]:
    """Run the co-located benchmark on cuda:0 with run files in `out`; returns a JSON-ready dict.
    shape / target_fields / cpu shrink it for a CPU check of the code path (host-clock timings,
    a breakdown of CPU op time, no GPU-busy %). target_attention (auto | flex | sdpa) and
    target_compile, fp8: the run's settings, for both phases. profile_steps: steps of the profiled
    stretch (at least 1); trace: also write it as a Chrome trace there."""
    if profile_steps < 1:
        raise ValueError(f"profile_steps={profile_steps}: the profiled stretch needs at least one step")
    from dflash_trainer.target_model.features import TargetFeatureExtractor
    from dflash_trainer.training import precision
    from dflash_trainer.training.feed import extract
    from dflash_trainer.training.run import step_settings, train
    from dflash_trainer.pipeline.target_source import RandomTarget

    from dflash_trainer.drafter.fp8 import check_fp8

    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    check_fp8(fp8, device)  # before the target loads
    if not cpu:
        torch.cuda.set_device(device)
    dtype = precision.compute_dtype(device)
    shape = shape or BenchShape()
    dc = shape.drafter_config()
    cfg = bench_run_config(out, shape, steps, log_every, device=device.type, overlap_target=overlap,
                           target_attention=target_attention, target_compile=target_compile, fp8=fp8)
    target = RandomTarget("qwen3", target_fields or qwen3_8b_fields(), seed=0).load_full(device, dtype)
    extractor = TargetFeatureExtractor.from_config(target, dc.target_layer_ids, cfg)
    settings = step_settings(cfg, dc, device)
    from datasets import load_from_disk

    host_rows = load_from_disk(str(Path(cfg.data.prepared) / "train")).with_format("torch")
    batches = [{k: host_rows[i:i + 1][k] for k in ("input_ids", "loss_mask", "position_ids")} for i in range(steps)]

    # 1. target standalone
    rows0 = {k: v.to(device) for k, v in batches[0].items()}
    for _ in range(2):
        extract(extractor, rows0, settings)
    target_ms = statistics.median(times_ms(lambda: extract(extractor, rows0, settings), probe_iters, device))

    # 2. drafter standalone, 3. GPU-busy % of the feed + step loop (a profiled stretch, outside the timed run)
    drafter_ms, breakdown = _drafter_phases(cfg, dc, target, extractor, settings, batches, rows0, probe_iters,
                                            profile_steps, overlap, cpu, trace)
    busy = float("nan") if cpu else breakdown["busy_pct"] / 100
    span_ms = breakdown["step_ms"] * profile_steps
    if not cpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    # 4. end to end: the real co-located run
    t0 = time.perf_counter()
    train(cfg, target=target, save_final=False)
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    T = shape.seq_len
    target_tps, drafter_tps = T / (target_ms / 1e3), T / (drafter_ms / 1e3)
    serial = 1.0 / (1.0 / target_tps + 1.0 / drafter_tps)
    e2e = steady_rate(records, warmup_steps)
    return {
        "what": "co-located target + drafter on one GPU, Qwen3-8B-shaped random target, reference drafter",
        "shape": shape.__dict__, "steps": steps, "warmup_steps": warmup_steps, "overlap_target": overlap,
        "target_attention": target_attention, "target_compile": target_compile, "fp8": fp8, "target_path": extractor.implementation_for(shape.seq_len),
        "target_layers_compiled": extractor.compiles(extractor.implementation_for(shape.seq_len)),
        "target_forward_ms_median": target_ms, "target_standalone_tok_per_s": target_tps,
        "drafter_step_ms_median": drafter_ms, "drafter_standalone_tok_per_s": drafter_tps,
        "serial_bound_tok_per_s": serial, "end_to_end_tok_per_s": e2e,
        "ratio_end_to_end_over_serial": (e2e / serial) if e2e else None,
        "gpu_busy_pct": 100 * busy, "profiled_span_ms": span_ms, "profiled_steps": profile_steps,
        "breakdown": breakdown,
        "peak_mem_gib_run": None if cpu else torch.cuda.max_memory_allocated(device) / 2**30,
        "intervals": [{"step": r["step"], "tok_per_s": r["tok_per_s"]} for r in records],
        "first_loss": records[0]["loss"] if records else None, "last_loss": records[-1]["loss"] if records else None,
        "wall_s": wall, "device_name": "cpu" if cpu else torch.cuda.get_device_name(device), "torch": torch.__version__,
    }


def _drafter_phases(cfg, dc, target, extractor, settings, batches, rows0, probe_iters: int, profile_steps: int,
                    overlap: bool, cpu: bool, trace: str | None) -> tuple[float, dict[str, Any]]:
    """(drafter step ms median, breakdown) with a drafter of its own.

    The step is `training.loop.train_step` on fixed target outputs; the breakdown (with the GPU-busy %
    it holds) comes from `profile_steps` steps of the co-located feed + step loop under torch.profiler
    (telemetry/breakdown.py; on CPU: CPU op time, the feed without overlap).
    """
    from dflash_trainer.drafter.metrics import MetricAccumulator
    from dflash_trainer.drafter.model import DFlashDrafter
    from dflash_trainer.telemetry.breakdown import profile_steps as profile
    from dflash_trainer.drafter.build import prepare_for_training
    from dflash_trainer.training.feed import TargetFeed, extract
    from dflash_trainer.training.optim import build_optimizer
    from dflash_trainer.training.loop import Batch, row_generators, train_step

    device = rows0["input_ids"].device
    torch.manual_seed(cfg.runtime.seed)
    drafter = DFlashDrafter(dc, target.embed_tokens, target.lm_head, checkpoint_layers=cfg.experimental.checkpoint_policy()).to(device)
    prepare_for_training(drafter, cfg.experimental.fp8, compile_layers=not cpu)  # as build_drafter: FP8 linears, then compile
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = build_optimizer(params, lr=cfg.optim.lr, weight_decay=0.0)
    acc = MetricAccumulator(dc.block_size, device)
    tgt0 = extract(extractor, rows0, settings)

    def step(rows, tgt) -> None:
        batch = Batch.of(rows, tgt)
        train_step(drafter, batch, settings, row_generators(batch.row_index, 0, 0, 0, device), opt, params,
                   cfg.optim.grad_clip, acc)

    for _ in range(4):
        step(rows0, tgt0)
    drafter_ms = statistics.median(times_ms(lambda: step(rows0, tgt0), probe_iters, device))
    feed = TargetFeed(lambda r: extract(extractor, r, settings), device, overlap=overlap)
    for rows, tgt in feed(batches[:3]):
        step(rows, tgt)

    def stretch() -> None:
        for rows, tgt in feed(batches[:profile_steps]):
            step(rows, tgt)

    what = ("co-located feed + drafter step (the target forward of the next batch on its own stream)"
            if feed.overlap else "co-located feed + drafter step (target forward, then the step, one stream)")
    breakdown, _ = profile(stretch, profile_steps, device, what=what, trace=trace)
    acc.summary()
    return drafter_ms, breakdown
