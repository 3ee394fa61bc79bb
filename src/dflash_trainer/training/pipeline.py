"""Multi-process training: target ranks run the frozen target and stream features to drafter ranks,
which train the drafter data-parallel.

Symbols: N target ranks, M drafter ranks, D queue depth, G rows per step, R = G/M rows per drafter
micro-batch, T tokens per row, F = k·H feature width (layout in training/layout.py, wire contract
in transport/batch.py, credits and shutdown in transport/flow.py, design in docs/transport.md).

    run_pipeline(cfg)                       CLI entry: resolve the layout, then
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

Exact-resume hooks (the data position is the step alone; anchors depend on (seed, epoch, rows);
targets hold no state): to resume, restore the drafter state on the drafter ranks and pass the
step as `first_step` to both role loops.
"""

from __future__ import annotations

import datetime as _dt
import json
import multiprocessing.connection
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from dflash_trainer.config import TrainConfig, dump_config
from dflash_trainer.drafter.config import DrafterConfig, default_gamma
from dflash_trainer.drafter.loss import LossSums
from dflash_trainer.drafter.metrics import MetricAccumulator
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.target.load import TargetBundle, bundle_from_model, load_embedding_and_head, load_target
from dflash_trainer.telemetry.progress import MetricsLog
from dflash_trainer.telemetry.provenance import provenance
from dflash_trainer.training.checkpoint import save_checkpoint
from dflash_trainer.training.layout import Layout, RankSpec, RowSchedule, anchor_seed, resolve_layout
from dflash_trainer.training.optim import build_optimizer, build_scheduler
from dflash_trainer.training.feed import rows_to
from dflash_trainer.training.run import NonFiniteError, RunResult, _load_drafter_config, extract
from dflash_trainer.training.step import StepSettings, default_mask_kind, drafter_step
from dflash_trainer.transport.batch import TransferBatch, WireSpec, pack_ids, padding_rows
from dflash_trainer.transport.flow import (FailureBoard, FailureReport, StopRequest, Watchdog, choose_original,
                                           describe_exit)
from dflash_trainer.transport.p2p import DrafterInbox, TargetOutbox
from dflash_trainer.transport.telemetry import RankTelemetry, format_line, rates

# ----------------------------------------------------------------------------------------------
# Where the target comes from


