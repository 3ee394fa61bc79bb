"""The training loop of every layout: take a batch → step → log / checkpoint / stop cadence.

The co-located run (target and drafter in one process on one device) is the 1 × 1 case of the
process layout (target ranks streaming to data-parallel drafter ranks): both run `run_loop` and
`train_step`; they differ only in the batch source and in where the log goes.
  - co-located: `FeedSource`, the target's forward in the same process (on CUDA the next batch's
    forward runs on a side stream during this step, training/feed.py);
  - process layout: `InboxSource`, this drafter's micro-batches received from the target ranks
    (pipeline/p2p.py).

Steps (training/schedule.py RowSchedule): optimizer step s trains on batch step b = s // n with
anchor draw d = s % n (n = anchor_draws_per_row, feature reuse). The anchors of dataset row r are
drawn from the seed anchor_seeds(seed, epoch, r, d): they do not depend on how rows are split into
micro-batches or between drafters, so every layout trains on the same blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from dflash_trainer.drafter.metrics import MetricAccumulator
from dflash_trainer.telemetry.sections import section
from dflash_trainer.training.checkpoint import Progress
from dflash_trainer.training.optim import clipped_step
from dflash_trainer.training.feed import fetch_rows
from dflash_trainer.training.schedule import RowSchedule, anchor_seeds
from dflash_trainer.training.precision import autocast
from dflash_trainer.training.step import StepSettings, drafter_step

Rows = dict[str, torch.Tensor]


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


@dataclass
class Batch:
    """What one batch step gives this drafter: R rows of T tokens and the target's outputs for them."""

    epoch: int
    row_index: np.ndarray  # [R] int64, dataset rows; −1 = padding (unsupervised, contributes nothing)
    rows: Rows  # input_ids / position_ids [R,T] int64, loss_mask [R,T] bool, on the drafter's device
    features: torch.Tensor  # [R,T,k·H] target aux hidden states
    argmax: torch.Tensor | None  # [R,T] int64 target greedy labels (label_source="target")
    last_hidden: torch.Tensor | None  # [R,T,H] final-normed target states (loss kl / ce_kl, weights cat)

    @classmethod
    def of(cls, rows: Rows, out: Any, epoch: int = 0, row_index: np.ndarray | None = None) -> "Batch":
        """A batch from rows and a target_model.features.TargetOutput (benchmarks, the split probe,
        tests); row_index defaults to 0..R−1."""
        if row_index is None:
            row_index = np.arange(rows["input_ids"].shape[0], dtype=np.int64)
        return cls(epoch, row_index, rows, out.features, out.argmax, out.last_hidden)


class BatchSource(Protocol):
    """Where a drafter's batches come from, by batch step (credits, queues and prefetch inside)."""

    def open(self, first_batch: int) -> None: ...
    def take(self, batch_step: int) -> Batch: ...
    def release(self, batch_step: int) -> None: ...
    def finish(self, last_taken: int) -> None: ...


class FeedSource:
    """Co-located batches: rows of batch step b (`schedule.rows_of(b)`, padded at the end of an
    epoch) read from the prepared dataset, target forward by `feed` (a training.feed.TargetFeed)."""

    def __init__(self, rows_ds: Any, schedule: RowSchedule, feed: Any, seq_len: int, total_batches: int):
        self.rows_ds, self.schedule, self.feed, self.seq_len, self.total = rows_ds, schedule, feed, seq_len, total_batches
        self._it: Iterator | None = None
        self._next = 0

    def _host_batches(self, first: int) -> Iterator[Rows]:
        for b in range(first, self.total):
            row_index = self.schedule.rows_of(b)[1]
            yield {**fetch_rows(self.rows_ds, row_index, self.seq_len), "row_index": row_index}

    def open(self, first_batch: int) -> None:
        self._it, self._next = self.feed(self._host_batches(first_batch)), first_batch

    def take(self, batch_step: int) -> Batch:
        assert self._it is not None and batch_step == self._next, (batch_step, self._next)
        rows, out = next(self._it)
        self._next += 1
        epoch, row_index = self.schedule.rows_of(batch_step)
        return Batch.of(rows, out, epoch, row_index)

    def release(self, batch_step: int) -> None:
        pass

    def finish(self, last_taken: int) -> None:
        if self._it is not None:
            self._it.close()  # drops the one prefetched batch


