"""Drafter ranks: train the drafter data-parallel on the micro-batches the target ranks send."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from dflash_trainer.config import dump_config
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.loss import LossSums
from dflash_trainer.drafter.metrics import MetricAccumulator
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.telemetry.progress import MetricsLog
from dflash_trainer.telemetry.provenance import provenance
from dflash_trainer.telemetry.report import write_report_safely
from dflash_trainer.training.checkpoint import prune, save_checkpoint
from dflash_trainer.training.layout import RowSchedule, anchor_seed
from dflash_trainer.training.optim import build_optimizer, build_scheduler
from dflash_trainer.training import precision
from dflash_trainer.training.rank_context import RankContext, wire_spec
from dflash_trainer.training.run import NonFiniteError, checkpoint_metadata, find_resume, step_settings
from dflash_trainer.training.step import StepSettings, drafter_step
from dflash_trainer.transport.p2p import DrafterInbox
from dflash_trainer.telemetry.rank_rates import format_line, rates


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


def global_weight_sum(weight_sum: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """Σ w over valid slots of all drafter ranks (no host sync; NCCL runs it on the device)."""
    w = weight_sum.detach().float().clone()
    if world > 1:
        dist.all_reduce(w, group=group)
    return w


def train_micro_batch(model: Any, rows: dict[str, torch.Tensor], features: torch.Tensor, argmax: torch.Tensor | None,
                      last_hidden: torch.Tensor | None, settings: StepSettings, generator: torch.Generator,
                      group: Any, world: int) -> tuple[LossSums, torch.Tensor]:
    """Forward, globally normalized loss, backward. Returns (local sums, global weight sum).

    The loss backpropagated on each rank is local Σ w·loss / global Σ w; with gradients summed over
    ranks (`sum_gradients_hook`) the result does not depend on how rows are split.
    """
    with precision.autocast(features.device):
        sums = drafter_step(model, rows, features, argmax, settings, generator, last_hidden)
    w = global_weight_sum(sums.weight_sum, group, world)
    (sums.loss_sum / w.clamp_min(1.0)).backward()
    return sums, w


def frozen_modules(embed_w: torch.Tensor, head_w: torch.Tensor, device: torch.device) -> tuple[nn.Embedding, nn.Linear]:
    """nn.Embedding / nn.Linear around the target's weights [V,H] (frozen; tied weights stay one tensor)."""
    tied = embed_w.data_ptr() == head_w.data_ptr()
    emb = nn.Embedding.from_pretrained(embed_w.to(device), freeze=True)
    head = nn.Linear(embed_w.shape[1], embed_w.shape[0], bias=False, device="meta")
    head.weight = emb.weight if tied else nn.Parameter(head_w.to(device), requires_grad=False)
    return emb, head


