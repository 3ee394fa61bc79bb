"""Pipeline benchmark: 1 target GPU feeding 1 drafter GPU at the reference configuration.

    python -m dflash_trainer.bench.pipeline --out /tmp/pipe --json pipeline.json

Target: a random-weight Qwen3-8B-shaped model (36 layers, H 4096, 32/8 heads, MLP 12288, vocab
151936) built in bf16 directly on its GPU. Drafter: bench.common.BenchShape (5 layers, k = 5,
T = 8192 packed rows of 8 documents, 512 anchors, B = 16). Both run the real pipeline code
(pipeline/launch.py) over synthetic rows.

Reported (one run, same processes):
  target_standalone_tok_per_s  the target rank's own forward + labels on one row, timed with CUDA
                               events before its loop (median of `probe_iters`)
  end_to_end_tok_per_s         trained context tokens per second on the drafter, over the logged
                               intervals after `warmup_steps` (host clock between synced log points)
  ratio                        end_to_end / target_standalone (1.0 = the target never waits)
  drafter_busy_pct             CUDA-event busy fraction of the drafter's compute stream over the same
                               intervals; nvml_util_pct where NVML answers
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.bench.common import BenchShape, synthetic_rows


def qwen3_8b_fields() -> dict[str, Any]:
    """Qwen3Config fields of the Qwen3-8B shape (random weights; speed does not depend on values)."""
    return dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02)


def write_rows(folder: Path, shape: BenchShape, num_rows: int) -> Path:
    """Synthetic packed rows as a prepared folder (train/ and validation/)."""
    from datasets import Dataset

    rows = synthetic_rows(shape, torch.device("cpu"), seed=0, rows=num_rows)
    body = {"input_ids": rows["input_ids"].int().numpy(), "loss_mask": rows["loss_mask"].to(torch.int8).numpy(),
            "position_ids": rows["position_ids"].int().numpy()}
    Dataset.from_dict({k: list(v) for k, v in body.items()}).save_to_disk(str(folder / "train"))
    Dataset.from_dict({k: list(v[:1]) for k, v in body.items()}).save_to_disk(str(folder / "validation"))
    return folder


def bench_run_config(out: Path, shape: BenchShape, steps: int, log_every: int, **fields: Any):
    """A TrainConfig over `steps` synthetic rows of `shape` written to out/data, drafter config
    out/drafter.json, run folder out/run; `fields` add or override config fields."""
    from dflash_trainer.config.schema import TrainConfig

    out.mkdir(parents=True, exist_ok=True)
    prepared = write_rows(out / "data", shape, num_rows=steps)
    (out / "drafter.json").write_text(shape.drafter_config().model_dump_json())
    return TrainConfig(**{**dict(out=str(out / "run"), prepared=str(prepared), drafter_config=str(out / "drafter.json"),
                                 seq_len=shape.seq_len, num_anchors=shape.num_anchors, block_size=shape.block_size,
                                 max_steps=steps, log_every=log_every, resume="never"), **fields})


def steady_rate(records: list[dict[str, Any]], warmup_steps: int) -> float | None:
    """Context tokens per second over the metrics.jsonl intervals that end after `warmup_steps`
    (each record's tok_per_s covers the tokens since the previous record)."""
    pairs = [(p, r) for p, r in zip(records, records[1:]) if r["step"] > warmup_steps and r["tok_per_s"] > 0]
    secs = sum((r["tokens"] - p["tokens"]) / r["tok_per_s"] for p, r in pairs)
    return sum(r["tokens"] - p["tokens"] for p, r in pairs) / secs if secs else None


def bench_pipeline(out: Path, *, steps: int = 48, warmup_steps: int = 16, log_every: int = 4, queue_depth: int = 2,
                   target_gpu: int = 0, drafter_gpu: int = 1, split: str | None = None, probe_iters: int = 5,
                   shape: BenchShape | None = None, target_fields: dict[str, Any] | None = None,
                   cpu: bool = False) -> dict[str, Any]:
    """Run the pipeline benchmark in `out`. shape / target_fields / cpu shrink it for a CPU check of the
    code path (then one target and one drafter process on the CPU). split: GPUs to split
    automatically instead of target_gpu + drafter_gpu (`train --gpus`; with cpu, a process count
    as for `--procs`); the result then holds the measured rates, the choice and end-to-end / projected."""
    from dflash_trainer.pipeline.launch import PipelineOptions, RandomTarget, run_pipeline

    shape = shape or BenchShape()
    target_fields = target_fields or qwen3_8b_fields()
    if split is not None:
        layout: dict[str, Any] = {"procs": int(split), "device": "cpu"} if cpu else {"gpus": split, "device": "cuda"}
    elif cpu:
        layout = {"target_procs": 1, "drafter_procs": 1, "device": "cpu"}
    else:
        layout = {"target_gpus": str(target_gpu), "drafter_gpus": str(drafter_gpu), "device": "cuda"}
    cfg = bench_run_config(out, shape, steps, log_every, queue_depth=queue_depth, comm_timeout_s=300.0, **layout)
    t0 = time.perf_counter()
    run_pipeline(cfg, options=PipelineOptions(target_source=RandomTarget("qwen3", target_fields, seed=0),
                                              probe_target_iters=probe_iters, save_final=False, status_every_s=15 if not cpu else 2))
    wall = time.perf_counter() - t0
    run = Path(cfg.out)
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = [r for r in records if r["step"] > warmup_steps]

    def role_mean(role: str, key: str) -> float | None:
        vals = [(x[key], x["seconds"]) for r in steady for x in r["ranks"] if x["role"] == role and x[key] is not None]
        w = sum(s for _, s in vals)
        return sum(v * s for v, s in vals) / w if w else None

    probe = summary["target_probe"].get("0", {})
    e2e = steady_rate(records, warmup_steps)
    standalone = probe.get("tok_per_s")
    lay = summary["layout"]
    auto = json.loads((run / "auto_split.json").read_text()) if split is not None else None
    projected = auto["chosen"]["projected_tok_per_s"] if auto else None
    return {
        "what": f"pipeline {lay['num_targets']} target + {lay['num_drafters']} drafter "
                f"{'processes' if cpu else 'GPUs'}{' (split measured and chosen)' if auto else ''}, Qwen3-8B-shaped "
                "random target, reference drafter",
        "auto_split": auto, "projected_tok_per_s": projected,
        "ratio_end_to_end_over_projected": (e2e / projected) if e2e and projected else None,
        "shape": shape.__dict__, "steps": steps, "warmup_steps": warmup_steps, "queue_depth": queue_depth,
        "target_standalone_tok_per_s": standalone, "target_forward_ms_median": probe.get("forward_ms_median"),
        "end_to_end_tok_per_s": e2e, "ratio_end_to_end_over_target": (e2e / standalone) if e2e and standalone else None,
        "drafter_busy_pct": role_mean("drafter", "busy_pct"), "drafter_nvml_util_pct": role_mean("drafter", "nvml_util_pct"),
        "target_busy_pct": role_mean("target", "busy_pct"), "target_nvml_util_pct": role_mean("target", "nvml_util_pct"),
        "drafter_wait_pct": role_mean("drafter", "wait_pct"), "target_wait_pct": role_mean("target", "wait_pct"),
        "drafter_transfer_pct": role_mean("drafter", "transfer_pct"),
        "drafter_queue_occupancy": role_mean("drafter", "occupancy_mean"),
        "intervals": [{"step": r["step"], "tok_per_s": r["tok_per_s"], "ranks": r["ranks"]} for r in records],
        "first_loss": summary["first_loss"], "last_loss": summary["last_loss"], "wall_s": wall,
        "device_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if not cpu else [],
        "torch": torch.__version__,
    }


def main() -> None:  # pragma: no cover - GPU entry
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/dflash-bench-pipeline")
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup-steps", type=int, default=16)
    args = ap.parse_args()
    result = bench_pipeline(Path(args.out), steps=args.steps, warmup_steps=args.warmup_steps)
    text = json.dumps(result, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("intervals", "shape")}, indent=2, default=str))


if __name__ == "__main__":  # pragma: no cover
    main()
