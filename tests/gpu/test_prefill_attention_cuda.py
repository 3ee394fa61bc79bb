"""GPU-only: a bf16 prefill of the static-cache target (decoding/static_layer.py) runs no cuDNN attention.

On sm90 with a recent cuDNN, torch tries cuDNN attention first for a masked bf16 SDPA call, and cuDNN builds
an execution graph for every new shape; prefill shapes change with every group of prompts, so the prefill
asks for the other backends (PREFILL_SDPA_BACKENDS). The control is the same prefill with cuDNN allowed
(torch's own choice): where it does not dispatch cuDNN attention either, there is nothing to avoid and the test
skips.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

import dflash_trainer.decoding.static_layer as static_layer
from dflash_trainer.decoding.batched import BatchedTarget
from tests.tiny_targets import tiny_bundle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDNN_OP = "aten::_scaled_dot_product_cudnn_attention"


def _ops(fn) -> set[str]:
    """Names of the aten ops `fn` dispatches (host-side profile)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


def test_bf16_prefill_avoids_cudnn_attention(monkeypatch):
    """Prevents a graph build per prefill shape (tens of ms each; the speedup table's first streams ran
    1.5–2× slow): three prefills of new shapes dispatch no cuDNN attention, and give the logits of the
    same prefill under torch's own choice."""
    dev = torch.device("cuda")
    bundle = tiny_bundle("llama", hidden=256, num_heads=4, num_kv_heads=2, vocab_size=128)  # head_dim 64
    bundle.model.to(dev, torch.bfloat16)
    bt = BatchedTarget(bundle, rows=4, max_len=64)
    gen = torch.Generator().manual_seed(1)
    for m, P in ((3, 17), (2, 9), (4, 30)):
        toks = torch.randint(3, 128, (m, P), generator=gen).to(dev)
        lengths = torch.randint(1, P + 1, (m,), generator=gen).to(dev)
        lengths[0] = P
        rows = torch.arange(m, device=dev)
        out = {}
        ops = _ops(lambda: out.setdefault("ours", bt.prefill(rows, toks, lengths)[0]))
        with monkeypatch.context() as mp:  # cuDNN allowed too: torch's own choice
            mp.setattr(static_layer, "PREFILL_SDPA_BACKENDS", [*static_layer.PREFILL_SDPA_BACKENDS,
                                                               SDPBackend.CUDNN_ATTENTION])
            control = _ops(lambda: out.setdefault("theirs", bt.prefill(rows, toks, lengths)[0]))
        if CUDNN_OP not in control:
            pytest.skip("this torch / cuDNN does not pick cuDNN attention for this prefill: nothing to avoid")
        assert CUDNN_OP not in ops, f"prefill of {m} prompts × {P} tokens dispatched cuDNN attention"
        torch.testing.assert_close(out["ours"], out["theirs"], atol=5e-2, rtol=5e-2)
