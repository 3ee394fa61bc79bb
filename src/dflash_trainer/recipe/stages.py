"""The recipe's stages: for each, the key its record hashes (settings + inputs), the outputs a redo
removes, and the body that runs the existing commands as child processes (recipe/child.py).

Keys: `mixture` the spec's build digest (or the packaged mixture's text); `regenerate` the prompts (the
mixture's record hash or --data's digest), the target and the regeneration settings; `prepare` the
regeneration's hash, seq_len, the target and the prepare format, with --spec its sources' weights;
`train` / `control` the prepared data's hash, the config file's digest and every --set; `eval` the
trainings' hashes and the eval settings; `export` the drafter's hash; `report` eval's and export's and the
--out path (its serving lines name it)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from dflash_trainer.recipe.child import run_child
from dflash_trainer.recipe.inputs import DEFAULT_MIXTURE, EMBEDDED_NAMES, FOLDER_WEIGHT_SUFFIXES
from dflash_trainer.recipe.machine import mixture_workers
from dflash_trainer.recipe.plan import Plan
from dflash_trainer.recipe.records import file_digest, same_inputs, train_key_sets
from dflash_trainer.recipe.settings import SUITES, RecipeSettings, RunPaths

CONTROL_SET = "experimental.no_target_features=true"
EXPORT_FORMATS = ("zlab", "speculators")


@dataclass
class Context:
    """What the stages share: settings, plan, paths, the finished records' hashes so far, the
    heartbeat the child runner calls (progress) and `say`, a line for the user (the recipe's console)."""

    settings: RecipeSettings
    plan: Plan
    paths: RunPaths
    hashes: dict[str, str] = field(default_factory=dict)
    heartbeat: Optional[Callable[[], None]] = None
    say: Callable[[str], None] = print
    said: set[tuple[str, str]] = field(default_factory=set)  # (stage, line) said (eval repeats a note per suite)

    def run(self, stage: str, args: list[str]) -> None:
        """Run one `dflash-train` command for `stage` (log RUN/logs/<stage>.log); its warnings and notes are
        said, each once."""
        for line in run_child(stage, args, self.paths.log(stage), self.heartbeat, run_root=self.paths.root):
            line = line.replace("--threads 1", "--set runtime.threads=1")  # eval's flag, as the recipe takes it
            if (stage, line) not in self.said:
                self.said.add((stage, line))
                self.say(f"[recipe] {stage}: {line}")

    def target_args(self) -> list[str]:
        return ["--target", self.settings.target] if self.settings.target else []

    def device(self) -> str:
        return self.plan.device


def target_id(target: Optional[str]) -> dict[str, Any]:
    """The target's part of a key: its name; for a folder the digest of its config and `weights_id` (weights
    retrained in place redo the stages); for a file its size and mtime (weights are too large to hash on every
    run)."""
    if target in EMBEDDED_NAMES:
        return {"target": "embedded smollm2-135m"}
    p = Path(str(target))
    if p.is_dir() and (p / "config.json").is_file():
        return {"target": str(p.resolve()), "config": file_digest(p / "config.json"), "weights": weights_id(p)}
    if p.is_file():
        st = p.stat()
        return {"target": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"target": str(target)}


WEIGHT_SUFFIXES = (*FOLDER_WEIGHT_SUFFIXES, ".gguf")
SAMPLE_BYTES = 1 << 20


def weights_id(folder: Path) -> str:
    """A digest of a model folder's weight files that changes when they are retrained in place and not when the
    same files are copied again (mtimes are not used): per file (sorted by name) its name, size and the sha256 of a MiB at
    its start, middle and end (a few MiB read, not the gigabytes of weights; retraining changes the tensors
    there). Changes confined to tensors between the samples are not seen: delete RUN/stages to redo."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(q for q in folder.iterdir() if q.is_file() and q.suffix in WEIGHT_SUFFIXES):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}:".encode())
        with f.open("rb") as fh:
            for at in (0, size // 2, size - SAMPLE_BYTES):
                fh.seek(max(0, at))
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


def _rm(*paths: Path) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


# ---- mixture ----
def mixture_key(ctx: Context) -> dict[str, Any]:
    """--spec: the spec's build digest (MixtureSpec.build_sha256: seed, dedupe, sources, options and the leak
    rules; not its comments, layout or weights, which change no record); the packaged mixture: its text."""
    spec = ctx.settings.spec
    from dflash_trainer.data.mixture.spec import LEAK_RULES_VERSION, load_spec

    if not spec:
        return {"spec": "packaged mixture-smollm2", "text": DEFAULT_MIXTURE, "leak_rules": LEAK_RULES_VERSION}
    # spec_file: what keys held before the build digest, so that such a record still matches (records.same_inputs)
    return {"spec": f"build {load_spec(spec).build_sha256()}", "text": None, "leak_rules": LEAK_RULES_VERSION,
            "spec_file": file_digest(spec)}


def mixture_outputs(p: RunPaths) -> list[Path]:
    return [p.prompts, p.prompts.with_name(p.prompts.name + ".report.json")]


def mixture_run(ctx: Context, resuming: bool) -> dict[str, Any]:
    _rm(*mixture_outputs(ctx.paths))  # the build is not resumable: start it again
    spec = ctx.settings.spec
    if not spec:
        ctx.paths.mixture_spec.write_text(DEFAULT_MIXTURE)
        spec = str(ctx.paths.mixture_spec)
    # the math generator and the code parsing on every CPU (at most 16): the records do not depend on it, nor the key
    ctx.run("mixture", ["mixture", "--spec", spec, "--out", str(ctx.paths.prompts), "--workers", str(mixture_workers())])
    return {"prompts": str(ctx.paths.prompts)}


# ---- regenerate ----
def regen_settings(plan: Plan, settings: RecipeSettings) -> dict[str, Any]:
    """What the regeneration runs with; sampling only when asked (RecipeSettings.regen_sampling)."""
    return {"max_new_tokens": plan.regen_max_new_tokens, "max_prompt_tokens": plan.regen_max_prompt_tokens,
            "batch_size": plan.regen_batch_rows, "max_seconds": plan.regen_max_seconds,
            "max_conversations": plan.regen_max_conversations, "device": plan.device, **settings.regen_sampling()}


def regen_key(ctx: Context) -> dict[str, Any]:
    data, template = ctx.settings.data, ctx.settings.chat_template
    src = {"data": file_digest(data)} if data else {"mixture": ctx.hashes["mixture"]}
    return {**src, **target_id(ctx.settings.target), **regen_settings(ctx.plan, ctx.settings),
            **({"chat_template": file_digest(template)} if template else {})}


def template_args(ctx: Context) -> list[str]:
    """`--chat-template FILE` for regenerate and prepare when the recipe was given one, else nothing."""
    return ["--chat-template", ctx.settings.chat_template] if ctx.settings.chat_template else []


def regen_outputs(p: RunPaths) -> list[Path]:
    return [p.regen, p.regen.with_name(p.regen.name + ".report.json"), p.regen.with_name(p.regen.name + ".partial.jsonl")]


def regen_args(ctx: Context, out: Path, max_seconds: float, first_record: int = 0) -> list[str]:
    plan = ctx.plan
    src = ctx.settings.data or str(ctx.paths.prompts)
    args = ["regenerate", "--data", src, "--out", str(out), *ctx.target_args(),
            "--max-new-tokens", str(plan.regen_max_new_tokens), "--max-prompt-tokens", str(plan.regen_max_prompt_tokens),
            "--batch-size", str(plan.regen_batch_rows), "--max-seconds", f"{max_seconds:g}",
            "--loop-ngram", "32", "--lookahead", "4", "--device", plan.device, *template_args(ctx)]
    if plan.regen_max_conversations:
        args += ["--max-conversations", str(plan.regen_max_conversations)]
    for name, value in ctx.settings.regen_sampling().items():  # repr: the key's exact temperature
        args += [f"--{name}", repr(value)]
    if first_record:
        args += ["--first-record", str(first_record)]
    return args


def regen_run(ctx: Context, resuming: bool) -> dict[str, Any]:
    """Regenerate into RUN/regen.jsonl; an unfinished one (its partial file) is continued by the same command.
    Not resuming (first run, or the inputs changed): what an earlier regeneration left is removed first."""
    if not resuming:
        _rm(*regen_outputs(ctx.paths))
    if ctx.paths.regen.exists() and not ctx.paths.regen.with_name(ctx.paths.regen.name + ".partial.jsonl").exists():
        pass  # this run's regeneration finished before the recipe could write its record: nothing to redo
    else:
        ctx.run("regenerate", regen_args(ctx, ctx.paths.regen, ctx.plan.regen_max_seconds))
    report = json.loads(ctx.paths.regen.with_name(ctx.paths.regen.name + ".report.json").read_text())
    check_answers(report, ctx.paths.regen)
    return {"regen": str(ctx.paths.regen), "records_read": report.get("records_read"),
            "next_record": report.get("next_record"), "stopped_at_max_seconds": report.get("stopped_at_max_seconds")}


def check_answers(report: dict[str, Any], regen: Path) -> None:
    """Raise RuntimeError when the regeneration wrote no record, naming why the records failed or were skipped,
    by count (regenerate's report); its empty output is removed first, so that a rerun (the stage has no
    finished record) regenerates again."""
    if report.get("records_written"):
        return
    why: dict[str, int] = {}
    for counts in (report.get("failed_by_reason") or {}, report.get("skipped_by_reason") or {}):
        for k, v in counts.items():
            why[k] = why.get(k, 0) + v
    said = ", ".join(f"{k} {v}" for k, v in sorted(why.items(), key=lambda kv: -kv[1])) or (
        "its time cap stopped it before any answer was done" if report.get("stopped_at_max_seconds")
        else "no input record")
    fix = (" (empty_response: the target's answers were empty or whitespace; check that its weights are trained "
           "and its chat template is the one it was trained with)" if "empty_response" in why else "")
    regen.unlink(missing_ok=True)  # so that a rerun regenerates (the report stays to be read)
    raise RuntimeError(f"the regeneration wrote no answered record ({report.get('records_read', 0)} read: {said}){fix}; "
                       f"see {regen}.report.json and logs/regenerate.log")


THROUGHPUT_SETTINGS = ("batch_size", "max_seconds")  # how fast the stage answers, not what it answers


def _what_is_answered(key: dict[str, Any]) -> dict[str, Any]:
    """A regeneration key without THROUGHPUT_SETTINGS: the prompts, target and generation limits."""
    return {n: v for n, v in key.items() if n not in THROUGHPUT_SETTINGS}


def regen_reusable(ctx: Context, old: dict[str, Any]) -> bool:
    """True when a finished regeneration answered every prompt (not stopped by its time cap) and its key
    differs from the new one only by THROUGHPUT_SETTINGS: the same prompts, target and generation limits,
    made at another card's batch rows or time cap (a run folder carried to another GPU, or a regeneration
    reused across runs). Greedy answers do not depend on those two settings beyond the rounding of the
    batched matmuls; sampled ones (--regen-samples) do, but draws made at other rows are draws of the same
    distribution, as good for training."""
    prev, outs = old.get("key", {}), old.get("outputs", {})
    new = regen_key(ctx)
    return (same_inputs(_what_is_answered(prev), _what_is_answered(new)) and outs.get("stopped_at_max_seconds") is False
            and ctx.paths.regen.exists())


def regen_continue(ctx: Context, old: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A finished regeneration whose record differs from the new key only by a larger time budget (and
    perhaps its batch rows: another card's plan), stopped by its budget: answer the records after its
    `next_record` for the extra seconds into RUN/regen-more-N.jsonl and append them (data/regen_report.py's
    append_continuation). None when the old record cannot be continued (then the stage is redone)."""
    new = regen_key(ctx)
    prev = old.get("key", {})
    outs = old.get("outputs", {})
    if not (same_inputs(_what_is_answered(prev), _what_is_answered(new)) and outs.get("stopped_at_max_seconds")
            and outs.get("next_record") and new["max_seconds"] > prev.get("max_seconds", 0)
            and ctx.paths.regen.exists()):
        return None
    from dflash_trainer.data.regen_report import append_continuation

    nxt = int(outs["next_record"])
    more = ctx.paths.root / f"regen-more-{nxt}.jsonl"
    _rm(more, more.with_name(more.name + ".report.json"), more.with_name(more.name + ".partial.jsonl"))
    ctx.run("regenerate", regen_args(ctx, more, new["max_seconds"] - prev["max_seconds"], first_record=nxt))
    merged = append_continuation(ctx.paths.regen, more)
    _rm(regen_outputs(ctx.paths)[2])  # the first run's partial file: its records are in the output now
    return {"regen": str(ctx.paths.regen), "records_read": merged.get("records_read"),
            "next_record": merged.get("next_record"), "stopped_at_max_seconds": merged.get("stopped_at_max_seconds"),
            "continued_from": nxt}


