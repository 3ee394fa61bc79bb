"""`bench regenerate` for several generator settings with one target load (GPU runs).

Usage: python benchmarks/regen_variants.py OUT_DIR CHAT_FILE [TARGET [VARIANT,VARIANT...]]
Each variant's result is written to OUT_DIR/regen-<name>.json and summarized in one table; the
variants are the VARIANTS list below (slots, sampling, loop guard, HF baseline batch).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dflash_trainer.bench.regenerate import run
from dflash_trainer.target_model.load import load_target
from dflash_trainer.training import precision

COMMON = dict(num_prompts=16384, max_new_tokens=256, max_prompt_tokens=1024)
VARIANTS = {
    # the setting the recipe regenerates with: 2,048 rows, greedy, loop guard, shortest prompts first
    "greedy-2048-loop32-shortest": dict(slots=2048, loop_ngram=32, shortest_first=True, hf_batch=256,
                                        hf_batch1_prompts=1),
    # 1.5x the rows (the static cache is ~90 GB in bf16): does the step cost grow slower than the rows?
    "greedy-3072-loop32-shortest": dict(slots=3072, loop_ngram=32, shortest_first=True, hf_batch=256,
                                        hf_batch1_prompts=1),
    # the same with each row attending its own slots (span efficiency 0.32 with the shared span)
    "greedy-2048-loop32-shortest-rowattn": dict(slots=2048, loop_ngram=32, shortest_first=True, row_attention=True,
                                                hf_batch=256, hf_batch1_prompts=1),
    # the 2026-12-01 setting (512 rows, first come first served), for the ratio to it
    "greedy-512": dict(slots=512, hf_batch=512, hf_batch1_prompts=1),
    "sampled-2048-t07-p095-loop32-shortest": dict(slots=2048, temperature=0.7, top_p=0.95, loop_ngram=32,
                                                  shortest_first=True, hf_batch=256, hf_batch1_prompts=1),
}


def main() -> None:
    out, data = Path(sys.argv[1]), sys.argv[2]
    target = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    bundle = load_target(target, device=dev, dtype=precision.compute_dtype(dev))
    only = set(sys.argv[4].split(",")) if len(sys.argv) > 4 else None
    rows = []
    for name, kw in VARIANTS.items():
        if only and name not in only:
            continue
        res = run(target, data, device=dev, bundle=bundle, **COMMON, **kw)
        (out / f"regen-{name}.json").write_text(json.dumps(res, indent=2) + "\n")
        ours, hf = res["ours"], res["hf_generate_batch_slots"]
        rows.append((name, ours["tokens_per_s"], hf["tokens_per_s"], res["hf_generate_batch1"]["tokens_per_s"],
                     ours.get("looped"), ours.get("finished"), res["prompts"]))
        print(f"{name}: ours {ours['tokens_per_s']:,.0f} tok/s ({ours['tokens']} tokens, {ours['wall_s']:.1f} s, "
              f"looped {ours.get('looped')}, finished {ours.get('finished')}, spans {ours.get('span_steps')}, "
              f"{ours.get('generator_ratios')}); "
              f"HF batch {hf['prompts']} {hf['tokens_per_s']:,.0f}; HF batch 1 {res['hf_generate_batch1']['tokens_per_s']:.1f}",
              flush=True)
        torch.cuda.empty_cache()
    print("| variant | ours tok/s | HF same-run batch tok/s | HF batch-1 tok/s | looped | finished | prompts |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:,.0f} | {r[2]:,.0f} | {r[3]:.1f} | {r[4]} | {r[5]} | {r[6]} |")


if __name__ == "__main__":
    main()
