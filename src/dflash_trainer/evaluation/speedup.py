"""The speedup table of `dflash-train eval --batch-sizes 1,4,16,64,256`: for each batch size b,
plain and speculative tokens per second on the same rows, their ratio, τ and the lossless check.

Rows: the first user turn of every prompt, cycled until they fill whole batches of b (max(b, prompts)
rounded up to a multiple of b, recorded as `rows`), so every batch really holds b rows. Each batch
size gets its own engine (decoding/engine.py; caches and, on CUDA, graphs made before timing) and
one warm-up; then each batch is decoded plain, then speculative, and timed as a whole (prefill included).
"""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console

from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.decoding.acceptance import committed_by_rounds, tau, tau_uncapped
from dflash_trainer.data.render import eos_token_ids
from dflash_trainer.decoding.engine import DecodeEngine
from dflash_trainer.target_model.load import TargetBundle


def speed_sentence(speedup: float) -> str:
    """How speculative decoding compares with plain decoding, in words that stay true below 1×."""
    return f"{'faster' if speedup >= 1 else 'slower'}: {speedup:.2f}× the plain speed"


def speedup_table(target: TargetBundle, drafter: DFlashDrafter, prompts: list[list[int]], batch_sizes: list[int], *,
                  max_new_tokens: int, block_size: int | None = None, temperature: float = 0.0, seed: int = 0,
                  zero_features: bool = False, cuda_graph: bool = True,
                  console: Console | None = None) -> list[dict[str, Any]]:
    """One record per batch size (module docstring): batch_size, rows, tokens (speculative),
    plain_tokens_per_s, speculative_tokens_per_s, speedup, tau (committed per round) and tau_uncapped
    (decoding/acceptance.py), lossless (null at T > 0),
    plain_wall_s, speculative_wall_s, cuda_graphs (the modes replayed from CUDA graphs: ["plain",
    "speculative"] on CUDA, [] when eager). Raises ValueError for no prompts or a batch size < 1."""
    console = console or Console(quiet=True)
    if not prompts:
        raise ValueError("no prompts for the speedup table")
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"--batch-sizes {batch_sizes}: every batch size must be >= 1")
    eos = eos_token_ids(target)
    gen = torch.Generator(device=target.embed_tokens.weight.device).manual_seed(seed)
    table = []
    for b in batch_sizes:
        total = -(-max(b, len(prompts)) // b) * b
        rows = [prompts[i % len(prompts)] for i in range(total)]
        engine = DecodeEngine(target, drafter, rows=b, max_prompt_tokens=max(map(len, rows)),
                              max_new_tokens=max_new_tokens, eos_ids=eos, block_size=block_size,
                              temperature=temperature, generator=gen, zero_features=zero_features,
                              cuda_graph=cuda_graph)
        engine.warm_up(rows[0])
        runs = [(engine.decode(rows[c0:c0 + b], speculative=False), engine.decode(rows[c0:c0 + b], speculative=True))
                for c0 in range(0, total, b)]  # (plain, speculative) per batch
        replayed = sorted(engine.graphs)
        del engine  # its caches go before the next batch size's are made
        plain_tokens, spec_tokens = (sum(len(t) for run in runs for t in run[i].tokens) for i in (0, 1))
        plain_wall, spec_wall = (sum(run[i].wall_s for run in runs) for i in (0, 1))
        accepted = [n for _, spec in runs for a in spec.accepted for n in a]
        committed = sum(committed_by_rounds(t) for _, spec in runs for t in spec.tokens)
        same = all(spec.tokens == ref.tokens for ref, spec in runs)
        plain_tps, spec_tps = plain_tokens / max(plain_wall, 1e-9), spec_tokens / max(spec_wall, 1e-9)
        rec = {"batch_size": b, "rows": total, "tokens": spec_tokens, "plain_tokens_per_s": plain_tps,
               "speculative_tokens_per_s": spec_tps, "speedup": spec_tps / max(plain_tps, 1e-9), "tau": tau(committed, len(accepted)),
               "tau_uncapped": tau_uncapped(accepted),
               "lossless": same if temperature <= 0 else None, "plain_wall_s": plain_wall,
               "speculative_wall_s": spec_wall, "cuda_graphs": replayed}
        table.append(rec)
        console.print(f"  batch {b}: plain {plain_tps:,.1f} tok/s, speculative {spec_tps:,.1f} tok/s, "
                      f"{speed_sentence(rec['speedup'])}, τ {rec['tau'] or 0:.2f} ({total} rows)", highlight=False)
    return table
