#!/usr/bin/env bash
# `dflash-train recipe` is the user path (docs/recipe.md); this script stays as the ablation harness.
# The SmolLM2 quality recipe on one GPU, end to end, with measured τ (the default, BASE_DATA=mixture):
#   the prompt mixture (`dflash-train mixture --spec configs/mixture-smollm2.yaml`: ShareGPT before its held-out
#   tail, math, chitchat, code requests; built once) → the target answers it itself (`regenerate`: greedy, loop
#   guard, 2,048 rows, shortest prompts first, REGEN_SECONDS budget; regen.jsonl is reused by later runs in the same
#   WORK) → prepare → train the drafter and the no-target-features control on the same rows and steps (one after
#   the other; measured τ every 500 steps) → eval every run on MT-Bench (80 × 2 turns) and HumanEval (164),
#   T = 0, 256 new tokens → benchmarks/results/recipe-smollm2_<gpu>_<date>.{json,png} (benchmarks/recipe_report.py).
# Usage: bash dev/recipe_smollm2.sh [WORK_DIR]
# Env: BASE_DATA (mixture): the data of drafter, control and the one-setting variants: mixture (the target's answers
#                  to the prompt mixture), regen (the target's answers to DATA's conversations) or original (ORIGINAL's
#                  first CONVERSATIONS conversations with their original answers, the 2026-12-01 recipe)
#      DATA (chat file to regenerate: default the mixture built here, or the embedded ShareGPT for regen),
#      MIXTURE_SPEC (configs/mixture-smollm2.yaml), TARGET (default the embedded SmolLM2),
#      CONVERSATIONS (14000; regen and original only), REGEN_SECONDS (480: time budget of the regeneration; the whole mixture took 431 s on an H200),
#      REGEN_CONTINUE (unset; 1 = WORK/regen.jsonl is reused and its budget stopped it: regenerate the records after it
#                  for REGEN_SECONDS more, `regenerate --first-record`, and append them, reports merged; mixture only), REGEN_TOKENS
#      (512 new tokens per turn), REGEN_PROMPT_TOKENS (1536: longest prompt answered), REGEN_FLAGS
#      ("--loop-ngram 32 --lookahead 4": extra `regenerate` flags), BENCH_REGEN (unset; 1 = `bench regenerate`'s
#      recipe setting over DATA while prepare runs, results in WORK/bench; BENCH_VARIANTS: others of benchmarks/regen_variants.py), TRAIN_SETS (extra --set flags for every run),
#      CONFIG (configs/smollm2-h200-onpolicy.yaml), EVAL_PROMPTS (all), EVAL_TOKENS (256),
#      SLOTS (2048 rows of the regeneration batch), SEQ_LEN (4096, = the config's seq_len), DFT (the dflash-train command),
#      TRAIN_SECONDS (unset: a wall-clock guard per training; a run stopped by it is evaluated at its last checkpoint),
#      TRAIN_PARALLEL (0: one training at a time, each run's evals beside the next training; 1: all at once, the
#                  feature cache's CACHE_GIB (104) split between the runs with features (the control: 1 GiB), then
#                  evals in waves of EVAL_WAVE (2) runs),
#      VARIANTS ("drafter control"; the ablation adds):
#        finished  the regenerated data cut before the first unfinished answer (benchmarks/finished_only.py)
#        no-code   the regenerated mixture without its code prompts (each source's contribution): `prepare --spec
#                  NO_CODE_SPEC` (configs/mixture-smollm2-no-code.yaml: MIXTURE_SPEC's sources, code weight 0)
#        original  the conversations regenerate read, with their original answers (also those it could not
#                  regenerate, e.g. a first prompt over 1,536 tokens): ORIGINAL, a JSONL of the first usable
#                  conversations of DATA in order (default: written here by `dev/stage_prompts.py OUT N
#                  --keep-answers` from DATA, which must then hold the answers, not a prompts-only file)
#        one setting changed from the config (on the base data): lr-hi (lr 1.5e-3), lr-lo (3e-4), anchors512,
#                  b8 (block_size 8), draws2 (anchor_draws_per_row 2: half the target tokens per step), steps400,
#                  steps1600, kl (loss kl), dpace (D-PACE position weights, the default), decay (the fixed decay weights), pard2 (CE + KL with CAT weights and
#                  10 % target-feature dropout, docs/losses.md), layers8 (8 drafter layers: is capacity the limit?), fp8-rowwise /
#                  fp8-tensorwise (FP8 matmuls for the drafter's linears, drafter/fp8.py: τ against `drafter` at equal
#                  steps; needs torchao in ~/site, .stage1/whl-fp8); long: 512 anchors, LONG_STEPS (3000) steps, a
#                  checkpoint every 250 (the 2026-12-01 runs that led to the original recipe's 512 anchors)
#      OFFLINE (1): also the offline τ (teacher-forced on the target's own greedy answers) of every eval; 0 = off,
#      DIAG_EVALS (none): "NAME=CHAT_FILE ..." more evals of the first variant (first turn of the first 64 prompts each),
#                  e.g. prompts of each mixture source, to compare measured τ in and out of the training distribution,
#      REPORT_TAG (none): suffix of the report's file names (recipe-smollm2-ablation-TAG_…)
#      REPORT_MODEL (smollm2): the target's name in the report's file names and title (with TARGET set to
#                  another model, e.g. a packaged name: dev/device_real_targets.sh)
set -euo pipefail
WORK=${1:-runs/recipe-smollm2}
CONFIG=${CONFIG:-configs/smollm2-h200-onpolicy.yaml}
DFT=${DFT:-dflash-train}
VARIANTS=${VARIANTS:-drafter control}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
targ=(); [ -n "${TARGET:-}" ] && targ=(--target "$TARGET")
stamp() { echo "$1 $(date +%s.%N)" >> "$WORK/stages.txt"; echo "== $1 $(date -u +%T)"; }
BASE_DATA=${BASE_DATA:-mixture}
case $BASE_DATA in regen|mixture) base="$WORK/data";; original) base="$WORK/data-original";;
  *) echo "BASE_DATA=$BASE_DATA: use mixture, regen or original" >&2; exit 2;; esac
