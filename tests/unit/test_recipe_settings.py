"""The recipe's flags (recipe/settings.py): which stages run, and the contradictions refused with the fix."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

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
    ({"regen_samples": 2}, "--regen-samples 2 at --regen-temperature 0 would write the same greedy answer"),
    ({"regen_samples": 0}, "--regen-samples 0: give 1 \\(the greedy answer\\) or more"),
    ({"regen_temperature": -0.5}, "--regen-temperature -0.5: give 0 \\(greedy\\) or a temperature > 0"),
    ({"regen_temperature": float("nan")}, "--regen-temperature nan: give 0"),
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
            self.paths.regen.with_name("regen.jsonl.report.json").write_text(json.dumps({"records_read": 1, "records_written": 1}))

    ctx = Ctx()
    ctx.paths.regen.write_text('{"old": 1}\n')  # a finished regeneration of other settings
    ctx.paths.regen.with_name("regen.jsonl.report.json").write_text(json.dumps({"records_read": 9, "records_written": 9}))
    monkeypatch.setattr(st, "regen_args", lambda *a, **k: [])  # the command line is not under test here
    out = st.regen_run(ctx, resuming=False)
    assert ctx.calls == ["regenerate"] and ctx.paths.regen.read_text() == '{"new": 1}\n'
    assert out["records_read"] == 1
    ctx.calls.clear()
    st.regen_run(ctx, resuming=True)  # complete, same inputs: nothing runs
    assert ctx.calls == []


def test_a_budget_stopped_regeneration_is_continued_at_other_batch_rows(tmp_path, monkeypatch):
    """A regeneration its time cap stopped at record 3 (2,048 rows, 100 s), rerun with a larger cap at
    1,024 rows (another card's plan): the records from 3 on are answered for the 200 s more into
    regen-more-3.jsonl and appended, not the whole stage redone. With other generation limits
    (max_new_tokens) it is not continued."""
    import json
    from dataclasses import asdict
    from pathlib import Path
    from types import SimpleNamespace

    from dflash_trainer.data.regen_report import RegenerateReport
    from dflash_trainer.recipe import stages as st
    from dflash_trainer.recipe.settings import RunPaths

    data = tmp_path / "chats.jsonl"
    data.write_text("{}\n" * 5)
    plan = SimpleNamespace(regen_max_new_tokens=512, regen_max_prompt_tokens=1536, regen_batch_rows=1024,
                           regen_max_seconds=300.0, regen_max_conversations=None, device="cuda")
    calls = []

    def fake_run(stage, args):
        more, seconds, first = args
        calls.append((stage, Path(more).name, seconds, first))
        Path(more).write_text('{"r": 3}\n{"r": 4}\n')
        Path(more + ".report.json").write_text(json.dumps(asdict(RegenerateReport(records_read=2, first_record=3))))

    ctx = SimpleNamespace(paths=RunPaths(tmp_path / "run"), plan=plan, run=fake_run,
                          settings=SimpleNamespace(data=str(data), target="smollm2-135m", regen_sampling=dict,
                                                  chat_template=None))
    ctx.paths.root.mkdir()
    monkeypatch.setattr(st, "regen_args", lambda c, out, secs, first_record=0: [str(out), secs, first_record])
    ctx.paths.regen.write_text('{"r": 0}\n{"r": 1}\n{"r": 2}\n')
    first = RegenerateReport(records_read=3, stopped_at_max_seconds=True, next_record=3)
    ctx.paths.regen.with_name("regen.jsonl.report.json").write_text(json.dumps(asdict(first)))
    old_key = {**st.regen_key(ctx), "batch_size": 2048, "max_seconds": 100.0}
    old = {"key": old_key, "outputs": {"stopped_at_max_seconds": True, "next_record": 3}}
    assert st.regen_continue(ctx, {**old, "key": {**old_key, "max_new_tokens": 256}}) is None and not calls
    out = st.regen_continue(ctx, old)
    assert calls == [("regenerate", "regen-more-3.jsonl", 200.0, 3)]
    assert out["continued_from"] == 3 and out["records_read"] == 5
    assert [json.loads(x)["r"] for x in ctx.paths.regen.read_text().splitlines()] == [0, 1, 2, 3, 4]
    # a finished regeneration of a folder target recorded before keys held its weights sample, carried to a
    # card with other batch rows: reused, not redone
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"w" * 64)
    ctx.settings.target = str(target)
    key = st.regen_key(ctx)
    done = {"key": {k: v for k, v in {**key, "batch_size": 2048}.items() if k != "weights"},
            "outputs": {"stopped_at_max_seconds": False}}
    assert "weights" in key and st.regen_reusable(ctx, done)
    assert not st.regen_reusable(ctx, {**done, "key": {**done["key"], "weights": "v" * 64}})  # other weights


def test_sampled_regeneration_flags_reach_the_command_and_the_key(tmp_path):
    """--regen-samples 3 --regen-temperature 0.7: `regenerate` gets --samples 3 --temperature 0.7 and the
    stage key holds both (another temperature is another regeneration). The greedy default adds neither,
    so the key of every regeneration recorded before these flags existed is unchanged."""
    from types import SimpleNamespace

    from dflash_trainer.recipe import stages as st
    from dflash_trainer.recipe.settings import RunPaths

    plan = SimpleNamespace(regen_max_new_tokens=512, regen_max_prompt_tokens=1536, regen_batch_rows=1024,
                           regen_max_seconds=300.0, regen_max_conversations=None, device="cuda")
    data = tmp_path / "chats.jsonl"
    data.write_text("{}\n")

    def ctx(**kw):
        settings = RecipeSettings(out=str(tmp_path / "run"), data=str(data), target="smollm2-135m", **kw)
        settings.check()
        return SimpleNamespace(paths=RunPaths(tmp_path / "run"), plan=plan, settings=settings,
                               target_args=lambda: ["--target", "smollm2-135m"])

    sampled, greedy = ctx(regen_samples=3, regen_temperature=0.7), ctx()
    args = st.regen_args(sampled, sampled.paths.regen, 300.0)
    assert args[args.index("--samples") + 1] == "3" and args[args.index("--temperature") + 1] == "0.7"
    exact = ctx(regen_samples=2, regen_temperature=0.12345678)  # the command gets the key's value, unrounded
    args = st.regen_args(exact, exact.paths.regen, 300.0)
    assert float(args[args.index("--temperature") + 1]) == 0.12345678 == st.regen_key(exact)["temperature"]
    assert "--samples" not in st.regen_args(greedy, greedy.paths.regen, 300.0)
    key, base = st.regen_key(sampled), st.regen_key(greedy)
    assert {k: v for k, v in key.items() if k not in base} == {"samples": 3, "temperature": 0.7}
    assert set(base) == {"data", "target", "max_new_tokens", "max_prompt_tokens", "batch_size", "max_seconds",
                         "max_conversations", "device"}
    assert st.regen_key(ctx(regen_temperature=0.7))["temperature"] == 0.7  # one sample at T > 0: sampled too


def test_a_misspelt_set_is_refused_before_any_stage(tmp_path):
    """A --set the train stage would refuse fails the plan at once (not after the regeneration), naming
    the field and the close one; a good one plans."""
    from typer.testing import CliRunner

    from dflash_trainer.cli.main import app

    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["recipe", "--out", str(out), "--plan", "--gpu-memory-gib", "80",
                                 "--set", "optim.lrr=1e-3"])
    assert r.exit_code != 0
    assert "'optim.lrr' is not a config field, did you mean optim.lr?" in r.output and "train stage" in r.output
    # a real run (CPU plan) stops there too: no stage ran, no run folder was made
    r = CliRunner().invoke(app, ["recipe", "--out", str(out), "--gpu-memory-gib", "0", "--set", "optim.lrr=1e-3"])
    assert r.exit_code != 0 and "did you mean optim.lr?" in r.output and not out.exists()
    r = CliRunner().invoke(app, ["recipe", "--out", str(out), "--plan", "--gpu-memory-gib", "80",
                                 "--set", "optim.lr=1e-3"])
    assert r.exit_code == 0, r.output


def test_the_serving_lines_load_the_exports_verifier_not_the_tools_name(tmp_path):
    """`vllm serve X`: the speculators export's verifier when it records one; before the export, a named
    target's hub id (smollm2-135m → HuggingFaceTB/SmolLM2-135M-Instruct, as for no --target); a path as given."""
    import json
    from types import SimpleNamespace

    from dflash_trainer.recipe.report import serve_target, serving_lines
    from dflash_trainer.recipe.settings import RecipeSettings, RunPaths

    def ctx(target):
        return SimpleNamespace(settings=RecipeSettings(out=str(tmp_path), target=target), paths=RunPaths(tmp_path))

    assert serve_target(ctx("smollm2-135m")) == serve_target(ctx(None)) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert serve_target(ctx("qwen2.5-coder-0.5b")) == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert serve_target(ctx("/models/mine")) == "/models/mine"
    cfg = tmp_path / "export-speculators" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": "org/my-model"}}}))
    assert serve_target(ctx("/models/mine")) == "org/my-model"
    # an export of a local GGUF records only the file's name: the path serves, the name would not
    cfg.write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": "my-7b-Q4_K_M"}}}))
    assert serve_target(ctx("/models/my-7b-Q4_K_M.gguf")) == "/models/my-7b-Q4_K_M.gguf"
    cfg.write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": "org/my-model"}}}))
    assert serving_lines(ctx("smollm2-135m"))[0].startswith("vllm serve org/my-model --speculative-config")


def test_a_stage_s_warnings_are_its_new_warning_lines_colour_codes_removed(tmp_path, monkeypatch):
    """run_child returns the lines of this run that start with `warning:` or `note:` (a FORCE_COLOR child writes
    escape codes around it), not lines that only contain them, nor an earlier run's lines in the same log."""
    import sys

    from dflash_trainer.recipe import child

    code = ("print('\\x1b[33mwarning:\\x1b[0m a'); print('note: the CPU is busy'); print('  warning: b'); "
            "print('step 3 note: no')")
    monkeypatch.setattr(child, "command", lambda args: [sys.executable, "-c", code])
    log = tmp_path / "logs" / "s.log"
    assert child.run_child("s", [], log) == ["warning: a", "note: the CPU is busy", "warning: b"]
    monkeypatch.setattr(child, "command", lambda args: [sys.executable, "-c", "print('warning: c')"])
    assert child.run_child("s", [], log) == ["warning: c"]


def test_a_stage_s_notes_are_said_once_per_stage(tmp_path, monkeypatch):
    """Eval runs once per suite and each run repeats the busy-CPU note: the recipe says it once for the stage,
    and again for another stage."""
    from dflash_trainer.recipe import stages
    from dflash_trainer.recipe.settings import RunPaths

    monkeypatch.setattr(stages, "run_child", lambda stage, args, log, hb, run_root=None: [
        "note: the CPU is busy: --threads 1 is often faster", "warning: w"])
    said: list[str] = []
    ctx = stages.Context(settings=RecipeSettings(out=str(tmp_path)), plan=None, paths=RunPaths(tmp_path),
                         say=said.append)
    for stage in ("eval", "eval", "export"):
        ctx.run(stage, [])
    # eval's own flag is named as the recipe takes it (--set runtime.threads, which the recipe passes to eval)
    busy = "note: the CPU is busy: --set runtime.threads=1 is often faster"
    assert said == [f"[recipe] eval: {busy}", "[recipe] eval: warning: w",
                    f"[recipe] export: {busy}", "[recipe] export: warning: w"]


def test_train_threads_reach_eval(tmp_path):
    """Prevents `--set runtime.threads=1` reaching train only: eval gets it as --threads, outside the eval key."""
    import json

    from dflash_trainer.recipe import stages_late
    from dflash_trainer.recipe.plan import SMOLLM2_135M, DataSize, make_plan
    from dflash_trainer.recipe.settings import RunPaths
    from dflash_trainer.recipe.stages import Context

    plan = make_plan(None, SMOLLM2_135M, DataSize(conversations=100, turns=100))
    for sets, expect in (([], None), (["runtime.threads=1"], "1"), (["threads=3"], "3")):
        ctx = Context(settings=RecipeSettings(out=str(tmp_path), sets=sets), plan=plan, paths=RunPaths(tmp_path))
        s = stages_late.eval_settings(ctx)
        args = stages_late._eval_args(ctx, s, "drafter", "mt-bench", tmp_path / "e.json", "float32")
        assert (args[args.index("--threads") + 1] if "--threads" in args else None) == expect
        assert "threads" not in json.dumps(s)  # eval_settings is the eval stage's key, less the train hash
    # nor in the train key: following the busy-CPU note keeps the trained drafter
    from dflash_trainer.recipe.records import train_key_sets

    assert train_key_sets(["optim.lr=1", "runtime.threads=1", " threads = 2"]) == ["optim.lr=1"]


def test_how_many_checkpoints_are_kept_is_not_part_of_the_train_key(tmp_path):
    """runtime.keep_last (the plan's or the user's) does not change the drafter: a run finished before the recipe
    set it keeps its record; a setting that does change it (optim.lr) changes the key."""
    from types import SimpleNamespace

    from dflash_trainer.recipe.records import key_hash
    from dflash_trainer.recipe.settings import RecipeSettings
    from dflash_trainer.recipe.stages import train_key

    def key(plan_sets, user_sets=()):
        ctx = SimpleNamespace(settings=RecipeSettings(out=str(tmp_path), sets=list(user_sets)),
                              plan=SimpleNamespace(train_sets=list(plan_sets)), hashes={"prepare": "p" * 64})
        return key_hash(train_key(ctx))

    old = key(["optim.max_steps=6000", "runtime.save_every=500"])
    assert key(["optim.max_steps=6000", "runtime.save_every=500", "runtime.keep_last=1"], ["runtime.keep_last=4"]) == old
    assert key(["optim.max_steps=6000", "runtime.save_every=500", "runtime.keep_last=1"], ["optim.lr=1e-3"]) != old


def test_a_target_folder_retrained_in_place_changes_the_key_a_copy_does_not(tmp_path):
    """target_id of an HF folder: same config.json, weights rewritten with other values of the same size →
    another id; the folder copied elsewhere with other mtimes → the same weights id."""
    import os
    import shutil

    from dflash_trainer.recipe.stages import target_id, weights_id

    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text('{"model_type": "llama"}')
    (m / "model.safetensors").write_bytes(bytes(3 << 20))
    (m / "notes.txt").write_text("not weights")
    before = target_id(str(m))
    assert before["weights"] == weights_id(m) and len(before["weights"]) == 64
    copy = tmp_path / "copy"
    shutil.copytree(m, copy)
    os.utime(copy / "model.safetensors", (1, 1))
    assert weights_id(copy) == weights_id(m)
    (m / "notes.txt").write_text("other notes")
    assert target_id(str(m)) == before
    (m / "model.safetensors").write_bytes(bytes(3 << 20 - 1) + b"\x01")  # one byte of the last MiB
    assert target_id(str(m))["weights"] != before["weights"] and target_id(str(m))["config"] == before["config"]


def test_a_regeneration_with_no_answer_fails_the_stage_with_the_reasons(tmp_path):
    """No record written: the stage raises (no finished record, so a rerun tries again) naming the counts by
    reason and, for empty answers, what to check; a regeneration with answers passes."""
    import pytest

    from dflash_trainer.recipe.stages import check_answers

    regen = tmp_path / "regen.jsonl"
    regen.write_text("")
    check_answers({"records_written": 3}, regen)
    assert regen.exists()
    with pytest.raises(RuntimeError) as e:
        check_answers({"records_written": 0, "records_read": 41, "failed_by_reason": {"empty_response": 40},
                       "skipped_by_reason": {"unknown_role": 1}}, tmp_path / "regen.jsonl")
    msg = str(e.value)
    assert "wrote no answered record (41 read: empty_response 40, unknown_role 1)" in msg
    assert "check that its weights are trained" in msg and "regen.jsonl.report.json" in msg
    assert not regen.exists()  # removed: a rerun regenerates instead of finding a finished empty output
    with pytest.raises(RuntimeError, match=r"\(7 read: its time cap stopped it before any answer was done\)"):
        check_answers({"records_written": 0, "records_read": 7, "stopped_at_max_seconds": True}, regen)


def test_a_shallow_or_foreign_target_is_refused_with_the_plan():
    """Before any stage: the DFlash rule for k = 5 on a 3-layer target (names the k that fits and an explicit
    list), explicit ids outside the target, a config without the decoder fields (GPT-2's n_embd / n_layer)."""
    import pytest

    from dflash_trainer.recipe.inputs import shape_from_config, check_target_layers

    # 3 layers, k = 5: the rule gives [1, 1, 0, 0, 0]; k = 1 fits; a list over 0 … L − 2 = [0, 1]
    with pytest.raises(ValueError, match=r"the DFlash rule gives \[1, 1, 0, 0, 0\].*num_target_features=1 \(the most "
                                         r"the rule fits here\).*target_layer_ids=\[0, 1\]"):
        check_target_layers(3, 5, None)
    with pytest.raises(ValueError, match=r"ids \[5\] lie outside \[0, 2\]"):
        check_target_layers(3, 5, [0, 5])
    check_target_layers(3, 5, [0, 2])
    check_target_layers(30, 5, None)  # [1, 8, 14, 20, 27]
    with pytest.raises(ValueError, match="model_type 'gpt2'.* has no hidden_size, num_hidden_layers"):
        shape_from_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "vocab_size": 100}, 5)


