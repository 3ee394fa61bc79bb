"""`dflash-train bench mask|step`: the drafter step's speed at the reference configuration or at a
training config's shapes with its target (`bench step --config FILE`).

Everything is measured in one process: the bf16 matmul ceiling (for MFU), the direct mask build
against torch's compiled `create_block_mask`, the full training step (`training.loop.train_step`:
anchors, blocks, masks, forward, loss, backward, clip, AdamW), host time per step, peak memory, and
a time breakdown by section from a profiler trace (telemetry/breakdown.py; its GPU-busy % is the
union of kernel intervals over the profiled window). With a target (`--config`), also the target
forward and the target forward + drafter step in series.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.bench.common import BenchShape, matmul_tflops, synthetic_rows
from dflash_trainer.telemetry.timing import cuda_times, times_ms
from dflash_trainer.bench.step_rig import StepRig, rig_from_config, rig_from_shape
from dflash_trainer.drafter.config import DrafterConfig, default_gamma
from dflash_trainer.drafter.masks import build_block_masks, reference_mask_mod
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.telemetry.breakdown import profile_steps as profile_steps_fn
from dflash_trainer.training.feature_cache import FeatureCache
from dflash_trainer.training.feed import extract
from dflash_trainer.training.loop import row_generators
from dflash_trainer.training.step import StepSettings, make_blocks


def _frozen_target_modules(cfg: DrafterConfig, device: torch.device) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=torch.bfloat16)
    for m in (emb, head):
        torch.nn.init.normal_(m.weight, std=0.02)
        m.requires_grad_(False)
    return emb, head


def step_flops(cfg: DrafterConfig, seq_len: int, num_anchors: int, visible_pairs: float, rows: int = 1) -> float:
    """Model FLOPs of one training step (forward + backward) over `rows` rows, matmuls and attention.

    Trainable linears count 3× their forward (forward, input grad, weight grad); `fc` 2× (its input
    needs no grad); the frozen LM head 2× (forward, input grad) over the B−1 trained slots;
    attention 3× its forward 4·head_dim·heads·visible_pairs (`visible_pairs`: all rows together).
    """
    H, I, B = cfg.hidden_size, cfg.intermediate_size, cfg.block_size
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    Q, T = num_anchors * B, seq_len
    per_layer = 2 * Q * H * (q_dim + 2 * kv_dim) + 2 * Q * q_dim * H + 3 * 2 * Q * H * I + 2 * T * H * 2 * kv_dim
    layers = 3 * cfg.num_hidden_layers * per_layer
    fc = 2 * 2 * T * cfg.num_aux_layers * H * H
    head = 2 * 2 * num_anchors * (B - 1) * H * cfg.vocab_size
    attn = 3 * 4 * cfg.head_dim * cfg.num_attention_heads * visible_pairs
    return float(rows * (layers + fc + head) + attn)


def _visible_pairs(blocks, cfg: DrafterConfig, seq_len: int) -> float:
    """Visible (query, key) pairs averaged over the layers' windows, from the per-anchor ranges."""
    lo, hi = blocks.context_lo.double(), blocks.context_hi.double()
    B = cfg.block_size
    total = 0.0
    for t in cfg.layer_types:
        k = torch.arange(B, dtype=torch.float64, device=lo.device)
        if t == "sliding_attention":
            lo_k = torch.maximum(lo[..., None], hi[..., None] + k - cfg.sliding_window + 1)
        else:
            lo_k = lo[..., None].expand(*lo.shape, B)
        ctx = (hi[..., None] - lo_k).clamp_min(0).sum()
        total += float(ctx) + lo.numel() * B * B  # intentional host sync: outside timed regions
    return total / cfg.num_hidden_layers