data_of() {
  case $1 in finished) echo "$WORK/data-finished";; original) echo "$WORK/data-original";;
    no-code) echo "$WORK/data-no-code";; *) echo "$base";; esac
}
sets_of() {
  case $1 in
    drafter|original|finished) ;;
    control) echo "--set no_target_features=true";;
    lr-hi) echo "--set lr=1.5e-3";;
    lr-lo) echo "--set lr=3e-4";;
    anchors512) echo "--set num_anchors=512";;
    b8) echo "--set block_size=8";;
    draws2) echo "--set anchor_draws_per_row=2";;
    steps400) echo "--set max_steps=400";;
    steps1600) echo "--set max_steps=1600";;
    kl) echo "--set loss.kind=kl";;
    dpace) echo "--set position_weights=dpace";;
    decay) echo "--set position_weights=decay";;
    pard2) echo "--set loss.kind=ce_kl --set position_weights=cat --set feature_dropout=0.1";;
    no-code) ;;
    layers8) echo "--set num_layers=8";;
    fp8-rowwise) echo "--set fp8=rowwise";;
    fp8-tensorwise) echo "--set fp8=tensorwise";;
    long) echo "--set num_anchors=512 --set max_steps=${LONG_STEPS:-3000} --set save_every=250";;
    *) echo "unknown variant $1 (see the header of $0)" >&2; return 2;;
  esac
}
for v in $VARIANTS; do sets_of "$v" > /dev/null; done  # unknown names fail before any work
needs_regen=0; [ "$BASE_DATA" != original ] && needs_regen=1
case " $VARIANTS " in *" finished "*) needs_regen=1;; esac
: > "$WORK/stages.txt"; stamp start
: > "$WORK/runs.jsonl"
for v in $VARIANTS; do
  printf '{"run": "%s", "data": "%s", "sets": "%s"}\n' "$v" "$(basename "$(data_of "$v")")" "$(sets_of "$v")" >> "$WORK/runs.jsonl"
done

regen_src() {  # the chat file regenerate reads
  if [ -n "${DATA:-}" ]; then echo "$DATA"
  elif [ "$BASE_DATA" = mixture ]; then echo "$WORK/prompts.jsonl"
  else python3 -c 'from dflash_trainer.data.sources import default_sharegpt_path as p; print(p())'; fi
}
regen() {  # regen LOG OUT [flags]: the recipe's regeneration of regen_src into OUT
  local log=$1 out=$2; shift 2
  local limit=(); [ "$BASE_DATA" = mixture ] || limit=(--max-conversations "${CONVERSATIONS:-14000}")
  # shellcheck disable=SC2086
  $DFT regenerate --data "$(regen_src)" --out "$out" "${targ[@]}" "${limit[@]}" "$@" \
    --max-new-tokens "${REGEN_TOKENS:-512}" --max-prompt-tokens "${REGEN_PROMPT_TOKENS:-1536}" --batch-size "${SLOTS:-2048}" \
    --max-seconds "${REGEN_SECONDS:-480}" ${REGEN_FLAGS:---loop-ngram 32 --lookahead 4} \
    > "$log" 2>&1
}
if [ "$needs_regen" = 1 ] && [ "$BASE_DATA" = mixture ] && [ -z "${DATA:-}" ] && [ ! -f "$WORK/prompts.jsonl" ] \
   && { [ ! -f "$WORK/regen.jsonl" ] || [ -n "${REGEN_CONTINUE:-}" ]; }; then
  # the prompt mixture, built once (CPU, a few minutes)
  $DFT mixture --spec "${MIXTURE_SPEC:-configs/mixture-smollm2.yaml}" --out "$WORK/prompts.jsonl" > "$WORK/mixture.log" 2>&1
  stamp mixture
