"""Where a regeneration decode step spends its time (decoding/continuous.py, the recipe's regenerate stage).

    python benchmarks/regen_profile.py --out DIR [--rows 1024] [--warm-polls 24] [--row-attention] [--tiny]

Target: a random-weight SmolLM2-135M-shaped Llama in bf16 (the time of a step does not depend on the
weights). The generator is the recipe's (1,536 prompt + 512 new tokens a row, the H100 plan's 1,024 rows,
greedy; no loop guard and no end-of-sequence id, which a random model's repetitive output would make
meaningless), one prompt per row. The rows start together, so after `--warm-polls` polls (16 steps each) every
row is that many tokens into its answer. The prompt lengths are drawn so that this state attends what the
2026-12-07 regeneration did on average: 95 % of prompts 64 – 350 tokens and 5 % 700 – 1,100. That gives about
370 slots a row needs at 8 polls, against the run's 336 – 355, and a shared span of 1,280 (the ladder rung
above the longest row), against the run's mean of 1,220. Then, at that span:
  replays: `--steps` back-to-back replays of the step's CUDA graph, profiled (kernels by device time)
  eager:   4 eager steps (`_advance`, what the graph captured), profiled by aten op and input shapes
Writes DIR/regen-profile.json (the state: live rows, span, slots a row needs, span efficiency; ms per replayed
and eager step; the profiles' summaries) and DIR/{replays,eager}.txt (the tables). --row-attention: the
generator's per-row attention (decoding/row_attention.py), each row reading its own slots (one graph at
the full 2,048). --tiny: a 2-layer model, a CPU smoke run of this script.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_profile import eager_ms, profiled, smollm2_shaped, sync, timed_replays  # noqa: E402

from dflash_trainer.decoding.continuous import ContinuousGenerator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--warm-polls", type=int, default=8, help="polls (16 steps each) before the profile")
    ap.add_argument("--steps", type=int, default=16, help="steps profiled per mode")
    ap.add_argument("--row-attention", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bundle = smollm2_shaped(device, dtype, args.tiny)
    R, K = args.rows, args.steps
    g = torch.Generator().manual_seed(0)
    short, long_ = (64, 350), (700, 1100)
    if args.tiny:
        short, long_ = (8, 24), (40, 60)
    lengths = [int(torch.randint(*(long_ if torch.rand((), generator=g) < 0.05 else short), (), generator=g))
               for _ in range(R)]
    never = bundle.vocab_size + 7
    gen = ContinuousGenerator(bundle, slots=R, max_prompt_tokens=1536, max_new_tokens=512, eos_ids={never},
                              row_attention=args.row_attention, overlap=False)
    for i, n in enumerate(lengths):
        gen.submit(i, torch.randint(3, bundle.vocab_size - 1, (n,), generator=g).tolist())
    t0 = time.perf_counter()
    for _ in range(args.warm_polls):
        gen.poll()
    sync(device)
    warm_s = time.perf_counter() - t0
    live = [b for b, k in zip(gen.bound, gen.keys) if k is not None]
    need, span = gen._span(live)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "rows": R, "live_rows": len(live), "span": span, "needed_span": need,
            "mean_row_slots": sum(live) / max(len(live), 1), "warm_polls": args.warm_polls,
            "warm_ms_per_step_with_prefill": warm_s * 1e3 / max(gen.steps, 1), "cuda_graphs": bool(gen.graphs),
            "row_attention": args.row_attention}
    # the slots a step reads per row: the shared span, or (row attention) each row's own
    info["read_slots_per_row"] = info["mean_row_slots"] if args.row_attention else span
    info["span_efficiency"] = info["mean_row_slots"] / info["read_slots_per_row"]
    print(json.dumps(info), flush=True)
    if gen.graphs:
        graph = gen.graphs[span]
        info["replay_ms"] = timed_replays(graph, K, device)
        info["replays"] = profiled("replays", out, lambda: [graph.replay() for _ in range(K)], K, device, traces=False)
    step = (lambda: gen._advance(span))
    info["eager_ms"] = eager_ms(step, 4, device)
    info["eager"] = profiled("eager", out, lambda: [step() for _ in range(4)], 4, device, by_op=True, traces=False)
    (out / "regen-profile.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"rows {R} ({len(live)} live), reads {info['read_slots_per_row']:.0f} slots a row (needed at most {need}, "
          f"mean {info['mean_row_slots']:.0f}): "
          f"replay {info.get('replay_ms', float('nan')):.2f} ms a step, eager {info['eager_ms']:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
