"""`dflash-train config` (every TrainConfig setting with type, default, description, by section), the
unknown-key suggestions (spelling, other trainers' names, renamed fields) and `dflash-train --version`."""

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
from dflash_trainer.config.schema import FIELD_SECTION, RENAMED, SECTIONS, TrainConfig, flat_config, resolve_key
from dflash_trainer.config.load import load_config
from dflash_trainer.config.fields import SYNONYMS, field_groups, field_rows, setting_names, suggest_fields


def test_json_lists_every_field_in_class_order_with_its_section():
    """Prevents a field missing from `config` (a new field added to a section but not shown) and
    sections that differ from TrainConfig's."""
    result = CliRunner().invoke(app, ["config", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert [r["name"] for r in body] == setting_names() == list(flat_config(TrainConfig().model_dump()))
    assert list(dict.fromkeys(r["group"] for r in body)) == ["", *SECTIONS]
    assert set(field_groups()) == set(setting_names())
    for r in body:
        assert r["description"] and r["type"], r
        section, _, field = r["name"].rpartition(".")
        assert r["default"] == (SECTIONS[section] if section else TrainConfig).model_fields[field].default
    by_name = {r["name"]: r for r in body}
    assert by_name["optim.lr"]["group"] == "optim" and by_name["optim.lr"]["type"] == "float, > 0"
    assert by_name["loss.label_source"]["type"] == "target | data"
    assert by_name["drafter.target_layer_ids"]["type"] == "list[int] | None"


def test_field_names_are_unique_and_none_repeats_its_section():
    """Prevents a bare `--set name=…` that could mean two settings, and `target.target`-style names."""
    names = [f for model in SECTIONS.values() for f in model.model_fields]
    assert len(names) == len(set(names)) == len(FIELD_SECTION)
    assert not set(names) & set(SECTIONS) and "out" not in names
    assert {RENAMED[k] for k in ("target", "data", "loss")} == {"target.path", "data.chats", "loss.kind"}


def test_plain_output_is_a_nested_config_file_with_the_defaults(tmp_path):
    """Prevents the piped output (`dflash-train config > my.yaml`) from being a file `--config`
    refuses or one that changes a setting."""
    result = CliRunner().invoke(app, ["config"])
    assert result.exit_code == 0, result.output
    assert "\noptim:\n" in result.output and "Peak AdamW learning rate" in result.output
    path = tmp_path / "all.yaml"
    path.write_text(result.output)
    body = yaml.safe_load(path.read_text())
    assert set(body) == {"out", *SECTIONS} and set(body["optim"]) == set(SECTIONS["optim"].model_fields)
    assert load_config(str(path)) == TrainConfig()


def test_section_filter_shows_one_section():
    """Prevents `dflash-train config optim` matching words instead of listing the section."""
    result = CliRunner().invoke(app, ["config", "optim", "--json"])
    assert result.exit_code == 0, result.output
    assert [r["name"] for r in json.loads(result.output)] == [f"optim.{f}" for f in SECTIONS["optim"].model_fields]


def test_nested_flat_and_dotted_inputs_resolve_alike(tmp_path):
    """Prevents a bare unique field name, a `section.field` key, a nested YAML file and a flat YAML
    key resolving to different configs; a flag and --set layer over a file setting by setting."""
    nested = tmp_path / "nested.yaml"
    nested.write_text("optim:\n  lr: 0.001\n  max_steps: 7\ndata:\n  seq_len: 1024\n")
    flat = tmp_path / "flat.yaml"
    flat.write_text("lr: 0.001\nmax_steps: 7\nseq_len: 1024\n")
    want = load_config(sets=["optim.lr=1e-3", "max_steps=7", "data.seq_len=1024"])
    assert load_config(str(nested)) == load_config(str(flat)) == want
    assert (want.optim.lr, want.optim.max_steps, want.data.seq_len) == (1e-3, 7, 1024)
    both = load_config(str(nested), {"optim.max_steps": 9}, ["optim.warmup_ratio=0.1"])
    assert (both.optim.lr, both.optim.max_steps, both.optim.warmup_ratio) == (1e-3, 9, 0.1)
    assert all(resolve_key(k.rpartition(".")[2]) == k for k in setting_names())


@pytest.mark.parametrize("old, new", [("target", "target.path"), ("data", "data.chats"), ("loss", "loss.kind")])
def test_a_renamed_field_suggests_its_new_name(old, new):
    """Prevents `--set target=…` (the flat name of earlier releases) failing without the new name."""
    with pytest.raises(ValueError, match=rf"--set: '{old}' is a section of the config, not a field, did you mean {new}\?"):
        load_config(sets=[f"{old}=x"])


def test_resolved_values_and_filter():
    """Prevents `config --set` showing the defaults instead of what a run would use."""
    result = CliRunner().invoke(app, ["config", "learning_rate", "--set", "optim.lr=1e-3", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body[0]["name"] == "optim.lr" and body[0]["value"] == 1e-3 and body[0]["default"] == 6e-4


def test_table_shows_every_field_and_bracketed_text():
    """Prevents rich markup eating `[int]` or `[T,T]` in the terminal table."""
    console = Console(force_terminal=True, width=200, color_system=None, record=True)
    render_table(field_rows(), console)
    text = console.export_text()
    for name in setting_names():
        assert name in text
    assert "list[int] | None" in text and "dense [T,T] mask" in text


@pytest.mark.parametrize("key,field", [
    ("learning_rate", "optim.lr"), ("batch_size", "optim.rows_per_step"), ("steps", "optim.max_steps"),
    ("num_steps", "optim.max_steps"), ("train_steps", "optim.max_steps"), ("num_draft_layers", "drafter.num_layers"),
    ("draft_layers", "drafter.num_layers"), ("block", "drafter.block_size"), ("draft_length", "drafter.block_size"),
    ("warmup", "optim.warmup_ratio"), ("warmup_steps", "optim.warmup_ratio"), ("max_seq_len", "data.seq_len"),
    ("seq_length", "data.seq_len"), ("max_length", "data.seq_len"), ("anchors", "loss.num_anchors"),
    ("epochs_num", "optim.epochs"), ("grad_norm", "optim.grad_clip"), ("max_grad_norm", "optim.grad_clip"),
    ("wd", "optim.weight_decay"), ("output_dir", "out"), ("model", "target.path"), ("target_model", "target.path"),
    ("dataset", "data.chats"), ("train_data", "data.chats"), ("Learning-Rate", "optim.lr"), ("seqlen", "data.seq_len"),
    ("learning_rat", "optim.lr"), ("num_layer", "drafter.num_layers"), ("target", "target.path"),
    ("loss", "loss.kind"), ("runtime.lr", "optim.lr"), ("optim.lrr", "optim.lr"),
])
def test_suggestions_by_synonym_and_spelling(key, field):
    """Prevents `--set learning_rate=…` answering with no hint (difflib alone finds nothing)."""
    assert suggest_fields(key)[0] == field


def test_every_synonym_names_a_field():
    """Prevents a renamed field leaving synonyms that suggest a field that no longer exists."""
    assert set(SYNONYMS.values()) <= set(setting_names())
    assert not set(SYNONYMS) & set(FIELD_SECTION)


def test_unknown_set_and_yaml_keys_name_the_source_suggest_and_point_to_config(tmp_path):
    """Prevents an unknown key error that names neither where the key came from nor the command
    listing the fields."""
    with pytest.raises(ValueError) as e:
        load_config(None, None, ["learning_rate=1e-3"])
    msg = str(e.value)
    assert "--set: 'learning_rate' is not a config field, did you mean optim.lr?" in msg
    assert msg.endswith("`dflash-train config` lists every field with its type, default and description.")
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: 4\nmax_seq_len: 256\n")
    with pytest.raises(ValueError) as e:
        load_config(str(bad))
    msg = str(e.value)
    assert f"--config {bad}: 'batch_size' is not a config field, did you mean optim.rows_per_step" in msg
    assert "'max_seq_len' is not a config field, did you mean data.seq_len" in msg
    assert msg.endswith("`dflash-train config` lists every field with its type, default and description.")


def test_version():
    """Prevents `--version` being unknown (a newcomer's first check of what is installed)."""
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert re.match(r"dflash-trainer \d+\.\d+\.\d+ \(torch \S+, transformers \S+, python \S+\)", result.output)


def test_docs_list_every_setting():
    """Prevents a setting missing from docs/config.md (every setting is documented there, by section)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    missing = [name for name in setting_names() if f"| `{name}` |" not in text]
    assert not missing, f"regenerate the 'Every setting' tables of docs/config.md: {missing}"


def test_a_setting_given_twice_in_one_file_is_refused(tmp_path):
    """Prevents a silent pick between `max_steps: 5` and `optim: {max_steps: 9}` in one YAML file (the
    winner would hang on the order of the keys, which yaml.safe_dump sorts)."""
    import pytest

    both = tmp_path / "both.yaml"
    both.write_text("max_steps: 5\noptim:\n  max_steps: 9\n")
    with pytest.raises(ValueError, match=r"sets optim.max_steps twice \('max_steps' and 'optim'\): keep one"):
        load_config(str(both))
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text("optim.lr: 0.001\noptim:\n  lr: 0.002\n")
    with pytest.raises(ValueError, match="sets optim.lr twice"):
        load_config(str(dotted))
    ok = tmp_path / "ok.yaml"
    ok.write_text("max_steps: 5\noptim:\n  lr: 0.002\n")
    assert (load_config(str(ok)).optim.max_steps, load_config(str(ok)).optim.lr) == (5, 0.002)


def test_a_section_with_every_field_commented_out_is_empty(tmp_path):
    """Prevents `optim:` with only comments under it (an edited `dflash-train config` dump) being refused."""
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  # lr: 0.001\ndata:\n  seq_len: 1024\n")
    cfg = load_config(str(f))
    assert cfg.optim == TrainConfig().optim and cfg.data.seq_len == 1024


def test_field_default_reads_the_sections():
    """The one reading of a setting's default: dotted, bare and top-level names; unknown names raise."""
    import pytest

    from dflash_trainer.config.schema import field_default

    assert (field_default("optim.lr"), field_default("lr"), field_default("out")) == (6e-4, 6e-4, "runs/default")
    assert (field_default("drafter.block_size"), field_default("loss.kind"), field_default("max_steps")) == (16, "ce", None)
    with pytest.raises(KeyError, match="'learning_rate' is not a setting"):
        field_default("learning_rate")
