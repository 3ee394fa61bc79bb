"""Drafter ranks: train the drafter data-parallel on the micro-batches the target ranks send."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from dflash_trainer.config.schema import saved_config
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.telemetry.rank_rates import rates
from dflash_trainer.telemetry.report import write_report_safely
from dflash_trainer.files.portable import portable_path
from dflash_trainer.training import precision
from dflash_trainer.training.checkpoint import Progress, prune, restore_training, training_state
from dflash_trainer.drafter.build import build_drafter
from dflash_trainer.training.schedule import RowSchedule
from dflash_trainer.training.loop import InboxSource, LoopParts, LoopResult, run_loop
from dflash_trainer.pipeline.rank_context import RankContext, wire_spec
from dflash_trainer.training.run import build_training, find_resume, save_run_checkpoint, start_run_records
from dflash_trainer.training.run_clock import RunClock
from dflash_trainer.training.run_log import RunLog
from dflash_trainer.pipeline.p2p import DrafterInbox


class ReplicatedDrafter:
    """What `drafter_step` needs from a drafter (config, LM head weight, the call) with the call
    going through DDP, so gradients are reduced during backward."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel):
        self.ddp = ddp
        self.config = ddp.module.config

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.ddp.module.lm_head_weight

    def __call__(self, *args: Any) -> torch.Tensor:
        return self.ddp(*args)


def sum_gradients_hook(group, bucket):  # noqa: ANN001 - DDP checks the real annotations; strings fail its check
    """DDP comm hook: all-reduce SUM (DDP's default divides by the world size; the loss is already
    divided by the global weight sum, so the sum is the gradient of the global loss).
    group: the drafter process group; bucket: dist.GradBucket → Future[Tensor]."""
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def drafter_role(ctx: RankContext) -> None:
    """Build the drafter from the run info, train it on the received micro-batches; drafter 0 logs,
    checkpoints and leaves `ctx.extra["write_summary"]` for after the final barrier."""
    from dflash_trainer.interop.load_drafter import load_drafter

    cfg, layout, device, wd = ctx.cfg, ctx.layout, ctx.device, ctx.watchdog
    clock = RunClock()  # this segment's wall time counts from here, as a co-located run's does from its start
    dtype = precision.compute_dtype(device)
    wd.beat("choosing the checkpoint to resume from")
    resume = agree_on_resume(ctx)
    wd.beat("waiting for the run info from target rank 0")
    info = ctx.board.wait_for("run_info", ctx.timeout_s)
    dc = DrafterConfig(**info["drafter_config"])
    V, H = info["vocab_size"], info["hidden_size"]
    if ctx.source.shares_head:
        wd.beat("receiving the embedding and LM head")
        embed_w = torch.empty(V, H, dtype=dtype, device=device)
        dist.recv(embed_w, src=layout.targets[0].rank)
        head_w = embed_w
        if not info["tied"]:
            head_w = torch.empty(V, H, dtype=dtype, device=device)
            dist.recv(head_w, src=layout.targets[0].rank)
    else:
        wd.beat("reading the embedding and LM head")
        embed_w, head_w = ctx.source.load_head(dtype)
    wd.beat("building the drafter")
    init = load_drafter(cfg.drafter.init_from, num_target_layers=info["num_target_layers"])[1] if cfg.drafter.init_from else None
    drafter = build_drafter(cfg, dc, (embed_w, head_w), device, init,
                            log=(lambda msg: print(msg, flush=True)) if ctx.logs else None)
    M = layout.num_drafters
    model: Any = drafter
    if M > 1:
        ddp = nn.parallel.DistributedDataParallel(drafter, process_group=ctx.drafters, gradient_as_bucket_view=True)
        ddp.register_comm_hook(ctx.drafters, sum_gradients_hook)
        model = ReplicatedDrafter(ddp)
    params = [p for p in drafter.parameters() if p.requires_grad]
    setup = build_training(cfg, dc, params, info["num_rows"], M, device)
    schedule, total, opt, sched, settings, acc = (setup.schedule, setup.total_steps, setup.opt, setup.sched,
                                                  setup.settings, setup.acc)
    spec = wire_spec(cfg, layout, dc, H, dtype)
    inbox = DrafterInbox(spec, drafter_index=ctx.me.role_index, num_drafters=M, num_targets=layout.num_targets,
                         target_rank_of=layout.target_rank_of, first_unit_of_target=layout.first_unit_of_target,
                         device=device, data_group=None, ctl_group=ctx.ctl,
                         depth=layout.queue_depth, total_steps=schedule.batch_steps(total), timeout_s=ctx.timeout_s,
                         telemetry=ctx.telemetry)
    prog = Progress()
    resumed_from = None
    if resume is not None:
        resumed_from, state, weights = resume
        prog = restore_training(state, weights, drafter, opt, sched, acc)
        del resume, state, weights  # the loaded copies are not kept for the whole run
    logger = _Logger(ctx, info, dc, schedule, total, prog) if ctx.logs else None
    if logger is not None and resumed_from is not None:
        logger.console.print(f"resumed from {resumed_from} at step {prog.step}")
    if logger is not None:
        for line in schedule.small_data_warnings(total):
            logger.console.print(f"[yellow]warning:[/] {line}", highlight=False)

    def save(step: int, name: str) -> Path:
        assert logger is not None
        clock.stamp(prog)
        state = training_state({"layout": "pipeline", "num_drafters": M}, prog, opt, sched, acc.state(), saved_config(cfg))
        path = logger.save(drafter, step, name, state)
        prune(Path(cfg.out), cfg.runtime.keep_last)
        return path

    parts = LoopParts(model=model, params=params, opt=opt, sched=sched, settings=settings, acc=acc,
                      source=InboxSource(inbox), schedule=schedule, seed=cfg.runtime.seed, seq_len=cfg.data.seq_len,
                      grad_clip=cfg.optim.grad_clip, log_every=cfg.runtime.log_every, save_every=cfg.runtime.save_every,
                      max_consecutive_skips=cfg.runtime.max_consecutive_skips, stop=lambda: _vote_stop(ctx, M),
                      log=logger.write if logger is not None else None, save=save if logger is not None else None,
                      beat=wd.beat, telemetry=ctx.telemetry, group=ctx.drafters, world=M)
    drafter.train()
    clock.start_training(prog)
    result = run_loop(parts, prog, total)
    _finish_drafter(ctx, drafter, result, prog, logger, save, clock)


