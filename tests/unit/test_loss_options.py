"""Loss options (per-slot loss ce | kl | ce_kl, weights decay | dpace | cat) against a plain float64
loop, hand-worked D-PACE and CAT weights, and data-parallel invariance of the sums.

Shapes: R rows, N anchors, B block size, Q = N·B, H hidden, V vocabulary; slot k of block j is q = j·B + k.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflash_trainer.drafter.loss import block_loss
from dflash_trainer.drafter.weights import cat_weights, decay_weights, dpace_weights, needs_target_hidden

KINDS = ("ce", "kl", "ce_kl")
WEIGHTS = ("decay", "dpace", "cat")


def random_case(seed: int, r: int = 2, n: int = 5, b: int = 5, h: int = 6, v: int = 13):
    """Odd sizes; invalid slots: slot 0, a hole inside a block (slot 2 of block 1 in row 0), a block's
    tail (slots 3, 4 of block 3 in row 1) and a fully invalid block (block 4 of row 0)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(r, n * b, h, generator=g)
    target_hidden = torch.randn(r, n * b, h, generator=g)
    head = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (r, n * b), generator=g)
    valid = torch.ones(r, n * b, dtype=torch.bool)
    valid[:, ::b] = False
    valid[0, 1 * b + 2] = False
    valid[1, 3 * b + 3:3 * b + 5] = False
    valid[0, 4 * b:5 * b] = False
    k = torch.arange(n * b) % b
    loss_weight = torch.where(valid, decay_weights(b, 2.5)[k], 0.0)
    labels = torch.where(valid, labels, -100)  # invalid labels must never be read
    return hidden, target_hidden, head, labels, valid, loss_weight


