"""`dflash-train train`, co-located: target and drafter in one process on one device.

The setup of the 1 × 1 layout (config → prepared rows (training/run_data.py) → target (frozen) →
drafter → optimizer → resume), then the loop every layout runs (training/loop.py) fed by the
in-process target (`FeedSource`), then checkpoint-final, validation and the summary. Also the run
helpers the other layouts share: `resolve_device`, `load_drafter_config`, `step_settings`,
`find_resume`, `refuse_unresumable`, `save_run_checkpoint`, `build_training`, `start_run_records`.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console

from dflash_trainer.config.schema import TrainConfig, check_saved_format, flat_config, resolve_key, saved_config
from dflash_trainer.config.sections import check_flex_tiles
from dflash_trainer.config.load import dump_config
from dflash_trainer.data.loader import check_mask_token_unused
from dflash_trainer.drafter.config import DrafterConfig, default_gamma
from dflash_trainer.drafter.metrics import MetricAccumulator
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.shape import check_fits_target, drafter_config_from_target
from dflash_trainer.interop.formats import is_checkpoint
from dflash_trainer.interop.load_drafter import load_drafter
from dflash_trainer.preflight.checks import NO_CUDA
from dflash_trainer.target_model.features import TargetFeatureExtractor
from dflash_trainer.target_model.head_transforms import target_head
from dflash_trainer.target_model.load import TargetBundle, load_target, load_tokenizer
from dflash_trainer.target_model.paths import recorded_target
from dflash_trainer.telemetry.progress import make_progress
from dflash_trainer.telemetry.provenance import provenance
from dflash_trainer.telemetry.report import write_report_safely
from dflash_trainer.telemetry.tensorboard_log import write_validation
from dflash_trainer.training import precision
from dflash_trainer.interop.checkpoint_files import save_checkpoint
from dflash_trainer.training.checkpoint import (Progress, check_resumable, load_latest, load_step_checkpoint, peek_step_checkpoint, prune, restore_training, training_state)
from dflash_trainer.training.run_clock import RunClock
from dflash_trainer.drafter.build import build_drafter
from dflash_trainer.training.feature_cache import FeatureCache
from dflash_trainer.training.feed import TargetFeed, extract
from dflash_trainer.drafter.fp8 import check_fp8
from dflash_trainer.training.finished import RunResult, finished_message, finished_run, peak_memory
from dflash_trainer.training.schedule import RowSchedule
from dflash_trainer.training.loop import FeedSource, LoopParts, run_loop
from dflash_trainer.training.optim import build_optimizer, build_scheduler
from dflash_trainer.training.run_log import RunLog
from dflash_trainer.training.run_data import prepared_rows
from dflash_trainer.training.run_profile import RunProfiler
from dflash_trainer.training.signals import StopRequest
from dflash_trainer.training.step import StepSettings, default_mask_kind
from dflash_trainer.training.tau_probe import build_tau_probe, load_tau_prompts
from dflash_trainer.training.validate import coverage, validate_rows


def resolve_device(name: str) -> torch.device:
    """'auto' → cuda when available else cpu; 'cuda' without a GPU raises ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(NO_CUDA)
    return torch.device(name)


def load_drafter_config(cfg: TrainConfig, target: TargetBundle, init: tuple | None = None) -> tuple[DrafterConfig, str]:
    """(drafter config, reason for its mask token) of this run: the warm-start folder's (`init`,
    from `load_drafter`), the `drafter_config` file's, or one derived from the target with the
    config's drafter fields. Raises ValueError when they conflict with the target or each other."""
    source = "init_from" if init is not None else "drafter_config"
    if init is not None:  # warm start: the folder's own architecture (load_drafter output)
        if cfg.drafter.drafter_config:
            raise ValueError(f"init_from={cfg.drafter.init_from} and drafter_config={cfg.drafter.drafter_config} are both set; the "
                             "drafter config comes from the init_from folder, drop drafter_config")
        dc, reason = init[0], f"from {cfg.drafter.init_from}: {init[2].get('mask_token_reason')}"
    elif cfg.drafter.drafter_config:
        body = json.loads(Path(cfg.drafter.drafter_config).read_text())
        meta = body.pop("dflash", None) or {}
        dc = DrafterConfig(**body)
        reason = meta.get("mask_token_reason") or f"from {cfg.drafter.drafter_config}"
    else:
        dc, info = drafter_config_from_target(target.config, target.tokenizer, cfg.drafter,
                                              chat_template=target.chat_template, head=target_head(target.model))
        reason = info["mask_token_reason"]
    check_fits_target(dc, target, source, "regenerate it with init-config")
    return dc, reason


