#!/usr/bin/env bash
# FP8 matmuls for the drafter (setting `fp8`, drafter/fp8.py) on one H200, in one call (≤ 600 s):
#   1. staging: the wheels of .stage1/whl and .stage1/whl-fp8 (torchao) into ~/site, as dev/device_profile.sh
#      stage1 does (dev/device_recipe.sh stage1 with SKIP_TESTS=1); skipped when ~/site already
#      imports torchao, pydantic, datasets and gguf (a machine still warm from a call that staged them);
#   2. the GPU test tests/gpu/test_fp8_cuda.py (FP8 against bf16: loss within 2 % / 5 %, finite grads,
#      state_dict keys/dtypes unchanged, the export loads back into the plain bf16 drafter);
#   3. `bench step --iters 10` at the reference configuration (Qwen3-8B-shaped drafter, T=8192, 512
#      anchors, B=16, random target outputs) with --fp8 off, rowwise and tensorwise, one process each:
#      step ms, context tok/s, MFU (against the bf16 matmul measured in the same process, for all three),
#      peak memory and the time breakdown by section.
# In $OUT: pytest-fp8.log, bench-step-fp8-{off,rowwise,tensorwise}.{json,log}, fp8-summary.json (the three
# rows side by side, with each recipe's speed-up over off); the tables print last.
# The torchao wheel must lie in .stage1/whl-fp8 (a git-ignored folder of the main checkout; torchao 0.18.0 is
# the newest release for torch 2.11, the device's torch, and needs torch >= 2.11):
#   pip download torchao==0.18.0 --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .stage1/whl-fp8
# (apart from .stage1/whl so that calls which need no FP8, e.g. the recipe's staging, leave its 3.4 MB behind)
# Run from that checkout:
#   run(command="bash dev/device_fp8.sh", carry=[".stage1/whl", ".stage1/whl-alt", ".stage1/whl-fp8"], timeout_s=600)
# BUDGET (s, default 570) bounds the whole call: a step that would not fit in what is left is skipped
# and said so. SKIP_TESTS=1 skips step 2; RECIPES="rowwise" benches off and the recipes listed.
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-570}
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
DFT="python3 -m dflash_trainer.cli.main"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
limit() {  # limit RESERVE CAP: seconds for the next step, keeping RESERVE s for the steps after it, at most CAP
  local t=$(( $(left) - $1 )); [ "$t" -gt "$2" ] && t=$2; echo "$t"
}
RECIPES=${RECIPES:-rowwise tensorwise}
NBENCH=$(( 1 + $(echo "$RECIPES" | wc -w) ))

# 1. staging
if python3 -c "import torchao.float8, pydantic, datasets, gguf" 2>/dev/null; then
  echo "staging: ~/site already holds the wheels"
else
  ls .stage1/whl-fp8/torchao-*.whl >/dev/null 2>&1 || { echo "no torchao wheel in .stage1/whl-fp8 (see this script's header)"; exit 1; }
  SKIP_TESTS=1 bash dev/device_recipe.sh stage1 2>&1 | grep -v "gguf.part00\|No such file" | tail -5
  python3 -c "import torchao.float8, pydantic, datasets, gguf" 2>/dev/null || { echo "staging failed: wheels missing"; exit 1; }
fi
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name(0), 'sm%d%d' % torch.cuda.get_device_capability(0))" 2>&1 | tail -1
echo "== staged in $(( $(date +%s) - T0 )) s"

# 2. the GPU test
if [ -z "${SKIP_TESTS:-}" ]; then
  t=$(limit $(( 110 * NBENCH )) 200)  # each bench keeps 110 s
  if [ "$t" -ge 60 ]; then
    t1=$(date +%s)
    timeout -k 10 "$t" python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_fp8_cuda.py > "$OUT/pytest-fp8.log" 2>&1
    rc=$?
    echo "== test_fp8_cuda rc=$rc in $(( $(date +%s) - t1 )) s (limit $t s): $(tail -1 "$OUT/pytest-fp8.log")"
    [ "$rc" -ne 0 ] && grep -E "^E |Error|assert" "$OUT/pytest-fp8.log" | head -20
  else
    echo "== test_fp8_cuda skipped: $(left) s left"
  fi
fi

# 3. bench step at the reference configuration, fp8 off and each recipe
bench() {  # bench RECIPE BENCHES_AFTER: one bench step process, its JSON and log in $OUT
  local name=bench-step-fp8-$1 secs
  secs=$(limit $(( 5 + 100 * $2 )) 200)
  if [ "$secs" -lt 60 ]; then echo "== $name skipped: $(left) s left"; return; fi
  local t1; t1=$(date +%s)
  timeout -k 10 "$secs" $DFT bench step --iters 10 --fp8 "$1" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - t1 )) s (limit $secs s)"
  [ "$rc" -ne 0 ] && tail -8 "$OUT/$name.log"
}
i=$NBENCH
for r in off $RECIPES; do i=$(( i - 1 )); bench "$r" "$i"; done

python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
from dflash_trainer.telemetry.breakdown import format_table
out = Path(sys.argv[1])
rows = {}
for p in sorted(out.glob("bench-step-fp8-*.json")):
    d = json.loads(p.read_text())
    rows[d.get("fp8", p.stem.rsplit("-", 1)[-1])] = d
base = rows.get("off")
summary = []
for name, d in rows.items():
    r = {"fp8": name, "step_ms_median": d["step_ms_median"], "context_tok_per_s": d["context_tok_per_s"],
         "mfu_vs_measured_bf16_matmul": d["mfu_vs_measured_matmul"], "peak_mem_gib": d["peak_mem_gib"],
         "gpu_busy_pct": d.get("gpu_busy_pct"), "fp8_linears": d.get("fp8_linears"),
         "speedup_vs_off": base["step_ms_median"] / d["step_ms_median"] if base else None}
    summary.append(r)
    print(f"--- fp8={name}: step {r['step_ms_median']:.2f} ms, {r['context_tok_per_s']:.0f} tok/s, MFU "
          f"{r['mfu_vs_measured_bf16_matmul']:.3f} (vs bf16 matmul), peak {r['peak_mem_gib']:.1f} GiB"
          + (f", {r['speedup_vs_off']:.3f}x off" if r["speedup_vs_off"] else ""))
    if r["fp8_linears"]:
        print("   " + r["fp8_linears"])
    if d.get("breakdown"):
        print(format_table(d["breakdown"]))
(out / "fp8-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
PY
echo "== done in $(( $(date +%s) - T0 )) s"
