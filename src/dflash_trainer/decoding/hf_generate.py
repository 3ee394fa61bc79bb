"""HF `generate` behind the continuous generator's interface: waves of up to `slots` prompts.

The fallback for targets the batched static-cache path does not implement
(`batched.unsupported_reason`), and the baseline of `bench regenerate`. Each `poll` answers the
next wave: prompts left-padded to one width, `model.generate` (dynamic cache), every row cut at its
first end-of-sequence token (kept). Greedy at temperature 0, else sampling at that temperature
(top-k off, top-p as given) seeded by `seed`. Slower than continuous batching: a wave runs
until its longest row ends.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from dflash_trainer.decoding.continuous import Finished
from dflash_trainer.target_model.load import TargetBundle


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [R,P] long, every prompt ending at the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, mask


class HFGenerator:
    """`submit(key, prompt)` / `poll() -> list[Finished]` / `busy`, like ContinuousGenerator, over
    HF `generate` in waves of `slots` prompts. A prompt longer than max_prompt_tokens comes back as
    Finished(error="prompt_too_long")."""

    def __init__(self, target: TargetBundle, *, slots: int, max_prompt_tokens: int, max_new_tokens: int,
                 eos_ids: set[int], temperature: float = 0.0, seed: int = 0, top_p: float = 1.0):
        if not eos_ids:
            raise ValueError("eos_ids is empty: generation needs an end-of-sequence token")
        self.target, self.slots = target, slots
        self.max_prompt, self.max_new = max_prompt_tokens, max_new_tokens
        self.eos, self.temperature, self.seed, self.top_p = set(eos_ids), temperature, seed, top_p
        tok = target.tokenizer
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        self.pad = pad if pad is not None else min(self.eos)
        self.queue: deque[tuple[Any, list[int]]] = deque()
        self.rejected: list[Finished] = []
        self.waves = 0

    @property
    def busy(self) -> bool:
        """Anything queued or not yet handed back."""
        return bool(self.queue) or bool(self.rejected)

    def submit(self, key: Any, prompt: list[int]) -> None:
        """Queue one prompt (token ids)."""
        if not prompt or len(prompt) > self.max_prompt:
            self.rejected.append(Finished(key, [], False, "prompt_too_long" if prompt else "empty_prompt"))
        else:
            self.queue.append((key, list(prompt)))

    @torch.no_grad()
    def poll(self) -> list[Finished]:
        """Generate the next wave; returns its sequences (and any rejected prompts)."""
        results, self.rejected = self.rejected, []
        wave = [self.queue.popleft() for _ in range(min(self.slots, len(self.queue)))]
        if not wave:
            return results
        device = self.target.embed_tokens.weight.device
        ids, mask = left_padded([p for _, p in wave], self.pad)
        sample = self.temperature > 0
        knobs = dict(temperature=self.temperature, top_k=0, top_p=self.top_p) if sample else {}
        torch.manual_seed(self.seed * 1_000_003 + self.waves)
        self.waves += 1
        out = self.target.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                         max_new_tokens=self.max_new, do_sample=sample, repetition_penalty=1.0,
                                         eos_token_id=sorted(self.eos), pad_token_id=self.pad, **knobs)
        for (key, _), row in zip(wave, out[:, ids.shape[1]:].tolist()):  # host sync: tokens decoded on the host
            end = next((i for i, t in enumerate(row) if t in self.eos), None)
            results.append(Finished(key, row if end is None else row[:end + 1], end is not None))
        return results