def agree_on_resume(ctx: RankContext) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]] | None:
    """The checkpoint every rank continues from, or None for a fresh start.

    Drafter 0 picks OUT's (or `resume`'s) newest readable checkpoint (falling back past unreadable
    ones, refusing one from another config or from the co-located layout) and publishes its folder
    and step; the other drafters load that same folder; target ranks read the step
    (`resume_step`). Returns (folder, training_state, weights) on drafter ranks.
    """
    from dflash_trainer.training.checkpoint import check_resumable, load_step_checkpoint

    cfg = ctx.cfg
    if ctx.me.role_index == 0:
        found = find_resume(cfg, Path(cfg.out), lambda msg: print(f"warning: {msg}", flush=True))
        if found is not None:
            folder, state, _ = found
            check_resumable(state, saved_config(cfg), folder, "pipeline", ctx.layout.num_drafters)
        ctx.board.publish("resume", {"folder": str(found[0]) if found else None,
                                     "step": int(found[1]["progress"]["step"]) if found else 0})
        return found
    choice = ctx.board.wait_for("resume", ctx.timeout_s)
    return None if choice["folder"] is None else load_step_checkpoint(Path(choice["folder"]))


def _vote_stop(ctx: RankContext, world: int) -> bool:
    """True on every drafter when any drafter (or the launcher, via the store) asked to stop."""
    local = ctx.stop.is_set()
    if world == 1:
        return local
    flag = torch.tensor([1 if local else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.drafters_ctl)
    return bool(flag.item())  # CPU tensor: no device sync


def _finish_drafter(ctx: RankContext, drafter: DFlashDrafter, result: LoopResult, prog: Progress,
                    logger: "_Logger | None", save: Callable[[int, str], Path], clock: RunClock) -> None:
    """Check the replicas agree, then (drafter 0) write checkpoint-final, or checkpoint-{step} with
    the full training state after a stop request so that the same command resumes."""
    ctx.watchdog.beat("checking the drafter replicas")
    diff = replica_max_abs_diff(drafter, ctx.drafters, ctx.layout.num_drafters)
    ctx.board.publish(f"final/{ctx.me.rank}", ctx.telemetry.snapshot())
    if logger is not None:
        name = f"checkpoint-{prog.step}" if result.stopped_early else "checkpoint-final"
        ckpt = None
        if result.stopped_early or ctx.options.save_final:
            ctx.watchdog.beat(f"writing {name}")
            ckpt = save(prog.step, name)
        ctx.extra["write_summary"] = lambda: logger.summary(result, prog, ckpt, diff, clock)


def replica_max_abs_diff(drafter: nn.Module, group: Any, world: int) -> float:
    """Largest |w_rank − w_drafter0| over all trainable weights and drafter ranks (0.0 when in sync).

    One broadcast of every weight from drafter 0, at the end of the run only.
    """
    if world == 1:
        return 0.0
    src = dist.get_global_rank(group, 0)
    worst = torch.zeros((), dtype=torch.float64, device=next(drafter.parameters()).device)
    with torch.no_grad():
        for p in drafter.parameters():
            ref = p.detach().clone()
            dist.broadcast(ref, src=src, group=group)
            worst = torch.maximum(worst, (p.detach() - ref).abs().max().double())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return float(worst.item())  # host sync: once, at the end


class _Logger:
    """Drafter 0's side: run files, metrics.jsonl with the aggregated rank telemetry, live line,
    checkpoints, summary.json."""

    def __init__(self, ctx: RankContext, info: dict, dc: DrafterConfig, schedule: RowSchedule, total: int,
                 prog: Progress):
        self.ctx, self.info, self.dc, self.total = ctx, info, dc, total
        out = Path(ctx.cfg.out)
        start_run_records(ctx.cfg, out)
        (out / "layout.json").write_text(ctx.layout.to_json() + "\n")
        self.console = Console()
        self.prev: dict[int, dict] = {}
        self.run_log = RunLog(out, prog, schedule, total, self.console, ranks=self.rank_rates)
        self.write = self.run_log.write
        self.console.print(f"drafter: {dc.num_hidden_layers} layers, B={dc.block_size}, target {info['target']}, "
                           f"{info['num_rows']} rows × {ctx.cfg.data.seq_len} tokens, {total} steps, "
                           f"{schedule.rows_per_drafter} rows per drafter per step")

    def rank_rates(self) -> list[dict]:
        rows = []
        for spec in self.ctx.layout.ranks:
            snap = (self.ctx.telemetry.snapshot() if spec.rank == self.ctx.me.rank
                    else self.ctx.board.read(f"telemetry/{spec.rank}"))
            if snap is None:
                continue
            rows.append(rates(self.prev.get(spec.rank), snap))
            self.prev[spec.rank] = snap
        return rows

    def save(self, drafter: DFlashDrafter, step: int, name: str, state: dict[str, Any]) -> Path:
        cfg = self.ctx.cfg
        return save_run_checkpoint(Path(cfg.out) / name, drafter, self.dc, cfg, step, self.info["target"],
                                   self.info["mask_token_reason"], self.info["chat_template"], state)

    def summary(self, result: LoopResult, prog: Progress, ckpt: Path | None, replica_diff: float,
                clock: RunClock) -> dict:
        """Write OUT/summary.json: the whole run's steps, tokens, wall time and tok/s (every resumed
        segment, `RunClock.totals`, as a co-located run reports them) beside this segment's, the
        loss, the checkpoint (relative to OUT) and each rank's telemetry; returns the body."""
        self.run_log.close()
        ctx = self.ctx
        finals = {s.rank: ctx.board.read(f"final/{s.rank}") for s in ctx.layout.ranks}
        probes = {s.rank: ctx.board.read(f"probe/{s.rank}") for s in ctx.layout.targets}
        body = {**clock.totals(prog, result.train_wall_s),
                "first_loss": prog.losses[0] if prog.losses else None, "last_loss": prog.losses[-1] if prog.losses else None,
                "validation": {}, "checkpoint": portable_path(ckpt, ctx.cfg.out) if ckpt else None, "stopped_early": result.stopped_early,
                "skipped_steps": prog.skipped_steps,
                "drafter_replica_max_abs_diff": replica_diff, "layout": ctx.layout.as_dict(),
                "ranks_final": [rates(None, f) for f in finals.values() if f is not None],
                "target_probe": {str(k): v for k, v in probes.items() if v is not None},
                "feature_cache": {str(k): f["feature_cache"] for k, f in finals.items() if f and "feature_cache" in f} or None}
        (Path(ctx.cfg.out) / "summary.json").write_text(json.dumps(body, indent=2) + "\n")
        write_report_safely(ctx.cfg.out, lambda msg: self.console.print(f"[yellow]warning:[/] {msg}"))  # OUT/report.png
        return body
