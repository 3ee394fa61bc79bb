"""Measured τ during training (`tau_every`, training/tau_probe.py): when it is measured, what it
equals, and that it changes nothing about training.

Two tiny co-located CPU runs (tests/integration/tiny_run.py: random 3-layer Llama target, word-level
tokenizer), one with `tau_every=3` over 7 steps and one without, are shared by the run-level tests;
the probe-level tests use the tiny eval targets of test_eval_common.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from test_eval_common import target_and_drafter

from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.decoding.acceptance import committed_by_rounds, summarize_rounds
from dflash_trainer.decoding.engine import DecodeEngine
from tests.integration.tiny_run import make_chats, make_prepared, make_target, train_here

EVERY, STEPS, PROMPTS, NEW = 3, 7, 6, 24
TAU_SETS = (f"tau_every={EVERY}", f"tau_prompts={PROMPTS}", f"tau_max_new_tokens={NEW}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(folder, target folder, chat file, {"tau": run dir, "plain": run dir}) of the two tiny runs,
    one intra-op thread throughout (tiny decoding is op-bound; the eval below uses the same)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("tau_runs")
    target, prepared = make_target(tmp / "target"), make_prepared(tmp / "prepared")
    chats = make_chats(tmp / "chats.jsonl", 10)
    train_here(tmp / "tau", target, prepared, *TAU_SETS, f"tau_dataset={chats}", max_steps=STEPS)
    train_here(tmp / "plain", target, prepared, max_steps=STEPS)
    yield tmp, target, chats, {"tau": tmp / "tau", "plain": tmp / "plain"}
    torch.set_num_threads(n)


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_tau_records_at_every_n_steps_and_at_the_end(runs):
    """Prevents measurements at the wrong steps (or a missing end-of-run one), τ outside [1, B], and
    a summary that does not carry the last measured τ."""
    _, _, _, dirs = runs
    records = _records(dirs["tau"])
    tau = [r for r in records if "tau_measured" in r]
    assert [r["step"] for r in tau] == [3, 6, 7]
    for r in tau:
        assert math.isfinite(r["tau_measured"]) and 1.0 <= r["tau_measured"] <= 8  # B = 8 (TINY_SETS)
        assert r["tau_prompts"] == PROMPTS and 0 < r["tau_tokens"] <= PROMPTS * NEW
        assert r["tau_wall_s"] > 0 and r["tau_tokens_per_s"] > 0 and r["tau_rounds"] > 0
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))  # log records unchanged
    summary = json.loads((dirs["tau"] / "summary.json").read_text())
    assert summary["tau_measured"] == tau[-1]["tau_measured"] and summary["tau_measured_step"] == STEPS
    assert json.loads((dirs["plain"] / "summary.json").read_text())["tau_measured"] is None


def test_loss_curve_and_weights_identical_with_and_without_tau(runs):
    """Prevents a measurement that perturbs training (global RNG, optimizer state, train/eval mode,
    weights): every logged metric and the final weights are bit for bit those of the run without."""
    _, _, _, dirs = runs
    a = [r for r in _records(dirs["tau"]) if "loss" in r]
    b = _records(dirs["plain"])
    keys = ("step", "loss", "acc_per_position", "tau_estimate", "tau_exact", "tokens", "lr", "skipped_steps")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    wa = load_file(str(dirs["tau"] / "checkpoint-final" / "model.safetensors"))
    wb = load_file(str(dirs["plain"] / "checkpoint-final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (dirs["tau"], dirs["plain"]))
    assert sa["validation"]["loss"] == sb["validation"]["loss"]


def test_measured_tau_equals_eval_of_the_final_checkpoint(runs):
    """Prevents a training-time τ that drifts from `dflash-train eval` (another template, prompt
    slice, acceptance rule or bonus-token count): eval of checkpoint-final on the same prompts gives
    exactly the τ, tokens and rounds of the measurement at the last step."""
    from dflash_trainer.evaluation.run import EvalSettings, run_eval

    _, target, chats, dirs = runs
    last = [r for r in _records(dirs["tau"]) if "tau_measured" in r][-1]
    r = run_eval(EvalSettings(drafter=str(dirs["tau"]), target=str(target), dataset=str(chats), max_prompts=PROMPTS,
                              max_new_tokens=NEW, max_turns=1, batch_size=PROMPTS, offline=False, device="cpu"))
    assert r["lossless"] is True and r["num_turns"] == PROMPTS
    assert (r["tau"], r["tokens"], r["rounds"]) == (last["tau_measured"], last["tau_tokens"], last["tau_rounds"])


def test_report_and_tensorboard_show_measured_tau(runs):
    """Prevents measured-τ records that break the report or never reach its τ panel / TensorBoard."""
    from matplotlib.figure import Figure

    from dflash_trainer.telemetry.report import _tau_panel, write_report
    from dflash_trainer.telemetry.tensorboard_log import record_scalars

    _, _, _, dirs = runs
    png = write_report(dirs["tau"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = Figure().add_subplot()
    _tau_panel(ax, _records(dirs["tau"]))
    labels = [line.get_label() for line in ax.get_lines()]
    assert any(label.startswith("τ measured") for label in labels) and any("estimate" in label for label in labels)
    measured = next(line for line in ax.get_lines() if line.get_label().startswith("τ measured"))
    assert list(measured.get_xdata()) == [3, 6, 7]
    tags = dict(record_scalars(next(r for r in _records(dirs["tau"]) if "tau_measured" in r)))
    assert {"tau/measured", "tau/tokens_per_s", "tau/wall_s"} <= set(tags)


def _prompts(vocab, lengths=(5, 1, 9, 3, 12, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (L,), generator=g).tolist() for L in lengths]


def _batched_rows(bundle, drafter, prompts, new):
    """A fresh engine's speculative decoding of the prompts in the probe's (eval's) order: (tokens per row, τ)."""
    ordered = sorted(prompts, key=len)
    engine = DecodeEngine(bundle, drafter, rows=len(prompts), max_prompt_tokens=len(ordered[-1]), max_new_tokens=new,
                          eos_ids={2})
    spec = engine.decode(ordered, speculative=True)
    rounds = {str(i): a for i, a in enumerate(spec.accepted)}
    committed = {str(i): committed_by_rounds(t) for i, t in enumerate(spec.tokens)}
    return spec.tokens, summarize_rounds(rounds, committed, drafter.config.block_size)["tau"]


def _probe_rows(probe):
    return probe.last_decoded.tokens


def test_probe_reuses_its_engine_and_leaves_training_state_alone():
    """Prevents a probe that rebuilds (and leaks) caches per measurement, leaves stale state from the
    last measurement in the next one, consumes the global RNG, keeps the drafter in eval mode or
    makes gradients; its rows equal a fresh batched decode token for token."""
    from dflash_trainer.training.tau_probe import TauProbe

    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    drafter.train().requires_grad_(True)
    prompts = _prompts(12)
    rng = torch.get_rng_state()
    probe = TauProbe(bundle, drafter, prompts, max_new_tokens=20, eos_ids={2})
    assert probe.decoder is drafter  # same dtype as the target: the live module itself
    caches = (probe.engine.target.k_cache.data_ptr(), probe.engine.draft.k_ctx.data_ptr())
    first, second = probe.measure(5), probe.measure(10)
    assert torch.equal(torch.get_rng_state(), rng)
    assert drafter.training and all(p.grad is None for p in drafter.parameters())
    assert (probe.engine.target.k_cache.data_ptr(), probe.engine.draft.k_ctx.data_ptr()) == caches
    assert (first.tau, first.tokens, first.rounds) == (second.tau, second.tokens, second.rounds)
    assert (second.step, probe.last) == (10, second)
    tokens, tau = _batched_rows(bundle, drafter, prompts, 20)
    assert _probe_rows(probe) == tokens and second.tau == tau
    assert 1.0 < tau < 4  # the small vocabulary makes some drafts right, not all


def test_probe_decodes_a_copy_in_the_target_dtype_and_follows_the_weights():
    """Prevents a bf16 copy (CUDA: fp32 drafter, bf16 target) that decodes other weights than the
    live ones or goes stale: the probe equals a drafter built as eval's build_drafter builds one over
    that target (weights cast to its dtype) before and after the live weights change, and refreshes
    its copy in place (a captured round keeps its addresses)."""
    from dflash_trainer.training.tau_probe import TauProbe

    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    bundle.model.to(torch.bfloat16)
    drafter.train().requires_grad_(True)
    prompts = _prompts(12, lengths=(4, 9, 2))
    rng = torch.get_rng_state()
    probe = TauProbe(bundle, drafter, prompts, max_new_tokens=12, eos_ids={2})
    assert torch.equal(torch.get_rng_state(), rng)  # the copy's random init did not use the global RNG
    assert probe.decoder is not drafter and probe.decoder.fc.weight.dtype == torch.bfloat16
    ptr = probe.decoder.fc.weight.data_ptr()
    for scale in (1.0, 1.5):
        with torch.no_grad():
            drafter.fc.weight.mul_(scale)
        m = probe.measure(1)
        evald = DFlashDrafter(drafter.config, bundle.embed_tokens, bundle.lm_head, compile_flex=False)
        evald.load_trainable_state_dict(drafter.trainable_state_dict())
        evald = evald.to(torch.bfloat16).eval()
        tokens, tau = _batched_rows(bundle, evald, prompts, 12)
        assert _probe_rows(probe) == tokens and m.tau == tau
    assert probe.decoder.fc.weight.data_ptr() == ptr and drafter.fc.weight.dtype == torch.float32


def test_config_and_preflight_name_the_field(tmp_path):
    """Prevents bad τ settings that fail late or with a message that names no field."""
    from dflash_trainer.config.schema import TrainConfig
    from dflash_trainer.config.load import load_config
    from dflash_trainer.preflight.checks import check_train_config
    from dflash_trainer.training.checkpoint import RESUME_MUTABLE
    from dflash_trainer.training.tau_probe import load_tau_prompts

    cfg = TrainConfig()
    defaults = (cfg.tau.tau_every, cfg.tau.tau_prompts, cfg.tau.tau_max_new_tokens, cfg.tau.tau_dataset)
    assert defaults == (None, 32, 128, "sharegpt-heldout")
    assert load_tau_prompts(cfg) is None and load_tau_prompts(cfg.updated({"tau_every": 0})) is None
    for bad, field in (("tau_every=-1", "tau_every"), ("tau_prompts=0", "tau_prompts"),
                       ("tau_max_new_tokens=0", "tau_max_new_tokens")):
        with pytest.raises(ValueError, match=field):
            load_config(None, None, [bad])
    with pytest.raises(ValueError, match="tau_dataset='nope.jsonl': not a file"):
        check_train_config(load_config(None, {"device": "cpu"}, ["tau_every=5", "tau_dataset=nope.jsonl"]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"conversations": [{"from": "gpt", "value": "w5"}]}\n')
    with pytest.raises(ValueError, match="tau_dataset="):
        load_tau_prompts(load_config(None, None, ["tau_every=5", f"tau_dataset={empty}"]))
    assert {"tau.tau_every", "tau.tau_prompts", "tau.tau_max_new_tokens", "tau.tau_dataset"} <= RESUME_MUTABLE
