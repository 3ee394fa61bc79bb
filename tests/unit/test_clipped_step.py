"""clipped_step: clip + AdamW in one update (adamw_update) equals clip_grad_norm_ + torch's AdamW step."""

import copy

import pytest
import torch

from dflash_trainer.training.optim import ClippedAdamW, build_optimizer, build_scheduler, clipped_step


def _pair(seed: int):
    """Two identical parameter sets (a matrix with decay, a vector without): the first with
    build_optimizer's ClippedAdamW, the second with torch's own fused AdamW."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 19), (19,)]
    a = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    return a, build_optimizer(a, lr=1e-2, weight_decay=0.1), b, _torch_adamw(b)


def _torch_adamw(b):
    """torch's own fused AdamW with build_optimizer's groups and settings: the reference."""
    return torch.optim.AdamW([{"params": [b[0]], "weight_decay": 0.1}, {"params": [b[1]], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)


def _assert_same(a, opt_a, b, opt_b):
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_a.state[p][key], opt_b.state[q][key], rtol=1e-5, atol=1e-9)
        assert float(opt_a.state[p]["step"]) == float(opt_b.state[q]["step"])


@pytest.mark.parametrize("grad_scale", [10.0, 0.01])  # ‖g‖ ≈ 270 (clipped) and ≈ 0.27 (not clipped)
def test_matches_clip_grad_norm_then_adamw(grad_scale):
    """Prevents a wrong clip, moment, bias correction or weight decay: four steps under a warmup + cosine
    schedule equal clip_grad_norm_(1.0) + torch's fused AdamW.step() within fp32 rounding."""
    a, opt_a, b, opt_b = _pair(0)
    sched_a, sched_b = (build_scheduler(o, total_steps=4, warmup_ratio=0.5, min_lr_ratio=0.1) for o in (opt_a, opt_b))
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g) * grad_scale for p in a]
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        assert bool(clipped_step(opt_a, a, 1.0, torch.tensor(True)))
        torch.nn.utils.clip_grad_norm_(b, 1.0)
        opt_b.step()
        _assert_same(a, opt_a, b, opt_b)
        sched_a.step()
        sched_b.step()
    if grad_scale > 1:  # the clip acted: unclipped moments would be ~100x larger
        assert torch.linalg.vector_norm(opt_a.state[a[0]]["exp_avg"]) < 1.0


def test_state_is_adamws_own():
    """Prevents a checkpoint format change: the state clipped_step creates loads into torch's fused AdamW,
    and both continue from it to the same weights (and torch's state loads into ClippedAdamW)."""
    a, opt_a, b, opt_b = _pair(3)
    g = torch.Generator().manual_seed(4)
    grads = [[torch.randn(p.shape, generator=g) for p in a] for _ in range(2)]
    for p, gr in zip(a, grads[0]):
        p.grad = gr.clone()
    clipped_step(opt_a, a, 1.0, torch.tensor(True))
    assert {k: (v.dtype, v.shape) for k, v in opt_a.state[a[0]].items()} == {
        "step": (torch.float32, torch.Size([])), "exp_avg": (torch.float32, a[0].shape),
        "exp_avg_sq": (torch.float32, a[0].shape)}
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # load_state_dict would share the tensors
    for p, q, gr in zip(a, b, grads[1]):
        p.grad, q.grad = gr.clone(), gr.clone()
    clipped_step(opt_a, a, 1.0, torch.tensor(True))
    torch.nn.utils.clip_grad_norm_(b, 1.0)
    opt_b.step()
    _assert_same(a, opt_a, b, opt_b)


def test_nonfinite_step_changes_nothing():
    """Prevents a NaN gradient (or a non-finite loss) from reaching the weights, moments or step count."""
    a, opt, _, _ = _pair(2)
    for p in a:
        p.grad = torch.ones_like(p)
    clipped_step(opt, a, 1.0, torch.tensor(True))
    before = [p.detach().clone() for p in a]
    moments = [opt.state[p]["exp_avg_sq"].clone() for p in a]
    for loss_finite, bad in ((torch.tensor(True), float("nan")), (torch.tensor(True), float("inf")),
                             (torch.tensor(False), 1.0)):
        for p in a:
            p.grad = torch.ones_like(p)
        a[0].grad[3, 4] = bad
        assert not bool(clipped_step(opt, a, 1.0, loss_finite))
        assert all(torch.equal(x, p) for x, p in zip(before, a))
        assert all(torch.equal(m, opt.state[p]["exp_avg_sq"]) for m, p in zip(moments, a))
        assert all(float(opt.state[p]["step"]) == 1 for p in a)


def test_other_fused_optimizer_gets_the_divisor():
    """Prevents unclipped updates through the grad_scale path: fused SGD (lr 1) moves by the clipped gradient."""
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])  # ‖g‖ = 5 → clipped to 1
    clipped_step(torch.optim.SGD([p], lr=1.0, fused=True), [p], 1.0, torch.tensor(True))
    torch.testing.assert_close(p.detach(), -torch.tensor([0.6, 0.8, 0.0, 0.0]), rtol=1e-5, atol=1e-6)


