#!/usr/bin/env bash
# GPU run for the pipeline numbers: GPU tests, then `bench pipeline` (needs 2 GPUs) or
# `bench colocated` (1 GPU). Usage: bash dev/device_pipeline.sh pipeline|colocated
# Results land in $OUT (JSON + log + the run's metrics.jsonl / summary.json).
set -u
WHAT=${1:-pipeline}
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
if [ "$WHAT" = pipeline ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -3
  timeout -k 15 ${LIMIT:-420} python3 -m dflash_trainer.cli.main bench pipeline --out /tmp/pipe --json "$OUT/pipeline_h200x2.json" \
    > "$OUT/pipeline.log" 2>&1; echo "bench pipeline rc=$?"
  cp /tmp/pipe/run/metrics.jsonl /tmp/pipe/run/summary.json /tmp/pipe/run/exit_status.json "$OUT/" 2>/dev/null
  grep -v "^\s*$" "$OUT/pipeline.log" | tail -40
else
  timeout -k 15 ${LIMIT:-420} python3 -m dflash_trainer.cli.main bench colocated --out /tmp/coloc --json "$OUT/colocated_h200.json" \
    > "$OUT/colocated.log" 2>&1; echo "bench colocated rc=$?"
  grep -v "^\s*$" "$OUT/colocated.log" | grep -v '"tok_per_s"\|"step"\|^ *[{}],\?$' | tail -40
fi
