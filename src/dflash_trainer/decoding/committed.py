"""Committed τ, torch-free (decoding/acceptance.py's module docstring defines it): the tokens a
turn's verify rounds committed are its new tokens less the first, which the prefill committed; τ is
their sum over the rounds' count, pooled over turns. Shared by the eval, the speed benchmark and
the scripts that summarize eval JSON (benchmarks/recipe_report.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def committed_of_turn(new_tokens: int) -> int:
    """Tokens the verify rounds of one turn committed, given its count of new tokens: one less (the
    prefill's), 0 for a turn that produced nothing."""
    return max(new_tokens - 1, 0)


def committed_by_rounds(tokens: Sequence[int]) -> int:
    """Tokens the verify rounds of one speculative decode committed: its new tokens less the first,
    which the prefill committed (0 for a decode that produced nothing)."""
    return committed_of_turn(len(tokens))


def tau(committed: int, rounds: int) -> float | None:
    """Committed τ (module docstring): tokens committed by the rounds per round; None without rounds.
    Example: rounds accepting 4, 4, 4 drafts (5 tokens offered each) in a turn capped at 12 new
    tokens commit 5, 5 and 1 after the prefill's token: τ = 11/3 ≈ 3.67, τ_uncapped = 5.0."""
    return committed / rounds if rounds else None


def tau_of_turns(turns: Iterable[Mapping[str, Any]]) -> float | None:
    """Committed τ pooled over an eval JSON's per-turn records (`per_prompt[i]["turns"]`, each with
    `tokens`, its new tokens, and `rounds`): Σ committed_of_turn(tokens) / Σ rounds; None without
    rounds. Raises KeyError for a record without either field."""
    committed = rounds = 0
    for t in turns:
        committed += committed_of_turn(int(t["tokens"]))
        rounds += int(t["rounds"])
    return tau(committed, rounds)
