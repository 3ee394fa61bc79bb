"""What every pipeline rank carries: run options, its place in the layout, groups, flags, counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.weights import needs_target_hidden
from dflash_trainer.pipeline.layout import Layout, RankSpec
from dflash_trainer.training.signals import StopRequest
from dflash_trainer.pipeline.target_source import TargetSource
from dflash_trainer.pipeline.wire import WireSpec
from dflash_trainer.pipeline.flow import FailureBoard, Watchdog
from dflash_trainer.telemetry.rank_rates import RankTelemetry


@dataclass(frozen=True)
class PipelineOptions:
    """Settings that are not part of the config (programmatic callers: tests, benchmarks)."""

    target_source: TargetSource | None = None  # None = CheckpointTarget(cfg.target.path)
    probe_target_iters: int = 0  # target ranks first time this many standalone forwards (bench)
    stall_timeout_s: float | None = None  # None = 2·comm_timeout_s + 60
    save_final: bool = True  # write checkpoint-final (benchmarks skip it)
    status_every_s: float = 30.0  # launcher: one line of every rank's state this often until all ranks work


@dataclass
class RankContext:
    """Everything a role loop needs besides the model: who it is, its groups, flags and counters."""

    cfg: TrainConfig
    layout: Layout
    me: RankSpec
    device: torch.device
    options: PipelineOptions
    source: TargetSource
    board: FailureBoard
    stop: StopRequest
    telemetry: RankTelemetry
    watchdog: Watchdog
    ctl: Any = None  # gloo group of all ranks: credits, headers, final barrier
    drafters: Any = None  # drafter group, default backend: DDP, weight sums, metrics
    drafters_ctl: Any = None  # gloo group of the drafters: stop vote
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def timeout_s(self) -> float:
        return self.cfg.layout.comm_timeout_s

    @property
    def logs(self) -> bool:
        """The rank that logs, checkpoints and writes the summary: drafter 0."""
        return self.me.role == "drafter" and self.me.role_index == 0


def wire_spec(cfg: TrainConfig, layout: Layout, dc: DrafterConfig, hidden: int, dtype: torch.dtype) -> WireSpec:
    """What one micro-batch carries between a target and a drafter rank: R = rows per drafter step
    rows of T tokens, features [R,T,k·H] in `dtype`, plus argmax labels / final hidden states [R,T,H]
    when the objective needs them (pipeline/wire.py)."""
    return WireSpec(rows=layout.rows_per_drafter, seq_len=cfg.data.seq_len, feature_width=dc.num_aux_layers * hidden,
                    hidden_size=hidden, feature_dtype=dtype, need_argmax=cfg.loss.label_source == "target",
                    need_last_hidden=needs_target_hidden(cfg.loss.kind, cfg.loss.position_weights))


def resume_step(ctx: RankContext) -> int:
    """The step the run continues from, as drafter 0 published it (0 for a fresh start); see
    drafter_rank.agree_on_resume."""
    return int(ctx.board.wait_for("resume", ctx.timeout_s)["step"])
