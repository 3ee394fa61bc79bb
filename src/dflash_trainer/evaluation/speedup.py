"""The speedup table of `dflash-train eval --batch-sizes 1,4,16,64,256`: for each batch size b,
plain and speculative tokens per second on the same rows, their ratio, τ and the lossless check,
at the full draft length B−1 and at the draft length k chosen for b.

Rows: the first user turn of every prompt (within eval's --max-prompt-tokens), cycled in whole
cycles to at least STREAM_ROWS_PER_BATCH · b (recorded as `rows`). Each batch size gets its own
engine of b rows (decoding/engine.py; caches and, on CUDA, graphs made before timing) and one
warm-up; the rows go through it as a server's continuous batch (decoding/stream.py: a finished row
takes the next prompt), plain, then speculative at k = B−1. Speeds are steady ones: tokens committed
from when the (2b)-th row is handed out to when the last one is, over that time (prefills included),
while all b rows are busy with a mix of prompts (decoding/stream.py); a
batch run to its slowest row instead would charge speculative decoding for the rows that wait (its
rows end at rounds ≈ tokens / τ, which vary more than the tokens). From the full run's conditional
acceptance per position and the round costs t(0 … B−1) measured on the first b rows,
evaluation/draft_length.py predicts the speedup of every k and picks the best; that k is then
decoded and timed on the same rows (k = B−1 reuses the full run; k = 0 is plain decoding itself,
speedup 1 by definition).
"""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console

from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.decoding.acceptance import (accept_histogram, committed_by_rounds, conditional_acceptance, tau,
                                                 tau_uncapped)
from dflash_trainer.data.render import eos_token_ids
from dflash_trainer.decoding.engine import DecodeEngine
from dflash_trainer.decoding.stream import Streamed, decode_stream
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


STREAM_ROWS_PER_BATCH = 4  # rows decoded at batch size b: at least 4 · b (whole cycles of the prompts)


def table_rows(prompts: list[list[int]], b: int) -> list[list[int]]:
    """The rows of batch size b: the prompts cycled whole until they are at least STREAM_ROWS_PER_BATCH · b
    (each prompt equally often, so τ and tokens are comparable across batch sizes). E.g. 3 prompts, b = 2
    → 9 rows."""
    cycles = -(-max(STREAM_ROWS_PER_BATCH * b, len(prompts)) // len(prompts))
    return prompts * cycles


def stream_record(run: Streamed, ref: Streamed, temperature: float) -> dict[str, Any]:
    """A speculative stream's numbers: tokens, tokens_per_s (steady), wall_s (whole stream), steady_tokens /
    steady_s, tau, tau_uncapped, lossless (against the plain run `ref` of the same rows; None at T > 0) and the
    pooled accepted counts."""
    accepted = [n for a in run.accepted for n in a]
    committed = sum(committed_by_rounds(t) for t in run.tokens)
    return {"tokens": sum(map(len, run.tokens)), "tokens_per_s": run.tokens_per_s(), "wall_s": run.wall_s,
            "steady_tokens": run.steady_tokens, "steady_s": run.steady_s,
            "tau": tau(committed, len(accepted)), "tau_uncapped": tau_uncapped(accepted),
            "lossless": run.tokens == ref.tokens if temperature <= 0 else None, "accepted": accepted}


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
    tokens (speculative), plain_tokens_per_s, speculative_tokens_per_s (steady, module docstring),
    speedup, tau (committed per round) and tau_uncapped (decoding/acceptance.py), lossless (null at
    T > 0), plain_wall_s, speculative_wall_s (whole streams), plain_steady_tokens / plain_steady_s and
    speculative_steady_tokens / speculative_steady_s (the steady windows, decoding/stream.py), cuda_graphs
    (the modes replayed from CUDA graphs: ["plain", "speculative"] on CUDA, [] when eager), step_attention
    (decoding/batched.py default_step_attention: "sdpa" | "cache" | "row", None on the HF-cache path),
    full_draft_length (B−1), conditional_accept_per_position.
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
        rows = table_rows(prompts, b)
        total = len(rows)
        engine = DecodeEngine(target, drafter, rows=b, max_prompt_tokens=max(map(len, rows)),
                              max_new_tokens=max_new_tokens, eos_ids=eos, block_size=block_size,
                              temperature=temperature, generator=gen, zero_features=zero_features,
                              cuda_graph=cuda_graph)
        engine.warm_up(rows[0])
        ref = decode_stream(engine, rows, speculative=False)
        replayed, step_attention = sorted(engine.graphs), engine.step_attention
        plain_tps = ref.tokens_per_s()
        full = stream_record(decode_stream(engine, rows, speculative=True), ref, temperature)
        B = engine.B
        cond = conditional_acceptance(accept_histogram(full["accepted"], B))
        costs = measure_round_costs(engine, rows[:b], repeats=cost_repeats)
        predicted = predict_draft_lengths(cond, costs, b)
        k = best_draft_length(predicted)
        if k == B - 1:
            chosen = full
        elif k == 0:  # plain decoding itself
            chosen = {"tokens_per_s": plain_tps, "tau": None, "lossless": True if temperature <= 0 else None}
        else:
            engine.set_draft_length(k)
            engine.warm_up(rows[0])
            chosen = stream_record(decode_stream(engine, rows, speculative=True), ref, temperature)
        del engine  # its caches go before the next batch size's are made
        rec = {"batch_size": b, "rows": total, "tokens": full["tokens"], "plain_tokens_per_s": plain_tps,
               "speculative_tokens_per_s": full["tokens_per_s"], "speedup": full["tokens_per_s"] / max(plain_tps, 1e-9),
               "tau": full["tau"], "tau_uncapped": full["tau_uncapped"], "lossless": full["lossless"],
               "plain_wall_s": ref.wall_s, "speculative_wall_s": full["wall_s"],
               "plain_steady_tokens": ref.steady_tokens, "plain_steady_s": ref.steady_s,
               "speculative_steady_tokens": full["steady_tokens"], "speculative_steady_s": full["steady_s"],
               "cuda_graphs": replayed, "step_attention": step_attention,
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
