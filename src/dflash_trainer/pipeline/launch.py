"""Multi-process training: target ranks run the frozen target and stream features to drafter ranks,
which train the drafter data-parallel.

Symbols: N target ranks, M drafter ranks, D queue depth, G rows per step, R = G/M rows per drafter
micro-batch, T tokens per row, F = k·H feature width (layout in pipeline/layout.py, wire contract
in pipeline/wire.py, credits and shutdown in pipeline/flow.py, design in docs/transport.md). Modules: this one launches and watches;
rank_process.py (one rank process: set up, run its role, report failures), rank_context.py (what a
rank carries), target_rank.py, drafter_rank.py (the two roles), target_source.py (checkpoint files
or random weights).

    run_pipeline(cfg)                       CLI entry: (--gpus/--procs: measure and choose the split,
                                            split_probe.py) resolve the layout, then
      ├─ spawn: one process per rank        launcher holds the rendezvous store, watches the ranks,
      │                                     prints the original error once
      └─ torchrun: this process is a rank
    rank_main(ctx)
      ├─ target_role   load the target, (target 0) publish the run info: drafter config, data size;
      │                for each of its micro-batches in order: wait credit → rows → forward → send
      └─ drafter_role  read the run info; embedding + LM head only (from the checkpoint files, or
                       sent by target 0 for in-memory targets); DDP over the drafter group; per step:
                       take → anchors (seeded by the rows) → drafter_step → loss / GLOBAL weight sum
                       → backward (gradients summed over drafters) → clip → AdamW → vote stop → release

Loss normalization: every drafter divides its local Σ w·loss by the weight sum all-reduced over
the drafter group, and DDP sums (does not average) the gradients, so the gradient is that of
Σ_all w·loss / Σ_all w whatever the split of rows over drafters.

Exact resume: the data position is the step alone (rows of a step follow from (seed, epoch)) and
anchors are seeded by (seed, epoch, row, draw), so targets hold no state. Drafter 0 writes
checkpoint-{step} (weights, optimizer, scheduler, metric sums, progress, config) every
`save_every` steps and on a stop request; at start it picks the newest readable one and
publishes its step, the other drafters load the same folder and the targets start at that step.
"""

from __future__ import annotations

import datetime as _dt
import json
import multiprocessing.connection
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.pipeline.auto_split import auto_split_devices, wants_auto_split
from dflash_trainer.pipeline.layout import Layout, resolve_layout
from dflash_trainer.pipeline.rank_context import PipelineOptions
from dflash_trainer.pipeline.rank_process import spawned_rank, torchrun_rank
from dflash_trainer.training.run import refuse_unresumable
from dflash_trainer.training.finished import (RunResult, finished_message, finished_run, finished_with_recorded_split,
                                              read_result)
from dflash_trainer.training.signals import StopRequest
from dflash_trainer.pipeline.split_probe import auto_split
from dflash_trainer.pipeline.target_source import CheckpointTarget, RandomTarget, TargetSource
from dflash_trainer.training.tau_probe import PROCESS_LAYOUT_NOTICE
from dflash_trainer.pipeline.flow import FailureBoard, FailureReport, choose_original, describe_exit

__all__ = ["CheckpointTarget", "PipelineFailed", "PipelineOptions", "RandomTarget", "run_pipeline"]


