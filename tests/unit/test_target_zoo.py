"""Every family of the target zoo (tests/zoo.py) against the family's own HF forward, on CPU.

R = rows, T = packed tokens per row, H = hidden, L = decoder layers, W = sliding window (8).

Oracle: the HF model's own forward of each document ALONE (its default attention: SDPA, or eager
for the classes transformers does not run with SDPA), `hidden_states[ℓ + 1]` for every layer
ℓ < L − 1, a hook on the last layer (transformers' `hidden_states[L]` is final-normed; the feature
is the raw layer output), and argmax of its logits for the labels. Every layer is checked, so any
`target_layer_ids` the rule can pick is. fp32, max |Δ| ≤ 1e-5.

The flex path runs here through torch's reference (uncompiled) flex kernel: the same BlockMask,
mask_mod and transformers' score_mod (soft-capping) as the compiled kernel, without one 5–40 s
compile per family on CPU. The compiled kernel's tile tables and its features against SDPA are
checked in test_target_flex.py.
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import pytest
import torch

from dflash_trainer.target_model.attention import resolve_attention
from dflash_trainer.target_model.families import support_from_config, target_support
from dflash_trainer.target_model.features import TargetFeatureExtractor, attention_masks_for
from dflash_trainer.target_model.load import bundle_from_model, find_decoder_layers
from tests.zoo import FAMILIES, family_status, refused_families, supported_families, zoo_config, zoo_model

ROWS = [[37, 50, 29, 12], [61, 67]]  # T = 128 (a flex tile); every document is longer than W = 8
T = 128
PATHS = ("sdpa", "eager", "flex")
STATEFUL = {"qwen3_next": "linear_attention", "qwen3_5": "linear_attention", "lfm2": "conv", "falcon_h1": "hybrid"}
SLIDING = ("qwen3", "gpt_oss", "gemma2", "gemma3", "mistral", "phi3")
# The paths refused on CPU, with words their one-line reason must hold (besides the architecture).
REFUSED_PATHS = {("gpt_oss", "sdpa"): "attention sinks", ("gpt_oss", "flex"): "CUDA only",
                 ("gemma2", "sdpa"): "soft-caps", **{(f, "flex"): "one forward per document" for f in STATEFUL}}
REFUSED = {"gpt2": "`layers`"}  # family → words of its refusal
AUTO_CPU = {"gpt_oss": "eager", "gemma2": "eager"}  # others: sdpa
ACCEPTED = [f for f in FAMILIES if f not in REFUSED]
EXACT = [(f, p) for f in ACCEPTED for p in PATHS if (f, p) not in REFUSED_PATHS]


def _positions(doc_lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in doc_lengths])


@functools.cache
def _case(family: str):
    """(bundle, input_ids [R,T], position_ids [R,T], per-document references) of one family, built once:
    reference[r][d] = (first position, {layer: [1,n,H] output}, argmax [1,n])."""
    model, _ = zoo_model(family)
    bundle = bundle_from_model(model, name_or_path=f"zoo-{family}")
    L = bundle.num_layers
    input_ids = torch.randint(3, bundle.vocab_size, (len(ROWS), T), generator=torch.Generator().manual_seed(1))
    position_ids = torch.stack([_positions(r) for r in ROWS])
    last = find_decoder_layers(model)[L - 1]
    refs = []
    for r, lengths in enumerate(ROWS):
        start, row = 0, []
        for n in lengths:
            seen = {}
            handle = last.register_forward_hook(lambda _m, _a, out: seen.__setitem__("x", out[0] if isinstance(
                out, tuple) else out))
            try:
                with torch.no_grad():
                    out = model(input_ids[r:r + 1, start:start + n], output_hidden_states=True)
            finally:
                handle.remove()
            layers = {i: out.hidden_states[i + 1] for i in range(L - 1)} | {L - 1: seen["x"].clone()}
            row.append((start, layers, out.logits.argmax(-1)))
            start += n
        refs.append(row)
    return bundle, input_ids, position_ids, refs


def _max_diff(family: str, features: torch.Tensor, argmax: torch.Tensor | None) -> float:
    """Max |features − reference| over every document and layer; asserts the labels when given."""
    bundle, _, _, refs = _case(family)
    H, worst = bundle.hidden_size, 0.0
    for r, row in enumerate(refs):
        for start, layers, labels in row:
            n = labels.shape[1]
            for j, ref in layers.items():
                worst = max(worst, (features[r:r + 1, start:start + n, j * H:(j + 1) * H] - ref).abs().max().item())
            if argmax is not None:
                assert torch.equal(argmax[r:r + 1, start:start + n], labels), (family, r, start)
    return worst


@pytest.fixture
def reference_flex(monkeypatch):
    """transformers' flex attention through torch's uncompiled flex kernel (see the module docstring)."""
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(hf_flex.WrappedFlexAttention, "__call__", lambda self: flex_attention)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        yield


# --------------------------------------------------------------------------------------------
# Verdicts


def test_verdicts():
    """The trainer accepts every family of docs/targets.md that transformers has and refuses GPT-2 with its
    reason; init-config (config on the meta device) and train (the real model) reach the same
    verdict; exactly the stateful families run one forward per document."""
    assert supported_families() == ACCEPTED
    refused = refused_families()
    assert set(refused) == set(REFUSED)
    for family, words in REFUSED.items():
        assert "GPT2LMHeadModel" in refused[family] and words in refused[family]
    for family in ACCEPTED:
        status = family_status(family)
        assert status == target_support(zoo_model(family)[0]), family
        assert status.per_document == (family in STATEFUL), family
        if family in STATEFUL:
            assert status.stateful.startswith(STATEFUL[family]), status.stateful
    assert family_status("gpt_oss").sinks and family_status("gemma2").softcap == 2.0


@pytest.mark.parametrize("family", ACCEPTED)
def test_auto_picks_an_exact_path(family):
    """auto never picks a refused path: on CPU sdpa, or eager for sinks / soft-capping; on CUDA flex
    where it is exact (gpt-oss's sinks included), the dense path for stateful families (no mask to
    realize there) — so the Gemma 2 soft-capping error and the gpt-oss silent sink loss cannot recur."""
    bundle = _case(family)[0]
    ex = TargetFeatureExtractor(bundle, [0])
    assert ex.implementation_for(T) == AUTO_CPU.get(family, "sdpa")
    support, cuda = ex.support, torch.device("cuda")
    if family in STATEFUL:  # one forward per document on every device: no mask for flex to realize
        assert support.flex_reason(cuda) is not None and support.dense_path == "sdpa"
        return
    assert resolve_attention("auto", device=cuda, seq_len=T, flex_reason=support.flex_reason(cuda),
                             sdpa_reason=support.unsupported.get("sdpa")) == "flex"


# --------------------------------------------------------------------------------------------
# Features and labels


@pytest.mark.parametrize(("family", "path"), EXACT, ids=[f"{f}-{p}" for f, p in EXACT])
def test_packed_features_equal_each_document_alone(family, path, reference_flex):
    """Features of 2 packed rows of several documents (padding tail included) equal the family's own
    forward of each document alone at every layer (≤ 1e-5, fp32), and the labels equal its argmax,
    on every path the trainer runs this family with. Prevents cross-document attention or state,
    lost sinks / soft-capping / windows, and positions that do not restart per document."""
    bundle, input_ids, position_ids, _ = _case(family)
    ex = TargetFeatureExtractor(bundle, list(range(bundle.num_layers)), attention=path)
    assert ex.implementation_for(T) == path
    out = ex(input_ids, position_ids)
    assert out.features.abs().max() > 0.5  # the zoo's features are not vanishing
    assert out.argmax.unique().numel() > 10  # nor its labels degenerate
    assert _max_diff(family, out.features, out.argmax) <= 1e-5


@pytest.mark.parametrize(("family", "path"), list(REFUSED_PATHS), ids=[f"{f}-{p}" for f, p in REFUSED_PATHS])
def test_paths_that_cannot_be_exact_are_refused(family, path):
    """A forced path that would give wrong features (or crash mid-run) is refused when the extractor is
    built, in one line naming the architecture, the missing piece and the way out."""
    bundle = _case(family)[0]
    with pytest.raises(ValueError) as err:
        TargetFeatureExtractor(bundle, [0], attention=path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"target_attention={path}: ")
    assert type(bundle.model).__name__ in msg and REFUSED_PATHS[family, path] in msg
    assert "use target_attention=auto" in msg


# --------------------------------------------------------------------------------------------
# The tests above can fail: each family's feature changes the features of the zoo's documents


def test_sdpa_would_drop_gpt_oss_sinks():
    """The silent error this guards against: gpt-oss through transformers' SDPA attention (which
    ignores the sinks) differs from its own forward by far more than the tolerance."""
    bundle, input_ids, position_ids, _ = _case("gpt_oss")
    ex = TargetFeatureExtractor(bundle, list(range(bundle.num_layers)), attention="eager")
    wrong = ex.run(input_ids, position_ids, attention_masks_for(bundle.config, position_ids, "sdpa"), "sdpa")
    assert _max_diff("gpt_oss", wrong.features, None) > 1e-2


def test_gemma2_soft_capping_matters():
    """Without its attention soft-capping Gemma 2's features differ: the zoo's cap (2.0) is reached."""
    bundle, input_ids, position_ids, _ = _case("gemma2")
    ex = TargetFeatureExtractor(bundle, list(range(bundle.num_layers)), attention="eager")
    attns = [layer.self_attn for layer in find_decoder_layers(bundle.model)]
    try:
        for a in attns:
            a.attn_logit_softcapping = None
        uncapped = ex(input_ids, position_ids, need_argmax=False)
    finally:
        for a in attns:
            a.attn_logit_softcapping = 2.0
    assert _max_diff("gemma2", uncapped.features, None) > 1e-2


@pytest.mark.parametrize("family", SLIDING)
def test_sliding_windows_matter(family):
    """One full-attention document mask on every layer (the window dropped) gives other features: the
    zoo's documents are longer than its window."""
    bundle, input_ids, position_ids, _ = _case(family)
    ex = TargetFeatureExtractor(bundle, list(range(bundle.num_layers)), attention="eager")
    dtype = torch.float32
    full = attention_masks_for(SimpleNamespace(), position_ids, "eager", dtype)  # a config without a window
    masks = attention_masks_for(bundle.config, position_ids, "eager", dtype)
    no_window = {k: full for k in masks} if isinstance(masks, dict) else full
    out = ex.run(input_ids, position_ids, no_window, "eager", need_argmax=False)
    assert _max_diff(family, out.features, None) > 1e-3


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "lfm2"])
def test_stateful_layers_would_leak_across_documents(family):
    """Why these families run one forward per document: their first layer holds no attention at all
    (linear attention / convolution), yet run over the whole packed row it changes the second
    document's features by far more than the tolerance, through the state it carries alone."""
    bundle, input_ids, position_ids, refs = _case(family)
    assert zoo_config(family).layer_types[0] == STATEFUL[family]
    ex = TargetFeatureExtractor(bundle, [0], attention="sdpa")
    whole = ex.run(input_ids, position_ids, None, "sdpa", need_argmax=False)
    start, layers, labels = refs[0][1]
    n = labels.shape[1]
    assert (whole.features[:1, start:start + n] - layers[0]).abs().max() > 1e-2
    assert (whole.features[:1, :37] - refs[0][0][1][0]).abs().max() <= 1e-5  # the first document is its own


