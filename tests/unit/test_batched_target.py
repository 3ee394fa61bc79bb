"""The batched static-cache target (decoding/batched.py, static_layer.py) against the HF forward of the same model.

Rows of different lengths are prefilled together, then decoded with per-row start positions;
logits and features must equal one plain HF forward over each row's whole sequence (fp32, tiny
random Llama / Qwen3 / sliding-window Qwen3 / Gemma 3 targets; Gemma 3: scaled embeddings, norms
after both sublayers, local and global RoPE tables, sliding layers, soft-capped logits). Rejected drafts (stale cache slots) must
stay invisible.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.decoding.batched import BatchedTarget, unsupported_reason
from dflash_trainer.target_model.features import TargetFeatureExtractor
from dflash_trainer.decoding.static_layer import ROPE_PER_HEAD_MAX
from tests.tiny_targets import tiny_bundle

KINDS = [("llama", {}), ("qwen3", {}),
         ("qwen3", dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"] * 2)),
         # layers alternate sliding / full, each type its own RoPE base; scores scaled by 1/√40, not 1/√D
         ("gemma3", dict(sliding_window=3, query_pre_attn_scalar=40))]


def _hf(bundle, seq, layer_ids):
    """HF logits [T,V] and features [T,k·H] of one sequence (plain forward, positions 0 … T−1)."""
    ids = torch.tensor([seq])
    logits = bundle.model(input_ids=ids).logits[0].float()
    feats = TargetFeatureExtractor(bundle, layer_ids)(ids, torch.arange(len(seq))[None]).features[0]
    return logits, feats


def _distinct_norms(bundle):
    """Every norm weight of the target random and different (Gemma 3 builds them all 0, i.e. ×1, so
    norms applied in the wrong place or order would give the same values)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in bundle.model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("kind,kw", KINDS)
