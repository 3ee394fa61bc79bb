"""AdamW with linear warmup and cosine decay (DFlash paper A.1: lr 6e-4, warmup 4%, clip 1.0)."""

from __future__ import annotations

import functools
import math

import torch

from dflash_trainer.training.adamw_update import adamw_update


class ClippedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose `step()` is `adamw_update`: the global gradient-norm clip and the AdamW
    update in one pass per parameter (compiled on CUDA), skipped on the device when not finite.

    Same state and state_dict as AdamW (checkpoints load either way). `step()` reads `max_norm` (float;
    default inf, no clip) and `loss_finite` (0-d bool tensor on the parameters' device, or None = finite)
    and leaves the on-device flag `finite` (loss and norm finite). Set them with `clipped_step`.
    `compiled` (keyword, default True): False runs the update eagerly on CUDA too (the `compile: false`
    setting); True compiles one graph at the first step on CUDA (seconds; once per process and
    parameter set).
    Raises ValueError from step() for a closure, amsgrad, maximize, a tensor lr or per-group betas/eps.
    """

    max_norm: float = math.inf
    loss_finite: torch.Tensor | None = None
    finite: torch.Tensor | None = None
    _lr_by_group: torch.Tensor | None = None  # [G] fp32 on the parameters' device, refilled every step

    def __init__(self, *args, compiled: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.compiled = compiled
        # fused=True would tell torch.amp.GradScaler that step() unscales and skips by itself; this one does not
        self._step_supports_amp_scaling = False

    def step(self, closure=None):  # noqa: D102 - the class docstring says what it does
        if closure is not None:
            raise ValueError("ClippedAdamW.step takes no closure")
        self.finite = _adamw_step(self, self.max_norm, self.loss_finite)


def build_optimizer(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float,
                    compiled: bool = True) -> ClippedAdamW:
    """AdamW over the drafter's trainable parameters; norms and 1-D weights get no decay; its step is
    the clip + update of `adamw_update` (ClippedAdamW; training calls `clipped_step`), compiled on CUDA
    unless `compiled` is False."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused=True only keeps the param groups (and so checkpoints) as they were when torch's fused kernel ran
    return ClippedAdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True, compiled=compiled)


def clipped_step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float,
                 loss_finite: torch.Tensor) -> torch.Tensor:
    """Clip the global gradient norm to `max_norm` and step, skipping a non-finite step on the device.

    ClippedAdamW (build_optimizer): its step, `adamw_update.adamw_update` over its own state, compiled
    on CUDA: one read of the gradients for the norm, then one pass per parameter (the update of
    clip_grad_norm_ + AdamW.step() up to fp32 rounding; the state stays AdamW's). Another fused
    optimizer (fused SGD in tests): the norm, then its own step with the clip divisor
    max(1, (‖g‖ + 1e-6) / max_norm) as `grad_scale`.

    params: the parameters `opt` updates (those without a gradient are skipped; ClippedAdamW takes
    them from its own param_groups, which every caller builds from the same list). loss_finite: 0-d
    bool tensor on their device, the loss's own finiteness. Returns the on-device `finite` flag
    (loss and gradient norm finite); a non-finite step changes no weight and no optimizer state.
    No host sync.
    Raises ValueError for an optimizer that is neither ClippedAdamW nor fused (it would ignore the clip
    divisor), or as ClippedAdamW.step does.
    Source: DFlash paper A.1 (clip 1.0); torch.nn.utils.clip_grad_norm_ (the coefficient).
    """
    if isinstance(opt, ClippedAdamW):
        opt.max_norm, opt.loss_finite = float(max_norm), loss_finite
        try:
            opt.step()  # through Optimizer's wrapper: step hooks, the LR scheduler's "optimizer stepped" mark
        finally:  # a later plain step() neither clips nor inherits this step's verdict
            opt.max_norm, opt.loss_finite = math.inf, None
        return opt.finite
    if not all(group.get("fused") for group in opt.param_groups):
        raise ValueError(f"clipped_step needs ClippedAdamW or a fused optimizer (fused=True): {type(opt).__name__} would "
                         "ignore grad_scale and apply unclipped gradients")
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    finite = torch.isfinite(norm) & loss_finite
    opt.found_inf = (~finite).to(torch.float32)
    opt.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
    opt.step()
    return finite


@functools.cache
def _compiled_update():
    """`adamw_update` compiled once per process (a graph per parameter set; fixed shapes)."""
    return torch.compile(adamw_update, dynamic=False)


def _adamw_step(opt: ClippedAdamW, max_norm: float, loss_finite: torch.Tensor | None) -> torch.Tensor:
    """ClippedAdamW.step: state created as AdamW creates it, lr per group as a device tensor."""
    params, groups = [], []
    for gi, group in enumerate(opt.param_groups):
        if group["amsgrad"] or group["maximize"] or isinstance(group["lr"], torch.Tensor):
            raise ValueError("ClippedAdamW supports neither amsgrad nor maximize, and needs a float lr")
        for p in group["params"]:
            if p.grad is not None:
                params.append(p)
                groups.append(gi)
    if not params:
        return torch.ones((), dtype=torch.bool) if loss_finite is None else loss_finite.clone()
    for p in params:
        state = opt.state[p]
        if not state:  # what AdamW's fused/capturable path creates: step a 0-d fp32 tensor on the device
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    device = params[0].device
    if loss_finite is None:
        loss_finite = torch.ones((), dtype=torch.bool, device=device)
    lrs = opt._lr_by_group
    if lrs is None or lrs.device != device or lrs.numel() != len(opt.param_groups):
        lrs = opt._lr_by_group = torch.zeros(len(opt.param_groups), dtype=torch.float32, device=device)
    for gi, group in enumerate(opt.param_groups):
        lrs[gi].fill_(group["lr"])  # a kernel launch with the value, no copy from the host
    (beta1, beta2), eps = opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]
    if any(g["betas"] != (beta1, beta2) or g["eps"] != eps for g in opt.param_groups):
        raise ValueError("ClippedAdamW needs the same betas and eps in every parameter group")
    states = [opt.state[p] for p in params]
    grads = [p.grad for p in params]
    update = _compiled_update() if device.type == "cuda" and opt.compiled else adamw_update
    with torch.no_grad():
        norm = torch.nn.utils.get_total_norm(grads, 2.0).float()  # foreach kernels: rank-independent bits
        return update(params, grads, [s["exp_avg"] for s in states],
                      [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lrs, tuple(groups),
                      tuple(float(opt.param_groups[g]["weight_decay"]) for g in groups), beta1, beta2, eps,
                      float(max_norm), norm, loss_finite)


def cosine_with_warmup(step: int, *, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at `step` (0-based): linear 1/w … 1 over warmup, then cosine down to min_lr_ratio."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, *, total_steps: int, warmup_ratio: float,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying `cosine_with_warmup`; warmup = round(warmup_ratio · total_steps)."""
    warmup = int(round(warmup_ratio * total_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cosine_with_warmup(s, total_steps=total_steps, warmup_steps=warmup, min_lr_ratio=min_lr_ratio))
