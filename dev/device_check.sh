#!/usr/bin/env bash
# One H200, a call per group of steps (the machine stays warm ~30 s between calls; wheels go to
# ~/site, outside the tree, so later calls reuse them):
#   STEPS="tests target step"   GPU tests (-m gpu), `bench target` (plain HF causal, SDPA + dense mask,
#                               flex eager, flex compiled layers), `bench step` (reference drafter)
#   STEPS="colocated"           `bench colocated --steps 60`, compiled target layers then eager ones
# The image lacks pydantic, datasets (+dill, multiprocess): carry .stage3 (those wheels only) on a bare
# machine. Results in $OUT: JSON per bench + logs.
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if ! python3 -c "import pydantic, datasets" 2>/dev/null; then
  [ -d .stage3/whl ] || { echo "pydantic/datasets missing and no .stage3/whl carried"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage3/whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
for s in ${STEPS:-tests target step}; do
  t0=$(date +%s)
  case $s in
  tests)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -4 ;;
  target)
    timeout -k 15 240 python3 -m dflash_trainer.cli.main bench target --device cuda --shape qwen3-8b --seq-len 8192 \
      --docs 8 --iters 8 --json "$OUT/bench-target.json" > "$OUT/bench_target.log" 2>&1; echo "bench target rc=$?"
    python3 - "$OUT/bench-target.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, paths in d["results"].items():
    print(m, {p: round(v["tok_per_s"]) for p, v in paths.items()})
print("speedup", json.dumps(d["speedup"]), "\nlm_head", d["lm_head"], "\ncompiled_vs_sdpa", d["compiled_vs_sdpa"],
      "\nflex_vs_sdpa", d["flex_vs_sdpa"], "layers_compiled", d["layers_compiled"])
PY
    ;;
  step)
    timeout -k 15 200 python3 -m dflash_trainer.cli.main bench step --json "$OUT/bench-step.json" > "$OUT/bench_step.log" 2>&1
    echo "bench step rc=$?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('step_ms_all',None); d.pop('shape',None); print(json.dumps(d))" "$OUT/bench-step.json" ;;
  colocated)
    for tc in target-compile no-target-compile; do
      timeout -k 15 280 python3 -m dflash_trainer.cli.main bench colocated --steps 60 --$tc --out /tmp/coloc-$tc \
        --json "$OUT/bench-colocated-$tc.json" > "$OUT/colocated-$tc.log" 2>&1; echo "bench colocated --$tc rc=$?"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [d.pop(k) for k in ('intervals','shape')]; print(json.dumps(d))" "$OUT/bench-colocated-$tc.json"
    done ;;
  esac
  echo "== $s took $(( $(date +%s) - t0 )) s"
done
