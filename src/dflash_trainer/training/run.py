"""`dflash-train train`, co-located: target and drafter in one process on one device.

Flow: config → target (frozen) → prepared rows → drafter → for each step: target features and
labels → drafter step (anchors, blocks, masks, forward, loss sums) → backward → clip → AdamW →
cosine LR; metrics accumulate on the device and cross to the host once per `log_every` steps.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from dflash_trainer.config import TrainConfig, dump_config
from dflash_trainer.data.loader import iterate_rows, load_split
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.sources import default_sharegpt_path
from dflash_trainer.drafter.config import DrafterConfig, default_gamma
from dflash_trainer.drafter.from_target import drafter_config_from_target
from dflash_trainer.drafter.metrics import MetricAccumulator
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.interop.load_drafter import load_drafter
from dflash_trainer.target.features import TargetFeatureExtractor
from dflash_trainer.target.load import TargetBundle, load_target
from dflash_trainer.telemetry.progress import MetricsLog, make_progress
from dflash_trainer.telemetry.provenance import provenance
from dflash_trainer.training.checkpoint import save_checkpoint
from dflash_trainer.training.optim import build_optimizer, build_scheduler
from dflash_trainer.training.step import StepSettings, default_mask_kind, drafter_step


def resolve_device(name: str) -> torch.device:
    """'auto' → cuda when available else cpu; 'cuda' without a GPU raises ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; use --device cpu")
    return torch.device(name)


@dataclass
class RunResult:
    """What a finished run reports (also printed as the summary)."""

    steps: int
    tokens: int
    wall_s: float
    train_tok_per_s: float
    first_loss: float | None
    last_loss: float | None
    validation: dict[str, Any]
    checkpoint: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _load_drafter_config(cfg: TrainConfig, target: TargetBundle, init: tuple | None = None) -> tuple[DrafterConfig, str]:
    source = "init_from" if init is not None else "drafter_config"
    if init is not None:  # warm start: the folder's own architecture (load_drafter output)
        if cfg.drafter_config:
            raise ValueError(f"init_from={cfg.init_from} and drafter_config={cfg.drafter_config} are both set; the "
                             "drafter config comes from the init_from folder, drop drafter_config")
        dc, reason = init[0], f"from {cfg.init_from}: {init[2].get('mask_token_reason')}"
    elif cfg.drafter_config:
        body = json.loads(Path(cfg.drafter_config).read_text())
        body.pop("dflash", None)
        dc = DrafterConfig(**body)
        reason = "from drafter config file"
    else:
        dc, reason = drafter_config_from_target(
            target.config, target.tokenizer, num_layers=cfg.num_layers, block_size=cfg.block_size,
            layer_types=cfg.layer_types, sliding_window=cfg.sliding_window, target_layer_ids=cfg.target_layer_ids,
            num_target_features=cfg.num_target_features, mask_token_id=cfg.mask_token_id, chat_template=target.chat_template)
    if (dc.hidden_size, dc.vocab_size, dc.num_target_layers) != (target.hidden_size, target.vocab_size, target.num_layers):
        raise ValueError(f"{source}: widths (hidden {dc.hidden_size}, vocab {dc.vocab_size}, target layers "
                         f"{dc.num_target_layers}) do not match the target (hidden {target.hidden_size}, vocab "
                         f"{target.vocab_size}, layers {target.num_layers}); regenerate it with init-config")
    return dc, reason


def _rows_to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    pin = device.type == "cuda"
    out = {}
    for k in ("input_ids", "loss_mask", "position_ids"):
        t = batch[k]
        out[k] = (t.pin_memory() if pin else t).to(device, non_blocking=pin)
    return out