@dataclass(frozen=True)
class CheckpointTarget:
    """A target on disk (HF folder, .gguf file, None = embedded SmolLM2). Drafters read only its
    embedding and LM head from the files."""

    path: str | None
    shares_head: bool = False

    def load_full(self, device: torch.device, dtype: torch.dtype) -> TargetBundle:
        return load_target(self.path, device=device, dtype=dtype)

    def load_head(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return load_embedding_and_head(self.path, dtype=dtype)


@dataclass(frozen=True)
class RandomTarget:
    """A random-weight HF causal LM built in memory from config fields (tests, throughput runs).

    It exists only on the target ranks, so target rank 0 sends its embedding and LM head to every
    drafter at startup. family: "llama" | "qwen3"; config: fields of LlamaConfig / Qwen3Config.
    """

    family: Literal["llama", "qwen3"]
    config: dict[str, Any]
    seed: int = 0
    shares_head: bool = True

    def load_full(self, device: torch.device, dtype: torch.dtype) -> TargetBundle:
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

        hf = {"llama": LlamaConfig, "qwen3": Qwen3Config}[self.family](**self.config)
        hf._attn_implementation = "sdpa"
        devices = [device.index if device.index is not None else 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa", dtype=dtype)
        return bundle_from_model(model, name_or_path=f"random-{self.family}")


TargetSource = CheckpointTarget | RandomTarget


@dataclass(frozen=True)
class PipelineOptions:
    """Settings that are not part of the config (programmatic callers: tests, benchmarks)."""

    target_source: TargetSource | None = None  # None = CheckpointTarget(cfg.target)
    probe_target_iters: int = 0  # target ranks first time this many standalone forwards (bench)
    stall_timeout_s: float | None = None  # None = 2·comm_timeout_s + 60
    save_final: bool = True  # write checkpoint-final (benchmarks skip it)
    status_every_s: float = 30.0  # launcher: one line of every rank's state this often until all ranks work


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
    do not log, under torchrun). Raises ValueError for bad settings (before any process starts) and
    PipelineFailed after a rank failed (all ranks have exited; the error was printed once)."""
    console = console or Console()
    options = options or PipelineOptions()
    env = dict(os.environ) if env is None else env
    layout = resolve_layout(cfg, env)
    if not layout.multiprocess:
        raise ValueError("run_pipeline needs a multi-process layout (--target-gpus/--drafter-gpus or "
                         "--target-procs/--drafter-procs); the co-located run is training.run.train")
    source = options.target_source or CheckpointTarget(cfg.target)
    if layout.launcher == "torchrun":
        if not cfg.prepared:
            raise ValueError("under torchrun prepare the data first (`dflash-train prepare`) and pass --prepared")
        return _torchrun_rank(layout, cfg, source, options, env)
    cfg = _prepare_in_launcher(cfg, source, console)
    return _spawn_and_watch(layout, cfg, source, options, console)


def _prepare_in_launcher(cfg: TrainConfig, source: TargetSource, console: Console) -> TrainConfig:
    """Tokenize and pack the data once before any rank starts (the ranks read OUT/data), check T."""
    from dflash_trainer.data.loader import load_split

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resume = getattr(cfg, "resume", "never")
    if resume not in ("auto", "never"):
        raise ValueError(f"resume={resume}: the multi-process layout does not resume yet; use the co-located run "
                         "or --resume never")
    if resume == "auto" and any(out.glob("checkpoint-*")):
        console.print(f"[yellow]warning:[/] {out} holds checkpoints, but the multi-process layout does not resume "
                      "yet: training starts at step 0 and overwrites checkpoint-final")
    if not cfg.prepared:
        if not isinstance(source, CheckpointTarget):
            raise ValueError("an in-memory target has no tokenizer: pass prepared rows with --prepared")
        from dflash_trainer.data.prepare import prepare_dataset
        from dflash_trainer.data.sources import default_sharegpt_path
        from dflash_trainer.target.load import load_tokenizer

        tok = load_tokenizer(source.path)
        template = Path(cfg.chat_template).read_text() if cfg.chat_template else None
        prepare_dataset(cfg.data or str(default_sharegpt_path()), tok, out / "data", seq_len=cfg.seq_len,
                        max_conversations=cfg.max_conversations, validation_fraction=cfg.validation_fraction,
                        seed=cfg.seed, chat_template=template, enable_thinking=cfg.enable_thinking)
        cfg = cfg.model_copy(update={"prepared": str(out / "data")})
        console.print(f"data: prepared into {cfg.prepared}")
    rows = load_split(cfg.prepared, "train")
    seq_len = len(rows[0]["input_ids"])
    if seq_len != cfg.seq_len:
        raise ValueError(f"seq_len={cfg.seq_len} but {cfg.prepared} holds rows of {seq_len} tokens; set --set seq_len={seq_len}")
    return cfg


# ----------------------------------------------------------------------------------------------
# Launcher (spawn mode): holds the store, starts and watches the ranks


def _spawn_and_watch(layout: Layout, cfg: TrainConfig, source: TargetSource, options: PipelineOptions,
                     console: Console) -> RunResult:
    out = Path(cfg.out)
    timeout = _dt.timedelta(seconds=cfg.comm_timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    board = FailureBoard(store)
    ctx = rank_process_context()
    console.print(f"[bold]dflash-train[/] pipeline: {layout.num_targets} target + {layout.num_drafters} drafter "
                  f"ranks ({layout.backend}), queue depth {layout.queue_depth}, out={out}")
    procs = []
    for spec in layout.ranks:
        p = ctx.Process(target=_spawned_rank, name=f"dflash-rank{spec.rank}",
                        args=(spec.rank, layout, cfg.model_dump(), source, options, "127.0.0.1", store.port))
        p.start()
        procs.append(p)
    (out / "ranks.json").write_text(json.dumps(
        [{**asdict(s), "pid": p.pid} for s, p in zip(layout.ranks, procs)], indent=2) + "\n")

    stop = StopRequest()
    saved = stop.install_signal_handlers()
    try:
        exitcodes = _watch(procs, layout, board, stop, options.status_every_s, console)
    finally:
        stop.restore_signal_handlers(saved)
    last = _rank_states(board, layout)
    (out / "exit_status.json").write_text(json.dumps(
        {str(r): {"exitcode": c, "how": describe_exit(c), "last_state": last.get(r)}
         for r, c in sorted(exitcodes.items())}, indent=2) + "\n")
    if any(c != 0 for c in exitcodes.values()):
        original = choose_original(board.reports(layout.world_size))
        raise _report_failure(original, exitcodes, layout)
    return _result_from_summary(out)


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
    ctx.set_forkserver_preload(["dflash_trainer.training.pipeline", "dflash_trainer.target.features",
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


def _result_from_summary(out: Path) -> RunResult:
    body = json.loads((out / "summary.json").read_text())
    return RunResult(**{k: body[k] for k in ("steps", "tokens", "wall_s", "train_tok_per_s", "first_loss",
                                              "last_loss", "validation", "checkpoint", "skipped_steps")},
                     interrupted="a stop request (SIGTERM/SIGINT)" if body["stopped_early"] else None)


def _spawned_rank(rank: int, layout: Layout, cfg_dict: dict, source: TargetSource, options: PipelineOptions,
                  host: str, port: int) -> None:
    """Entry of a spawned rank process (never returns normally with a failure: exit code 1)."""
    cfg = TrainConfig(**cfg_dict)
    timeout = _dt.timedelta(seconds=cfg.comm_timeout_s)
    # Two clients: the process group's rendezvous blocks in its client; the watchdog must not wait behind it.
    pg_store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    board_store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    _run_rank(layout, layout.ranks[rank], cfg, source, options, pg_store, board_store, quiet=True)


def _torchrun_rank(layout: Layout, cfg: TrainConfig, source: TargetSource, options: PipelineOptions,
                   env: dict[str, str]) -> RunResult | None:
    rank = int(env["RANK"])
    timeout = _dt.timedelta(seconds=cfg.comm_timeout_s)
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    pg_store = dist.TCPStore(host, port, layout.world_size, is_master=(rank == 0 and not agent_store), timeout=timeout,
                             wait_for_workers=False)
    board_store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    summary = _run_rank(layout, layout.ranks[rank], cfg, source, options, pg_store, board_store, quiet=False)
    return _result_from_summary(Path(cfg.out)) if summary is not None else None


# ----------------------------------------------------------------------------------------------
# One rank


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
        return self.cfg.comm_timeout_s

    @property
    def logs(self) -> bool:
        """The rank that logs, checkpoints and writes the summary: drafter 0."""
        return self.me.role == "drafter" and self.me.role_index == 0


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
    stop.install_signal_handlers()
    stall = options.stall_timeout_s or 2 * cfg.comm_timeout_s + 60
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


def _wire_spec(cfg: TrainConfig, layout: Layout, dc: DrafterConfig, hidden: int, dtype: torch.dtype) -> WireSpec:
    return WireSpec(rows=layout.rows_per_drafter, seq_len=cfg.seq_len, feature_width=dc.num_aux_layers * hidden,
                    hidden_size=hidden, feature_dtype=dtype, need_argmax=cfg.label_source == "target",
                    need_last_hidden=cfg.loss == "kl")


def _dtype_of(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


# ----------------------------------------------------------------------------------------------
# Target role


def target_role(ctx: RankContext, first_step: int = 0) -> None:
    """Load the target, publish the run info (target 0), then serve this rank's micro-batches."""
    from dflash_trainer.data.loader import load_split
    from dflash_trainer.interop.load_drafter import load_drafter
    from dflash_trainer.target.features import TargetFeatureExtractor

    cfg, layout, device, wd = ctx.cfg, ctx.layout, ctx.device, ctx.watchdog
    dtype = _dtype_of(device)
    wd.beat("loading the target")
    target = ctx.source.load_full(device, dtype)
    wd.beat("opening the prepared rows")
    rows_ds = load_split(cfg.prepared, "train")
    seq_len = len(rows_ds[0]["input_ids"])
    if seq_len != cfg.seq_len:
        raise ValueError(f"seq_len={cfg.seq_len} but {cfg.prepared} holds rows of {seq_len} tokens")
    if ctx.me.role_index == 0:
        wd.beat("publishing the run info")
        init = load_drafter(cfg.init_from, num_target_layers=target.num_layers) if cfg.init_from else None
        dc, mask_reason = _load_drafter_config(cfg, target, init)
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
    extractor = TargetFeatureExtractor(target, dc.target_layer_ids)
    spec = _wire_spec(cfg, layout, dc, target.hidden_size, dtype)
    settings = _step_settings(cfg, dc, device)
    schedule = RowSchedule(len(rows_ds), cfg.rows_per_step, layout.num_drafters, cfg.seed)
    total = schedule.total_steps(cfg.max_steps, cfg.epochs)
    feeds = layout.feeds()[ctx.me.rank]
    outbox = TargetOutbox(spec, drafter_rank_of=layout.drafter_rank_of, data_group=None, ctl_group=ctx.ctl,
                          timeout_s=ctx.timeout_s, telemetry=ctx.telemetry, max_inflight=layout.queue_depth * len(feeds))
    units = layout.units_of_target(ctx.me.role_index, first_step, total)
    first = layout.first_unit_of_target(ctx.me.role_index, first_step, total)
    wd.beat("target ready")
    if ctx.options.probe_target_iters and first is not None:
        _probe_target(ctx, extractor, rows_ds, schedule, first, settings)
    target_loop(ctx, extractor, rows_ds, schedule, spec, settings, outbox, units)


def target_loop(ctx: RankContext, extractor, rows_ds, schedule: RowSchedule, spec: WireSpec,
                settings: StepSettings, outbox, units: Iterable[int]) -> None:
    """For each micro-batch of `units` in order: credit → rows → forward → send. `outbox`: a
    p2p.TargetOutbox or queue.LocalChannel."""
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
            out = extract(extractor, rows, settings)
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
    ctx.board.publish(f"final/{ctx.me.rank}", tel.snapshot())


def fetch_rows(rows_ds, row_index, seq_len: int) -> dict[str, torch.Tensor]:
    """input_ids / position_ids [R,T] int64 and loss_mask [R,T] bool of dataset rows; −1 = padding row."""
    out = padding_rows(len(row_index), seq_len)
    keep = [i for i, r in enumerate(row_index) if r >= 0]
    if keep:
        got = rows_ds[[int(row_index[i]) for i in keep]]
        for name, dtype in (("input_ids", torch.int64), ("position_ids", torch.int64), ("loss_mask", torch.bool)):
            col = got[name]
            col = torch.stack(list(col)) if isinstance(col, (list, tuple)) else torch.as_tensor(col)
            out[name][keep] = col.to(dtype)
    return out


def _probe_target(ctx: RankContext, extractor, rows_ds, schedule: RowSchedule, unit: int, settings: StepSettings) -> None:
    """Standalone target speed on this rank's first micro-batch (CUDA events, after 2 warm-ups)."""
    _, row_index = schedule.rows_of(unit)
    rows = rows_to(fetch_rows(rows_ds, row_index, ctx.cfg.seq_len), ctx.device)
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
    tokens = int((row_index >= 0).sum()) * ctx.cfg.seq_len
    ctx.board.publish(f"probe/{ctx.me.rank}", {"forward_ms_median": med, "tok_per_s": tokens / (med / 1e3),
                                               "forward_ms_all": times})


# ----------------------------------------------------------------------------------------------
# Drafter role


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
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if features.is_cuda
                else torch.autocast("cpu", enabled=False))
    with autocast:
        sums = drafter_step(model, rows, features, argmax, settings, generator, last_hidden)
    w = global_weight_sum(sums.weight_sum, group, world)
    (sums.loss_sum / w.clamp_min(1.0)).backward()
    return sums, w


