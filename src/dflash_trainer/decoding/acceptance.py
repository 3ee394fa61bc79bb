"""Acceptance statistics of measured speculative decoding, and the offline τ of the same drafter.

B = block size. A round proposes B−1 drafts; n ∈ {0 … B−1} of them are accepted, and the round
offers n+1 tokens (the accepted drafts plus the target's bonus token). It commits fewer when the
turn ends inside them: at the first end-of-sequence token or at the cap of new tokens
(decoding/engine.py's stopping rule). A turn's first new token comes from the prefill, as in
plain decoding, and belongs to no round.

  τ                     = tokens committed by the rounds / rounds, pooled over the turns
                        = Σ (new tokens − 1) / Σ rounds: the tokens each target verify forward
                          really added to the output (`committed_by_rounds`; decoding/committed.py,
                          torch-free, also reads an eval JSON's per-turn records: `tau_of_turns`)
  τ_uncapped            = mean over rounds of n+1: also counts what a turn's last round accepted
                          past the eos or the cap (the definition before committed τ; ≥ τ)
  accept_histogram[n]   = number of rounds that accepted exactly n drafts (length B)
  conditional[k−1]      = P(draft k accepted | drafts 1 … k−1 accepted)
                        = #rounds with n ≥ k / #rounds with n ≥ k−1,   k = 1 … B−1
                          (None where no round got that far)

Offline τ (training metric, `drafter/metrics.py`) runs the drafter through the training code (eval mode) over
[prompt + target greedy response], one block anchored at every response position (context =
everything before the anchor, as at inference), with the target's greedy labels:
exact = 1 + mean leading run of correct slots per block; estimate = 1 + Σ_k Π_{i≤k} acc_i.
Measured and offline τ of the same prompts differ only where the rounds' anchors (which depend
on acceptance) differ from "every position" and in truncation at the response end.
walk = the same blocks taken at decoding's anchors only (`walk_rounds`): the first response token, then
the position after each block's accepted run; committed tokens (response − 1) / rounds. With the same
features and drafter it is measured τ up to the two paths' rounding; where exact ≫ walk ≈ measured, the
gap is where decoding anchors (after a rejection), not a mismatch between training and serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dflash_trainer.decoding.committed import committed_by_rounds, tau  # noqa: F401 (re-exported)
from dflash_trainer.drafter.blocks import build_blocks
from dflash_trainer.drafter.loss import block_loss
from dflash_trainer.drafter.masks import build_dense_masks
from dflash_trainer.drafter.metrics import MetricAccumulator
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.target_model.features import TargetFeatureExtractor


def walk_rounds(runs: Sequence[int]) -> int:
    """The rounds greedy speculative decoding takes over one response, from the accepted run of the block
    anchored at each response position: runs[i] = leading run of correct drafts of the block anchored at the
    response's i-th token (i = 0 … n−1 for a response of n+1 tokens; the first comes from the prefill). A round
    at anchor i commits runs[i] drafts and the target's token after them, so the next anchor is i + runs[i] + 1;
    decoding ends once token n is committed. E.g. runs [2, 0, 0, 1, 0] (6 tokens): the round at anchor 0
    commits tokens 1–3, the one at anchor 3 tokens 4–5: 2 rounds. Raises ValueError for a negative run."""
    if any(r < 0 for r in runs):
        raise ValueError(f"runs must be ≥ 0, got {min(runs)}")
    i, rounds = 0, 0
    while i < len(runs):
        rounds += 1
        i += runs[i] + 1
    return rounds


def accept_histogram(accepted: Sequence[int], block_size: int) -> list[int]:
    """Counts of rounds by accepted drafts n = 0 … B−1. Raises ValueError for n outside that range."""
    hist = [0] * block_size
    for n in accepted:
        if not 0 <= n < block_size:
            raise ValueError(f"accepted={n} outside 0..{block_size - 1} for block_size={block_size}")
        hist[n] += 1
    return hist


def tau_uncapped(accepted: Sequence[int]) -> float | None:
    """Mean tokens a round offered including the bonus token (1 + mean n), whether or not the turn
    committed them; None without rounds."""
    return 1.0 + sum(accepted) / len(accepted) if accepted else None


def conditional_acceptance(hist: Sequence[int]) -> list[float | None]:
    """P(draft k accepted | drafts < k accepted) for k = 1 … B−1 from a histogram of length B."""
    B = len(hist)
    reached = [sum(hist[m:]) for m in range(B)]  # reached[m] = #rounds with n ≥ m
    return [reached[k] / reached[k - 1] if reached[k - 1] else None for k in range(1, B)]


def summarize_rounds(accepted_per_prompt: dict[str, list[int]], committed_per_prompt: dict[str, int],
                     block_size: int) -> dict[str, Any]:
    """Committed τ (pooled, and per prompt), τ_uncapped, tokens committed by rounds, histogram and
    conditional acceptance of all rounds (pooled over prompts). `committed_per_prompt[id]`: the
    tokens its rounds committed (`committed_by_rounds`, summed over its turns). The histogram counts
    what verification accepted (n), as τ_uncapped does. Raises ValueError when the two dicts name
    different prompts."""
    if set(accepted_per_prompt) != set(committed_per_prompt):
        raise ValueError("accepted_per_prompt and committed_per_prompt must name the same prompts")
    pooled = [n for rounds in accepted_per_prompt.values() for n in rounds]
    committed = sum(committed_per_prompt.values())
    hist = accept_histogram(pooled, block_size)
    return {
        "tau": tau(committed, len(pooled)),
        "tau_uncapped": tau_uncapped(pooled),
        "tau_per_prompt": {pid: tau(committed_per_prompt[pid], len(r)) for pid, r in accepted_per_prompt.items()},
        "accept_histogram": hist,
        "conditional_accept_per_position": conditional_acceptance(hist),
        "rounds": len(pooled),
        "committed_tokens": committed,
    }


@torch.no_grad()
def offline_acceptance(drafter: DFlashDrafter, extractor: TargetFeatureExtractor,
                       sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *, block_size: int | None = None,
                       zero_features: bool = False, anchors_per_pass: int = 256) -> dict[str, Any]:
    """Offline τ (module docstring) of the drafter on (prompt, response) token sequences, through the
    training code (build_blocks → build_dense_masks → drafter → block_loss → MetricAccumulator); slot k
    of the block at a is labelled with the target's argmax at a+k−1 and valid while a+k is in the response.

    block_size: B at inference (≤ trained B; default the trained B). zero_features: zero the target
    features (control drafters). anchors_per_pass bounds the dense mask [N·B, T+N·B] per forward.
    Returns tau_exact, tau_estimate, acc_per_position (slots 1 … B−1), num_blocks, and tau_walk (committed
    tokens / `walk_rounds` over the sequences, None without blocks) with walk_rounds; one host sync per sequence
    for its runs.
    """
    cfg = drafter.config
    B = block_size or cfg.block_size
    device = drafter.fc.weight.device
    was_training = drafter.training
    drafter.eval()
    acc = MetricAccumulator(B, device)
    windows = cfg.attention_windows()
    walked = committed = 0
    for prompt, response in sequences:
        if len(response) < 2:
            continue
        ids = torch.tensor([list(prompt) + list(response)], dtype=torch.long, device=device)  # [1,T]
        T = ids.shape[1]
        pos = torch.arange(T, device=device)[None]  # [1,T], one document
        loss_mask = (pos >= len(prompt)).to(torch.int8)  # response tokens are supervised
        tgt = extractor(ids, pos)  # features [1,T,k·H], argmax [1,T]
        features = torch.zeros_like(tgt.features) if zero_features else tgt.features
        starts = list(range(len(prompt), T - 1))  # anchors a with a and a+1 in the response
        runs = []  # [N] per chunk: leading run of correct slots of each block (walk_rounds)
        for c0 in range(0, len(starts), anchors_per_pass):
            chunk = starts[c0:c0 + anchors_per_pass]
            anchors = torch.tensor([chunk], dtype=torch.long, device=device)  # [1,N]
            blocks = build_blocks(ids, loss_mask, pos, anchors, torch.ones_like(anchors, dtype=torch.bool),
                                  block_size=B, mask_token_id=cfg.mask_token_id, gamma=1.0, label_source="target",
                                  target_argmax=tgt.argmax)
            masks = build_dense_masks(blocks.context_lo, blocks.context_hi, T, B, windows)
            hidden = drafter(features, pos, blocks.block_input_ids, blocks.block_position_ids, masks)  # [1,N·B,H]
            sums = block_loss(hidden, drafter.lm_head_weight, blocks.labels, blocks.loss_weight, block_size=B,
                              slot_valid=blocks.slot_valid)
            acc.add(sums)
            runs.append(sums.runs)  # [N] this chunk's blocks, in anchor order
        walked += walk_rounds(torch.cat(runs).tolist())  # host sync: this sequence's runs
        committed += len(response) - 1
    drafter.train(was_training)
    s = acc.summary()  # host sync: one copy of the sums
    out = {k: s[k] for k in ("tau_exact", "tau_estimate", "acc_per_position", "num_blocks")}
    return {**out, "tau_walk": tau(committed, walked), "walk_rounds": walked}
