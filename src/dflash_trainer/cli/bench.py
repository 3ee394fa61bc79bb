"""`dflash-train bench …`: the benchmark commands (GPU numbers; heavy imports inside each command)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash_trainer.cli.common import Verbose, console
from dflash_trainer.cli.common import fail as _fail
from dflash_trainer.telemetry.library_bars import set_library_bars

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks of the drafter step (GPU numbers are the ones that count).")


def _bench_shape(seq_len: int, num_anchors: int, block_size: int, layers: int, layer_types: str, window: int):
    from dflash_trainer.bench.common import BenchShape

    return BenchShape(seq_len=seq_len, num_anchors=num_anchors, block_size=block_size, num_layers=layers,
                      layer_types=layer_types, sliding_window=window)


FP8_HELP = ("FP8 matmuls for the drafter's linears: off | rowwise | tensorwise (the `fp8` setting; needs torchao and "
            "a GPU of compute capability 8.9+; default: off, with --config the config's).")


def _check_fp8(fp8: str | None) -> None:
    """One line and exit 2 for an unknown fp8 recipe, or fp8 without torchao (before torch loads)."""
    if fp8 is None or fp8 == "off":
        return
    from dflash_trainer.preflight.checks import check_fp8_available
    from dflash_trainer.drafter.fp8 import check_fp8_setting

    try:
        check_fp8_setting(fp8)
        check_fp8_available(fp8)
    except ValueError as e:
        _fail(str(e))


def _bench_device():
    from dflash_trainer.preflight.checks import cuda_ruled_out

    if cuda_ruled_out():  # answered without importing torch
        _fail("bench needs a CUDA device (the numbers are GPU numbers)")
    import torch

    if not torch.cuda.is_available():
        _fail("bench needs a CUDA device (the numbers are GPU numbers)")
    return torch.device("cuda")


def _check_paths(json_out: Optional[str], *, target: Optional[str] = None, data: Optional[str] = None,
                 out: Optional[str] = None, target_used: bool = False) -> None:
    """A benchmark's path flags, before any import or device check (preflight/paths.py,
    files/writable.py): --json a writable file path, --out creatable, and for `bench regenerate`
    the target and the chat file."""
    from dflash_trainer.preflight.paths import check_chat_file, check_target
    from dflash_trainer.files.writable import check_creatable, check_new_file

    try:
        check_new_file(json_out, "--json")
        if out is not None:
            check_creatable(out, "--out")
        if target_used:
            check_target(target)
            check_chat_file(data)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


def _check_trace(path: Optional[str]) -> None:
    """--profile-trace: a writable file path (checked before anything loads)."""
    from dflash_trainer.files.writable import check_new_file

    try:
        check_new_file(path, "--profile-trace")
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


def _emit(result: dict, json_out: Optional[str]) -> None:
    text = json.dumps(result, indent=2, default=str)
    if json_out:
        Path(json_out).write_text(text + "\n")
    console.print_json(text)


def _print_breakdown(result: dict) -> None:
    """The time breakdown as a table after the JSON (the last thing a log shows), with the target's
    provenance when it is not the real one."""
    from dflash_trainer.telemetry.breakdown import format_table

    note = (result.get("target") or {}).get("note")
    if note and (result.get("target") or {}).get("source") == "random":
        console.print(f"[yellow]warning:[/] {note}", highlight=False)
    if result.get("breakdown"):
        console.print(format_table(result["breakdown"]), highlight=False, markup=False)


@bench_app.command("regenerate")
def bench_regenerate_cmd(
    target: Annotated[Optional[str], typer.Option(help="Target: HF folder or .gguf file (default: embedded SmolLM2).")] = None,
    data: Annotated[Optional[str], typer.Option(help="Chat file for the prompts (default: embedded ShareGPT).")] = None,
    num_prompts: int = 1024, slots: int = 512, max_new_tokens: int = 256, max_prompt_tokens: int = 1024,
    hf_batch1_prompts: int = 4,
    hf_batch: Annotated[Optional[int], typer.Option(help="Batch of the HF generate baseline (default: --slots).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 = sampling (both generators).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus of the sampling (both generators).")] = 1.0,
    loop_ngram: Annotated[Optional[int], typer.Option(help="Our loop guard (HF generate has none).")] = None,
    shortest_first: Annotated[bool, typer.Option("--shortest-first", help="Our rows take the shortest waiting prompts first.")] = False,
    row_attention: Annotated[Optional[bool], typer.Option("--row-attention/--no-row-attention", help="Our decode steps attend each row's own slots (decoding/row_attention.py; default: as `regenerate`, on where its kernel runs).")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the result to this file.")] = None,
    verbose: Verbose = False,
) -> None:
    """Generated tokens/s: continuous batching against HF generate at batch 1 and at the same batch."""
    _check_paths(json_out, target=target, data=data, target_used=True)
    set_library_bars(verbose)
    device = _bench_device()
    from dflash_trainer.bench.regenerate import run

    _emit(run(target, data, num_prompts=num_prompts, slots=slots, max_new_tokens=max_new_tokens,
              max_prompt_tokens=max_prompt_tokens, hf_batch1_prompts=hf_batch1_prompts, hf_batch=hf_batch,
              temperature=temperature, top_p=top_p, loop_ngram=loop_ngram, shortest_first=shortest_first,
              row_attention=row_attention, device=device), json_out)


@bench_app.command("regen-shapes")
def bench_regen_shapes_cmd(
    shapes: Annotated[str, typer.Option(help="Comma-separated random-weight target shapes, the first the reference: "
                                             "smollm2-135m, qwen2.5-0.5b, qwen3-1.7b, qwen3-8b (tiny: a CPU check).")]
    = "smollm2-135m,qwen2.5-0.5b,qwen3-1.7b,qwen3-8b",
    rows: Annotated[Optional[int], typer.Option(help="Rows of the continuous batch (default: the recipe plan's "
                                                     "for each shape on this card's free memory).")] = None,
    new_tokens: Annotated[int, typer.Option(help="Tokens each prompt generates (1 … 512, the recipe's most).")] = 128,
    device: Annotated[str, typer.Option(help="cuda (the numbers that count) | cpu (a check of the code path).")] = "cuda",
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the result to this file.")] = None,
) -> None:
    """Regeneration decode rate (generated tok/s) per target shape, at the plan's rows: the ratios the recipe's
    plan scales SmolLM2's measured rate by (bench/regen_shapes.py)."""
    _check_paths(json_out)
    names = [s.strip() for s in shapes.split(",") if s.strip()]
    from dflash_trainer.bench.regen_shapes import NEW_TOKENS, SHAPES

    bad = [n for n in names if n not in SHAPES]
    if not names or bad:
        _fail(f"--shapes {shapes!r}: use names from {', '.join(SHAPES)}")
    if rows is not None and rows < 1:
        _fail(f"--rows {rows}: must be at least 1")
    if not 1 <= new_tokens <= NEW_TOKENS:
        _fail(f"--new-tokens {new_tokens}: must lie in [1, {NEW_TOKENS}]")
    if device not in ("cuda", "cpu"):
        _fail(f"--device {device!r}: use cuda or cpu")
    if device == "cpu" and names != ["tiny"]:
        _fail(f"--device cpu checks the code path with --shapes tiny only (the other shapes are GPU-sized: an "
              f"8B fp32 model takes 33 GB of host memory)")
    import torch

    from dflash_trainer.bench.regen_shapes import bench_regen_shapes

    dev = _bench_device() if device == "cuda" else torch.device("cpu")
    _emit(bench_regen_shapes(names, device=dev, rows=rows, new_tokens=new_tokens), json_out)


