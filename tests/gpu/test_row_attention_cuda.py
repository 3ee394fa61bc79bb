"""GPU-only: the compiled row-attention kernel (decoding/row_attention.py) on CUDA, both ways of taking the
dots: fp32 IEEE dots (fp32 inputs, exact_dots) equal the float64 brute force to fp32 rounding; tensor-core
dots (bf16 / fp16 inputs) to bf16 rounding, at every block_n, with a slot outside a row's range poisoned."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_row_attention import case, reference  # noqa: E402

from dflash_trainer.decoding.row_attention import row_attention  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton = pytest.importorskip("triton")


def _cuda(*ts):
    return [t.cuda() for t in ts]


@pytest.mark.parametrize("M,D", [(3, 64), (16, 32), (20, 128)])
def test_fp32_kernel_equals_the_float64_reference(M, D):
    q, keys, values, start, end = case(M, D)
    out = row_attention(*_cuda(q, keys, values, start, end), D ** -0.5, backend="triton").cpu()
    torch.testing.assert_close(out.double(), reference(q, keys, values, start, end, D ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_n", [None, 16, 32, 128])
@pytest.mark.parametrize("M,D", [(3, 64), (20, 32)])
def test_tensor_core_kernel_within_rounding(dtype, block_n, M, D):
    q, keys, values, start, end = case(M, D, dtype=dtype, seed=2)
    poisoned = keys.clone()
    poisoned[4, :, 16] = 100.0  # just before its window
    poisoned[4, :, 33] = 100.0  # just past its position
    args = _cuda(q, poisoned, values, start, end)
    out = row_attention(*args, D ** -0.5, backend="triton", block_n=block_n).cpu()
    exact = row_attention(*args, D ** -0.5, backend="triton", exact_dots=True).cpu()
    assert out.dtype == dtype
    ref = reference(q, keys, values, start, end, D ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), exact.double(), rtol=tol, atol=tol)




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,G", [(4, 3), (16, 3), (2, 5)])
def test_a_block_of_tokens_on_cuda(dtype, tokens, G):
    """A verify block (causal within it, windows moving with it) through the compiled kernel: tensor-core
    dots in bf16 to bf16 rounding, IEEE dots in fp32 to fp32 rounding."""
    g = torch.Generator().manual_seed(5)
    m, H, S, D = 4, 2, 90, 64
    keys, values = torch.randn(2, m, H, S, D, generator=g).to(dtype)
    q = torch.randn(m, H, G * tokens, D, generator=g).to(dtype)
    end = torch.tensor([tokens + 1, 80, tokens, 90])
    start = torch.tensor([1, 40, 0, 0])
    out = row_attention(*_cuda(q, keys, values, start, end), D ** -0.5, backend="triton", tokens=tokens).cpu()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), reference(q, keys, values, start, end, D ** -0.5, tokens), rtol=tol, atol=tol)
