#!/usr/bin/env bash
# Builds, on this machine, the git-ignored folders that dev/device_recipe.sh carries to a GPU machine
# without a registry (64 MiB per call, the tracked tree included), for a recipe that regenerates the whole
# prompt mixture (no reused regeneration):
#   .stage1       gguf.part00 (the embedded SmolLM2 GGUF, first half), whl/ (the wheels the image lacks), whl-alt/
#                 (an older datasets for the image's pyarrow), whl-fp8/ (torchao: the fp8 setting, device_fp8.sh),
#                 site/ (the MT-Bench and HumanEval files): 55 MB
#   .stage-extra  prompts.a.jsonl.xz, prompts.b.jsonl.xz (the mixture in two xz halves): 18 MB
#   .stage2       gguf.part01, heldout64.jsonl (held-out ShareGPT prompts for measured τ): 47 MB
# Each folder goes to the GPU host with the tracked tree (about 7 MB; 64 MiB per copy), and the commands follow each
# other there while its files outside the tree are kept (device_recipe.sh's header):
#   with .stage1:      SKIP_TESTS=1 bash dev/device_recipe.sh stage1
#   with .stage-extra: bash dev/device_recipe.sh extra
#   with .stage2:      VARIANTS="drafter control" bash dev/device_recipe.sh stage2
#   then, until the recipe is done: LIMIT=540 REGEN_BACK=1 bash dev/device_recipe.sh wait
# Needs `make setup` (the venv with the package, the embedded model and data). The mixture is built with
# `dflash-train mixture --spec MIXTURE_SPEC` unless PROMPTS names an existing chat file.
# Usage: bash dev/stage_recipe.sh    (then the calls in the header of dev/device_recipe.sh)
set -euo pipefail
PY=${PY:-.venv/bin/python}
DFT=${DFT:-.venv/bin/dflash-train}
WORK=${WORK:-runs/stage-recipe}
mkdir -p "$WORK"
# data brought back from a GPU run (a regeneration, originals, diagnostic prompts) is never deleted here
kept=$(ls -d .stage1/regen.* .stage2/regen.* .stage-extra/regen.* .stage*/originals.* .stage2/diag 2>/dev/null || true)
if [ -n "$kept" ]; then
  echo "stage_recipe.sh: these would be deleted; move them elsewhere first: $kept" >&2; exit 2
fi
rm -rf .stage1 .stage2 .stage-extra && mkdir -p .stage1/whl .stage1/whl-alt .stage1/whl-fp8 .stage1/site .stage2 .stage-extra

# shellcheck source=dev/stage_common.sh
. "$(dirname "$0")/stage_common.sh"
stage_ignore
stage_gguf_halves "$WORK" .stage1 .stage2
stage_wheels .stage1/whl .stage1/whl-alt
$PY -m pip download -q --no-deps --only-binary=:all: -d .stage1/whl-fp8 torchao==0.18.0
stage_eval_files .stage1/site

prompts=${PROMPTS:-$WORK/prompts.jsonl}
if [ ! -f "$prompts" ]; then
  $DFT mixture --spec "${MIXTURE_SPEC:-configs/mixture-smollm2.yaml}" --out "$prompts" > "$WORK/mixture.log" 2>&1 ||
    { tail -20 "$WORK/mixture.log" >&2; exit 1; }
fi
n=$(wc -l < "$prompts"); half=$(( (n + 1) / 2 ))
head -n "$half" "$prompts" | xz -9 -T0 > .stage-extra/prompts.a.jsonl.xz
tail -n +"$((half + 1))" "$prompts" | xz -9 -T0 > .stage-extra/prompts.b.jsonl.xz
PYTHONPATH=src $PY dev/stage_prompts.py .stage2/heldout64.jsonl 64 --heldout

du -sh --apparent-size .stage1/* .stage-extra/* .stage2/*
echo "tracked tree: $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1); the limit per call is 64 MiB"
