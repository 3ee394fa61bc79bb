"""Continuous batching over the decoding engine: any number of prompts through its R rows, a finished
row taking the next prompt at the next host look, as a server keeps its batch full.

Why: decoding prompts in whole batches (`DecodeEngine.decode`) runs each batch until its slowest row
ends. A speculative row ends after rounds ≈ its tokens / its τ, which varies row to row far more than
the tokens do, so at large batches most rows wait for a few slow ones and speculative decoding looks
slower than a server would find it (one that refills rows as they finish: vLLM, SGLang). Here the rows
are refilled (`DecodeEngine.refill`: prefill into those rows, their state reset; the other rows decode
on untouched, in the same CUDA graph replays), and the speed that counts is the steady one, while every
row is busy with a mix of prompts: tokens committed from the look at which the (2R)-th prompt got a row
to the look at which the last one did, over that time (prefills included). The first R prompts start
together and are left out: a fresh batch holds each prompt once, a running one holds more of the prompts
that keep their rows longest (for speculative decoding, the low-τ ones), so the start runs faster than
what follows. With at most 2R prompts the window starts at the stream's start.

Host looks are `decode`'s: every `sync_every` replays (one round or step a look when eager); a row that
finishes waits at most that long for its next prompt. Outputs are per prompt, in the given order, and
equal `decode`'s token for token at T = 0 (a row decodes as it would alone, tests/unit/test_stream.py).
At T > 0 they depend on when refills land, so replayed and eager streams differ (both sample the
target's distribution).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from dflash_trainer.decoding.engine import Decoded, DecodeEngine, sync_device


@dataclass
class Streamed(Decoded):
    """`Decoded` of a continuous batch (per prompt, in order; wall_s: the whole stream), and the steady
    state (module docstring): steady_tokens committed in steady_s seconds, from the look at which
    steady_from_tokens had been committed (all None when every prompt had a row from the start: no steady
    state apart from the whole run)."""

    steady_tokens: int | None = None
    steady_s: float | None = None
    steady_from_tokens: int | None = None

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
    owner: list[int | None] = list(range(first)) + [None] * (R - first)  # the prompt each row decodes
    done_out: dict[int, tuple[list[int], list[int], str]] = {}
    nxt, refilled_tokens, since = first, 0, engine.sync_every
    window_from = (0, 0.0) if n <= 2 * R else None  # (tokens, seconds) where the steady window starts
    steady: tuple[int, float, int] | None = None
    while True:
        look = torch.cat([torch.stack([engine.a.max(), engine.count.sum(), engine.steps_to_end()]),
                          engine.done.long()]).tolist()
        at = time.perf_counter() - t0  # the device is idle here: the look above waited for it
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
                if window_from is None and nxt + len(take) >= 2 * R:  # the (2R)-th prompt gets a row
                    window_from = (total, at)
                nxt += len(take)
                if nxt == n:  # the last prompt has a row: the steady state ends here
                    if at <= window_from[1]:  # the (2R)-th and the last prompt got rows at one look
                        window_from = (0, 0.0)
                    steady = (total - window_from[0], at - window_from[1], window_from[0])
        if on_round is not None:
            on_round(total)
        if all(o is None for o in owner):
            break
        # while prompts wait, a look every sync_every replays; after the last refill, no more replays than the
        # live rows can use (`bound`, read before this look's refill, holds when there was none)
        stretch = engine.sync_every if (nxt < n or take) else max(1, min(engine.sync_every, bound))
        since = engine.advance(spec, stretch, longest, since)
    sync_device(engine.device)
    wall = time.perf_counter() - t0
    tokens, accepted, stop = (list(x) for x in zip(*(done_out[i] for i in range(n))))
    return Streamed(tokens=tokens, accepted=accepted, stop=stop, wall_s=wall,
                    **dict(zip(("steady_tokens", "steady_s", "steady_from_tokens"), steady or (None, None, None))))
