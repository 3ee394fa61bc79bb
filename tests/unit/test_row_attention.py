"""decoding/row_attention.py: each row's attention over its own cache slots, against a float64 brute
force (softmax over exactly the slots start … end − 1), on both backends: torch (`cache_attention` with the
mask of those slots) and the Triton kernel run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, in a
child process; compiled on CUDA in tests/gpu/test_row_attention_cuda.py and tests/gpu/test_engine_cuda.py). Rows
of length 1, windows, a row whose slots fill the cache, blocks cut mid-way, strided cache views, grouped query
rows, blocks of several tokens."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from dflash_trainer.decoding.row_attention import row_attention, row_kernel_runs

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    if request.param == "triton":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed (make test installs it)")
        if not INTERPRETER:  # Triton reads TRITON_INTERPRET when it is imported: run in a fresh process
            pytest.skip("runs in test_triton_backend_under_the_interpreter's child process")
    return request.param


def reference(q, keys, values, start, end, scale, tokens=1):
    """float64: per row and query row (token i = row % tokens, d = tokens − 1 − i back from the last),
    softmax(q·kᵀ·scale) over slots max(0, start − d) … end − d − 1, times v."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        for j in range(q.shape[2]):
            d = tokens - 1 - j % tokens
            lo, hi = max(0, int(start[r]) - d), int(end[r]) - d
            k = keys[r, :, lo:hi].double()  # [H,L,D]
            v = values[r, :, lo:hi].double()
            w = torch.softmax(q[r, :, j:j + 1].double() @ k.transpose(-1, -2) * scale, -1)  # [H,1,L]
            out[r, :, j:j + 1] = w @ v
    return out


def case(M=3, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    m, H, S = 6, 2, 100
    cache = torch.randn(2, m, H, S + 9, D, generator=g).to(dtype)  # a longer cache: views with strides
    keys, values = cache[0, :, :, :S], cache[1, :, :, :S]
    q = torch.randn(m, H, M, D, generator=g).to(dtype)
    # length 1, a block cut mid-way, exactly one block (32 slots), the whole cache (4 blocks, the last cut),
    # a window of 16 across a block boundary, a window of 70 (3 blocks)
    pos = torch.tensor([0, 5, 31, 99, 32, 90])
    start = torch.tensor([0, 0, 0, 0, 17, 21])
    # a key that dominates late in the long rows: the running maximum changes between blocks, so the
    # online softmax must rescale what the earlier blocks summed
    keys[3, :, 80] = 4.0 * q[3, :, 0]
    keys[5, :, 85] = 4.0 * q[5, :, 0]
    return q, keys, values, start, pos + 1


@pytest.mark.parametrize("M,D", [(3, 64), (1, 16), (16, 32), (20, 32)])
def test_equals_the_float64_reference(backend, M, D):
    q, keys, values, start, end = case(M, D)
    out = row_attention(q, keys, values, start, end, D ** -0.5, backend=backend)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(q, keys, values, start, end, D ** -0.5), rtol=1e-5, atol=1e-5)
    # a slot outside a row's range changes nothing: poison it
    poisoned = keys.clone()
    poisoned[4, :, 16] = 1e4  # just before its window
    poisoned[4, :, 33] = 1e4  # just past its position
    poisoned[0, :, 1] = 1e4
    torch.testing.assert_close(row_attention(q, poisoned, values, start, end, D ** -0.5, backend=backend), out)


@pytest.mark.parametrize("tokens,G", [(4, 3), (16, 1), (2, 5)])
def test_a_block_of_tokens_is_causal_within_the_block(backend, tokens, G):
    """A verify step's block: token i sees the last token's slots moved back by n − 1 − i (windows move
    with it; row 0's window starts at 1 so its early tokens clip at 0, row 2 has exactly n slots)."""
    g = torch.Generator().manual_seed(5)
    m, H, S, D = 4, 2, 90, 32
    keys, values = torch.randn(2, m, H, S, D, generator=g)
    q = torch.randn(m, H, G * tokens, D, generator=g)
    end = torch.tensor([tokens + 1, 80, tokens, 90])
    start = torch.tensor([1, 40, 0, 0])  # windows (rows 0, 1) and full attention (rows 2, 3)
    out = row_attention(q, keys, values, start, end, D ** -0.5, backend=backend, tokens=tokens)
    ref = reference(q, keys, values, start, end, D ** -0.5, tokens)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # the first token of row 3 must not see the block's later slots: poison them
    poisoned = keys.clone()
    poisoned[3, :, 90 - tokens + 1:] = 1e4
    first = row_attention(q, poisoned, values, start, end, D ** -0.5, backend=backend, tokens=tokens)[3, :, ::tokens]
    torch.testing.assert_close(first, out[3, :, ::tokens])