def bench_mask(shape: BenchShape, device: torch.device, iters: int = 50) -> dict[str, Any]:
    """Direct BlockMask build (all windows, one pass) vs torch's compiled create_block_mask, same anchors."""
    from torch.nn.attention.flex_attention import create_block_mask

    cfg = shape.drafter_config()
    rows = synthetic_rows(shape, device)
    emb, head = _frozen_target_modules(cfg, device)
    drafter = DFlashDrafter(cfg, emb, head).to(device)
    settings = StepSettings(num_anchors=shape.num_anchors, gamma=default_gamma(cfg.block_size), label_source="data",
                            mask_kind="flex")
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = make_blocks(rows, None, drafter, settings, gen)
    windows = cfg.attention_windows()
    T, B, R = shape.seq_len, cfg.block_size, 1
    Q = shape.num_anchors * B

    def direct():
        return build_block_masks(blocks.context_lo, blocks.context_hi, T, B, windows)

    for _ in range(5):
        direct()
    torch.cuda.synchronize()
    gpu_ms = statistics.median(cuda_times(direct, iters))
    t0 = time.perf_counter()
    for _ in range(iters):
        direct()
    host_ms = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()

    compiled = torch.compile(create_block_mask)
    ref_ms, identical = {}, {}
    ours = direct()
    for w in windows:
        mod = reference_mask_mod(blocks.context_lo, blocks.context_hi, T, B, w)
        t0 = time.perf_counter()
        ref = compiled(mod, R, 1, Q, T + Q, device=device)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        ref_ms[str(w)] = {"gpu_ms": statistics.median(cuda_times(lambda: compiled(mod, R, 1, Q, T + Q, device=device), iters)),
                          "first_call_s": compile_s}
        mine = ours[w]
        identical[str(w)] = all(torch.equal(getattr(mine, a), getattr(ref, a)) for a in
                                ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"))
    return {"windows": [str(w) for w in windows], "direct_gpu_ms": gpu_ms, "direct_host_ms": host_ms,
            "create_block_mask_compiled": ref_ms, "bit_identical": identical}


def bench_step(shape: BenchShape, device: torch.device, warmup: int = 6, iters: int = 20,
               compile_layers: bool = True, checkpoint_layers=None, loss_chunk: int | None = None,
               profile_steps: int = 6, trace: str | None = None, loss_impl: str | None = None,
               fp8: str = "off") -> dict[str, Any]:
    """Time the reference drafter step at `shape` (random weights and target outputs, no target
    model) with training's default objective (named in the JSON: loss, position_weights,
    label_source, loss_impl; loss_impl None = training's default) and the `fp8` setting
    (drafter/fp8.py); returns a JSON-ready dict of rates, ratios and the section breakdown (`_bench_rig`)."""
    rig = rig_from_shape(shape, device, compile_layers=compile_layers, checkpoint_layers=checkpoint_layers,
                         loss_chunk=loss_chunk, loss_impl=loss_impl, fp8=fp8)
    out = _bench_rig(rig, device, warmup, iters, profile_steps, trace)
    out.update(compile_layers=compile_layers, checkpoint_layers=checkpoint_layers, loss_chunk=loss_chunk,
               loss=rig.settings.loss, position_weights=rig.settings.position_weights,
               label_source=rig.settings.label_source, loss_impl=rig.settings.loss_impl)
    return out


def bench_step_config(cfg: TrainConfig, device: torch.device, *, target: Any = None, config_file: str | None = None,
                      num_documents: int = 8, warmup: int = 6, iters: int = 20, profile_steps: int = 6,
                      trace: str | None = None) -> dict[str, Any]:
    """Time a training config's step (`cfg`, a TrainConfig) with its target (`step_rig.rig_from_config`:
    loaded, or a random stand-in said in `target`): the drafter step alone on fixed target outputs,
    the target forward alone, both in series (`training_step_ms_median`), and the section breakdown
    of the series."""
    rig = rig_from_config(cfg, device, target, num_documents=num_documents)
    out = _bench_rig(rig, device, warmup, iters, profile_steps, trace)
    if cfg.target.feature_cache_gib > 0 and rig.extractor is not None:
        out.update(_bench_cached(rig, cfg, device, iters, out["training_step_ms_median"]))
    out.update(config=config_file, compile_layers=cfg.runtime.compile and device.type == "cuda",
               checkpoint_layers=cfg.experimental.checkpoint_layers, loss_chunk=cfg.experimental.loss_chunk, loss=cfg.loss.kind,
               position_weights=cfg.loss.position_weights, label_source=cfg.loss.label_source, loss_impl=cfg.experimental.loss_impl)
    return out


def _bench_cached(rig: StepRig, cfg: TrainConfig, device: torch.device, iters: int, series_ms: float) -> dict[str, Any]:
    """The training step of an epoch after the first under `feature_cache_gib`: the rows' target outputs
    served from a FeatureCache (filled once here), then the drafter step. Returns cached_step_ms_median,
    cached_tok_per_s and cached_speedup_over_series (÷ the target forward + drafter step in series)."""
    cache = FeatureCache.for_run(cfg, rig.shape["rows"])
    index = np.arange(rig.shape["rows"], dtype=np.int64)
    forward = lambda rows: extract(rig.extractor, rows, rig.settings)  # noqa: E731
    cache.outputs(index, rig.rows, forward)  # epoch 1: computed and stored
    step = lambda: rig.train_on(cache.outputs(index, rig.rows, forward))  # noqa: E731
    for _ in range(2):
        step()
    ms = statistics.median(times_ms(step, iters, device))
    summary = cache.summary()
    # a budget short of the R rows times sub-batch target forwards too, not a pure epoch-2 step
    return {"cached_step_ms_median": ms, "cached_tok_per_s": rig.context_tokens / (ms / 1e3),
            "cached_speedup_over_series": series_ms / ms, "cached_all_rows": summary["stored_rows"] == len(index),
            "feature_cache": summary}


def _bench_rig(rig: StepRig, device: torch.device, warmup: int, iters: int, profile_steps: int,
               trace: str | None) -> dict[str, Any]:
    """Measure `rig`: drafter step time (median of `iters`, CUDA events; host clock on CPU), host
    enqueue time, MFU against a bf16 matmul of this process (CUDA), peak memory; with a target, the
    target forward and the serial training step too; then the section breakdown over
    `profile_steps` steps (0 = none) of the training step (or of the drafter step without a
    target), written as a Chrome trace to `trace` when given."""
    cuda = device.type == "cuda"
    peak_tflops = matmul_tflops(device) if cuda else None
    for _ in range(warmup):
        rig.drafter_step()
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step_ms = times_ms(rig.drafter_step, iters, device)
    # Host time to enqueue a step (no sync inside); below the GPU time ⇒ the GPU never waits.
    _sync(device)
    host = []
    t0 = time.perf_counter()
    for _ in range(iters):
        h0 = time.perf_counter()
        rig.drafter_step()
        host.append((time.perf_counter() - h0) * 1e3)
    _sync(device)
    wall_ms = (time.perf_counter() - t0) / iters * 1e3
    med = statistics.median(step_ms)
    T, R = rig.shape["seq_len"], rig.shape["rows"]
    gens = row_generators(np.arange(R, dtype=np.int64), rig.seed, 0, 0, device)
    blocks = make_blocks(rig.rows, rig.target_out.argmax, rig.drafter, rig.settings, gens)
    flops = step_flops(rig.dc, T, rig.settings.num_anchors, _visible_pairs(blocks, rig.dc, T), rows=R)
    achieved = flops / (med / 1e3) / 1e12
    out: dict[str, Any] = {
        "shape": rig.shape, "target": rig.target_info, "matmul_bf16_tflops": peak_tflops, "step_ms_median": med,
        "step_ms_all": step_ms, "wall_ms_per_step": wall_ms, "host_ms_per_step_median": statistics.median(host),
        "context_tok_per_s": rig.context_tokens / (med / 1e3), "step_tflop": flops / 1e12, "achieved_tflops": achieved,
        "mfu_vs_measured_matmul": achieved / peak_tflops if peak_tflops else None,
        # FP8 matmuls (drafter/fp8.py): MFU above stays against the bf16 matmul of this process
        "fp8": rig.fp8, "fp8_linears": rig.fp8_line,
    }
    series = rig.drafter_step
    if rig.extractor is not None:
        series = rig.training_step
        for _ in range(2):
            series()
        target_ms = statistics.median(times_ms(lambda: extract(rig.extractor, rig.rows, rig.settings), iters, device))
        train_ms = statistics.median(times_ms(series, iters, device))
        out.update(target_forward_ms_median=target_ms, target_tok_per_s=rig.context_tokens / (target_ms / 1e3),
                   training_step_ms_median=train_ms, training_tok_per_s=rig.context_tokens / (train_ms / 1e3))
    b = None
    if profile_steps > 0:
        what = ("target forward + drafter step in series (one stream)" if rig.extractor is not None else
                "drafter step on fixed random target outputs")
        unprofiled = out.get("training_step_ms_median", med)
        b, _ = profile_steps_fn(lambda: [series() for _ in range(profile_steps)], profile_steps, device, what=what,
                                trace=trace, unprofiled_step_ms=unprofiled)
    out.update(breakdown=b, gpu_busy_pct=b["busy_pct"] if (b and cuda) else None,
               profiled_span_ms=b["step_ms"] * profile_steps if b else None,
               peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
               device_name=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
