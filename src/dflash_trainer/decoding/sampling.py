"""Token choice for batched generation: greedy, or temperature / top-p sampling by inverse CDF.

Shapes: R = rows, V = vocabulary.

Sampling takes one uniform number per row instead of V (Gumbel / exponential noise) and no
`torch.multinomial`, so the whole choice is a fixed chain of kernels with no host sync and no
random-number call: the uniforms are drawn outside, by the caller, from its own seeded generator.
That is what lets the decode step, sampling included, be captured once in a CUDA graph and
replayed (decoding/continuous.py), and makes graph and eager choose the same tokens.

Inverse CDF: with probabilities p over the kept tokens and u ~ U[0, 1), the token is the first
index i whose cumulative sum c_i exceeds u · c_V (the sum over kept tokens; renormalization is
folded into that product). Top-p (nucleus, Holtzman et al. 2020, "The Curious Case of Neural Text
Degeneration"): keep the smallest set of most likely tokens whose probability reaches top_p (the
most likely token always stays), found by sorting each row once.
"""

from __future__ import annotations

import torch


def check_sampling(temperature: float, top_p: float) -> None:
    """Raise ValueError naming the setting unless temperature ≥ 0 and 0 < top_p ≤ 1."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: must be in (0, 1] (1 = no nucleus filter)")


def pick_tokens(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """Next tokens [R] int64 from logits [R,V] (any float dtype; computed in fp32).

    temperature ≤ 0: argmax (uniforms unused). Otherwise softmax(logits / temperature), filtered
    to the top_p nucleus when top_p < 1, sampled by inverse CDF with uniforms [R] fp32 in [0, 1)
    (required; ValueError without). Pure tensor ops: no host sync, capturable in a CUDA graph.
    """
    if temperature <= 0:
        return logits.argmax(-1)
    if uniforms is None:
        raise ValueError("sampling (temperature > 0) needs uniforms [R] in [0, 1)")
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [R,V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [R,V] ×2
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))  # rank 0 always kept
        cdf = sorted_p.cumsum(-1)
        rank = (cdf < uniforms[:, None] * cdf[:, -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)  # [R]
        return order.gather(-1, rank[:, None])[:, 0]
    cdf = probs.cumsum(-1)  # [R,V]
    return (cdf < uniforms[:, None] * cdf[:, -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)


def repeated_tail(out: torch.Tensor, count: torch.Tensor, ngram: int) -> torch.Tensor:
    """bool [R]: rows whose last `ngram` generated tokens already occurred earlier in the same output.

    out [R,N] int64 generated tokens (only the first count[r] of row r are meaningful); count [R]
    int64. An earlier occurrence may overlap the tail (a loop of period p < ngram repeats the
    n-gram p tokens back), so a row is flagged once it has written ngram + p tokens of a period-p
    loop. Only windows wholly inside the first count[r] tokens are compared (stale tokens past a
    row's count never match). Cost: R · (N − ngram + 1) · ngram comparisons, no host sync.
    Raises ValueError when ngram < 1.
    """
    if ngram < 1:
        raise ValueError(f"loop n-gram={ngram}: must be >= 1")
    R, N = out.shape
    if N <= ngram:
        return torch.zeros(R, dtype=torch.bool, device=out.device)
    tail_start = count - ngram  # [R]; < 1 means no earlier window fits
    idx = (tail_start[:, None] + torch.arange(ngram, device=out.device)).clamp(0, N - 1)  # [R,n]
    tail = out.gather(1, idx)  # [R,n]
    windows = out.unfold(1, ngram, 1)  # [R, N−n+1, n] view
    same = (windows == tail[:, None, :]).all(-1)  # [R, N−n+1]
    earlier = torch.arange(N - ngram + 1, device=out.device)[None] < tail_start[:, None]
    return (same & earlier).any(-1)