def reference(hidden, target_hidden, head, labels, valid, loss_weight, b, kind, position_weights,
              alpha=0.5, denominator="blocks", ce_w=0.1, kl_w=1.0):
    """Plain float64 recomputation, one slot at a time. Returns (loss_sum [differentiable w.r.t. the
    returned hidden64], weight_sum, hidden64). Weights use Python floats, so they carry no gradient."""
    h64 = hidden.double().clone().requires_grad_(True)
    t64, head64 = target_hidden.double(), head.double()
    r, q, _ = hidden.shape
    loss, wsum, blocks_with_valid = torch.zeros((), dtype=torch.float64), 0.0, 0
    for ri in range(r):
        for j in range(q // b):
            slots = [k for k in range(1, b) if valid[ri, j * b + k]]
            blocks_with_valid += bool(slots)
            terms, conf, tprob = {}, {}, {}
            for k in slots:
                i = j * b + k
                logp = torch.log_softmax(head64 @ h64[ri, i], 0)
                tlogp = torch.log_softmax(head64 @ t64[ri, i], 0)
                ce = -logp[labels[ri, i]]
                kl = (tlogp.exp() * (tlogp - logp)).sum()
                terms[k] = {"ce": ce, "kl": kl, "ce_kl": ce_w * ce + kl_w * kl}[kind]
                conf[k] = math.exp(-float(ce.detach()))
                tprob[k] = math.exp(float(tlogp[labels[ri, i]]))
            w = {}
            if position_weights == "decay":
                w = {k: float(loss_weight[ri, j * b + k]) for k in slots}
            elif position_weights == "dpace":
                prefix, running = {}, 1.0
                for k in slots:
                    running *= (1 - alpha) * conf[k] + alpha
                    prefix[k] = running
                w = {k: sum(prefix[m] for m in slots if m >= k) for k in slots}
            else:
                running = 1.0
                for k in slots:
                    w[k] = running
                    running *= tprob[k]
            for k in slots:
                loss = loss + w[k] * terms[k]
                wsum += w[k]
    if position_weights == "dpace" and denominator == "blocks":
        wsum = float(blocks_with_valid)
    return loss, wsum, h64


@pytest.mark.parametrize("kind,position_weights,chunk", list(itertools.product(KINDS, WEIGHTS, (None, 7))))
def test_options_match_plain_float64_loop(kind, position_weights, chunk):
    """Every (loss, weights) pair, one chunk and chunks of 7 slots (recomputed in backward), equals a
    slot-by-slot float64 loop in loss, denominator and gradient: catches a weight from the wrong slot,
    an invalid slot leaking into a product, a D-PACE weight carrying gradient, a chunk splitting a block."""
    hidden, target_hidden, head, labels, valid, loss_weight = random_case(1)
    b = 5
    hid = hidden.clone().requires_grad_(True)
    s = block_loss(hid, head, labels, loss_weight, block_size=b, kind=kind, target_hidden=target_hidden,
                   slot_valid=valid, chunk_size=chunk, compiled=False, position_weights=position_weights,
                   dpace_alpha=0.3, ce_weight=0.25, kl_weight=0.75)
    ref, ref_w, h64 = reference(hidden, target_hidden, head, labels, valid, loss_weight, b, kind, position_weights,
                                alpha=0.3, ce_w=0.25, kl_w=0.75)
    assert s.loss_sum.item() == pytest.approx(ref.item(), rel=1e-5)
    assert s.weight_sum.item() == pytest.approx(ref_w, rel=1e-6)
    s.loss_sum.backward()
    ref.backward()
    torch.testing.assert_close(hid.grad, h64.grad.float(), rtol=1e-4, atol=1e-6)
    assert hid.grad[0, 4 * b:].abs().max() == 0 and hid.grad[:, ::b].abs().max() == 0


def test_dpace_weight_sum_denominator_matches_loop():
    """dpace_denominator='weights' divides by Σ w (the TorchSpec reduction); 'blocks' by the valid blocks."""
    hidden, target_hidden, head, labels, valid, loss_weight = random_case(2)
    by_w = block_loss(hidden, head, labels, loss_weight, block_size=5, slot_valid=valid, position_weights="dpace",
                      dpace_denominator="weights", chunk_size=4)
    by_b = block_loss(hidden, head, labels, loss_weight, block_size=5, slot_valid=valid, position_weights="dpace")
    ref, ref_w, _ = reference(hidden, target_hidden, head, labels, valid, loss_weight, 5, "ce", "dpace",
                              denominator="weights")
    assert by_w.weight_sum.item() == pytest.approx(ref_w, rel=1e-6)
    assert by_w.loss_sum.item() == pytest.approx(ref.item(), rel=1e-5)
    assert by_b.weight_sum.item() == 2 * 5 - 1  # ten blocks, one fully invalid
    torch.testing.assert_close(by_b.loss_sum, by_w.loss_sum)


def test_dpace_weights_hand_worked():
    """α = 0.5, confidences (0.8, 0.4, 0.6): q̃ = (0.9, 0.7, 0.8), prefix products (0.9, 0.63, 0.504),
    suffix sums w = (2.034, 1.134, 0.504). With the middle slot invalid it counts as q̃ = 1 and gets
    weight 0: prefix (0.9, ·, 0.72), w = (1.62, 0, 0.72). α = 1 ignores confidence: w_k = valid slots ≥ k."""
    conf = torch.tensor([[0.8, 0.4, 0.6], [0.8, 0.123, 0.6]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    w = dpace_weights(conf, valid, 0.5)
    torch.testing.assert_close(w, torch.tensor([[2.034, 1.134, 0.504], [1.62, 0.0, 0.72]]))
    torch.testing.assert_close(dpace_weights(conf, valid, 1.0), torch.tensor([[3.0, 2.0, 1.0], [2.0, 0.0, 1.0]]))
    assert not dpace_weights(conf.requires_grad_(True), valid, 0.5).requires_grad
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="dpace_alpha"):
            dpace_weights(conf, valid, bad)


def test_cat_weights_hand_worked():
    """Target probabilities of the labels (0.5, 0.8, 0.9): slot 1 gets 1, slot 2 gets 0.5, slot 3 0.5·0.8.
    An invalid slot is skipped in the product (factor 1) and weighs 0 itself."""
    p = torch.tensor([[0.5, 0.8, 0.9], [0.5, 0.01, 0.9]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    torch.testing.assert_close(cat_weights(p, valid), torch.tensor([[1.0, 0.5, 0.4], [1.0, 0.0, 0.5]]))


@pytest.mark.parametrize("kind,position_weights", [("ce", "decay"), ("ce", "dpace"), ("kl", "dpace"),
                                                   ("ce_kl", "cat"), ("ce", "cat")])
def test_half_batches_sum_to_the_whole_batch(kind, position_weights):
    """Data-parallel invariance: each row's sums depend on that row only, so two ranks holding one row
    each sum (loss, denominator, counts) to the one-rank batch; the global division then gives the
    same loss however rows are split (per-rank normalization would not)."""
    hidden, target_hidden, head, labels, valid, loss_weight = random_case(3)
    kw = dict(block_size=5, kind=kind, position_weights=position_weights, chunk_size=6)
    whole = block_loss(hidden, head, labels, loss_weight, target_hidden=target_hidden, slot_valid=valid, **kw)
    parts = [block_loss(hidden[i:i + 1], head, labels[i:i + 1], loss_weight[i:i + 1],
                        target_hidden=target_hidden[i:i + 1], slot_valid=valid[i:i + 1], **kw) for i in range(2)]
    for f in ("loss_sum", "weight_sum"):
        torch.testing.assert_close(getattr(parts[0], f) + getattr(parts[1], f), getattr(whole, f), rtol=1e-6, atol=0)
    for f in ("correct", "count", "run_length_sum", "num_blocks"):
        assert torch.equal(getattr(parts[0], f) + getattr(parts[1], f), getattr(whole, f)), f


def test_metrics_do_not_depend_on_the_loss_option():
    """Accuracy, counts and runs are the argmax against the label whatever the loss and weights."""
    hidden, target_hidden, head, labels, valid, loss_weight = random_case(4)
    base = block_loss(hidden, head, labels, loss_weight, block_size=5, slot_valid=valid)
    for kind, pw in itertools.product(KINDS, WEIGHTS):
        s = block_loss(hidden, head, labels, loss_weight, block_size=5, slot_valid=valid, kind=kind,
                       position_weights=pw, target_hidden=target_hidden)
        for f in ("correct", "count", "run_length_sum", "num_blocks"):
            assert torch.equal(getattr(s, f), getattr(base, f)), (kind, pw, f)


def test_block_loss_rejects_bad_options():
    """Unknown options and missing inputs fail with the argument's name instead of training on garbage."""
    hidden, target_hidden, head, labels, valid, loss_weight = random_case(5)
    kw = dict(block_size=5, slot_valid=valid)
    with pytest.raises(ValueError, match="kind"):
        block_loss(hidden, head, labels, loss_weight, kind="tv", **kw)
    with pytest.raises(ValueError, match="position_weights"):
        block_loss(hidden, head, labels, loss_weight, position_weights="exp", **kw)
    with pytest.raises(ValueError, match="dpace_denominator"):
        block_loss(hidden, head, labels, loss_weight, position_weights="dpace", dpace_denominator="tokens", **kw)
    with pytest.raises(ValueError, match="target_hidden"):
        block_loss(hidden, head, labels, loss_weight, position_weights="cat", **kw)
    with pytest.raises(ValueError, match="target_hidden"):
        block_loss(hidden, head, labels, loss_weight, kind="ce_kl", **kw)
    with pytest.raises(ValueError, match="ce_weight"):
        block_loss(hidden, head, labels, loss_weight, kind="ce_kl", ce_weight=0.0, kl_weight=0.0,
                   target_hidden=target_hidden, **kw)


def test_needs_target_hidden():
    """The target's final states are shipped exactly when the KL term or CAT weights read them."""
    assert not needs_target_hidden("ce", "decay") and not needs_target_hidden("ce", "dpace")
    assert needs_target_hidden("kl", "decay") and needs_target_hidden("ce_kl", "dpace")
    assert needs_target_hidden("ce", "cat")


def test_config_fields_defaults_errors_and_round_trip(tmp_path):
    """Objective fields: the defaults (CE with D-PACE weights, the best measured), bad values fail
    naming the field and the fix, the resolved config round-trips through train_config.json (its
    paths written relative to OUT, `restore_config` joins them back onto the folder), and a
    flat config of an earlier release is refused on resume (naming the fix), and a changed objective
    is refused."""
    import json

    from dflash_trainer.config.schema import TrainConfig, flat_config, restore_config, saved_config
    from dflash_trainer.config.load import dump_config, load_config
    from dflash_trainer.training.checkpoint import check_resumable

    cfg = load_config()
    assert (cfg.loss.kind, cfg.loss.position_weights, cfg.experimental.feature_dropout, cfg.experimental.feature_dropout_unit) == ("ce", "dpace", 0.0,
                                                                                                "document")
    for bad, field in (("position_weights=exp", "position_weights"), ("dpace_alpha=0", "dpace_alpha"),
                       ("dpace_alpha=1.5", "dpace_alpha"), ("feature_dropout=1", "feature_dropout"),
                       ("feature_dropout=-0.1", "feature_dropout"), ("loss.kind=tv", "loss.kind"),
                       ("loss_ce_weight=-1", "loss_ce_weight"), ("feature_dropout_unit=token", "feature_dropout_unit"),
                       ("dpace_denominator=tokens", "dpace_denominator")):
        with pytest.raises(ValueError, match=field):
            load_config(sets=[bad])
    with pytest.raises(ValueError, match="loss_ce_weight=0 and loss_kl_weight=0"):
        load_config(sets=["loss.kind=ce_kl", "loss_ce_weight=0", "loss_kl_weight=0"])
    (tmp_path / "data").mkdir()
    chosen = load_config(sets=["loss.kind=ce_kl", "position_weights=cat", "feature_dropout=0.1", f"out={tmp_path}",
                               f"prepared={tmp_path / 'data'}", "chats=../chats.jsonl"])
    dump_config(chosen, tmp_path / "train_config.json")
    written = json.loads((tmp_path / "train_config.json").read_text())
    assert (written["out"], written["data"]["prepared"], written["data"]["chats"]) == (".", "data", "../chats.jsonl")
    assert restore_config(written, tmp_path) == chosen  # the reader restores what was saved relative to OUT
    assert TrainConfig(**{k: v for k, v in written.items() if k != "format_version"}) != chosen  # not as written
    old = {k: v for k, v in flat_config(TrainConfig().model_dump()).items() if k != "loss.position_weights"}
    old = {k.rpartition(".")[2]: v for k, v in old.items()}  # the flat config of earlier releases
    with pytest.raises(ValueError, match=r"holds a flat config of an earlier release .*start a new --out, or pass "
                                         r"--set runtime.resume=never"):  # never resumed under guessed defaults
        check_resumable({"config": old}, TrainConfig(position_weights="decay").model_dump(), tmp_path, "colocated")
    check_resumable({"config": saved_config(cfg)}, cfg.model_dump(), tmp_path, "colocated")
    with pytest.raises(ValueError, match="loss.position_weights: 'dpace' → 'cat'"):  # a changed objective is not resumed silently
        check_resumable({"config": saved_config(cfg)}, chosen.model_dump(), tmp_path, "colocated")


def test_config_warns_about_ignored_settings():
    """A setting the others make irrelevant is named in a warning rather than silently dropped."""
    from dflash_trainer.config.load import load_config

    with pytest.warns(UserWarning, match="gamma is ignored"):
        load_config(sets=["gamma=3"])  # the default weights are D-PACE's
    with pytest.warns(UserWarning, match="dpace_alpha is ignored"):
        load_config(sets=["position_weights=decay", "dpace_alpha=0.3"])
    with pytest.warns(UserWarning, match="loss_kl_weight is ignored"):
        load_config(sets=["loss_kl_weight=2"])


def test_step_settings_and_target_outputs_follow_the_config():
    """run.step_settings carries every objective field, and the target is asked for its final hidden
    states exactly when the objective reads them (co-located feed and the process layout's wire)."""
    from types import SimpleNamespace

    from dflash_trainer.config.load import load_config
    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.training.feed import extract
    from dflash_trainer.pipeline.rank_context import wire_spec
    from dflash_trainer.training.run import step_settings

    dc = DrafterConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, vocab_size=32, block_size=8, mask_token_id=31,
                       target_layer_ids=[0, 1], num_target_layers=2)
    cfg = load_config(sets=["loss.kind=ce_kl", "loss_ce_weight=0.2", "loss_kl_weight=0.9", "position_weights=dpace",
                            "dpace_alpha=0.4", "dpace_denominator=weights", "feature_dropout=0.1",
                            "feature_dropout_unit=position"])
    s = step_settings(cfg, dc, torch.device("cpu"))
    assert (s.loss, s.loss_ce_weight, s.loss_kl_weight, s.position_weights, s.dpace_alpha, s.dpace_denominator,
            s.feature_dropout, s.feature_dropout_unit) == ("ce_kl", 0.2, 0.9, "dpace", 0.4, "weights", 0.1, "position")
    layout = SimpleNamespace(rows_per_drafter=1)
    rows = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "position_ids": torch.arange(4)[None]}
    for sets, wanted in ((["position_weights=cat"], True), (["position_weights=dpace"], False), ([], False),
                         (["loss.kind=kl"], True)):
        c = load_config(sets=sets)
        asked = {}
        extract(lambda *a, **kw: asked.update(kw), rows, step_settings(c, dc, torch.device("cpu")))
        assert asked["need_last_hidden"] is wanted, sets
        assert wire_spec(c, layout, dc, 8, torch.float32).need_last_hidden is wanted, sets


def test_bench_step_trains_the_training_default_objective():
    """Prevents `bench step` (no --config) timing another objective than `train` trains by default:
    its settings are those `run.step_settings` gives a default TrainConfig at the same shapes, and a
    StepSettings built without a config has TrainConfig's objective defaults (D-PACE, not decay)."""
    import dataclasses

    import torch

    from dflash_trainer.bench.common import BenchShape
    from dflash_trainer.bench.step import bench_step
    from dflash_trainer.bench.step_rig import rig_from_shape
    from dflash_trainer.config.schema import FIELD_SECTION, SECTIONS, TrainConfig
    from dflash_trainer.training.run import step_settings
    from dflash_trainer.training.step import StepSettings

    cpu = torch.device("cpu")
    shape = BenchShape(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       vocab_size=128, num_target_layers=6, num_target_features=2, seq_len=256, num_documents=2,
                       num_anchors=16, block_size=8, layer_types="full")
    cfg = TrainConfig(seq_len=shape.seq_len, num_anchors=shape.num_anchors, block_size=shape.block_size,
                      num_layers=shape.num_layers, device="cpu")
    trained = step_settings(cfg, shape.drafter_config(), cpu)
    bench = rig_from_shape(shape, cpu).settings
    assert (bench.position_weights, bench.loss) == (trained.position_weights, trained.loss) == ("dpace", "ce")
    assert bench == trained  # every field: anchors, γ, labels, the loss and its weights, dropout, mask path
    fields = {"no_target_features": "zero_features"}  # TrainConfig name → StepSettings name where they differ
    plain = dataclasses.asdict(StepSettings(num_anchors=1, gamma=1.0))
    fields["kind"] = "loss"
    for name in ("label_source", "kind", "per_document_quota", "loss_chunk", "no_target_features", "position_weights",
                 "dpace_alpha", "dpace_denominator", "loss_ce_weight", "loss_kl_weight", "feature_dropout",
                 "feature_dropout_unit", "loss_impl"):
        assert plain[fields.get(name, name)] == SECTIONS[FIELD_SECTION[name]].model_fields[name].default, name
    result = bench_step(shape, cpu, warmup=0, iters=1, profile_steps=0)
    assert (result["loss"], result["position_weights"], result["label_source"]) == ("ce", "dpace", "target")
