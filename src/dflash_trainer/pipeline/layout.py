"""Process layout of a run: which rank is a target or a drafter, on which device, and which rows
each one handles.

Symbols: N = target ranks, M = drafter ranks, G = rows per optimizer step (global, `rows_per_step`),
R = G / M rows per drafter per step, s = global optimizer step, u = micro-batch index.

Roles
  target   runs the frozen target over packed rows and sends features and labels on
  drafter  trains the drafter on what it receives; the M drafters form one data-parallel group
  both     co-located: one process holds the target and the drafter (the default on one device)

Sources of a layout, in order:
  torchrun (env RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE): the flags give the layout of one
    node; every node runs the same layout. Local ranks [0, n_t) are targets, [n_t, n_t + n_d)
    drafters; global ranks are node·(n_t + n_d) + local rank.
  --target-gpus/--drafter-gpus on one host: this program spawns one process per GPU; ranks
    [0, N) are the targets, [N, N + M) the drafters. Backend NCCL.
  --target-procs/--drafter-procs: the same on CPU with gloo (tests, hosts without GPUs).
  --gpus/--procs: a split measured and chosen first (auto_split.py, split_probe.py), then one of the above.
  otherwise (or --colocate): one process, role "both".

Which rows each micro-batch holds, and the anchor seeds: training/schedule.py.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from dflash_trainer.config.schema import TrainConfig

Role = Literal["target", "drafter", "both"]
Launcher = Literal["single", "spawn", "torchrun"]


@dataclass(frozen=True)
class RankSpec:
    """One process of the layout. role_index: index among the ranks of the same role (target t or drafter d)."""

    rank: int
    node: int
    local_rank: int
    role: Role
    role_index: int
    device: str  # "cuda:3" or "cpu"


@dataclass(frozen=True)
class Layout:
    """The resolved layout: every rank of every node, and the settings the schedule needs."""

    ranks: tuple[RankSpec, ...]
    launcher: Launcher
    backend: Literal["nccl", "gloo"]
    num_nodes: int
    queue_depth: int
    rows_per_step: int  # G, global

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def targets(self) -> list[RankSpec]:
        """Target ranks ordered by role index."""
        return sorted((r for r in self.ranks if r.role == "target"), key=lambda r: r.role_index)

    @property
    def drafters(self) -> list[RankSpec]:
        """Drafter ranks ordered by role index."""
        return sorted((r for r in self.ranks if r.role == "drafter"), key=lambda r: r.role_index)

    @property
    def num_targets(self) -> int:
        return len(self.targets)

    @property
    def num_drafters(self) -> int:
        return len(self.drafters)

    @property
    def rows_per_drafter(self) -> int:
        """R = G / M: rows of one micro-batch (1 in the co-located layout's terms: G)."""
        return self.rows_per_step // max(1, self.num_drafters)

    @property
    def multiprocess(self) -> bool:
        return self.launcher != "single"

    def target_index_of(self, unit: int) -> int:
        """Target index (role index) that computes micro-batch `unit` (node-local round robin)."""
        m, n = self.num_drafters // self.num_nodes, self.num_targets // self.num_nodes
        step, d = divmod(unit, self.num_drafters)
        node, j = divmod(d, m)
        return node * n + (step * m + j) % n

    def target_rank_of(self, unit: int) -> int:
        """Global rank of the target that computes micro-batch `unit`."""
        return self.targets[self.target_index_of(unit)].rank

    def units_of_target(self, target_index: int, first_step: int, total_steps: int) -> Iterator[int]:
        """Micro-batches target `target_index` computes for steps [first_step, total_steps), in increasing order."""
        m, n = self.num_drafters // self.num_nodes, self.num_targets // self.num_nodes
        node, i = divmod(target_index, n)
        lo = first_step * m
        for v in range(lo + (i - lo) % n, total_steps * m, n):
            step, j = divmod(v, m)
            yield step * self.num_drafters + node * m + j

    def first_unit_of_target(self, target_index: int, from_step: int, total_steps: int) -> int | None:
        """The target's first micro-batch at or after step `from_step` (None when it has none left)."""
        return next(iter(self.units_of_target(target_index, from_step, total_steps)), None)

    def drafter_rank_of(self, unit: int) -> int:
        """Global rank of the drafter that trains on micro-batch `unit`."""
        return self.drafters[unit % self.num_drafters].rank

    def rank_spec(self, rank: int) -> RankSpec:
        return self.ranks[rank]

    def feeds(self) -> dict[int, list[int]]:
        """target rank → drafter ranks it ever sends to (one period of the schedule)."""
        n, m = self.num_targets, self.num_drafters
        out: dict[int, set[int]] = {t.rank: set() for t in self.targets}
        for u in range(m * math.lcm(n, m)):
            out[self.target_rank_of(u)].add(self.drafter_rank_of(u))
        return {t: sorted(d) for t, d in out.items()}

    def as_dict(self, *, num_units: int | None = None, visible_cuda_devices: int | None = None) -> dict[str, Any]:
        """JSON-ready description (the `--dry-run` output)."""
        body: dict[str, Any] = {
            "launcher": self.launcher, "backend": self.backend, "world_size": self.world_size,
            "num_nodes": self.num_nodes, "num_targets": self.num_targets, "num_drafters": self.num_drafters,
            "queue_depth": self.queue_depth, "rows_per_step": self.rows_per_step,
            "rows_per_drafter_step": self.rows_per_drafter,
            "ranks": [asdict(r) for r in self.ranks],
        }
        if self.multiprocess:
            n, m = self.num_targets, self.num_drafters
            k = num_units if num_units is not None else max(2 * math.lcm(n, m), 2 * m)
            body["feeds"] = [{"target_rank": t, "drafter_ranks": d} for t, d in self.feeds().items()]
            body["schedule"] = {
                "rule": "micro-batch u = step*M + d holds drafter d's rows of the step; drafter = u mod M; "
                        "targets feed the drafters of their node round robin (one node: target = u mod N); "
                        "a target sends its micro-batches in increasing u",
                "first_units": [{"unit": u, "step": u // m, "target_rank": self.target_rank_of(u),
                                 "drafter_rank": self.drafter_rank_of(u)} for u in range(k)],
            }
        if visible_cuda_devices is not None:
            body["visible_cuda_devices"] = visible_cuda_devices
        return body

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.as_dict(**kwargs), indent=2)