def test_the_serve_section_says_when_the_table_advises_fewer_drafts():
    """Hand-worked rows: at the smallest batch k = 0 → plain decoding; k = 3 of 7 → that k with its speedup;
    k = 7 of 7 (every draft) or no table → no note."""
    from dflash_trainer.recipe.report import serve_note

    def table(k):
        return {"speedup_table": [{"batch_size": 4, "full_draft_length": 7, "recommended_draft_length": 7},
                                  {"batch_size": 1, "full_draft_length": 7, "recommended_draft_length": k,
                                   "recommended_speedup": 1.5}]}

    assert "At batch 1 the measured table says plain decoding was faster (leave speculation off)" in serve_note(table(0))[1]
    assert "set num_speculative_tokens to 3 (1.50×)" in serve_note(table(3))[1]
    assert serve_note(table(7)) == [] and serve_note(None) == [] and serve_note({"speedup_table": []}) == []


def test_a_run_recorded_before_keys_held_the_target_weights_is_not_redone(tmp_path, monkeypatch):
    """A stage whose finished record's hash is that of its key without `weights` (written before folder targets'
    keys sampled their weights) is skipped, and stays skipped on the next run; another key is redone."""
    import io

    from rich.console import Console

    from dflash_trainer.recipe import run as run_mod
    from dflash_trainer.recipe.plan import MIXTURE_SMOLLM2, SMOLLM2_135M, make_plan
    from dflash_trainer.recipe.records import StageRecords
    from dflash_trainer.recipe.settings import RecipeSettings

    ran = []
    key = {"target": "/models/m", "config": "c" * 64, "weights": "w" * 64}
    monkeypatch.setattr(run_mod, "STAGE_TABLE", {"report": (lambda ctx: dict(key), lambda ctx, r: ran.append(1) or {},
                                                           "the stage")})
    settings = RecipeSettings(out=str(tmp_path), until="report")
    monkeypatch.setattr(RecipeSettings, "stages", lambda self: ["report"])
    plan = make_plan(None, SMOLLM2_135M, MIXTURE_SMOLLM2)
    records = StageRecords(tmp_path)
    records.finish("report", {k: v for k, v in key.items() if k != "weights"}, 1.0, {})
    console = Console(file=io.StringIO())
    assert run_mod.run_recipe(settings, plan, console) == {"report": "skipped"}
    assert run_mod.run_recipe(settings, plan, console) == {"report": "skipped"} and ran == []
    key["weights"] = "v" * 64
    records.finish("report", {**key, "config": "d" * 64}, 1.0, {})  # another target's record
    assert run_mod.run_recipe(settings, plan, console) == {"report": "ran"} and ran == [1]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_run_child_stopped_by_a_signal_passes_it_on_and_exits_with_its_code(tmp_path, monkeypatch, signum, code):
    """A signal to the recipe reaches the running stage (which stops), and the recipe's exit code is the shell's
    for that signal: 130 for Ctrl-C, 143 for SIGTERM."""
    from dflash_trainer.recipe import child

    monkeypatch.setattr(child, "_stop_signal", [])
    flag = tmp_path / "started"
    code_text = f"import pathlib, time; pathlib.Path({str(flag)!r}).touch(); time.sleep(60)"
    monkeypatch.setattr(child, "command", lambda args: [sys.executable, "-c", code_text])

    def send():
        while not flag.exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signum)

    threading.Thread(target=send, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(child.Stopped, match=signal.Signals(signum).name) as e:
        child.run_child("train", [], tmp_path / "s.log")
    assert e.value.exit_code == code
    assert time.monotonic() - t0 < 30  # the child stopped on the forwarded signal, not at the end of its sleep


def test_verifier_names_the_target_in_the_exports_and_the_serving_lines(tmp_path, monkeypatch):
    """--verifier reaches export (its key changes only when given: older exports keep theirs) and the serving
    lines; without it, a folder whose config.json names no hub id is warned of with the plan, and one that does
    (or the embedded target) is not; a padded --verifier is refused."""
    import json
    from types import SimpleNamespace

    from dflash_trainer.recipe import stages_late
    from dflash_trainer.recipe.inputs import verifier_warning
    from dflash_trainer.recipe.report import serve_target
    from dflash_trainer.recipe.settings import RecipeSettings, RunPaths

    def ctx(verifier=None):
        return SimpleNamespace(settings=RecipeSettings(out=str(tmp_path), target="/models/mine", verifier=verifier),
                               paths=RunPaths(tmp_path), hashes={"train": "t" * 64})

    assert "verifier" not in stages_late.export_key(ctx())
    assert stages_late.export_key(ctx("org/mine"))["verifier"] == "org/mine"
    assert serve_target(ctx("org/mine")) == "org/mine" and serve_target(ctx()) == "/models/mine"
    calls = []
    c = ctx("org/mine")
    c.run = lambda stage, args: calls.append(args)
    c.target_args = lambda: ["--target", "/models/mine"]
    stages_late.export_run(c, resuming=False)
    assert [a[a.index("--verifier") + 1] for a in calls] == ["org/mine", "org/mine"]
    with pytest.raises(ValueError, match="--verifier ' org/mine'"):
        RecipeSettings(out="x", verifier=" org/mine").check()

    folder = tmp_path / "my-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    [line] = verifier_warning(str(folder), None)
    assert "names it 'my-7b'" in line and "--verifier HUB_ID" in line
    assert verifier_warning(str(folder), "org/my-7b") == [] and verifier_warning(None, None) == []
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "_name_or_path": "org/my-7b"}))
    assert verifier_warning(str(folder), None) == []
    # a local folder given as Org/Name (a hub download's layout) is exported under that name: no warning
    hub_like = tmp_path / "Org" / "Name-1B"
    hub_like.mkdir(parents=True)
    (hub_like / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.chdir(tmp_path)
    assert verifier_warning("Org/Name-1B", None) == [] and verifier_warning(str(hub_like), None) != []


_GROUP_CHILD = """
import pathlib, signal, sys, time
got = pathlib.Path(sys.argv[1])
def on(signum, _frame):
    with got.open("a") as f:
        f.write(signal.Signals(signum).name + "\\n")
signal.signal(signal.SIGINT, on)
signal.signal(signal.SIGTERM, on)
pathlib.Path(sys.argv[2]).touch()
t0 = time.monotonic()
while time.monotonic() - t0 < 30 and len(got.read_text().split() if got.exists() else []) < 2:
    time.sleep(0.02)
time.sleep(0.3)  # a third signal would still be counted
"""

_GROUP_RECIPE = """
import sys
from pathlib import Path
from dflash_trainer.recipe import child
child.command = lambda args: [sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]]
try:
    child.run_child("train", [], Path(sys.argv[4]))
except child.Stopped as e:
    sys.exit(e.exit_code)
"""


def test_ctrl_c_in_a_terminal_reaches_the_stage_once_as_sigint_then_as_sigterm(tmp_path):
    """A terminal's Ctrl-C signals the whole process group: the stage gets that SIGINT and the recipe's
    forwarded signal, which must not be a second SIGINT (train would exit at once without its checkpoint): it
    is SIGTERM. The recipe exits 130."""
    import subprocess

    got, started = tmp_path / "got", tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", _GROUP_RECIPE, _GROUP_CHILD, str(got), str(started),
                             str(tmp_path / "s.log")], start_new_session=True)
    t0 = time.monotonic()
    while not started.exists():
        assert proc.poll() is None and time.monotonic() - t0 < 60
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert sorted(got.read_text().split()) == ["SIGINT", "SIGTERM"]


