#!/usr/bin/env bash
# GPU run for the target paths on one H200: the GPU tests of the flex target path, then
# `bench target` at the Qwen3-8B shape (T=8192, 8 documents) and, with SLIDING=W, once more with
# every other layer sliding. Results in $OUT: bench-target_h200.json (+ _swa), logs.
# The image lacks pydantic: carry .stage1 with its wheels (see device_recipe.sh) on a bare machine.
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if ! python3 -c "import pydantic" 2>/dev/null && [ -d .stage1/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage1/whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_target_flex_cuda.py tests/gpu/test_target_feed.py 2>&1 | tail -4
timeout -k 15 ${LIMIT:-420} python3 -m dflash_trainer.cli.main bench target --device cuda --shape qwen3-8b --seq-len 8192 \
  --docs 8 --json "$OUT/bench-target_h200.json" > "$OUT/bench_target.log" 2>&1; echo "bench target rc=$?"
grep -v "^\s*$" "$OUT/bench_target.log" | tail -90
if [ -n "${SLIDING:-}" ]; then
  timeout -k 15 ${LIMIT:-420} python3 -m dflash_trainer.cli.main bench target --device cuda --shape qwen3-8b --seq-len 8192 \
    --docs 8 --sliding-window "$SLIDING" --json "$OUT/bench-target_h200_swa.json" > "$OUT/bench_target_swa.log" 2>&1
  echo "bench target (sliding $SLIDING) rc=$?"; grep -A 40 '"results"' "$OUT/bench_target_swa.log" | head -40
fi