def parse_devices(spec: str, flag: str) -> list[int]:
    """'0-4' → [0..4], '0,2,5-6' → [0, 2, 5, 6]. ValueError naming `flag` on bad input or repeats."""
    out: list[int] = []
    try:
        for part in (p.strip() for p in str(spec).split(",")):
            if not part:
                continue
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise ValueError(f"{flag} {spec!r}: expected GPU indices like 0-4 or 0,1,2") from None
    if not out or min(out) < 0:
        raise ValueError(f"{flag} {spec!r}: expected at least one GPU index >= 0")
    if len(set(out)) != len(out):
        raise ValueError(f"{flag} {spec!r}: a GPU is listed twice")
    return out


def under_torchrun(env: Mapping[str, str]) -> bool:
    """True when launched by torchrun (or any launcher setting the torch.distributed env vars)."""
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))


def resolve_layout(cfg: TrainConfig, env: Mapping[str, str] | None = None, cuda_count: int | None = None) -> Layout:
    """The layout `cfg` asks for (TrainConfig fields target_gpus, drafter_gpus, colocate, target_procs,
    drafter_procs, queue_depth, rows_per_step, device), under the launcher found in `env`.

    cuda_count: visible CUDA devices (None = ask torch); GPU indices beyond it are a ValueError unless
    cfg.layout.dry_run. Raises ValueError naming the flag and the fix for contradictory or incomplete flags.
    """
    env = os.environ if env is None else env
    if cfg.layout.gpus is not None or cfg.layout.procs is not None:
        raise RuntimeError("--gpus/--procs ask for an automatic split: resolve it first (pipeline/split_probe.py: "
                           "auto_split)")
    gpus = cfg.layout.target_gpus is not None or cfg.layout.drafter_gpus is not None
    procs = cfg.layout.target_procs is not None or cfg.layout.drafter_procs is not None
    if cfg.layout.colocate and (gpus or procs):
        raise ValueError("--colocate runs target and drafter in one process; drop --target-gpus/--drafter-gpus/"
                         "--target-procs/--drafter-procs (or drop --colocate)")
    if gpus and procs:
        raise ValueError("--target-gpus/--drafter-gpus (GPU processes) and --target-procs/--drafter-procs "
                         "(CPU processes) exclude each other; give one pair")
    if gpus and (cfg.layout.target_gpus is None or cfg.layout.drafter_gpus is None):
        raise ValueError("give both --target-gpus and --drafter-gpus (e.g. --target-gpus 0-4 --drafter-gpus 5-7)")
    if procs and (cfg.layout.target_procs is None or cfg.layout.drafter_procs is None):
        raise ValueError("give both --target-procs and --drafter-procs (e.g. --target-procs 1 --drafter-procs 2)")
    if gpus and cfg.runtime.device == "cpu":
        raise ValueError("device=cpu contradicts --target-gpus/--drafter-gpus; use --target-procs/--drafter-procs on CPU")

    if not gpus and not procs:
        if under_torchrun(env) and int(env["WORLD_SIZE"]) > 1:
            raise ValueError("under torchrun give the layout of one node: --target-gpus/--drafter-gpus (GPU) or "
                             "--target-procs/--drafter-procs (CPU)")
        device = "cuda:0" if cfg.runtime.device == "cuda" or (cfg.runtime.device == "auto" and _cuda_count(cuda_count) > 0) else "cpu"
        return Layout(ranks=(RankSpec(0, 0, 0, "both", 0, device),), launcher="single",
                      backend="nccl" if device != "cpu" else "gloo", num_nodes=1,
                      queue_depth=cfg.layout.queue_depth, rows_per_step=cfg.optim.rows_per_step)

    if gpus:
        t_dev = parse_devices(cfg.layout.target_gpus, "--target-gpus")
        d_dev = parse_devices(cfg.layout.drafter_gpus, "--drafter-gpus")
        both = sorted(set(t_dev) & set(d_dev))
        if both:
            raise ValueError(f"GPU {both} is in both --target-gpus and --drafter-gpus; give each GPU one role "
                             "(use --colocate to share one device)")
        if not cfg.layout.dry_run:
            n = _cuda_count(cuda_count)
            missing = [g for g in t_dev + d_dev if g >= n]
            if missing:
                raise ValueError(f"GPU {missing} requested but only {n} CUDA devices are visible; fix "
                                 "--target-gpus/--drafter-gpus (or CUDA_VISIBLE_DEVICES)")
        local = [("target", f"cuda:{g}") for g in t_dev] + [("drafter", f"cuda:{g}") for g in d_dev]
        backend = "nccl"
    else:
        if cfg.layout.target_procs < 1 or cfg.layout.drafter_procs < 1:
            raise ValueError("--target-procs and --drafter-procs must both be >= 1")
        local = [("target", "cpu")] * cfg.layout.target_procs + [("drafter", "cpu")] * cfg.layout.drafter_procs
        backend = "gloo"
    n_t = sum(1 for r, _ in local if r == "target")
    n_d = len(local) - n_t

    launcher: Launcher = "spawn"
    num_nodes = 1
    if under_torchrun(env):
        launcher = "torchrun"
        world, local_world = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
        if local_world != len(local):
            raise ValueError(f"torchrun --nproc-per-node={local_world} but the layout has {len(local)} processes per "
                             f"node ({n_t} targets + {n_d} drafters); make them equal")
        if world % local_world:
            raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}; every node "
                             "must run the same layout")
        num_nodes = world // local_world
    ranks = []
    for node in range(num_nodes):
        for lr, (role, device) in enumerate(local):
            idx = node * n_t + lr if role == "target" else node * n_d + (lr - n_t)
            ranks.append(RankSpec(rank=node * len(local) + lr, node=node, local_rank=lr, role=role,  # type: ignore[arg-type]
                                  role_index=idx, device=device))
    if n_t < 1 or n_d < 1:
        raise ValueError("a layout needs at least one target and one drafter process per node")
    layout = Layout(ranks=tuple(ranks), launcher=launcher, backend=backend, num_nodes=num_nodes,
                    queue_depth=cfg.layout.queue_depth, rows_per_step=layout_rows_per_step(cfg, num_nodes * n_d))
    if layout.rows_per_step % layout.num_drafters:
        m = layout.num_drafters
        raise ValueError(f"rows_per_step={cfg.optim.rows_per_step} must be a multiple of the number of drafter ranks ({m}): "
                         f"each drafter takes rows_per_step/{m} rows per step; set --set rows_per_step="
                         f"{m * max(1, math.ceil(cfg.optim.rows_per_step / m))}")
    if under_torchrun(env):
        me = int(env["RANK"])
        if layout.ranks[me].local_rank != int(env["LOCAL_RANK"]):
            raise ValueError(f"RANK={me} and LOCAL_RANK={env['LOCAL_RANK']} do not follow node-major order "
                             "(rank = node·nproc_per_node + local_rank); launch with torchrun's default rank assignment")
    return layout