def test_bf16_within_rounding(backend):
    q, keys, values, start, end = case(dtype=torch.bfloat16, seed=2)
    out = row_attention(q, keys, values, start, end, 0.125, backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(q, keys, values, start, end, 0.125), rtol=2e-2, atol=2e-2)


def test_bad_arguments_are_refused():
    q, keys, values, start, end = case()
    with pytest.raises(ValueError, match="need q"):
        row_attention(q[:, :1], keys, values, start, end, 1.0)
    with pytest.raises(ValueError, match="need contiguous int32 or int64"):
        row_attention(q, keys, values, start.float(), end.float(), 1.0)
    with pytest.raises(ValueError, match="backend='cuda'"):
        row_attention(q, keys, values, start, end, 1.0, backend="cuda")
    with pytest.raises(ValueError, match="tokens=2: need >= 1 and dividing"):
        row_attention(q, keys, values, start, end, 1.0, tokens=2)
    with pytest.raises(ValueError, match="block_n=48: need a power of two"):
        row_attention(q, keys, values, start, end, 1.0, block_n=48)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (make test installs it)")
def test_a_head_dim_the_kernel_cannot_tile_takes_the_torch_path():
    """head_dim 24: refused when the kernel is asked for; the default dispatch takes the torch path."""
    q, keys, values, start, end = case(D=24)
    with pytest.raises(ValueError, match="head_dim 24"):
        row_attention(q, keys, values, start, end, 1.0, backend="triton")
    torch.testing.assert_close(row_attention(q, keys, values, start, end, 24 ** -0.5).double(),
                               reference(q, keys, values, start, end, 24 ** -0.5), rtol=1e-5, atol=1e-5)


def _old_interpreter() -> bool:
    """Triton's interpreter before 3.9 holds a loaded scalar as a 1-element array, which the kernel's
    `range(start, end, BLOCK_N)` cannot take (3.6.0, a GPU host's: TypeError "only 0-dimensional arrays
    can be converted to Python scalars"; 3.9.0 runs it; 3.7 and 3.8 were not tried). The compiled kernel is not affected: it is tested
    on CUDA in tests/gpu/test_row_attention_cuda.py."""
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (major, minor) < (3, 9)


@pytest.mark.skipif(INTERPRETER or importlib.util.find_spec("triton") is None,
                    reason="the child process itself, or triton is not installed (make test installs it)")
def test_triton_backend_under_the_interpreter():
    """This file's Triton-backend tests and the continuous batch decoding with the kernel
    (tests/unit/test_continuous.py, row attention), in a child process started with TRITON_INTERPRET=1:
    all pass, none skip."""
    if _old_interpreter():
        pytest.skip("Triton's interpreter before 3.9 cannot run the kernel's loop over loaded bounds "
                    "(the compiled kernel is tested in tests/gpu)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                           "(triton and not interpreter) or row_attention_kernel",
                           __file__, os.path.join(here, "test_continuous.py")], env=env, capture_output=True,
                          text=True, timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 6 and "skipped" not in summary, summary


def test_the_kernel_is_the_default_only_where_it_runs():
    """ContinuousGenerator's default (row_attention=None) asks `row_kernel_runs`: never on the CPU, never in
    fp32, never for a head_dim the kernel cannot tile or the GPU tests do not cover; on CUDA in bf16 / fp16
    for 16 … 128 when Triton imports."""
    cpu, cuda, bf16 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16
    assert not row_kernel_runs(64, cpu, bf16) and not row_kernel_runs(64, cuda, torch.float32)
    assert not any(row_kernel_runs(d, cuda, bf16) for d in (8, 24, 80, 96, 256))
    has_triton = importlib.util.find_spec("triton") is not None
    assert row_kernel_runs(64, cuda, bf16) == row_kernel_runs(128, cuda, torch.float16) == has_triton
