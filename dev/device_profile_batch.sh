#!/usr/bin/env bash
# Where the time goes at batch > 1, in one call on one H100 / H200, with random-weight SmolLM2-shaped
# models (no GGUF): the engine's GPU tests (tests/gpu/test_engine_cuda.py: the continuous-batch stream included),
# benchmarks/attention_shapes.py (the attention op alone: the engine's, SDPA, the row kernel), benchmarks/engine_profile.py at ROWS (default "64 256": a speculative round against a plain step at the speedup
# table's batch sizes, the eager round by aten op), and benchmarks/regen_profile.py (a regeneration decode step at
# the H100 plan's 1,024 rows, shared span and --row-attention). Needs the wheels the image lacks:
#   run(command="bash dev/device_profile_batch.sh", carry=[".stage1/whl"], timeout_s=600)
# STEP_ATTN (default: the engine's, sdpa for the bf16 target; e.g. "cache sdpa"): the target's step attention
# profiled at each ROWS and BLOCKS.
# BLOCKS (default 16): the random drafter's block sizes profiled at each ROWS (engine_profile.py's round_ms_by_draft_length
# already times each draft length k with its block of k+1, as the speedup table does).
# SKIP_TESTS=1 / SKIP_ROWATTN=1 / SKIP_SHAPES=1 / SKIP_REGEN=1 leave out the tests / the row-attention regeneration
# profile / the attention-op table / the regeneration profile (a short call).
# Step limits add up to 60 + 120 + 150 per (ROWS, BLOCKS, STEP_ATTN) + 200 + 120 s (800 s at the defaults): pass the
# call's timeout_s and trim with ROWS / BLOCKS / SKIP_*; steps run in order of value, the cut ones are the last.
# In $OUT: summary.log and prof.tgz (every table and JSON; a call brings back at most 8 files).
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
W=$HOME/prof; rm -rf "$W"; mkdir -p ~/site "$W"  # a warm machine keeps $HOME: no earlier call's results
python3 -c "import pydantic" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target ~/site .stage1/whl/pydantic*.whl .stage1/whl/annotated_types*.whl .stage1/whl/typing_*.whl || exit 1
# after every step (written whole, then renamed): a call cut at its limit still brings back what ran
pack() { tar -C "$W" -czf "$OUT/.prof.tgz.tmp" . && mv "$OUT/.prof.tgz.tmp" "$OUT/prof.tgz"; }
rc() { echo "  rc=$1 ($2)"; }  # a step's exit status (124: its timeout cut it)
{
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
git rev-parse HEAD 2>/dev/null; cat COMMIT 2>/dev/null
if [ -z "${SKIP_SHAPES:-}" ]; then
  timeout 60 python3 benchmarks/attention_shapes.py --out "$W/attention-shapes.json" 2>&1 | tail -6
  rc "${PIPESTATUS[0]}" attention-shapes; pack
fi
if [ -z "${SKIP_REGEN:-}" ]; then
  timeout 120 python3 benchmarks/regen_profile.py --out "$W/regen" ${REGEN_FLAGS:-} 2>&1 | grep -v "USDT" | tail -3
  rc "${PIPESTATUS[0]}" regen; pack
fi
for R in ${ROWS:-64 256}; do
  for B in ${BLOCKS:-16}; do  # the random drafter's B
    for A in ${STEP_ATTN:-sdpa}; do  # the target's step attention (decoding/batched.py STEP_ATTENTION)
      timeout 150 python3 benchmarks/engine_profile.py --out "$W/engine-rows$R-b$B-$A" --rows "$R" --block-size "$B" \
        --step-attention "$A" --no-traces ${PROFILE_FLAGS:-} 2>&1 | grep -v "Converting\|Loading\|USDT" | tail -4
      rc "${PIPESTATUS[0]}" "engine rows $R B $B $A"; pack
    done
  done
done
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_cuda.py > "$W/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$W/gpu_tests.log"; pack
fi
if [ -z "${SKIP_ROWATTN:-}" ]; then
  timeout 120 python3 benchmarks/regen_profile.py --out "$W/regen-rowattn" --row-attention ${REGEN_FLAGS:-} 2>&1 \
    | grep -v "USDT" | tail -3
  rc "${PIPESTATUS[0]}" regen-row-attention; pack
fi
} 2>&1 | tee "$OUT/summary.log"
ls -la "$OUT"
