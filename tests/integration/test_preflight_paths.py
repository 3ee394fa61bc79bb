"""Every path flag of every command is checked for what it must be before any heavy work: one line
naming the flag, what the path is and what the flag expects, exit 2, and no run folder left.

The commands run in this process (typer's CliRunner) with every heavy step replaced by a tripwire
(`tripwires`): the target and tokenizer loads, data preparation, the training run, eval, export,
regeneration, the report plot. A refusal that came after one of them would show the tripwire's AssertionError
(exit 1), not the preflight's line (exit 2); the accepted cases below reach a tripwire, so the
checks do not refuse good paths either. A fresh interpreter proves no torch/transformers import
happens before a refusal, and a few real CLI processes prove the exit code and stderr. The
folders here are hand-written config.json files and empty weight files: no model is built.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_trainer.cli.main import app

CLI = [sys.executable, "-m", "dflash_trainer.cli.main"]
HEAVY = ("torch", "transformers", "datasets", "safetensors")
SPEC = Path(__file__).parents[2] / "configs" / "mixture-smollm2.yaml"


class Tripwire(AssertionError):
    """Raised by a heavy step that a refused command must never reach."""


def _write(path: Path, body) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


def _drafter(folder: Path, config: dict) -> Path:
    _write(folder / "config.json", config)
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    """One folder of each kind the flags tell apart (see preflight.paths.what_is)."""
    d = tmp_path_factory.mktemp("preflight")
    _write(d / "target" / "config.json", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    _write(d / "target" / "tokenizer.json", "{}")
    _write(d / "notok" / "config.json", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    _write(d / "bert" / "config.json", {"architectures": ["BertModel"], "model_type": "bert"})
    _drafter(d / "zlab", {"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 5},
                          "dflash_trainer": {"target": "org/base-model"}})
    _drafter(d / "speculators", {"speculators_model_type": "dflash"})
    _drafter(d / "run" / "checkpoint-final", {"dflash": {"target": "tiny"}, "target_layer_ids": [0]})
    _write(d / "run" / "train_config.json", {"format_version": 2, "target": {"path": str(d / "target")}})
    _drafter(d / "run2" / "checkpoint-3", {"dflash": {}, "target_layer_ids": [0]})  # unfinished run
    _write(d / "prepared" / "train" / "state.json", "{}")
    _write(d / "pre" / "data" / "train" / "state.json", "{}")  # `prepare --out pre/data` before `train --out pre`
    _write(d / "chats.jsonl", '{"conversations": []}\n')
    _write(d / "notes.txt", "hello, not JSON\n")
    _write(d / "lfs.gguf", "version https://git-lfs.github.com/spec/v1\n")
    _write(d / "ggufs" / "m.Q4.gguf", "GGUF")
    _write(d / "other.json", {"a": 1})
    _write(d / "drafter.json", {"hidden_size": 8, "target_layer_ids": [0]})
    _write(d / "broken.yaml", "seq_len: [1, 2\n")
    _write(d / "list.yaml", "- a\n- b\n")
    (d / "empty").mkdir()
    return d


@pytest.fixture
def tripwires(monkeypatch):
    """Every heavy step raises Tripwire (the CLI imports them when a command runs, so the patched
    module attributes are the ones it calls)."""
    import dflash_trainer.data.prepare as prepare
    import dflash_trainer.evaluation.run as eval_run
    import dflash_trainer.drafter.shape as cft
    import dflash_trainer.interop.export as export
    import dflash_trainer.target_model.load as load
    import dflash_trainer.telemetry.report as report
    import dflash_trainer.pipeline.launch as pipeline
    import dflash_trainer.training.run as run

    def wire(name):
        def tripped(*args, **kwargs):
            raise Tripwire(f"{name} ran before the preflight refused")
        return tripped

    for module, name in ((load, "load_target"), (load, "load_tokenizer"), (prepare, "prepare_dataset"),
                         (run, "train"), (run, "resolve_device"), (pipeline, "run_pipeline"),
                         (cft, "load_target_config"), (eval_run, "run_eval"), (export, "export_drafter"),
                         (report, "write_report")):
        monkeypatch.setattr(module, name, wire(f"{module.__name__}.{name}"))


def _train(*args: str) -> list[str]:
    return ["train", "--out", "{d}/r", "--device", "cpu", *args]


CASES = {
    "--target folder without config.json": (_train("--target", "{d}/empty"),
                                            "--target {d}/empty is an empty folder, not a target model"),
    "--target without tokenizer": (_train("--target", "{d}/notok"), "--target {d}/notok is a target model folder "
                                                                     "(LlamaForCausalLM) without tokenizer files"),
    "--target not a causal LM": (_train("--target", "{d}/bert"),
                                 "config.json is no causal LM (architectures ['BertModel'])"),
    "--target zlab export": (_train("--target", "{d}/zlab"),
                             "--target {d}/zlab is a drafter (zlab export), not a target model: pass the target the "
                             "drafter was trained for (org/base-model)"),
    "--target speculators export": (_train("--target", "{d}/speculators"),
                                    "--target {d}/speculators is a drafter (speculators export), not a target model"),
    "--target checkpoint": (_train("--target", "{d}/run/checkpoint-final"),
                            "is a drafter (dflash-train checkpoint), not a target model"),
    "--target run folder": (_train("--target", "{d}/run"),
                            "--target {d}/run is a run folder of `dflash-train train`, not a target model: pass the "
                            "target the run trained with ({d}/target)"),
    "--target hub id": (_train("--target", "Qwen/Qwen3-8B"),
                        "--target Qwen/Qwen3-8B is no local path and looks like a Hugging Face hub id; dflash-train reads local "
                        "files only and downloads nothing"),
    "--target missing": (_train("--target", "{d}/nowhere"), "--target {d}/nowhere: path not found"),
    "--target LFS pointer": (_train("--target", "{d}/lfs.gguf"), "does not start with GGUF"),
    "--target GGUF folder": (_train("--target", "{d}/ggufs"),
                             "pass the file itself, e.g. --target {d}/ggufs/m.Q4.gguf"),
    "--init-from target": (_train("--target", "{d}/target", "--init-from", "{d}/target"),
                           "--init-from {d}/target is a target model folder (LlamaForCausalLM), not a drafter folder"),
    "--init-from run folder": (_train("--target", "{d}/target", "--init-from", "{d}/run"),
                               "pass one of its checkpoints, e.g. --init-from {d}/run/checkpoint-final"),
    "--init-from empty": (_train("--target", "{d}/target", "--init-from", "{d}/empty"),
                          "--init-from {d}/empty is an empty folder, not a drafter folder (no config.json)"),
    "--init-from and --drafter-config": (_train("--target", "{d}/target", "--init-from", "{d}/zlab",
                                                "--drafter-config", "{d}/drafter.json"), "drop drafter_config"),
    "--out under a file": (["train", "--out", "{d}/notes.txt/run", "--target", "{d}/target"],
                           "--out {d}/notes.txt/run: {d}/notes.txt is a file, not a folder"),
    "--out a drafter": (["train", "--out", "{d}/zlab", "--target", "{d}/target"],
                        "--out {d}/zlab is a drafter (zlab export), not a run folder"),
    "--out a busy folder": (["train", "--out", "{d}", "--target", "{d}/target"],
                            "not a run folder: choose a new folder"),
    "--data hub id": (_train("--target", "{d}/target", "--data", "org/chats"),
                      "--data org/chats is no local path and looks like a Hugging Face hub id; dflash-train reads local "
                      "files only and downloads nothing"),
    "--data missing": (_train("--target", "{d}/target", "--data", "{d}/missing.jsonl"),
                       "--data {d}/missing.jsonl: file not found"),
    "--data prepared folder": (_train("--target", "{d}/target", "--data", "{d}/prepared"),
                               "not a chat file: pass it as --prepared"),
    "--data not JSON": (_train("--target", "{d}/target", "--data", "{d}/notes.txt"),
                        "--data {d}/notes.txt is a file starting with 'hello, not JSON', not a JSON/JSONL chat file"),
    "--prepared chat file": (_train("--target", "{d}/target", "--prepared", "{d}/chats.jsonl"),
                             "--prepared {d}/chats.jsonl is a JSON/JSONL file, not a prepared-data folder"),
    "--prepared run folder": (_train("--target", "{d}/target", "--prepared", "{d}/run"),
                              "--prepared {d}/run is a run folder"),
    "--prepared missing": (_train("--target", "{d}/target", "--prepared", "{d}/nowhere"),
                           "--prepared {d}/nowhere: not found; run `dflash-train prepare"),
    "--drafter-config drafter folder": (_train("--target", "{d}/target", "--drafter-config", "{d}/zlab"),
                                        "pass the folder as --init-from"),
    "--drafter-config other JSON": (_train("--target", "{d}/target", "--drafter-config", "{d}/other.json"),
                                    "without hidden_size and target_layer_ids, not a drafter config"),
    "--set layer_types": (_train("--target", "{d}/target", "--set", "layer_types=bogus"),
                          "layer_types: unknown entry 'bogus'"),
    "--config missing": (["train", "--config", "{d}/missing.yaml", "--out", "{d}/r"],
                         "--config {d}/missing.yaml: file not found"),
    "--config broken YAML": (["train", "--config", "{d}/broken.yaml", "--out", "{d}/r"], "not valid YAML (line 2)"),
    "--config YAML list": (["train", "--config", "{d}/list.yaml", "--out", "{d}/r"],
                           "holds a YAML list, not a mapping"),
    "init-config --layer-types": (["init-config", "--out", "{d}/r/ic.json", "--target", "{d}/target", "--layer-types",
                                   "bogus"], "--layer-types 'bogus': unknown entry 'bogus'"),
    "init-config --target drafter": (["init-config", "--out", "{d}/r/ic.json", "--target", "{d}/speculators"],
                                     "is a drafter (speculators export), not a target model"),
    "init-config --out folder": (["init-config", "--out", "{d}/empty", "--target", "{d}/target"],
                                 "--out {d}/empty is a folder, not a file"),
    "prepare --target run": (["prepare", "--out", "{d}/r", "--target", "{d}/run", "--data", "{d}/chats.jsonl"],
                             "--target {d}/run is a run folder"),
    "prepare --out a drafter": (["prepare", "--out", "{d}/zlab", "--target", "{d}/target", "--data", "{d}/chats.jsonl"],
                                "--out {d}/zlab: exists and is not empty (a drafter (zlab export))"),
    "eval --drafter target": (["eval", "--drafter", "{d}/target", "--target", "{d}/target"],
                              "--drafter {d}/target is a target model folder (LlamaForCausalLM), not a drafter folder"),
    "eval --drafter unfinished run": (["eval", "--drafter", "{d}/run2", "--target", "{d}/target"],
                                      "pass one of its checkpoints, e.g. --drafter {d}/run2/checkpoint-3"),
    "eval --target drafter": (["eval", "--drafter", "{d}/zlab", "--target", "{d}/zlab"],
                              "--target {d}/zlab is a drafter (zlab export), not a target model"),
    "eval --dataset hub id": (["eval", "--drafter", "{d}/zlab", "--target", "{d}/target", "--dataset", "org/prompts"],
                              "--dataset org/prompts is no local path and looks like a Hugging Face hub id"),
    "eval --json under a file": (["eval", "--drafter", "{d}/zlab", "--target", "{d}/target", "--json",
                                  "{d}/notes.txt/eval.json"],
                                 "--json {d}/notes.txt/eval.json: {d}/notes.txt is a file"),
    "export SOURCE target": (["export", "{d}/target", "--format", "zlab", "--out", "{d}/r"],
                             "SOURCE {d}/target is a target model folder (LlamaForCausalLM), not a drafter folder"),
    "export --out under a file": (["export", "{d}/zlab", "--format", "speculators", "--out", "{d}/notes.txt/x"],
                                  "--out {d}/notes.txt/x: {d}/notes.txt is a file, not a folder"),
    "regenerate --target drafter": (["regenerate", "--data", "{d}/chats.jsonl", "--out", "{d}/r/x.jsonl", "--target",
                                     "{d}/run/checkpoint-final"], "is a drafter (dflash-train checkpoint)"),
    "regenerate --data folder": (["regenerate", "--data", "{d}/prepared", "--out", "{d}/r/x.jsonl", "--target",
                                  "{d}/target"], "--data {d}/prepared is a prepared-data folder"),
    "mixture --out under a file": (["mixture", "--spec", str(SPEC), "--out", "{d}/notes.txt/mix.jsonl"],
                                   "--out {d}/notes.txt/mix.jsonl: {d}/notes.txt is a file"),
    "recipe --target misspelt name": (["recipe", "--out", "{d}/r", "--target", "smollm2-135M"],
                                      "--target smollm2-135M: path not found; did you mean smollm2-135m?"),
    "recipe --target folder": (["recipe", "--out", "{d}/r", "--target", "{d}/empty"],
                               "--target {d}/empty is an empty folder, not a target model"),
    "recipe --target without weights": (["recipe", "--out", "{d}/r", "--target", "{d}/target"],
                                        "--target {d}/target: the folder holds config.json but no weights"),
    "recipe --data not JSON": (["recipe", "--out", "{d}/r", "--data", "{d}/notes.txt"],
                               "--data {d}/notes.txt is a file starting with 'hello, not JSON'"),
    "report RUN_DIR target": (["report", "{d}/target"],
                              "RUN_DIR {d}/target is a target model folder (LlamaForCausalLM), not a run folder"),
    "report --png under a file": (["report", "{d}/run", "--png", "{d}/notes.txt/r.png"],
                                  "--png {d}/notes.txt/r.png: {d}/notes.txt is a file"),
    "bench regenerate --target drafter": (["bench", "regenerate", "--target", "{d}/zlab"],
                                          "is a drafter (zlab export)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_path_flags_are_refused_before_any_heavy_step(d, tripwires, case):
    """Prevents a wrong path being found out only after a model load, a tokenizer load or data
    preparation (a drafter passed as --target loaded as a random-headed Qwen3 for 4 minutes), a
    message that does not name the flag, and a run folder made by a start that was refused."""
    args, needle = CASES[case]
    r = CliRunner().invoke(app, [a.format(d=d) for a in args])
    text = " ".join(r.output.split())
    assert not isinstance(r.exception, Tripwire), r.exception
    assert r.exit_code == 2, (r.exit_code, text, r.exception)
    assert text.startswith("error: ") and needle.format(d=d) in text, text
    assert not (d / "r").exists()


ACCEPTED = {  # good paths pass the preflight and reach the first heavy step
    "train": (_train("--target", "{d}/target", "--prepared", "{d}/prepared", "--init-from", "{d}/zlab"), "train"),
    "train --out holding prepared rows": (["train", "--out", "{d}/pre", "--target", "{d}/target", "--prepared",
                                           "{d}/pre/data", "--device", "cpu"], "train"),
    "train --data": (_train("--target", "{d}/target", "--data", "{d}/chats.jsonl",
                            "--drafter-config", "{d}/drafter.json"), "train"),
    "prepare": (["prepare", "--out", "{d}/r", "--target", "{d}/target", "--data", "{d}/chats.jsonl"], "load_tokenizer"),
    "init-config": (["init-config", "--out", "{d}/r/ic.json", "--target", "{d}/ggufs/m.Q4.gguf"], "load_target_config"),
    "eval run folder": (["eval", "--drafter", "{d}/run", "--target", "{d}/target", "--dataset", "{d}/chats.jsonl"],
                        "run_eval"),
    "export speculators": (["export", "{d}/speculators", "--format", "zlab", "--out", "{d}/r"], "export_drafter"),
    "report": (["report", "{d}/run"], "write_report"),
    "regenerate": (["regenerate", "--data", "{d}/chats.jsonl", "--out", "{d}/r/x.jsonl", "--target", "{d}/target"],
                   "resolve_device"),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_good_paths_pass_the_preflight(d, tripwires, case):
    """Prevents a preflight that refuses what the loaders accept (each kind of drafter folder, a run
    folder for eval, a GGUF file, prepared rows, a chat file)."""
    args, step = ACCEPTED[case]
    r = CliRunner().invoke(app, [a.format(d=d) for a in args])
    assert isinstance(r.exception, Tripwire) and step in str(r.exception), (r.output, r.exception)


def test_no_heavy_import_before_a_refusal(d):
    """Prevents a refusal that waits for torch (~3 s) or transformers: in a fresh interpreter, after
    the refusals of each command, none of them is imported."""
    cases = [[a.format(d=d) for a in CASES[c][0]] for c in
             ("--target zlab export", "--out under a file", "init-config --layer-types", "eval --drafter target",
              "export SOURCE target", "--data hub id", "--prepared chat file", "regenerate --target drafter")]
    code = ("import json, sys\nfrom typer.testing import CliRunner\nfrom dflash_trainer.cli.main import app\n"
            f"codes = [CliRunner().invoke(app, a).exit_code for a in {cases!r}]\n"
            f"print(json.dumps([codes, [m for m in {HEAVY!r} if m in sys.modules]]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    codes, imported = json.loads(r.stdout.strip().splitlines()[-1])
    assert codes == [2] * len(cases) and imported == [], (codes, imported, r.stderr)


@pytest.mark.parametrize("case", ["--target zlab export", "--out under a file", "init-config --layer-types"])
def test_cli_process_prints_one_line_on_stderr_and_exits_2(d, case):
    """Prevents the line reaching stdout (where scripts parse results) or a traceback instead of it."""
    args, needle = CASES[case]
    r = subprocess.run(CLI + [a.format(d=d) for a in args], capture_output=True, text=True, timeout=120)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, err)
    assert err.startswith("error: ") and needle.format(d=d) in err and "Traceback" not in err, err
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (d / "r").exists()
