#!/usr/bin/env bash
# The SmolLM2 recipe and its ablation, as `dflash-train recipe` runs them (docs/recipe.md):
#   1. the base run: `dflash-train recipe --out WORK [--control]` (mixture → regenerate → prepare → drafter [and the
#      no-target-features control] → evals → exports → WORK/REPORT.md); rerun-safe, so rerunning this script
#      resumes or skips what is done;
#   2. each other variant of VARIANTS: one more recipe run in WORK/variants/NAME with the variant's --set flags from
#      SWEEP, seeded with the base run's prompts, regeneration and prepared rows (hard links and their stage
#      records: the recipe skips those stages, a variant that changes data.seq_len prepares again);
#   3. `benchmarks/recipe_report.py` over all runs → RESULTS/recipe-smollm2_<gpu>_<date>.{json,png}.
# Usage: bash dev/recipe_smollm2.sh [WORK]   (default runs/recipe-smollm2)
# Env: VARIANTS ("drafter control"; control = the base run's --control; others: names in SWEEP),
#      SWEEP (dev/sweep_smollm2.yaml: variant → list of section.field=value), TARGET, DATA (a chat file whose prompts
#      the target answers instead of the packaged mixture), SPEC (a mixture spec), CONFIG
#      (configs/smollm2-h200-onpolicy.yaml; the plan's settings override it, this adds measured τ every 500 steps),
#      SETS (more train flags for every run, e.g. "--set tau.tau_dataset=heldout.jsonl"), HOURS, STEPS (recipe's
#      --hours / --steps), DIAG_EVALS ("NAME=CHAT_FILE ...": the first variant on other prompts, first turn of 64 each),
#      REPORT_TAG, REPORT_MODEL (smollm2: the target's name in the report), RESULTS (benchmarks/results), DFT.
# Data variants are not recipe variants (`recipe --data` has the target answer the file's prompts): each is a
# `dev/prepared_runs.sh OUT CHAT_FILE` call (prepare → train → eval) with its own file — finished: the regeneration
# cut before unfinished answers (`python benchmarks/finished_only.py WORK/regen.jsonl FILE`); original: the same
# conversations with their own answers (`python dev/stage_prompts.py FILE N --keep-answers`, N = the regeneration
# report's records_read); no-code: WORK/regen.jsonl with SPEC=configs/mixture-smollm2-no-code.yaml.
set -euo pipefail
WORK=${1:-runs/recipe-smollm2}
DFT=${DFT:-dflash-train}
VARIANTS=${VARIANTS:-drafter control}
SWEEP=${SWEEP:-dev/sweep_smollm2.yaml}
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
targ=(); [ -n "${TARGET:-}" ] && targ=(--target "$TARGET")
args=("${targ[@]}")
[ -n "${DATA:-}" ] && args+=(--data "$DATA")
[ -n "${SPEC:-}" ] && args+=(--spec "$SPEC")
[ -n "${HOURS:-}" ] && args+=(--hours "$HOURS")
[ -n "${STEPS:-}" ] && args+=(--steps "$STEPS")
args+=(--config "${CONFIG:-configs/smollm2-h200-onpolicy.yaml}")
read -ra sets <<< "${SETS:-}"
control=(); others=()
for v in $VARIANTS; do
  case $v in drafter) ;; control) control=(--control);;
    *) python3 "$HERE/sweep_sets.py" "$SWEEP" "$v" > /dev/null; others+=("$v");;  # unknown names fail before any work
  esac
done
mkdir -p "$WORK"
stamp() { echo "$1 $(date +%s.%N)" >> "$WORK/stages.txt"; echo "== $1 $(date -u +%T)"; }
: > "$WORK/stages.txt"; stamp start
: > "$WORK/runs.jsonl"
for v in $VARIANTS; do  # each run's data folder and changed settings, for the report
  case $v in drafter) s="";; control) s="--set experimental.no_target_features=true";;
    *) s=$(python3 "$HERE/sweep_sets.py" "$SWEEP" "$v" | paste -sd' ');; esac
  printf '{"run": "%s", "data": "data", "sets": "%s"}\n' "$v" "$s" >> "$WORK/runs.jsonl"
done

seed() {  # seed VW: the base run's prompts, regeneration and rows with their stage records, unless VW holds these
  local vw=$1 f s  # very records; hard links: the stages replace their outputs, never write into them
  cmp -s "$WORK/stages/prepare.json" "$vw/stages/prepare.json" && return 0
  mkdir -p "$vw/stages"
  for f in mixture.yaml prompts.jsonl prompts.jsonl.report.json regen.jsonl regen.jsonl.report.json data; do
    rm -rf "${vw:?}/$f"; [ -e "$WORK/$f" ] && cp -al "$WORK/$f" "$vw/$f"
  done
  for s in mixture regenerate prepare; do [ -f "$WORK/stages/$s.json" ] && cp "$WORK/stages/$s.json" "$vw/stages/"; done
  return 0
}
evals() {  # evals DIR RUN NAME: DIR/RUN-SUITE.json copied to WORK/eval-NAME-SUITE.json (benchmarks/recipe_report.py's layout)
  local f
  for f in "$1/$2"-*.json; do [ -e "$f" ] && cp "$f" "$WORK/eval-$3-${f##*/"$2"-}"; done
  return 0
}

$DFT recipe --out "$WORK" "${args[@]}" "${control[@]}" "${sets[@]}" 2>&1 | tee "$WORK/recipe.log"
evals "$WORK/eval" drafter drafter
[ -n "${control[*]}" ] && evals "$WORK/eval" control control
stamp base

for v in "${others[@]}"; do
  seed "$WORK/variants/$v"
  mapfile -t vsets < <(python3 "$HERE/sweep_sets.py" "$SWEEP" "$v")
  $DFT recipe --out "$WORK/variants/$v" "${args[@]}" "${sets[@]}" "${vsets[@]}" > "$WORK/recipe-$v.log" 2>&1 \
    || echo "$v: the recipe exited with $? (log $WORK/recipe-$v.log; rerun this script to resume it)"
  ln -sfn "variants/$v/drafter" "$WORK/$v"  # WORK/NAME: the run's folder, as the report reads it
  evals "$WORK/variants/$v/eval" drafter "$v"
  stamp "variant-$v"
done

first=${VARIANTS%% *}
for spec in ${DIAG_EVALS:-}; do  # the first variant on other prompt sets, one at a time (small)
  name=${spec%%=*}; file=${spec#*=}
  $DFT eval --drafter "$WORK/$first/checkpoint-final" "${targ[@]}" --dataset "$file" --max-prompts 64 --max-turns 1 \
    --max-new-tokens 256 --json "$WORK/eval-$first-diag-$name.json" > "$WORK/eval-$first-diag-$name.log" 2>&1 \
    || echo "diagnostic eval $name exited with $?"
done
stamp evaluated

python3 "$HERE/../benchmarks/recipe_report.py" "$WORK" --results "${RESULTS:-benchmarks/results}" --runs $VARIANTS \
  ${REPORT_TAG:+--tag $REPORT_TAG} ${REPORT_MODEL:+--model $REPORT_MODEL}
