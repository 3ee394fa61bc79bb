"""The fit behind recipe/regen_time.py, from `dflash-train bench regen-shapes --json` files of one card: the
step-time model's four coefficients (least squares on relative error), each run's prediction, and each shape's
runs predicted by a fit without that shape. Writes one results JSON holding the raw runs too.

Usage: python benchmarks/regen_shapes_fit.py OUT.json RUN.json [RUN.json ...] [--commit SHA] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

TERMS = ("layers", "rows", "rows·params", "rows·kv_bytes")


def _features(run: dict) -> list[float]:
    kv = 2 * run["layers"] * run["kv_heads"] * run["head_dim"] * 2
    return [run["layers"], run["rows"], run["rows"] * run["params"], run["rows"] * kv]


def _fit(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(x / t[:, None], np.ones(len(t)), rcond=None)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--commit")
    ap.add_argument("--note")
    a = ap.parse_args()
    files = {Path(p).name: json.loads(Path(p).read_text()) for p in a.runs}
    rows = [(f, name, run) for f, d in files.items() for name, run in d["shapes"].items()]
    x = np.array([_features(r) for _, _, r in rows], float)
    t = np.array([r["ms_per_step"] for _, _, r in rows])
    names = np.array([n for _, n, _ in rows])
    c = _fit(x, t)
    pred = x @ c
    held = {}
    for shape in sorted(set(names)):
        keep = names != shape
        ck = _fit(x[keep], t[keep])
        held[shape] = [round(float(v), 4) for v in (x[~keep] @ ck) / t[~keep]]
    out = {
        "what": "regeneration decode step time by target shape (random weights), and the fit recipe/regen_time.py uses",
        "note": a.note, "commit": a.commit,
        "device": sorted({d["device"] for d in files.values()}), "torch": sorted({d["torch"] for d in files.values()}),
        "model": "step_ms = c_layers·layers + rows·(c_rows + c_params·params + c_kv·kv_bytes_per_token)",
        "coefficients": dict(zip(TERMS, map(float, c))),
        "rms_relative_error": float(np.sqrt(np.mean((pred / t - 1) ** 2))),
        "runs": [{"file": f, "shape": n, "rows": r["rows"], "ms_per_step": r["ms_per_step"],
                  "tokens_per_s": r["tokens_per_s"], "predicted_ms": float(p), "predicted_over_measured": float(p / m)}
                 for (f, n, r), p, m in zip(rows, pred, t)],
        "left_out_shape_predicted_over_measured": held,
        "raw": files,
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("coefficients", "rms_relative_error", "left_out_shape_predicted_over_measured")},
                     indent=1))


if __name__ == "__main__":
    main()
