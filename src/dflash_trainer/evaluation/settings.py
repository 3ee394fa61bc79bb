"""What `dflash-train eval` runs, and the checks of it that need no torch and no model: the CLI runs
them before any heavy import (a bad flag is answered in about a second) and `run_eval` runs them
again for callers that skip the CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_trainer.data.suites import SUITES, check_suite_name
from dflash_trainer.interop.formats import CONFIG_FILE, detect_kind
from dflash_trainer.preflight.checks import check_device
from dflash_trainer.preflight.paths import check_chat_file, check_drafter, check_target, refuse_hub_id
from dflash_trainer.files.writable import check_new_file


DEFAULT_MAX_PROMPT_TOKENS = 2048  # a longer turn prompt is skipped, counted and reported (chat files, held-out ShareGPT)


@dataclass
class EvalSettings:
    """What `dflash-train eval` runs. max_prompts None = all prompts (0 = all too) and
    max_new_tokens None = 256, except on the CPU, where None means the defaults of
    evaluation/progress.py `cpu_defaults` (a few minutes with SmolLM2); block_size None = the
    trained B; max_turns None = all turns; max_prompt_tokens: a turn whose rendered prompt is longer
    is not decoded, nor are that conversation's later turns (counted in the result's `skipped`);
    json_out / plot_out None = not written (plot_out defaults to json_out with .png)."""

    drafter: str
    target: str | None = None
    dataset: str = "mt-bench"
    max_prompts: int | None = None
    max_new_tokens: int | None = None
    temperature: float = 0.0
    block_size: int | None = None
    max_turns: int | None = None
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    json_out: str | None = None
    plot_out: str | None = None
    device: str = "auto"
    seed: int = 0
    offline: bool = True
    threads: int | None = None  # CPU intra-op threads (None = torch's default); decoding is latency-bound
    batch_size: int | None = None  # turns decoded at once; None = 256 on CUDA, 1 on the CPU
    cuda_graph: bool = True  # on CUDA, replay each plain step / speculative round from a CUDA graph
    batch_sizes: list[int] | None = None  # the speedup table's batch sizes (evaluation/speedup.py); None = no table
    dtype: str = "auto"  # the target's dtype: auto (bfloat16 on CUDA, float32 on the CPU) | float32 | bfloat16


DTYPES = ("auto", "float32", "bfloat16")


def parse_batch_sizes(text: str | None) -> list[int] | None:
    """`--batch-sizes 1,4,16` → [1, 4, 16] (None or "" → None). Raises ValueError naming the flag
    for anything but comma-separated integers >= 1."""
    if not text:
        return None
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes {text!r}: expected comma-separated integers, e.g. 1,4,16,64,256") from None
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"--batch-sizes {text!r}: every batch size must be >= 1, e.g. 1,4,16,64,256")
    return sizes


def check_eval_settings(s: EvalSettings) -> None:
    """Raise ValueError / FileNotFoundError for settings that cannot run: bad values, device=cuda
    without a GPU, a target or drafter folder that is not one (preflight/paths.py), a dataset that
    is neither a suite nor a chat file, an output path that cannot be written. Reads only
    config.json files and the first bytes of the chat file."""
    if s.temperature < 0:
        raise ValueError(f"temperature={s.temperature} must be >= 0 (0 = greedy)")
    if s.max_prompts is not None and s.max_prompts < 0:
        raise ValueError(f"--max-prompts {s.max_prompts} must be >= 0 (0 = all prompts)")
    if s.max_new_tokens is not None and s.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={s.max_new_tokens} must be >= 1")
    if s.max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens {s.max_prompt_tokens} must be >= 1")
    if s.batch_size is not None and s.batch_size < 1:
        raise ValueError(f"--batch-size {s.batch_size} must be >= 1")
    if s.batch_sizes is not None and (not s.batch_sizes or any(b < 1 for b in s.batch_sizes)):
        raise ValueError(f"--batch-sizes {s.batch_sizes}: every batch size must be >= 1, e.g. 1,4,16,64,256")
    if s.dtype not in DTYPES:
        raise ValueError(f"--dtype {s.dtype!r}: pass one of {', '.join(DTYPES)}")
    check_device(s.device)
    check_target(s.target)
    checkpoint_format(resolve_drafter_path(s.drafter))
    if s.dataset not in SUITES:
        refuse_hub_id("--dataset", s.dataset, f"pass a local JSON/JSONL chat file (or one of {', '.join(SUITES)})")
        check_suite_name(s.dataset)
        check_chat_file(s.dataset, "--dataset")
    check_new_file(s.json_out, "--json")
    check_new_file(s.plot_out, "--plot")


def resolve_drafter_path(path: str | Path) -> Path:
    """The drafter folder `path` names: itself, or `path/checkpoint-final` for a run folder.
    Raises ValueError / FileNotFoundError naming --drafter when it is no drafter folder
    (`preflight/paths.py` `check_drafter`)."""
    return check_drafter(str(path), "--drafter", run_folder=True)


def checkpoint_format(path: Path) -> str:
    """"checkpoint" | "zlab" | "speculators" from a folder's config.json (no weights read; the rule
    `load_drafter` loads by, `interop.formats.detect_kind`). Raises ValueError naming --drafter
    when it is none of them."""
    try:
        return detect_kind(json.loads((path / CONFIG_FILE).read_text()))
    except ValueError as e:
        raise ValueError(f"--drafter {path}: {e}") from None