def drafter_role(ctx: RankContext) -> None:
    """Build the drafter from the run info, train it on the received micro-batches; drafter 0 logs,
    checkpoints and leaves `ctx.extra["write_summary"]` for after the final barrier."""
    from dflash_trainer.interop.load_drafter import load_drafter

    cfg, layout, device, wd = ctx.cfg, ctx.layout, ctx.device, ctx.watchdog
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
    emb, head = frozen_modules(embed_w, head_w, device)
    wd.beat("building the drafter")
    torch.manual_seed(cfg.seed)  # same initial weights on every drafter rank (DDP also broadcasts rank 0's)
    with torch.device(device):  # initialized where it trains (1B random values take seconds on a CPU)
        drafter = DFlashDrafter(dc, emb, head, checkpoint_layers=cfg.checkpoint_policy(), compile_flex=cfg.compile)
    if cfg.init_from:
        drafter.load_trainable_state_dict(load_drafter(cfg.init_from, num_target_layers=info["num_target_layers"])[1])
    if device.type == "cuda" and cfg.compile:
        drafter.compile_layers()
    M = layout.num_drafters
    model: Any = drafter
    if M > 1:
        ddp = nn.parallel.DistributedDataParallel(drafter, process_group=ctx.drafters, gradient_as_bucket_view=True)
        ddp.register_comm_hook(ctx.drafters, sum_gradients_hook)
        model = ReplicatedDrafter(ddp)
    params = [p for p in drafter.parameters() if p.requires_grad]
    schedule = RowSchedule(info["num_rows"], cfg.rows_per_step, M, cfg.seed, cfg.anchor_draws_per_row)
    total = schedule.total_steps(cfg.max_steps, cfg.epochs)  # optimizer steps
    opt = build_optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = build_scheduler(opt, total_steps=total, warmup_ratio=cfg.warmup_ratio, min_lr_ratio=cfg.min_lr_ratio)
    settings = step_settings(cfg, dc, device)
    spec = wire_spec(cfg, layout, dc, H, dtype)
    inbox = DrafterInbox(spec, drafter_index=ctx.me.role_index, num_drafters=M, num_targets=layout.num_targets,
                         target_rank_of=layout.target_rank_of, first_unit_of_target=layout.first_unit_of_target,
                         device=device, data_group=None, ctl_group=ctx.ctl,
                         depth=layout.queue_depth, total_steps=schedule.batch_steps(total), timeout_s=ctx.timeout_s,
                         telemetry=ctx.telemetry)
    acc = MetricAccumulator(dc.block_size, device)
    progress = {"step": 0, "tokens": 0, "skipped_steps": 0, "losses": []}
    resumed_from = None
    if resume is not None:
        resumed_from, state, weights = resume
        drafter.load_trainable_state_dict(weights)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        acc.load_state(state["metrics"])
        progress = dict(state["progress"])
        del resume, state, weights  # the loaded copies are not kept for the whole run
    logger = _Logger(ctx, info, dc, schedule, total, progress) if ctx.logs else None
    if logger is not None and resumed_from is not None:
        logger.console.print(f"resumed from {resumed_from} at step {progress['step']}")

    def training_state(step: int, tokens: int) -> dict[str, Any]:
        assert logger is not None
        return {"layout": "pipeline", "num_drafters": layout.num_drafters, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "metrics": acc.state(), "config": cfg.model_dump(), "provenance": provenance(),
                "progress": {"step": step, "tokens": tokens, "skipped_steps": logger.skipped,
                             "losses": list(logger.losses)}}

    result = drafter_loop(ctx, model, drafter, params, opt, sched, settings, inbox, schedule, total,
                          progress["step"], logger, acc, progress["tokens"], training_state)
    _finish_drafter(ctx, drafter, result, logger, training_state)


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
            check_resumable(state, cfg.model_dump(), folder, "pipeline", ctx.layout.num_drafters)
        ctx.board.publish("resume", {"folder": str(found[0]) if found else None,
                                     "step": int(found[1]["progress"]["step"]) if found else 0})
        return found
    choice = ctx.board.wait_for("resume", ctx.timeout_s)
    return None if choice["folder"] is None else load_step_checkpoint(Path(choice["folder"]))


@dataclass
class _LoopResult:
    steps: int  # steps trained in this run
    last_step: int  # index of the last step trained (first_step − 1 when none)
    tokens: int  # context tokens trained since step 0 (resumed runs included)
    new_tokens: int  # ... in this run
    train_wall_s: float
    stopped_early: bool


