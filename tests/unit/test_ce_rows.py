"""drafter/ce_rows.py: the row statistics and the in-place CE gradient against a brute-force float64
reference (log_softmax, gather, argmax, autograd of Σ coef·CE through the logit transform), on both
backends: torch ops, and the Triton kernels run by Triton's interpreter on the CPU (TRITON_INTERPRET=1;
the same kernels run compiled on CUDA, tests/gpu/test_fused_loss_cuda.py). Tiles smaller than the
vocabulary (several tiles per row, a partial last one), argmax ties across tiles, rows with no loss,
bf16 input, logit scale and soft-cap.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from dflash_trainer.drafter import ce_rows
from dflash_trainer.target_model.shared_head import transform_logits

TRANSFORMS = ((1.0, None), (0.7, None), (1.3, 2.5))  # none, Granite-like scale, Gemma-like soft-cap
N, V = 6, 300


def reference(z_raw, labels, coef, scale, softcap):
    """float64 brute force: (lse, z_y, argmax, ∂(Σ coef·CE)/∂z_raw)."""
    zr = z_raw.double().requires_grad_(True)
    z = transform_logits(zr, scale, softcap)
    logp = torch.log_softmax(z, -1)
    ce = -logp.gather(-1, labels[:, None]).squeeze(-1)
    (grad,) = torch.autograd.grad((coef.double() * ce).sum(), zr)
    return torch.logsumexp(z, -1).detach(), z.gather(-1, labels[:, None]).squeeze(-1).detach(), z.argmax(-1), grad


def case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    z_raw = (3.0 * torch.randn(N, V, generator=g)).to(dtype)
    z_raw[2, [5, 69, 77, 140, 299]] = 40.0  # ties across tiles and lanes (5 and 69 share a lane): the first wins
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = V - 1  # the label in the partial last tile
    coef = torch.rand(N, generator=g)
    coef[4] = 0.0  # a row with no loss: its gradient row is zero
    return z_raw, labels, coef


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed (make test installs it)")
        if not INTERPRETER:  # Triton reads TRITON_INTERPRET when it is imported: run in a fresh process
            pytest.skip("runs in test_triton_backend_under_the_interpreter's child process")
        monkeypatch.setattr(ce_rows, "_TILE", 64)  # 5 tiles per row, the last one partial (300 = 4·64 + 44)
    return request.param


@pytest.mark.skipif(INTERPRETER or importlib.util.find_spec("triton") is None,
                    reason="the child process itself, or triton is not installed (make test installs it)")
def test_triton_backend_under_the_interpreter():
    """This file's Triton-backend tests, in a child process started with TRITON_INTERPRET=1 (Triton reads
    it when first imported, so it cannot be switched on in this process): all of them pass, none skip."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton and not interpreter",
                           __file__], env=env, capture_output=True, text=True, timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 8 and "skipped" not in summary, summary  # 4 + 4 kernel tests, +1


