"""Shared pieces of the benchmarks: the reference configuration, synthetic rows, timing helpers.

Reference configuration (benchmarks/reports/2026-11-30-drafter-step.md): Qwen3-8B-shaped drafter, 5 layers, H 4096, 32/8 heads,
head_dim 128, MLP 12288, vocab 151936, k = 5 target layers, T = 8192 packed tokens (8 documents),
512 anchors, B = 16. Weights are random: speed does not depend on their values.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from dflash_trainer.config.sections import parse_layer_types
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.telemetry.timing import cuda_times
from dflash_trainer.target_model.layers import default_target_layer_ids


@dataclass
class BenchShape:
    """Sizes of a benchmark run. The defaults are the reference benchmark shape (a Qwen3-8B-sized
    target, T = 8192, 512 anchors, a 5-layer B = 16 drafter with sliding layers), stated here on
    purpose: it is the fixed shape benchmarks/README.md measures, not the training default (the
    config's drafter section)."""

    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_layers: int = 5
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936
    num_target_layers: int = 36
    num_target_features: int = 5
    seq_len: int = 8192
    num_documents: int = 8
    num_anchors: int = 512
    block_size: int = 16
    layer_types: str = "last-full"
    sliding_window: int = 2048

    def drafter_config(self) -> DrafterConfig:
        """The DrafterConfig of this shape (mask token = last row)."""
        ids = default_target_layer_ids(self.num_target_layers, self.num_target_features)
        return DrafterConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            vocab_size=self.vocab_size, block_size=self.block_size, mask_token_id=self.vocab_size - 1,
            target_layer_ids=ids, num_target_layers=self.num_target_layers, rope_theta=1e6,
            layer_types=parse_layer_types(self.layer_types, self.num_layers), sliding_window=self.sliding_window)


def synthetic_rows(shape: BenchShape, device: torch.device, seed: int = 0, rows: int = 1) -> dict[str, torch.Tensor]:
    """`packed_rows` of the shape's T, documents and vocabulary."""
    return packed_rows(shape.seq_len, shape.num_documents, shape.vocab_size, device, seed=seed, rows=rows)


def packed_rows(seq_len: int, num_documents: int, vocab_size: int, device: torch.device, *, seed: int = 0,
                rows: int = 1) -> dict[str, torch.Tensor]:
    """R = `rows` packed rows of T = `seq_len` tokens in D = `num_documents` documents of T // D tokens
    (plus a shorter one at the end when D does not divide T); the first quarter of each is an
    unsupervised prompt. Token ids are uniform in [0, V−1) (V−1 is the reference shape's mask token).

    Returns input_ids/position_ids [R,T] int64 and loss_mask [R,T] bool on `device`.
    """
    g = torch.Generator().manual_seed(seed)
    T, D = seq_len, num_documents
    doc_len = T // D
    pos = torch.arange(T) % doc_len
    loss_mask = pos >= doc_len // 4
    ids = torch.randint(0, vocab_size - 1, (rows, T), generator=g)
    return {"input_ids": ids.to(device), "position_ids": pos.expand(rows, T).contiguous().to(device),
            "loss_mask": loss_mask.expand(rows, T).contiguous().to(device)}


def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """Measured bf16 n×n×n matmul rate in TFLOP/s on random data (median of `iters`, after warm-up)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = cuda_times(lambda: a @ b, iters)
    return 2 * n**3 / statistics.median(times) / 1e12 * 1e3