# ---- prepare ----
def prepare_key(ctx: Context) -> dict[str, Any]:
    """What RUN/data depends on: the regenerated chats, seq_len, the target, the prepare format (a release that
    bumps PREPARE_FORMAT_VERSION prepares again instead of training refusing the old rows) and, with --spec, its
    sources' weights (prepare --spec applies them)."""
    from dflash_trainer.data.prepare_report import PREPARE_FORMAT_VERSION

    key = {"regenerate": ctx.hashes["regenerate"], "seq_len": ctx.plan.seq_len, **target_id(ctx.settings.target),
           "prepare_format": PREPARE_FORMAT_VERSION}
    if ctx.settings.spec:  # its source weights (data/mixture/weights.py) decide the rows; the mixture key leaves them out
        from dflash_trainer.data.mixture.spec import load_spec

        key["spec_weights"] = {s.name: s.weight for s in load_spec(ctx.settings.spec).sources}
    return key


def prepare_run(ctx: Context, resuming: bool) -> dict[str, Any]:
    _rm(ctx.paths.data)  # prepare is fast and not resumable: start it again
    spec = ["--spec", str(ctx.settings.spec)] if ctx.settings.spec else []  # the sources' weights
    ctx.run("prepare", ["prepare", "--out", str(ctx.paths.data), "--data", str(ctx.paths.regen), *ctx.target_args(),
                        "--seq-len", str(ctx.plan.seq_len), *template_args(ctx), *spec])
    report = json.loads((ctx.paths.data / "prepare_report.json").read_text())
    return {"prepared": str(ctx.paths.data), "rows": report.get("rows_train"), "tokens": report.get("tokens")}