class PipelineFailed(RuntimeError):
    """A rank failed; the original error was already printed. exit_code: 2 = bad input, 1 = failure."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# ----------------------------------------------------------------------------------------------
# Entry point


def run_pipeline(cfg: TrainConfig, console: Console | None = None, options: PipelineOptions | None = None,
                 env: dict[str, str] | None = None) -> RunResult | None:
    """Train with the multi-process layout `cfg` asks for. Returns the run summary (None on ranks that
    do not log, under torchrun). A re-run of a command that already finished says so and returns
    its summary before any data is prepared, model loaded or process started (records untouched;
    `finished.finished_run`). Raises ValueError for bad settings (before any process starts; for a
    checkpoint it would refuse to continue, before anything in OUT is written: `refuse_unresumable`)
    and PipelineFailed after a rank failed (all ranks have exited; the error was printed once)."""
    console = console or Console()
    options = options or PipelineOptions()
    env = dict(os.environ) if env is None else env
    source = options.target_source or CheckpointTarget(cfg.target.path)
    if wants_auto_split(cfg):  # --gpus/--procs: measure on this run's rows, then run the split chosen
        auto_split_devices(cfg, env)  # flag errors before the data is prepared
        done = finished_with_recorded_split(cfg)  # a finished re-run measures nothing, writes nothing
        if done is not None:
            console.print(finished_message(cfg, done), highlight=False)
            return done
        # a resume that will be refused is refused before rows are prepared or measured into OUT;
        # the split decides the default rows_per_step (and honours the checkpoint's drafter count)
        refuse_unresumable(cfg, "pipeline", undecided=() if "rows_per_step" in cfg.optim.model_fields_set
                           else ("rows_per_step",))
        cfg = _prepare_in_launcher(cfg, source, console)
        split = auto_split(cfg, source, log=lambda msg: console.print(msg, highlight=False, markup=False))
        console.print(split.table(), highlight=False, markup=False)
        (Path(cfg.out) / "auto_split.json").write_text(json.dumps(split.as_dict(), indent=2) + "\n")
        cfg = split.config
    layout = resolve_layout(cfg, env)
    if not layout.multiprocess:
        raise ValueError("run_pipeline needs a multi-process layout (--target-gpus/--drafter-gpus or "
                         "--target-procs/--drafter-procs); the co-located run is training.run.train")
    check_fp8_layout(cfg.experimental.fp8, layout)
    if layout.rows_per_step != cfg.optim.rows_per_step:  # the default batch, rounded up to the drafter count
        console.print(f"global batch: {layout.rows_per_step} rows per step = {layout.rows_per_drafter} per drafter × "
                      f"{layout.num_drafters} drafters (rows_per_step default {cfg.optim.rows_per_step} rounded up to a "
                      "multiple of the drafter count; set rows_per_step to choose)", highlight=False)
        cfg = cfg.updated({"rows_per_step": layout.rows_per_step})
    # the config as the ranks record it: the launcher prepares the data into OUT/data when not given
    recorded = cfg if cfg.data.prepared else cfg.updated({"prepared": str(Path(cfg.out) / "data")})
    done = finished_run(recorded)
    if done is not None:
        me = layout.ranks[int(env["RANK"])] if layout.launcher == "torchrun" else None
        if me is not None and not (me.role == "drafter" and me.role_index == 0):
            return None  # under torchrun drafter 0 speaks for the run
        console.print(finished_message(cfg, done), highlight=False)
        return done
    speaks = layout.launcher != "torchrun" or layout.ranks[int(env["RANK"])] == layout.drafters[0]
    if cfg.tau.tau_every and speaks:
        console.print(PROCESS_LAYOUT_NOTICE, highlight=False)
    if layout.launcher == "torchrun":
        if not cfg.data.prepared:
            raise ValueError("under torchrun prepare the data first (`dflash-train prepare`) and pass --prepared")
        _check_prepared_rows(cfg, source, console)  # on every rank alike: all refuse or none
        return torchrun_rank(layout, cfg, source, options, env)
    # before OUT/data, ranks.json or any rank's records are written (drafter 0 checks again what it loads)
    refuse_unresumable(cfg, "pipeline", layout.num_drafters)
    cfg = _prepare_in_launcher(cfg, source, console)
    return _spawn_and_watch(layout, cfg, source, options, console)


def auto_split_dry_run(cfg: TrainConfig, console: Console, options: PipelineOptions | None = None,
                       env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """`train --gpus/--procs --dry-run`: measure and choose as the run would, start nothing, write
    nothing to OUT (without `prepared` the rows are prepared in a temporary folder). Returns (the
    chosen layout's dry-run JSON with an "auto_split" entry, the readable table)."""
    import tempfile

    env = dict(os.environ) if env is None else env
    source = (options or PipelineOptions()).target_source or CheckpointTarget(cfg.target.path)
    auto_split_devices(cfg, env)
    with tempfile.TemporaryDirectory(prefix="dflash-split-") as tmp:
        rows_from = cfg.data.prepared or _prepare_in_launcher(cfg.updated({"out": tmp}), source, console).data.prepared
        split = auto_split(cfg, source, rows_from=rows_from,
                           log=lambda msg: console.print(msg, highlight=False, markup=False))
    layout = resolve_layout(split.config, env)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {**layout.as_dict(visible_cuda_devices=visible), "auto_split": split.as_dict()}, split.table()


def _check_prepared_rows(cfg: TrainConfig, source: TargetSource, console: Console) -> None:
    """`--prepared` rows tokenized as the target tokenizes (data/loader.check_prepared_tokenizer: raises
    TokenizerMismatch, prints its warnings); an in-memory target (no tokenizer files) is not checked."""
    if not isinstance(source, CheckpointTarget):
        return
    from dflash_trainer.data.loader import check_prepared_tokenizer
    from dflash_trainer.target_model.load import load_tokenizer

    warning = check_prepared_tokenizer(cfg.data.prepared, load_tokenizer(source.path), cfg.data.chat_template_text())
    if warning:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)


