"""A target whose embedding module scales its output (Gemma 3: ×√H) and whose RoPE base depends on
the layer type: what the drafter takes from it.

H = hidden size (64 in the tiny Gemma 3: scale 8), V = vocabulary, B = block size.
"""

from __future__ import annotations

import math

import torch

from dflash_trainer.drafter.masks import build_dense_masks
from dflash_trainer.config.sections import DrafterSection
from dflash_trainer.drafter.shape import drafter_config_from_target, rope_theta_of
from dflash_trainer.drafter.build import frozen_modules
from test_eval_common import target_and_drafter


def test_drafter_embeds_as_the_target_does_read_from_the_weight():
    """The drafter's block inputs are what the target's own embedding module gives (×√H here), computed
    from the weight with the config's embedding_scale, so a module that scales by itself is not applied
    twice and plain modules around the weight (training) give the same inputs."""
    bundle, drafter = target_and_drafter("gemma3")
    ids = torch.tensor([[3, 17, 127, 5]])
    rows = bundle.embed_tokens.weight[ids]  # [1,4,H]
    torch.testing.assert_close(bundle.embed_tokens(ids), rows * math.sqrt(64))  # the target's module scales by 8
    assert drafter.config.embedding_scale == math.sqrt(64)
    torch.testing.assert_close(drafter.embed_block(ids), bundle.embed_tokens(ids))


def test_eval_drafter_is_the_trained_drafter_on_a_scaling_target():
    """The same weights give the same block hidden states whether the drafter sits on the target's
    modules (eval, measured τ) or on plain modules around the target's weights (training, every
    layout). Before, eval fed Gemma drafters √H-times larger inputs than they were trained on."""
    bundle, evaluated = target_and_drafter("gemma3")
    trained = type(evaluated)(evaluated.config, *frozen_modules(bundle.embed_tokens.weight, bundle.lm_head.weight,
                                                                torch.device("cpu")), compile_flex=False)
    trained.load_trainable_state_dict(evaluated.trainable_state_dict())
    cfg, T = evaluated.config, 9
    B = cfg.block_size
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, T, cfg.num_aux_layers * cfg.hidden_size, generator=g)
    ids = torch.full((1, B), cfg.mask_token_id)
    ids[0, 0] = 17
    masks = build_dense_masks(torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), T, dtype=torch.int32), T, B,
                              cfg.attention_windows())
    args = (feats, torch.arange(T)[None], ids, torch.arange(T, T + B)[None], masks)
    with torch.no_grad():
        torch.testing.assert_close(evaluated(*args), trained(*args), rtol=0, atol=0)


def test_per_layer_type_rope_base_gives_the_full_attention_base():
    """Gemma 3 keeps one RoPE base per layer type (transformers 5 `rope_parameters`); the drafter,
    whose layers attend over the whole context, takes the full-attention one (1e6), not 1e4 and not
    the 10000 fallback of configs without a base."""
    bundle, _ = target_and_drafter("gemma3")
    params = bundle.config.rope_parameters
    assert params["full_attention"]["rope_theta"] == 1e6 and params["sliding_attention"]["rope_theta"] == 1e4
    assert rope_theta_of(bundle.config) == 1e6
    dc, info = drafter_config_from_target(bundle.config, None,
                                          DrafterSection(mask_token_id=4, num_layers=2, block_size=4, target_layer_ids=[0, 2]))
    assert (dc.rope_theta, dc.head_dim, dc.num_attention_heads, dc.num_key_value_heads) == (1e6, 16, 4, 2)
    assert dc.num_target_layers == 4 and dc.vocab_size == 128 and info["mask_token"] is None