@pytest.mark.parametrize("long_prompts", [False, True], ids=["short", "long"])
def test_prefill_then_steps_equal_hf_forward(kind, kw, long_prompts):
    """Prefill (short: RoPE tables per head; long: past ROPE_PER_HEAD_MAX tokens, q and k rotated by
    one broadcast table, v copied) and decode steps give HF's logits and features."""
    torch.manual_seed(0)
    bundle = tiny_bundle(kind, **kw)
    if kind == "gemma3":
        _distinct_norms(bundle)
    layer_ids = [0, 2]
    extra = ROPE_PER_HEAD_MAX + 4 if long_prompts else 0
    seqs = [torch.randint(3, 128, (L + extra,)).tolist() for L in (11, 7, 13)]
    prompt_len = [5 + extra, 2 + extra, 7 + extra]
    bt = BatchedTarget(bundle, rows=3, max_len=32 + extra, layer_ids=layer_ids)
    P = max(prompt_len)
    toks = torch.zeros(3, P, dtype=torch.long)
    for r, s in enumerate(seqs):
        toks[r, :prompt_len[r]] = torch.tensor(s[:prompt_len[r]])
    lengths = torch.tensor(prompt_len)
    last, feats = bt.prefill(torch.arange(3), toks, lengths, with_features=True)
    for r, s in enumerate(seqs):
        ref_logits, ref_feats = _hf(bundle, s, layer_ids)
        torch.testing.assert_close(last[r], ref_logits[prompt_len[r] - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feats[r, :prompt_len[r]], ref_feats[:prompt_len[r]], atol=1e-4, rtol=1e-4)
    # write 3 junk "drafts" after every prompt, then overwrite them with the true tokens in steps of 2
    junk = torch.randint(3, 128, (3, 3))
    bt.step(junk, lengths, span=32 + extra)
    start = lengths.clone()
    for _ in range(2):
        chunk = torch.stack([torch.tensor(s[int(start[r]):int(start[r]) + 2]) for r, s in enumerate(seqs)])
        logits, f = bt.step(chunk, start, span=int(start.max()) + 2, with_features=True)
        for r, s in enumerate(seqs):
            ref_logits, ref_feats = _hf(bundle, s, layer_ids)
            a = int(start[r])
            torch.testing.assert_close(logits[r], ref_logits[a:a + 2], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(f[r], ref_feats[a:a + 2], atol=1e-4, rtol=1e-4)
        start += 2


def test_rejects_targets_it_does_not_implement():
    """Other decoder families (extra norms, softcapping) would run with the wrong math: refused by
    model_type and by layer structure, with the reason (regenerate then falls back to HF generate)."""
    bundle = tiny_bundle("llama")
    assert unsupported_reason(bundle) is None
    bundle.model.model.layers[1].self_attn = torch.nn.Identity()
    with pytest.raises(ValueError, match="target layer 1 .*q/k/v/o_proj"):
        BatchedTarget(bundle, rows=1, max_len=8)
    gemma = tiny_bundle("gemma3")
    assert unsupported_reason(gemma) is None
    del gemma.model.model.layers[2].post_feedforward_layernorm  # a Gemma 3 layer needs all four norms
    assert "post_feedforward_layernorm" in unsupported_reason(gemma)
    for field, value in (("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)):
        gemma = tiny_bundle("gemma3")
        setattr(gemma.model.config, field, value)
        assert field in unsupported_reason(gemma)
    gemma = tiny_bundle("gemma3")
    gemma.model.config.layer_types = gemma.model.config.layer_types[:2]  # a table per layer type needs every layer's
    assert "layer_types" in unsupported_reason(gemma)
    other = tiny_bundle("qwen3")
    other.config.model_type = "gemma2"
    with pytest.raises(ValueError, match="'gemma2' is not one of"):
        BatchedTarget(other, rows=1, max_len=8)


def test_gemma3_roPE_tables_differ_by_layer_type_and_logits_are_soft_capped():
    """Gemma 3's local (sliding) and global layers rotate with different RoPE bases (a single table
    would pass the sliding-window tests above only by luck: check the tables differ), and a target
    with final_logit_softcapping gets c·tanh(z/c) logits equal to HF's."""
    torch.manual_seed(0)
    bundle = tiny_bundle("gemma3", sliding_window=3)
    bt = BatchedTarget(bundle, rows=2, max_len=16)
    assert set(bt._ropes) == {"sliding_attention", "full_attention"}
    local, glob = (bt._ropes[k].table[0] for k in ("sliding_attention", "full_attention"))
    assert (local[5] - glob[5]).abs().max() > 1e-2
    bundle.model.config.final_logit_softcapping = 0.5  # far below the raw logits' range: the cap matters
    bt = BatchedTarget(bundle, rows=2, max_len=16)
    seq = torch.randint(3, 128, (9,)).tolist()
    last, _ = bt.prefill(torch.arange(1), torch.tensor([seq]), torch.tensor([9]))
    ref = bundle.model(input_ids=torch.tensor([seq])).logits[0, -1].float()
    assert ref.abs().max() <= 0.5 and ref.abs().max() > 0.3
    torch.testing.assert_close(last[0], ref, atol=1e-5, rtol=1e-5)


def test_fused_projections_share_storage_and_keep_the_model_intact():
    """The step's one q/k/v matmul (and gate/up) reads the target's own weights moved side by side in
    one storage: values and the HF forward unchanged, no second copy when another engine is built,
    biases fused too (Qwen2), and a trainable module is left alone (run one linear at a time)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dflash_trainer.target_model.load import bundle_from_model, freeze
    from dflash_trainer.decoding.static_layer import fused_linear

    bundle = tiny_bundle("llama")
    ids = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(2))
    before = bundle.model(input_ids=ids).logits
    attn = bundle.model.model.layers[0].self_attn
    weights = [attn.q_proj.weight.detach().clone(), attn.k_proj.weight.detach().clone()]
    BatchedTarget(bundle, rows=1, max_len=16)
    ptr = attn.q_proj.weight.data_ptr()
    assert attn.k_proj.weight.data_ptr() == ptr + attn.q_proj.weight.numel() * attn.q_proj.weight.element_size()
    assert torch.equal(attn.q_proj.weight, weights[0]) and torch.equal(attn.k_proj.weight, weights[1])
    BatchedTarget(bundle, rows=2, max_len=16)
    assert attn.q_proj.weight.data_ptr() == ptr  # found side by side: a view, no new storage
    assert torch.equal(bundle.model(input_ids=ids).logits, before)

    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        qwen2 = freeze(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32))
        with torch.no_grad():
            for name, p in qwen2.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    seq = torch.randint(3, 120, (1, 10), generator=torch.Generator().manual_seed(3))
    ref = qwen2(input_ids=seq).logits[0]
    bt = BatchedTarget(bundle_from_model(qwen2, name_or_path="tiny-qwen2"), rows=1, max_len=16)
    assert bt._layers[0].qkv[1] is not None  # q/k/v biases side by side too
    last, _ = bt.prefill(torch.arange(1), seq[:, :6], torch.tensor([6]))
    logits, _ = bt.step(seq[:, 6:], torch.tensor([6]), 10)
    torch.testing.assert_close(last[0], ref[5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0], ref[6:], atol=1e-4, rtol=1e-4)

    trainable = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    ptrs = [m.weight.data_ptr() for m in trainable]
    assert fused_linear(trainable) is None and [m.weight.data_ptr() for m in trainable] == ptrs


def test_fused_norm_runs_only_norms_that_compute_w_x_over_rms():
    """FusedNorm takes the one-kernel path only for a module that computes w·x/rms(x): Qwen3's norm with
    large weights in fp32 / bf16 / fp16 passes the probe; a module with the same attributes that
    computes (1 + w)·x/rms(x) (Gemma's form) fails it and runs as itself, with its own values."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from dflash_trainer.decoding.static_layer import FusedNorm

    class OnePlusW(Qwen3RMSNorm):
        def forward(self, x):
            v = x.float()
            v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (v * (1.0 + self.weight.float())).to(x.dtype)

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        norm = Qwen3RMSNorm(256, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(256, generator=g) * 50)
        assert FusedNorm(norm.to(dtype)).fast, dtype
    odd = OnePlusW(64, eps=1e-6)
    with torch.no_grad():
        odd.weight.zero_()
    fused = FusedNorm(odd)
    assert not fused.fast
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(fused(x), odd(x), rtol=0, atol=0)