def train(cfg: TrainConfig, console: Console | None = None) -> RunResult:
    """Run co-located training as configured; returns the run summary. Raises ValueError on bad input."""
    console = console or Console()
    t_start = time.perf_counter()
    device = resolve_device(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    dump_config(cfg, out / "train_config.json")
    (out / "provenance.json").write_text(json.dumps(provenance(), indent=2) + "\n")
    on_gpu = device.type == "cuda"
    target_dtype = torch.bfloat16 if on_gpu else torch.float32

    console.print(f"[bold]dflash-train[/] device={device} out={out}")
    target = load_target(cfg.target, device=device, dtype=target_dtype)
    console.print(f"target: {target.name_or_path} ({target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size})")

    prepared = Path(cfg.prepared) if cfg.prepared else out / "data"
    if not cfg.prepared:
        data_path = cfg.data or str(default_sharegpt_path())
        chat_template = Path(cfg.chat_template).read_text() if cfg.chat_template else None
        report = prepare_dataset(data_path, target.tokenizer, prepared, seq_len=cfg.seq_len,
                                 max_conversations=cfg.max_conversations, validation_fraction=cfg.validation_fraction,
                                 seed=cfg.seed, chat_template=chat_template, enable_thinking=cfg.enable_thinking)
        console.print(f"data: {_report_line(report)}")
    train_rows = load_split(prepared, "train")
    val_rows = load_split(prepared, "validation")
    seq_len = len(train_rows[0]["input_ids"])
    if seq_len != cfg.seq_len:
        raise ValueError(f"seq_len={cfg.seq_len} but {prepared} holds rows of {seq_len} tokens; set --set seq_len={seq_len}")

    init = load_drafter(cfg.init_from, num_target_layers=target.num_layers) if cfg.init_from else None
    dc, mask_reason = _load_drafter_config(cfg, target, init)
    console.print(f"drafter: {dc.num_hidden_layers} layers, B={dc.block_size}, target_layer_ids={dc.target_layer_ids}, "
                  f"mask token {dc.mask_token_id} ({mask_reason})")
    extractor = TargetFeatureExtractor(target, dc.target_layer_ids)
    drafter = DFlashDrafter(dc, target.embed_tokens, target.lm_head, checkpoint_layers=cfg.checkpoint_policy(),
                            compile_flex=cfg.compile).to(device)
    if init is not None:
        drafter.load_trainable_state_dict(init[1])  # copies into the drafter's device and dtype
        template = Path(cfg.chat_template).read_text() if cfg.chat_template else target.chat_template
        if init[2].get("chat_template") and init[2]["chat_template"] != template:
            console.print(f"[yellow]warning:[/] {cfg.init_from} was trained with another chat template than this run's")
    if on_gpu and cfg.compile:
        drafter.compile_layers()
    params = [p for p in drafter.parameters() if p.requires_grad]
    steps_per_epoch = math.ceil(len(train_rows) / cfg.rows_per_step)
    # max_steps, when set, decides alone (more passes over the rows if needed, anchors resampled
    # each pass); otherwise `epochs` full passes.
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    opt = build_optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = build_scheduler(opt, total_steps=total_steps, warmup_ratio=cfg.warmup_ratio, min_lr_ratio=cfg.min_lr_ratio)
    settings = StepSettings(num_anchors=cfg.num_anchors, gamma=cfg.gamma or default_gamma(dc.block_size),
                            label_source=cfg.label_source, loss=cfg.loss, per_document_quota=cfg.per_document_quota,
                            mask_kind=default_mask_kind(device), loss_chunk=cfg.loss_chunk,
                            compiled_loss=on_gpu and cfg.compile, zero_features=cfg.no_target_features)
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed)
    acc = MetricAccumulator(dc.block_size, device)
    log = MetricsLog(out / "metrics.jsonl")
    console.print(f"training: {len(train_rows)} rows × {seq_len} tokens, {total_steps} steps, "
                  f"{cfg.num_anchors} anchors/row, {sum(p.numel() for p in params) / 1e6:.1f}M trainable parameters")

    tokens = 0
    step = 0
    losses: list[float] = []
    t_train = time.perf_counter()
    t_log, tok_log = t_train, 0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)
    drafter.train()
    with make_progress(console) as progress:
        task = progress.add_task("train", total=total_steps, tok_per_s="-", loss="-", tau="-")
        epoch = 0
        while step < total_steps:
            for batch in iterate_rows(train_rows, cfg.rows_per_step, cfg.seed, epoch):
                if step >= total_steps:
                    break
                rows = _rows_to(batch, device)
                tgt = extract(extractor, rows, settings)
                with autocast:
                    sums = drafter_step(drafter, rows, tgt.features, tgt.argmax, settings, gen, tgt.last_hidden)
                loss = sums.loss_sum / sums.weight_sum.clamp_min(1.0)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                acc.add(sums)
                step += 1
                tokens += rows["input_ids"].numel()
                if step % cfg.log_every == 0 or step == total_steps:
                    summary = acc.summary()  # one device→host copy per log interval
                    now = time.perf_counter()
                    rate = (tokens - tok_log) / max(now - t_log, 1e-9)
                    t_log, tok_log = now, tokens
                    record = {"step": step, "epoch": epoch, "loss": summary["loss"], "tokens": tokens,
                              "tok_per_s": rate, "acc_per_position": summary["acc_per_position"],
                              "tau_estimate": summary["tau_estimate"], "tau_exact": summary["tau_exact"],
                              "lr": sched.get_last_lr()[0], "elapsed_s": now - t_start}
                    log.write(record)
                    if summary["loss"] is not None:
                        losses.append(summary["loss"])
                    progress.update(task, tok_per_s=f"{rate:,.0f}", loss=_fmt(summary["loss"], 3),
                                    tau=_fmt(summary["tau_estimate"], 2))
                progress.update(task, completed=step)
                if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
                    _save(out / f"checkpoint-{step}", drafter, dc, cfg, target, mask_reason, step)
            epoch += 1
    log.close()
    train_wall = time.perf_counter() - t_train
    ckpt = _save(out / "checkpoint-final", drafter, dc, cfg, target, mask_reason, step)
    validation = evaluate_rows(drafter, extractor, val_rows, settings, device, cfg.seed) if len(val_rows) else {}
    result = RunResult(steps=step, tokens=tokens, wall_s=time.perf_counter() - t_start,
                       train_tok_per_s=tokens / max(train_wall, 1e-9), first_loss=losses[0] if losses else None,
                       last_loss=losses[-1] if losses else None, validation=validation, checkpoint=str(ckpt))
    (out / "summary.json").write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    return result