def test_the_recipe_command_exits_with_the_stopping_signal_s_code(tmp_path, monkeypatch):
    """`dflash-train recipe` stopped by Ctrl-C exits 130 and by SIGTERM 143, saying how to resume."""
    from typer.testing import CliRunner

    import dflash_trainer.recipe.run as recipe_run
    from dflash_trainer.cli.main import app
    from dflash_trainer.recipe.child import Stopped

    for signum, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        def stopped(*_a, signum=signum):
            raise Stopped("stopped during train; run the same command to resume", signum)

        monkeypatch.setattr(recipe_run, "run_recipe", stopped)
        r = CliRunner().invoke(app, ["recipe", "--out", str(tmp_path / "r"), "--gpu-memory-gib", "0"])
        assert r.exit_code == code, r.output
        assert "run the same command to resume" in r.output


def test_a_train_record_keyed_with_plan_only_settings_stays_valid():
    """A train record whose key held the feature cache size and checkpoint interval (left out of the key since:
    they do not change the drafter) is the same training; one with other steps, or a record whose weights sample
    differs, is not. The record's own form is kept, so its hash stays what the stages after it were keyed on."""
    from dflash_trainer.recipe.records import key_hash
    from dflash_trainer.recipe.records import recorded_form, same_inputs

    base = ["data.seq_len=4096", "optim.max_steps=6000", "drafter.block_size=16"]
    old = {"prepare": "p" * 64, "config": None, "target": "embedded smollm2-135m",
           "sets": [*base[:1], "target.feature_cache_gib=108", *base[1:2], "runtime.save_every=500", *base[2:]]}
    new = {**old, "sets": base}
    rec = {"hash": key_hash(old), "key": old}
    assert same_inputs(old, new) and recorded_form(new, None, rec) == old
    assert recorded_form({**new, "sets": [*base, "target.feature_cache_gib=56"]}, rec) == old  # a smaller card
    steps = {**new, "sets": ["data.seq_len=4096", "optim.max_steps=1225", "drafter.block_size=16"]}
    assert not same_inputs(old, steps) and recorded_form(steps, rec) == steps
    assert recorded_form(new, {"hash": "x" * 64, "key": old}) == new  # a record whose hash is not its key's
    # the weights sample: left out only against a record made before keys held it
    assert same_inputs(old, {**new, "weights": "w" * 64})
    assert not same_inputs({**old, "weights": "v" * 64}, {**new, "weights": "w" * 64})


