"""The lossless rule of DFlash verification, for R rows at once: which drafts a round accepts and
which token follows them. Pure tensor ops, no host sync, no random-number call (uniforms come from
the caller), so a whole round can be captured in a CUDA graph (decoding/engine.py).

Shapes: R = rows, B = block size (anchor + B−1 drafts), V = vocabulary.

Greedy (T = 0): drafts d_1 … d_{B−1} are the drafter's argmax; the target's logits at positions
a … a+B−1 give its tokens t_1 … t_B; n = the length of the leading run with d_k = t_k, and the
round commits d_1 … d_n and the bonus token t_{n+1}. Every committed token is then the target's
greedy token, so the output equals plain greedy decoding token for token.

Sampling (T > 0, speculative sampling): q_k = softmax(drafter logits of slot k / T) and
p_j = softmax(target logits at position a+j / T). The drafts of a DFlash block come from one pass,
so q_k depends only on the committed prefix: a valid proposal. Draft d_k ~ q_k is accepted with
probability min(1, p_{k−1}(d_k) / q_k(d_k)); at the first rejection (slot n+1) the next token is
drawn from norm(max(0, p_n − q_{n+1})); when all B−1 are accepted the bonus is drawn from p_{B−1}.
Every committed token is then distributed exactly as the target's own samples at temperature T
(chi-square tests in tests/unit/test_engine.py).
"""

from __future__ import annotations

import torch


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF samples: probs [..., V] (non-negative, any positive total), u [...] in [0, 1).
    Returns long [...]: the first index whose cumulative sum exceeds u · total."""
    cdf = probs.cumsum(-1)
    return (cdf < u[..., None] * cdf[..., -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [R,B−1], target_logits [R,B,V] (row j at position a+j). Returns (n [R] accepted drafts,
    next [R,B]: the tokens a round would commit, d_1 … d_n then the bonus t_{n+1} at slot n; slots
    past n are unused). The accepted drafts equal the target's tokens (d_k = t_k for k ≤ n), so
    next is t_1 … t_B itself: the committed tokens are the target's greedy tokens by construction."""
    pred = target_logits.argmax(-1)  # [R,B] t_1 … t_B
    n = torch.cumprod(drafts == pred[:, :-1], 1).sum(1)  # [R]
    return n, pred


def accept_sampled(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                   u_accept: torch.Tensor, u_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (module docstring). drafts [R,B−1] drawn from q [R,B−1,V];
    p [R,B,V] target probabilities; u_accept [R,B−1] and u_next [R] uniforms in [0, 1).
    Returns (n [R], next [R,B]) as `accept_greedy`."""
    R, Bm1 = drafts.shape
    p_d = p[:, :-1].gather(2, drafts[..., None])[..., 0]  # [R,B−1] p_{k−1}(d_k)
    q_d = q.gather(2, drafts[..., None])[..., 0]  # [R,B−1] q_k(d_k) > 0 (d_k was drawn from q_k)
    ok = u_accept * q_d <= p_d  # u < p/q without dividing
    n = torch.cumprod(ok.long(), 1).sum(1)  # [R]
    p_n = p.gather(1, n[:, None, None].expand(R, 1, p.shape[-1]))[:, 0]  # [R,V]
    q_n = q.gather(1, n.clamp(max=Bm1 - 1)[:, None, None].expand(R, 1, q.shape[-1]))[:, 0]
    q_n = torch.where((n < Bm1)[:, None], q_n, 0.0)  # all accepted: the bonus comes from p_{B−1} itself
    residual = (p_n - q_n).clamp_min(0.0)
    # the residual sums to 0 only where p_n = q_n, where nothing is rejected; p_n keeps it well defined
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
    bonus = sample_from(residual, u_next)[:, None]  # [R,1]
    slot = torch.arange(Bm1 + 1, device=drafts.device)[None]  # [1,B]
    return n, torch.where(slot < n[:, None], torch.cat([drafts, bonus], 1), bonus)  # drafts at slots < n, bonus after
