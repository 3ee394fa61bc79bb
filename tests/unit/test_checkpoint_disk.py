"""Disk full or unwritable output while checkpointing: a clear error with path and sizes, the previous
checkpoint intact, no temporary folder left, and the run resumable from what was saved."""

import errno
import shutil
from collections import namedtuple

import pytest
import torch
from typer.testing import CliRunner

import dflash_trainer.interop.checkpoint_files as ckmod
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.interop.checkpoint_files import load_checkpoint, save_checkpoint

CFG = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=128, block_size=4, mask_token_id=127,
                    target_layer_ids=[0, 2], num_target_layers=3)
Usage = namedtuple("Usage", "total used free")


def _weights(v: float) -> dict[str, torch.Tensor]:
    return {"fc.weight": torch.full((64, 128), v), "norm.weight": torch.full((64,), v)}


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_disk_full_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Prevents a crash mid-write from destroying the last good checkpoint."""
    path = tmp_path / "checkpoint-final"
    save_checkpoint(path, _weights(1.0), CFG, {"step": 1}, {"opt": torch.zeros(1000)})

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckmod, "save_file", full)
    with pytest.raises(OSError) as info:
        save_checkpoint(path, _weights(2.0), CFG, {"step": 2}, {"opt": torch.zeros(1000)})
    msg = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert f"could not write checkpoint {path}" in msg and "No space left on device" in msg
    assert "needs about 0.0 MiB" in msg  # 64·128·4 + 64·4 + 1000·4 bytes ≈ 0.04 MiB
    _, weights, meta = load_checkpoint(path)
    assert meta["step"] == 1 and torch.equal(weights["fc.weight"], _weights(1.0)["fc.weight"])
    assert _leftovers(tmp_path) == []


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    """Prevents filling the disk: the needed and free sizes are named, nothing is written."""
    monkeypatch.setattr(ckmod.shutil, "disk_usage", lambda p: Usage(10 << 30, 10 << 30, 512 << 10))
    big = {"fc.weight": torch.zeros(1024, 1024)}  # 4 MiB
    with pytest.raises(OSError) as info:
        save_checkpoint(tmp_path / "checkpoint-3", big, CFG, {"step": 3}, {"opt": torch.zeros(1024, 1024)})
    msg = str(info.value)
    assert "checkpoint-3" in msg and "needs about 8.0 MiB" in msg and "0.5 MiB free" in msg
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output_directory_names_the_path(tmp_path, monkeypatch):
    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(ckmod.tempfile, "mkdtemp", denied)
    with pytest.raises(OSError) as info:
        save_checkpoint(tmp_path / "checkpoint-1", _weights(1.0), CFG, {"step": 1})
    assert f"could not write checkpoint {tmp_path / 'checkpoint-1'}" in str(info.value)
    assert "Permission denied" in str(info.value)


def test_run_hitting_a_full_disk_stops_with_one_line_and_resumes(tmp_path, monkeypatch):
    """A training run whose disk fills after its first checkpoint: exit 2 with the path and sizes,
    checkpoint-3 stays loadable and is the one a resume picks."""
    from dflash_trainer.cli.main import app
    from dflash_trainer.training.checkpoint import load_latest
    from tests.integration.tiny_run import make_prepared, make_target, train_cmd

    target = make_target(tmp_path / "target")
    prepared = make_prepared(tmp_path / "prepared")
    out = tmp_path / "run"
    args = train_cmd(out, target, prepared)[3:]  # drop "python -m dflash_trainer.cli.main"
    real = shutil.disk_usage
    calls = []

    def filling(p):
        calls.append(p)
        u = real(p)
        return u if len(calls) == 1 else Usage(u.total, u.total, 1024)

    monkeypatch.setattr(ckmod.shutil, "disk_usage", filling)
    r = CliRunner().invoke(app, args)
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert f"could not write checkpoint {out / 'checkpoint-6'}" in text and "0.0 MiB free" in text, text
    assert "Traceback" not in text
    found = load_latest(out, print)
    assert found is not None and found[0].name == "checkpoint-3" and found[1]["progress"]["step"] == 3
    assert _leftovers(out) == []


def test_one_rule_for_what_a_checkpoint_folder_is(tmp_path):
    """Prevents the resume scan, the resume folder check, eval's run-folder lookup and the loader
    from disagreeing about which folders are checkpoints: one predicate (`is_checkpoint`) decides."""
    from dflash_trainer.evaluation.settings import resolve_drafter_path
    from dflash_trainer.interop.formats import is_checkpoint
    from dflash_trainer.training.checkpoint import step_checkpoints

    save_checkpoint(tmp_path / "checkpoint-2", _weights(1.0), CFG, {"step": 2}, {"progress": {"step": 2}})
    save_checkpoint(tmp_path / "checkpoint-4", _weights(1.0), CFG, {"step": 4}, {"progress": {"step": 4}})
    save_checkpoint(tmp_path / "checkpoint-final", _weights(1.0), CFG, {"step": 5})  # weights only
    assert is_checkpoint(tmp_path / "checkpoint-4", resumable=True)
    assert is_checkpoint(tmp_path / "checkpoint-final") and not is_checkpoint(tmp_path / "checkpoint-final",
                                                                              resumable=True)
    (tmp_path / "checkpoint-4" / "model.safetensors").unlink()  # weights gone: neither kind any more
    assert not is_checkpoint(tmp_path / "checkpoint-4") and not is_checkpoint(tmp_path / "checkpoint-4",
                                                                              resumable=True)
    assert step_checkpoints(tmp_path) == [(2, tmp_path / "checkpoint-2")]
    with pytest.raises(ValueError, match="not a drafter checkpoint"):
        load_checkpoint(tmp_path / "checkpoint-4")
    assert resolve_drafter_path(tmp_path) == tmp_path / "checkpoint-final"
