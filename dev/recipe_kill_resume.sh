#!/usr/bin/env bash
# On a GPU host with the package on PYTHONPATH: `recipe --target smollm2-135m --out RUN` as a user would run it, with
# KILLS=both (the default; regen: the first only; 0: none) stopped twice on purpose and resumed by the same command each time, then once more (nothing to redo):
#   1. SIGTERM once regenerate has run KILL_REGEN_S (150) seconds;  2. SIGTERM once training logged step KILL_STEP (2000);
#   3. the same command to the end;  4. the same command again;  5. with THEN_FLAGS, one more recipe run with those
#   flags in RUN-b on RUN's regeneration and rows.
# Also the plan of the other kind (H100 80 GiB ↔ H200 141 GiB) as JSON in ~ (this card's: RUN/plan.json). Writes ~/driver.done last.
set -u
RUN=${1:?RUN}
DFT="python3 -m dflash_trainer.cli.main"
CMD=${CMD:-"$DFT recipe --target smollm2-135m --out $RUN ${RECIPE_FLAGS:-}"}  # CMD: another recipe command (its --out RUN)
say() { echo "[driver $(date +%T)] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi: planning the other card as an H200"
cat COMMIT 2>/dev/null || true
total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
total=${total:-0}
other=$([ "$total" -gt 100000 ] && echo 79 || echo 139)
# the other kind's plan on the CPU while the recipe runs (this card's is RUN/plan.json)
[ "${OTHER_PLAN:-1}" = 0 ] || ($CMD --plan --gpu-memory-gib "$other" --plan-json ~/plan-other-card.json > ~/plan-other-card.txt 2>&1; \
 say "the plan for $other GiB written") &
launch() { $CMD >> ~/recipe.out 2>&1 & PID=$!; say "recipe started, pid $PID"; }
finish() { wait "$PID"; local rc=$?; say "recipe exited $rc"; }
last_step() { tail -1 "$RUN/drafter/metrics.jsonl" 2>/dev/null | python3 -c 'import json,sys; print(json.loads(sys.stdin.read() or "{}").get("step", 0))' 2>/dev/null || echo 0; }
if [ "${KILLS:-both}" = both ] || [ "${KILLS:-both}" = regen ]; then
  launch
  while kill -0 "$PID" 2>/dev/null && [ ! -f "$RUN/stages/regenerate.started.json" ]; do sleep 2; done
  sleep "${KILL_REGEN_S:-150}"; say "SIGTERM during regenerate"; kill -TERM "$PID"; finish; ls "$RUN" "$RUN/stages"
fi
if [ "${KILLS:-both}" = both ]; then
  launch
  while kill -0 "$PID" 2>/dev/null && [ "$(last_step)" -lt "${KILL_STEP:-2000}" ]; do sleep 3; done
  say "SIGTERM during train at step $(last_step)"; kill -TERM "$PID"; finish; ls "$RUN/stages" "$RUN/drafter"
fi
launch; finish
say "once more: nothing should be redone"; $CMD > ~/recipe-again.out 2>&1; say "recipe exited $? (again)"
grep "skipped\|reused\|done in" ~/recipe-again.out; tail -3 ~/recipe-again.out
# THEN_FLAGS: one more recipe run, in RUN-b, with these flags on RUN's mixture, regeneration and rows (their
# records are copied, so only train and what follows run)
if [ -n "${THEN_FLAGS:-}" ]; then
  R2="${RUN%/}-b"; rm -rf "$R2" && mkdir -p "$R2/stages"
  cp -r "$RUN"/mixture.yaml "$RUN"/prompts.jsonl* "$RUN"/regen.jsonl* "$RUN"/data "$R2"/ 2>/dev/null
  cp "$RUN"/stages/mixture.json "$RUN"/stages/regenerate.json "$RUN"/stages/prepare.json "$R2"/stages/
  say "recipe in $R2 with $THEN_FLAGS"
  ${CMD2:-$DFT recipe --target smollm2-135m --out $R2 ${RECIPE_FLAGS:-} $THEN_FLAGS} >> ~/recipe-b.out 2>&1; say "recipe in $R2 exited $?"
fi
touch ~/driver.done
