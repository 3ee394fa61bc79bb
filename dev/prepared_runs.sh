#!/usr/bin/env bash
# The drafter and the no-target-features control on a chat file trained as it is (no regeneration, so not
# `dflash-train recipe`, which always has the target answer its prompts): prepare → train both → MT-Bench and
# HumanEval (T = 0, fp32 target) → benchmarks/recipe_report.py. The data variants of the SmolLM2 ablation
# (dev/recipe_smollm2.sh's header) and the packaged GGUF targets on ShareGPT's own answers (device_real_targets.sh).
# Usage: bash dev/prepared_runs.sh WORK CHAT_FILE
# Env: TARGET, CONFIG (configs/smollm2-h200-onpolicy.yaml), SPEC (prepare's --spec: weight the file's sources),
#      SEQ_LEN (4096), RUNS ("drafter control"), TRAIN_SECONDS (a wall-clock guard per training; a run it stops is
#      evaluated at its last checkpoint), EVAL_PROMPTS (all), EVAL_TOKENS (256), REPORT_MODEL, REPORT_TAG, RESULTS, DFT.
set -euo pipefail
WORK=${1:?WORK}; CHATS=${2:?CHAT_FILE}
DFT=${DFT:-dflash-train}
RUNS=${RUNS:-drafter control}
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
targ=(); [ -n "${TARGET:-}" ] && targ=(--target "$TARGET")
guard=(); [ -n "${TRAIN_SECONDS:-}" ] && guard=(timeout -s TERM "$TRAIN_SECONDS")
mkdir -p "$WORK"
stamp() { echo "$1 $(date +%s.%N)" >> "$WORK/stages.txt"; echo "== $1 $(date -u +%T)"; }
: > "$WORK/stages.txt"; stamp start
[ -f "$WORK/data/prepare_report.json" ] || $DFT prepare --out "$WORK/data" --data "$CHATS" ${SPEC:+--spec "$SPEC"} \
  "${targ[@]}" --seq-len "${SEQ_LEN:-4096}" > "$WORK/data.prepare.log" 2>&1
stamp prepared
: > "$WORK/runs.jsonl"
for v in $RUNS; do
  sets=(); [ "$v" = control ] && sets=(--set experimental.no_target_features=true)
  printf '{"run": "%s", "data": "data", "sets": "%s"}\n' "$v" "${sets[*]}" >> "$WORK/runs.jsonl"
  "${guard[@]}" $DFT train --config "${CONFIG:-configs/smollm2-h200-onpolicy.yaml}" --prepared "$WORK/data" "${targ[@]}" \
    --out "$WORK/$v" "${sets[@]}" > "$WORK/train-$v.log" 2>&1 || echo "$v: training exited with $?"
  ckpt=$WORK/$v/checkpoint-final
  [ -d "$ckpt" ] || ckpt=$(ls -d "$WORK/$v"/checkpoint-* 2>/dev/null | sort -V | tail -1 || true)
  [ -n "$ckpt" ] || { echo "$v: no checkpoint to evaluate"; continue; }
  for ds in mt-bench humaneval; do
    $DFT eval --drafter "$ckpt" "${targ[@]}" --dataset "$ds" --max-new-tokens "${EVAL_TOKENS:-256}" --dtype float32 \
      ${EVAL_PROMPTS:+--max-prompts "$EVAL_PROMPTS"} --json "$WORK/eval-$v-$ds.json" > "$WORK/eval-$v-$ds.log" 2>&1 \
      || echo "$v on $ds: eval exited with $?"
  done
  stamp "done-$v"
done
python3 "$HERE/../benchmarks/recipe_report.py" "$WORK" --results "${RESULTS:-benchmarks/results}" --runs $RUNS \
  ${REPORT_TAG:+--tag $REPORT_TAG} ${REPORT_MODEL:+--model $REPORT_MODEL}
