"""`dflash-train`: prepare | train | init-config | bench.

User errors (bad config, bad data, missing files) print one clear line and exit 2; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train DFlash block drafters for a frozen target model.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks of the drafter step (GPU numbers are the ones that count).")
app.add_typer(bench_app, name="bench")
console = Console()


def _fail(msg: str) -> None:
    console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code=2)


@app.command()
def train(
    out: Annotated[Optional[str], typer.Option(help="Run directory.")] = None,
    config: Annotated[Optional[str], typer.Option(help="YAML config file (fields of TrainConfig).")] = None,
    target: Annotated[Optional[str], typer.Option(help="Target: HF folder or .gguf file (default: embedded SmolLM2).")] = None,
    data: Annotated[Optional[str], typer.Option(help="Chat data JSON/JSONL (default: embedded ShareGPT).")] = None,
    prepared: Annotated[Optional[str], typer.Option(help="Folder from `dflash-train prepare` (skips preparation).")] = None,
    drafter_config: Annotated[Optional[str], typer.Option(help="Drafter config JSON from `init-config`.")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Optimizer steps.")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto | cpu | cuda")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed for data order, anchors and init.")] = None,
    log_every: Annotated[Optional[int], typer.Option(help="Steps between metric logs.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override any config field: --set seq_len=1024")] = None,
) -> None:
    """Train a drafter (co-located target + drafter on one device). Writes OUT/metrics.jsonl and OUT/checkpoint-final/."""
    from dflash_trainer.config import load_config
    from dflash_trainer.training.run import train as run_train

    try:
        cfg = load_config(config, {"out": out, "target": target, "data": data, "prepared": prepared,
                                   "drafter_config": drafter_config, "max_steps": max_steps, "device": device,
                                   "seed": seed, "log_every": log_every}, set_)
        result = run_train(cfg, console)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    v = result.validation
    console.print("\n[bold]summary[/]")
    console.print(f"  steps {result.steps}, {result.tokens:,} context tokens, {result.train_tok_per_s:,.0f} tok/s, wall {result.wall_s:.0f} s")
    if result.first_loss is not None:
        console.print(f"  train loss {result.first_loss:.3f} (first log) → {result.last_loss:.3f} (last log)")
    if v:
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in v["acc_per_position"])
        console.print(f"  validation loss {v['loss']:.3f}, τ exact {v['tau_exact']:.2f}, τ estimate {v['tau_estimate']:.2f}")
        console.print(f"  validation acc per position: [{acc}]")
    console.print(f"  checkpoint {result.checkpoint}")


@app.command()
def prepare(
    out: Annotated[str, typer.Option(help="Output folder (train/, validation/, prepare_report.json).")],
    data: Annotated[Optional[str], typer.Option(help="Chat data JSON/JSONL (default: embedded ShareGPT).")] = None,
    target: Annotated[Optional[str], typer.Option(help="Target whose tokenizer and chat template are used.")] = None,
    seq_len: Annotated[int, typer.Option(help="T: tokens per packed row.")] = 512,
    max_conversations: Annotated[Optional[int], typer.Option(help="Read at most this many usable conversations.")] = None,
    validation_fraction: Annotated[float, typer.Option(help="Held-out fraction of conversations.")] = 0.02,
    seed: Annotated[int, typer.Option(help="Seed of split and packing order.")] = 0,
    chat_template: Annotated[Optional[str], typer.Option(help="Jinja chat template file (overrides the tokenizer's).")] = None,
    enable_thinking: Annotated[Optional[bool], typer.Option(help="Thinking flag passed to the template.")] = None,
) -> None:
    """Tokenize chats with the target's template, mask all but assistant tokens, pack rows of T tokens."""
    from dflash_trainer.data.prepare import prepare_dataset
    from dflash_trainer.data.sources import default_sharegpt_path
    from dflash_trainer.target.load import load_tokenizer

    try:
        tok = load_tokenizer(target)
        report = prepare_dataset(data or str(default_sharegpt_path()), tok, Path(out), seq_len=seq_len,
                                 max_conversations=max_conversations, validation_fraction=validation_fraction, seed=seed,
                                 chat_template=Path(chat_template).read_text() if chat_template else None,
                                 enable_thinking=enable_thinking)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    body = report.model_dump() if hasattr(report, "model_dump") else getattr(report, "__dict__", report)
    console.print_json(json.dumps(body, default=str))


def _bench_shape(seq_len: int, num_anchors: int, block_size: int, layers: int, layer_types: str, window: int):
    from dflash_trainer.bench.common import BenchShape

    return BenchShape(seq_len=seq_len, num_anchors=num_anchors, block_size=block_size, num_layers=layers,
                      layer_types=layer_types, sliding_window=window)


def _bench_device():
    import torch

    if not torch.cuda.is_available():
        _fail("bench needs a CUDA device (the numbers are GPU numbers)")
    return torch.device("cuda")


def _emit(result: dict, json_out: Optional[str]) -> None:
    text = json.dumps(result, indent=2, default=str)
    if json_out:
        Path(json_out).write_text(text + "\n")
    console.print_json(text)


@bench_app.command("mask")
def bench_mask_cmd(
    seq_len: int = 8192, num_anchors: int = 512, block_size: int = 16, layers: int = 5,
    layer_types: str = "last-full", sliding_window: int = 2048,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the result to this file.")] = None,
) -> None:
    """Direct on-device BlockMask build vs torch's compiled create_block_mask (reference config by default)."""
    from dflash_trainer.bench.step import bench_mask

    dev = _bench_device()
    _emit(bench_mask(_bench_shape(seq_len, num_anchors, block_size, layers, layer_types, sliding_window), dev), json_out)


@bench_app.command("step")
def bench_step_cmd(
    seq_len: int = 8192, num_anchors: int = 512, block_size: int = 16, layers: int = 5,
    layer_types: str = "last-full", sliding_window: int = 2048, iters: int = 20,
    compile_layers: bool = True, checkpoint_layers: str = "none", loss_chunk: Optional[int] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the result to this file.")] = None,
) -> None:
    """Full drafter training step: step time, context tok/s, MFU vs a bf16 matmul, GPU-busy %, peak memory."""
    from dflash_trainer.bench.step import bench_step

    dev = _bench_device()
    ck = None if checkpoint_layers == "none" else ("all" if checkpoint_layers == "all" else [int(x) for x in checkpoint_layers.split(",")])
    _emit(bench_step(_bench_shape(seq_len, num_anchors, block_size, layers, layer_types, sliding_window), dev,
                     iters=iters, compile_layers=compile_layers, checkpoint_layers=ck, loss_chunk=loss_chunk), json_out)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