class InboxSource:
    """Process-layout batches: this drafter's micro-batches from the target ranks (p2p.DrafterInbox)."""

    def __init__(self, inbox: Any):
        self.inbox = inbox

    def open(self, first_batch: int) -> None:
        self.inbox.open(first_batch)

    def take(self, batch_step: int) -> Batch:
        tb = self.inbox.take(batch_step)
        return Batch(tb.epoch, tb.row_index.numpy(), tb.rows(), tb.features, tb.argmax(), tb.last_hidden)

    def release(self, batch_step: int) -> None:
        self.inbox.release(batch_step)

    def finish(self, last_taken: int) -> None:
        self.inbox.finish(last_taken)


def row_generators(row_index: np.ndarray, seed: int, epoch: int, draw: int, device: torch.device) -> list[torch.Generator]:
    """One anchor generator per row [R], seeded by (seed, epoch, dataset row, draw) on `device`
    (schedule.anchor_seeds; host work only, no device sync)."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in anchor_seeds(seed, epoch, row_index, draw)]


def train_step(model: Any, batch: Batch, settings: StepSettings, generators: list[torch.Generator],
               opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grad_clip: float, acc: MetricAccumulator,
               group: Any = None, world: int = 1) -> torch.Tensor:
    """One optimizer step on one batch: forward (bf16 autocast on CUDA), loss = local Σ w·loss ÷
    global Σ w, backward, clip, AdamW. Returns the on-device `finite` flag (no host sync).
    Backward and the optimizer are profiler sections (telemetry/sections.py), as are the parts of
    `drafter_step`.

    group/world: the drafters' process group and size. With world > 1 one all-reduce sums (Σ w,
    Σ w·loss) over the drafters and `model` is the DDP-wrapped drafter whose gradients are summed
    (drafter_rank.sum_gradients_hook): the update does not depend on how rows are split. A step
    whose global loss or gradient norm is not finite changes no weight and no optimizer state
    (optim.clipped_step decides on the device); every drafter skips alike, and the
    accumulator counts the skip instead of the sums.
    """
    with autocast(batch.features.device):
        sums = drafter_step(model, batch.rows, batch.features, batch.argmax, settings, generators, batch.last_hidden,
                            train=True)
    totals = torch.stack([sums.weight_sum.detach().float(), sums.loss_sum.detach().float()])  # [Σ w, Σ w·loss]
    if world > 1:
        dist.all_reduce(totals, group=group)
    # Σ w of a step is 0 or at least 1 with decay weights; D-PACE/CAT weight sums may lie in (0, 1)
    denominator = torch.where(totals[0] > 0, totals[0], torch.ones_like(totals[0]))
    with section("backward"):
        (sums.loss_sum / denominator).backward()
    with section("optimizer"):
        finite = clipped_step(opt, params, grad_clip, torch.isfinite(totals[1]))
        opt.zero_grad(set_to_none=True)
    acc.add(sums, finite)
    return finite


@dataclass
class LoopParts:
    """What `run_loop` drives. `log(step, tokens, summary, lr, final)` and `save(step, name)` are
    the layout's sinks (None on drafters that do not log); `stop()` says (the same on every drafter)
    that a stop was requested; `beat(what)` feeds the watchdog; `telemetry` (RankTelemetry) or None."""

    model: Any
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: Any
    settings: StepSettings
    acc: MetricAccumulator
    source: BatchSource
    schedule: RowSchedule
    seed: int
    seq_len: int
    grad_clip: float
    log_every: int
    save_every: int | None
    max_consecutive_skips: int
    stop: Callable[[], bool]
    log: Callable[..., None] | None = None
    save: Callable[[int, str], None] | None = None
    beat: Callable[[str], None] = lambda what: None
    after_step: Callable[[int], None] | None = None  # called with the new step count (a live bar)
    # measured τ (training/tau_probe.py): measure_tau(step) every `tau_every` steps and at the end
    measure_tau: Callable[[int], None] | None = None
    tau_every: int | None = None
    telemetry: Any = None
    group: Any = None  # drafters' process group (None: one drafter)
    world: int = 1
    profiler: Any = None  # training/run_profile.RunProfiler: a time breakdown of a few steps, once (or None)


@dataclass
class LoopResult:
    """What one `run_loop` call did (the run's totals are in its Progress)."""

    steps: int  # steps trained in this call
    stopped_early: bool
    train_wall_s: float
    new_tokens: int  # target tokens trained in this call


def run_loop(p: LoopParts, prog: Progress, total: int) -> LoopResult:
    """Optimizer steps [prog.step, total): take → train_step → (vote stop) → release → log every
    `log_every` steps / checkpoint every `save_every` (a checkpoint holds no unlogged metric sums) /
    measure τ every `tau_every` steps (`measure_tau`, between steps; also once after the last step
    unless a stop was requested).

    With `profiler` set, the steps it asks for run under torch.profiler once (run_profile.py).
    Updates `prog` (step, tokens: target tokens counted once per batch however many draws). Logs
    once more at the end. Raises NonFiniteError on every drafter alike after max_consecutive_skips
    non-finite steps in a row (checked at log steps).
    """
    draws = p.schedule.anchor_draws
    device = p.acc.device
    first = prog.step
    if first >= total:  # resumed at the end (e.g. a finished run re-run with another log_every): nothing to do
        return LoopResult(steps=0, stopped_early=False, train_wall_s=0.0, new_tokens=0)
    p.source.open(first // draws)
    t0, tokens0 = time.perf_counter(), prog.tokens
    taken, stopped, batch = first // draws - 1, False, None
    for step in range(first, total):
        b, draw = divmod(step, draws)
        if p.profiler is not None:
            p.profiler.before(step)
        if batch is None:
            p.beat(f"waiting for the batch of step {step}")
            batch, taken = p.source.take(b), b
        p.beat(f"training step {step}")
        if p.telemetry is not None:
            p.telemetry.busy.start()
        gens = row_generators(batch.row_index, p.seed, batch.epoch, draw, device)
        train_step(p.model, batch, p.settings, gens, p.opt, p.params, p.grad_clip, p.acc, p.group, p.world)
        p.sched.step()
        prog.step = step + 1
        if p.profiler is not None:
            p.profiler.after(prog.step)
        b_next, prog.draw = divmod(prog.step, draws)  # where a resume from here continues
        prog.epoch, prog.batch_in_epoch = divmod(b_next, p.schedule.steps_per_epoch)
        if draw == 0:
            prog.tokens += p.schedule.valid_rows(b) * p.seq_len  # all drafters together
        if p.telemetry is not None:
            p.telemetry.busy.stop()
            if draw == 0:
                p.telemetry.finish_item(int((batch.row_index >= 0).sum()) * p.seq_len)
        if p.after_step is not None:
            p.after_step(prog.step)
        stopped = p.stop() and step < total - 1
        if stopped or step == total - 1:
            break
        if draw == draws - 1:
            p.source.release(b)
            batch = None
        saving = bool(p.save_every) and prog.step % p.save_every == 0
        if prog.step % p.log_every == 0 or saving:
            _log(p, prog)
        if saving and p.save is not None:
            p.beat(f"writing checkpoint-{prog.step}")
            p.save(prog.step, f"checkpoint-{prog.step}")
        if p.measure_tau is not None and p.tau_every and prog.step % p.tau_every == 0:
            p.beat(f"measuring τ at step {prog.step}")
            p.measure_tau(prog.step)
    if p.profiler is not None:
        p.profiler.close(prog.step)
    p.beat("draining and ending the transfers")
    p.source.finish(taken)
    _log(p, prog, final=True)
    if p.measure_tau is not None and p.tau_every and not stopped:  # the last step never measured above
        p.beat(f"measuring τ at step {prog.step}")
        p.measure_tau(prog.step)
    return LoopResult(steps=prog.step - first, stopped_early=stopped, train_wall_s=time.perf_counter() - t0,
                      new_tokens=prog.tokens - tokens0)


def _log(p: LoopParts, prog: Progress, final: bool = False) -> None:
    """Reduce the metric sums over the drafters (one collective per log interval), hand them to the
    log sink, and stop on too many consecutive non-finite steps."""
    if p.world > 1:
        p.acc.all_reduce(p.group)
    summary = p.acc.summary()  # host sync: one device→host copy per log interval
    prog.skipped_steps += summary.get("skipped_steps", 0)
    if summary["loss"] is not None:
        prog.losses.append(summary["loss"])
    if p.log is not None:
        p.log(prog, summary, p.sched.get_last_lr()[0], final)
    if summary.get("consecutive_skips", 0) >= p.max_consecutive_skips:
        raise NonFiniteError(f"{summary['consecutive_skips']} consecutive steps had a non-finite loss or gradient "
                             f"norm (up to step {prog.step}); lower lr, check the data, or resume from the last "
                             "checkpoint")
