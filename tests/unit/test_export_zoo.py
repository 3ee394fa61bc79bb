"""Both export formats for a drafter of every zoo family (tests/zoo.py), imported back (docs/formats.md).

R = 1 row, T = 6 context positions, Q = N·B block queries, H = 64 hidden, k = 2 target layers.

The drafter config is init-config's for the family's tiny target (its widths, window and the
target's embedding / logits functions); every drafter weight is random, so a dropped, swapped or
transposed tensor changes the forward output. The speculators format cannot carry an embedding
scale (vLLM's DFlash drafter embeds raw rows): it is refused for Gemma 2 / 3, Granite and Falcon-H1
with the reason, and the zlab folder records the scale in z-lab's own key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.config.sections import DrafterSection
from dflash_trainer.drafter.shape import drafter_config_from_target
from dflash_trainer.interop.export import ZLAB_SCALE_NOTE, export_drafter, write_export
from dflash_trainer.interop.formats import FORMATS
from dflash_trainer.interop.load_drafter import load_drafter
from dflash_trainer.interop.checkpoint_files import save_checkpoint
from tests.zoo import supported_families, zoo_config

B, T = 4, 6
META = {"target": "zoo", "chat_template": None, "enable_thinking": None, "mask_token_reason": "given", "step": 3}
SCALED = {"gemma2": 8.0, "gemma3": 8.0, "granite": 3.0, "falcon_h1": 2.0}  # embedding_scale ≠ 1


def _drafter(family: str) -> DFlashDrafter:
    dc, _ = drafter_config_from_target(zoo_config(family), None,
                                       DrafterSection(num_layers=2, block_size=B, target_layer_ids=[0, 1], mask_token_id=127,
                                                      layer_types="last-full", sliding_window=3))
    g = torch.Generator().manual_seed(0)
    embed, head = nn.Embedding(dc.vocab_size, dc.hidden_size), nn.Linear(dc.hidden_size, dc.vocab_size, bias=False)
    drafter = DFlashDrafter(dc, embed, head, compile_flex=False)
    with torch.no_grad():
        for p in [*drafter.parameters(), embed.weight, head.weight]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return drafter.eval()


def _outputs(drafter: DFlashDrafter) -> torch.Tensor:
    """Logits [1,Q,V] of two blocks (anchors 2 and 4) over T random context features."""
    cfg = drafter.config
    g = torch.Generator().manual_seed(1)
    features = torch.randn(1, T, cfg.num_aux_layers * cfg.hidden_size, generator=g)
    ids = torch.tensor([[9, 127, 127, 127, 33, 127, 127, 127]])
    pos = torch.tensor([[2, 3, 4, 5, 4, 5, 6, 7]])
    visible = torch.arange(T)[None, :] < torch.tensor([2] * B + [4] * B)[:, None]  # [Q,T] context before the anchor
    own = torch.block_diag(*[torch.ones(B, B, dtype=torch.bool)] * 2)  # [Q,Q] the block itself
    mask = torch.cat([visible, own], dim=1)[None]  # [1,Q,T+Q]
    with torch.no_grad():
        return drafter.logits(drafter(features, torch.arange(T)[None], ids, pos, {None: mask, 3: mask}))


@pytest.mark.parametrize("family", supported_families())
def test_every_family_exports_and_imports_back_the_same_drafter(tmp_path: Path, family: str) -> None:
    """zlab (and speculators where it can carry the drafter) round-trip to the same config, bit-identical
    tensors and bit-identical logits; speculators is refused with the reason for a scaled embedding."""
    drafter = _drafter(family)
    dc, weights = drafter.config, drafter.trainable_state_dict()
    assert (dc.embedding_scale != 1.0) == (family in SCALED)
    save_checkpoint(tmp_path / "ckpt", weights, dc, META)
    for fmt in FORMATS:
        if fmt == "speculators" and family in SCALED:
            with pytest.raises(ValueError, match=rf"^--format speculators: .* {SCALED[family]:g} × the target's "
                                                 r"embedding rows .*vLLM's DFlash drafter embeds raw rows"):
                export_drafter(tmp_path / "ckpt", fmt, tmp_path / fmt, read_target=False)
            assert not (tmp_path / fmt).exists()
            continue
        _, _, notes = export_drafter(tmp_path / "ckpt", fmt, tmp_path / fmt, read_target=False)
        dc2, weights2, meta2 = load_drafter(tmp_path / fmt)
        assert dc2 == dc, (family, fmt)
        assert sorted(weights2) == sorted(weights) and all(torch.equal(weights2[k], v) for k, v in weights.items())
        again = DFlashDrafter(dc2, drafter.embed_tokens, drafter.lm_head, compile_flex=False)
        again.load_trainable_state_dict(weights2)
        assert torch.equal(_outputs(again.eval()), _outputs(drafter)), (family, fmt)
        assert meta2["step"] == 3
        body = json.loads((tmp_path / fmt / "config.json").read_text())
        keys = body["dflash_config"] if fmt == "zlab" else body
        assert keys.get("input_embedding_scale") == (SCALED.get(family) if fmt == "zlab" else None)
        assert keys.get("output_multiplier") == (None if dc.logit_scale == 1.0 else dc.logit_scale)
        assert keys.get("final_logit_softcapping") == dc.logit_softcap
        assert (ZLAB_SCALE_NOTE.format(scale=dc.embedding_scale) in notes) == (fmt == "zlab" and family in SCALED)


def test_zlab_keys_are_what_z_labs_reference_reads(tmp_path: Path) -> None:
    """A Gemma 2 drafter's zlab folder holds input_embedding_scale √H, final_logit_softcapping and no
    output_multiplier (neutral), under dflash_config where z-lab's `_draft_value` looks first; a
    folder written by another tool with the keys at the top level imports the same."""
    drafter = _drafter("gemma2")
    write_export(tmp_path / "z", "zlab", drafter.config, drafter.trainable_state_dict(), META)
    body = json.loads((tmp_path / "z" / "config.json").read_text())
    dflash = body["dflash_config"]
    assert dflash["input_embedding_scale"] == 8.0 and dflash["final_logit_softcapping"] == 5.0
    assert "output_multiplier" not in dflash and "input_embedding_scale" not in body
    for key in ("input_embedding_scale", "final_logit_softcapping"):
        body[key] = dflash.pop(key)
    body["dflash_config"]["output_multiplier"] = 1.0
    (tmp_path / "z" / "config.json").write_text(json.dumps(body))
    assert load_drafter(tmp_path / "z")[0] == drafter.config
