"""Does the speedup table's order of runs change what it measures? At each batch size b, the rows of the table
(evaluation/speedup.py `table_rows`: MT-Bench first turns cycled to at least 4 · b) are decoded by one engine as
a continuous batch, after its warm-up, in the order `--order` gives, plain first (default: plain; all B−1 drafts
twice; draft length k twice; all drafts once more). Each run's steady tokens per second (decoding/stream.py), its
wall time and the allocator's device allocations during it are recorded, so a first run slower than the same run
repeated shows a one-time cost inside the timed window. A run named `w<run>` (wplain, wfull, wk) decodes only the
first 2·b rows: a shorter warm-up stream, recorded (tokens, tokens_per_s, wall_s) but not compared, whose effect
on the next run is what it measures.

    python benchmarks/speedup_order.py --drafter PATH --out FILE.json [--batch-sizes 16,64] [--k 7]
        [--order plain,full,full,k,k,full] [--max-new-tokens 256] [--max-prompts 80] [--dtype bfloat16]

Target: the embedded SmolLM2 (CUDA: bf16, the table's dtype; CPU: fp32). The recorded JSON holds the device,
versions, settings and one record per (batch size, run): order (0-based over every run), run (its --order name),
device_allocs, mode, draft_length, tokens, tokens_per_s (steady),
wall_s, steady_tokens, steady_s, tau, tau_uncapped, lossless (against the plain run) and speedup over the plain run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflash_trainer.data.render import eos_token_ids, render_prompt  # noqa: E402
from dflash_trainer.data.suites import load_suite  # noqa: E402
from dflash_trainer.data.tokenize import resolve_chat_template  # noqa: E402
from dflash_trainer.decoding.engine import DecodeEngine  # noqa: E402
from dflash_trainer.decoding.stream import decode_stream  # noqa: E402
from dflash_trainer.evaluation.load import build_drafter, load_drafter_checkpoint  # noqa: E402
from dflash_trainer.evaluation.speedup import stream_record, table_rows  # noqa: E402
from dflash_trainer.target_model.load import load_target  # noqa: E402
from dflash_trainer.telemetry.provenance import provenance  # noqa: E402

ORDER = "plain,full,full,k,k,full"
RUNS = ("plain", "full", "k")


def run_record(run, ref, mode: str, k: int, plain_tps: float) -> dict:
    """One run's numbers (`run`, `ref`: decoding/stream.Streamed; `ref` the plain run of the same rows):
    evaluation/speedup.stream_record's, less the accepted counts, with the draft length and the speedup."""
    rec = {k_: v for k_, v in stream_record(run, ref, 0.0).items() if k_ != "accepted"}
    return {"mode": mode, "draft_length": k, **rec, "speedup": rec["tokens_per_s"] / plain_tps}


def run_words(x: dict) -> str:
    """One record in the printed line: run, draft length, speedup (or warm-up), device allocations."""
    speed = f"{x['speedup']:.2f}×" if "speedup" in x else "warm-up"
    return f"{x['run']} k={x['draft_length']} {speed} ({x['device_allocs']} allocs)"


def device_allocs() -> int:
    """The caching allocator's device allocations so far (cudaMalloc calls; 0 on the CPU)."""
    return torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_available() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", required=True, help="drafter checkpoint or export folder")
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--k", type=int, default=7, help="the shorter draft length measured")
    ap.add_argument("--order", default=ORDER, help="runs in order: plain, full, k, or w+one of them (2·b rows)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompts", type=int, default=0, help="MT-Bench prompts (0 = all 80)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    args = ap.parse_args()
    order = args.order.split(",")
    bad = [n for n in order if n.removeprefix("w") not in RUNS]
    if bad:
        raise SystemExit(f"--order {args.order}: unknown runs {bad}; use plain, full, k or w+one of them")
    if order[0] != "plain":
        raise SystemExit(f"--order {args.order}: start with plain (every later run is checked against it)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    target = load_target(None, device=device, dtype=dtype)
    ckpt = load_drafter_checkpoint(args.drafter, num_target_layers=target.num_layers)
    drafter = build_drafter(ckpt, target)
    template = ckpt.chat_template or resolve_chat_template(target.tokenizer)
    prompts = [render_prompt(target.tokenizer, template, p.messages([]), ckpt.enable_thinking)
               for p in load_suite("mt-bench", args.max_prompts or None)]
    records = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        rows = table_rows(prompts, b)
        engine = DecodeEngine(target, drafter, rows=b, max_prompt_tokens=max(map(len, rows)),
                              max_new_tokens=args.max_new_tokens, eos_ids=eos_token_ids(target))
        full = engine.B - 1
        engine.warm_up(rows[0])
        t0 = time.perf_counter()
        plain_tps, current = None, full
        for step, name in enumerate(order):
            warm, which = name.startswith("w"), name.removeprefix("w")
            run_rows = rows[:2 * b] if warm else rows
            k = {"plain": 0, "full": full, "k": args.k}[which]
            if which != "plain" and k != current:  # as the table does for its chosen k: set, then one warm-up decode
                engine.set_draft_length(k)
                engine.warm_up(rows[0])
                current = k
            allocs = device_allocs()
            run = decode_stream(engine, run_rows, speculative=which != "plain")
            allocs = device_allocs() - allocs
            if plain_tps is None:  # the first run: plain (checked above)
                ref, plain_tps = run, run.tokens_per_s()
            if warm:  # a warm-up stream
                rec = {"mode": "warm-up", "draft_length": k, "tokens": sum(map(len, run.tokens)),
                       "tokens_per_s": run.tokens_per_s(), "wall_s": run.wall_s}
            else:
                rec = run_record(run, ref, "plain" if which == "plain" else "speculative", k, plain_tps)
            records.append({"batch_size": b, "rows": len(run_rows),
                            "order": step, "run": name, "device_allocs": allocs, **rec})
        r = [x for x in records if x["batch_size"] == b]
        print(f"batch {b} ({len(rows)} rows, {time.perf_counter() - t0:.1f} s): "
              + ", ".join(map(run_words, r)), flush=True)
        del engine
    info = {"what": "speedup-table run order (benchmarks/speedup_order.py)", "order": order,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "target_dtype": str(dtype).removeprefix("torch."), "drafter": Path(args.drafter).name,
            "block_size": drafter.config.block_size, "k": args.k, "max_new_tokens": args.max_new_tokens,
            "max_prompts": args.max_prompts or None, "prompts": len(prompts),
            "provenance": provenance(), "records": records}
    Path(args.out).write_text(json.dumps(info, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
