#!/usr/bin/env bash
# A packaged GGUF target (NAME = qwen2.5-coder-0.5b | gemma3-270m) on one H200: prepare → train the drafter and
# the no-target-features control → eval (MT-Bench and HumanEval, T = 0), by dev/prepared_runs.sh on ShareGPT's own
# answers (no regeneration) with TARGET=NAME and configs/NAME-h200.yaml; the report
# (benchmarks/recipe_report.py --model NAME) lands in $OUT as recipe-NAME_h200_<date>.{json,png}.
#
# The GGUF exceeds one call's 64 MiB carry, so it travels in pieces of PIECE_MIB (56) in consecutive calls, each copied
# outside the repo (ignored folders inside the tree are removed between calls; files outside it stay while the machine
# is warm, ≈30 s after a call: start the next call at once). Folders (git-ignored, `/.rt*/`), one set per target, so
# both targets can be split at once and the second one's pieces sent while the first one's job runs:
#   .rt-NAME-01 … .rt-NAME-NN   one piece each (gguf.partNN)
#   .rt-NAME-run    the last piece, the wheels the image lacks or has too old (stage_common.sh), the MT-Bench /
#                   HumanEval files (site/), ShareGPT conversations with their answers (originals.jsonl.xz,
#                   CONVERSATIONS of them)
# Modes:
#   split NAME      here (CPU machine, in the repo): fetch the GGUF if needed, write the folders above, print each
#                   call's command and MiB
#   piece DIR       device: keep DIR's piece in ~/rt/NAME
#   start NAME      device (carry .rt-NAME-run): install the wheels into ~/site, join the pieces into ~/targets (sha256
#                   checked against the package table), start the recipe detached in ~/rtwork, follow it until WAIT (420) s after the call began
#   wait            device: follow the recipe until LIMIT (540) s after the call began, then copy its report and logs to $OUT
#   dry-run NAME    here: the whole job on CPU at toy size (a few conversations, steps and tokens) to check the plumbing
# Env: NAME-specific defaults below; CONVERSATIONS (6000), PIECE_MIB (56), TRAIN_SECONDS (420: time guard per training,
#   a stopped run is evaluated at its last checkpoint; it includes loading the GGUF and compiling, ≈ 100 s for gemma3-270m),
#   EVAL_PROMPTS (all), EVAL_TOKENS (256), VARIANTS ("drafter control").
set -u
MODE=${1:?split NAME | piece DIR | start NAME | wait | dry-run NAME}
T0=$(date +%s)  # WAIT and LIMIT count from here: the staging before them never pushes a call past its limit
export OUT=${OUT:-/tmp/out}
HERE=$(cd "$(dirname "$0")" && pwd)
PIECE_MIB=${PIECE_MIB:-56}

