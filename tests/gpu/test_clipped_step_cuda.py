"""GPU-only: the compiled clip + AdamW update (training.optim.clipped_step on CUDA) equals
clip_grad_norm_ + torch's fused AdamW, skips a non-finite step, and runs without a host sync."""

import pytest
import torch

from dflash_trainer.training.optim import build_optimizer, build_scheduler, clipped_step

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_update_matches_torch_adamw():
    """Prevents the compiled update drifting from AdamW (clip, moments, decay, schedule) on CUDA."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(1024, 3072), (3072,), (256, 64), (64,)]
    a = [torch.nn.Parameter(torch.randn(s, device=dev, generator=g)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a = build_optimizer(a, lr=1e-3, weight_decay=0.1)
    opt_b = torch.optim.AdamW([{"params": [q for q in b if q.ndim >= 2], "weight_decay": 0.1},  # torch's own
                               {"params": [q for q in b if q.ndim < 2], "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    sched_a, sched_b = (build_scheduler(o, total_steps=6, warmup_ratio=0.3, min_lr_ratio=0.1) for o in (opt_a, opt_b))
    for i in range(6):
        scale = 10.0 if i % 2 else 1e-3  # clipped and unclipped steps
        grads = [torch.randn(p.shape, device=dev, generator=g) * scale for p in a]
        bad = i == 3
        if bad:
            grads[0][5, 7] = float("nan")
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        finite = clipped_step(opt_a, a, 1.0, torch.ones((), dtype=torch.bool, device=dev))
        assert bool(finite) is not bad
        if not bad:
            torch.nn.utils.clip_grad_norm_(b, 1.0)
            opt_b.step()
            sched_a.step()
            sched_b.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(opt_a.state[p]["exp_avg"], opt_b.state[q]["exp_avg"], rtol=1e-5, atol=1e-8)
            assert float(opt_a.state[p]["step"]) == float(opt_b.state[q]["step"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_update_makes_no_host_sync():
    """Prevents the update idling the GPU on the host (lr written by a kernel, no .item())."""
    dev = torch.device("cuda")
    ps = [torch.nn.Parameter(torch.randn(512, 256, device=dev)), torch.nn.Parameter(torch.randn(256, device=dev))]
    opt = build_optimizer(ps, lr=1e-3, weight_decay=0.1)
    ok = torch.ones((), dtype=torch.bool, device=dev)
    for _ in range(2):  # compile outside the checked region
        for p in ps:
            p.grad = torch.ones_like(p)
        clipped_step(opt, ps, 1.0, ok)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for p in ps:
                p.grad = torch.ones_like(p)
            clipped_step(opt, ps, 1.0, ok)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert float(opt.state[ps[0]]["step"]) == 5
