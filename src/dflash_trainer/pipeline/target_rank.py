"""Target ranks: run the frozen target over their micro-batches and send features to the drafters."""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import nullcontext

import torch
import torch.distributed as dist

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.training.feature_cache import FeatureCache
from dflash_trainer.training.feed import extract, fetch_rows, rows_to
from dflash_trainer.training.schedule import RowSchedule
from dflash_trainer.training import precision
from dflash_trainer.pipeline.rank_context import RankContext, resume_step, wire_spec
from dflash_trainer.training.run import load_drafter_config, step_settings
from dflash_trainer.training.step import StepSettings
from dflash_trainer.pipeline.wire import TransferBatch, WireSpec, pack_ids
from dflash_trainer.pipeline.p2p import TargetOutbox


def target_role(ctx: RankContext) -> None:
    """Load the target, publish the run info (target 0), then serve this rank's micro-batches."""
    from dflash_trainer.data.loader import check_mask_token_unused, load_split
    from dflash_trainer.interop.load_drafter import load_drafter
    from dflash_trainer.target_model.features import TargetFeatureExtractor

    cfg, layout, device, wd = ctx.cfg, ctx.layout, ctx.device, ctx.watchdog
    dtype = precision.compute_dtype(device)
    wd.beat("loading the target")
    target = ctx.source.load_full(device, dtype)
    wd.beat("opening the prepared rows")
    rows_ds = load_split(cfg.data.prepared, "train")
    seq_len = len(rows_ds[0]["input_ids"])
    if seq_len != cfg.data.seq_len:
        raise ValueError(f"seq_len={cfg.data.seq_len} but {cfg.data.prepared} holds rows of {seq_len} tokens")
    if ctx.me.role_index == 0:
        wd.beat("publishing the run info")
        init = load_drafter(cfg.drafter.init_from, num_target_layers=target.num_layers) if cfg.drafter.init_from else None
        dc, mask_reason = load_drafter_config(cfg, target, init)
        check_mask_token_unused(rows_ds, dc.mask_token_id)
        head_w = target.lm_head.weight
        info = {"drafter_config": dc.model_dump(), "mask_token_reason": mask_reason, "target": target.name_or_path,
                "chat_template": target.chat_template, "num_target_layers": target.num_layers,
                "hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "num_rows": len(rows_ds),
                "tied": head_w.data_ptr() == target.embed_tokens.weight.data_ptr()}
        ctx.board.publish("run_info", info)
        if ctx.source.shares_head:
            wd.beat("sending the embedding and LM head")
            for d in layout.drafters:
                dist.send(target.embed_tokens.weight.detach().contiguous(), dst=d.rank)
                if not info["tied"]:
                    dist.send(head_w.detach().contiguous(), dst=d.rank)
    else:
        info = ctx.board.wait_for("run_info", ctx.timeout_s)
        dc = DrafterConfig(**info["drafter_config"])
    extractor = TargetFeatureExtractor.from_config(target, dc.target_layer_ids, cfg)
    spec = wire_spec(cfg, layout, dc, target.hidden_size, dtype)
    settings = step_settings(cfg, dc, device)
    schedule = RowSchedule(len(rows_ds), cfg.optim.rows_per_step, layout.num_drafters, cfg.runtime.seed, cfg.experimental.anchor_draws_per_row)
    total = schedule.batch_steps(schedule.total_steps(cfg.optim.max_steps, cfg.optim.epochs))  # batch steps
    feeds = layout.feeds()[ctx.me.rank]
    outbox = TargetOutbox(spec, drafter_rank_of=layout.drafter_rank_of, data_group=None, ctl_group=ctx.ctl,
                          timeout_s=ctx.timeout_s, telemetry=ctx.telemetry, max_inflight=layout.queue_depth * len(feeds))
    wd.beat("waiting for the resume step from drafter 0")
    resumed = resume_step(ctx)  # optimizer step; its batch step is resumed // anchor_draws_per_row
    first_step = total if resumed >= schedule.total_steps(cfg.optim.max_steps, cfg.optim.epochs) else resumed // cfg.experimental.anchor_draws_per_row
    units = layout.units_of_target(ctx.me.role_index, first_step, total)
    first = layout.first_unit_of_target(ctx.me.role_index, first_step, total)
    wd.beat("target ready")
    if ctx.options.probe_target_iters and first is not None:
        _probe_target(ctx, extractor, rows_ds, schedule, first, settings)
    cache = FeatureCache.for_run(cfg, len(rows_ds))
    with cache.explain_oom() if cache is not None else nullcontext():
        target_loop(ctx, extractor, rows_ds, schedule, spec, settings, outbox, units, cache)


