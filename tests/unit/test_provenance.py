"""The provenance record (telemetry/provenance.py): which commit ran, and whether the tracked files were
changed from it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

import dflash_trainer.telemetry.provenance as prov


def test_record_is_json_and_names_the_code():
    """Serializable; the versions of torch and transformers; the script by name, not its path."""
    p = prov.provenance()
    json.dumps(p)
    assert p["versions"]["torch"] and p["versions"]["transformers"] and p["python"]
    assert set(p) >= {"git_sha", "git_dirty", "cuda_devices", "cpu_threads", "time_utc"}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_dirty_flag_follows_the_tracked_files(tmp_path, monkeypatch):
    """A fresh commit is clean; an edited tracked file makes it dirty; an untracked file does not; outside
    a checkout both are None."""
    def git(*a):
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    real = prov._git
    monkeypatch.setattr(prov, "_git", lambda *a: real("-C", str(tmp_path), *a))  # the later -C wins
    assert len(prov._git_sha()) == 40 and prov._git_dirty() is False
    (tmp_path / "new.txt").write_text("x\n")
    assert prov._git_dirty() is False
    (tmp_path / "f.txt").write_text("b\n")
    assert prov._git_dirty() is True
    monkeypatch.setattr(prov, "_git", lambda *a: real("-C", str(tmp_path / "nowhere"), *a))
    assert prov._git_sha() is None and prov._git_dirty() is None


def test_report_line_says_when_the_tree_differs_from_the_commit():
    from dflash_trainer.recipe.report import _provenance_line

    p = {"cuda_devices": ["NVIDIA H100 80GB HBM3"], "git_sha": "abc", "versions": {"torch": "2.11.0",
                                                                                  "transformers": "5.17.0"}}
    assert _provenance_line({**p, "git_dirty": False})[1] == ("Trained on NVIDIA H100 80GB HBM3; commit abc; torch "
                                                             "2.11.0, transformers 5.17.0.")
    assert "commit abc with tracked files changed;" in _provenance_line({**p, "git_dirty": True})[1]
    assert "commit unknown;" in _provenance_line({"versions": {}})[1] and _provenance_line(None) == []
