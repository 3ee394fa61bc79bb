"""Continuous batching over the decoding engine: any number of prompts through its R rows, a finished
row taking the next prompt at the next host look, as a server keeps its batch full.

Why: decoding prompts in whole batches (`DecodeEngine.decode`) runs each batch until its slowest row
ends. A speculative row ends after rounds ≈ its tokens / its τ, which varies row to row far more than
the tokens do, so at large batches most rows wait for a few slow ones and speculative decoding looks
slower than a server would find it (one that refills rows as they finish: vLLM, SGLang). Here the rows
are refilled (`DecodeEngine.refill`: prefill into those rows, their state reset; the other rows decode
on untouched, in the same CUDA graph replays), and the speed that counts is the steady one: tokens
committed until the last prompt gets a row, over that time (prefills included), while every row is busy.

Host looks are `decode`'s: every `sync_every` replays (one round or step a look when eager); a row that
finishes waits at most that long for its next prompt. Outputs are per prompt, in the given order, and
equal `decode`'s token for token at T = 0 (a row decodes as it would alone, tests/unit/test_stream.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from dflash_trainer.decoding.engine import PLAIN, SPECULATIVE, Decoded, DecodeEngine, sync_device


@dataclass
class Streamed(Decoded):
    """`Decoded` of a continuous batch (per prompt, in order; wall_s: the whole stream), and the steady
    state: steady_tokens committed in the first steady_s seconds, until the last prompt got a row (None
    when every prompt had a row from the start: no steady state apart from the whole run)."""

    steady_tokens: int | None = None
    steady_s: float | None = None

    def tokens_per_s(self) -> float:
        """Steady tokens a second, or over the whole stream when there was no steady state."""
        if self.steady_s:
            return self.steady_tokens / self.steady_s
        return sum(map(len, self.tokens)) / max(self.wall_s, 1e-9)


@torch.no_grad()
def decode_stream(engine: DecodeEngine, prompts: list[list[int]], *, speculative: bool,
                  max_new_tokens: int | None = None, on_round: Callable[[int], None] | None = None) -> Streamed:
    """Decode every prompt (≥ 1, each 1 … the engine's max_prompt_tokens) through the engine's rows with
    continuous refill (module docstring); plain or speculative, at the engine's draft length.
    on_round(tokens): the tokens committed so far at every host look. Raises ValueError as
    `DecodeEngine.start` does (no prompts, a bad length, no drafter, a bad cap)."""
    if not prompts:
        raise ValueError("no prompts to decode")
    engine.check_prompts(prompts, speculative=speculative)
    n, R = len(prompts), engine.rows
    sync_device(engine.device)
    t0 = time.perf_counter()
    first = min(R, n)
    engine.start(prompts[:first], speculative=speculative, max_new_tokens=max_new_tokens)
    spec = engine.speculating(speculative)
    graph = engine.graphs.get(SPECULATIVE if spec else PLAIN)
    owner: list[int | None] = list(range(first)) + [None] * (R - first)  # the prompt each row decodes
    done_out: dict[int, tuple[list[int], list[int], str]] = {}
    nxt, refilled_tokens, since = first, 0, engine.sync_every
    steady: tuple[int, float] | None = None
    while True:
        left = (engine.limit - engine.count).masked_fill(engine.done, 0).max()  # steps that surely end every row
        look = torch.cat([torch.stack([engine.a.max(), engine.count.sum(), left]), engine.done.long()]).tolist()
        longest, counted, bound, done = look[0], look[1], look[2], look[3:]  # host sync, once per look
        total = refilled_tokens + counted  # tokens committed so far (a refilled row's count restarts)
        finished = [r for r in range(R) if done[r] and owner[r] is not None]
        take: list[int] = []
        if finished:
            idx = torch.tensor(finished, device=engine.device)
            counts, hits, outs = engine.count[idx].tolist(), engine.eos_hit[idx].tolist(), engine.out[idx].tolist()
            accs, rounds = (engine.accepted[idx].tolist(), engine.rounds[idx].tolist()) if spec else (None, None)
            for i, r in enumerate(finished):
                done_out[owner[r]] = (outs[i][:counts[i]], accs[i][:rounds[i]] if spec else [],
                                      "eos" if hits[i] else "length")
                owner[r] = None
            take = finished[:n - nxt]
            if take:
                refilled_tokens += sum(counts[:len(take)])
                engine.refill(take, prompts[nxt:nxt + len(take)], speculative=speculative)
                longest = max(longest, *(len(p) for p in prompts[nxt:nxt + len(take)]))
                for i, r in enumerate(take):
                    owner[r] = nxt + i
                nxt += len(take)
                if nxt == n:  # the last prompt has a row: the steady state ends here
                    steady = (total, time.perf_counter() - t0)
        if on_round is not None:
            on_round(total)
        if all(o is None for o in owner):
            break
        # while prompts wait, a look every sync_every replays; after the last refill, no more replays than the
        # live rows can use (`bound`, read before this look's refill, holds when there was none)
        stretch = engine.sync_every if (nxt < n or take) else max(1, min(engine.sync_every, bound))
        if graph is not None:
            engine.draw_uniforms(spec)
            for _ in range(stretch):
                graph.replay()
            continue
        if since == engine.sync_every:
            engine.draw_uniforms(spec)
            since = 0
        engine.round(longest) if spec else engine.plain_step(longest + 1)
        since += 1
    sync_device(engine.device)
    wall = time.perf_counter() - t0
    tokens, accepted, stop = (list(x) for x in zip(*(done_out[i] for i in range(n))))
    return Streamed(tokens=tokens, accepted=accepted, stop=stop, wall_s=wall,
                    steady_tokens=steady[0] if steady else None, steady_s=steady[1] if steady else None)