gguf_of() {  # NAME → the GGUF's file name in the package table
  python3 -c 'import sys; from dflash_trainer.target_model.packaged_targets import PACKAGED_TARGETS as T; print(T[sys.argv[1]].gguf_name)' "$1"
}
mib() { du -sb "$1" | awk '{printf "%.1f", $1 / 1048576}'; }  # a file or folder's size in MiB
eval_prompts_of() { echo "${EVAL_PROMPTS:-}"; }  # empty: every prompt
follow() {  # print the recipe's progress until it finishes or $1 seconds after the call's start pass
  local end=$(( T0 + $1 ))
  while [ ! -f ~/rtwork/done ] && [ "$(date +%s)" -lt "$end" ] && pgrep -f prepared_runs >/dev/null; do sleep 10; done
  grep -v "Converting\|Loading" ~/rtwork.log | tail -25
  for f in ~/rtwork/*/metrics.jsonl; do echo "--- $f"; tail -1 "$f" | cut -c1-300; done 2>/dev/null
}

case $MODE in
split)
  NAME=${2:?split NAME}
  export PYTHONPATH=$PWD/src
  PY=${PY:-python3}
  # shellcheck source=dev/stage_common.sh
  . "$HERE/stage_common.sh"
  $PY -m dflash_trainer.cli.main fetch-target "$NAME" || exit 1
  GG=$($PY -c 'import sys; from dflash_trainer.target_model.packaged_targets import packaged_gguf_path as p; print(p(sys.argv[1]))' "$NAME")
  RUN=.rt-$NAME-run
  rm -rf ".rt-$NAME-"* && mkdir -p "$RUN/whl" "$RUN/site"
  split -b "${PIECE_MIB}M" -d -a 2 "$GG" "$RUN/gguf.part"
  parts=("$RUN"/gguf.part*)
  last=$(( ${#parts[@]} - 1 ))
  for i in $(seq 0 $(( last - 1 ))); do
    d=$(printf '.rt-%s-%02d' "$NAME" $((i + 1))); mkdir -p "$d" && mv "${parts[$i]}" "$d/"
  done
  stage_wheels "$RUN/whl" "$RUN/whl-alt" && stage_transformers "$RUN/whl" || exit 1
  stage_eval_files "$RUN/site" || exit 1
  $PY "$HERE/stage_prompts.py" "$RUN/originals.jsonl" "${CONVERSATIONS:-6000}" --keep-answers && xz -9 -T0 "$RUN/originals.jsonl" || exit 1
  echo "$NAME: $(gguf_of "$NAME") in ${#parts[@]} pieces; one call each, in this order, each right after the last:"
  for d in ".rt-$NAME-"[0-9]*; do
    echo "  run(command='bash dev/device_real_targets.sh piece $d', carry=['$d'])   # $(mib "$d") MiB"
  done
  echo "  run(command='bash dev/device_real_targets.sh start $NAME', carry=['$RUN'], timeout_s=600)   # $(mib "$RUN") MiB"
  echo "  run(command='bash dev/device_real_targets.sh wait', timeout_s=600)   # as often as needed, until it prints 'recipe finished'"
  echo "tracked tree: $(git ls-files -z | xargs -0 du -cb | tail -1 | awk '{printf "%.1f", $1 / 1048576}') MiB travels with each call"
  ;;
piece)
  DIR=${2:?piece DIR}
  D=~/rt/$(basename "$DIR" | sed 's/^\.rt-//; s/-[0-9]*$//')  # ~/rt/NAME
  mkdir -p "$D" && cp "$DIR"/gguf.part* "$D/" && ls -l "$D" | tail -n +2 | awk -v d="$D" '{s += $5} END {printf "%s: %d pieces, %.1f MiB\n", d, NR, s / 1048576}'
  ;;
start)
  NAME=${2:?start NAME}
  export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src DFLASH_TARGETS_DIR=$HOME/targets
  RUN=.rt-$NAME-run PIECES=~/rt/$NAME
  mkdir -p ~/site ~/targets "$PIECES" && cp -r "$RUN"/site/* ~/site/ && cp "$RUN"/gguf.part* "$PIECES/" || exit 1
  if pgrep -f prepared_runs >/dev/null; then echo "a recipe job is still running here: 'wait' for it first" >&2; exit 1; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target ~/site "$RUN"/whl/*.whl \
    > ~/pip.log 2>&1 || { cat ~/pip.log; exit 1; }  # --upgrade: replaces what ~/site holds (an older transformers)
  python3 -c "import datasets, pyarrow" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target ~/site "$RUN"/whl-alt/*.whl
  python3 -c 'import sys, transformers as t; from packaging.version import Version as V; print("transformers", t.__version__)
sys.exit(V(t.__version__) < V("5.18"))' || { echo "transformers < 5.18 in ~/site: it mis-splits Gemma's tokenizer" >&2; exit 1; }
  GG=~/targets/$(gguf_of "$NAME")
  cat "$PIECES"/gguf.part* > "$GG.partial" && rm -rf "$PIECES"
  python3 - "$NAME" "$GG.partial" <<'PY' || exit 1
import hashlib, os, sys
from dflash_trainer.target_model.packaged_targets import PACKAGED_TARGETS
t, path = PACKAGED_TARGETS[sys.argv[1]], sys.argv[2]
h = hashlib.sha256()
with open(path, "rb") as f:
    while block := f.read(1 << 24):
        h.update(block)
ok = h.hexdigest() == t.sha256 and os.path.getsize(path) == t.size
print(f"{t.name}: {os.path.getsize(path):,} bytes, sha256 {h.hexdigest()[:16]} {'ok' if ok else 'MISMATCH (a piece is missing?)'}")
sys.exit(0 if ok else 1)
PY
  mv "$GG.partial" "$GG"
  # the target's dense copies (target_model/gguf_cache.py), bf16 for training and fp32 for the evals, written while
  # prepare runs, so that the trainings usually spend no TRAIN_SECONDS dequantizing (detached like the recipe below,
  # so that the call's end does not stop them; output to files)
  for dt in bfloat16 float32; do
    (setsid nohup python3 -c 'import sys, torch; from dflash_trainer.target_model.load import load_target as l
l(sys.argv[1], device="cpu", dtype=getattr(torch, sys.argv[2]))' "$GG" "$dt" > ~/warm-$dt.log 2>&1 < /dev/null &)
  done
  xz -dc "$RUN/originals.jsonl.xz" > ~/originals.jsonl
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  rm -rf ~/rtwork ~/repo; cp -r "$PWD" ~/repo; rm -rf ~/repo/.rt-*
  # the backgrounded list is a subshell that waits for the job: its output goes to a file so that it does not hold
  # this script's stdout open (a caller reading it would then wait for the whole recipe)
  (cd ~/repo && TARGET=$NAME CONFIG=configs/$NAME-h200.yaml RUNS="${VARIANTS:-drafter control}" \
     TRAIN_SECONDS=${TRAIN_SECONDS:-420} EVAL_PROMPTS=$(eval_prompts_of "$NAME") EVAL_TOKENS=${EVAL_TOKENS:-256} \
     REPORT_MODEL=$NAME DFT="python3 -m dflash_trainer.cli.main" RESULTS=~/rtwork/results \
     setsid nohup bash -c 'bash dev/prepared_runs.sh ~/rtwork ~/originals.jsonl; touch ~/rtwork/done' > ~/rtwork.log 2>&1 < /dev/null &) > ~/rtwork.start.log 2>&1
  sleep 5; cat ~/rtwork.start.log; follow "${WAIT:-420}"
  ;;
wait)
  follow "${LIMIT:-540}"
  mkdir -p "$OUT"
  if [ -f ~/rtwork/done ]; then
    echo "recipe finished"
    cp ~/rtwork/results/* "$OUT/" 2>/dev/null
    (cd ~/rtwork && tar czf "$OUT/rtwork.tgz" --ignore-failed-read ./*.log stages.txt runs.jsonl ./*/metrics.jsonl \
       ./*/summary.json ./data*/prepare_report.json ./eval-*.json 2>/dev/null)
  fi
  ;;
