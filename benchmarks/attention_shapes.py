"""Cache attention alone, at the shapes decoding runs it: the engine's `cache_attention` (two matmuls, fp32
softmax), `row_attention` (the Triton kernel over each row's own slots: tensor-core dots at its default block of
64 slots and at 32 / 128, and its fp32 IEEE dots, `exact_dots`) and torch SDPA on the same tensors
(the backend SDPA picks with an additive mask, and the memory-efficient one forced).

    python benchmarks/attention_shapes.py --out FILE.json

Shapes (SmolLM2-135M: 3 KV heads, G = 3, D = 64, bf16 cache views of a [2,R,Hkv,S_max,D] cache):
  regen-1024: 1,024 rows, one query token (M = 3), span 1,280 (the ladder rung over the 2026-12-07
              regeneration's mean attended span of 1,220), rows needing 336 slots on average (its needed span)
  verify-b64 / verify-b256: 64 / 256 rows, 16 query tokens (M = 48), span 688 (the engine's S for MT-Bench's
              longest first turn: 402 + 256 + 16 rounded up to a multiple of 16), rows needing 228 on average
              (mean prompt 100 + half an answer)
  decode-b1 / verify-b1: one row, M = 3 / 48, span 688
Rows need uniformly ½ … 1½ × that mean; query token i of a row sits at its last n positions, causal within the
block; query row g·n + i of a KV head is token i's (as decoding/static_layer.py lays them out); at n = 1 the
mask is one query row, broadcast, as the engine passes it. Each: ms per call, the median of 5 replays of a CUDA
graph of 20 calls (launch costs out, as the engine replays its steps; eager back-to-back calls on the CPU), the
GB of K/V at the span, and the largest error relative to the output's largest magnitude against
`cache_attention` in fp32. Prints a table; writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflash_trainer.decoding.row_attention import row_attention  # noqa: E402
from dflash_trainer.decoding.static_layer import cache_attention  # noqa: E402
from dflash_trainer.telemetry.timing import cuda_times  # noqa: E402

SHAPES = {"regen-1024": (1024, 1, 1280, 336), "verify-b64": (64, 16, 688, 228), "verify-b256": (256, 16, 688, 228),
          "decode-b1": (1, 1, 688, 228), "verify-b1": (1, 16, 688, 228)}
HKV, G, D = 3, 3, 64


def timed(fn, device: torch.device, calls: int = 20, repeats: int = 5) -> float:
    """ms per call of fn(): on CUDA the median of `repeats` replays of a graph of `calls` calls; on the CPU
    `calls` eager calls back to back."""
    import time

    for _ in range(3):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except RuntimeError as e:  # not capturable: back-to-back eager calls (launch costs partly in), said so
        print(f"  graph capture failed ({str(e)[:80]}): timed eagerly", flush=True)
        torch.cuda.synchronize(device)

        def run():
            for _ in range(calls):
                fn()
    times = cuda_times(run, repeats)
    return sorted(times)[len(times) // 2] / calls


def case(name: str, device: torch.device, dtype: torch.dtype, small: bool) -> dict:
    m, n, span, need = SHAPES[name]
    if small:
        m, span, need = min(m, 4), min(span, 64), min(need, 32)
    M, S_max = G * n, span + 64
    g = torch.Generator(device="cpu").manual_seed(0)
    cache = torch.randn(2, m, HKV, S_max, D, generator=g).to(device=device, dtype=dtype)
    keys, values = cache[0, :, :, :span], cache[1, :, :, :span]
    q = torch.randn(m, HKV, M, D, generator=g).to(device=device, dtype=dtype)
    lens = torch.randint(max(need // 2, n), min(3 * need // 2, span) + 1, (m,), generator=g).to(device)
    slot = torch.arange(span, device=device)
    # query token i of a row at position lens − n + i sees slots ≤ its position (causal within the block)
    qpos = (lens[:, None] - n + torch.arange(n, device=device)).repeat(1, G)  # query row g·n + i → token i
    visible = slot[None, None] <= qpos[:, :, None]  # [m,M,span]
    mask = torch.where(visible, 0.0, float("-inf"))[:, None].to(torch.float32)  # [m,1,M,span]
    if n == 1:  # one query token: every query row sees the same slots, one mask row broadcast (as the engine)
        mask = mask[:, :, :1].contiguous()
    scale = D ** -0.5
    ref = cache_attention(q.float(), keys.float(), values.float(), mask, scale)
    out = {"rows": m, "query_tokens": n, "span": span, "mean_needed": float(lens.float().mean()),
           "kv_gb_at_span": 2 * m * HKV * span * D * cache.element_size() / 1e9}
    mask_q = mask.to(dtype)
    fns = {"cache_attention": lambda: cache_attention(q, keys, values, mask, scale),
           "sdpa": lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_q, scale=scale)}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def efficient():
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_q, scale=scale)
        fns["sdpa_efficient"] = efficient
        # row_attention: each row its own slots, its last token 0 … lens − 1, a block causal within it
        start, end = torch.zeros_like(lens), lens.contiguous()
        fns["row_attention"] = lambda: row_attention(q, cache[0], cache[1], start, end, scale, tokens=n)  # tensor cores
        fns["row_attention_ieee"] = lambda: row_attention(q, cache[0], cache[1], start, end, scale, tokens=n,
                                                          exact_dots=True)
        for bn in (32, 128) if n == 1 else ():
            fns[f"row_attention_b{bn}"] = (lambda bn=bn: row_attention(q, cache[0], cache[1], start, end, scale,
                                                                        block_n=bn))
    for k, fn in fns.items():
        try:
            o = fn()
            out[f"{k}_ms"] = timed(fn, device)
            out[f"{k}_max_rel_err"] = float((o.float() - ref).abs().max() / ref.abs().max())
        except Exception as e:  # a backend that refuses these inputs: say which and why
            out[f"{k}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "cases": {}}
    for name in SHAPES:
        res["cases"][name] = r = case(name, device, dtype, small=device.type != "cuda")
        cols = " ".join(f"{k.removesuffix('_ms')} {v:.3f}" for k, v in r.items() if k.endswith("_ms"))
        errs = " ".join(f"{k}: {v}" for k, v in r.items() if k.endswith("_error"))
        print(f"{name}: rows {r['rows']} n {r['query_tokens']} span {r['span']} (K/V {r['kv_gb_at_span']:.2f} GB): "
              f"{cols} {errs}", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
