#!/usr/bin/env bash
# One call on a GPU host, with .stage1 carried: the row kernel for verify blocks (step_attention "row") checked
# and timed against "cache" / "sdpa". Results under $OUT:
#   tests-row.log            tests/gpu/test_row_attention_cuda.py, test_engine_cuda.py, test_draft_length_cuda.py
#   attention-shapes.json    benchmarks/attention_shapes.py (row_attention at decode and verify shapes)
#   engine-R-MODE/ + .log    benchmarks/engine_profile.py at ROWS_MODES (random SmolLM2-shaped bf16 target)
# Env: ROWS_MODES ("1:cache 1:sdpa 1:row 64:sdpa 64:row 256:sdpa 256:row"), NEW (new tokens, 128), EP_S (60 s a profile).
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src:$PWD
bash dev/device_recipe_cmd.sh stage1 > "$OUT/stage1.log" 2>&1 || { tail -5 "$OUT/stage1.log"; exit 1; }
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, 'triton', triton.__version__)"
timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_row_attention_cuda.py tests/unit/test_row_attention.py \
  tests/gpu/test_engine_cuda.py tests/gpu/test_draft_length_cuda.py > "$OUT/tests-row.log" 2>&1
echo "tests exit $?: $(tail -1 "$OUT/tests-row.log")"
timeout -k 5 90 python3 benchmarks/attention_shapes.py --out "$OUT/attention-shapes.json" > "$OUT/attention-shapes.log" 2>&1
echo "attention shapes exit $?"; cut -c1-400 "$OUT/attention-shapes.log"
for rm in ${ROWS_MODES:-1:cache 1:sdpa 1:row 64:sdpa 64:row 256:sdpa 256:row}; do
  R=${rm%%:*}; M=${rm##*:}
  timeout -k 5 "${EP_S:-60}" python3 benchmarks/engine_profile.py --out "$OUT/engine-$R-$M" --rows "$R" --step-attention "$M" \
    --new-tokens "${NEW:-128}" --no-traces > "$OUT/engine-$R-$M.log" 2>&1
  echo "engine rows $R $M exit $?"; grep "^rows\|^step attention\|^round ms" "$OUT/engine-$R-$M.log" | cut -c1-330
done
# a call brings back at most 8 files: everything in one archive
tar czf /tmp/row-steps.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/row-steps.tgz "$OUT/"