dry-run)  # CPU, toy sizes: the recipe's plumbing with this target (not a measurement; the report keeps the _h200_ name)
  NAME=${2:?dry-run NAME}
  W=${WORK:-/tmp/rt-dry-$NAME}
  export PYTHONPATH=$PWD/src
  rm -rf "$W" && mkdir -p "$W"
  python3 "$HERE/stage_prompts.py" "$W/originals.jsonl" 12 --keep-answers || exit 1
  cat > "$W/tiny.yaml" <<EOF
seq_len: 256
num_layers: 1
block_size: 4
num_anchors: 8
rows_per_step: 1
max_steps: 2
log_every: 1
validation_max_rows: 1
device: cpu
EOF
  TARGET=$NAME CONFIG=$W/tiny.yaml SEQ_LEN=256 RUNS="${VARIANTS:-drafter control}" EVAL_PROMPTS=1 \
    EVAL_TOKENS=${EVAL_TOKENS:-8} REPORT_MODEL=$NAME DFT="python3 -m dflash_trainer.cli.main" RESULTS=$W/results \
    bash "$HERE/prepared_runs.sh" "$W/work" "$W/originals.jsonl"
  ls "$W/results"
  ;;
*) echo "unknown mode $MODE (see the header of $0)" >&2; exit 2;;
esac
