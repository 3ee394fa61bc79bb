"""Automatic target:drafter split of N devices (`train --gpus 0-7`, on CPU `--procs N`): the flag
checks and the choice, as pure functions (no torch; split_probe.py measures the two rates).

Symbols: N devices, t target ranks, d drafter ranks (t + d = N, t ≥ 1, d ≥ 1), r_t = target rate and
r_d = drafter rate per device in context tokens/s (rows × T per second, the unit of the run's tok/s;
with anchor_draws_per_row = n a batch takes n drafter steps, so r_d is the step rate ÷ n),
e = `split_ddp_efficiency`.

Projection (what each candidate split would train per second):
  target bound   = t · r_t          target ranks never talk to each other: linear
  drafter bound  = d · r_d · e      for d ≥ 2 (data-parallel: one gradient all-reduce per step);
                 = r_d              for d = 1 (no all-reduce: the measured step is the whole step)
  projected      = min(target bound, drafter bound); "limited by" names the smaller bound
The transfers between the roles are not modeled (measured: 1 target H200 feeding 1 drafter H200
trains at 0.985 × the target's standalone rate, benchmarks/reports/2026-12-01-pipeline-colocated.md).

Choice: the feasible split with the highest projection; splits within `tie_tolerance` (1 % by
default: about what repeated measurements of the same step differ by) of the best count as ties,
and a tie goes to the most target ranks, which is the same as the fewest drafters. Why that side:
every drafter added grows the gradient all-reduce, which the model charges only through e (1.0
unless set); and with the default batch every drafter added is one more row per step
(rows_per_step rounds up to d), moving the global batch further from the one configured.

Feasible: rows_per_step must split over the d drafters (`layout.rows_per_step_for`: a default
rows_per_step is rounded up to a multiple of d, one the user set must already be one), and a run
that resumes must keep its checkpoint's drafter count (`required_drafters`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.pipeline.layout import parse_devices, rows_per_step_for, under_torchrun

Bound = Literal["target", "drafter", "both"]


@dataclass(frozen=True)
class SplitCandidate:
    """One split t + d = N and its projection (tokens/s; None when `infeasible` says why it cannot run)."""

    targets: int
    drafters: int
    rows_per_step: int  # G this split runs with
    target_bound_tok_per_s: float
    drafter_bound_tok_per_s: float
    projected_tok_per_s: float | None
    limited_by: Bound | None
    infeasible: str | None = None


@dataclass(frozen=True)
class SplitChoice:
    """Every candidate (targets ascending) and the chosen one."""

    num_devices: int
    target_tok_per_s: float  # r_t, per device
    drafter_tok_per_s: float  # r_d, per device
    ddp_efficiency: float
    tie_tolerance: float
    candidates: tuple[SplitCandidate, ...]
    chosen: SplitCandidate

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the rates (context tokens/s per device), the model, every candidate, the choice."""
        return {"num_devices": self.num_devices, "target_tok_per_s_per_device": self.target_tok_per_s,
                "drafter_tok_per_s_per_device": self.drafter_tok_per_s, "ddp_efficiency": self.ddp_efficiency,
                "tie_tolerance": self.tie_tolerance, "model": MODEL,
                "candidates": [asdict(c) for c in self.candidates], "chosen": asdict(self.chosen)}

    def table(self) -> str:
        """The candidates as aligned text, the chosen row marked."""
        head = f"{'targets':>7} {'drafters':>8} {'rows/step':>9} {'target bound':>13} {'drafter bound':>14} " \
               f"{'projected':>10}  limited by"
        lines = [head]
        for c in self.candidates:
            projected = "-" if c.projected_tok_per_s is None else f"{c.projected_tok_per_s:,.0f}"
            why = c.infeasible or c.limited_by or ""
            mark = "  <- chosen" if c == self.chosen else ""
            lines.append(f"{c.targets:>7} {c.drafters:>8} {c.rows_per_step:>9} {c.target_bound_tok_per_s:>13,.0f} "
                         f"{c.drafter_bound_tok_per_s:>14,.0f} {projected:>10}  {why}{mark}")
        return "\n".join(lines)