@pytest.mark.parametrize("scale,softcap", TRANSFORMS)
def test_stats_and_gradient_equal_the_float64_reference(backend, scale, softcap):
    z_raw, labels, coef = case()
    lse_ref, zy_ref, amax_ref, grad_ref = reference(z_raw, labels, coef, scale, softcap)
    lse, zy, amax = ce_rows.row_stats(z_raw, labels, scale, softcap, backend=backend)
    assert lse.dtype == zy.dtype == torch.float32 and amax.dtype == torch.int64
    torch.testing.assert_close(lse.double(), lse_ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(zy.double(), zy_ref, rtol=2e-6, atol=2e-6)
    assert torch.equal(amax, amax_ref)
    if softcap is None:
        assert int(amax[2]) == 5  # the first of five equal maxima, in the first tile
    buf = z_raw.clone()
    out = ce_rows.ce_logit_grad_(buf, labels, lse, coef, scale, softcap, backend=backend)
    assert out.data_ptr() == buf.data_ptr()  # in place
    torch.testing.assert_close(buf.double(), grad_ref, rtol=1e-5, atol=1e-7)
    assert buf[4].abs().max() == 0
    assert grad_ref.abs().max() > 1e-3  # a real gradient, not zeros on both sides


def test_bf16_rows_match_the_reference_within_bf16_rounding(backend):
    z_raw, labels, coef = case(torch.bfloat16, seed=3)
    lse_ref, zy_ref, amax_ref, grad_ref = reference(z_raw, labels, coef, 1.0, None)
    lse, zy, amax = ce_rows.row_stats(z_raw, labels, backend=backend)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-6, atol=1e-5)  # fp32 math on exact bf16 inputs
    torch.testing.assert_close(zy.double(), zy_ref, rtol=0, atol=0)
    assert torch.equal(amax, amax_ref)
    buf = z_raw.clone()
    ce_rows.ce_logit_grad_(buf, labels, lse, coef, backend=backend)
    assert buf.dtype == torch.bfloat16
    # one bf16 rounding: 2⁻⁸ relative to nearest, 2⁻⁷ when truncated (Triton's interpreter truncates;
    # the GPU rounds to nearest, tests/gpu/test_fused_loss_cuda.py)
    torch.testing.assert_close(buf.double(), grad_ref, rtol=2 ** -8 if backend == "torch" else 2 ** -7, atol=1e-6)


def test_bad_shapes_and_backend_are_refused():
    z = torch.zeros(4, 10)
    with pytest.raises(ValueError, match=r"z_raw \[N,V\]"):
        ce_rows.row_stats(z.t(), torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels \[N\]"):
        ce_rows.row_stats(z, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="backend='cuda'"):
        ce_rows.ce_logit_grad_(z, torch.zeros(4, dtype=torch.long), torch.zeros(4), torch.zeros(4), backend="cuda")


def test_triton_is_used_only_where_it_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not ce_rows.triton_usable(torch.zeros(2, 2))  # CPU: the torch ops
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not ce_rows.triton_usable(torch.zeros(2, 2, dtype=torch.float64))  # fp64 (tests): the torch ops


@pytest.mark.parametrize("position_weights,chunk,transform", [
    ("decay", None, (1.0, None)), ("dpace", 13, (0.7, None)), ("cat", 13, (1.3, 2.5)), ("dpace", None, (1.3, 2.5))])
def test_fused_ce_loss_through_either_backend_equals_autograd(backend, position_weights, chunk, transform, monkeypatch):
    """block_loss(loss_impl="fused", kind "ce") runs these two passes (the Triton kernels when they can run:
    here interpreted, fp32): its sums and ∂/∂hidden equal the autograd path's (loss.py's log-softmax)
    with D-PACE and CAT weights (CAT reads the target's row statistics), chunked, with invalid slots."""
    from dflash_trainer.drafter.loss import block_loss
    from test_loss_options import random_case

    monkeypatch.setattr(ce_rows, "_TILE", 4)  # V = 13: four tiles, the last one partial
    scale, softcap = transform
    hidden, target_hidden, head, labels, valid, loss_weight = random_case(2)
    out = {}
    for impl in ("autograd", "fused"):
        hid = hidden.clone().requires_grad_(True)
        s = block_loss(hid, head, labels, loss_weight, block_size=5, target_hidden=target_hidden, slot_valid=valid,
                       kind="ce", position_weights=position_weights, chunk_size=chunk, dpace_alpha=0.3,
                       logit_scale=scale, logit_softcap=softcap, loss_impl=impl)
        (g,) = torch.autograd.grad(s.loss_sum / 7.0, hid)
        out[impl] = s, g
    (a, ga), (f, gf) = out["autograd"], out["fused"]
    torch.testing.assert_close(f.loss_sum, a.loss_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f.weight_sum, a.weight_sum, rtol=1e-5, atol=1e-6)
    assert torch.equal(f.correct, a.correct) and torch.equal(f.run_length_sum, a.run_length_sum)
    torch.testing.assert_close(gf, ga, rtol=1e-4, atol=1e-6)
    assert ga.abs().max() > 0 and gf[~valid].abs().max() == 0
