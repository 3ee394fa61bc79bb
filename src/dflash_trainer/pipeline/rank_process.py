"""One rank process of the multi-process layout (pipeline/launch.py starts them): connect to the
rendezvous store (spawned by the launcher, or under torchrun), set up the device, telemetry and
watchdog, join the process groups, run the rank's role (target_rank.py or drafter_rank.py), and on
any failure report it to the store and leave with exit code 1."""

from __future__ import annotations

import datetime as _dt
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.telemetry.rank_rates import RankTelemetry
from dflash_trainer.pipeline.drafter_rank import drafter_role
from dflash_trainer.training.finished import RunResult, read_result
from dflash_trainer.pipeline.layout import Layout, RankSpec
from dflash_trainer.pipeline.rank_context import PipelineOptions, RankContext
from dflash_trainer.training.signals import StopRequest
from dflash_trainer.pipeline.target_rank import target_role
from dflash_trainer.pipeline.target_source import TargetSource
from dflash_trainer.pipeline.flow import FailureBoard, FailureReport, Watchdog


def spawned_rank(rank: int, layout: Layout, cfg_dict: dict, source: TargetSource, options: PipelineOptions,
                 host: str, port: int) -> None:
    """Entry of a spawned rank process (never returns normally with a failure: exit code 1)."""
    cfg = TrainConfig(**cfg_dict)
    timeout = _dt.timedelta(seconds=cfg.layout.comm_timeout_s)
    # Two clients: the process group's rendezvous blocks in its client; the watchdog must not wait behind it.
    pg_store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    board_store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    _run_rank(layout, layout.ranks[rank], cfg, source, options, pg_store, board_store, quiet=True)


def torchrun_rank(layout: Layout, cfg: TrainConfig, source: TargetSource, options: PipelineOptions,
                  env: dict[str, str]) -> RunResult | None:
    rank = int(env["RANK"])
    timeout = _dt.timedelta(seconds=cfg.layout.comm_timeout_s)
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    pg_store = dist.TCPStore(host, port, layout.world_size, is_master=(rank == 0 and not agent_store), timeout=timeout,
                             wait_for_workers=False)
    board_store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    summary = _run_rank(layout, layout.ranks[rank], cfg, source, options, pg_store, board_store, quiet=False)
    return read_result(cfg.out) if summary is not None else None


def _run_rank(layout: Layout, me: RankSpec, cfg: TrainConfig, source: TargetSource, options: PipelineOptions,
              pg_store: Any, board_store: Any, *, quiet: bool) -> dict | None:
    """Set up one rank, run its role, report any failure to the store and leave with exit code 1."""
    board = FailureBoard(board_store)
    board.publish(f"pid/{me.rank}", os.getpid())
    device = torch.device(me.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        local = sum(1 for r in layout.ranks if r.node == me.node)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    telemetry = RankTelemetry(me.rank, me.role, device)
    stop = StopRequest()
    stop.install()
    stall = options.stall_timeout_s or 2 * cfg.layout.comm_timeout_s + 60
    watchdog = Watchdog(board, rank=me.rank, role=me.role, device=me.device, stop=stop, stall_timeout_s=stall,
                        snapshot=telemetry.snapshot, quiet=quiet)
    watchdog.start()
    ctx = RankContext(cfg=cfg, layout=layout, me=me, device=device, options=options, source=source, board=board,
                      stop=stop, telemetry=telemetry, watchdog=watchdog)
    try:
        watchdog.beat("initializing the process groups")
        _init_groups(ctx, pg_store)
        if me.role == "target":
            target_role(ctx)
        else:
            drafter_role(ctx)
        watchdog.beat("final barrier")
        dist.barrier(group=ctx.ctl)  # every rank has published its final snapshot
        summary = ctx.extra["write_summary"]() if "write_summary" in ctx.extra else None
        watchdog.close()
        telemetry.close()
        dist.destroy_process_group()
        return summary
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the process leaves
        rep = FailureReport.from_exception(me.rank, me.role, me.device, e)
        try:
            board.report(rep)
        except Exception:  # noqa: BLE001 - no store: say it here
            quiet = False
        if not quiet:
            if rep.kind == "peer":
                print(f"[rank {me.rank}] stopping: {rep.message[:300]}", file=sys.stderr)
            else:
                print(f"[rank {me.rank}] error: {rep.type}: {rep.message}\n{rep.traceback}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _init_groups(ctx: RankContext, store: Any) -> None:
    timeout = _dt.timedelta(seconds=ctx.timeout_s)
    layout = ctx.layout
    if layout.backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # durations of P2P ops for telemetry
    # Lazy NCCL communicators (no device_id): each is created by the ranks that first use it (a
    # target-drafter pair, the drafter group), never by a split every rank must join.
    dist.init_process_group(backend=layout.backend, store=dist.PrefixStore("pg/", store), rank=ctx.me.rank,
                            world_size=layout.world_size, timeout=timeout)
    drafter_ranks = [r.rank for r in layout.drafters]
    ctx.ctl = dist.new_group(backend="gloo", timeout=timeout)
    ctx.drafters = dist.new_group(ranks=drafter_ranks, timeout=timeout)
    ctx.drafters_ctl = dist.new_group(ranks=drafter_ranks, backend="gloo", timeout=timeout)