@bench_app.command("mask")
def bench_mask_cmd(
    seq_len: int = 8192, num_anchors: int = 512, block_size: int = 16, layers: int = 5,
    layer_types: str = "last-full", sliding_window: int = 2048,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the result to this file.")] = None,
) -> None:
    """Direct on-device BlockMask build vs torch's compiled create_block_mask (reference config by default)."""
    _check_paths(json_out)
    dev = _bench_device()
    from dflash_trainer.bench.step import bench_mask

    _emit(bench_mask(_bench_shape(seq_len, num_anchors, block_size, layers, layer_types, sliding_window), dev), json_out)


@bench_app.command("step")
def bench_step_cmd(
    config: Annotated[Optional[str], typer.Option("--config", help="Bench this training config's step (YAML, as `train --config`): its drafter, objective, rows_per_step × seq_len rows and its target; the shape flags below then override its fields.")] = None,
    target: Annotated[Optional[str], typer.Option(help="With --config: the target (HF folder or .gguf; default: the config's, else the embedded SmolLM2). One that cannot be loaded is replaced by a random-weight model of its shape, said in the JSON.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="With --config: override a config field, e.g. --set optim.rows_per_step=4.")] = None,
    docs: Annotated[int, typer.Option(help="With --config: documents per synthetic packed row.")] = 8,
    seq_len: Annotated[Optional[int], typer.Option(help="T (reference: 8192).")] = None,
    num_anchors: Annotated[Optional[int], typer.Option(help="Anchors per row (reference: 512).")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="B (reference: 16).")] = None,
    layers: Annotated[Optional[int], typer.Option(help="Drafter layers (reference: 5).")] = None,
    layer_types: Annotated[Optional[str], typer.Option(help="all-swa | last-full | full | comma list (reference: last-full).")] = None,
    sliding_window: Annotated[Optional[int], typer.Option(help="W of sliding layers (reference: 2048).")] = None,
    iters: int = 20, warmup: int = 6,
    compile_layers: Annotated[Optional[bool], typer.Option("--compile-layers/--no-compile-layers", help="Compiled drafter layers and loss (default: on; with --config the config's `compile`).")] = None,
    checkpoint_layers: Annotated[Optional[str], typer.Option(help="none | all | comma list of layer indices (default none; with --config the config's).")] = None,
    loss_chunk: Optional[int] = None,
    loss_impl: Annotated[Optional[str], typer.Option(help="LM head + loss gradient: autograd | fused (config field loss_impl; default: training's, with --config the config's).")] = None,
    fp8: Annotated[Optional[str], typer.Option(help=FP8_HELP)] = None,
    profile_steps: Annotated[int, typer.Option(help="Steps profiled for the time breakdown by section (0 = no breakdown).")] = 6,
    profile_trace: Annotated[Optional[str], typer.Option(help="Also write the profiled steps as a Chrome trace (JSON) to this file.")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the result to this file.")] = None,
    verbose: Verbose = False,
) -> None:
    """Full drafter training step: step time, context tok/s, MFU vs a bf16 matmul, GPU-busy %, peak memory, and
    where the step's time goes (target forward, drafter forward, LM head + loss, backward, optimizer, masks, other)."""
    _check_paths(json_out)
    _check_trace(profile_trace)
    if profile_steps < 0 or iters < 1 or warmup < 0 or docs < 1:
        _fail("--profile-steps and --warmup must be at least 0, --iters and --docs at least 1")
    if loss_impl not in (None, "autograd", "fused"):
        _fail(f"--loss-impl {loss_impl}: use autograd or fused")
    if config is None and (target is not None or set_):
        _fail("--target and --set need --config (the reference bench has no target model); e.g. "
              "--config configs/smollm2-h200-onpolicy.yaml (the reference bench takes --fp8 for the fp8 setting)")
    _check_fp8(fp8)
    cfg = None
    if config is not None:  # read and checked before anything heavy loads
        from dflash_trainer.config.load import load_config

        flags = dict(seq_len=seq_len, num_anchors=num_anchors, block_size=block_size, num_layers=layers,
                     layer_types=layer_types, sliding_window=sliding_window, compile=compile_layers,
                     checkpoint_layers=checkpoint_layers, loss_chunk=loss_chunk, loss_impl=loss_impl, fp8=fp8,
                     device="cuda")
        try:
            cfg = load_config(config, flags, set_)
        except (ValueError, FileNotFoundError) as e:
            _fail(str(e))
            return
        if docs > cfg.data.seq_len:
            _fail(f"--docs {docs}: more documents than seq_len={cfg.data.seq_len} tokens per row")
        _check_fp8(cfg.experimental.fp8)
    set_library_bars(verbose)
    dev = _bench_device()
    from dflash_trainer.bench.step import bench_step, bench_step_config

    if cfg is None:
        ck = checkpoint_layers or "none"
        ck = None if ck == "none" else ("all" if ck == "all" else [int(x) for x in ck.split(",")])
        shape = _bench_shape(seq_len or 8192, num_anchors or 512, block_size or 16, layers or 5,
                             layer_types or "last-full", sliding_window or 2048)
        result = bench_step(shape, dev, warmup=warmup, iters=iters, compile_layers=compile_layers is not False,
                            checkpoint_layers=ck, loss_chunk=loss_chunk, loss_impl=loss_impl,
                            profile_steps=profile_steps, trace=profile_trace, fp8=fp8 or "off")
    else:
        try:
            result = bench_step_config(cfg, dev, target=target, config_file=config, num_documents=docs,
                                       warmup=warmup, iters=iters, profile_steps=profile_steps, trace=profile_trace)
        except ValueError as e:
            _fail(str(e))
            return
    _emit(result, json_out)
    _print_breakdown(result)


@bench_app.command("colocated")
def bench_colocated_cmd(
    steps: int = 40, warmup_steps: int = 10, overlap: bool = True,
    target_attention: Annotated[str, typer.Option(help="Target attention: auto (flex on CUDA) | flex | sdpa | eager.")] = "auto",
    target_compile: Annotated[bool, typer.Option(help="Compiled target layers on the flex path (the training default).")] = True,
    out: Annotated[str, typer.Option(help="Run folder of the benchmark (synthetic rows, metrics).")] = "/tmp/dflash-bench-colocated",
    profile_steps: Annotated[int, typer.Option(help="Steps of the profiled feed + step stretch (GPU-busy %, time breakdown by section).")] = 6,
    profile_trace: Annotated[Optional[str], typer.Option(help="Also write the profiled stretch as a Chrome trace (JSON) to this file.")] = None,
    fp8: Annotated[str, typer.Option(help=FP8_HELP)] = "off",
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the result to this file.")] = None,
    verbose: Verbose = False,
) -> None:
    """Target + drafter on one GPU: end-to-end tok/s against 1/(1/target + 1/drafter) measured standalone, GPU-busy %,
    and where a co-located step's time goes by section."""
    _check_paths(json_out, out=out)
    _check_trace(profile_trace)
    _check_fp8(fp8)
    if not 1 <= profile_steps <= steps:
        _fail(f"--profile-steps {profile_steps}: must lie in [1, --steps {steps}]")
    set_library_bars(verbose)
    _bench_device()
    from dflash_trainer.bench.colocated import bench_colocated

    result = bench_colocated(Path(out), steps=steps, warmup_steps=warmup_steps, overlap=overlap,
                             target_attention=target_attention, target_compile=target_compile,
                             profile_steps=profile_steps, trace=profile_trace, fp8=fp8)
    _emit(result, json_out)
    _print_breakdown(result)


@bench_app.command("pipeline")
def bench_pipeline_cmd(
    steps: int = 40, warmup_steps: int = 12, queue_depth: int = 2,
    gpus: Annotated[Optional[str], typer.Option(help="Split these GPUs automatically (as `train --gpus`, e.g. 0-7) instead of cuda:0 + cuda:1.")] = None,
    out: Annotated[str, typer.Option(help="Run folder of the benchmark (synthetic rows, metrics).")] = "/tmp/dflash-bench-pipeline",
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the result to this file.")] = None,
    verbose: Verbose = False,
) -> None:
    """1 target GPU (0) feeding 1 drafter GPU (1), or the split --gpus chooses: end-to-end tok/s against the
    target's standalone tok/s (and the projection of the chosen split), busy %."""
    _check_paths(json_out, out=out)
    set_library_bars(verbose)
    _bench_device()
    import torch

    from dflash_trainer.bench.pipeline import bench_pipeline
    from dflash_trainer.pipeline.launch import PipelineFailed

    if torch.cuda.device_count() < 2:
        _fail(f"bench pipeline needs 2 GPUs (target on cuda:0, drafter on cuda:1); {torch.cuda.device_count()} visible")
    try:
        result = bench_pipeline(Path(out), steps=steps, warmup_steps=warmup_steps, queue_depth=queue_depth, split=gpus)
    except (ValueError, PipelineFailed) as e:
        _fail(str(e))
        return
    _emit(result, json_out)


@bench_app.command("target")
def bench_target_cmd(
    device: Annotated[str, typer.Option(help="cuda (the numbers that count) | cpu (a check of the code path).")] = "cuda",
    shape: Annotated[str, typer.Option(help="Random-weight target shape: qwen3-8b | tiny.")] = "qwen3-8b",
    seq_len: Annotated[int, typer.Option(help="T: tokens per packed row (multiple of 128).")] = 8192,
    docs: Annotated[int, typer.Option(help="D: equal documents per row.")] = 8,
    rows: Annotated[int, typer.Option(help="R: rows per forward.")] = 1,
    iters: Annotated[int, typer.Option(help="Timed rounds (median).")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed calls of each variant first (flex compiles here).")] = 3,
    sliding_window: Annotated[Optional[int], typer.Option(help="Make every other target layer slide with this W.")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the result to this file.")] = None,
) -> None:
    """Target forward over packed rows: plain HF causal vs SDPA + dense mask vs flex + BlockMask, with and without labels."""
    _check_paths(json_out)
    if device not in ("cuda", "cpu"):
        _fail(f"--device {device!r}: use cuda or cpu")
    if shape not in ("qwen3-8b", "tiny"):
        _fail(f"--shape {shape!r}: use qwen3-8b or tiny")
    if seq_len < 128 or seq_len % 128:
        _fail(f"--seq-len {seq_len}: must be a positive multiple of 128 (flex tiles)")
    if not 1 <= docs <= seq_len or rows < 1 or iters < 1 or warmup < 0:
        _fail("--docs must lie in [1, seq-len]; --rows and --iters at least 1; --warmup at least 0")
    if sliding_window is not None and sliding_window < 1:
        _fail(f"--sliding-window {sliding_window}: must be at least 1")
    dev = _bench_device() if device == "cuda" else None
    import torch

    from dflash_trainer.bench.target import bench_target

    _emit(bench_target(device=dev or torch.device("cpu"), shape=shape, seq_len=seq_len, num_documents=docs, rows=rows,
                       iters=iters, warmup=warmup, sliding_window=sliding_window), json_out)
