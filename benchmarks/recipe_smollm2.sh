#!/usr/bin/env bash
# The SmolLM2 quality recipe on one GPU, end to end, with measured τ:
#   regenerate (the target answers ShareGPT itself) → prepare → train the drafter and the
#   no-target-features control on the same rows and steps (two processes, side by side) →
#   eval both on MT-Bench (80 × 2 turns) and HumanEval (164), T = 0, 256 new tokens →
#   benchmarks/results/recipe-smollm2_<gpu>_<date>.{json,png} (recipe_report.py).
# Usage: bash benchmarks/recipe_smollm2.sh [WORK_DIR]
# Env: DATA (chat file; default the embedded ShareGPT), TARGET (default the embedded SmolLM2),
#      CONVERSATIONS (12000), REGEN_SECONDS (240: time budget of the regeneration), REGEN_TOKENS
#      (512 new tokens per turn), CONFIG (configs/smollm2-h200.yaml), EVAL_PROMPTS (all), EVAL_TOKENS (256),
#      SLOTS (512 rows of the regeneration batch), SEQ_LEN (4096, = the config's seq_len), DFT (the dflash-train command).
set -euo pipefail
WORK=${1:-runs/recipe-smollm2}
CONFIG=${CONFIG:-configs/smollm2-h200.yaml}
DFT=${DFT:-dflash-train}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
targ=(); [ -n "${TARGET:-}" ] && targ=(--target "$TARGET")
data=(); [ -n "${DATA:-}" ] && data=(--data "$DATA")
stamp() { echo "$1 $(date +%s.%N)" >> "$WORK/stages.txt"; echo "== $1 $(date -u +%T)"; }
: > "$WORK/stages.txt"; stamp start

if [ ! -f "$WORK/regen.jsonl" ]; then
  src=${DATA:-$(python3 -c 'from dflash_trainer.data.sources import default_sharegpt_path as p; print(p())')}
  $DFT regenerate --data "$src" --out "$WORK/regen.jsonl" "${targ[@]}" --max-conversations "${CONVERSATIONS:-12000}" \
    --max-new-tokens "${REGEN_TOKENS:-512}" --max-prompt-tokens 1536 --batch-size "${SLOTS:-512}" \
    --max-seconds "${REGEN_SECONDS:-240}" \
    > "$WORK/regenerate.log" 2>&1
fi
tail -c 1500 "$WORK/regen.jsonl.report.json"; echo
stamp regenerated

[ -f "$WORK/data/prepare_report.json" ] || $DFT prepare --out "$WORK/data" --data "$WORK/regen.jsonl" "${targ[@]}" \
  --seq-len "${SEQ_LEN:-4096}" > "$WORK/prepare.log" 2>&1
tail -3 "$WORK/prepare.log"
stamp prepared

$DFT train --config "$CONFIG" --prepared "$WORK/data" "${targ[@]}" --out "$WORK/drafter" > "$WORK/train-drafter.log" 2>&1 &
p1=$!
$DFT train --config "$CONFIG" --prepared "$WORK/data" "${targ[@]}" --out "$WORK/control" --set no_target_features=true \
  > "$WORK/train-control.log" 2>&1 &
p2=$!
wait $p1; wait $p2
stamp trained

pids=()
for run in drafter control; do
  for ds in mt-bench humaneval; do
    $DFT eval --drafter "$WORK/$run" "${targ[@]}" --dataset "$ds" --max-new-tokens "${EVAL_TOKENS:-256}" --no-offline \
      ${EVAL_PROMPTS:+--max-prompts $EVAL_PROMPTS} \
      --json "$WORK/eval-$run-$ds.json" > "$WORK/eval-$run-$ds.log" 2>&1 &
    pids+=($!)
  done
done
for p in "${pids[@]}"; do wait "$p"; done
stamp evaluated

python3 benchmarks/recipe_report.py "$WORK" --results "${RESULTS:-benchmarks/results}"
