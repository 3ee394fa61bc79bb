"""The target's flex path: document-causal BlockMask and flex forward against the dense SDPA path.

R = rows, T = packed tokens per row, W = sliding window, n = T/128 tiles. fp32 on CPU (flex
forward runs on CPU in torch ≥ 2.9; the target needs no backward). Oracles: the dense mask (itself
checked against a Python loop in test_target_features.py), torch's `create_block_mask` evaluating
the mask_mod over every pair, and transformers' own SDPA forward with the dense mask.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from dflash_trainer.target_model.attention import (
    attention_masks_for,
    flex_unsupported_reason,
    resolve_attention,
)
from dflash_trainer.target_model.features import TargetFeatureExtractor
from dflash_trainer.target_model.packed_masks import (
    document_block_masks,
    document_mask_mod,
    document_starts,
    packed_causal_mask,
)
from tests.tiny_targets import bundle_from_model, tiny_llama, tiny_qwen3
from tests.sync_guard import SyncGuard

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _positions(doc_lengths: list[int]) -> torch.Tensor:
    """[T] position ids restarting at 0 in each document."""
    return torch.cat([torch.arange(n) for n in doc_lengths])


# Packed rows of 512 tokens: documents inside one tile, across tile edges, ending on an edge,
# one-token documents, one document filling the row.
ROWS = [[100, 300, 5, 107], [512], [128, 128, 1, 255], [1, 1, 1, 129, 380]]


def _tiles(num: torch.Tensor, idx: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Dense tile bools [R,n,n_cols] from (counts [R,1,n], indices [R,1,n,C]) tables."""
    cols = torch.arange(idx.shape[-1])
    out = torch.zeros(num.shape[0], num.shape[2], n_cols, dtype=torch.bool)
    for r in range(num.shape[0]):
        for i in range(num.shape[2]):
            for c in idx[r, 0, i][cols < num[r, 0, i]].tolist():
                out[r, i, c] = True
    return out


def _realized(block_mask, T: int) -> torch.Tensor:
    """The element mask [R,T,T] a flex kernel applies: full tiles whole, partial tiles through mask_mod."""
    n = T // 128
    full = _tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n)
    partial = _tiles(block_mask.kv_num_blocks, block_mask.kv_indices, n)
    R = full.shape[0]
    up = lambda t: t.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)  # noqa: E731
    b = torch.arange(R)[:, None, None]
    q = torch.arange(T)[None, :, None]
    k = torch.arange(T)[None, None, :]
    mod = block_mask.mask_mod(b, 0, q, k)  # [R,T,T]
    return up(full) | (up(partial) & mod)


@pytest.mark.parametrize("window", [None, 1, 129, 200, 384])
def test_block_mask_tables_equal_create_block_mask(window):
    """The directly built tables are bit-identical to torch's create_block_mask over the same
    mask_mod (no tile dropped, none visited in vain, full tiles kept apart, torch's index order)."""
    position_ids = torch.stack([_positions(d) for d in ROWS])  # [4,512]
    got = document_block_masks(position_ids, [window])[window]
    ref = create_block_mask(document_mask_mod(document_starts(position_ids), window), len(ROWS), 1, 512, 512,
                            device="cpu")
    for name in TABLES:
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape, name
        assert torch.equal(a, b), (name, window)
    assert got.seq_lengths == (512, 512) and got.BLOCK_SIZE == (128, 128)
    if window is None or window > 255:  # a full off-diagonal tile needs W > 128 + 127
        assert int(got.full_kv_num_blocks.sum()) > 0  # the test sees full tiles, not only partial ones


@pytest.mark.parametrize("window", [None, 3, 130])
def test_block_mask_realizes_the_dense_mask(window):
    """What a flex kernel applies (full tiles + mask_mod on partial tiles) equals the dense mask of
    the SDPA path element by element: no cross-document key, no future key, the window kept."""
    position_ids = torch.stack([_positions(d) for d in ROWS])
    got = _realized(document_block_masks(position_ids, [window])[window], 512)
    assert torch.equal(got, packed_causal_mask(position_ids, window)[:, 0])


def test_block_mask_is_safe_for_any_position_ids():
    """Position ids that are not runs of 0, 1, 2, … (jumps, repeats) still give exactly the dense
    mask's visibility: the tile rule only ever visits more tiles, never fewer."""
    g = torch.Generator().manual_seed(0)
    position_ids = torch.randint(0, 300, (2, 384), generator=g)
    position_ids[1, 200:] = torch.arange(184) * 2  # jumps up by 2
    for window in (None, 150):
        got = _realized(document_block_masks(position_ids, [window])[window], 384)
        assert torch.equal(got, packed_causal_mask(position_ids, window)[:, 0])


def test_block_mask_build_has_no_host_sync():
    """The build runs on the device only (no .item(), nonzero, boolean indexing): on CUDA the
    target forward is queued without waiting. Both windows in one call."""
    position_ids = torch.stack([_positions(d) for d in ROWS])
    with SyncGuard():
        masks = document_block_masks(position_ids, [None, 200, None])
    assert set(masks) == {None, 200}


