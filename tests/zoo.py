"""A zoo of tiny random-weight targets, one per model family, from transformers' own config classes.

No files, no downloads, no tokenizer: each family is a config built here with 2–3 decoder layers,
hidden size 64, a 128-token vocabulary, and whatever makes the family's own feature run in a forward
over short documents (documents in the tests are 12–67 tokens, longer than every window):

    family          config class            exercised here
    llama           LlamaConfig             plain RoPE attention (SmolLM2's architecture)
    qwen3           Qwen3Config             q/k norms; sliding (W=8) and full layers mixed
    qwen3_moe       Qwen3MoeConfig          8 experts, top-2 routing (sparse MLP on every layer)
    qwen3_next      Qwen3NextConfig         gated-delta-net linear attention + full attention, MoE
    qwen3_5         Qwen3_5TextConfig       gated-delta-net linear attention + full attention
    gpt_oss         GptOssConfig            attention sinks (non-zero), 4 experts top-2, sliding W=8, YaRN
    gemma2          Gemma2Config            attention and final logit soft-capping, sliding W=8,
                                            scaled embeddings
    gemma3          Gemma3TextConfig        scaled embeddings, sliding W=8 + global layers, q/k norms
    deepseek_v3     DeepseekV3Config        multi-head latent attention (q/kv LoRA, split rope dims),
                                            one dense layer then grouped top-k MoE
    mistral         MistralConfig           sliding window W=8 on every layer (no layer_types)
    phi3            Phi3Config              fused qkv / gate-up projections, partial rotary, sliding W=8
    olmo2           Olmo2Config             post-norms, q/k norms over all heads
    granite         GraniteConfig           embedding / residual / attention multipliers, logit scaling
    lfm2            Lfm2Config              short gated convolutions + full attention
    falcon_h1       FalconH1Config          Mamba-2 mixer beside attention in every layer, multipliers
    gpt2            GPT2Config              (refused: its decoder blocks are `transformer.h`, not `layers`)

API (what tests import):

    FAMILIES                        the family names above, in this order
    zoo_config(family) -> config    the tiny HF config (fresh object each call)
    zoo_model(family, seed=0)       (model, config): fp32, eval, frozen; same seed → same weights
    zoo_bundle(family, seed=0)      TargetBundle around zoo_model (name "zoo-<family>"); ValueError
                                    for a family the trainer refuses (gpt2)
    family_status(family)           the trainer's own verdict (`target_model.families.target_support`):
                                    a TargetSupport with .refused (None or the one-line reason)
    supported_families() / refused_families()   the families the trainer accepts / refuses here

An HF folder of a zoo family with a word-level tokenizer and chat template (for init-config, train,
export): `tests.integration.tiny_run.make_target(folder, family)`.

Weights: HF's own init with initializer_range 0.1 (spread-out logits, few argmax ties); parameters HF
initializes to zero or one that carry a family's feature (attention sinks) are redrawn so the feature
is not a no-op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from dflash_trainer.target_model.load import TargetBundle, bundle_from_model, freeze

if TYPE_CHECKING:
    from dflash_trainer.target_model.families import TargetSupport

__all__ = ["FAMILIES", "zoo_config", "zoo_model", "zoo_bundle", "family_status", "supported_families",
           "refused_families"]

V, H, W = 128, 64, 8  # vocabulary, hidden size, sliding window
_COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama():
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=3, **_COMMON)


def _qwen3():
    from transformers import Qwen3Config
    return Qwen3Config(num_hidden_layers=3, head_dim=16, use_sliding_window=True, sliding_window=W,
                       max_window_layers=0, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                       **_COMMON)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(num_hidden_layers=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, norm_topk_prob=True, **_COMMON)


def _qwen3_next():
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(num_hidden_layers=3, head_dim=16, layer_types=["linear_attention", "full_attention",
                                                                          "linear_attention"],
                           linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=32, **_COMMON)


def _qwen3_5():
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(num_hidden_layers=3, head_dim=16, layer_types=["linear_attention", "full_attention",
                                                                            "linear_attention"],
                             linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4, **_COMMON)


def _gpt_oss():
    from transformers import GptOssConfig
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 16}  # YaRN as the real config, 16 × 32 = 512
    return GptOssConfig(num_hidden_layers=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=W, layer_types=["sliding_attention", "full_attention"], rope_parameters=rope,
                        **_COMMON)


def _gemma2():
    from transformers import Gemma2Config
    return Gemma2Config(num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=W,
                        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0,
                        final_logit_softcapping=5.0, **_COMMON)


def _gemma3():
    from transformers import Gemma3TextConfig
    return Gemma3TextConfig(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=W,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"], **_COMMON)


def _deepseek_v3():
    from transformers import DeepseekV3Config
    cfg = dict(_COMMON, num_key_value_heads=4)
    return DeepseekV3Config(num_hidden_layers=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                            qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                            n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
                            first_k_dense_replace=1, **cfg)


def _mistral():
    from transformers import MistralConfig
    return MistralConfig(num_hidden_layers=2, head_dim=16, sliding_window=W, **_COMMON)


def _phi3():
    from transformers import Phi3Config
    return Phi3Config(num_hidden_layers=2, partial_rotary_factor=0.5, sliding_window=W, **_COMMON)


def _olmo2():
    from transformers import Olmo2Config
    return Olmo2Config(num_hidden_layers=2, **_COMMON)


def _granite():
    from transformers import GraniteConfig
    return GraniteConfig(num_hidden_layers=2, embedding_multiplier=3.0, residual_multiplier=0.5,
                         attention_multiplier=0.2, logits_scaling=4.0, **_COMMON)


def _lfm2():
    from transformers import Lfm2Config
    cfg = {k: v for k, v in _COMMON.items() if k != "tie_word_embeddings"}
    return Lfm2Config(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                      block_auto_adjust_ff_dim=False, tie_word_embeddings=False, **cfg)


def _falcon_h1():
    from transformers import FalconH1Config
    return FalconH1Config(num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                          mamba_d_state=8, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16,
                          embedding_multiplier=2.0, lm_head_multiplier=0.5, **_COMMON)


def _gpt2():
    from transformers import GPT2Config
    return GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=512, initializer_range=0.1,
                      bos_token_id=1, eos_token_id=2)


_BUILDERS: dict[str, Callable[[], Any]] = {
    "llama": _llama, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5,
    "gpt_oss": _gpt_oss, "gemma2": _gemma2, "gemma3": _gemma3, "deepseek_v3": _deepseek_v3,
    "mistral": _mistral, "phi3": _phi3, "olmo2": _olmo2, "granite": _granite, "lfm2": _lfm2,
    "falcon_h1": _falcon_h1, "gpt2": _gpt2,
}
FAMILIES: tuple[str, ...] = tuple(_BUILDERS)


def zoo_config(family: str) -> Any:
    """The tiny HF config of `family` (a fresh object). ValueError naming the known families otherwise."""
    if family not in _BUILDERS:
        raise ValueError(f"family={family!r}: use one of {', '.join(FAMILIES)}")
    return _BUILDERS[family]()


def _redraw_feature_params(model: nn.Module, gen: torch.Generator) -> None:
    """Give parameters that HF initializes to a no-op value, and that carry the family's feature, real values."""
    for name, p in model.named_parameters():
        if name.endswith(".sinks"):  # gpt-oss attention sinks: per head logits of the extra 'sink' column
            p.data.copy_(torch.randn(p.shape, generator=gen) * 1.5)