fi
if [ "$needs_regen" = 1 ] && [ ! -f "$WORK/regen.jsonl" ]; then
  regen "$WORK/regenerate.log" "$WORK/regen.jsonl"
elif [ "$needs_regen" = 1 ] && [ -n "${REGEN_CONTINUE:-}" ]; then
  # a reused regeneration that its time budget stopped: answer the records after it (its report's next_record;
  # reports from before that field: first_record + records_read) into regen-more-N.jsonl, then append it and merge
  # the reports (data/regen_report.py), so regen.jsonl and its report describe the whole and a rerun continues further
  [ "$BASE_DATA" = mixture ] || { echo "REGEN_CONTINUE: only for BASE_DATA=mixture (a limit of conversations would restart)" >&2; exit 2; }
  next=$(python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
print((r.get("next_record") or r.get("first_record", 0) + r["records_read"]) if r["stopped_at_max_seconds"] else "")' \
    "$WORK/regen.jsonl.report.json")
  if [ -n "$next" ]; then
    regen "$WORK/regenerate-more-$next.log" "$WORK/regen-more-$next.jsonl" --first-record "$next"
    python3 -c 'import sys; from dflash_trainer.data.regen_report import append_continuation as a; a(*sys.argv[1:])' \
      "$WORK/regen.jsonl" "$WORK/regen-more-$next.jsonl"
  else echo "REGEN_CONTINUE: the reused regeneration read its whole input; nothing to continue"; fi
fi
if [ "$needs_regen" = 1 ]; then tail -c 1500 "$WORK/regen.jsonl.report.json"; echo; stamp regenerated; fi

# The chat file of each dataset the variants need (and its weighting spec, if any), then one prepare per dataset (in parallel).
declare -A chats=() specs=()
for v in $VARIANTS; do
  d=$(data_of "$v")
  case $d in
    "$WORK/data") chats["$d"]="$WORK/regen.jsonl";;
    "$WORK/data-finished") python3 "$HERE/../benchmarks/finished_only.py" "$WORK/regen.jsonl" "$WORK/regen-finished.jsonl"
                           chats["$d"]="$WORK/regen-finished.jsonl";;
    "$WORK/data-no-code") chats["$d"]="$WORK/regen.jsonl"  # the mixture without its code prompts: code weight 0
                          specs["$d"]=${NO_CODE_SPEC:-configs/mixture-smollm2-no-code.yaml};;
    "$WORK/data-original")
      if [ "$needs_regen" = 1 ]; then  # the very conversations regenerate read
        n=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["records_read"])' "$WORK/regen.jsonl.report.json")
      else n=${CONVERSATIONS:-14000}; fi
      if [ -n "${ORIGINAL:-}" ]; then head -n "$n" "$ORIGINAL" > "$WORK/original.jsonl"
      else python3 "$HERE/stage_prompts.py" "$WORK/original.jsonl" "$n" ${DATA:+"$DATA"} --keep-answers; fi
      got=$(wc -l < "$WORK/original.jsonl")
      [ "$got" -ge "$n" ] || { echo "original data: $got conversations, $n asked (CONVERSATIONS or ORIGINAL)" >&2; exit 2; }
      chats["$d"]="$WORK/original.jsonl";;
  esac
done
pids=()
if [ -n "${BENCH_REGEN:-}" ]; then  # the regeneration's speed against HF generate, on the GPU while prepare uses the CPUs
  bsrc=${DATA:-$(python3 -c 'from dflash_trainer.data.sources import default_sharegpt_path as p; print(p())')}
  python3 "$HERE/../benchmarks/regen_variants.py" "$WORK/bench" "$bsrc" "${TARGET:-}" "${BENCH_VARIANTS:-greedy-2048-loop32-shortest}" > "$WORK/bench.log" 2>&1 &
  pids+=($!)