def test_block_mask_input_errors():
    with pytest.raises(ValueError, match="multiple of 128"):
        document_block_masks(torch.arange(200)[None], [None])
    with pytest.raises(ValueError, match=r"\[R,T\]"):
        document_block_masks(torch.arange(256), [None])
    with pytest.raises(ValueError, match="sliding_window=0"):
        document_block_masks(torch.arange(256)[None], [0])


# --------------------------------------------------------------------------------------------
# The flex forward against the SDPA forward (fp32, CPU)


def _sliding_qwen3():
    return tiny_qwen3(num_layers=4, sliding_window=100,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])


MODELS = {"llama": lambda: tiny_llama(num_layers=4), "qwen3": lambda: tiny_qwen3(num_layers=4),
          "qwen3-sliding": _sliding_qwen3}


@pytest.mark.parametrize("kind", list(MODELS))
def test_flex_forward_equals_sdpa_forward(kind):
    """Flex + BlockMask gives the SDPA + dense-mask features at every layer and the same greedy
    labels, for 2 packed rows of several documents (documents crossing tile edges; with sliding
    layers, a window shorter than the documents). Tolerance: max |Δ| ≤ 2e-5 in fp32 (features
    reach ~10; measured ~2e-6). Also with layers skipped (features only)."""
    bundle = bundle_from_model(MODELS[kind]())
    L = bundle.num_layers
    position_ids = torch.stack([_positions([100, 150, 6]), _positions([256])])  # [2,256]
    input_ids = torch.randint(3, bundle.vocab_size, (2, 256), generator=torch.Generator().manual_seed(1))
    layer_ids = list(range(L))
    sdpa = TargetFeatureExtractor(bundle, layer_ids, attention="sdpa")
    flex = TargetFeatureExtractor(bundle, layer_ids, attention="flex")
    assert flex.implementation_for(256) == "flex" and sdpa.implementation_for(256) == "sdpa"
    ref, got = sdpa(input_ids, position_ids), flex(input_ids, position_ids)
    assert ref.features.abs().max() > 1.0
    torch.testing.assert_close(got.features, ref.features, rtol=0, atol=2e-5)
    assert torch.equal(got.argmax, ref.argmax)
    assert ref.argmax.unique().numel() > 20  # labels are not degenerate
    short = TargetFeatureExtractor(bundle, [0, 2], attention="flex")(input_ids, position_ids, need_argmax=False)
    H = bundle.hidden_size
    torch.testing.assert_close(short.features, torch.cat([ref.features[..., :H], ref.features[..., 2 * H:3 * H]], -1),
                               rtol=0, atol=2e-5)
    assert bundle.config._attn_implementation == "sdpa"  # switched back after each forward, also after an early stop
    if kind == "qwen3-sliding":
        masks = attention_masks_for(bundle.config, position_ids, "flex")
        assert set(masks) == {"full_attention", "sliding_attention"}
        assert masks["full_attention"] is not masks["sliding_attention"]
        # the window matters here: the full mask on every layer gives other features
        no_window = flex.run(input_ids, position_ids, masks["full_attention"], "flex", need_argmax=False)
        assert (no_window.features - ref.features).abs().max() > 1e-3


def test_single_window_config_gets_one_windowed_mask():
    """A target without layer_types whose config has sliding_window (Mistral-style: every layer
    slides) gets one mask with the window on both paths; use_sliding_window=False drops it."""
    from types import SimpleNamespace

    position_ids = torch.stack([_positions([300, 84]), _positions([384])])
    mistral = SimpleNamespace(sliding_window=100)
    flex = attention_masks_for(mistral, position_ids, "flex")
    dense = attention_masks_for(mistral, position_ids, "sdpa")
    assert torch.equal(dense, packed_causal_mask(position_ids, 100))
    assert torch.equal(_realized(flex, 384), dense[:, 0])
    off = SimpleNamespace(sliding_window=100, use_sliding_window=False)
    no_window = _realized(attention_masks_for(off, position_ids, "flex"), 384)
    assert torch.equal(no_window, packed_causal_mask(position_ids)[:, 0])


def test_flex_forward_is_not_plain_causal():
    """The equality above can fail: the flex path differs from a plain causal forward over the row
    (documents seeing earlier documents) after the first document, and matches it inside it."""
    bundle = bundle_from_model(tiny_qwen3(num_layers=2))
    position_ids = _positions([100, 156])[None]
    input_ids = torch.randint(3, bundle.vocab_size, (1, 256), generator=torch.Generator().manual_seed(2))
    ex = TargetFeatureExtractor(bundle, [1], attention="flex")
    packed = ex(input_ids, position_ids, need_argmax=False)
    plain = ex.run(input_ids, None, None, "sdpa", need_argmax=False)
    torch.testing.assert_close(packed.features[:, :100], plain.features[:, :100], rtol=0, atol=2e-5)
    assert (packed.features[:, 100:] - plain.features[:, 100:]).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------
