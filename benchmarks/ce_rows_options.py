"""The CE row passes (drafter/ce_rows.py) at the reference step's shape, [7,680 × 151,936] bf16 LM-head rows
(512 blocks × 15 trained slots): time of each pass by tile width and warps, its bandwidth (bytes it must
move ÷ time), the torch-ops backend and the compiled elementwise pass of drafter/fused_loss.py for comparison,
and the largest difference from the torch backend. One process, CUDA events (a sweep, not a test).

    python benchmarks/ce_rows_options.py > ce_rows.json
"""

from __future__ import annotations

import functools
import json
import statistics

import torch

from dflash_trainer.telemetry.timing import cuda_times
from dflash_trainer.drafter import ce_rows
from dflash_trainer.drafter.fused_loss import _compiled
from dflash_trainer.drafter.loss import LossOptions

N, V = 7680, 151936


def _time(fn, iters: int = 10) -> float:
    """Median GPU ms of `iters` calls after one warm-up call (compiles the kernel)."""
    fn()
    return statistics.median(cuda_times(fn, iters))


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    z = (2.5 * torch.randn(N, V, device=dev, generator=g)).bfloat16()
    labels = torch.randint(0, V, (N,), device=dev, generator=g)
    coef = torch.rand(N, device=dev, generator=g)
    buf = torch.empty_like(z)
    row_bytes = N * V * z.element_size()
    lse_ref, _, amax_ref = ce_rows.row_stats(z, labels, backend="torch")
    ref = z.clone()
    ce_rows.ce_logit_grad_(ref, labels, lse_ref, coef, backend="torch")
    out = {"shape": [N, V], "dtype": "bfloat16", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "runs": []}
    for tile in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            ce_rows._TILE, ce_rows._STATS_WARPS, ce_rows._GRAD_WARPS = tile, warps, warps
            try:
                stats_ms = _time(lambda: ce_rows.row_stats(z, labels, backend="triton"))

                def grad():
                    buf.copy_(z)
                    ce_rows.ce_logit_grad_(buf, labels, lse_ref, coef, backend="triton")

                copy_ms = _time(lambda: buf.copy_(z))
                grad_ms = _time(grad) - copy_ms
                lse, _, amax = ce_rows.row_stats(z, labels, backend="triton")
                grad()
                out["runs"].append({
                    "tile": tile, "warps": warps, "stats_ms": round(stats_ms, 4), "grad_ms": round(grad_ms, 4),
                    "stats_TBps": round(row_bytes / stats_ms / 1e9, 3), "grad_TBps": round(2 * row_bytes / grad_ms / 1e9, 3),
                    "lse_max_abs_diff": float((lse - lse_ref).abs().max()), "argmax_equal": bool(torch.equal(amax, amax_ref)),
                    "grad_max_abs_diff": float((buf.float() - ref.float()).abs().max())})
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile is reported, not fatal
                out["runs"].append({"tile": tile, "warps": warps, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    opts = LossOptions(kind="ce", position_weights="decay")
    compiled = _compiled(opts)
    w = torch.ones(N // 15, 15, device=dev)
    valid = torch.ones(N // 15, 15, device=dev, dtype=torch.bool)
    lab = labels.view(N // 15, 15)

    def compiled_pass():
        buf.copy_(z)
        compiled(buf, None, lab, w, valid)

    out["compiled_elementwise_pass_ms"] = round(_time(compiled_pass) - _time(lambda: buf.copy_(z)), 4)
    out["torch_backend_ms"] = round(_time(functools.partial(ce_rows.row_stats, z, labels, backend="torch")), 4)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