def drafter_loop(ctx: RankContext, model: Any, drafter: DFlashDrafter, params: list[nn.Parameter], opt, sched,
                 settings: StepSettings, inbox, schedule: RowSchedule, total: int, first_step: int,
                 logger: "_Logger | None", acc: MetricAccumulator, tokens: int,
                 training_state: Callable[[int, int], dict[str, Any]]) -> _LoopResult:
    """Steps [first_step, total): take → train → vote stop → release; `inbox`: the
    p2p.DrafterInbox. tokens: context tokens trained before first_step (resume). Every
    `save_every` steps drafter 0 logs, then writes a resumable checkpoint (`training_state(step,
    tokens)`) and prunes to `keep_last`."""
    cfg, device, wd, tel = ctx.cfg, ctx.device, ctx.watchdog, ctx.telemetry
    M = ctx.layout.num_drafters
    draws = schedule.anchor_draws
    drafter.train()
    inbox.open(first_step // draws)
    t0 = time.perf_counter()
    tokens0 = tokens
    last, stopped = first_step - 1, False
    batch = None
    for step in range(first_step, total):
        last = step
        b, draw = divmod(step, draws)  # batch step, anchor draw on it
        if batch is None:
            wd.beat(f"waiting for the micro-batch of step {step}")
            batch = inbox.take(b)
        wd.beat(f"training step {step}")
        tel.busy.start()
        gen = torch.Generator(device=device)
        gen.manual_seed(anchor_seed(cfg.seed, batch.epoch, int(batch.row_index[0]), draw))
        sums, _ = train_micro_batch(model, batch.rows(), batch.features, batch.argmax(), batch.last_hidden,
                                    settings, gen, ctx.drafters, M)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        # The gradients are already summed over drafters, so `finite` is the same on every rank and
        # all of them skip the same steps (fused AdamW reads found_inf on the device: no host sync).
        finite = torch.isfinite(norm)
        opt.found_inf = (~finite).to(torch.float32)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tel.busy.stop()
        acc.add(sums, finite)
        if draw == 0:  # target tokens count once per batch, however many draws train on it
            tokens += schedule.valid_rows(b) * cfg.seq_len  # all drafters together
            tel.finish_item(batch.num_valid_rows * cfg.seq_len)
        stopped = _vote_stop(ctx, M) and step < total - 1
        if stopped or step == total - 1:
            break
        if draw == draws - 1:
            inbox.release(b)
            batch = None
        saving = bool(cfg.save_every) and (step + 1) % cfg.save_every == 0
        if (step + 1) % cfg.log_every == 0 or saving:  # a checkpoint holds no unlogged metric sums
            _log(ctx, acc, logger, step + 1, tokens, sched)
        if saving and logger is not None:
            wd.beat(f"writing checkpoint-{step + 1}")
            logger.save(drafter, step + 1, f"checkpoint-{step + 1}", training_state(step + 1, tokens))
            prune(Path(cfg.out), cfg.keep_last)
    wd.beat("draining and ending the transfers")
    inbox.finish(last // draws if last >= first_step else first_step // draws - 1)  # the last batch step taken
    _log(ctx, acc, logger, last + 1, tokens, sched, final=True)
    return _LoopResult(steps=last + 1 - first_step, last_step=last, tokens=tokens, new_tokens=tokens - tokens0,
                       train_wall_s=time.perf_counter() - t0, stopped_early=stopped)


def _vote_stop(ctx: RankContext, world: int) -> bool:
    """True on every drafter when any drafter (or the launcher, via the store) asked to stop."""
    local = ctx.stop.is_set()
    if world == 1:
        return local
    flag = torch.tensor([1 if local else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.drafters_ctl)
    return bool(flag.item())  # CPU tensor: no device sync


def _log(ctx: RankContext, acc: MetricAccumulator, logger: "_Logger | None", step: int, tokens: int, sched,
         final: bool = False) -> None:
    """Reduce the metric sums over the drafters (one collective per log interval) and log on drafter 0.

    Only the (sum, count) entries are reduced (`MetricAccumulator.all_reduce`). Raises
    NonFiniteError (on every drafter alike) after cfg.max_consecutive_skips skipped steps in a row.
    """
    if ctx.layout.num_drafters > 1:
        acc.all_reduce(ctx.drafters)
    summary = acc.summary()  # host sync: one device→host copy per log interval
    if logger is not None:
        logger.write(step, tokens, summary, sched.get_last_lr()[0], final)
    if summary.get("consecutive_skips", 0) >= ctx.cfg.max_consecutive_skips:
        raise NonFiniteError(f"{summary['consecutive_skips']} consecutive steps had a non-finite loss or gradient "
                             f"norm (max_consecutive_skips={ctx.cfg.max_consecutive_skips}); lower lr or check the data")


def _finish_drafter(ctx: RankContext, drafter: DFlashDrafter, result: _LoopResult, logger: "_Logger | None",
                    training_state: Callable[[int, int], dict[str, Any]]) -> None:
    """Check the replicas agree, then (drafter 0) write checkpoint-final, or checkpoint-{step} with
    the full training state after a stop request so that the same command resumes."""
    ctx.watchdog.beat("checking the drafter replicas")
    diff = replica_max_abs_diff(drafter, ctx.drafters, ctx.layout.num_drafters)
    ctx.board.publish(f"final/{ctx.me.rank}", ctx.telemetry.snapshot())
    if logger is not None:
        step = result.last_step + 1
        name = f"checkpoint-{step}" if result.stopped_early else "checkpoint-final"
        ckpt = None
        if result.stopped_early or ctx.options.save_final:
            ctx.watchdog.beat(f"writing {name}")
            ckpt = logger.save(drafter, step, name, training_state(step, result.tokens))
            prune(Path(ctx.cfg.out), ctx.cfg.keep_last)
        ctx.extra["write_summary"] = lambda: logger.summary(result, ckpt, diff)


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
                 progress: dict[str, Any]):
        self.ctx, self.info, self.dc, self.total = ctx, info, dc, total
        out = Path(ctx.cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        # this run writes its own summary at the end; an older one must not make a crashed
        # continuation (say, with a larger max_steps) look finished to the next re-run
        (out / "summary.json").unlink(missing_ok=True)
        dump_config(ctx.cfg, out / "train_config.json")
        (out / "provenance.json").write_text(json.dumps(provenance(), indent=2) + "\n")
        (out / "layout.json").write_text(ctx.layout.to_json() + "\n")
        self.log = MetricsLog(out / "metrics.jsonl", resume_from_step=progress["step"])
        self.console = Console()
        self.t_start = time.perf_counter()
        self.t_log, self.tok_log = self.t_start, progress["tokens"]
        self.prev: dict[int, dict] = {}
        self.losses: list[float] = list(progress["losses"])
        self.skipped = int(progress["skipped_steps"])
        self.console.print(f"drafter: {dc.num_hidden_layers} layers, B={dc.block_size}, target {info['target']}, "
                           f"{info['num_rows']} rows × {ctx.cfg.seq_len} tokens, {total} steps, "
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

    def write(self, step: int, tokens: int, summary: dict, lr: float, final: bool) -> None:
        now = time.perf_counter()
        rate = (tokens - self.tok_log) / max(now - self.t_log, 1e-9)
        self.t_log, self.tok_log = now, tokens
        ranks = self.rank_rates()
        self.skipped += summary.get("skipped_steps", 0)
        record = {"step": step, "loss": summary["loss"], "tokens": tokens, "tok_per_s": rate,
                  "skipped_steps": summary.get("skipped_steps", 0),
                  "acc_per_position": summary["acc_per_position"], "tau_estimate": summary["tau_estimate"],
                  "tau_exact": summary["tau_exact"], "lr": lr, "elapsed_s": now - self.t_start, "ranks": ranks}
        self.log.write(record)
        if summary["loss"] is not None:
            self.losses.append(summary["loss"])
        loss = "-" if summary["loss"] is None else f"{summary['loss']:.3f}"
        self.console.print(f"step {step}/{self.total} loss {loss} {rate:,.0f} tok/s | {format_line(ranks)}",
                           highlight=False)

    def save(self, drafter: DFlashDrafter, step: int, name: str, training_state: dict[str, Any]) -> Path:
        cfg = self.ctx.cfg
        meta = checkpoint_metadata(cfg, step, self.info["target"], self.info["mask_token_reason"],
                                   self.info["chat_template"])
        return save_checkpoint(Path(cfg.out) / name, drafter.trainable_state_dict(), self.dc, meta, training_state)

    def summary(self, result: _LoopResult, ckpt: Path | None, replica_diff: float) -> dict:
        self.log.close()
        ctx = self.ctx
        finals = {s.rank: ctx.board.read(f"final/{s.rank}") for s in ctx.layout.ranks}
        probes = {s.rank: ctx.board.read(f"probe/{s.rank}") for s in ctx.layout.targets}
        body = {"steps": result.last_step + 1, "steps_this_run": result.steps, "tokens": result.tokens, "wall_s": time.perf_counter() - self.t_start,
                "train_tok_per_s": result.new_tokens / max(result.train_wall_s, 1e-9),
                "first_loss": self.losses[0] if self.losses else None, "last_loss": self.losses[-1] if self.losses else None,
                "validation": {}, "checkpoint": str(ckpt) if ckpt else None, "stopped_early": result.stopped_early,
                "skipped_steps": self.skipped,
                "drafter_replica_max_abs_diff": replica_diff, "layout": ctx.layout.as_dict(),
                "ranks_final": [rates(None, f) for f in finals.values() if f is not None],
                "target_probe": {str(k): v for k, v in probes.items() if v is not None}}
        (Path(ctx.cfg.out) / "summary.json").write_text(json.dumps(body, indent=2) + "\n")
        write_report_safely(ctx.cfg.out, lambda msg: self.console.print(f"[yellow]warning:[/] {msg}"))  # OUT/report.png
        return body
