"""End to end per zoo family (tests/zoo.py): a drafter overfit on two memorized prompts reaches τ = B in
our eval, which stays lossless; eval refuses the stateful families with their reason. CPU, fp32.

B = 4, answers of 1 + 4·B tokens (the target's own greedy continuations), a 1-layer drafter from
init-config's config (so Gemma's √H and soft-cap, Granite's multipliers are in it), trained with
training's own step until every slot of every block is right, then `evaluate` (eval's entry point
below the CLI: render → plain and speculative decoding → compare) with the drafter built around the
target's own modules, as `eval` builds it. Falcon-H1, stateful (eval refuses it) and the one family
with both multipliers there, is checked offline instead: every slot of every block right.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dflash_trainer.decoding.acceptance import offline_acceptance
from dflash_trainer.evaluation.run import check_decodable, evaluate
from dflash_trainer.data.suites import EvalPrompt
from dflash_trainer.target_model.features import TargetFeatureExtractor
from tests.integration.overfit import overfit
from tests.zoo import family_status, supported_families, zoo_bundle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_eval_common import CHATML, word_tokenizer  # noqa: E402

B = 4
STATEFUL = {"qwen3_next": "linear_attention layers", "qwen3_5": "linear_attention layers", "lfm2": "conv layers",
            "falcon_h1": "layers (FalconH1Mixer"}
DECODABLE = [f for f in supported_families() if f not in STATEFUL]
CANDIDATES = [EvalPrompt(id=f"p{i}", user_turns=[" ".join(f"w{(7 * i + 3 * j) % 90 + 5}" for j in range(5))])
              for i in range(12)]



@pytest.mark.parametrize("family", DECODABLE)
def test_overfit_drafter_reaches_tau_b_in_eval(family, one_thread):
    """Prevents a drafter that trains on one embedding or logits function and drafts with another (Gemma's
    √H applied twice or never, a soft-cap in one path only), features or masks that differ between
    training and decoding for the family, and a lossy verify: memorized answers are accepted in full."""
    bundle = zoo_bundle(family)
    bundle.tokenizer = word_tokenizer(100)  # 100 tokens over 128 rows: init-config's mask is row 100
    fit = overfit(bundle, CHATML, CANDIDATES, block_size=B)
    r = evaluate(bundle, fit.drafter, fit.prompts, chat_template=CHATML, max_new_tokens=fit.max_new_tokens,
                 offline=False)
    print(f"{family}: {fit.steps} steps, τ = {r['tau']}")
    assert r["lossless"] is True and r["mismatches"] == []
    assert r["tau"] == B and r["rounds"] == 2 * (fit.max_new_tokens - 1) // B, (family, fit.steps, r["tau"])


@pytest.mark.parametrize("family", sorted(STATEFUL))
def test_eval_refuses_stateful_families_with_the_reason(family):
    """Speculative decoding crops rejected drafts from the KV cache, which cannot undo a recurrent state or
    a convolution window: eval refuses these families with one line naming the layers and the way out."""
    with pytest.raises(ValueError) as e:
        check_decodable(family_status(family))
    text = str(e.value)
    assert text.startswith("eval: ") and STATEFUL[family] in text and "offline τ of train's validation" in text


def test_stateful_family_with_multipliers_overfits_offline(one_thread):
    """Falcon-H1 (embedding and LM-head multipliers; one target forward per document): the overfit drafter
    gets every slot of every memorized block right in train's offline measure (eval refuses the family)."""
    bundle = zoo_bundle("falcon_h1")
    bundle.tokenizer = word_tokenizer(100)
    fit = overfit(bundle, CHATML, CANDIDATES, block_size=B)
    extractor = TargetFeatureExtractor(bundle, fit.drafter.config.target_layer_ids)
    off = offline_acceptance(fit.drafter, extractor, fit.sequences, block_size=B)
    print(f"falcon_h1: {fit.steps} steps, offline {off}")
    assert off["acc_per_position"] == [1.0] * (B - 1) and off["tau_estimate"] == B
