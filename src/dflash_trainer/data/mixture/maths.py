"""Math questions from PyPI `mathematics-dataset==1.0.1` (DeepMind, Apache-2.0), as user prompts.

The questions come from child processes (math_worker.py: why, the shims, the protocol). Modules
take turns: round r gives question r of every module that still runs, in sorted module order, so
any count is spread evenly over the modules. Each question is put in one of the `templates`
(picked by the seed) and becomes one user turn. The result depends only on (seed, selection,
templates) and the installed sympy/numpy, not on `workers`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import IO, Any

from dflash_trainer.data.mixture.licences import package_version
from dflash_trainer.data.mixture.records import Messages, SourceReport
from dflash_trainer.data.mixture.spec import SourceSpec

MATH_INSTALL = "pip install --no-deps mathematics-dataset==1.0.1 && pip install absl-py six sympy numpy"
_NEEDS = ("mathematics_dataset", "absl", "six", "sympy", "numpy")


def check_installed() -> None:
    """Raise FileNotFoundError naming the install command when the generator or a dependency is
    missing (checked without importing them)."""
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise FileNotFoundError(f"the math source needs {', '.join(missing)}: run `{MATH_INSTALL}`")


class _Worker:
    """One generator process; its stderr goes to a temporary file (shown when it dies)."""

    def __init__(self, seed: int, worker: int, workers: int, modules: list[str] | None):
        self.stderr: IO[bytes] = tempfile.TemporaryFile()
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        cmd = [sys.executable, "-m", "dflash_trainer.data.mixture.math_worker", "--seed", str(seed),
               "--worker", str(worker), "--workers", str(workers), "--modules", json.dumps(modules)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, env=env, text=True,
                                     encoding="utf-8")

    def read(self) -> dict[str, Any]:
        """The next protocol line. Raises RuntimeError with the child's stderr when it ended."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            tail = self.stderr.read().decode("utf-8", "replace")[-2000:]
            raise RuntimeError(f"the math generator process ended (exit {self.proc.returncode}):\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        """Stop the process (it would run forever) and wait for it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.stderr.close()


def iter_math(source: SourceSpec, seed: int, report: SourceReport,
              workers: int | None = None) -> Iterator[tuple[int, Messages]]:
    """(question index, one user turn) forever, modules taking turns (module docstring); the caller
    stops at its count. Failed modules are left out and listed in `details.modules_failed`;
    redrawn questions are counted in `details` (`too_long`, `generator_errors`). workers: generator
    processes instead of the spec's `options.workers` (the questions do not depend on it; recorded in
    `details.workers`).

    Raises FileNotFoundError naming the install command when a package is missing, ValueError
    when `options.modules` selects nothing, RuntimeError when a generator process dies.
    """
    check_installed()
    opts = source.parsed
    report.package, report.version = "mathematics-dataset", package_version("mathematics_dataset")
    count = workers or opts.workers
    report.details["workers"] = count
    workers = [_Worker(seed, w, count, opts.modules) for w in range(count)]
    per_module: Counter[str] = Counter()
    failed: dict[str, str] = {}
    too_long = errors = 0
    try:
        header = workers[0].read()
        for w in workers[1:]:
            w.read()
        names: list[str] = header["modules"]
        if not names:
            groups = sorted({m.split("__")[0] for m in header["all_modules"]})
            raise ValueError(f"options.modules of source 'math': {opts.modules} selects no module; use groups "
                             f"({', '.join(groups)}) or module names such as {header['all_modules'][0]}")
        report.details.update(shims=header["shims"], library_versions=header["versions"], modules_selected=len(names))
        owner = {name: workers[i % len(workers)] for i, name in enumerate(names)}
        rng = random.Random(f"{seed}/math/templates")
        running = list(names)
        n = 0
        while running:
            for name in list(running):
                line = owner[name].read()
                assert line["module"] == name, (line["module"], name)  # the rotation both sides follow
                if "error" in line:
                    failed[name] = line["error"]
                    running.remove(name)
                    continue
                too_long += line["too_long"]
                errors += line["errors"]
                per_module[name] += 1
                text = rng.choice(opts.templates).format(question=line["question"])
                yield n, [{"role": "user", "content": text}]
                n += 1
        raise RuntimeError(f"every math module failed: {failed}")
    finally:
        for w in workers:
            w.close()
        report.details.update(modules_ran=sorted(per_module), modules_failed=failed, too_long=too_long,
                              generator_errors=errors, questions_per_module=dict(per_module))