def train(cfg: TrainConfig, console: Console | None = None, *, target: TargetBundle | None = None,
          save_final: bool = True) -> RunResult:
    """Run co-located training as configured; returns the run summary.

    Resumes from the newest readable checkpoint in OUT (or `resume`) when there is one. SIGTERM /
    SIGINT stop at the next step boundary with a checkpoint (a second SIGINT exits at once).
    On CUDA the target forward of the next batch overlaps the drafter step (`overlap_target`,
    training/feed.py). target: an already-loaded target (benchmarks with random weights; None =
    load `cfg.target.path`). save_final=False skips checkpoint-final and validation (benchmarks).
    Raises ValueError on bad input (config, data, checkpoint from another config) and
    NonFiniteError after `max_consecutive_skips` consecutive non-finite steps.
    """
    console = console or Console()
    done = finished_run(cfg)
    if done is not None:
        console.print(finished_message(cfg, done), highlight=False)
        return done
    clock = RunClock()
    device = resolve_device(cfg.runtime.device)
    check_fp8(cfg.experimental.fp8, device)  # before OUT is touched, the data prepared or the target loaded
    out = Path(cfg.out)
    refuse_unresumable(cfg, "colocated")  # before OUT's records change: a refused resume leaves them as they were
    start_run_records(cfg, out)
    resume = find_resume(cfg, out, lambda msg: console.print(f"[yellow]warning:[/] {msg}"))
    torch.manual_seed(cfg.runtime.seed)

    console.print(f"[bold]dflash-train[/] device={device} out={out}")
    hint = precision.set_cpu_threads(cfg.runtime.threads, device, "--set runtime.threads=1")
    if hint:
        console.print(f"note: {hint}", highlight=False)
    # the data is prepared and checked with the tokenizer alone, before the model loads: bad data fails in seconds
    tokenizer = (lambda: target.tokenizer) if target is not None else (lambda: load_tokenizer(cfg.target.path))
    tau_prompts = load_tau_prompts(cfg)  # None unless tau_every; bad tau_dataset fails before anything loads
    train_rows, val_rows = prepared_rows(cfg, tokenizer, out, console)
    if target is None:
        target = load_target(cfg.target.path, device=device, dtype=precision.compute_dtype(device))
    console.print(f"target: {target.name_or_path} ({target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size})")

    init = load_drafter(cfg.drafter.init_from, num_target_layers=target.num_layers) if cfg.drafter.init_from else None
    dc, mask_reason = load_drafter_config(cfg, target, init)
    console.print(f"drafter: {dc.num_hidden_layers} layers, B={dc.block_size}, target_layer_ids={dc.target_layer_ids}, "
                  f"mask token {dc.mask_token_id} ({mask_reason})")
    check_mask_token_unused(train_rows, dc.mask_token_id)
    extractor = TargetFeatureExtractor.from_config(target, dc.target_layer_ids, cfg)
    path = extractor.implementation_for(cfg.data.seq_len)
    console.print(f"target attention: {path} (target_attention={cfg.target.target_attention}), "
                  f"{'compiled' if extractor.compiles(path) else 'eager'} layers (target_compile={cfg.target.target_compile})")
    console.print(f"target forward: {extractor.support.forward_line()}", highlight=False)
    drafter = build_drafter(cfg, dc, (target.embed_tokens.weight, target.lm_head.weight), device,
                            init[1] if init is not None else None, log=lambda msg: console.print(msg, highlight=False))
    if init is not None:
        template = run_chat_template(cfg, target.chat_template)
        if init[2].get("chat_template") and init[2]["chat_template"] != template:
            console.print(f"[yellow]warning:[/] {cfg.drafter.init_from} was trained with another chat template than this run's")
    params = [p for p in drafter.parameters() if p.requires_grad]
    # The 1 × 1 case of the process layout: the same row schedule, optimizer and loop.
    setup = build_training(cfg, dc, params, len(train_rows), 1, device)
    schedule, total_steps, opt, sched, settings, acc = (setup.schedule, setup.total_steps, setup.opt, setup.sched,
                                                        setup.settings, setup.acc)
    prog = Progress()
    if resume is not None:
        folder, state, weights = resume
        check_resumable(state, saved_config(cfg), folder, "colocated")  # what was loaded (refuse_unresumable peeked)
        prog = restore_training(state, weights, drafter, opt, sched, acc)
        del state, weights  # not kept for the whole run
        console.print(f"resumed from {folder} at step {prog.step}")
    console.print(f"training: {len(train_rows)} rows × {cfg.data.seq_len} tokens, {total_steps} steps, "
                  f"{cfg.loss.num_anchors} anchors/row, {sum(p.numel() for p in params) / 1e6:.1f}M trainable parameters")
    for line in schedule.small_data_warnings(total_steps, len(val_rows)):
        console.print(f"[yellow]warning:[/] {line}", highlight=False)
    if cfg.target.feature_cache_gib > 0:
        console.print(f"feature cache: up to {cfg.target.feature_cache_gib:g} GiB of target outputs on {device}; later epochs "
                      f"skip the target forward for the rows it holds"
                      f"{' (labels only: features are zeroed)' if cfg.experimental.no_target_features else ''}", highlight=False)
    probe = None
    if tau_prompts is not None:  # built once, after resume (it may copy the weights), reused by every measurement
        probe = build_tau_probe(cfg, target, drafter, tau_prompts, run_chat_template(cfg, target.chat_template))
        console.print(f"measured τ: every {cfg.tau.tau_every} steps and at the end, {len(tau_prompts)} prompts of "
                      f"{cfg.tau.tau_dataset} (first turns, ≤ {cfg.tau.tau_max_new_tokens} new tokens) as one batch"
                      f"{', CUDA graph' if probe.uses_cuda_graph else ''}", highlight=False)

    def save(step: int, name: str) -> Path:
        clock.stamp(prog, probe.total_wall_s if probe else 0.0)
        state = training_state({"layout": "colocated"}, prog, opt, sched, acc.state(), saved_config(cfg))
        path = save_run_checkpoint(out / name, drafter, dc, cfg, step, target.name_or_path, mask_reason,
                                   target.chat_template, state)
        prune(out, cfg.runtime.keep_last)
        return path

    cache = FeatureCache.for_run(cfg, len(train_rows))
    feed = TargetFeed(lambda rows: extract(extractor, rows, settings), device, overlap=cfg.target.overlap_target, cache=cache)
    source = FeedSource(train_rows, schedule, feed, cfg.data.seq_len, schedule.batch_steps(total_steps))
    stop = StopRequest()
    clock.start_training(prog)
    drafter.train()
    with stop.installed(), make_progress(console) as bar:
        task = bar.add_task("train", total=total_steps, completed=prog.step, tok_per_s="-", loss="-", tau="-")
        run_log = RunLog(out, prog, schedule, total_steps, console, bar=bar, task=task)
        parts = LoopParts(model=drafter, params=params, opt=opt, sched=sched, settings=settings, acc=acc, source=source,
                          schedule=schedule, seed=cfg.runtime.seed, seq_len=cfg.data.seq_len, grad_clip=cfg.optim.grad_clip,
                          log_every=cfg.runtime.log_every, save_every=cfg.runtime.save_every,
                          max_consecutive_skips=cfg.runtime.max_consecutive_skips, stop=lambda: bool(stop.requested),
                          log=run_log.write, save=save, after_step=lambda step: bar.update(task, completed=step),
                          measure_tau=probe and (lambda step: run_log.write_tau(probe.measure(step))),
                          tau_every=cfg.tau.tau_every, profiler=run_profiler(cfg, out, device, console))
        with cache.explain_oom() if cache is not None else nullcontext():
            loop = run_loop(parts, prog, total_steps)
        if loop.stopped_early:
            save(prog.step, f"checkpoint-{prog.step}")
    run_log.close()
    if cache is not None:
        console.print(cache_line(cache, len(train_rows)), highlight=False)
    train_wall = time.perf_counter() - clock.t_train - (probe.total_wall_s if probe else 0.0)  # training alone
    if loop.stopped_early:
        console.print(f"[yellow]stopped by {stop.requested}[/] at step {prog.step}; checkpoint-{prog.step} written, "
                      f"resume with the same command")
        ckpt, validation = out / f"checkpoint-{prog.step}", {}
    elif not save_final:
        ckpt, validation = None, {}
    else:
        ckpt = save(prog.step, "checkpoint-final")
        validation = validate_rows(drafter, extractor, val_rows, settings, device, cfg.runtime.seed, console,
                                   max_rows=cfg.data.validation_max_rows, max_seconds=cfg.data.validation_max_seconds)
        if validation:
            try:
                write_validation(out, prog.step, validation)
            except ImportError:  # no tensorboard: MetricsLog warned already
                pass
            hint = "" if validation["cut_by"] is None else f"; --set {validation['cut_by']}=null for all rows"
            console.print(f"validation: {coverage(validation)} in {validation['seconds']:.0f} s{hint}", highlight=False)
    result = RunResult(**clock.totals(prog, train_wall),
                       first_loss=prog.losses[0] if prog.losses else None,
                       last_loss=prog.losses[-1] if prog.losses else None, validation=validation,
                       checkpoint=str(ckpt) if ckpt else None, skipped_steps=prog.skipped_steps,
                       interrupted=stop.requested if loop.stopped_early else None,
                       tau_measured=probe.last.tau if probe and probe.last else None,
                       tau_measured_step=probe.last.step if probe and probe.last else None,
                       feature_cache=cache.summary() if cache is not None else None,
                       peak_memory_gib=peak_memory(device))
    (out / "summary.json").write_text(json.dumps(result.record(out), indent=2) + "\n")
    write_report_safely(out, lambda msg: console.print(f"[yellow]warning:[/] {msg}"))  # OUT/report.png
    return result


