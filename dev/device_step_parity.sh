#!/usr/bin/env bash
# `dflash-train bench step` of two trees on one GPU, in one call: the reference config and
# configs/smollm2-h200.yaml, in the order before, after, after, before per config while the time
# budget allows (a linear drift of the GPU's clock cancels in the means). Writes one JSON with every
# run and the after/before ratios ($OUT/step-parity.json) and the log.
# Carries .stage1: whl/ + whl-alt/ (dev/stage_common.sh stage_wheels) and base/ (the "before" tree:
#   mkdir -p .stage1/base && git archive REV src configs | tar -x -C .stage1/base).
# Env: BASE_CLI (module of the before tree's app; default dflash_trainer.cli.main), BASE, COMMIT (ids
#   recorded in the JSON), BUDGET_S (seconds for the whole script, default 540).
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p ~/site /tmp/parity
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .stage1/whl/*.whl || exit 1
PYTHONPATH=$HOME/site python3 -c "import datasets, pyarrow" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target ~/site .stage1/whl-alt/*.whl
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader | tee -a "$OUT/log.txt"
t_start=$(date +%s)
budget=${BUDGET_S:-540}
step() {  # step NAME ROOT CLI [ARGS…]: bench step with the tree at ROOT (its src/ and configs/)
  local name=$1 root=$2 cli=$3 t0; shift 3
  if (( $(date +%s) - t_start > budget - 150 )); then echo "== $name skipped (time budget)" | tee -a "$OUT/log.txt"; return; fi
  t0=$(date +%s)
  (cd "$root" && PYTHONPATH=$HOME/site:$root/src timeout -k 10 280 python3 -m "$cli" bench step --iters 20 \
    --json "/tmp/parity/$name.json" "$@") >> "$OUT/log.txt" 2>&1
  echo "== $name rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/log.txt"
}
before=$PWD/.stage1/base after=$PWD base_cli=${BASE_CLI:-dflash_trainer.cli.main}
step ref-before1 "$before" "$base_cli"
step ref-after1 "$after" dflash_trainer.cli.main
step smollm2-before1 "$before" "$base_cli" --config configs/smollm2-h200.yaml
step smollm2-after1 "$after" dflash_trainer.cli.main --config configs/smollm2-h200.yaml
step ref-after2 "$after" dflash_trainer.cli.main
step ref-before2 "$before" "$base_cli"
step smollm2-after2 "$after" dflash_trainer.cli.main --config configs/smollm2-h200.yaml
step smollm2-before2 "$before" "$base_cli" --config configs/smollm2-h200.yaml
PYTHONPATH=$HOME/site python3 - "$OUT/step-parity.json" <<'PY'
import json, os, pathlib, platform, statistics, subprocess, sys, datetime
import torch
runs = {}
for p in sorted(pathlib.Path("/tmp/parity").glob("*.json")):
    try:
        runs[p.stem] = json.loads(p.read_text())
    except ValueError as e:
        runs[p.stem] = {"error": str(e)}
means, ratios = {}, {}
for cfg in ("ref", "smollm2"):
    for tree in ("before", "after"):
        ms = [r["step_ms_median"] for k, r in runs.items() if k.startswith(f"{cfg}-{tree}") and "step_ms_median" in r]
        if ms:
            means[f"{cfg}-{tree}"] = statistics.mean(ms)
    if f"{cfg}-before" in means and f"{cfg}-after" in means:
        ratios[cfg] = means[f"{cfg}-after"] / means[f"{cfg}-before"]
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
body = {"what": "bench step (reference config, configs/smollm2-h200.yaml): tree before vs after, interleaved",
        "date": datetime.date.today().isoformat(), "device": gpu, "torch": torch.__version__,
        "python": platform.python_version(), "base": os.environ.get("BASE"), "commit": os.environ.get("COMMIT"),
        "means_step_ms": means, "after_over_before": ratios, "runs": runs}
pathlib.Path(sys.argv[1]).write_text(json.dumps(body, indent=1) + "\n")
print(json.dumps({"means_step_ms": means, "after_over_before": ratios}, indent=1))
PY
