"""Measure a run's target and drafter rates in the launcher process, then choose the split.

    auto_split(cfg, source)                 before any rank starts (pipeline/launch.py)
      ├─ devices of --gpus / --procs        auto_split.auto_split_devices
      ├─ measure_rates                      target on the first device, drafter on the last: the
      │                                     run's own code on one micro-batch of its own rows
      ├─ choose_split                       auto_split.py (model, ties, feasibility)
      └─ apply_split                        the config with --target-gpus/--drafter-gpus (or
                                            --target-procs/--drafter-procs) set

What is timed, per device, in context tokens/s (R rows × T tokens per call):
  target   `feed.extract`: forward + the labels the objective needs, as a target rank runs it
  drafter  `loop.train_step`: anchors → masks → forward → loss → backward → clip → AdamW, as one
           drafter runs it (the DDP all-reduce of 2+ drafters is the model's efficiency factor)
Both after `warmup` untimed calls (compilation happens there), with bench.common.times_ms (CUDA
events on a GPU, the host clock on the CPU); each side stops after `max_iters` timed calls or once
`split_probe_s` seconds of timed work are spent (at least one call); the median counts. R is the
smallest micro-batch any feasible split runs (1 row with the default batch); rates per token are
taken to be the same at other R. On the CPU each measurement uses the threads one rank gets
(cores / processes). Models, optimizer and batches are freed afterwards (`memory_left_bytes`
reports what torch still holds); on a GPU the launcher keeps its CUDA context on the two devices
measured until the run ends.

Why in the launcher, before the ranks: the measurement needs no rendezvous and no extra process,
runs the exact code and rows of the run, and its result decides how many processes to start. The
ranks start from a fork server that is a fresh interpreter (pipeline.rank_process_context), so no
CUDA state of the launcher reaches them. The cost is one more target load before training.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dflash_trainer.telemetry.timing import times_ms
from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.interop.formats import is_checkpoint
from dflash_trainer.training import precision
from dflash_trainer.pipeline.auto_split import SplitChoice, apply_split, auto_split_devices, choose_split
from dflash_trainer.training.schedule import RowSchedule
from dflash_trainer.pipeline.target_source import TargetSource


@dataclass(frozen=True)
class MeasuredRates:
    """Standalone rates of one device per role, in context tokens/s, and how they were measured."""

    target_tok_per_s: float
    drafter_tok_per_s: float
    target_ms: list[float]  # each timed call
    drafter_ms: list[float]
    rows: int  # R rows of seq_len tokens per call
    seq_len: int
    target_device: str
    drafter_device: str
    warmup: int
    timing: str  # "cuda events" | "host clock"
    cpu_threads: int | None
    wall_s: float  # the whole measurement: loads, warm-up and timed calls
    memory_left_bytes: int  # still allocated by torch on the measured GPUs after freeing (0 on the CPU)


@dataclass(frozen=True)
class AutoSplit:
    """The outcome of `auto_split`: the measurement, every candidate, and the config to run."""

    devices: list[str]
    measured: MeasuredRates
    choice: SplitChoice
    config: TrainConfig  # the run's config with the chosen split as explicit layout flags
    resume_note: str | None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (OUT/auto_split.json): devices, measured rates, the choice and the layout flags it sets."""
        cfg = self.config
        chosen = {"target_gpus": cfg.layout.target_gpus, "drafter_gpus": cfg.layout.drafter_gpus} if cfg.layout.target_gpus is not None \
            else {"target_procs": cfg.layout.target_procs, "drafter_procs": cfg.layout.drafter_procs}
        return {"devices": self.devices, "measured": asdict(self.measured), **self.choice.as_dict(),
                "chosen_flags": chosen, "resume_note": self.resume_note}

    def table(self) -> str:
        """What a person reads: the rates, every candidate, the choice."""
        m, c = self.measured, self.choice.chosen
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.as_dict()["chosen_flags"].items())
        lines = [f"automatic split of {len(self.devices)} devices ({m.timing}, {m.rows} row(s) × {m.seq_len} tokens per "
                 f"call, median of {len(m.target_ms)} target / {len(m.drafter_ms)} drafter calls after {m.warmup} "
                 "warm-up calls):",
                 f"  target  {m.target_tok_per_s:,.0f} tok/s per device ({statistics.median(m.target_ms):.1f} ms per "
                 f"call on {m.target_device})",
                 f"  drafter {m.drafter_tok_per_s:,.0f} tok/s per device ({statistics.median(m.drafter_ms):.1f} ms per "
                 f"step on {m.drafter_device}); efficiency of 2+ data-parallel drafters {self.choice.ddp_efficiency:g}",
                 self.choice.table()]
        if self.resume_note:
            lines.append(self.resume_note)
        limit = "both roles" if c.limited_by == "both" else f"the {c.limited_by}"
        lines.append(f"chosen: {c.targets} target + {c.drafters} drafter ranks ({flags}), projected "
                     f"{c.projected_tok_per_s:,.0f} tok/s, limited by {limit}")
        return "\n".join(lines)