def _prepare_in_launcher(cfg: TrainConfig, source: TargetSource, console: Console) -> TrainConfig:
    """Tokenize and pack the data once before any rank starts (the ranks read OUT/data), check T."""
    from dflash_trainer.data.loader import load_split

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.runtime.resume not in ("auto", "never") and not Path(cfg.runtime.resume).is_dir():
        raise ValueError(f"resume={cfg.runtime.resume}: no such folder; give a run directory holding checkpoint-* folders")
    if not cfg.data.prepared:
        if not isinstance(source, CheckpointTarget):
            raise ValueError("an in-memory target has no tokenizer: pass prepared rows with --prepared")
        from dflash_trainer.data.prepare import prepare_dataset
        from dflash_trainer.data.sources import default_sharegpt_path
        from dflash_trainer.target_model.load import load_tokenizer

        tok = load_tokenizer(source.path)
        report = prepare_dataset(cfg.data.chats or str(default_sharegpt_path()), tok, out / "data", seq_len=cfg.data.seq_len,
                        max_conversations=cfg.data.max_conversations, validation_fraction=cfg.data.validation_fraction,
                        seed=cfg.runtime.seed, chat_template=cfg.data.chat_template_text(), enable_thinking=cfg.data.enable_thinking)
        cfg = cfg.updated({"prepared": str(out / "data")})
        console.print(f"data: {report.summary_line()} (in {cfg.data.prepared})", highlight=False, markup=False)
    else:
        _check_prepared_rows(cfg, source, console)
    rows = load_split(cfg.data.prepared, "train")
    seq_len = len(rows[0]["input_ids"])
    if seq_len != cfg.data.seq_len:
        raise ValueError(f"seq_len={cfg.data.seq_len} but {cfg.data.prepared} holds rows of {seq_len} tokens; set --set seq_len={seq_len}")
    return cfg


# ----------------------------------------------------------------------------------------------
# Launcher (spawn mode): holds the store, starts and watches the ranks


