"""recipe/regen_time.py: the decode step model against hand-worked values, and against the H100 runs it was
fitted on (benchmarks/results/bench-regen-shapes_h100_2026-12-07.json)."""

import json
from pathlib import Path

import pytest

from dflash_trainer.recipe import regen_time
from dflash_trainer.recipe.memory import TargetShape
from dflash_trainer.recipe.plan import SMOLLM2_135M as S
from dflash_trainer.recipe.regen_time import decode_rate, kv_bytes_per_token, regen_rate_ratio, step_ms

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "bench-regen-shapes_h100_2026-12-07.json"


def test_step_and_rate_by_hand():
    # SmolLM2: KV 2 · 30 · 3 · 64 · 2 = 23,040 bytes a token; per row 0.01378 + 2.417e-11 · 134.5e6 (0.0032509)
    # + 6.019e-7 · 23,040 (0.0138678) = 0.0308987 ms; 30 layers · 0.1 = 3.0 ms
    assert kv_bytes_per_token(S) == 23_040
    assert step_ms(S, 1024) == pytest.approx(3.0 + 1024 * 0.0308987, rel=1e-5)  # 34.640 ms
    assert decode_rate(S, 1024) == pytest.approx(1024 / 34.640e-3, rel=1e-4)  # 29,561 tok/s
    assert regen_rate_ratio(S, 1024, S, 1024) == 1.0
    # fewer rows are slower per token (the layers' fixed part is shared by fewer rows): 256 rows 10.910 ms
    assert regen_rate_ratio(S, 256, S, 1024) == pytest.approx((256 / 10.910) / (1024 / 34.640), rel=1e-4)


def test_the_fit_reproduces_the_runs_it_was_fitted_on():
    """The module's constants are the committed fit's, rounded; each run is predicted within 16 % but the one
    noted outlier. Prevents the constants from drifting away from the measurements they cite."""
    d = json.loads(RESULTS.read_text())
    c = d["coefficients"]
    assert regen_time.PER_LAYER_MS == pytest.approx(c["layers"], rel=1e-3)
    assert regen_time.PER_ROW_MS == pytest.approx(c["rows"], rel=1e-3)
    assert regen_time.PER_ROW_PARAM_MS == pytest.approx(c["rows·params"], rel=1e-3)
    assert regen_time.PER_ROW_KV_MS == pytest.approx(c["rows·kv_bytes"], rel=1e-3)
    errors = []
    for run in d["runs"]:
        shape = d["raw"][run["file"]]["shapes"][run["shape"]]
        ts = TargetShape(hidden=shape["hidden"], layers=shape["layers"], kv_heads=shape["kv_heads"],
                         head_dim=shape["head_dim"], vocab=shape["vocab"], params=shape["params"])
        errors.append(step_ms(ts, run["rows"]) / run["ms_per_step"] - 1)
    assert len(errors) == 14
    assert sorted(abs(e) for e in errors)[-2] < 0.16  # all but the 25.7 ms Qwen3-1.7B run
    assert min(errors) > -0.35


def test_the_fit_script_refits_the_committed_runs(tmp_path):
    """benchmarks/regen_shapes_fit.py on the committed raw runs gives the committed coefficients."""
    import subprocess
    import sys

    d = json.loads(RESULTS.read_text())
    files = []
    for name, raw in d["raw"].items():
        (tmp_path / name).write_text(json.dumps(raw))
        files.append(str(tmp_path / name))
    out = tmp_path / "fit.json"
    r = subprocess.run([sys.executable, str(RESULTS.parents[1] / "regen_shapes_fit.py"), str(out), *files],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    refit = json.loads(out.read_text())
    for term, value in d["coefficients"].items():
        assert refit["coefficients"][term] == pytest.approx(value, rel=1e-9)
    assert refit["left_out_shape_predicted_over_measured"] == d["left_out_shape_predicted_over_measured"]
