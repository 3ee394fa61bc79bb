#!/usr/bin/env bash
# Step-time levers on one H200, measured in one call:
#   (1) `bench step` on the reference config with the code as carried in .stage1/base/src (before) and as in
#       this tree (after), same process image, one after the other;
#   (2) benchmarks/flex_options.py: flex attention kernel options on the reference step's masks;
#   (3) benchmarks/optimizer_options.py: clip + AdamW implementations on the reference drafter's parameters;
#   (4) a Chrome trace of `bench step` (every kernel of the profiled steps);
#   (5) gputests: tests/gpu/test_clipped_step_cuda.py, test_sync_free_step.py and test_fused_loss_cuda.py;
#   (6) loss / loss2: before, then this tree with loss_impl fused and autograd, interleaved (two calls);
#   (7) cerows: benchmarks/ce_rows_options.py, the CE row kernels alone;
#   (8) smollm2: bench step --config configs/smollm2-h200.yaml, before and after; (9) colocated: bench colocated.
# Carries .stage1 (whl/, whl-alt/: the wheels the image lacks; base/src: the "before" tree, from
#   mkdir -p .stage1/base && git archive REV src | tar -x -C .stage1/base).
# Run on the GPU machine from the repository root, with .stage1 copied beside the tree: bash dev/device_levers.sh
# PARTS (default "steps flex") picks the parts; FLEX_ARGS is passed to flex_options.py.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p ~/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage1/whl/*.whl || exit 1
PYTHONPATH=$HOME/site python3 -c "import datasets, pyarrow" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target ~/site .stage1/whl-alt/*.whl
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
step() {  # step NAME SRC [ARGS…]: bench step (reference config) with the package at SRC, more bench step ARGS
  local t0 name=$1 src=$2; t0=$(date +%s); shift 2
  PYTHONPATH=$HOME/site:$src timeout -k 10 240 python3 -m dflash_trainer.cli.main bench step --iters 20 \
    --json "$OUT/step-$name.json" "$@" > "$OUT/step-$name.log" 2>&1
  echo "== step $name rc=$? in $(( $(date +%s) - t0 )) s"
  python3 - "$OUT/step-$name.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print("  no result:", e); sys.exit()
secs = {k: round(v["ms"], 2) for k, v in (d.get("breakdown") or {}).get("sections", {}).items() if v["ms"]}
print(f"  step {d['step_ms_median']:.2f} ms, {d['context_tok_per_s']:.0f} tok/s, MFU {d['mfu_vs_measured_matmul']:.3f}, "
      f"peak {d['peak_mem_gib']:.2f} GiB; {secs}")
PY
}
for part in ${PARTS:-steps flex}; do
  case $part in
  steps)
    step before "$PWD/.stage1/base/src"
    step after "$PWD/src"
    ;;
  abba)  # before, after, after, before: a linear drift of the GPU's clock (it warms up) cancels in the means
    step before1 "$PWD/.stage1/base/src"
    step after1 "$PWD/src"
    step after2 "$PWD/src"
    step before2 "$PWD/.stage1/base/src"
    ;;
  loss)  # the LM head + loss: before (autograd), then this tree with loss_impl fused and autograd, interleaved
    step before1 "$PWD/.stage1/base/src"
    step fused1 "$PWD/src" --loss-impl fused
    step autograd1 "$PWD/src" --loss-impl autograd
    ;;
  loss2)  # the rest of the interleaving: fused, autograd, before
    step fused2 "$PWD/src" --loss-impl fused
    step autograd2 "$PWD/src" --loss-impl autograd
    step before2 "$PWD/.stage1/base/src"
    ;;
  smollm2)  # the SmolLM2 recipe config's drafter step (a random-weight target of its shape when its GGUF is absent)
    step smollm2-before "$PWD/.stage1/base/src" --config configs/smollm2-h200.yaml
    step smollm2-after "$PWD/src" --config configs/smollm2-h200.yaml
    ;;
  colocated)  # bench colocated (random Qwen3-8B-shaped target), this tree
    PYTHONPATH=$HOME/site:$PWD/src timeout -k 15 280 python3 -m dflash_trainer.cli.main bench colocated --out /tmp/coloc \
      --json "$OUT/colocated.json" > "$OUT/colocated.log" 2>&1
    echo "== colocated rc=$?"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('drafter_step_ms_median', 'target_forward_ms_median', 'serial_bound_tok_per_s', 'end_to_end_tok_per_s', 'ratio_end_to_end_over_serial', 'peak_mem_gib_run')})" "$OUT/colocated.json"
    ;;
  cerows)  # the CE row kernels alone: tile / warps sweep at the reference shape
    PYTHONPATH=$HOME/site:$PWD/src timeout -k 10 240 python3 benchmarks/ce_rows_options.py > "$OUT/ce_rows.json" \
      2> "$OUT/ce_rows.err"
    echo "== cerows rc=$?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(' ', r) for r in d['runs']]; print(' compiled pass', d['compiled_elementwise_pass_ms'], 'torch', d['torch_backend_ms'])" "$OUT/ce_rows.json"; tail -3 "$OUT/ce_rows.err"
    ;;
  gputests)  # the GPU tests of the compiled clip + AdamW update, the sync-free step and the fused loss
    # shellcheck disable=SC2086
    PYTHONPATH=$HOME/site:$PWD/src:$PWD timeout -k 10 300 python3 -m pytest -q -p no:cacheprovider -s \
      ${GPU_TESTS:-tests/gpu/test_clipped_step_cuda.py tests/gpu/test_sync_free_step.py tests/gpu/test_fused_loss_cuda.py} \
      > "$OUT/gputests.log" 2>&1
    echo "== gputests rc=$?"; tail -4 "$OUT/gputests.log"
    ;;
  opt)
    t0=$(date +%s)
    PYTHONPATH=$HOME/site:$PWD/src timeout -k 10 300 python3 benchmarks/optimizer_options.py > "$OUT/optimizer.json" \
      2> "$OUT/optimizer.err"
    echo "== optimizer rc=$? in $(( $(date +%s) - t0 )) s"; cat "$OUT/optimizer.json"; tail -3 "$OUT/optimizer.err"
    ;;
  trace)  # bench step (this tree) with a Chrome trace of the profiled steps (gzipped; the kernel list is read here)
    # shellcheck disable=SC2086
    PYTHONPATH=$HOME/site:$PWD/src timeout -k 10 240 python3 -m dflash_trainer.cli.main bench step --iters 10 ${TRACE_ARGS:-} \
      --json "$OUT/step-trace.json" --profile-trace /tmp/step.trace.json > "$OUT/step-trace.log" 2>&1
    echo "== trace rc=$?"; gzip -c /tmp/step.trace.json > "$OUT/step.trace.json.gz"; ls -la "$OUT/step.trace.json.gz"
    ;;
  flex)
    t0=$(date +%s)
    # shellcheck disable=SC2086
    PYTHONPATH=$HOME/site:$PWD/src timeout -k 10 "${FLEX_SECONDS:-300}" python3 benchmarks/flex_options.py ${FLEX_ARGS:-} \
      > "$OUT/flex.jsonl" 2> "$OUT/flex.err"
    echo "== flex rc=$? in $(( $(date +%s) - t0 )) s"
    python3 - "$OUT/flex.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    if "error" in d:
        print(f"  {d['name']:18s} ERROR {d['error'][:160]}"); continue
    w = "  ".join(f"W={k}: fwd {v['fwd_ms']:.3f} bwd {v['bwd_ms']:.3f} diff {v['max_abs_diff_vs_default']:.3g}"
                  for k, v in d["per_window"].items())
    print(f"  {d['name']:18s} 5 layers fwd+bwd {d['reference_layers_fwd_bwd_ms']:.2f} ms | {w}")
PY
    tail -3 "$OUT/flex.err"
    ;;
  esac
done
