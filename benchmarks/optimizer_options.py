"""Clip + AdamW implementations on the reference drafter's parameters (≈ 1.05 B fp32): time per step
and agreement with clip_grad_norm_ + fused AdamW, one process, CUDA events (a sweep, not a test).

    python benchmarks/optimizer_options.py
"""

from __future__ import annotations

import json

import torch

from dflash_trainer.bench.common import BenchShape
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.training.optim import build_optimizer, clipped_step


def _time(fn, iters: int = 10) -> float:
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in ev)[iters // 2]


def main() -> None:
    dev = torch.device("cuda")
    cfg = BenchShape().drafter_config()
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    model = DFlashDrafter(cfg, emb, head).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    g = torch.Generator(device=dev).manual_seed(0)
    grads = [torch.randn(p.shape, device=dev, generator=g) * 1e-3 for p in params]
    start = [p.detach().clone() for p in params]

    def reset(opt):
        for p, s, gr in zip(params, start, grads):
            p.data.copy_(s)
            p.grad = gr.clone()
        opt.state.clear()

    results = {"params": n, "tensors": len(params)}

    # A: clip_grad_norm_ + fused AdamW (before); B: the norm, then fused AdamW with the clip divisor as grad_scale;
    # C: clipped_step (the compiled adamw_update, training's path)
    ours = build_optimizer(params, lr=1e-4, weight_decay=0.1)
    # A and B: torch's own fused AdamW kernel, same groups and settings as ours
    opt = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in ours.param_groups],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    ok = torch.ones((), dtype=torch.bool, device=dev)

    def a():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    def b():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        opt.found_inf = (~torch.isfinite(norm)).float()
        opt.grad_scale = torch.clamp((norm + 1e-6) / 1.0, min=1.0)
        opt.step()
        del opt.found_inf, opt.grad_scale

    def c():
        clipped_step(ours, params, 1.0, ok)

    after_one = {}
    for name, fn in (("clip_then_fused", a), ("fused_grad_scale", b), ("compiled_update", c)):
        reset(ours if fn is c else opt)
        fn()
        torch.cuda.synchronize()
        after_one[name] = [p.detach().clone() for p in params]
        results[name + "_ms"] = _time(fn)
    for name in ("fused_grad_scale", "compiled_update"):
        results[name + "_max_abs_diff_first_step"] = max(
            (x - y).abs().max().item() for x, y in zip(after_one[name], after_one["clip_then_fused"]))
    results["bytes_per_param_min"] = 28
    results["roofline_ms_at_4TBps"] = 28 * n / 4e12 * 1e3
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