def _fmt(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def extract(extractor: TargetFeatureExtractor, rows: dict[str, torch.Tensor], settings: StepSettings):
    """Target forward for one batch: features, plus argmax labels / final hidden states as the objective needs."""
    return extractor(rows["input_ids"], rows["position_ids"], need_argmax=settings.label_source == "target",
                     need_last_hidden=settings.loss == "kl")


def _save(path: Path, drafter: DFlashDrafter, dc: DrafterConfig, cfg: TrainConfig, target: TargetBundle,
          mask_reason: str, step: int) -> Path:
    meta = {"step": step, "target": target.name_or_path, "mask_token_reason": mask_reason,
            "chat_template": target.chat_template, "enable_thinking": cfg.enable_thinking,
            "label_source": cfg.label_source, "seq_len": cfg.seq_len, "no_target_features": cfg.no_target_features}
    return save_checkpoint(path, drafter.trainable_state_dict(), dc, meta)


@torch.no_grad()
def evaluate_rows(drafter: DFlashDrafter, extractor: TargetFeatureExtractor, rows_ds, settings: StepSettings,
                  device: torch.device, seed: int) -> dict[str, Any]:
    """Loss, per-position accuracy and offline τ (exact and product estimate) on held-out rows."""
    was_training = drafter.training
    drafter.eval()
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1)
    acc = MetricAccumulator(drafter.config.block_size, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    for batch in iterate_rows(rows_ds, 1, seed, 0):
        rows = _rows_to(batch, device)
        tgt = extract(extractor, rows, settings)
        with autocast:
            acc.add(drafter_step(drafter, rows, tgt.features, tgt.argmax, settings, gen, tgt.last_hidden))
    drafter.train(was_training)
    return acc.summary()


def _report_line(report: Any) -> str:
    d = report if isinstance(report, dict) else (report.model_dump() if hasattr(report, "model_dump") else report.__dict__)
    keys = [k for k in ("conversations_kept", "conversations_skipped", "rows_train", "rows_validation", "tokens") if k in d]
    return ", ".join(f"{k}={d[k]}" for k in keys) or json.dumps(d, default=str)[:300]