def test_refuses_an_optimizer_that_would_ignore_the_clip():
    """Prevents silently unclipped updates: a non-fused, non-AdamW optimizer ignores grad_scale."""
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="fused=True"):
        clipped_step(torch.optim.SGD([p], lr=1.0), [p], 1.0, torch.tensor(True))


def test_plain_step_is_adamw_and_the_scheduler_sees_it():
    """Prevents two surprises: ClippedAdamW.step() without a clip is torch's AdamW step, and an LR
    scheduler stepping after clipped_step does not warn that the optimizer never stepped."""
    import warnings

    a, opt_a, b, opt_b = _pair(5)
    for p, q in zip(a, b):
        p.grad = torch.full_like(p, 0.5)
        q.grad = torch.full_like(q, 0.5)
    opt_a.step()  # max_norm inf: no clip (‖g‖ ≈ 13.7)
    opt_b.step()
    _assert_same(a, opt_a, b, opt_b)
    sched = build_scheduler(opt_a, total_steps=4, warmup_ratio=0.5, min_lr_ratio=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clipped_step(opt_a, a, 1.0, torch.tensor(True))
        sched.step()


def test_each_group_steps_with_its_own_lr():
    """Prevents one group's learning rate reaching another's parameters (lr_index)."""
    g = torch.Generator().manual_seed(6)
    a = [torch.nn.Parameter(torch.randn(8, 4, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    groups = lambda ps: [{"params": [ps[0]], "lr": 1e-2, "weight_decay": 0.1}, {"params": [ps[1]], "lr": 3e-4}]  # noqa: E731
    opt_a = ClippedAdamW(groups(a), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    opt_b = torch.optim.AdamW(groups(b), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    for _ in range(2):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        clipped_step(opt_a, a, 1.0, torch.tensor(True))
        torch.nn.utils.clip_grad_norm_(b, 1.0)
        opt_b.step()
        _assert_same(a, opt_a, b, opt_b)


def test_compiled_update_is_one_graph_equal_to_eager():
    """Prevents a recompile per step (the lr changes every step, a skipped step takes the other branch) and a
    compiled update that differs from the eager one (inductor's CPU backend here; CUDA in tests/gpu)."""
    from torch._dynamo.utils import counters

    from dflash_trainer.training.adamw_update import adamw_update

    g = torch.Generator().manual_seed(7)
    shapes = [(64, 32), (32,), (16, 8)]
    sets = []
    for _ in range(2):
        g_init = torch.Generator().manual_seed(8)
        p = [torch.randn(s, generator=g_init) for s in shapes]
        sets.append((p, [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p],
                     [torch.zeros(()) for _ in p]))
    lrs = torch.zeros(2)
    compiled = torch.compile(adamw_update, dynamic=False)
    torch._dynamo.reset()
    counters.clear()
    for i in range(4):
        grads = [torch.randn(s, generator=g) * 10 for s in shapes]
        if i == 2:
            grads[0][0, 0] = float("nan")
        norm = torch.nn.utils.get_total_norm(grads)
        lrs.copy_(torch.tensor([1e-2 * (i + 1), 3e-3]))
        flags = [fn(p, grads, m, v, s, lrs, (0, 1, 0), (0.1, 0.0, 0.1), 0.9, 0.95, 1e-8, 1.0, norm, torch.tensor(True))
                 for fn, (p, m, v, s) in zip((compiled, adamw_update), sets)]
        assert bool(flags[0]) == bool(flags[1]) == (i != 2)
        for x, y in zip(sets[0][0] + sets[0][1] + sets[0][2], sets[1][0] + sets[1][1] + sets[1][2]):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    assert [float(s) for s in sets[0][3]] == [3.0] * 3
    assert counters["stats"]["unique_graphs"] == 1


def test_torch_adamw_state_loads_and_settings_do_not_linger():
    """Prevents two regressions: a checkpoint of torch's fused AdamW (what training saved before) resumes
    into ClippedAdamW to the same weights, and a non-finite clipped_step leaves no clip or skip behind for
    a later plain step()."""
    a, opt_a, b, opt_b = _pair(9)
    for p, q in zip(a, b):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    opt_b.step()  # torch's own state
    opt_a.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    with torch.no_grad():
        for p, q in zip(a, b):
            p.copy_(q)
    assert not bool(clipped_step(opt_a, a, 1.0, torch.tensor(False)))  # skipped: nothing moves
    assert opt_a.max_norm == float("inf") and opt_a.loss_finite is None
    opt_a.step()  # a plain step: unclipped, not skipped
    opt_b.step()
    _assert_same(a, opt_a, b, opt_b)
