"""The drafter's block embedding and logits against each zoo family's own HF forward (tests/zoo.py), CPU fp32.

n = probe tokens, B = block size, H = hidden, V = vocabulary.

Oracle: the HF model itself. Its first decoder layer's input (a forward pre-hook on layers[0]) for
token ids, against the drafter's `embed_block` of the same ids; its `logits` output against the
drafter's `logits` of the final hidden its LM head received (a hook on lm_head). The drafter config
comes from init-config's `drafter_config_from_target`; the drafter is built both as eval builds it (around
the target's own modules: Gemma's embedding module scales by itself) and as training builds it (plain
modules around the same weights). fp32, equal bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dflash_trainer.drafter.loss import block_loss
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.config.sections import DrafterSection
from dflash_trainer.drafter.shape import drafter_config_from_target, check_fits_target
from dflash_trainer.target_model.head_transforms import TargetHead, check_target_head, target_head
from dflash_trainer.target_model.load import bundle_from_model, find_decoder_layers, freeze
from dflash_trainer.drafter.build import frozen_modules
from tests.zoo import supported_families, zoo_config, zoo_model

B = 4
IDS = torch.tensor([[5, 127, 64, 3, 99, 127, 127, 17]])  # [1,n], n = 2·B; 127 = the mask row
# What each family applies around its embedding and LM head (transformers 5.24, tests/zoo.py's values):
# (embedding_scale, logit_scale, logit_softcap); every other family is a plain lookup and matmul.
EXPECTED = {"gemma2": (8.0, 1.0, 5.0), "gemma3": (8.0, 1.0, None), "granite": (3.0, 0.25, None),
            "falcon_h1": (2.0, 0.5, None)}
FAMILIES = supported_families()


def _oracle(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input of decoder layer 0 [1,n,H], input of the LM head [1,n,H], logits [1,n,V]) of the HF forward."""
    seen: dict[str, torch.Tensor] = {}

    def first(_m, args, kwargs):
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).clone()

    def head(_m, args, _out):
        seen["h"] = args[0].clone()

    handles = [find_decoder_layers(model)[0].register_forward_pre_hook(first, with_kwargs=True),
               model.get_output_embeddings().register_forward_hook(head)]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return seen["x"], seen["h"], logits


@functools.cache
def _case(family: str, tied: bool = False):
    """(bundle, drafter config from init-config, oracle tensors) of one family, built once."""
    if tied:
        config = zoo_config(family)
        config.tie_word_embeddings = True
        from transformers import AutoModelForCausalLM
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = freeze(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    else:
        model, _ = zoo_model(family)
    bundle = bundle_from_model(model, name_or_path=f"zoo-{family}")
    dc, _ = drafter_config_from_target(model.config, None,
                                       DrafterSection(num_layers=1, block_size=B, target_layer_ids=[0, 1], mask_token_id=127))
    return bundle, dc, _oracle(model, IDS)


def _drafters(bundle, dc) -> dict[str, DFlashDrafter]:
    """The drafter as eval builds it (the target's modules) and as training builds it (frozen_modules)."""
    torch.manual_seed(0)
    as_eval = DFlashDrafter(dc, bundle.embed_tokens, bundle.lm_head, compile_flex=False)
    as_train = DFlashDrafter(dc, *frozen_modules(bundle.embed_tokens.weight, bundle.lm_head.weight,
                                                 torch.device("cpu")), compile_flex=False)
    return {"eval": as_eval, "train": as_train}


@pytest.mark.parametrize("family", FAMILIES)
def test_init_config_copies_the_targets_embedding_and_logit_functions(family):
    """Prevents a drafter config that misses Gemma's √H, Granite's or Falcon-H1's multipliers or a
    final soft-cap (the drafter would train on another input and distribution than the target's)."""
    _, dc, _ = _case(family)
    assert (dc.embedding_scale, dc.logit_scale, dc.logit_softcap) == EXPECTED.get(family, (1.0, 1.0, None))


@pytest.mark.parametrize("family", FAMILIES)
def test_block_embedding_is_what_the_target_feeds_its_first_layer(family):
    """The drafter's block input for token ids equals the HF target's layer-0 input for them, on the eval
    and the training construction, and inside the drafter's own forward: prevents Gemma's scale applied
    twice (its module already scales) or not at all (a plain nn.Embedding of the weight)."""
    bundle, dc, (x0, _, _) = _case(family)
    for how, drafter in _drafters(bundle, dc).items():
        assert torch.equal(drafter.embed_block(IDS), x0), (family, how)
        seen = {}
        hook = drafter.layers[0].register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0]))
        n, T = IDS.shape[1], 3
        features = torch.randn(1, T, 2 * dc.hidden_size)
        masks = {None: torch.ones(1, n, T + n, dtype=torch.bool)}
        with torch.no_grad():
            drafter(features, torch.arange(T)[None], IDS, torch.arange(T, T + n)[None], masks)
        hook.remove()
        assert torch.equal(seen["x"], x0), (family, how)
    if family in EXPECTED:  # the scale matters: the raw rows are not the target's input
        assert not torch.allclose(bundle.embed_tokens.weight[IDS], x0)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_logits_are_the_targets_logits_function(family):
    """drafter.logits (eval's drafts) and the training loss score a final hidden exactly as the HF
    target's own logits: prevents a missing soft-cap, logit scaling or LM-head multiplier."""
    bundle, dc, (_, h, logits) = _case(family)
    for how, drafter in _drafters(bundle, dc).items():
        assert torch.equal(drafter.logits(h), logits), (family, how)
    # The loss: CE of slots 1..B−1 of each block against the HF logits' log-softmax.
    labels = torch.tensor([[3, 9, 40, 77, 0, 5, 6, 100]])
    weight = torch.ones(1, IDS.shape[1])
    sums = block_loss(h, bundle.lm_head.weight, labels, weight, block_size=B, logit_scale=dc.logit_scale,
                      logit_softcap=dc.logit_softcap)
    logp = torch.log_softmax(logits[0], -1)
    slots = [k for k in range(IDS.shape[1]) if k % B]
    want = -sum(logp[k, labels[0, k]] for k in slots)
    torch.testing.assert_close(sums.loss_sum, want, rtol=1e-6, atol=1e-6)
    if EXPECTED.get(family, (1.0, 1.0, None))[1:] != (1.0, None):  # the transform matters here
        assert not torch.allclose(bundle.lm_head(h), logits)