MODEL = ("projected tok/s = min(targets * target_tok_per_s, drafter bound); drafter bound = drafter_tok_per_s for "
         "1 drafter, drafters * drafter_tok_per_s * ddp_efficiency for 2 or more; ties (within tie_tolerance of the "
         "best) go to the most targets")


def project_split(targets: int, drafters: int, target_tok_per_s: float, drafter_tok_per_s: float,
                  ddp_efficiency: float = 1.0) -> tuple[float, float, float, Bound]:
    """(target bound, drafter bound, projected, limited by) of one split, in tokens/s (module docstring)."""
    target_bound = targets * target_tok_per_s
    drafter_bound = drafters * drafter_tok_per_s * (ddp_efficiency if drafters > 1 else 1.0)
    if math.isclose(target_bound, drafter_bound, rel_tol=1e-9):
        limited: Bound = "both"
    else:
        limited = "target" if target_bound < drafter_bound else "drafter"
    return target_bound, drafter_bound, min(target_bound, drafter_bound), limited


def choose_split(num_devices: int, target_tok_per_s: float, drafter_tok_per_s: float, *, ddp_efficiency: float = 1.0,
                 rows_per_step: int = 1, rows_per_step_set: bool = False, required_drafters: int | None = None,
                 tie_tolerance: float = 0.01) -> SplitChoice:
    """Project every split t + d = num_devices and choose one (module docstring: model, ties, feasibility).

    Rates are per device in tokens/s. rows_per_step / rows_per_step_set: the run's batch and whether
    the user set it. required_drafters: the drafter count a resumed checkpoint needs (None = any).
    Raises ValueError for fewer than 2 devices, a rate that is not a positive finite number, an
    efficiency outside (0, 1], or when no split is feasible.
    """
    if num_devices < 2:
        raise ValueError(f"an automatic split needs at least 2 devices (1 target + 1 drafter), got {num_devices}")
    for name, rate in (("target", target_tok_per_s), ("drafter", drafter_tok_per_s)):
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"the measured {name} rate must be a positive number of tokens/s, got {rate}")
    if not 0 < ddp_efficiency <= 1:
        raise ValueError(f"split_ddp_efficiency={ddp_efficiency} must lie in (0, 1]")
    candidates = []
    for t in range(1, num_devices):
        d = num_devices - t
        rows = rows_per_step_for(rows_per_step, rows_per_step_set, d)
        tb, db, projected, limited = project_split(t, d, target_tok_per_s, drafter_tok_per_s, ddp_efficiency)
        why = None
        if rows % d:
            why = f"rows_per_step={rows} does not split over {d} drafters"
        elif required_drafters is not None and d != required_drafters:
            why = f"the checkpoint to resume needs {required_drafters} drafters"
        candidates.append(SplitCandidate(t, d, rows, tb, db, None if why else projected, None if why else limited, why))
    feasible = [c for c in candidates if c.infeasible is None]
    if not feasible:
        if required_drafters is not None:
            raise ValueError(f"the checkpoint to resume was trained with {required_drafters} drafter ranks: give at "
                             f"least {required_drafters + 1} devices, or start afresh (--resume never, or a new --out)")
        raise ValueError(f"no split of {num_devices} devices can run rows_per_step={rows_per_step}")  # d = 1 always can
    best = max(c.projected_tok_per_s for c in feasible)  # type: ignore[type-var]
    ties = [c for c in feasible if c.projected_tok_per_s >= best * (1 - tie_tolerance)]  # type: ignore[operator]
    chosen = max(ties, key=lambda c: c.targets)
    return SplitChoice(num_devices, target_tok_per_s, drafter_tok_per_s, ddp_efficiency, tie_tolerance,
                       tuple(candidates), chosen)