fi
todo=0; for d in "${!chats[@]}"; do [ -f "$d/prepare_report.json" ] || todo=$((todo + 1)); done
cores=$(nproc); [ -n "${BENCH_REGEN:-}" ] && cores=$((cores - 1))  # the bench's host loop keeps one core
workers=$(( cores / (todo > 0 ? todo : 1) )); [ "$workers" -ge 1 ] || workers=1  # the cores shared by the prepares at once
for d in "${!chats[@]}"; do
  [ -f "$d/prepare_report.json" ] || $DFT prepare --out "$d" --data "${chats[$d]}" ${specs[$d]:+--spec "${specs[$d]}"} \
    "${targ[@]}" --seq-len "${SEQ_LEN:-4096}" --workers "$workers" > "$d.prepare.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for d in "${!chats[@]}"; do echo "$d: $(tail -1 "$d.prepare.log")"; done
stamp prepared

guard=(); [ -n "${TRAIN_SECONDS:-}" ] && guard=(timeout -s TERM "$TRAIN_SECONDS")
train_run() {  # train_run VARIANT [extra --set flags]: one training, its log in WORK
  local v=$1; shift
  # shellcheck disable=SC2046
  "${guard[@]}" $DFT train --config "$CONFIG" --prepared "$(data_of "$v")" "${targ[@]}" --out "$WORK/$v" $(sets_of "$v") \
    ${TRAIN_SETS:-} "$@" > "$WORK/train-$v.log" 2>&1 || echo "$v: training exited with $? (a stop by TRAIN_SECONDS leaves its last checkpoint)"
}
# Evals: fp32 target (EVAL_DTYPE), exact losslessness checked, as before eval's bf16 default on CUDA.
offline=(--offline); [ "${OFFLINE:-1}" = 0 ] && offline=(--no-offline)
eval_run() {  # eval_run VARIANT: its checkpoint on both suites at once
  local v=$1 ckpt=$WORK/$1/checkpoint-final ds
  [ -d "$ckpt" ] || ckpt=$(ls -d "$WORK/$v"/checkpoint-* 2>/dev/null | sort -V | tail -1 || true)
  [ -n "$ckpt" ] || { echo "$v: no checkpoint to evaluate"; return 0; }
  for ds in mt-bench humaneval; do
    $DFT eval --drafter "$ckpt" "${targ[@]}" --dataset "$ds" --max-new-tokens "${EVAL_TOKENS:-256}" "${offline[@]}" \
      ${EVAL_PROMPTS:+--max-prompts $EVAL_PROMPTS} --dtype "${EVAL_DTYPE:-float32}" \
      --json "$WORK/eval-$v-$ds.json" > "$WORK/eval-$v-$ds.log" 2>&1 &
  done
  wait
}
if [ "${TRAIN_PARALLEL:-0}" = 1 ]; then
  # every training at once, then evals in waves of EVAL_WAVE runs; the feature cache split between the runs
  # with target features (the control stores labels only: 1 GiB holds them)
  n_feat=$(for v in $VARIANTS; do [ "$v" = control ] || echo "$v"; done | wc -l)
  pids=()
  for v in $VARIANTS; do
    gib=$(python3 -c "print(1 if '$v' == 'control' else (${CACHE_GIB:-104} - 1) / max($n_feat, 1))")
    train_run "$v" --set feature_cache_gib="$gib" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  stamp trained
  pids=(); n=0
  for v in $VARIANTS; do
    eval_run "$v" & pids+=($!); n=$((n + 1))
    if [ $((n % ${EVAL_WAVE:-2})) -eq 0 ]; then for p in "${pids[@]}"; do wait "$p"; done; pids=(); fi
  done
  for p in "${pids[@]}"; do wait "$p"; done
else
  # one training at a time (the GPU to itself: the first run's speed is its speed alone); each run's evals
  # start when it ends, beside the next training
  ev=""
  for v in $VARIANTS; do
    train_run "$v"
    stamp "trained-$v"
    [ -n "$ev" ] && wait "$ev"
    eval_run "$v" & ev=$!
  done
  stamp trained
  [ -n "$ev" ] && wait "$ev"
fi
first=${VARIANTS%% *}
for spec in ${DIAG_EVALS:-}; do  # the first variant on other prompt sets, one at a time (small)
  name=${spec%%=*}; file=${spec#*=}
  $DFT eval --drafter "$WORK/$first/checkpoint-final" "${targ[@]}" --dataset "$file" --max-prompts 64 --max-turns 1 \
    --max-new-tokens "${EVAL_TOKENS:-256}" "${offline[@]}" --json "$WORK/eval-$first-diag-$name.json" \
    > "$WORK/eval-$first-diag-$name.log" 2>&1 || echo "diagnostic eval $name exited with $?"
done
stamp evaluated

python3 "$HERE/../benchmarks/recipe_report.py" "$WORK" --results "${RESULTS:-benchmarks/results}" --runs $VARIANTS ${REPORT_TAG:+--tag $REPORT_TAG} \
  ${REPORT_MODEL:+--model $REPORT_MODEL}