# ---- train / control ----
def train_sets(plan: Plan, settings: RecipeSettings, control: bool = False) -> list[str]:
    """The train command's --set list: the plan's, the recipe's chat template, the user's, then the control's."""
    template = [f"data.chat_template={settings.chat_template}"] if settings.chat_template else []
    return [*plan.train_sets, *template, *settings.sets, *([CONTROL_SET] if control else [])]


def train_key(ctx: Context, control: bool = False) -> dict[str, Any]:
    cfg = ctx.settings.config
    sets = train_key_sets(train_sets(ctx.plan, ctx.settings, control))
    return {"prepare": ctx.hashes["prepare"], "config": file_digest(cfg) if cfg else None,
            "sets": sets, **target_id(ctx.settings.target)}


def train_run(ctx: Context, resuming: bool, control: bool = False) -> dict[str, Any]:
    """Train into RUN/drafter (or RUN/control); killed midway, train resumes from the folder's newest checkpoint."""
    name = "control" if control else "drafter"
    out = ctx.paths.run_dir(name)
    if not resuming:
        _rm(out)
    args = ["train", "--out", str(out), "--prepared", str(ctx.paths.data), *ctx.target_args(), "--resume", "auto"]
    if ctx.settings.config:
        args += ["--config", ctx.settings.config]
    for s in train_sets(ctx.plan, ctx.settings, control):
        args += ["--set", s]
    ctx.run("control" if control else "train", args)
    if not ctx.paths.checkpoint(name).is_dir():
        raise RuntimeError(f"{out}: training stopped before its final checkpoint (log {ctx.paths.log(name)}); "
                           "run the same command to resume")
    summary = out / "summary.json"
    return {"run": str(out), "summary": json.loads(summary.read_text()) if summary.exists() else None}