def test_a_mixture_record_keyed_by_its_spec_file_still_matches():
    """--spec's mixture key is the spec's build digest; `spec_file` (the file's digest) is left out of the
    comparison, so a comment rebuilds nothing, and a record from before build-digest keys, whose `spec` was that
    file digest, is the same mixture (its form and hash kept, so the regeneration keyed on it is not redone)."""
    from dflash_trainer.recipe.records import key_hash, recorded_form, same_inputs

    new = {"spec": "build " + "b" * 64, "text": None, "leak_rules": 3, "spec_file": "f" * 64}
    old = {"spec": "f" * 64, "text": None, "leak_rules": 3}
    assert same_inputs(old, new) and recorded_form(new, {"hash": key_hash(old), "key": old}) == old
    assert same_inputs({**new, "spec_file": "e" * 64}, new)  # the same build, its file edited (a comment)
    assert not same_inputs({**old, "spec": "e" * 64}, new)  # another file: another spec
    assert not same_inputs({**new, "spec": "build " + "c" * 64}, new)  # another build
    assert not same_inputs({**old, "leak_rules": 2}, new)  # built under other leak rules


def test_spec_keys_follow_the_build_and_the_weights(tmp_path):
    """The stage keys of a --spec run: a comment leaves the mixture's and prepare's keys the same inputs, a weight
    changes prepare's only, a count changes the mixture's (recipe/stages.py mixture_key, prepare_key)."""
    from types import SimpleNamespace

    from dflash_trainer.recipe.records import same_inputs
    from dflash_trainer.recipe.stages import mixture_key, prepare_key

    spec = tmp_path / "spec.yaml"
    chats = tmp_path / "c.jsonl"
    chats.write_text("")

    def keys(text):
        spec.write_text(text)
        ctx = SimpleNamespace(settings=SimpleNamespace(spec=str(spec), target=None), hashes={"regenerate": "r" * 64},
                              plan=SimpleNamespace(seq_len=128))
        return mixture_key(ctx), prepare_key(ctx)

    m0, p0 = keys(f"seed: 0\nsources:\n  - name: {chats}\n    count: 5\n")
    m1, p1 = keys(f"# a comment\nseed: 0\nsources:\n  - name: {chats}\n    count: 5\n")
    assert m0["spec_file"] != m1["spec_file"] and same_inputs(m0, m1) and same_inputs(p0, p1)
    m2, p2 = keys(f"seed: 0\nsources:\n  - name: {chats}\n    count: 5\n    weight: 2\n")
    assert same_inputs(m0, m2) and not same_inputs(p0, p2) and p2["spec_weights"] == {str(chats): 2.0}
    m3, _ = keys(f"seed: 0\nsources:\n  - name: {chats}\n    count: 6\n")
    assert not same_inputs(m0, m3)


