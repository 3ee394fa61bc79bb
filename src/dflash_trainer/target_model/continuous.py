"""Continuous batching: the target generates for many prompts at once, refilling rows as they finish.

Shapes: R = rows (`slots`), S = cache slots per row (`max_len` = longest prompt + new tokens),
N = max_new_tokens, V = vocabulary.

Every row of a `BatchedTarget` holds one sequence. A prompt waits in a queue until a row is free;
free rows are filled by one batched prefill (prompts sorted by length, grouped under a token
budget), then every row advances one token per forward. Decoding state (last token, position,
count, done flag, output tokens) stays on the device; the host looks every `sync_every` steps,
hands out the finished sequences and refills their rows. Rows that finished between two looks
keep stepping on frozen positions and are ignored, so at most `sync_every` wasted steps per
sequence.

Greedy at temperature 0 (each sequence's output equals one-sequence greedy decoding, checked in
tests/unit/test_continuous.py); sampling at T > 0 draws from softmax(logits / T) with the given
generator (no top-k / top-p). A sequence ends at its first end-of-sequence token (kept in the
output, `finished` True) or after N tokens (`finished` False); rows hold max_prompt_tokens + N
slots, so a row never fills up first.

CUDA graph (cuda_graph=True, on CUDA, greedy): one decode step is L layers × a few dozen small
kernels, so for a small target eager PyTorch is bound by kernel launches, not by the GPU (H200,
SmolLM2-shaped, 512 rows: 83 ms eager, 20.5 ms replayed). The whole device part of a
step (the forward, argmax, and the updates of tok / pos / count / out / eos_hit / done) is then
captured once into a `torch.cuda.CUDAGraph` and replayed, one launch per step. A graph needs
static shapes, so the step attends over a fixed span of S cache slots instead of the host-side
bound of the eager path; slots past a row's position are masked, so the tokens are the same
(up to rounding, where a kernel sums in another order over the longer span). The price is
attention over all S slots every step, which grows with max_len. Every state update is in place on the
persistent tensors, so the addresses baked into the graph stay valid; prefill (`_refill`) writes
into the same tensors eagerly between replays. Capture happens in the constructor, while every
row is done and free: live is all False, so the warm-up runs and the capture change no state,
only the cache slot at each row's position (0), which prefill overwrites and which no sequence
sees before it is rewritten. Greedy only (sampling at T > 0 stays eager), and not for RoPE types
that rebuild their tables after a host-side look at the positions ("dynamic").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from dflash_trainer.target_model.batched import BatchedTarget, right_padded
from dflash_trainer.target_model.load import TargetBundle


def rope_is_static(base: Any) -> bool:
    """False for HF RoPE types that rebuild their tables from a host-side read of the positions
    ("dynamic": a data-dependent branch, which a CUDA graph cannot hold)."""
    return "dynamic" not in str(getattr(base.rotary_emb, "rope_type", "default"))


def is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """bool, tokens' shape: which tokens (any long tensor) are one of `eos` [E]. Compared with == rather
    than torch.isin, which sorts (and syncs the host) for larger sets: safe inside a CUDA graph."""
    return (tokens[..., None] == eos).any(-1)


@dataclass
class Finished:
    """One generated continuation: the caller's key, new tokens (eos kept when hit), whether it
    ended with an end-of-sequence token, and an error reason ("prompt_too_long", "empty_prompt")
    or None."""

    key: Any
    tokens: list[int]
    finished: bool
    error: str | None = None


class ContinuousGenerator:
    """Generate for a stream of prompts with `slots` rows (see the module docstring).

    `submit(key, prompt)` queues a prompt; `poll()` runs until some sequences finish and returns
    them; `busy` says whether anything is queued or running. prefill_tokens bounds rows × prompt
    length of one prefill forward. cuda_graph: replay the decode step from a CUDA graph when the
    target is on CUDA and temperature ≤ 0 (module docstring); the eager step otherwise. Raises
    ValueError for bad sizes or an empty eos set.
    """

    def __init__(self, target: TargetBundle, *, slots: int, max_prompt_tokens: int, max_new_tokens: int,
                 eos_ids: set[int], temperature: float = 0.0, generator: torch.Generator | None = None,
                 sync_every: int = 16, prefill_tokens: int = 32768, cuda_graph: bool = True):
        if slots < 1 or max_new_tokens < 1 or max_prompt_tokens < 1:
            raise ValueError(f"slots={slots}, max_new_tokens={max_new_tokens}, max_prompt_tokens={max_prompt_tokens}: "
                             "each must be >= 1")
        if not eos_ids:
            raise ValueError("eos_ids is empty: generation needs an end-of-sequence token")
        self.target = target
        self.max_new, self.max_prompt = max_new_tokens, max_prompt_tokens
        self.max_len = max_prompt_tokens + max_new_tokens
        self.engine = BatchedTarget(target, rows=slots, max_len=self.max_len)
        self.device = self.engine.device
        self.temperature, self.generator = temperature, generator
        self.sync_every, self.prefill_tokens = sync_every, prefill_tokens
        self.eos = torch.tensor(sorted(eos_ids), device=self.device, dtype=torch.long)
        R = slots
        self.tok = torch.zeros(R, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(R, dtype=torch.long, device=self.device)  # position of `tok` = cached length
        self.count = torch.zeros(R, dtype=torch.long, device=self.device)
        self.done = torch.ones(R, dtype=torch.bool, device=self.device)
        self.eos_hit = torch.zeros(R, dtype=torch.bool, device=self.device)
        self.out = torch.zeros(R, max_new_tokens, dtype=torch.long, device=self.device)
        self.keys: list[Any] = [None] * R  # host: the key a row serves, None = free
        self.bound = [0] * R  # host: upper bound of each row's position (the eager step's span)
        self.queue: deque[tuple[Any, list[int]]] = deque()
        self.rejected: list[Finished] = []
        self.steps = 0  # decode forwards run (telemetry)
        self.graph: torch.cuda.CUDAGraph | None = None
        if cuda_graph and self.device.type == "cuda" and temperature <= 0 and rope_is_static(self.engine.base):
            self.graph = self._capture()

    @property
    def busy(self) -> bool:
        """Anything queued, running, or finished and not yet handed back."""
        return bool(self.queue) or any(k is not None for k in self.keys) or bool(self.rejected)

    def submit(self, key: Any, prompt: list[int]) -> None:
        """Queue one prompt (token ids). A prompt longer than max_prompt_tokens comes back from
        `poll` as Finished(error="prompt_too_long") without running."""
        if not prompt or len(prompt) > self.max_prompt:
            self.rejected.append(Finished(key, [], False, "prompt_too_long" if prompt else "empty_prompt"))
        else:
            self.queue.append((key, list(prompt)))

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]

    def _refill(self) -> None:
        free = [r for r, k in enumerate(self.keys) if k is None]
        jobs = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        jobs.sort(key=lambda j: len(j[1]))
        i = 0
        while i < len(jobs):
            j = i + 1  # grow the group while rows × longest prompt stays within the budget
            while j < len(jobs) and (j + 1 - i) * len(jobs[j][1]) <= self.prefill_tokens:
                j += 1
            group, rows = jobs[i:j], free[i:j]
            toks, lengths = right_padded([p for _, p in group], self.device)
            rows_t = torch.tensor(rows).to(self.device)
            logits, _ = self.engine.prefill(rows_t, toks, lengths)
            first = self._pick(logits)
            self.tok[rows_t] = first
            self.pos[rows_t] = lengths
            self.count[rows_t] = 1
            self.out[rows_t, 0] = first
            self.eos_hit[rows_t] = is_eos(first, self.eos)
            self.done[rows_t] = self.eos_hit[rows_t] | (self.max_new <= 1)
            for (key, p), r in zip(group, rows):
                self.keys[r], self.bound[r] = key, len(p)
            i = j

    def _advance(self, span: int) -> None:
        """The device part of one decode step: forward over `span` slots, pick, update the state.

        Every update is in place (no attribute is rebound) and nothing syncs the host, so this is
        what the CUDA graph captures. Rows that are done keep their state (frozen position).
        """
        logits, _ = self.engine.step(self.tok[:, None], self.pos, span, all_logits=False)
        live = ~self.done
        # rows that are done or free may attend to nothing valid (a frozen position past a sliding
        # window): their logits are zeroed so sampling never sees NaN; their picks are discarded
        new = self._pick(torch.where(live[:, None], logits, 0.0))
        idx = self.count.clamp(max=self.max_new - 1)[:, None]
        self.out.scatter_(1, idx, torch.where(live, new, self.out.gather(1, idx)[:, 0])[:, None])
        self.count += live.long()
        self.pos += live.long()
        hit = live & is_eos(new, self.eos)
        self.eos_hit |= hit
        self.done |= hit | (self.count >= self.max_new) | (self.pos >= self.max_len - 1)
        self.tok.copy_(torch.where(live, new, self.tok))

    @torch.no_grad()
    def _capture(self) -> torch.cuda.CUDAGraph:
        """Capture `_advance(max_len)` into a CUDA graph (called while every row is done and free).

        Warm-up runs on a side stream first (lazy initialisation, cuBLAS workspaces, allocator
        state stay out of the graph), then the capture on that stream; the graph's memory comes
        from its own private pool.
        """
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    self._advance(self.max_len)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                self._advance(self.max_len)
            torch.cuda.current_stream().wait_stream(stream)
        return graph

    def _step(self) -> None:
        if self.graph is not None:
            self.graph.replay()  # fixed span: the host-side bound is not needed
        else:
            span = min(max(b for b, k in zip(self.bound, self.keys) if k is not None) + 1, self.max_len)
            self._advance(span)
            self.bound = [min(b + 1, self.max_len - 1) if k is not None else b for b, k in zip(self.bound, self.keys)]
        self.steps += 1

    @torch.no_grad()
    def poll(self) -> list[Finished]:
        """Refill free rows, decode up to `sync_every` steps, return the sequences that finished
        (possibly none while others run; [] when nothing is left)."""
        results, self.rejected = self.rejected, []
        self._refill()
        if all(k is None for k in self.keys):
            return results
        for _ in range(self.sync_every):
            self._step()
        occupied = [r for r, k in enumerate(self.keys) if k is not None]
        done, count, hit = (t.tolist() for t in (self.done, self.count, self.eos_hit))  # host sync, every few steps
        ended = [r for r in occupied if done[r]]
        if ended:
            rows = self.out[torch.tensor(ended, device=self.device)].tolist()
            for r, toks in zip(ended, rows):
                results.append(Finished(self.keys[r], toks[:count[r]], bool(hit[r])))
                self.keys[r] = None
        return results


def generate_all(gen: Any, prompts: list[list[int]]) -> list[Finished]:
    """Submit every prompt to `gen` (ContinuousGenerator or HFGenerator), poll until it is idle;
    the Finished results in prompt order."""
    for i, p in enumerate(prompts):
        gen.submit(i, p)
    done: dict[int, Finished] = {}
    while gen.busy:
        done.update((f.key, f) for f in gen.poll())
    return [done[i] for i in range(len(prompts))]