def _step_settings(cfg: TrainConfig, dc: DrafterConfig, device: torch.device) -> StepSettings:
    on_gpu = device.type == "cuda"
    return StepSettings(num_anchors=cfg.num_anchors, gamma=cfg.gamma or default_gamma(dc.block_size),
                        label_source=cfg.label_source, loss=cfg.loss, per_document_quota=cfg.per_document_quota,
                        mask_kind=default_mask_kind(device), loss_chunk=cfg.loss_chunk,
                        compiled_loss=on_gpu and cfg.compile, zero_features=cfg.no_target_features)


def _frozen_modules(embed_w: torch.Tensor, head_w: torch.Tensor, device: torch.device) -> tuple[nn.Embedding, nn.Linear]:
    """nn.Embedding / nn.Linear around the target's weights [V,H] (frozen; tied weights stay one tensor)."""
    tied = embed_w.data_ptr() == head_w.data_ptr()
    emb = nn.Embedding.from_pretrained(embed_w.to(device), freeze=True)
    head = nn.Linear(embed_w.shape[1], embed_w.shape[0], bias=False, device="meta")
    head.weight = emb.weight if tied else nn.Parameter(head_w.to(device), requires_grad=False)
    return emb, head


def drafter_role(ctx: RankContext, first_step: int = 0) -> None:
    """Build the drafter from the run info, train it on the received micro-batches; drafter 0 logs,
    checkpoints and leaves `ctx.extra["write_summary"]` for after the final barrier."""
    from dflash_trainer.interop.load_drafter import load_drafter

    cfg, layout, device, wd = ctx.cfg, ctx.layout, ctx.device, ctx.watchdog
    dtype = _dtype_of(device)
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
    emb, head = _frozen_modules(embed_w, head_w, device)
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
    schedule = RowSchedule(info["num_rows"], cfg.rows_per_step, M, cfg.seed)
    total = schedule.total_steps(cfg.max_steps, cfg.epochs)
    opt = build_optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = build_scheduler(opt, total_steps=total, warmup_ratio=cfg.warmup_ratio, min_lr_ratio=cfg.min_lr_ratio)
    settings = _step_settings(cfg, dc, device)
    spec = _wire_spec(cfg, layout, dc, H, dtype)
    inbox = DrafterInbox(spec, drafter_index=ctx.me.role_index, num_drafters=M, num_targets=layout.num_targets,
                         target_rank_of=layout.target_rank_of, first_unit_of_target=layout.first_unit_of_target,
                         device=device, data_group=None, ctl_group=ctx.ctl,
                         depth=layout.queue_depth, total_steps=total, timeout_s=ctx.timeout_s, telemetry=ctx.telemetry)
    logger = _Logger(ctx, info, dc, schedule, total) if ctx.logs else None
    result = drafter_loop(ctx, model, drafter, params, opt, sched, settings, inbox, schedule, total, first_step, logger)
    _finish_drafter(ctx, drafter, result, logger)