def wants_auto_split(cfg: TrainConfig) -> bool:
    """Whether `cfg` asks for an automatic split (`gpus` or `procs` set)."""
    return cfg.layout.gpus is not None or cfg.layout.procs is not None


def auto_split_devices(cfg: TrainConfig, env: Mapping[str, str] | None = None) -> list[str]:
    """The devices `--gpus`/`--procs` name ("cuda:3" each, or "cpu" once per process), after checking
    the flags around them. Needs no torch (the CLI answers bad flags at once). Raises ValueError
    naming the flags and the fix."""
    from dflash_trainer.preflight.checks import cuda_ruled_out

    env = os.environ if env is None else env
    flag = "--gpus" if cfg.layout.gpus is not None else "--procs"
    if cfg.layout.gpus is not None and cfg.layout.procs is not None:
        raise ValueError("--gpus (GPU processes) and --procs (CPU processes) exclude each other; give one")
    given = [f for f, v in (("--target-gpus", cfg.layout.target_gpus), ("--drafter-gpus", cfg.layout.drafter_gpus),
                            ("--target-procs", cfg.layout.target_procs), ("--drafter-procs", cfg.layout.drafter_procs)) if v is not None]
    if given:
        raise ValueError(f"{flag} measures and chooses the split, {'/'.join(given)} give one: drop {flag} to keep "
                         f"your split, or drop {'/'.join(given)} to have it chosen")
    if cfg.layout.colocate:
        raise ValueError(f"--colocate runs target and drafter in one process; drop {flag} (or drop --colocate)")
    if under_torchrun(env):
        raise ValueError(f"{flag} measures on one host; under torchrun give each node's split with --target-gpus/"
                         f"--drafter-gpus (run `dflash-train train {flag} ... --dry-run` on one node to choose it)")
    if cfg.layout.procs is not None:
        if cfg.layout.procs < 2:
            raise ValueError(f"--procs {cfg.layout.procs}: an automatic split needs at least 2 processes (1 target + 1 "
                             "drafter); for one process drop --procs (co-located training)")
        return ["cpu"] * cfg.layout.procs
    if cfg.runtime.device == "cpu":
        raise ValueError("device=cpu contradicts --gpus; use --procs N for CPU processes")
    gpus = parse_devices(cfg.layout.gpus, "--gpus")
    if len(gpus) < 2:
        raise ValueError(f"--gpus {cfg.layout.gpus}: an automatic split needs at least 2 GPUs (1 target + 1 drafter); on one "
                         "GPU drop --gpus (co-located training)")
    if cuda_ruled_out():
        raise ValueError("--gpus needs CUDA GPUs but none is visible; use --procs N for CPU processes")
    return [f"cuda:{g}" for g in gpus]


def apply_split(cfg: TrainConfig, devices: list[str], chosen: SplitCandidate) -> TrainConfig:
    """`cfg` with the chosen split as explicit layout flags (the first `targets` devices run the
    target, the rest the drafter), `gpus`/`procs` cleared: the path of --target-gpus/--drafter-gpus
    (or --target-procs/--drafter-procs) from here on."""
    if devices[0] == "cpu":
        update = {"procs": None, "target_procs": chosen.targets, "drafter_procs": chosen.drafters}
    else:
        ids = [int(d.split(":")[1]) for d in devices]
        update = {"gpus": None, "target_gpus": format_devices(ids[:chosen.targets]),
                  "drafter_gpus": format_devices(ids[chosen.targets:])}
    return cfg.updated(update)


def format_devices(ids: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2,5' (what parse_devices reads back)."""
    parts: list[str] = []
    start = prev = ids[0]
    for g in [*ids[1:], None]:
        if g is not None and g == prev + 1:
            prev = g
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if g is not None:
            start = prev = g
    return ",".join(parts)
