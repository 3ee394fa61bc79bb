"""One home for the drafter's shape: the config's drafter section holds the defaults (the paper's
5 layers, B = 16) and every shape rule; init-config's flags default from it; the mask builders only
assert; `make train` keeps its 3-layer, B = 8 drafter explicitly."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_trainer.cli.main import app
from dflash_trainer.config.load import load_config
from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.config.sections import DrafterSection, check_flex_tiles
from dflash_trainer.drafter.shape import shape_from_flags

ROOT = Path(__file__).resolve().parents[2]


def test_the_section_holds_the_papers_shape_and_init_config_defaults_from_it():
    """Prevents a second set of shape defaults (init-config's options, DrafterConfig) drifting from
    the config's."""
    import inspect

    from dflash_trainer.cli.main import init_config_cmd
    from dflash_trainer.drafter.config import DrafterConfig

    section = DrafterSection()
    assert (section.num_layers, section.block_size, section.layer_types) == (5, 16, "full")
    assert (TrainConfig().drafter.num_layers, TrainConfig().drafter.block_size) == (5, 16)
    params = inspect.signature(init_config_cmd).parameters
    for name in ("num_layers", "block_size", "layer_types", "num_target_features"):
        assert params[name].default == DrafterSection.model_fields[name].default, name
    assert DrafterConfig.model_fields["num_hidden_layers"].is_required()
    assert DrafterConfig.model_fields["block_size"].is_required()
    shape, notes = shape_from_flags()
    assert shape == DrafterSection() and notes == []


@pytest.mark.parametrize("sets, message", [
    (["drafter.block_size=10"], "block_size=10 must divide 128"),
    (["drafter.layer_types=swa,full"], "layer_types: 2 entries for num_layers=5"),
    (["drafter.layer_types=bogus"], "unknown entry 'bogus'"),
    (["drafter.layer_types=last-full"], "sliding_window: required when a layer slides"),
    (["drafter.target_layer_ids=[3,1]"], "ids must be in ascending order"),
    (["drafter.target_layer_ids=[-1,2]"], "ids [-1] lie outside"),
    (["runtime.device=cuda", "loss.num_anchors=36"], "loss.num_anchors × drafter.block_size = 36 × 16 = 576"),
])
def test_every_shape_rule_is_the_configs(sets, message):
    """Prevents a shape that fails only at the first GPU mask build (or after the target loads)."""
    with pytest.raises(ValueError) as e:
        load_config(sets=sets)
    assert message in str(e.value)


def test_flex_tiles_rule_names_a_fix():
    check_flex_tiles(32, 16)
    with pytest.raises(ValueError, match=r"use a multiple of 8 anchors, e.g. num_anchors=32"):
        check_flex_tiles(36, 16)


def test_init_config_refuses_a_block_size_that_cannot_train_before_loading(tmp_path):
    """Prevents init-config writing a config (B = 10) that only fails when training builds its masks:
    refused before the target is read (the target does not even exist here)."""
    out = tmp_path / "d.json"
    r = CliRunner().invoke(app, ["init-config", "--out", str(out), "--target", str(tmp_path / "nowhere"),
                                 "--block-size", "10"])
    assert r.exit_code == 2, r.output
    assert "block_size=10 must divide 128" in " ".join(r.output.split()) and not out.exists()


def test_a_drafter_config_file_is_held_to_the_same_rules_before_loading(tmp_path):
    """Prevents a drafter config file whose B cannot tile (hand-written, or an older init-config's)
    passing the pre-flight and failing at the first mask build."""
    from dflash_trainer.preflight.checks import check_drafter_config_shape

    body = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=128, block_size=10, mask_token_id=100,
                target_layer_ids=[1, 2], num_target_layers=4, layer_types=["full_attention"] * 2)
    path = tmp_path / "drafter.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=r"drafter_config=.*block_size=10 must divide 128.*init-config"):
        check_drafter_config_shape(load_config(sets=[f"drafter.drafter_config={path}"]))
    path.write_text(json.dumps({**body, "block_size": 16}))
    check_drafter_config_shape(load_config(sets=[f"drafter.drafter_config={path}"]))
    with pytest.raises(ValueError, match="36 × 16 = 576"):
        check_drafter_config_shape(load_config(sets=[f"drafter.drafter_config={path}", "loss.num_anchors=36"])
                                   .updated({"device": "cuda"}))


def test_init_config_notes_the_window_it_fills_in():
    shape, notes = shape_from_flags(num_layers=3, layer_types="last-full")
    assert shape.sliding_window == 2048 and "default window 2048" in notes[0]
    shape, notes = shape_from_flags(sliding_window=64)
    assert shape.sliding_window is None and "ignored: no layer slides" in notes[0]


def test_make_train_keeps_its_three_layer_b8_drafter():
    """Prevents `make train` silently training the paper's shape, or all of ShareGPT, now that those are
    the defaults: the Makefile's command resolves to the former default config (3 layers, B = 8, 600
    conversations, 160 steps), field for field: `make train` runs `default-run`, whose CPU choice is that command."""
    from dflash_trainer.cli.default_run import choose_default_run

    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("\t$(BIN)/dflash-train default-run"))
    assert shlex.split(line)[1:] == ["default-run", "--out", "$(OUT)"]
    args = choose_default_run("runs/default", None).argv
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    config = next((str(ROOT / args[i + 1]) for i, a in enumerate(args) if a == "--config"), None)
    cfg = load_config(config, {"out": "runs/default"}, sets)
    assert (cfg.drafter.num_layers, cfg.drafter.block_size) == (3, 8)
    assert cfg == TrainConfig(num_layers=3, block_size=8, max_conversations=600, max_steps=160)
    assert "`--num-layers 3 --block-size 8` is the smoke run's" in (ROOT / "README.md").read_text()