def test_a_stage_out_of_memory_names_the_recipe_s_flag(tmp_path, monkeypatch):
    """A regenerate stage that ran out of GPU memory (its log: an earlier attempt, then this one) makes the recipe
    name --gpu-memory-gib with a plan of fewer rows, read from the last attempt's message only."""
    from typer.testing import CliRunner

    import dflash_trainer.recipe.run as recipe_run
    from dflash_trainer.cli.main import app
    from dflash_trainer.recipe.child import StageFailed

    log = tmp_path / "regenerate.log"
    log.write_text("\n$ dflash-train regenerate ...\nerror: some other failure\n"
                   "\n$ dflash-train regenerate ...\nerror: out of GPU memory in regenerate: ... (torch: Tried to "
                   "allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 512.00 MiB is free.)\n")

    def failed(*_a):
        raise StageFailed("regenerate", 1, log)

    monkeypatch.setattr(recipe_run, "run_recipe", failed)
    r = CliRunner().invoke(app, ["recipe", "--out", str(tmp_path / "r"), "--gpu-memory-gib", "78.66"])
    assert r.exit_code != 0
    text = " ".join(r.output.split())
    assert "--gpu-memory-gib 63, which plans regeneration rows 1,024 → 512" in text, r.output
    log.write_text("\n$ dflash-train regenerate ...\nerror: out of GPU memory in regenerate\n"
                   "\n$ dflash-train regenerate ...\nerror: some other failure\n")
    r = CliRunner().invoke(app, ["recipe", "--out", str(tmp_path / "r"), "--gpu-memory-gib", "78.66"])
    assert "--gpu-memory-gib" not in " ".join(r.output.split())  # the last attempt failed otherwise
