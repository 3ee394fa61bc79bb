"""`dflash-train recipe` end to end on CPU with the tiny target: every stage runs and REPORT.md is written;
a second run redoes nothing; a recipe killed during regenerate or stopped during train resumes without
redoing finished work."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dflash_trainer.recipe.records import key_hash
from tests.integration.tiny_run import cli_env, make_chats, make_target

TINY = ("seq_len=128", "num_anchors=16", "num_layers=1", "target_layer_ids=[0,2]", "block_size=8", "save_every=2")


def recipe_cmd(out, target, chats, *extra, steps=6):
    sets = [a for s in TINY for a in ("--set", s)]
    return [sys.executable, "-m", "dflash_trainer.cli.main", "recipe", "--out", str(out), "--target", str(target),
            "--data", str(chats), "--gpu-memory-gib", "0", "--steps", str(steps), *sets, *extra]


def run(cmd, timeout=240):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cli_env())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("recipe")
    return d, make_target(d / "target"), make_chats(d / "chats.jsonl", 12)


def test_recipe_end_to_end_then_nothing_to_redo(tiny):
    d, target, good = tiny
    out = d / "run"
    chats = d / "chats-and-two-bad.jsonl"  # 12 conversations, then a record with an unknown role and a broken line
    chats.write_text(good.read_text() + json.dumps({"messages": [{"role": "usr", "content": "w3"}]}) + "\n{not json\n")
    r = run(recipe_cmd(out, target, chats))
    assert r.returncode == 0, r.stdout + r.stderr
    # what the stages warn of reaches the recipe's console: the skipped records, with what they lack, by line
    out_text = " ".join(r.stdout.split())
    assert ("[recipe] regenerate: warning: 2 of 14 input records skipped, not answered: invalid_json 1 (each line must "
            "be one JSON object; e.g. line 14), unknown_role 1 (roles are system, human, user, gpt, assistant") in out_text
    assert "e.g. line 13)" in out_text and "[recipe] train: warning: the validation split holds 1 row (fewer than 8)" in out_text
    # it ends by saying τ, the speedup to serve and the serving line (from report.json)
    assert "[recipe] τ (T = 0), drafter: mt-bench " in r.stdout and "[recipe] speedup at batch 1: " in r.stdout
    assert "[recipe] serve: vllm serve " in r.stdout
    # a target folder whose config names no hub id: said with the plan, before any stage
    assert "[recipe] plan: warning: the target's files do not say its hub id, so the speculators export names it " \
           "'target'" in out_text
    for stage in ("regenerate", "prepare", "train", "eval", "export", "report"):
        rec = json.loads((out / "stages" / f"{stage}.json").read_text())
        assert len(rec["hash"]) == 64 and (out / "logs" / f"{stage}.log").exists() or stage == "report"
    md = (out / "REPORT.md").read_text()
    assert "| drafter |" in md and "vllm serve" in md and "sharegpt-heldout" in md
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.png").exists() and report["tau"]["drafter"]
    # the result carries where and with what it was made, and the regeneration's counts
    assert report["provenance"]["versions"]["torch"] and "git_sha" in report["provenance"]
    assert report["regenerate_report"]["records_read"] == 14 and report["mixture_report"] is None
    assert "torch " in md
    # τ by turn, ending and category (MT-Bench's categories) for each suite
    assert "- drafter, mt-bench: turn 1 " in md and "- drafter, humaneval: turn 1 " in md and "| writing " in md
    breakdown = report["tau"]["drafter"]["mt-bench"]["tau_breakdown"]
    assert set(breakdown) == {"by_turn", "by_stop", "by_turn_and_stop", "by_category"}
    assert sum(g["turns"] for g in breakdown["by_turn"].values()) == report["tau"]["drafter"]["mt-bench"]["num_turns"]
    assert (out / "export-zlab" / "config.json").exists() and (out / "export-speculators" / "config.json").exists()
    # the drafter's speedup table (batch 1 on CPU) reaches the report and both exports' speculation sidecars
    table = json.loads((out / "speedup" / "drafter-mt-bench.json").read_text())["speedup_table"]
    assert [row["batch_size"] for row in table] == [1] and report["speedup_table"] == table
    assert "## Speedup by batch size" in md and f"| 1 | " in md
    for fmt in ("zlab", "speculators"):
        side = json.loads((out / f"export-{fmt}" / "speculation.json").read_text())
        assert side["measured"] is True and [r["batch_size"] for r in side["by_batch_size"]] == [1]
        assert side["source"]["same_drafter"] is True  # the bf16 export is the drafter the table measured
    # the stages' records name the run folder's files relative to themselves, never by this machine's path
    records = [*(out / "eval").glob("*.json"), *(out / "speedup").glob("*.json"), out / "data" / "prepare_report.json",
               out / "drafter" / "train_config.json", out / "drafter" / "summary.json",
               *(out / "drafter" / "checkpoint-final").glob("*.json")]
    assert len(records) >= 8 and all(p.exists() for p in records)
    for p in records:  # (a provenance's argv is the command as the recipe ran it: a log line, kept as it was)
        body = json.loads(p.read_text())
        for prov in (body.get("provenance"), (body.get("drafter") or {}).get("provenance")):
            if isinstance(prov, dict):
                prov.pop("argv", None)
        assert str(out) not in json.dumps(body), p
    assert json.loads((out / "drafter" / "train_config.json").read_text())["data"]["prepared"] == "../data"
    assert json.loads((out / "data" / "prepare_report.json").read_text())["data_path"] == "../regen.jsonl"
    assert json.loads((out / "eval" / "drafter-mt-bench.json").read_text())["drafter"]["path"] == \
        "../drafter/checkpoint-final"
    again = run(recipe_cmd(out, target, chats))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "[recipe] every stage" in again.stdout and "done in" not in again.stdout
    # the records name their outputs relative to RUN: the folder moved elsewhere still has nothing to redo
    assert json.loads((out / "stages" / "prepare.json").read_text())["outputs"]["prepared"] == "data"
    assert json.loads((out / "stages" / "regenerate.json").read_text())["outputs"]["regen"] == "regen.jsonl"
    moved = d / "moved-run"
    out.rename(moved)
    third = run(recipe_cmd(moved, target, chats))
    assert third.returncode == 0, third.stdout + third.stderr
    # ... but the report: its serving lines now name the exports where the folder is
    for stage in ("regenerate", "prepare", "train", "eval", "export"):
        assert f"[recipe] {stage}: finished with the same inputs, skipped" in third.stdout, (stage, third.stdout)
    assert "[recipe] report: done in" in third.stdout, third.stdout
    moved_md = (moved / "REPORT.md").read_text()
    assert str(moved / "export-zlab") in moved_md and str(out / "export-zlab") not in moved_md
    assert json.loads((moved / "report.json").read_text())["serve"][0].count(str(moved / "export-zlab")) == 1
    again_moved = run(recipe_cmd(moved, target, chats))
    assert "[recipe] every stage" in again_moved.stdout, again_moved.stdout + again_moved.stderr
    # a finished regeneration made at other batch rows and time cap (another card's plan) is reused, not redone,
    # and the stages keyed on it stay finished: the run's records rewritten as if the regeneration had had those
    # settings (its hash, and each later key naming an earlier hash, redone in stage order)
    renamed = {}
    for stage in ("regenerate", "prepare", "train", "eval", "export", "report"):
        rec_path = moved / "stages" / f"{stage}.json"
        rec = json.loads(rec_path.read_text())
        if stage == "regenerate":
            rec["key"].update(batch_size=4096, max_seconds=1.0)
        rec["key"] = {k: renamed.get(v, v) if isinstance(v, str) else v for k, v in rec["key"].items()}
        renamed[rec["hash"]] = rec["hash"] = key_hash(rec["key"])
        rec_path.write_text(json.dumps(rec))
    regen_mtime = (moved / "regen.jsonl").stat().st_mtime_ns
    fourth = run(recipe_cmd(moved, target, chats))
    assert fourth.returncode == 0, fourth.stdout + fourth.stderr
    assert "regenerate: every prompt answered at other batch rows / time cap (4096 rows): reused" in fourth.stdout
    assert "[recipe] every stage" in fourth.stdout and "done in" not in fourth.stdout, fourth.stdout
    assert (moved / "regen.jsonl").stat().st_mtime_ns == regen_mtime
    # a CPU plan says, on the console and in the report, that its drafter is not a useful one
    assert "not a useful drafter" in r.stdout and "not a useful drafter" in md and "40 steps" not in md


def _wait(cond, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_killed_in_regenerate_and_stopped_in_train_resume(tiny):
    d, target, chats = tiny
    out = d / "killed"
    # 40 steps: the tiny run trains ~60 steps a second, and at 8 it could finish all of them between the
    # third metrics line and the SIGTERM (then nothing is left to resume)
    cmd = recipe_cmd(out, target, chats, "--until", "train", steps=40)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(), start_new_session=True)
    _wait(lambda: (out / "regen.jsonl.partial.jsonl").exists(), proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the recipe and its regenerate child, mid-stage
    proc.wait(timeout=30)
    assert not (out / "stages" / "regenerate.json").exists()
    # again, stopped by SIGTERM during training (train checkpoints, the recipe stops without a record)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    metrics = out / "drafter" / "metrics.jsonl"
    _wait(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stdout + stderr
    assert "regenerate: resuming" in stdout
    assert (out / "stages" / "prepare.json").exists() and not (out / "stages" / "train.json").exists()
    r = run(cmd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "regenerate: finished with the same inputs" in r.stdout and "prepare: finished" in r.stdout
    assert "train: resuming" in r.stdout
    assert "stopped after train as asked (--until)" in r.stdout and "REPORT.md" not in r.stdout
    assert "resumed from" in (out / "logs" / "train.log").read_text()
    assert json.loads((out / "stages" / "train.json").read_text())["outputs"]["summary"]["steps"] == 40


def test_sampled_answers_regenerate_and_prepare_by_prompt(tiny):
    """--regen-samples 2 --regen-temperature 0.8 on the tiny target: every conversation is answered twice
    (records "sample" 0 and 1 under its id), the stage key records the sampling, and prepare keeps both
    samples of a prompt in one split (validation ids hold whole prompts: 2 records each)."""
    d, target, chats = tiny
    out = d / "sampled"
    r = run(recipe_cmd(out, target, chats, "--regen-samples", "2", "--regen-temperature", "0.8", "--until", "prepare"))
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(x) for x in (out / "regen.jsonl").read_text().splitlines()]
    by_id: dict = {}
    for rec in records:
        by_id.setdefault(rec["id"], []).append(rec["sample"])
    assert len(by_id) == 12 and all(sorted(s) == [0, 1] for s in by_id.values())
    key = json.loads((out / "stages" / "regenerate.json").read_text())["key"]
    assert key["samples"] == 2 and key["temperature"] == 0.8
    report = json.loads((out / "data" / "prepare_report.json").read_text())
    assert report["conversations_validation"] == 2 * len(report["validation_ids"]) > 0
    assert report["conversations_train"] + report["conversations_validation"] == report["conversations_kept"]


def test_a_chat_template_file_reaches_every_stage_that_renders(tiny):
    """--chat-template: regenerate and prepare get the file, the drafter records its text (what eval and the
    exports render with); the stages' keys carry its digest."""
    d, target, chats = tiny
    template = d / "other.jinja"
    template.write_text("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                        "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    out = d / "templated"
    r = run(recipe_cmd(out, target, chats, "--chat-template", str(template), "--until", "train"))
    assert r.returncode == 0, r.stdout + r.stderr
    for stage in ("regenerate", "prepare"):
        assert f"--chat-template {template}" in (out / "logs" / f"{stage}.log").read_text()
    assert json.loads((out / "stages" / "regenerate.json").read_text())["key"]["chat_template"]
    cfg = json.loads((out / "drafter" / "checkpoint-final" / "config.json").read_text())
    assert cfg["dflash"]["chat_template"] == template.read_text()


def test_a_spec_is_built_once_and_its_weights_reach_prepare(tiny):
    """--spec with a chat-file source: the mixture is built and keyed by the spec's build digest (a comment
    changes nothing), and prepare applies the sources' weights (a new weight redoes prepare only)."""
    from dflash_trainer.data.mixture.leaks import EvalIndex

    try:
        EvalIndex.load()  # the mixture's eval-leak check reads MT-Bench and HumanEval (make setup installs them)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    d, target, chats = tiny
    spec = d / "spec.yaml"
    spec.write_text(f"seed: 0\nsources:\n  - name: {chats}\n    weight: 1\n")
    out = d / "spec-run"
    cmd = [a for a in recipe_cmd(out, target, chats, "--until", "prepare") if a != str(chats)]
    cmd[cmd.index("--data")] = "--spec"
    cmd.insert(cmd.index("--spec") + 1, str(spec))
    r = run(cmd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"--spec {spec}" in (out / "logs" / "prepare.log").read_text()
    def copies():
        return json.loads((out / "data" / "prepare_report.json").read_text())["spec"]["sources"][str(chats)]["copies"]

    assert copies() == 12
    spec.write_text(f"# a comment\nseed: 0\nsources:\n  - name: {chats}\n    weight: 1\n")
    r = run(cmd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mixture: finished with the same inputs" in r.stdout and "prepare: finished with the same inputs" in r.stdout
    spec.write_text(f"seed: 0\nsources:\n  - name: {chats}\n    weight: 2\n")
    r = run(cmd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mixture: finished with the same inputs" in r.stdout and "regenerate: finished with the same inputs" in r.stdout
    assert "prepare: finished with the same inputs" not in r.stdout
    assert copies() == 24  # each conversation twice in the rows
