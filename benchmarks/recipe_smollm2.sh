#!/usr/bin/env bash
# The SmolLM2 quality recipe on one GPU, end to end, with measured τ:
#   regenerate (the target answers ShareGPT itself) → prepare → train the drafter and the
#   no-target-features control on the same rows and steps (processes side by side) →
#   eval every run on MT-Bench (80 × 2 turns) and HumanEval (164), T = 0, 256 new tokens →
#   benchmarks/results/recipe-smollm2_<gpu>_<date>.{json,png} (recipe_report.py).
# Usage: bash benchmarks/recipe_smollm2.sh [WORK_DIR]
# Env: DATA (chat file; default the embedded ShareGPT), TARGET (default the embedded SmolLM2),
#      CONVERSATIONS (12000), REGEN_SECONDS (240: time budget of the regeneration), REGEN_TOKENS
#      (512 new tokens per turn), CONFIG (configs/smollm2-h200.yaml), EVAL_PROMPTS (all), EVAL_TOKENS (256),
#      SLOTS (512 rows of the regeneration batch), SEQ_LEN (4096, = the config's seq_len), DFT (the dflash-train command),
#      TRAIN_SECONDS (unset: a wall-clock guard per training; a run stopped by it is evaluated at its last checkpoint),
#      EVAL_WAVE (2: runs evaluated at once, two suites each),
#      VARIANTS ("drafter control"; the ablation adds):
#        finished  the regenerated data cut before the first unfinished answer (benchmarks/finished_only.py)
#        original  the conversations regenerate read, with their original answers (also those it could not
#                  regenerate, e.g. a first prompt over 1,536 tokens); needs ORIGINAL (a JSONL of the first usable
#                  conversations of DATA in order, e.g. `benchmarks/stage_prompts.py OUT N --keep-answers`)
set -euo pipefail
WORK=${1:-runs/recipe-smollm2}
CONFIG=${CONFIG:-configs/smollm2-h200.yaml}
DFT=${DFT:-dflash-train}
VARIANTS=${VARIANTS:-drafter control}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
targ=(); [ -n "${TARGET:-}" ] && targ=(--target "$TARGET")
stamp() { echo "$1 $(date +%s.%N)" >> "$WORK/stages.txt"; echo "== $1 $(date -u +%T)"; }
data_of() { case $1 in finished) echo "$WORK/data-finished";; original) echo "$WORK/data-original";; *) echo "$WORK/data";; esac; }
sets_of() { case $1 in control) echo "--set no_target_features=true";; esac; }
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

# The chat file of each dataset the variants need, then one prepare per dataset (in parallel).
declare -A chats=(["$WORK/data"]="$WORK/regen.jsonl")
for v in $VARIANTS; do
  case $v in
    finished) python3 "$HERE/finished_only.py" "$WORK/regen.jsonl" "$WORK/regen-finished.jsonl"
              chats["$WORK/data-finished"]="$WORK/regen-finished.jsonl";;
    original) n=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["records_read"])' "$WORK/regen.jsonl.report.json")
              head -n "$n" "${ORIGINAL:?the original variant needs ORIGINAL}" > "$WORK/original.jsonl"
              chats["$WORK/data-original"]="$WORK/original.jsonl";;
  esac
done
pids=()
for d in "${!chats[@]}"; do
  [ -f "$d/prepare_report.json" ] || $DFT prepare --out "$d" --data "${chats[$d]}" "${targ[@]}" \
    --seq-len "${SEQ_LEN:-4096}" > "$d.prepare.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for d in "${!chats[@]}"; do echo "$d: $(tail -1 "$d.prepare.log")"; done
stamp prepared

guard=(); [ -n "${TRAIN_SECONDS:-}" ] && guard=(timeout -s TERM "$TRAIN_SECONDS")
pids=()
for v in $VARIANTS; do
  # shellcheck disable=SC2046
  "${guard[@]}" $DFT train --config "$CONFIG" --prepared "$(data_of "$v")" "${targ[@]}" --out "$WORK/$v" $(sets_of "$v") \
    > "$WORK/train-$v.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || echo "a training exited with $? (a stop by TRAIN_SECONDS leaves its last checkpoint)"; done
stamp trained

# Evals in waves of EVAL_WAVE runs (two suites each): each eval holds batched caches of 256 rows
# for the target and the drafter, so eight at once could exhaust the GPU's memory.
pids=()
n=0
for v in $VARIANTS; do
  ckpt=$WORK/$v/checkpoint-final
  [ -d "$ckpt" ] || ckpt=$(ls -d "$WORK/$v"/checkpoint-* 2>/dev/null | sort -V | tail -1 || true)
  [ -n "$ckpt" ] || { echo "$v: no checkpoint to evaluate"; continue; }
  for ds in mt-bench humaneval; do
    $DFT eval --drafter "$ckpt" "${targ[@]}" --dataset "$ds" --max-new-tokens "${EVAL_TOKENS:-256}" --no-offline \
      ${EVAL_PROMPTS:+--max-prompts $EVAL_PROMPTS} \
      --json "$WORK/eval-$v-$ds.json" > "$WORK/eval-$v-$ds.log" 2>&1 &
    pids+=($!)
  done
  n=$((n + 1))
  if [ $((n % ${EVAL_WAVE:-2})) -eq 0 ]; then
    for p in "${pids[@]}"; do wait "$p" || echo "an eval exited with $?"; done
    pids=()
  fi
done
for p in "${pids[@]}"; do wait "$p" || echo "an eval exited with $?"; done
stamp evaluated

python3 "$HERE/recipe_report.py" "$WORK" --results "${RESULTS:-benchmarks/results}" --runs $VARIANTS
