"""The recipe's flags (recipe/settings.py): which stages run, and the contradictions refused with the fix."""

from __future__ import annotations

import pytest

from dflash_trainer.recipe.settings import RecipeSettings


def test_stages_by_flags(tmp_path):
    """The packaged mixture runs every stage but control; --data drops the mixture; --control adds the
    control; --until cuts after the named stage."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("{}\n")
    assert RecipeSettings(out="r").stages() == ["mixture", "regenerate", "prepare", "train", "eval", "export",
                                                "report"]
    assert RecipeSettings(out="r", data=str(chats), control=True).stages() == [
        "regenerate", "prepare", "train", "control", "eval", "export", "report"]
    assert RecipeSettings(out="r", until="prepare").stages() == ["mixture", "regenerate", "prepare"]
    assert RecipeSettings(out="r", data=str(chats), until="regenerate").stages() == ["regenerate"]


@pytest.mark.parametrize("kwargs,message", [
    ({"until": "serve"}, "--until serve: one of mixture, regenerate"),
    ({"until": "control"}, "--until control needs --control"),
    ({"until": "mixture", "data": "CHATS"}, "--until mixture with --data: a chat file has no mixture stage"),
    ({"sets": ["optim.lr"]}, "--set optim.lr: expected section.field=value"),
    ({"spec": "CHATS", "data": "CHATS"}, "--spec and --data: give one"),
])
def test_contradicting_flags_are_refused(tmp_path, kwargs, message):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("{}\n")
    kwargs = {k: (str(chats) if v == "CHATS" else v) for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        RecipeSettings(out="r", **kwargs).check()


def test_missing_file_names_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data .*nope.jsonl: file not found"):
        RecipeSettings(out="r", data=str(tmp_path / "nope.jsonl")).check()


def test_regenerate_with_changed_inputs_starts_from_nothing(tmp_path, monkeypatch):
    """Prevents a complete regen.jsonl made with other settings (say another --max-new-tokens) being
    recorded under the new key: a regenerate stage that is not resuming removes what was left and runs;
    a resumed one whose output is complete runs nothing."""
    import json

    from dflash_trainer.recipe import stages as st
    from dflash_trainer.recipe.settings import RunPaths

    class Ctx:  # what regen_run reads: paths, plan, settings, run
        def __init__(self):
            self.paths = RunPaths(tmp_path)
            self.plan = type("Plan", (), {"regen_max_seconds": 60.0})()
            self.calls = []

        def run(self, stage, args):
            self.calls.append(stage)
            self.paths.regen.write_text('{"new": 1}\n')
            self.paths.regen.with_name("regen.jsonl.report.json").write_text(json.dumps({"records_read": 1}))

    ctx = Ctx()
    ctx.paths.regen.write_text('{"old": 1}\n')  # a finished regeneration of other settings
    ctx.paths.regen.with_name("regen.jsonl.report.json").write_text(json.dumps({"records_read": 9}))
    monkeypatch.setattr(st, "regen_args", lambda *a, **k: [])  # the command line is not under test here
    out = st.regen_run(ctx, resuming=False)
    assert ctx.calls == ["regenerate"] and ctx.paths.regen.read_text() == '{"new": 1}\n'
    assert out["records_read"] == 1
    ctx.calls.clear()
    st.regen_run(ctx, resuming=True)  # complete, same inputs: nothing runs
    assert ctx.calls == []