@dataclass
class TrainingSetup:
    """What a drafter trains with, built alike in every layout by `build_training`."""

    schedule: RowSchedule
    total_steps: int  # optimizer steps
    opt: torch.optim.Optimizer
    sched: Any  # learning-rate schedule (optim.build_scheduler)
    settings: StepSettings
    acc: MetricAccumulator


def build_training(cfg: TrainConfig, dc: DrafterConfig, params: list[torch.nn.Parameter], num_rows: int,
                   num_drafters: int, device: torch.device) -> TrainingSetup:
    """The row schedule of `num_rows` training rows over `num_drafters` drafters (max_steps, when set,
    decides alone; otherwise `epochs` full passes of anchor_draws_per_row steps per batch), AdamW over
    `params` with its warmup + cosine schedule over those steps, the step settings and the metric sums.
    Raises ValueError when rows_per_step does not split over the drafters (RowSchedule)."""
    schedule = RowSchedule(num_rows, cfg.optim.rows_per_step, num_drafters, cfg.runtime.seed, cfg.experimental.anchor_draws_per_row)
    total = schedule.total_steps(cfg.optim.max_steps, cfg.optim.epochs)
    opt = build_optimizer(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, compiled=cfg.runtime.compile)
    sched = build_scheduler(opt, total_steps=total, warmup_ratio=cfg.optim.warmup_ratio, min_lr_ratio=cfg.optim.min_lr_ratio)
    return TrainingSetup(schedule, total, opt, sched, step_settings(cfg, dc, device),
                         MetricAccumulator(dc.block_size, device))


