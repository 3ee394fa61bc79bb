"""`dflash-train config` (every TrainConfig field with type, default, description, grouped), the
unknown-key suggestions (spelling and other trainers' names) and `dflash-train --version`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from dflash_trainer.cli.main import app
from dflash_trainer.cli.info import render_table
from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.config.load import load_config
from dflash_trainer.config.fields import SYNONYMS, field_groups, field_rows, suggest_fields

CONFIG_SOURCE = Path(__file__).resolve().parents[2] / "src" / "dflash_trainer" / "config" / "schema.py"


def test_json_lists_every_field_in_class_order_with_its_group():
    """Prevents a field missing from `config` (a new field added to TrainConfig but not shown) and
    groups that differ from the `# --- group ---` comments of the class."""
    result = CliRunner().invoke(app, ["config", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert [r["name"] for r in body] == list(TrainConfig.model_fields)
    headers = [h.split(" (")[0] for h in re.findall(r"# --- (.+?) ---", CONFIG_SOURCE.read_text())]
    assert list(dict.fromkeys(r["group"] for r in body)) == headers
    assert set(field_groups()) == set(TrainConfig.model_fields)
    for r in body:
        assert r["description"] and r["type"], r
        assert r["default"] == TrainConfig.model_fields[r["name"]].default
    by_name = {r["name"]: r for r in body}
    assert by_name["lr"]["group"] == "optimization" and by_name["lr"]["type"] == "float, > 0"
    assert by_name["label_source"]["type"] == "target | data"
    assert by_name["target_layer_ids"]["type"] == "list[int] | None"


def test_plain_output_is_a_config_file_with_the_defaults(tmp_path):
    """Prevents the piped output (`dflash-train config > my.yaml`) from being a file `--config`
    refuses or one that changes a setting."""
    result = CliRunner().invoke(app, ["config"])
    assert result.exit_code == 0, result.output
    assert "# --- optimization ---" in result.output and "Peak AdamW learning rate" in result.output
    path = tmp_path / "all.yaml"
    path.write_text(result.output)
    assert set(yaml.safe_load(path.read_text())) == set(TrainConfig.model_fields)
    assert load_config(str(path)) == TrainConfig()


def test_resolved_values_and_filter():
    """Prevents `config --set` showing the defaults instead of what a run would use."""
    result = CliRunner().invoke(app, ["config", "learning_rate", "--set", "lr=1e-3", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body[0]["name"] == "lr" and body[0]["value"] == 1e-3 and body[0]["default"] == 6e-4


def test_table_shows_every_field_and_bracketed_text():
    """Prevents rich markup eating `[int]` or `[T,T]` in the terminal table."""
    console = Console(force_terminal=True, width=200, color_system=None, record=True)
    render_table(field_rows(), console)
    text = console.export_text()
    for name in TrainConfig.model_fields:
        assert name in text
    assert "list[int] | None" in text and "dense [T,T] mask" in text


@pytest.mark.parametrize("key,field", [
    ("learning_rate", "lr"), ("batch_size", "rows_per_step"), ("steps", "max_steps"), ("num_steps", "max_steps"),
    ("train_steps", "max_steps"), ("num_draft_layers", "num_layers"), ("draft_layers", "num_layers"),
    ("block", "block_size"), ("draft_length", "block_size"), ("warmup", "warmup_ratio"),
    ("warmup_steps", "warmup_ratio"), ("max_seq_len", "seq_len"), ("seq_length", "seq_len"),
    ("max_length", "seq_len"), ("anchors", "num_anchors"), ("epochs_num", "epochs"), ("grad_norm", "grad_clip"),
    ("max_grad_norm", "grad_clip"), ("wd", "weight_decay"), ("output_dir", "out"), ("model", "target"),
    ("target_model", "target"), ("dataset", "data"), ("train_data", "data"), ("Learning-Rate", "lr"),
    ("seqlen", "seq_len"), ("learning_rat", "lr"), ("num_layer", "num_layers"),
])
def test_suggestions_by_synonym_and_spelling(key, field):
    """Prevents `--set learning_rate=…` answering with no hint (difflib alone finds nothing)."""
    assert suggest_fields(key)[0] == field


def test_every_synonym_names_a_field():
    """Prevents a renamed field leaving synonyms that suggest a field that no longer exists."""
    assert set(SYNONYMS.values()) <= set(TrainConfig.model_fields)
    assert not set(SYNONYMS) & set(TrainConfig.model_fields)


def test_unknown_set_and_yaml_keys_name_the_source_suggest_and_point_to_config(tmp_path):
    """Prevents an unknown key error that names neither where the key came from nor the command
    listing the fields."""
    with pytest.raises(ValueError) as e:
        load_config(None, None, ["learning_rate=1e-3"])
    msg = str(e.value)
    assert "--set: 'learning_rate' is not a config field, did you mean lr?" in msg
    assert msg.endswith("`dflash-train config` lists every field with its type, default and description.")
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: 4\nmax_seq_len: 256\n")
    with pytest.raises(ValueError) as e:
        load_config(str(bad))
    msg = str(e.value)
    assert f"--config {bad}: 'batch_size' is not a config field, did you mean rows_per_step" in msg
    assert "'max_seq_len' is not a config field, did you mean seq_len" in msg
    assert msg.endswith("`dflash-train config` lists every field with its type, default and description.")


def test_version():
    """Prevents `--version` being unknown (a newcomer's first check of what is installed)."""
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert re.match(r"dflash-trainer \d+\.\d+\.\d+ \(torch \S+, transformers \S+, python \S+\)", result.output)