@pytest.mark.parametrize("family", ["gemma2", "granite", "falcon_h1"])
def test_kl_teacher_is_the_targets_own_distribution(family):
    """loss=kl against the HF target's own softmax (soft-capped / scaled logits), for a drafter hidden
    that is not the target's: prevents a teacher computed from the plain LM head (the reason these
    losses were refused for such targets before the drafter applied the target's logits function)."""
    bundle, dc, (_, h, logits) = _case(family)
    drafter = _drafters(bundle, dc)["train"]
    h_d = h + 0.5 * torch.randn(h.shape, generator=torch.Generator().manual_seed(2))
    labels, weight = torch.zeros(1, IDS.shape[1], dtype=torch.long), torch.ones(1, IDS.shape[1])
    sums = block_loss(h_d, bundle.lm_head.weight, labels, weight, block_size=B, kind="kl", target_hidden=h,
                      logit_scale=dc.logit_scale, logit_softcap=dc.logit_softcap)
    log_p, log_q = torch.log_softmax(logits[0], -1), torch.log_softmax(drafter.logits(h_d)[0], -1)
    slots = [k for k in range(IDS.shape[1]) if k % B]
    want = sum((log_p[k].exp() * (log_p[k] - log_q[k])).sum() for k in slots)
    torch.testing.assert_close(sums.loss_sum, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_tied_embedding_and_head_stay_one_tensor(family):
    """Gemma checkpoints tie the LM head to the embedding: the training construction keeps one tensor,
    and embedding and logits still equal the tied HF target's."""
    bundle, dc, (x0, h, logits) = _case(family, tied=True)
    assert bundle.lm_head.weight is bundle.embed_tokens.weight
    drafters = _drafters(bundle, dc)
    assert drafters["train"].lm_head_weight is drafters["train"].embed_tokens.weight
    for drafter in drafters.values():
        assert torch.equal(drafter.embed_block(IDS), x0) and torch.equal(drafter.logits(h), logits)


def test_check_fits_target_refuses_a_drafter_config_without_the_targets_functions():
    """A drafter config written before these fields (defaults 1 / None) for a Gemma 3 target is refused
    at train and eval start, naming the field and the target's value."""
    bundle, dc, _ = _case("gemma3")
    old = dc.model_copy(update={"embedding_scale": 1.0})
    with pytest.raises(ValueError, match=r"^drafter_config: embedding_scale=1.0 \(the target's: 8.0\).*init-config"):
        check_fits_target(old, bundle, "drafter_config", "regenerate it with init-config")
    check_fits_target(dc, bundle, "drafter_config", "regenerate it with init-config")


def test_run_time_check_refuses_a_target_whose_functions_are_not_read():
    """check_target_head runs the target: a wrong scale or soft-cap (what a family transforming its
    embedding or logits some unread way looks like) is refused with one line; Cohere's `logit_scale`
    is such a family (not read here, so refused rather than trained on the plain head)."""
    bundle, _, _ = _case("llama")
    check_target_head(bundle, target_head(bundle.model))
    with pytest.raises(ValueError, match="first layer does not receive embedding_scale=2"):
        check_target_head(bundle, TargetHead(embedding_scale=2.0))
    with pytest.raises(ValueError, match="logits are not the LM head's output"):
        check_target_head(bundle, TargetHead(logit_softcap=0.5))
    from transformers import AutoModelForCausalLM, CohereConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cohere = AutoModelForCausalLM.from_config(CohereConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, logit_scale=0.125, tie_word_embeddings=False, initializer_range=0.1))
    with pytest.raises(ValueError, match="^CohereForCausalLM: its logits are not"):
        check_target_head(bundle_from_model(cohere), target_head(cohere))
