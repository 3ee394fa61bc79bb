"""The speedup table of `dflash-train eval --batch-sizes 1,4,16,64,256`: for each batch size b,
plain and speculative tokens per second on the same rows, their ratio, τ and the lossless check,
at the full draft length B−1 and at the draft length k chosen for b.

Rows: the first user turn of every prompt (within eval's --max-prompt-tokens), cycled until they fill whole batches of b (max(b, prompts)
rounded up to a multiple of b, recorded as `rows`), so every batch really holds b rows. Each batch
size gets its own engine (decoding/engine.py; caches and, on CUDA, graphs made before timing) and
one warm-up; then each batch is decoded plain, then speculative at k = B−1, and timed as a whole
(prefill included). From that run's conditional acceptance per position and the round costs
t(0 … B−1) measured on the first batch, evaluation/draft_length.py predicts the speedup of every
k and picks the best; that k is then decoded and timed on the same batches (k = B−1 reuses the
full run; k = 0 is plain decoding itself, speedup 1 by definition).
"""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console

from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.decoding.acceptance import (accept_histogram, committed_by_rounds, conditional_acceptance, tau,
                                                 tau_uncapped)
from dflash_trainer.data.render import eos_token_ids
from dflash_trainer.decoding.engine import DecodeEngine, Decoded
from dflash_trainer.evaluation.draft_length import best_draft_length, measure_round_costs, predict_draft_lengths
from dflash_trainer.target_model.load import TargetBundle


def recommend(rec: dict) -> tuple[int, float]:
    """(draft length, measured speedup) to serve at one batch size: the fastest *measured* of plain decoding
    (k = 0, 1.0×), the predicted choice (`chosen_draft_length`, `chosen_speedup`) and all drafts
    (`full_draft_length`, `speedup`); a choice that was not lossless at T = 0 (`chosen_lossless` False, or
    `lossless` False for all drafts) is not recommended; the smaller k on a tie. The prediction picks what
    to measure; the measurement decides."""
    options = {0: 1.0}
    if rec.get("lossless") is not False:
        options[rec["full_draft_length"]] = rec["speedup"]
    if rec.get("chosen_lossless") is not False:
        options[rec["chosen_draft_length"]] = rec["chosen_speedup"]
    k = min(options, key=lambda d: (-options[d], d))
    return k, options[k]


def speed_sentence(speedup: float) -> str:
    """How speculative decoding compares with plain decoding, in words that stay true below 1×."""
    return f"{'faster' if speedup >= 1 else 'slower'}: {speedup:.2f}× the plain speed"


def _speculative(runs: list[Decoded], refs: list[Decoded], temperature: float) -> dict[str, Any]:
    """tokens, tokens_per_s, wall_s, tau, tau_uncapped, lossless (vs the plain runs; None at T > 0)
    and the pooled accepted counts of speculative runs over the same batches as `refs`."""
    tokens, wall = sum(len(t) for r in runs for t in r.tokens), sum(r.wall_s for r in runs)
    accepted = [n for r in runs for a in r.accepted for n in a]
    committed = sum(committed_by_rounds(t) for r in runs for t in r.tokens)
    return {"tokens": tokens, "tokens_per_s": tokens / max(wall, 1e-9), "wall_s": wall,
            "tau": tau(committed, len(accepted)), "tau_uncapped": tau_uncapped(accepted),
            "lossless": all(r.tokens == ref.tokens for r, ref in zip(runs, refs)) if temperature <= 0 else None,
            "accepted": accepted}


def choice_sentence(rec: dict[str, Any]) -> str:
    """The chosen draft length of a table record in words: "draft length 1 of 3 (predicted 1.50×):
    faster: 1.42× the plain speed", or "draft length 0 of 3: plain decoding" when nothing beat it."""
    k, full = rec["chosen_draft_length"], rec["full_draft_length"]
    if k == 0:
        return f"draft length 0 of {full}: plain decoding"
    return (f"draft length {k} of {full} (predicted {rec['chosen_predicted_speedup']:.2f}×): "
            f"{speed_sentence(rec['chosen_speedup'])}")