def layout_rows_per_step(cfg: TrainConfig, num_drafters: int) -> int:
    """G for a layout of `num_drafters` drafter ranks: `cfg.optim.rows_per_step` when the user set it (it
    must then be a multiple of the drafter count: checked by resolve_layout), else the default
    rounded up to the next multiple, so every split runs with no extra flag (one row per drafter
    per step for the default of 1)."""
    return rows_per_step_for(int(cfg.optim.rows_per_step), "rows_per_step" in cfg.optim.model_fields_set, num_drafters)


def rows_per_step_for(rows: int, explicit: bool, num_drafters: int) -> int:
    """The rule of `layout_rows_per_step` on plain values: `rows` when `explicit` or already a multiple."""
    return rows if explicit or rows % num_drafters == 0 else num_drafters * math.ceil(rows / num_drafters)


def dry_run_json(cfg: TrainConfig, env: Mapping[str, str] | None = None) -> str:
    """The `--dry-run` output: the resolved layout as JSON (no process started, no model loaded)."""
    layout = resolve_layout(cfg, env)
    return layout.to_json(visible_cuda_devices=_cuda_count(None))


def is_multiprocess(cfg: TrainConfig, env: Mapping[str, str] | None = None) -> bool:
    """Whether `cfg` asks for the multi-process pipeline (a layout flag, or torchrun with >1 process)."""
    return resolve_layout(cfg, env).multiprocess


def _cuda_count(given: int | None) -> int:
    if given is not None:
        return given
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
