"""Flex attention kernel options on the reference step's own masks: forward and backward time per
option set, one process, CUDA events (a tuning sweep, not a test).

Builds the reference shape's blocks and BlockMasks exactly as `bench step` does (8 documents, 512
anchors, B = 16, T = 8192; sliding W = 2048 and full), then times flex_attention forward and
backward for each option set on q [1,32,Q,128], k/v [1,8,T+Q,128] bf16 and checks every output
and gradient against the defaults' (bf16 tolerance). Prints one JSON line per option set.

    python benchmarks/flex_options.py [--autotune] > flex.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.nn.attention.flex_attention import flex_attention

from dflash_trainer.bench.common import BenchShape, synthetic_rows
from dflash_trainer.drafter.config import default_gamma
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.training.step import StepSettings, make_blocks, make_masks

OPTIONS = {
    "default": {},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "fwd_tma": {"USE_TMA": True},
    "fwd_128x128_s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8},
    "fwd_64x128_s3w4": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 4},
    "fwd_128x64_s4": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 4, "fwd_num_warps": 8},
    "bwd_64_all_s3w4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_stages": 3, "bwd_num_warps": 4},
    "bwd_64_all_s2w8": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_stages": 2, "bwd_num_warps": 8},
    "bwd_default_s2": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                       "bwd_num_stages": 2, "bwd_num_warps": 8},
    "bwd_default_s4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                       "bwd_num_stages": 4, "bwd_num_warps": 8},
    "bwd_32x128": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                   "bwd_num_stages": 3, "bwd_num_warps": 8},
    "bwd_no_write_dq": {"WRITE_DQ": False},
    "prescale": {"PRESCALE_QK": True},
}


def _time(fn, iters: int) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[iters // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--autotune", action="store_true", help="also compile with mode=max-autotune-no-cudagraphs")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma list of option names")
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.recompile_limit = 256
    device = torch.device("cuda")
    shape = BenchShape()
    cfg = shape.drafter_config()
    drafter = DFlashDrafter.__new__(DFlashDrafter)  # only .config is read by make_blocks/make_masks
    torch.nn.Module.__init__(drafter)
    drafter.config = cfg
    rows = synthetic_rows(shape, device)
    settings = StepSettings(num_anchors=shape.num_anchors, gamma=default_gamma(cfg.block_size), mask_kind="flex",
                            label_source="data")  # labels do not shape the masks
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = make_blocks(rows, None, drafter, settings, gen)
    masks = make_masks(blocks, shape.seq_len, drafter, "flex")
    Q, K = shape.num_anchors * shape.block_size, shape.seq_len + shape.num_anchors * shape.block_size
    g = torch.Generator(device=device).manual_seed(1)
    q0 = torch.randn(1, cfg.num_attention_heads, Q, cfg.head_dim, device=device, dtype=torch.bfloat16, generator=g)
    k0 = torch.randn(1, cfg.num_key_value_heads, K, cfg.head_dim, device=device, dtype=torch.bfloat16, generator=g)
    v0 = torch.randn(1, cfg.num_key_value_heads, K, cfg.head_dim, device=device, dtype=torch.bfloat16, generator=g)
    dout = torch.randn(1, cfg.num_attention_heads, Q, cfg.head_dim, device=device, dtype=torch.bfloat16, generator=g)
    layer_windows = [None if t == "full_attention" else cfg.sliding_window for t in cfg.layer_types]
    weights = {w: layer_windows.count(w) for w in set(layer_windows)}  # layers per mask
    compiled = torch.compile(flex_attention, dynamic=False)
    ref: dict = {}
    names = list(OPTIONS) if args.only is None else args.only.split(",")
    runs = [(n, compiled, OPTIONS[n]) for n in names]
    if args.autotune:
        runs.append(("max_autotune", torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs"), {}))
    for name, fn, opts in runs:
        rec = {"name": name, "options": opts, "per_window": {}}
        try:
            total = 0.0
            for w, mask in masks.items():
                q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))

                def fwd():
                    return fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts or None)

                out = fwd()
                out.backward(dout)
                grads = [t.grad.clone() for t in (q, k, v)]
                if name == "default":
                    ref[w] = (out.detach(), grads)
                err = max(((a.float() - b.float()).abs().max().item()
                           for a, b in zip([out.detach(), *grads], [ref[w][0], *ref[w][1]])), default=0.0)
                with torch.no_grad():
                    f_ms = _time(fwd, args.iters)

                def fb():
                    for t in (q, k, v):
                        t.grad = None
                    fwd().backward(dout)

                fb_ms = _time(fb, args.iters)
                rec["per_window"][str(w)] = {"fwd_ms": f_ms, "bwd_ms": fb_ms - f_ms, "max_abs_diff_vs_default": err}
                total += weights[w] * fb_ms
            rec["reference_layers_fwd_bwd_ms"] = total
        except Exception as e:  # an option set the kernel cannot take: reported, the sweep goes on
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    sys.exit(main())