def run_profiler(cfg: TrainConfig, out: Path, device: torch.device, console: Console) -> RunProfiler | None:
    """The co-located run's one-time step profile (`profile_at_step`), or None when off."""
    if cfg.experimental.profile_at_step is None:
        return None
    overlap = cfg.target.overlap_target and device.type == "cuda"
    what = ("co-located training step (the target forward of the next batch on its own stream)" if overlap else
            "co-located training step (target forward, then the drafter step)")
    return RunProfiler(cfg.experimental.profile_at_step, cfg.experimental.profile_steps, out, device,
                       lambda text: console.print(text, highlight=False, markup=False), what)


def start_run_records(cfg: TrainConfig, out: Path) -> None:
    """Begin OUT's records of a run that will train: drop an older summary.json (it must not make a
    crashed continuation, say with a larger max_steps, look finished to the next re-run), write the
    resolved config (train_config.json) and provenance.json."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    dump_config(cfg, out / "train_config.json")
    (out / "provenance.json").write_text(json.dumps(provenance(), indent=2) + "\n")


def step_settings(cfg: TrainConfig, dc: DrafterConfig, device: torch.device) -> StepSettings:
    """The per-step objective settings of a run (anchors, γ, labels, loss and weights, feature dropout,
    mask path) from its config."""
    if default_mask_kind(device) == "flex":  # the CUDA flex masks tile the drafter's queries
        check_flex_tiles(cfg.loss.num_anchors, dc.block_size)
    return StepSettings(num_anchors=cfg.loss.num_anchors, gamma=cfg.loss.gamma or default_gamma(dc.block_size),
                        label_source=cfg.loss.label_source, loss=cfg.loss.kind, per_document_quota=cfg.experimental.per_document_quota,
                        mask_kind=default_mask_kind(device), loss_chunk=cfg.experimental.loss_chunk,
                        compiled_loss=device.type == "cuda" and cfg.runtime.compile, zero_features=cfg.experimental.no_target_features,
                        position_weights=cfg.loss.position_weights, dpace_alpha=cfg.experimental.dpace_alpha,
                        dpace_denominator=cfg.experimental.dpace_denominator, loss_ce_weight=cfg.loss.loss_ce_weight,
                        loss_kl_weight=cfg.loss.loss_kl_weight, feature_dropout=cfg.experimental.feature_dropout,
                        feature_dropout_unit=cfg.experimental.feature_dropout_unit, loss_impl=cfg.experimental.loss_impl,
                        rejection_weight=cfg.experimental.rejection_weight)


def find_resume(cfg: TrainConfig, out: Path, warn: Callable[[str], None],
                load: Callable[[Path], Any] = load_step_checkpoint):
    """The checkpoint to resume from: (folder, training_state, weights) of the `resume` checkpoint
    folder itself, of the newest readable one in the `resume` run folder, of OUT's newest readable
    one (auto), or None (never / none found under auto). Unreadable checkpoints of a run folder are
    reported through `warn` and skipped. Raises ValueError when an explicit `resume` folder does not
    exist or holds no readable checkpoint. load: what is read of the folder chosen
    (`peek_step_checkpoint`: (folder, training_state) without reading tensors)."""
    if cfg.runtime.resume == "never":
        return None
    where = out if cfg.runtime.resume == "auto" else Path(cfg.runtime.resume)
    if cfg.runtime.resume != "auto" and not where.is_dir():
        raise ValueError(f"resume={cfg.runtime.resume}: no such folder; give a run directory holding checkpoint-* folders")
    if is_checkpoint(where, resumable=True):  # a checkpoint folder itself: exactly that one
        try:
            return load(where)
        except Exception as e:  # noqa: BLE001 - any corruption: say which file
            raise ValueError(f"resume={cfg.runtime.resume}: checkpoint unreadable ({type(e).__name__}: {str(e)[:160]}); "
                             "give another checkpoint or the run folder") from None
    found = load_latest(where, warn, load)
    if found is None and cfg.runtime.resume != "auto":
        raise ValueError(f"resume={cfg.runtime.resume}: no readable checkpoint with training state in {where}")
    return found


def refuse_unresumable(cfg: TrainConfig, layout: str, num_drafters: int | None = None, *,
                       undecided: tuple[str, ...] = ()) -> None:
    """Raise the ValueError `check_resumable` gives (another config, layout or drafter count) for the
    checkpoint this run would resume from (`find_resume`), before the run writes or removes anything
    in OUT (train_config.json, summary.json, provenance.json, prepared rows): a refused resume leaves
    the run's records as they were. Reads only that checkpoint's training state, its tensors
    memory-mapped (`peek_step_checkpoint`); the weights load later, where the loaded state is checked
    again. undecided: fields this start has not resolved yet (an automatic split's rows_per_step),
    compared as the checkpoint has them."""
    found = find_resume(cfg, Path(cfg.out), lambda _msg: None, load=peek_step_checkpoint)
    if found is None:
        return
    folder, state = found
    saved = state.get("config", {})
    check_saved_format(saved, folder)
    flat = flat_config(saved)
    current = saved_config(cfg.updated({k: flat[name] for k in undecided if (name := resolve_key(k)) in flat}))
    check_resumable(state, current, folder, layout, num_drafters)


def cache_line(cache: FeatureCache, num_rows: int) -> str:
    """One log line: how much of the data the feature cache held and how many target rows it saved."""
    c = cache.summary()
    served, computed = c["rows_served"], c["rows_computed"]
    return (f"feature cache: {c['stored_rows']} of {num_rows} rows stored ({c['allocated_gib']:.1f} of "
            f"{c['budget_gib']:.1f} GiB); {served} of {served + computed} batch rows served from it, "
            f"{computed} target row forwards")


def run_chat_template(cfg: TrainConfig, target_chat_template: str | None) -> str | None:
    """The chat template a run trains with: the `chat_template` file if set, else the target's."""
    text = cfg.data.chat_template_text()
    return target_chat_template if text is None else text


def checkpoint_metadata(cfg: TrainConfig, step: int, target_name: str, mask_reason: str,
                        target_chat_template: str | None) -> dict[str, Any]:
    """The `dflash` metadata of a checkpoint: what eval and export need to use the drafter as it was
    trained (the chat template actually used, `run_chat_template`); the target by its name when it is
    the embedded or a packaged one, else as the user gave it (`recorded_target`)."""
    template = run_chat_template(cfg, target_chat_template)
    return {"step": step, "target": recorded_target(target_name), "mask_token_reason": mask_reason, "chat_template": template,
            "enable_thinking": cfg.data.enable_thinking, "label_source": cfg.loss.label_source, "seq_len": cfg.data.seq_len,
            "no_target_features": cfg.experimental.no_target_features}


def save_run_checkpoint(path: Path, drafter: DFlashDrafter, dc: DrafterConfig, cfg: TrainConfig, step: int,
                        target_name: str, mask_reason: str, target_chat_template: str | None,
                        state: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint folder of this run (weights, config with `checkpoint_metadata`, and the
    resumable `state` when given), in every layout; returns the folder."""
    meta = checkpoint_metadata(cfg, step, target_name, mask_reason, target_chat_template)
    return save_checkpoint(path, drafter.trainable_state_dict(), dc, meta, state)