# Choosing the path


def test_auto_resolves_per_device_and_length():
    """auto = flex on CUDA with T % 128 == 0, SDPA on CPU (no warning), SDPA with a warning on CUDA
    when T does not fit the tiles; a forced flex that cannot run is a ValueError naming the setting."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attention("auto", device=cuda, seq_len=8192, flex_reason=None) == "flex"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_attention("auto", device=cpu, seq_len=8192, flex_reason=None) == "sdpa"
    with pytest.warns(UserWarning, match="T=200 is not a multiple of 128"):
        assert resolve_attention("auto", device=cuda, seq_len=200, flex_reason=None) == "sdpa"
    with pytest.warns(UserWarning, match="no flex"):
        assert resolve_attention("auto", device=cuda, seq_len=256, flex_reason="no flex") == "sdpa"
    assert resolve_attention("sdpa", device=cuda, seq_len=256, flex_reason=None) == "sdpa"
    with pytest.raises(ValueError, match="target_attention=flex: T=200"):
        resolve_attention("flex", device=cpu, seq_len=200, flex_reason=None)
    with pytest.raises(ValueError, match="target_attention='fast'"):
        resolve_attention("fast", device=cpu, seq_len=256, flex_reason=None)


def test_model_without_flex_support():
    """A model class transformers cannot run with flex: forced flex is refused at construction,
    auto keeps SDPA, and the model's own attention setting is left as it was."""
    model = tiny_llama(num_layers=2)
    model._supports_flex_attn = False
    bundle = bundle_from_model(model)
    assert flex_unsupported_reason(model) is not None
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="target_attention=flex"):
        TargetFeatureExtractor(bundle, [0], attention="flex")
    ex = TargetFeatureExtractor(bundle, [0], attention="auto")
    assert ex.implementation_for(256) == "sdpa"
    with pytest.raises(ValueError, match="target_attention='flash'"):
        TargetFeatureExtractor(bundle, [0], attention="flash")


def test_compiled_layers_equal_eager_layers_and_are_put_back(monkeypatch):
    """Compiled decoder layers (the CUDA default on the flex path) trace the HF layers with their
    BlockMasks and give the eager features and labels (max |Δ| ≤ 1e-5), sliding and full layers
    alike, also with the last layer skipped (features only); afterwards every layer runs what it ran
    before (its own eager `forward`, or an instance `forward` put there by someone else, e.g. an
    accelerate hook), also when the forward raises: the same model serves KV-cache decoding. Dynamo
    traces the layers here through the aot_eager backend (inductor's CPU code generation would add
    ~25 s and is not a path training takes); inductor's CUDA kernels are checked in
    tests/gpu/test_target_flex_cuda.py."""
    import functools

    from torch._dynamo.utils import counters

    bundle = bundle_from_model(tiny_qwen3(num_layers=3, sliding_window=100,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    position_ids = torch.stack([_positions([100, 150, 6]), _positions([256])])
    input_ids = torch.randint(3, bundle.vocab_size, (2, 256), generator=torch.Generator().manual_seed(3))
    eager = TargetFeatureExtractor(bundle, [0, 1], attention="flex", compile_layers=False)
    ref = eager(input_ids, position_ids)  # before the patch: transformers compiles its flex kernel once, for good
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    compiled = TargetFeatureExtractor(bundle, [0, 1], attention="flex", compile_layers=True)
    auto = TargetFeatureExtractor(bundle, [0, 1], attention="flex")
    assert compiled.compiles("flex") and not eager.compiles("flex")
    assert not auto.compiles("flex") and not auto.compiles("sdpa")  # compiled layers are a CUDA default
    layers = compiled.layers
    sentinel = layers[2].forward  # an instance attribute someone else set (bound method object)
    layers[2].forward = sentinel
    traced = counters["stats"]["calls_captured"]
    got = compiled(input_ids, position_ids)
    assert counters["stats"]["calls_captured"] > traced  # the layers did run through dynamo
    torch.testing.assert_close(got.features, ref.features, rtol=0, atol=1e-5)
    assert torch.equal(got.argmax, ref.argmax)
    short = compiled(input_ids, position_ids, need_argmax=False)  # layer 2 skipped: a hook stops after layer 1
    torch.testing.assert_close(short.features, ref.features, rtol=0, atol=1e-5)
    assert "forward" not in layers[0].__dict__ and "forward" not in layers[1].__dict__
    assert layers[2].__dict__["forward"] is sentinel
    handle = layers[1].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(KeyError("mid-forward")))
    try:
        with pytest.raises(KeyError, match="mid-forward"):
            compiled(input_ids, position_ids)
    finally:
        handle.remove()
    assert "forward" not in layers[0].__dict__ and layers[2].__dict__["forward"] is sentinel
