"""`dflash-train bench mask|step`: the drafter step's speed at the reference configuration.

Everything is measured in one process: the bf16 matmul ceiling (for MFU), the direct mask build
against torch's compiled `create_block_mask`, the full training step (anchors, blocks, masks,
forward, loss, backward, clip, AdamW), host time per step, GPU-busy % from a profiler trace
(union of kernel intervals over the span), and peak memory.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from dflash_trainer.bench.common import BenchShape, busy_fraction_from_profile, cuda_times, matmul_tflops, synthetic_rows
from dflash_trainer.drafter.config import DrafterConfig, default_gamma
from dflash_trainer.drafter.masks import build_block_masks, reference_mask_mod
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.training import precision
from dflash_trainer.training.optim import build_optimizer
from dflash_trainer.training.step import StepSettings, drafter_step, make_blocks


def _frozen_target_modules(cfg: DrafterConfig, device: torch.device) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=torch.bfloat16)
    for m in (emb, head):
        torch.nn.init.normal_(m.weight, std=0.02)
        m.requires_grad_(False)
    return emb, head


def step_flops(cfg: DrafterConfig, seq_len: int, num_anchors: int, visible_pairs: float) -> float:
    """Model FLOPs of one training step (forward + backward), matmuls and attention.

    Trainable linears count 3× their forward (forward, input grad, weight grad); `fc` 2× (its input
    needs no grad); the frozen LM head 2× (forward, input grad) over the B−1 trained slots;
    attention 3× its forward 4·head_dim·heads·visible_pairs.
    """
    H, I, B = cfg.hidden_size, cfg.intermediate_size, cfg.block_size
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    Q, T = num_anchors * B, seq_len
    per_layer = 2 * Q * H * (q_dim + 2 * kv_dim) + 2 * Q * q_dim * H + 3 * 2 * Q * H * I + 2 * T * H * 2 * kv_dim
    layers = 3 * cfg.num_hidden_layers * per_layer
    fc = 2 * 2 * T * cfg.num_aux_layers * H * H
    head = 2 * 2 * num_anchors * (B - 1) * H * cfg.vocab_size
    attn = 3 * 4 * cfg.head_dim * cfg.num_attention_heads * visible_pairs
    return float(layers + fc + head + attn)


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
               compile_layers: bool = True, checkpoint_layers=None, loss_chunk: int | None = None) -> dict[str, Any]:
    """Time the full drafter training step at `shape`; returns a JSON-ready dict of rates and ratios."""
    peak_tflops = matmul_tflops(device)
    cfg = shape.drafter_config()
    rows = synthetic_rows(shape, device)
    emb, head = _frozen_target_modules(cfg, device)
    drafter = DFlashDrafter(cfg, emb, head, checkpoint_layers=checkpoint_layers).to(device)
    if compile_layers:
        drafter.compile_layers()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = build_optimizer(params, lr=1e-4, weight_decay=0.0)
    g = torch.Generator(device=device).manual_seed(1)
    k_h = cfg.num_aux_layers * cfg.hidden_size
    features = torch.randn(1, shape.seq_len, k_h, device=device, dtype=torch.bfloat16, generator=g)
    argmax = torch.randint(0, cfg.vocab_size, (1, shape.seq_len), device=device, generator=g)
    settings = StepSettings(num_anchors=shape.num_anchors, gamma=default_gamma(cfg.block_size), mask_kind="flex",
                            compiled_loss=compile_layers, loss_chunk=loss_chunk)
    gen = torch.Generator(device=device).manual_seed(0)

    def step():
        with precision.autocast(device):
            sums = drafter_step(drafter, rows, features, argmax, settings, gen)
        loss = sums.loss_sum / sums.weight_sum.clamp_min(1.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step_ms = cuda_times(step, iters)
    # Host time to enqueue a step (no sync inside); below the GPU time ⇒ the GPU never waits.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host = []
    for _ in range(iters):
        h0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - h0) * 1e3)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / iters * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    busy, span_ms = busy_fraction_from_profile(prof)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30

    blocks = make_blocks(rows, argmax, drafter, settings, torch.Generator(device=device).manual_seed(0))
    flops = step_flops(cfg, shape.seq_len, shape.num_anchors, _visible_pairs(blocks, cfg, shape.seq_len))
    med = statistics.median(step_ms)
    achieved = flops / (med / 1e3) / 1e12
    return {
        "shape": shape.__dict__, "matmul_bf16_tflops": peak_tflops, "step_ms_median": med,
        "step_ms_all": step_ms, "wall_ms_per_step": wall_ms, "host_ms_per_step_median": statistics.median(host),
        "context_tok_per_s": shape.seq_len / (med / 1e3), "step_tflop": flops / 1e12, "achieved_tflops": achieved,
        "mfu_vs_measured_matmul": achieved / peak_tflops, "gpu_busy_pct": 100 * busy, "profiled_span_ms": span_ms,
        "peak_mem_gib": peak_gib, "compile_layers": compile_layers, "checkpoint_layers": checkpoint_layers, "loss_chunk": loss_chunk,
        "device_name": torch.cuda.get_device_name(device), "torch": torch.__version__,
    }
