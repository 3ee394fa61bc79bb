"""`regenerate --spec SPEC --out OUT`: the prompts of a mixture spec, built once and kept next to the
output, then regenerated like any `--data` file.

    OUT.prompts.jsonl               the built mixture, exactly as `dflash-train mixture` writes it
    OUT.prompts.jsonl.report.json   its report, with `spec_build_sha256`

The cache is reused when its report's `spec_build_sha256` equals the spec's `build_sha256()` (seed,
dedupe, each source's name, count and options; weights act at `prepare` and do not count, nor do
comments). A cache built from another spec is rebuilt, unless a regeneration of it is under way or
finished (OUT.partial.jsonl or OUT exists): the partial file's record indices refer to the old
prompts, so that mismatch is an error naming both hashes and the fix. The cache follows the spec
text, not the files it names: after editing a chat file a spec names, delete OUT.prompts.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from dflash_trainer.data.mixture.spec import MixtureSpec, load_spec


def prompts_path(out: str | Path) -> Path:
    """Where `regenerate --spec --out OUT` keeps the built prompts: OUT.prompts.jsonl."""
    return Path(f"{out}.prompts.jsonl")


def regenerate_input(data: str | None, spec: str | None, out: str, console: Console | None = None) -> str:
    """The chat file `regenerate` reads: `--data` as given, or the prompts of `--spec` (built or
    reused, `spec_prompts`). Raises ValueError unless exactly one of them is given."""
    if data is not None and spec is not None:
        raise ValueError("--data and --spec both given: pass one (--data: a chat file to regenerate; --spec: a "
                         "mixture spec whose prompts are built, then regenerated)")
    if spec is None:
        if data is None:
            raise ValueError("give --data FILE (a chat file to regenerate) or --spec SPEC (a mixture spec, e.g. "
                             "configs/mixture-smollm2.yaml)")
        return data
    return str(spec_prompts(load_spec(spec), spec, out, console or Console(quiet=True)))


def cached_build_sha256(prompts: Path) -> str | None:
    """`spec_build_sha256` of the cached prompts' report; None when the cache is incomplete (no
    prompts or no report: a build that did not finish), "" when the report does not say."""
    from dflash_trainer.data.mixture.build import report_path

    report = report_path(prompts)
    if not prompts.is_file() or not report.is_file():
        return None
    try:
        return str(json.loads(report.read_text(encoding="utf-8")).get("spec_build_sha256") or "")
    except (json.JSONDecodeError, AttributeError):
        return ""


def spec_prompts(spec: MixtureSpec, spec_path: str | Path, out: str | Path, console: Console) -> Path:
    """OUT.prompts.jsonl built from `spec`: reused when it was built from the same spec (module
    docstring), else built (by `build_mixture`, as `dflash-train mixture` does). Raises ValueError
    when it must be rebuilt while OUT or OUT.partial.jsonl regenerates the old prompts."""
    from dflash_trainer.data.mixture.build import build_mixture, summary_lines, write_mixture
    from dflash_trainer.data.regen_report import regenerate_partial_path
    from dflash_trainer.files.writable import check_new_file

    prompts, want = prompts_path(out), spec.build_sha256()
    have = cached_build_sha256(prompts)
    if have == want:
        console.print(f"prompts: reusing {prompts} (built from this spec, build sha256 {want[:12]})", highlight=False)
        return prompts
    started = [p for p in (regenerate_partial_path(out), Path(out)) if p.exists()]
    if started and have is not None:
        raise ValueError(f"--spec {spec_path} (build sha256 {want[:12]}) is not the spec {prompts} was built from "
                         f"(build sha256 {have[:12] or 'unknown'}), and {started[0]} regenerates those prompts: rerun "
                         f"with that spec to continue, or delete {out}, {regenerate_partial_path(out)} and {prompts} "
                         "(or choose another --out) to start over")
    if started:
        raise ValueError(f"--out {out}: {started[0]} exists but was not regenerated with --spec (no {prompts}); "
                         "delete it or choose another --out")
    if have is not None:
        console.print(f"prompts: {prompts} was built from another spec (build sha256 {have[:12] or 'unknown'}, "
                      f"this one {want[:12]}); rebuilding", highlight=False)
    check_new_file(str(prompts), "--out")
    mix = build_mixture(spec, log=lambda line: console.print(f"  {line}", highlight=False))
    write_mixture(mix, prompts)
    for line in summary_lines(mix.report):
        console.print(line, highlight=False)
    console.print(f"prompts: built {prompts} from {spec_path} ({mix.report.records} records)", highlight=False)
    return prompts