def _spawn_and_watch(layout: Layout, cfg: TrainConfig, source: TargetSource, options: PipelineOptions,
                     console: Console) -> RunResult:
    out = Path(cfg.out)
    timeout = _dt.timedelta(seconds=cfg.layout.comm_timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    board = FailureBoard(store)
    ctx = rank_process_context()
    console.print(f"[bold]dflash-train[/] pipeline: {layout.num_targets} target + {layout.num_drafters} drafter "
                  f"ranks ({layout.backend}), queue depth {layout.queue_depth}, out={out}")
    procs = []
    for spec in layout.ranks:
        p = ctx.Process(target=spawned_rank, name=f"dflash-rank{spec.rank}",
                        args=(spec.rank, layout, cfg.model_dump(), source, options, "127.0.0.1", store.port))
        p.start()
        procs.append(p)
    (out / "ranks.json").write_text(json.dumps(
        [{**asdict(s), "pid": p.pid} for s, p in zip(layout.ranks, procs)], indent=2) + "\n")

    stop = StopRequest()
    with stop.installed():
        exitcodes = _watch(procs, layout, board, stop, options.status_every_s, console)
    last = _rank_states(board, layout)
    (out / "exit_status.json").write_text(json.dumps(
        {str(r): {"exitcode": c, "how": describe_exit(c), "last_state": last.get(r)}
         for r, c in sorted(exitcodes.items())}, indent=2) + "\n")
    if any(c != 0 for c in exitcodes.values()):
        original = choose_original(board.reports(layout.world_size))
        raise _report_failure(original, exitcodes, layout)
    return read_result(out)


def _rank_states(board: FailureBoard, layout: Layout) -> dict[int, dict]:
    """Last published state of every rank: what it was doing, for how long, items done."""
    out = {}
    for s in layout.ranks:
        try:
            snap = board.read(f"telemetry/{s.rank}")
        except Exception:  # noqa: BLE001 - diagnostics only
            snap = None
        if snap is not None:
            out[s.rank] = {"state": snap.get("state"), "state_s": round(snap.get("state_s", 0.0), 1),
                           "items": snap.get("items"), "elapsed_s": round(snap.get("elapsed_s", 0.0), 1)}
    return out


def _watch(procs: list, layout: Layout, board: FailureBoard, stop: StopRequest, status_every_s: float,
           console: Console) -> dict[int, int]:
    """Wait for every rank; report deaths, forward stop requests, end stragglers after an abort, and
    print every rank's state every `status_every_s` until all of them have done work (startup)."""
    exitcodes: dict[int, int] = {}
    t0 = next_status = time.monotonic()
    next_status += status_every_s
    started = False
    abort_since: float | None = None
    forwarded = False
    while len(exitcodes) < len(procs):
        alive = [p for r, p in enumerate(procs) if r not in exitcodes]
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.5)
        for r, p in enumerate(procs):
            if r in exitcodes or p.exitcode is None:
                continue
            exitcodes[r] = p.exitcode
            if p.exitcode != 0 and board.read(f"error/{r}") is None:
                s = layout.ranks[r]
                board.report(FailureReport(rank=r, role=s.role, device=s.device, kind="died", type="Died",
                                           message=describe_exit(p.exitcode)))
        if stop.is_set() and not forwarded:
            board.request_stop()  # ranks finish the current step and exit cleanly
            forwarded = True
        if not started and time.monotonic() >= next_status:
            next_status += status_every_s
            states = _rank_states(board, layout)
            started = len(states) == layout.world_size and all(st["items"] for st in states.values())
            if not started:
                line = " | ".join(f"rank {r} {layout.ranks[r].role}: {st['state']} ({st['state_s']:.0f} s)"
                                  for r, st in sorted(states.items()))
                console.print(f"startup {time.monotonic() - t0:.0f} s: {line or 'no rank has reported yet'}",
                              highlight=False)
        if abort_since is None and board.abort_set():
            abort_since = time.monotonic()
        if abort_since is not None:
            waited = time.monotonic() - abort_since
            for r, p in enumerate(procs):  # ranks leave by themselves within ~1 s; stragglers are ended
                if r not in exitcodes and p.is_alive():
                    if waited > 25:
                        p.kill()
                    elif waited > 15:
                        p.terminate()
    for p in procs:
        p.join()
    return exitcodes


def rank_process_context():
    """The multiprocessing context ranks start from: a fork server that imported torch, transformers,
    datasets and this package once (no CUDA, no threads), so each rank starts by a fork instead of
    importing everything again. The preload list only takes effect before the server first starts."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["dflash_trainer.pipeline.launch", "dflash_trainer.target_model.features",
                                "dflash_trainer.data.loader", "datasets", "transformers.modeling_utils"])
    return ctx


def _report_failure(original: FailureReport | None, exitcodes: dict[int, int], layout: Layout) -> PipelineFailed:
    """Print the original error once (stderr); the other ranks get one summary line."""
    err = Console(stderr=True)
    others = ", ".join(f"rank {r} {describe_exit(c)}" for r, c in sorted(exitcodes.items())
                       if original is None or r != original.rank)
    if original is None:
        err.print(f"[bold red]error:[/] the run failed without a report ({others})")
        return PipelineFailed("run failed", 1)
    err.print(f"[bold red]error:[/] {original.headline()}", markup=True, highlight=False)
    if original.kind == "error" and not original.user_error and original.traceback:
        err.print(original.traceback.rstrip(), markup=False, highlight=False)
    err.print(f"all {layout.world_size} ranks stopped ({others})", markup=False, highlight=False)
    return PipelineFailed(original.headline(), 2 if original.user_error else 1)


def check_fp8_layout(fp8: str, layout: Layout) -> None:
    """Raise ValueError (before any process starts) when `fp8` cannot run on the layout's drafter
    devices (training.fp8.check_fp8). Under torchrun only this node's devices are known here; each
    drafter rank checks its own again when it builds the drafter."""
    if fp8 == "off":
        return
    from dflash_trainer.drafter.fp8 import check_fp8, require_torchao

    require_torchao(fp8)
    if layout.launcher == "torchrun":
        return
    for spec in layout.drafters:
        check_fp8(fp8, torch.device(spec.device))