def auto_split(cfg: TrainConfig, source: TargetSource, *, rows_from: str | None = None,
               log: Callable[[str], None] = print) -> AutoSplit:
    """Measure both rates on this run's rows and choose the split of `--gpus`/`--procs`.

    rows_from: the prepared folder to read rows from (default `cfg.data.prepared`, which must be set).
    Raises ValueError for bad flags (auto_split_devices), GPUs that are not visible, or no feasible
    split (choose_split)."""
    devices = auto_split_devices(cfg)
    if devices[0] != "cpu":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        missing = [d for d in devices if int(d.split(":")[1]) >= visible]
        if missing:
            raise ValueError(f"{', '.join(missing)} requested but only {visible} CUDA devices are visible; fix --gpus "
                             "(or CUDA_VISIBLE_DEVICES)")
    required = resume_drafter_count(cfg)
    fixed = "rows_per_step" in cfg.optim.model_fields_set
    feasible = choose_split(len(devices), 1.0, 1.0, rows_per_step=cfg.optim.rows_per_step, rows_per_step_set=fixed,
                            required_drafters=required).candidates  # its errors come before any model loads
    rows = min(c.rows_per_step // c.drafters for c in feasible if c.infeasible is None)
    threads = max(1, (os.cpu_count() or 1) // len(devices)) if devices[0] == "cpu" else None
    log(f"automatic split: measuring the target on {devices[0]} and the drafter on {devices[-1]} "
        f"({rows} row(s) of {cfg.data.seq_len} tokens)")
    measured = measure_rates(cfg, source, torch.device(devices[0]), torch.device(devices[-1]), rows=rows,
                             rows_from=rows_from or cfg.data.prepared, budget_s=cfg.experimental.split_probe_s, cpu_threads=threads)
    choice = choose_split(len(devices), measured.target_tok_per_s, measured.drafter_tok_per_s,
                          ddp_efficiency=cfg.experimental.split_ddp_efficiency, rows_per_step=cfg.optim.rows_per_step,
                          rows_per_step_set=fixed, required_drafters=required)
    note = (f"resume: {cfg.out if cfg.runtime.resume == 'auto' else cfg.runtime.resume} holds checkpoints of {required} drafter ranks; "
            "only that drafter count can continue them") if required is not None else None
    return AutoSplit(devices, measured, choice, apply_split(cfg, devices, choice.chosen), note)


def resume_drafter_count(cfg: TrainConfig) -> int | None:
    """The drafter count a resumed run must keep (checkpoints seed their anchors by micro-batch):
    that of the run folder holding the checkpoint `resume` points at, from its layout.json (written
    when that run started). None for a fresh start or a folder without one."""
    from dflash_trainer.training.checkpoint import step_checkpoints

    if cfg.runtime.resume == "never":
        return None
    where = Path(cfg.out) if cfg.runtime.resume == "auto" else Path(cfg.runtime.resume)
    if is_checkpoint(where, resumable=True):  # a checkpoint folder itself
        where = where.parent
    if not step_checkpoints(where):
        return None
    try:
        return int(json.loads((where / "layout.json").read_text())["num_drafters"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measure_rates(cfg: TrainConfig, source: TargetSource, target_device: torch.device, drafter_device: torch.device,
                  *, rows: int, rows_from: str, warmup: int = 2, max_iters: int = 5, budget_s: float = 10.0,
                  cpu_threads: int | None = None) -> MeasuredRates:
    """Time the target (forward + labels) and one drafter training step on one micro-batch of `rows`
    rows of the prepared folder `rows_from` (the first rows of epoch 0), in this process. Returns
    the per-device rates in context tokens/s (module docstring: what is timed, how, what is freed)."""
    from dflash_trainer.data.loader import load_split
    from dflash_trainer.training.feed import fetch_rows

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)  # what one rank process gets (rank_process._run_rank)
    rows_ds = load_split(rows_from, "train")
    _, row_index = RowSchedule(len(rows_ds), rows, 1, cfg.runtime.seed).rows_of(0)
    host_rows = fetch_rows(rows_ds, row_index, cfg.data.seq_len)
    timing = (warmup, max_iters, budget_s)
    try:
        with _on(target_device):
            target_ms, features, dc, head = _target_phase(cfg, source, target_device, host_rows, timing)
        if target_device.type == "cuda":
            torch._dynamo.reset()  # the compiled target layers, before the drafter is measured
        gc.collect()  # the rest of the target (module reference cycles) before the drafter is built
        with _on(drafter_device):
            drafter_ms = _drafter_phase(cfg, dc, head, features, drafter_device, host_rows, timing)
        del features, head
    finally:
        torch.set_num_threads(threads)
    left = _free({target_device, drafter_device})
    tokens = rows * cfg.data.seq_len
    return MeasuredRates(
        target_tok_per_s=tokens / (statistics.median(target_ms) / 1e3),
        # a batch of target tokens takes anchor_draws_per_row drafter steps
        drafter_tok_per_s=tokens / (statistics.median(drafter_ms) * cfg.experimental.anchor_draws_per_row / 1e3),
        target_ms=target_ms, drafter_ms=drafter_ms,
        rows=rows, seq_len=cfg.data.seq_len, target_device=str(target_device), drafter_device=str(drafter_device),
        warmup=warmup, timing="cuda events" if target_device.type == "cuda" else "host clock", cpu_threads=cpu_threads,
        wall_s=time.perf_counter() - t0, memory_left_bytes=left)


def _target_phase(cfg: TrainConfig, source: TargetSource, device: torch.device, host_rows: dict[str, torch.Tensor],
                  timing: tuple[int, int, float]):
    """Load the target on `device`, time `feed.extract` on the rows. Returns (ms of each timed call, the
    TargetOutput the drafter trains on, the drafter config, (embedding, LM head) weights); the rest of
    the target is freed when this returns."""
    from dflash_trainer.interop.load_drafter import load_drafter
    from dflash_trainer.target_model.features import TargetFeatureExtractor
    from dflash_trainer.training.feed import extract, rows_to
    from dflash_trainer.training.run import load_drafter_config, step_settings

    warmup, max_iters, budget_s = timing
    target = source.load_full(device, precision.compute_dtype(device))
    init = load_drafter(cfg.drafter.init_from, num_target_layers=target.num_layers) if cfg.drafter.init_from else None
    dc, _ = load_drafter_config(cfg, target, init)  # the architecture; warm-start weights do not change speed
    extractor = TargetFeatureExtractor.from_config(target, dc.target_layer_ids, cfg)
    settings = step_settings(cfg, dc, device)
    rows = rows_to(host_rows, device)
    for _ in range(warmup):
        extract(extractor, rows, settings)
    ms = _timed(lambda: extract(extractor, rows, settings), device, max_iters, budget_s)
    return ms, extract(extractor, rows, settings), dc, (target.embed_tokens.weight, target.lm_head.weight)


def _drafter_phase(cfg: TrainConfig, dc: Any, head: tuple[torch.Tensor, torch.Tensor], features: Any,
                   device: torch.device, host_rows: dict[str, torch.Tensor], timing: tuple[int, int, float]) -> list[float]:
    """Build the drafter on `device` as a drafter rank does and time `loop.train_step` on the target's
    outputs `features`; returns the ms of each timed call (everything it built is freed on return)."""
    from dflash_trainer.drafter.metrics import MetricAccumulator
    from dflash_trainer.target_model.features import TargetOutput
    from dflash_trainer.drafter.build import build_drafter
    from dflash_trainer.training.feed import rows_to
    from dflash_trainer.training.loop import Batch, row_generators, train_step
    from dflash_trainer.training.optim import build_optimizer
    from dflash_trainer.training.run import step_settings

    warmup, max_iters, budget_s = timing
    moved = {k: getattr(features, k) for k in ("features", "argmax", "last_hidden")}
    tgt = TargetOutput(**{k: None if v is None else v.to(device) for k, v in moved.items()})
    rows = rows_to(host_rows, device)
    drafter = build_drafter(cfg, dc, head, device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = build_optimizer(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, compiled=cfg.runtime.compile)
    settings = step_settings(cfg, dc, device)
    acc = MetricAccumulator(dc.block_size, device)
    batch = Batch.of(rows, tgt)

    def step() -> None:
        gens = row_generators(batch.row_index, cfg.runtime.seed, 0, 0, device)  # per step, as the loop does
        train_step(drafter, batch, settings, gens, opt, params, cfg.optim.grad_clip, acc)

    for _ in range(warmup):
        step()
    return _timed(step, device, max_iters, budget_s)


def _timed(fn: Callable[[], Any], device: torch.device, max_iters: int, budget_s: float) -> list[float]:
    """ms of up to `max_iters` calls of fn (bench.common.times_ms), stopping once `budget_s` seconds of
    timed calls are spent; at least one call."""
    out: list[float] = []
    while len(out) < max_iters and sum(out) < budget_s * 1e3:
        out += times_ms(fn, 1, device)
    return out


def _on(device: torch.device):
    """CUDA events and compiled kernels follow the current device: make it `device` for a phase."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _free(devices: set[torch.device]) -> int:
    """Drop compiled graphs and cached blocks; bytes torch still holds on the GPUs (0 on the CPU)."""
    gc.collect()
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    if not cuda:
        return 0
    torch._dynamo.reset()  # compiled graphs can hold the drafter's tensors
    gc.collect()
    for i in cuda:
        with torch.cuda.device(i):
            torch.cuda.empty_cache()
    return sum(torch.cuda.memory_allocated(i) for i in cuda)
