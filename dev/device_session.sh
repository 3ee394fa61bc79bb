#!/usr/bin/env bash
# GPU run: sync-free step test, mask and step benchmarks (reference config), and the default
# training run with --device cuda. Expects the SmolLM2 GGUF at $GGUF and prepared rows at $PREPARED.
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_masks.py -k "cuda or gpu or sync" 2>&1 | tail -2
timeout 170 python3 -m dflash_trainer.cli.main bench mask --json "$OUT/bench_mask_h200.json" > "$OUT/bench_mask.log" 2>&1; echo "bench mask rc=$?"
timeout 200 python3 -m dflash_trainer.cli.main train --config configs/smoke-cpu.yaml --device cuda --prepared "$PREPARED" --target "$GGUF" --out "$OUT/run" > "$OUT/train_cuda.log" 2>&1; echo "train rc=$?"
grep -v "Converting\|Loading weights" "$OUT/train_cuda.log" | tail -14
timeout 200 python3 -m dflash_trainer.cli.main bench step --json "$OUT/bench_step_h200.json" > "$OUT/bench_step.log" 2>&1; echo "bench step rc=$?"
python3 - "$OUT" <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
for f in ("bench_mask_h200.json", "bench_step_h200.json"):
    p = o / f
    if p.exists():
        d = json.loads(p.read_text()); d.pop("step_ms_all", None); d.pop("shape", None); print(f, json.dumps(d))
    else:
        print(f, "missing")
PY