@dataclass
class _LoopResult:
    steps: int  # steps trained in this run
    last_step: int  # index of the last step trained (first_step − 1 when none)
    tokens: int
    train_wall_s: float
    stopped_early: bool


def drafter_loop(ctx: RankContext, model: Any, drafter: DFlashDrafter, params: list[nn.Parameter], opt, sched,
                 settings: StepSettings, inbox, schedule: RowSchedule, total: int, first_step: int,
                 logger: "_Logger | None") -> _LoopResult:
    """Steps [first_step, total): take → train → vote stop → release; `inbox`: p2p.DrafterInbox or
    queue.LocalChannel."""
    cfg, device, wd, tel = ctx.cfg, ctx.device, ctx.watchdog, ctx.telemetry
    M = ctx.layout.num_drafters
    acc = MetricAccumulator(drafter.config.block_size, device)
    drafter.train()
    inbox.open(first_step)
    tokens, t0 = 0, time.perf_counter()
    last, stopped = first_step - 1, False
    for step in range(first_step, total):
        last = step
        wd.beat(f"waiting for the micro-batch of step {step}")
        batch = inbox.take(step)
        wd.beat(f"training step {step}")
        tel.busy.start()
        gen = torch.Generator(device=device)
        gen.manual_seed(anchor_seed(cfg.seed, batch.epoch, int(batch.row_index[0])))
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
        step_tokens = schedule.valid_rows(step) * cfg.seq_len  # all drafters together
        tokens += step_tokens
        tel.finish_item(batch.num_valid_rows * cfg.seq_len)
        stopped = _vote_stop(ctx, M) and step < total - 1
        if stopped or step == total - 1:
            break
        inbox.release(step)
        if (step + 1) % cfg.log_every == 0:
            _log(ctx, acc, logger, step + 1, tokens, sched)
        if logger is not None and cfg.save_every and (step + 1) % cfg.save_every == 0:
            logger.save(drafter, step + 1, f"checkpoint-{step + 1}")
    wd.beat("draining and ending the transfers")
    inbox.finish(last)
    _log(ctx, acc, logger, last + 1, tokens, sched, final=True)
    return _LoopResult(steps=last + 1 - first_step, last_step=last, tokens=tokens,
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

    Only the (sum, count) entries are reduced: [loss_sum, weight_sum, run_length_sum, num_blocks,
    correct[B], count[B]]; the skip counters after them are the same on every drafter. Raises
    NonFiniteError (on every drafter alike) after cfg.max_consecutive_skips skipped steps in a row.
    """
    if ctx.layout.num_drafters > 1:
        dist.all_reduce(acc._sums[:4 + 2 * acc.block_size], group=ctx.drafters)
    summary = acc.summary()  # host sync: one device→host copy per log interval
    if logger is not None:
        logger.write(step, tokens, summary, sched.get_last_lr()[0], final)
    if summary.get("consecutive_skips", 0) >= ctx.cfg.max_consecutive_skips:
        raise NonFiniteError(f"{summary['consecutive_skips']} consecutive steps had a non-finite loss or gradient "
                             f"norm (max_consecutive_skips={ctx.cfg.max_consecutive_skips}); lower lr or check the data")


def _finish_drafter(ctx: RankContext, drafter: DFlashDrafter, result: _LoopResult, logger: "_Logger | None") -> None:
    ctx.watchdog.beat("checking the drafter replicas")
    diff = replica_max_abs_diff(drafter, ctx.drafters, ctx.layout.num_drafters)
    ctx.board.publish(f"final/{ctx.me.rank}", ctx.telemetry.snapshot())
    if logger is not None:
        ctx.watchdog.beat("writing the final checkpoint")
        ckpt = logger.save(drafter, result.last_step + 1, "checkpoint-final") if ctx.options.save_final else None
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

    def __init__(self, ctx: RankContext, info: dict, dc: DrafterConfig, schedule: RowSchedule, total: int):
        self.ctx, self.info, self.dc, self.total = ctx, info, dc, total
        out = Path(ctx.cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        dump_config(ctx.cfg, out / "train_config.json")
        (out / "provenance.json").write_text(json.dumps(provenance(), indent=2) + "\n")
        (out / "layout.json").write_text(ctx.layout.to_json() + "\n")
        self.log = MetricsLog(out / "metrics.jsonl")
        self.console = Console()
        self.t_start = time.perf_counter()
        self.t_log, self.tok_log = self.t_start, 0
        self.prev: dict[int, dict] = {}
        self.losses: list[float] = []
        self.skipped = 0
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

    def save(self, drafter: DFlashDrafter, step: int, name: str) -> Path:
        cfg = self.ctx.cfg
        meta = {"step": step, "target": self.info["target"], "mask_token_reason": self.info["mask_token_reason"],
                "chat_template": self.info["chat_template"], "enable_thinking": cfg.enable_thinking,
                "label_source": cfg.label_source, "seq_len": cfg.seq_len, "no_target_features": cfg.no_target_features}
        return save_checkpoint(Path(cfg.out) / name, drafter.trainable_state_dict(), self.dc, meta)

    def summary(self, result: _LoopResult, ckpt: Path | None, replica_diff: float) -> dict:
        self.log.close()
        ctx = self.ctx
        finals = {s.rank: ctx.board.read(f"final/{s.rank}") for s in ctx.layout.ranks}
        probes = {s.rank: ctx.board.read(f"probe/{s.rank}") for s in ctx.layout.targets}
        body = {"steps": result.steps, "tokens": result.tokens, "wall_s": time.perf_counter() - self.t_start,
                "train_tok_per_s": result.tokens / max(result.train_wall_s, 1e-9),
                "first_loss": self.losses[0] if self.losses else None, "last_loss": self.losses[-1] if self.losses else None,
                "validation": {}, "checkpoint": str(ckpt) if ckpt else None, "stopped_early": result.stopped_early,
                "skipped_steps": self.skipped,
                "drafter_replica_max_abs_diff": replica_diff, "layout": ctx.layout.as_dict(),
                "ranks_final": [rates(None, f) for f in finals.values() if f is not None],
                "target_probe": {str(k): v for k, v in probes.items() if v is not None}}
        (Path(ctx.cfg.out) / "summary.json").write_text(json.dumps(body, indent=2) + "\n")
        return body
