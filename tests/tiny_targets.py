"""Tiny random-init targets for tests (no files, no tokenizer).

`tiny_llama`, `tiny_qwen3` and `tiny_gemma3` build HF causal LMs from LlamaConfig / Qwen3Config /
Gemma3TextConfig with a few layers, hidden size 64 and a 128-token vocabulary, seeded, fp32, eval
mode, SDPA attention. Gemma 3 is the odd one: its embedding module scales by √H, its layers have
four norms, and sliding and full layers alternate (window 4 here).
`bundle_from_model` (re-exported from load.py) wraps one into a TargetBundle:

    bundle = bundle_from_model(tiny_llama())
    out = TargetFeatureExtractor(bundle, [0, 2])(input_ids, position_ids)
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trainer.target_model.load import TargetBundle, bundle_from_model, freeze

__all__ = ["tiny_llama", "tiny_qwen3", "tiny_gemma3", "tiny_bundle", "bundle_from_model", "TargetBundle"]


def _build(config, seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return freeze(model)


def tiny_llama(num_layers: int = 4, hidden: int = 64, *, num_heads: int = 4, num_kv_heads: int = 2,
               intermediate: int = 128, vocab_size: int = 128, tie_word_embeddings: bool = False,
               initializer_range: float = 0.1, seed: int = 0) -> nn.Module:
    """A random LlamaForCausalLM (fp32, eval, no grad). Same seed → same weights.

    initializer_range is larger than HF's 0.02 so logits are spread out and argmax ties are
    unlikely in tests.
    """
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings,
                      initializer_range=initializer_range, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _build(cfg, seed)


def tiny_qwen3(num_layers: int = 4, hidden: int = 64, *, num_heads: int = 4, num_kv_heads: int = 2,
               head_dim: int = 16, intermediate: int = 128, vocab_size: int = 128,
               tie_word_embeddings: bool = False, sliding_window: int | None = None,
               layer_types: list[str] | None = None, initializer_range: float = 0.1, seed: int = 0) -> nn.Module:
    """A random Qwen3ForCausalLM (fp32, eval, no grad; q/k norms, explicit head_dim).

    sliding_window with layer_types (e.g. ["sliding_attention", "full_attention", ...]) builds a
    target that mixes sliding-window and full-attention layers.
    """
    from transformers import Qwen3Config

    kwargs = {}
    if sliding_window is not None:
        kwargs.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0)
    if layer_types is not None:
        kwargs["layer_types"] = list(layer_types)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings,
                      initializer_range=initializer_range, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kwargs)
    return _build(cfg, seed)


def tiny_gemma3(num_layers: int = 4, hidden: int = 64, *, num_heads: int = 4, num_kv_heads: int = 2,
                head_dim: int = 16, intermediate: int = 128, vocab_size: int = 128, sliding_window: int = 4,
                initializer_range: float = 0.1, query_pre_attn_scalar: int | None = None, seed: int = 0) -> nn.Module:
    """A random Gemma3ForCausalLM (fp32, eval, no grad): tied head, embedding scaled by √hidden (8 at
    H = 64), layers alternating sliding (window `sliding_window`) and full attention, starting sliding;
    attention scores scaled by query_pre_attn_scalar^-½ (default head_dim, i.e. the usual 1/√D)."""
    from transformers import Gemma3TextConfig

    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    cfg = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                           num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                           head_dim=head_dim, query_pre_attn_scalar=query_pre_attn_scalar or head_dim,
                           sliding_window=sliding_window,
                           layer_types=types, max_position_embeddings=4096, initializer_range=initializer_range,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _build(cfg, seed)


def tiny_bundle(kind: str = "llama", **kwargs) -> TargetBundle:
    """TargetBundle around tiny_llama / tiny_qwen3 / tiny_gemma3(**kwargs) (kind "llama" | "qwen3" | "gemma3")."""
    builders = {"llama": tiny_llama, "qwen3": tiny_qwen3, "gemma3": tiny_gemma3}
    if kind not in builders:
        raise ValueError(f"kind={kind!r}: use one of {', '.join(builders)}")
    return bundle_from_model(builders[kind](**kwargs), name_or_path=f"tiny-{kind}")
