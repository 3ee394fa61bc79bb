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


def tau_breakdown(per_prompt: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Committed τ of an eval's turns grouped four ways, to show where τ is lost: `by_turn` (the
    conversation's turn, "1" = first), `by_stop` (how the turn ended: "eos", or "length" = the token
    cap; "None" for a record without `stop`), `by_turn_and_stop` ("1 eos", "2 length", …: the two
    together, since later turns and capped turns can go together) and `by_category` (the prompt's
    `category`, e.g. MT-Bench's writing … humanities; only prompts that name one). Input: an eval
    JSON's `per_prompt` ({"id", "category"?, "turns": [{"turn" (0-based), "tokens", "rounds",
    "stop"}]}). Each group: {"tau", "turns", "rounds"}; groups in first-seen order, turns sorted.
    Example: turns of 11 new tokens in 3 rounds and 5 in 1 pool to τ (10 + 4) / 4 = 3.5."""
    names = ("by_turn", "by_stop", "by_turn_and_stop", "by_category")
    groups: dict[str, dict[str, list[Mapping[str, Any]]]] = {name: {} for name in names}
    for p in per_prompt:
        for t in p.get("turns", []):
            turn, stop = str(int(t["turn"]) + 1), str(t.get("stop"))
            groups["by_turn"].setdefault(turn, []).append(t)
            groups["by_stop"].setdefault(stop, []).append(t)
            groups["by_turn_and_stop"].setdefault(f"{turn} {stop}", []).append(t)
            if p.get("category"):
                groups["by_category"].setdefault(str(p["category"]), []).append(t)
    for name in ("by_turn", "by_turn_and_stop"):
        groups[name] = dict(sorted(groups[name].items(), key=lambda kv: (int(kv[0].split()[0]), kv[0])))
    return {name: {k: {"tau": tau_of_turns(ts), "turns": len(ts), "rounds": sum(int(t["rounds"]) for t in ts)}
                   for k, ts in groups[name].items()} for name in names}


def breakdown_line(breakdown: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """One line of `tau_breakdown`'s by_turn, by_stop and by_category groups, e.g. "turn 1 2.89 · turn 2
    4.01 | ended by length 3.40 · eos 3.16 | writing 3.32 · roleplay 3.14" (τ to 2 decimals, "-" for a
    group without rounds; empty groups left out; "" when every group is empty)."""
    def fmt(x: Any) -> str:
        return "-" if x is None else f"{x:.2f}"

    parts = [head + " · ".join(f"{prefix}{k} {fmt(g['tau'])}" for k, g in breakdown.get(name, {}).items())
             for name, head, prefix in (("by_turn", "", "turn "), ("by_stop", "ended by ", ""), ("by_category", "", ""))
             if breakdown.get(name)]
    return " | ".join(parts)
