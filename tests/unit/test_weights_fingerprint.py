"""The drafter weights fingerprint (interop/fingerprint.py) that ties an eval to the drafter it measured."""

from __future__ import annotations

import hashlib

import pytest
import torch

from dflash_trainer.interop.fingerprint import weights_fingerprint


def test_digest_by_hand():
    """One tensor: sha256 of "name:shape;" then the bf16 bytes, little-endian (1.0 = 0x3F80, 2.0 = 0x4000)."""
    expected = hashlib.sha256(b"w:(2,);" + bytes([0x80, 0x3F, 0x00, 0x40])).hexdigest()
    assert weights_fingerprint({"w": torch.tensor([1.0, 2.0])}) == expected


def test_same_drafter_in_fp32_or_bf16_and_any_order():
    """An fp32 checkpoint and its bf16 export (values already bf16-representable after rounding) are one
    drafter; the dict's order does not matter."""
    torch.manual_seed(0)
    w = {"layers.0.q": torch.randn(4, 3), "fc": torch.randn(3, 6)}
    bf16 = {k: v.to(torch.bfloat16) for k, v in reversed(list(w.items()))}
    assert weights_fingerprint(w) == weights_fingerprint(bf16)


@pytest.mark.parametrize("change", ["value", "name", "shape"])
def test_another_drafter_differs(change):
    """A value moved by one bf16 step, a renamed tensor or a reshaped one give another digest."""
    w = {"fc": torch.ones(2, 3)}
    if change == "value":
        other = {"fc": torch.ones(2, 3)}
        other["fc"][1, 2] = 1.0078125  # the next bf16 value above 1.0
    elif change == "name":
        other = {"fc2": torch.ones(2, 3)}
    else:
        other = {"fc": torch.ones(3, 2)}
    assert weights_fingerprint(other) != weights_fingerprint(w)


def test_no_weights_is_an_error():
    with pytest.raises(ValueError, match="no weights"):
        weights_fingerprint({})


def test_fp16_copy_has_its_own_fingerprint_and_export_accepts_either():
    """fp32 → fp16 → bf16 rounds otherwise than fp32 → bf16 (a value just above a bf16 midpoint, lost in
    fp16, rounds down): an fp16 export is its own fingerprint, so export checks an eval against the
    exported (cast) weights first, then the source."""
    from dflash_trainer.interop.export import _fingerprints

    w = {"fc": torch.tensor([1.0 + 2**-8 + 2**-20])}  # bf16 rounds up to 1 + 2**-7; via fp16 (1 + 2**-8, a tie) to 1.0
    assert w["fc"].to(torch.bfloat16).item() == 1.0 + 2**-7
    assert w["fc"].to(torch.float16).to(torch.bfloat16).item() == 1.0
    fp32, fp16 = weights_fingerprint(w), weights_fingerprint({"fc": w["fc"].to(torch.float16)})
    assert fp32 != fp16
    assert _fingerprints(w, torch.float16) == (fp16, fp32)
    assert _fingerprints(w, torch.bfloat16) == (fp32,) and _fingerprints(w, None) == (fp32,)
