"""`dflash-train bench target`: the frozen target's forward over packed rows, three ways, one process.

Target: a random-weight HF Qwen3 model of a named shape (`qwen3-8b` = bench.pipeline.qwen3_8b_fields;
`tiny` for CPU checks) in bf16 on CUDA (fp32 on CPU); speed does not depend on weight values.
Rows: R synthetic packed rows of T tokens in D equal documents (bench.common).

Paths, each timed in both label modes:
  plain_causal      HF causal forward over the whole row, no document mask, no position ids
                    (SDPA's causal kernel; documents see each other: the speed ceiling, wrong
                    semantics for packed rows)
  sdpa_dense_mask   our path with SDPA and the dense [R,1,T,T] document-causal mask
  flex_block_mask   our path with flex attention and the document-causal BlockMask, eager layers
  flex_compiled     the same with the decoder layers compiled (the training default on CUDA;
                    features.py "Compiled layers"; eager like flex_block_mask on CPU)
Label modes: `labels` = features + greedy labels (LM-head argmax over all T positions, chunked);
`features_only` = features with the layers after the last needed one skipped.

Reported per (mode, path): ms per row and tok/s (median of `iters` calls, CUDA events; the host
clock on CPU), peak memory. Also: the LM head + argmax alone (ms per row and its share of each
path's `labels` time), the mask builds alone, flex/SDPA and flex/plain speed ratios, and how far
the flex features and labels are from the SDPA ones (a correctness check at the bench's dtype).
Rounds are interleaved (one call of every variant per round) so clock drift hits all alike.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from dflash_trainer.bench.common import BenchShape, synthetic_rows
from dflash_trainer.telemetry.timing import times_ms

PATHS = ("plain_causal", "sdpa_dense_mask", "flex_block_mask", "flex_compiled")
MODES = ("labels", "features_only")

TINY_FIELDS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False,
                   initializer_range=0.1)


def target_fields(shape: str, sliding_window: int | None) -> tuple[dict[str, Any], int]:
    """(Qwen3Config fields, number of feature layers k) of a named shape: qwen3-8b | tiny.

    sliding_window W: every other layer (0, 2, …) becomes a sliding-window layer of width W, so
    the per-layer-type masks are exercised. Raises ValueError for an unknown shape.
    """
    from dflash_trainer.bench.pipeline import qwen3_8b_fields

    if shape == "qwen3-8b":
        fields, k = qwen3_8b_fields(), 5
    elif shape == "tiny":
        fields, k = dict(TINY_FIELDS), 2
    else:
        raise ValueError(f"--shape {shape!r}: use qwen3-8b or tiny")
    if sliding_window is not None:
        L = fields["num_hidden_layers"]
        fields.update(use_sliding_window=True, sliding_window=int(sliding_window), max_window_layers=0,
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)])
    return fields, k


def bench_target(*, device: torch.device, shape: str = "qwen3-8b", seq_len: int = 8192, num_documents: int = 8,
                 rows: int = 1, iters: int = 10, warmup: int = 3, sliding_window: int | None = None) -> dict[str, Any]:
    """Time the target paths on `device`; returns a JSON-ready dict (see the module docstring).

    Raises ValueError for an unknown shape, seq_len not a multiple of 128 (the flex path needs it)
    or num_documents outside [1, seq_len].
    """
    import transformers

    from dflash_trainer.target_model.attention import attention_masks_for
    from dflash_trainer.target_model.features import TargetFeatureExtractor
    from dflash_trainer.target_model.layers import default_target_layer_ids
    from dflash_trainer.training import precision
    from dflash_trainer.pipeline.target_source import RandomTarget

    if seq_len % 128:
        raise ValueError(f"--seq-len {seq_len}: must be a multiple of 128 (flex tiles)")
    if not 1 <= num_documents <= seq_len:
        raise ValueError(f"--docs {num_documents}: must lie in [1, seq_len]")
    cuda = device.type == "cuda"
    dtype = precision.compute_dtype(device)
    fields, k = target_fields(shape, sliding_window)
    target = RandomTarget("qwen3", fields, seed=0).load_full(device, dtype)
    layer_ids = default_target_layer_ids(target.num_layers, k)
    batch = synthetic_rows(BenchShape(seq_len=seq_len, num_documents=num_documents, vocab_size=target.vocab_size),
                           device, rows=rows)
    ids, pos = batch["input_ids"], batch["position_ids"]  # [R,T]
    sdpa = TargetFeatureExtractor(target, layer_ids, attention="sdpa")
    flex = TargetFeatureExtractor(target, layer_ids, attention="flex", compile_layers=False)
    compiled = TargetFeatureExtractor(target, layer_ids, attention="flex")  # compiles on CUDA only
    extractors = {"sdpa_dense_mask": sdpa, "flex_block_mask": flex, "flex_compiled": compiled}

    def call(path: str, labels: bool) -> Callable[[], Any]:
        if path == "plain_causal":
            return lambda: sdpa.run(ids, None, None, "sdpa", need_argmax=labels)
        ex = extractors[path]
        return lambda: ex(ids, pos, need_argmax=labels)

    variants = {(m, p): call(p, m == "labels") for m in MODES for p in PATHS}
    last_hidden = sdpa(ids, pos, need_argmax=False, need_last_hidden=True).last_hidden  # [R,T,H]
    variants[("lm_head", "argmax")] = lambda: sdpa.greedy_labels(last_hidden)
    variants[("mask", "sdpa_dense")] = lambda: attention_masks_for(target.config, pos, "sdpa")
    variants[("mask", "flex_block")] = lambda: attention_masks_for(target.config, pos, "flex")

    for fn in variants.values():  # compile (flex, layers), allocate, warm the caches
        for _ in range(warmup):
            fn()
    times: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
    peak: dict[tuple[str, str], float | None] = {key: None for key in variants}
    for _ in range(iters):
        for key, fn in variants.items():
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            times[key] += times_ms(fn, 1, device)
            if cuda:
                peak[key] = max(peak[key] or 0.0, torch.cuda.max_memory_allocated(device) / 2**30)
    med = {key: statistics.median(v) for key, v in times.items()}

    tokens = rows * seq_len
    results = {m: {p: {"ms_per_row": med[(m, p)] / rows, "tok_per_s": tokens / (med[(m, p)] / 1e3),
                       "ms_median_per_call": med[(m, p)], "peak_mem_gib": peak[(m, p)]} for p in PATHS}
               for m in MODES}
    head_ms = med[("lm_head", "argmax")]
    return {
        "what": "frozen target forward over packed rows: plain HF causal vs SDPA + dense document mask vs "
                "flex + document BlockMask (eager and compiled layers), with greedy labels and features only",
        "shape": shape, "target_fields": fields, "target_layer_ids": layer_ids,
        "dtype": str(dtype).removeprefix("torch."),
        "seq_len": seq_len, "num_documents": num_documents, "rows": rows, "iters": iters, "warmup": warmup,
        "sliding_window": sliding_window, "argmax_chunk": sdpa.argmax_chunk,
        "results": results,
        "lm_head": {"ms_per_row": head_ms / rows,
                    "share_of_labels_time": {p: head_ms / med[("labels", p)] for p in PATHS}},
        "labels_over_features_only_ms_per_row": {p: (med[("labels", p)] - med[("features_only", p)]) / rows
                                                 for p in PATHS},
        "layers_compiled": compiled.compiles("flex"),
        "speedup": {m: {"flex_over_sdpa_dense": med[(m, "sdpa_dense_mask")] / med[(m, "flex_block_mask")],
                        "flex_over_plain_causal": med[(m, "plain_causal")] / med[(m, "flex_block_mask")],
                        "compiled_over_flex": med[(m, "flex_block_mask")] / med[(m, "flex_compiled")],
                        "compiled_over_plain_causal": med[(m, "plain_causal")] / med[(m, "flex_compiled")],
                        "sdpa_dense_over_plain_causal": med[(m, "plain_causal")] / med[(m, "sdpa_dense_mask")]}
                    for m in MODES},
        "mask_build_ms": {"sdpa_dense": med[("mask", "sdpa_dense")], "flex_block": med[("mask", "flex_block")]},
        "flex_vs_sdpa": _agreement(reference := sdpa(ids, pos), flex(ids, pos)),
        "compiled_vs_sdpa": _agreement(reference, compiled(ids, pos)),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
    }


def _agreement(ref, got) -> dict[str, float]:
    """How far the flex outputs are from the SDPA ones: feature max |Δ| (absolute and relative to
    max |ref|) and the fraction of equal greedy labels. One host read each (after timing)."""
    diff = (got.features.float() - ref.features.float()).abs().max()
    scale = ref.features.float().abs().max()
    return {"features_max_abs_diff": float(diff), "features_max_rel_diff": float(diff / scale),
            "labels_equal_fraction": float((got.argmax == ref.argmax).float().mean())}