def zoo_model(family: str, seed: int = 0) -> tuple[nn.Module, Any]:
    """(model, config) of `family`: the CausalLM class transformers maps the config to, fp32, eval mode,
    no gradients, SDPA attention where the class supports it (eager otherwise). Same seed → same weights."""
    from transformers import AutoModelForCausalLM

    config = zoo_config(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _redraw_feature_params(model, torch.Generator().manual_seed(seed + 1))
    return freeze(model), model.config


def zoo_bundle(family: str, seed: int = 0) -> TargetBundle:
    """TargetBundle around `zoo_model(family, seed)`, named "zoo-<family>"."""
    return bundle_from_model(zoo_model(family, seed)[0], name_or_path=f"zoo-{family}")


def family_status(family: str) -> "TargetSupport":
    """The trainer's own verdict on `family` (`target_model.families.support_from_config` of its tiny
    config, as `init-config` computes it): `.refused` is None or the one-line reason, `.needs` lists
    what the family needed, `.per_document` says whether each document runs as its own forward."""
    from dflash_trainer.target_model.families import support_from_config

    return support_from_config(zoo_config(family))


def supported_families() -> list[str]:
    """Families the trainer accepts (`family_status(f).refused is None`), in FAMILIES order."""
    return [f for f in FAMILIES if family_status(f).refused is None]


def refused_families() -> dict[str, str]:
    """{family: one-line reason} of the families the trainer refuses (empty when it accepts all)."""
    return {f: s.refused for f in FAMILIES if (s := family_status(f)).refused is not None}
