"""Gradient clip + AdamW as one compiled update: after one read of every gradient for the norm
(torch's foreach norm), one elementwise pass per parameter for the clip, the moments, decoupled
weight decay and the skip of a non-finite step.

`clip_grad_norm_` then fused AdamW reads and writes every fp32 gradient once more than needed
(the multiply by the clip coefficient) and, with the coefficient handed to the fused kernel as
`grad_scale`, writes the unscaled gradient back. Here the coefficient is applied as each gradient
is read, so per parameter the pass reads p, g, m, v and writes p, m, v (28 bytes per fp32
parameter; 32 with the norm's read), the memory-bound minimum for fp32 weights and moments.

The arithmetic is torch.optim.AdamW's (decoupled weight decay, bias corrections), in fp32; the
state is an AdamW optimizer's own (exp_avg, exp_avg_sq, step per parameter), so checkpoints and
`optimizer.state_dict()` are unchanged. Source: Loshchilov & Hutter, "Decoupled Weight Decay
Regularization" (AdamW); DFlash paper A.1 (clip 1.0); torch.nn.utils.clip_grad_norm_ (coefficient).
"""

from __future__ import annotations

import torch


def adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lrs: torch.Tensor,
                 lr_index: tuple[int, ...], weight_decays: tuple[float, ...], beta1: float, beta2: float,
                 eps: float, max_norm: float, norm: torch.Tensor, loss_finite: torch.Tensor) -> torch.Tensor:
    """Clip to `max_norm` and take one AdamW step in place, or change nothing when not finite.

    params, exp_avgs, exp_avg_sqs: fp32 tensors (same shapes, one device; other dtypes are not
    supported: the moments must be fp32 for `lerp` with the fp32 gradient); grads: their gradients
    (any float dtype); steps: each parameter's 0-d fp32 step count; lrs: [G] fp32 learning rates
    (one per parameter group); lr_index, weight_decays: per parameter, its group's index into lrs
    and its weight decay. norm: 0-d fp32, the global L2 norm of `grads`, computed by the caller
    outside any compiled graph (torch's foreach norm: the same bits on every data-parallel rank,
    where an autotuned reduction could differ by an ulp and let replicas drift); loss_finite: 0-d
    bool, the loss's own finiteness.
    Returns the 0-d bool `finite` (loss and norm finite); when False no parameter, moment or step
    count changes. No host sync; compilable (torch.compile, fixed shapes): elementwise only.
    """
    finite = torch.isfinite(norm) & loss_finite
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s coefficient
    for p, g, m, v, s, gi, wd in zip(params, grads, exp_avgs, exp_avg_sqs, steps, lr_index, weight_decays):
        lr = lrs[gi]
        step = s + 1
        bias2_sqrt = (1 - beta2 ** step).sqrt()
        step_size = lr / (1 - beta1 ** step)
        g = g.float() * coef
        m_new = m.lerp(g, 1 - beta1)
        v_new = v * beta2 + (1 - beta2) * g * g
        p_new = p * (1 - lr * wd) if wd else p
        p_new = p_new - step_size * m_new / (v_new.sqrt() / bias2_sqrt + eps)
        p.copy_(torch.where(finite, p_new, p))
        m.copy_(torch.where(finite, m_new, m))
        v.copy_(torch.where(finite, v_new, v))
        s.copy_(torch.where(finite, step, s))
    return finite
