"""On-device accumulation of the drafter's loss/accuracy sums; one host copy per summary.

B = block size. Per-position accuracy acc_k (k = 1..B−1) = correct_k / count_k. Acceptance length
τ counts the bonus token: exact offline τ = 1 + mean leading run of correct slots per block;
product estimate = 1 + Σ_k Π_{i≤k} acc_i (ignores the correlation between slots).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dflash_trainer.drafter.loss import LossSums


class MetricAccumulator:
    """Sums LossSums on the device (detached); `summary()` copies them to the host once and resets."""

    def __init__(self, block_size: int, device: torch.device | str):
        self.block_size = block_size
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        # Layout of the packed vector: [loss_sum, weight_sum, run_length_sum, num_blocks, correct[B], count[B],
        # skipped_steps, consecutive_skips]; the last entry is a running value, not reset per summary.
        consecutive = self._sums[-1].clone() if hasattr(self, "_sums") else None
        self._sums = torch.zeros(6 + 2 * self.block_size, dtype=torch.float64, device=self.device)
        if consecutive is not None:
            self._sums[-1] = consecutive

    def add(self, sums: LossSums, finite: torch.Tensor | None = None) -> None:
        """Accumulate one step's sums (no host sync).

        finite: bool scalar tensor; when False the step was skipped (non-finite loss or gradients):
        its sums are left out and the skip counters advance.
        """
        if sums.correct.shape[0] != self.block_size:
            raise ValueError(f"LossSums has {sums.correct.shape[0]} slots, accumulator block_size={self.block_size}")
        packed = torch.cat([
            torch.stack([sums.loss_sum.detach().double(), sums.weight_sum.detach().double(),
                         sums.run_length_sum.detach().double(), sums.num_blocks.detach().double()]),
            sums.correct.detach().double(), sums.count.detach().double(),
        ]).to(self.device)
        if finite is None:
            self._sums[:-2] += packed
            self._sums[-1] = 0.0
            return
        ok = finite.to(self.device)
        self._sums[:-2] += torch.where(ok, packed, torch.zeros_like(packed))
        self._sums[-2] += (~ok).double()
        self._sums[-1] = torch.where(ok, torch.zeros_like(self._sums[-1]), self._sums[-1] + 1)

    def all_reduce(self, group: Any = None) -> None:
        """Sum the (sum, count) entries over the ranks of `group` in place, one collective (no host
        sync): [loss_sum, weight_sum, run_length_sum, num_blocks, correct[B], count[B]]. The skip
        counters after them are the same on every rank and are left as they are."""
        dist.all_reduce(self._sums[:4 + 2 * self.block_size], group=group)

    def state(self) -> torch.Tensor:
        """The accumulated sums (for a resumable checkpoint)."""
        return self._sums.detach().cpu().clone()

    def load_state(self, sums: torch.Tensor) -> None:
        """Restore sums saved by `state()`."""
        self._sums = sums.to(self.device, torch.float64).clone()

    def summary(self) -> dict[str, Any]:
        """loss (Σ w·loss / Σ w), acc_per_position (slots 1..B−1, None where no valid slot), tau_exact,
        tau_estimate (slots without data count as accuracy 0), valid_slots, num_blocks, weight_sum,
        skipped_steps (since the last summary), consecutive_skips (running).
        Values are None where their denominator is 0. Resets the accumulator.
        """
        b = self.block_size
        values = self._sums.cpu().tolist()  # host sync: the one device→host copy per summary
        self.reset()
        loss_sum, weight_sum, run_sum, num_blocks = values[:4]
        correct, count = values[4:4 + b], values[4 + b:4 + 2 * b]
        skipped, consecutive = values[-2], values[-1]
        acc = [correct[k] / count[k] if count[k] > 0 else None for k in range(1, b)]
        tau_estimate, prod = None, 1.0
        if sum(count) > 0:
            tau_estimate = 1.0
            for a in acc:
                prod *= a if a is not None else 0.0
                tau_estimate += prod
        return {
            "loss": loss_sum / weight_sum if weight_sum > 0 else None,
            "acc_per_position": acc,
            "tau_exact": 1.0 + run_sum / num_blocks if num_blocks > 0 else None,
            "tau_estimate": tau_estimate,
            "valid_slots": int(sum(count)),
            "num_blocks": int(num_blocks),
            "weight_sum": weight_sum,
            "skipped_steps": int(skipped),
            "consecutive_skips": int(consecutive),
        }

