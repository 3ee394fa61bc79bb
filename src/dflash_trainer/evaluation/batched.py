"""Greedy plain and DFlash speculative decoding of many prompts at once (T = 0).

Shapes: R = prompts decoded together, P = longest prompt, B = block size, N = max_new_tokens.

Plain decoding is continuous batching without refills (target_model/continuous.py; on CUDA each step
is a CUDA graph replay). Speculative decoding: each row follows exactly the one-sequence loop of
`speculate.py` (same round, same acceptance, same stop rule: `max_new_tokens` tokens or the first
end-of-sequence token, kept), with its own anchor position and acceptance; rows that stopped keep
riding along and are ignored. All state lives on the device (spec_rounds.py); eagerly the host
reads one small tensor per round (are all rows done; the longest row, to bound the attended span),
on CUDA each round is a CUDA graph replay and the host looks every few rounds. At T = 0 the output
of every row equals the one-sequence loop's token for token (tests/unit/test_eval_batched.py).

Memory: the target cache is R × (P + N + B) slots per layer and the drafter's context cache the
same; callers choose R (`eval --batch-size`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dflash_trainer.evaluation.batched_draft import BatchedDraftSession
from dflash_trainer.evaluation.spec_rounds import SpeculativeRounds
from dflash_trainer.evaluation.speculate import sync_device
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.target_model.batched import BatchedTarget, right_padded
from dflash_trainer.target_model.continuous import ContinuousGenerator, generate_all
from dflash_trainer.target_model.load import TargetBundle

SYNC_EVERY = 8  # plain decoding: steps between looks at which rows are done


@dataclass
class BatchGeneration:
    """Per row: new tokens (eos kept when hit), accepted drafts per round (speculative only),
    stop reason "eos" | "length"; wall_s: host wall-clock of the whole batch (prefill included)."""

    tokens: list[list[int]]
    accepted: list[list[int]]
    stop: list[str]
    wall_s: float


def _check_prompts(prompts: list[list[int]]) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt (or no prompts): decoding needs at least one prompt token per row")


def _pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens [R,P] (pad 0) and lengths [R]. ValueError on an empty prompt."""
    _check_prompts(prompts)
    return right_padded(prompts, device)


def _rows(out: torch.Tensor, count: torch.Tensor, eos_hit: torch.Tensor) -> tuple[list[list[int]], list[str]]:
    counts, hits, toks = count.tolist(), eos_hit.tolist(), out.tolist()  # host sync: the results
    return [t[:c] for t, c in zip(toks, counts)], ["eos" if h else "length" for h in hits]


@torch.no_grad()
def plain_batch(target: TargetBundle, prompts: list[list[int]], *, max_new_tokens: int,
                eos_ids: set[int], cuda_graph: bool = True) -> BatchGeneration:
    """Greedy target-only decoding of every prompt, one row each (target_model/continuous.py; on CUDA
    the decode step is a CUDA graph): the reference for losslessness and the speed baseline."""
    if not eos_ids:
        raise ValueError("eos_ids is empty: decoding needs an end-of-sequence token")
    device = target.embed_tokens.weight.device
    sync_device(device)
    t0 = time.perf_counter()
    _check_prompts(prompts)
    gen = ContinuousGenerator(target, slots=len(prompts), max_prompt_tokens=max(len(p) for p in prompts),
                              max_new_tokens=max_new_tokens, eos_ids=eos_ids, sync_every=SYNC_EVERY,
                              cuda_graph=cuda_graph)
    done = generate_all(gen, prompts)
    sync_device(device)
    return BatchGeneration(tokens=[f.tokens for f in done], accepted=[[] for _ in prompts],
                           stop=["eos" if f.finished else "length" for f in done], wall_s=time.perf_counter() - t0)


@torch.no_grad()
def speculative_batch(target: TargetBundle, drafter: DFlashDrafter, prompts: list[list[int]], *, block_size: int,
                      max_new_tokens: int, eos_ids: set[int], layer_ids: list[int],
                      zero_features: bool = False, cuda_graph: bool = True) -> BatchGeneration:
    """Greedy DFlash speculative decoding of every prompt (one round per row per iteration;
    spec_rounds.py, a CUDA graph per round on CUDA when `cuda_graph`).

    layer_ids: the drafter's target layers (features). Raises ValueError on a bad block size
    or an empty prompt.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not eos_ids:
        raise ValueError("eos_ids is empty: decoding needs an end-of-sequence token")
    B = drafter.config.inference_block_size(block_size)
    device = target.embed_tokens.weight.device
    sync_device(device)
    t0 = time.perf_counter()
    toks, lengths = _pad(prompts, device)
    R, P = toks.shape
    max_len = P + max_new_tokens + B
    engine = BatchedTarget(target, rows=R, max_len=max_len, layer_ids=layer_ids)
    draft = BatchedDraftSession(drafter, rows=R, max_len=max_len, zero_features=zero_features)
    state = SpeculativeRounds(engine, draft, block_size=B, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                              cuda_graph=cuda_graph)
    state.start(toks, lengths)
    state.run()
    tokens, stop = _rows(state.out, state.count, state.eos_hit)
    accepted = [r[:k] for r, k in zip(state.accepted.tolist(), state.rounds.tolist())]
    sync_device(device)
    return BatchGeneration(tokens=tokens, accepted=accepted, stop=stop, wall_s=time.perf_counter() - t0)
