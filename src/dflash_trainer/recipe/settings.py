"""What `dflash-train recipe` was asked (RecipeSettings) and the run folder's layout (paths)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

STAGES = ("mixture", "regenerate", "prepare", "train", "control", "eval", "export", "report")
SUITES = ("mt-bench", "humaneval", "sharegpt-heldout")


@dataclass
class RecipeSettings:
    """The recipe's flags: target (None = the embedded SmolLM2), out (the run folder), spec / data (the
    prompt mixture or a chat file; neither = the packaged mixture), control (also train the
    no-target-features control), hours / steps, gpu_memory_gib (plan for that card; None = this
    machine's), config (a train config YAML), sets (train `--set` overrides), until (stop after this stage),
    regen_samples / regen_temperature (answers per conversation and their sampling temperature; 1 and 0 =
    the greedy answer, the measured recipe), chat_template (a Jinja file for a target whose tokenizer has
    none or another than serving uses: regenerate, prepare and train render with it, the exports record it),
    verifier (the target's name in the exports, a hub id or the path where it is served; None = the
    target's hub id when its files say it, else its folder name: export's rule, interop/verifier.py)."""

    out: str
    target: Optional[str] = None
    spec: Optional[str] = None
    data: Optional[str] = None
    control: bool = False
    hours: Optional[float] = None
    steps: Optional[int] = None
    gpu_memory_gib: Optional[float] = None
    config: Optional[str] = None
    sets: list[str] = field(default_factory=list)
    until: Optional[str] = None
    regen_samples: int = 1
    regen_temperature: float = 0.0
    chat_template: Optional[str] = None
    verifier: Optional[str] = None

    def check(self) -> None:
        """Raises ValueError for contradicting or out-of-range flags, FileNotFoundError for missing files."""
        if self.spec and self.data:
            raise ValueError("--spec and --data: give one (the prompts to answer), or neither for the packaged mixture")
        for flag, path in (("--spec", self.spec), ("--data", self.data), ("--config", self.config),
                           ("--chat-template", self.chat_template)):
            if path and not Path(path).is_file():
                raise FileNotFoundError(f"{flag} {path}: file not found")
        if self.until is not None and self.until not in STAGES:
            raise ValueError(f"--until {self.until}: one of {', '.join(STAGES)}")
        if self.until == "control" and not self.control:
            raise ValueError("--until control needs --control")
        if self.until == "mixture" and self.data:
            raise ValueError("--until mixture with --data: a chat file has no mixture stage; stop after regenerate "
                             "(--until regenerate) or drop --data")
        if self.regen_samples < 1:
            raise ValueError(f"--regen-samples {self.regen_samples}: give 1 (the greedy answer) or more sampled answers")
        if not self.regen_temperature >= 0:  # NaN too
            raise ValueError(f"--regen-temperature {self.regen_temperature}: give 0 (greedy) or a temperature > 0, "
                             "e.g. 0.7")
        if self.regen_samples > 1 and self.regen_temperature == 0:
            raise ValueError(f"--regen-samples {self.regen_samples} at --regen-temperature 0 would write the same greedy "
                             "answer each time; pass a temperature too, e.g. --regen-temperature 0.7")
        from dflash_trainer.interop.formats import check_verifier

        check_verifier(self.verifier)
        for s in self.sets:
            if "=" not in s:
                raise ValueError(f"--set {s}: expected section.field=value")

    def stages(self) -> list[str]:
        """The stages this recipe runs, in order (mixture only for a spec, control only with --control)."""
        names = [s for s in STAGES if (s != "mixture" or not self.data) and (s != "control" or self.control)]
        return names[: names.index(self.until) + 1] if self.until else names

    def regen_sampling(self) -> dict[str, Any]:
        """{"samples", "temperature"} of a sampled regeneration (regenerate's flags of those names), {} for the
        greedy answer (the default, whose stage key then stays as it was before sampling could be asked)."""
        if self.regen_samples > 1 or self.regen_temperature > 0:
            return {"samples": self.regen_samples, "temperature": self.regen_temperature}
        return {}

    def user_set(self, *names: str) -> Optional[str]:
        """The value of the last --set naming any of `names` (e.g. data.seq_len or seq_len), else None."""
        got = None
        for s in self.sets:
            k, _, v = s.partition("=")
            if k.strip() in names:
                got = v.strip()
        return got


class RunPaths:
    """Where each stage writes inside the run folder."""

    def __init__(self, out: str | Path):
        self.root = Path(out)
        self.logs = self.root / "logs"
        self.mixture_spec = self.root / "mixture.yaml"
        self.prompts = self.root / "prompts.jsonl"
        self.regen = self.root / "regen.jsonl"
        self.data = self.root / "data"
        self.eval = self.root / "eval"
        self.speedup = self.root / "speedup" / "drafter-mt-bench.json"  # the speedup table (eval --batch-sizes)

    def run_dir(self, name: str) -> Path:
        """The training folder of `drafter` or `control`."""
        return self.root / name

    def checkpoint(self, name: str) -> Path:
        return self.run_dir(name) / "checkpoint-final"

    def export(self, fmt: str) -> Path:
        return self.root / f"export-{fmt}"

    def log(self, stage: str) -> Path:
        return self.logs / f"{stage}.log"
