"""A drafter's weights fingerprint: which weights an eval measured, so that `export --speedup-from`
can refuse a speedup table measured with another drafter. Weights only: the drafter's config
(target_layer_ids, layer_types, mask token, …) is not included.

The fingerprint is the sha256 (hex) over the trainable weights under the drafter's own names (as
`load_drafter` and `load_checkpoint` return them), in sorted name order: for each tensor its name,
shape and its values rounded to bfloat16. The rounding makes an fp32 checkpoint and its bf16
export one drafter; any trained update that moves a bf16 value makes another. An fp16 copy rounds
otherwise (fp32 → fp16 → bf16 is not fp32 → bf16) and has its own fingerprint: export checks an
eval against both the source and the exported weights.
"""

from __future__ import annotations

import hashlib

import torch


def weights_fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """sha256 hex digest (64 chars) of `weights` (name → tensor, any float dtype, any device).

    Equal for the same names, shapes and bf16-rounded values, in fp32 or bf16, on any device;
    a renamed, reshaped or changed tensor gives another digest. Raises ValueError for an empty dict
    (no drafter to name)."""
    if not weights:
        raise ValueError("weights_fingerprint: no weights")
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach()
        h.update(f"{name}:{tuple(t.shape)};".encode())
        values = t.to(device="cpu", dtype=torch.bfloat16).contiguous() if t.is_floating_point() else t.cpu().contiguous()
        h.update(values.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