def speedup_table(target: TargetBundle, drafter: DFlashDrafter, prompts: list[list[int]], batch_sizes: list[int], *,
                  max_new_tokens: int, block_size: int | None = None, temperature: float = 0.0, seed: int = 0,
                  zero_features: bool = False, cuda_graph: bool = True, cost_repeats: int = 5,
                  console: Console | None = None) -> list[dict[str, Any]]:
    """One record per batch size (module docstring). At the full draft length B−1: batch_size, rows,
    tokens (speculative), plain_tokens_per_s, speculative_tokens_per_s, speedup, tau (committed
    per round) and tau_uncapped (decoding/acceptance.py), lossless (null at T > 0), plain_wall_s,
    speculative_wall_s, cuda_graphs (the modes replayed from CUDA graphs: ["plain",
    "speculative"] on CUDA, [] when eager), full_draft_length (B−1), conditional_accept_per_position.
    The choice: round_s (t(k) for k = 0 … B−1, seconds, median of `cost_repeats` steps), predicted
    (per k: draft_length, round_s, tokens_per_round, tokens_per_s, speedup;
    evaluation/draft_length.py), chosen_draft_length, chosen_predicted_speedup, and measured at it:
    chosen_tokens_per_s, chosen_speedup, chosen_tau, chosen_lossless. Raises ValueError for no
    prompts or a batch size < 1."""
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
        batches = [rows[c0:c0 + b] for c0 in range(0, total, b)]
        engine = DecodeEngine(target, drafter, rows=b, max_prompt_tokens=max(map(len, rows)),
                              max_new_tokens=max_new_tokens, eos_ids=eos, block_size=block_size,
                              temperature=temperature, generator=gen, zero_features=zero_features,
                              cuda_graph=cuda_graph)
        engine.warm_up(rows[0])
        runs = [(engine.decode(x, speculative=False), engine.decode(x, speculative=True)) for x in batches]
        replayed = sorted(engine.graphs)
        refs = [plain for plain, _ in runs]
        plain_tokens, plain_wall = sum(len(t) for r in refs for t in r.tokens), sum(r.wall_s for r in refs)
        plain_tps = plain_tokens / max(plain_wall, 1e-9)
        full = _speculative([spec for _, spec in runs], refs, temperature)
        B = engine.B
        cond = conditional_acceptance(accept_histogram(full["accepted"], B))
        costs = measure_round_costs(engine, batches[0], repeats=cost_repeats)
        predicted = predict_draft_lengths(cond, costs, b)
        k = best_draft_length(predicted)
        if k == B - 1:
            chosen = full
        elif k == 0:  # plain decoding itself
            chosen = {"tokens_per_s": plain_tps, "tau": None, "lossless": True if temperature <= 0 else None}
        else:
            engine.set_draft_length(k)
            engine.warm_up(rows[0])
            chosen = _speculative([engine.decode(x, speculative=True) for x in batches], refs, temperature)
        del engine  # its caches go before the next batch size's are made
        rec = {"batch_size": b, "rows": total, "tokens": full["tokens"], "plain_tokens_per_s": plain_tps,
               "speculative_tokens_per_s": full["tokens_per_s"], "speedup": full["tokens_per_s"] / max(plain_tps, 1e-9),
               "tau": full["tau"], "tau_uncapped": full["tau_uncapped"], "lossless": full["lossless"],
               "plain_wall_s": plain_wall, "speculative_wall_s": full["wall_s"], "cuda_graphs": replayed,
               "full_draft_length": B - 1, "conditional_accept_per_position": cond, "round_s": costs,
               "predicted": predicted, "chosen_draft_length": k,
               "chosen_predicted_speedup": predicted[k]["speedup"], "chosen_tokens_per_s": chosen["tokens_per_s"],
               "chosen_speedup": chosen["tokens_per_s"] / max(plain_tps, 1e-9), "chosen_tau": chosen["tau"],
               "chosen_lossless": chosen["lossless"]}
        rec["recommended_draft_length"], rec["recommended_speedup"] = recommend(rec)
        table.append(rec)
        console.print(f"  batch {b}: plain {plain_tps:,.1f} tok/s, speculative {full['tokens_per_s']:,.1f} tok/s, "
                      f"{speed_sentence(rec['speedup'])}, τ {rec['tau'] or 0:.2f} ({total} rows); chosen "
                      f"{choice_sentence(rec)}", highlight=False)
    return table