def test_init_config_sees_the_same_families():
    """`init-config` reads the verdict from the config alone (meta device, no weights) — the same object
    the zoo reports — so a refused family fails there, before any weights load."""
    assert support_from_config(zoo_config("qwen3_next")).per_document
    assert support_from_config(zoo_config("gpt2")).refused


@pytest.mark.parametrize("family", sorted(STATEFUL))
def test_eval_refuses_stateful_targets_with_one_line(family):
    """Speculative decoding crops the target's KV cache to drop rejected drafts, which cannot undo a
    recurrent state: eval refuses such targets at start (one line) instead of failing mid-run."""
    from dflash_trainer.evaluation.run import check_decodable

    with pytest.raises(ValueError, match=rf"^eval: {type(_case(family)[0].model).__name__} has {STATEFUL[family]}"):
        check_decodable(family_status(family))
    check_decodable(family_status("gpt_oss"))  # attention-only families decode


def test_a_logit_scale_that_reorders_the_argmax_is_refused():
    """A non-positive logit scale would make the plain head's argmax the target's argmin: refused at
    init-config with the field, not trained on reversed labels. A positive one is accepted."""
    cfg = zoo_config("granite")
    cfg.logits_scaling = -1.0
    refused = support_from_config(cfg).refused
    assert refused.startswith("GraniteForCausalLM: logits_scaling=-1.0") and "positive" in refused
    assert family_status("granite").refused is None