def target_loop(ctx: RankContext, extractor, rows_ds, schedule: RowSchedule, spec: WireSpec,
                settings: StepSettings, outbox, units: Iterable[int], cache: FeatureCache | None = None) -> None:
    """For each micro-batch of `units` in order: credit → rows → forward → send. `outbox`: the
    p2p.TargetOutbox. cache: serves the rows this rank stored in an earlier epoch (a row goes to
    whichever target rank its micro-batch falls to, so with n target ranks a rank holds the rows it
    saw; each rank's budget is `feature_cache_gib`)."""
    tel, wd, device = ctx.telemetry, ctx.watchdog, ctx.device
    T = spec.seq_len
    for u in units:
        wd.beat(f"waiting for the credit of micro-batch {u}")
        if not outbox.wait_credit(u):
            break
        wd.beat(f"computing micro-batch {u}")
        epoch, row_index = schedule.rows_of(u)
        rows = rows_to(fetch_rows(rows_ds, row_index, T), device)
        valid = int((row_index >= 0).sum())
        tel.busy.start()
        if valid:
            forward = lambda r: extract(extractor, r, settings)  # noqa: E731
            out = forward(rows) if cache is None else cache.outputs(row_index, rows, forward)
            features, argmax, last_hidden = out.features, out.argmax, out.last_hidden
        else:  # the whole micro-batch is padding: zeros, no forward
            features = torch.zeros(spec.rows, T, spec.feature_width, dtype=spec.feature_dtype, device=device)
            argmax = torch.zeros(spec.rows, T, dtype=torch.long, device=device) if spec.need_argmax else None
            last_hidden = (torch.zeros(spec.rows, T, spec.hidden_size, dtype=spec.feature_dtype, device=device)
                           if spec.need_last_hidden else None)
        batch = TransferBatch(unit=u, step=u // ctx.layout.num_drafters, epoch=epoch,
                              row_index=torch.from_numpy(row_index), ids=pack_ids(rows, argmax, spec),
                              features=features.contiguous(), last_hidden=last_hidden, zero_features=not valid)
        tel.busy.stop()
        outbox.send(batch)
        tel.add_occupancy(outbox.inflight())
        tel.finish_item(valid * T)
    wd.beat("finishing the last sends")
    outbox.close()
    final = tel.snapshot()
    if cache is not None:
        final = {**final, "feature_cache": cache.summary()}
    ctx.board.publish(f"final/{ctx.me.rank}", final)


def _probe_target(ctx: RankContext, extractor, rows_ds, schedule: RowSchedule, unit: int, settings: StepSettings) -> None:
    """Standalone target speed on this rank's first micro-batch (CUDA events, after 2 warm-ups)."""
    _, row_index = schedule.rows_of(unit)
    rows = rows_to(fetch_rows(rows_ds, row_index, ctx.cfg.data.seq_len), ctx.device)
    times = []
    for i in range(2 + ctx.options.probe_target_iters):
        ctx.watchdog.beat("probing the standalone target speed")
        if ctx.device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            extract(extractor, rows, settings)
            e.record()
            e.synchronize()  # host sync: probe only, before the loop
            ms = s.elapsed_time(e)
        else:
            t0 = time.perf_counter()
            extract(extractor, rows, settings)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 2:
            times.append(ms)
    times.sort()
    med = times[len(times) // 2]
    tokens = int((row_index >= 0).sum()) * ctx.cfg.data.seq_len
    ctx.board.publish(f"probe/{ctx.me.rank}", {"forward_ms_median": med, "tok_per_s": tokens / (med / 1e3),
                                               "forward_ms_all": times})
