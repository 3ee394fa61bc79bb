"""Code requests built from installed Python: "write function X(signature) that <docstring>".

No PyPI package ships code instructions (docs/data.md, "Sources"), so the requests are built from the
public functions (and, with `methods`, public methods of public classes) of the listed packages
and the standard library: name, signature and the first paragraph of the docstring, put in one of
a few templates picked by the seed. The source files are parsed with `ast`, never imported: no
package code runs, and nothing depends on import side effects (33 s for the shipped list in one process on
2 cores; with `workers` > 1 the packages are parsed in that many processes, the same definitions).

Order: packages as listed, files sorted, definitions in file order; then one seeded shuffle.
Never a HumanEval function: a definition named like a HumanEval entry point is skipped here, and
the build's eval-leak check (leaks.py) drops any request that still matches.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import random
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_trainer.data.mixture.licences import STDLIB, distribution, package_licence, package_version
from dflash_trainer.data.mixture.records import Messages, SourceReport
from dflash_trainer.data.mixture.spec import CodeOptions, SourceSpec

SKIP_DIRS = frozenset({"test", "tests", "testing", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                       "site-packages", "dist-packages", "__pycache__", "vendor", "vendored", "examples",
                       "benchmarks", "docs"})
SKIP_DECORATORS = frozenset({"property", "cached_property", "overload", "setter", "getter", "deleter"})
_ROLE = re.compile(r":[\w.]+(?::[\w.]+)*:`~?([^`<]+?)(?:\s*<[^>]*>)?`")  # :func:`x` / :class:`~a.B <c>`
_PLACEHOLDER = re.compile(r"\b(TODO|FIXME|XXX)\b")


@dataclass(frozen=True)
class Candidate:
    """One public definition with a usable docstring (`cls` None for a module-level function)."""

    ref: str  # package:relative/path.py:Class.name, for reports
    cls: str | None
    name: str
    signature: str
    description: str


def package_files(package: str) -> tuple[Path, list[Path]]:
    """(root folder, Python files) of an installed package ('stdlib' = the standard library);
    files sorted, without tests, vendored copies, private subpackages and site-packages. Raises
    FileNotFoundError naming the install command when the package is missing."""
    if package == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
    else:
        spec = importlib.util.find_spec(package)
        if spec is None:
            dist = distribution(package) or package
            raise FileNotFoundError(f"the code source lists {package!r}, which is not installed: run `pip install "
                                    f"{dist}` or remove it from options.packages")
        if not spec.submodule_search_locations:
            origin = Path(spec.origin or "")
            return origin.parent, [origin] if origin.suffix == ".py" else []
        root = Path(list(spec.submodule_search_locations)[0])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(("_", "."))
                             and d.isidentifier())
        for f in sorted(filenames):
            if (f.endswith(".py") and not f.startswith("test_") and not f.endswith("_test.py")
                    and f not in ("conftest.py", "setup.py", "__main__.py")):
                files.append(Path(dirpath) / f)
    return root, files


def describe(doc: str) -> str:
    """First paragraph of a docstring on one line, with reST roles and ``literals`` as `code`."""
    first = doc.strip().split("\n\n")[0]
    first = _ROLE.sub(r"`\1`", first).replace("``", "`")
    return " ".join(first.split())


def _skip_reason(name: str, description: str, signature: str, opts: CodeOptions,
                 eval_names: frozenset[str]) -> str | None:
    """Why a definition makes no request (a skip reason), or None."""
    if name.startswith("test"):
        return "test_function"
    if name in eval_names:
        return "humaneval_name"
    if len(description) < opts.min_description_chars or len(description.split()) < 4:
        return "short_description"
    if len(description) > opts.max_description_chars:
        return "long_description"
    if not description[0].isalpha():
        return "description_not_text"
    if ">>>" in description:
        return "doctest_in_description"
    if "deprecat" in description.lower():
        return "deprecated"
    if _PLACEHOLDER.search(description):
        return "placeholder_text"
    if len(signature) > opts.max_signature_chars:
        return "long_signature"
    return None


def _definitions(tree: ast.Module) -> Iterator[tuple[str | None, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node.name, sub


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute):
            names.add(target.attr)
        elif isinstance(target, ast.Name):
            names.add(target.id)
    return names


_PARSED: dict[str, tuple[tuple[Candidate, ...], int, int]] = {}  # parse_package's results in this process


def parse_package(package: str) -> tuple[tuple[Candidate, ...], int, int]:
    """(public definitions with a docstring, unfiltered, in file order; files; unparsable files)
    of one package. Parsed once per process (the slow part; `parse_packages` parses several at once).
    Raises FileNotFoundError as `package_files` does."""
    if package not in _PARSED:
        _PARSED[package] = _parse(package)
    return _PARSED[package]


def parse_packages(packages: list[str], workers: int) -> None:
    """Parse the packages not parsed yet in `workers` processes (forked) into this process's cache, so that
    `parse_package` then returns at once; with workers ≤ 1 or one package left, nothing (each is parsed when
    first asked). The results are those of `parse_package` in one process. Raises FileNotFoundError as
    `package_files` does."""
    todo = [p for p in dict.fromkeys(packages) if p not in _PARSED]
    if workers <= 1 or len(todo) <= 1:
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=multiprocessing.get_context("fork")) as pool:
        for package, parsed in zip(todo, pool.map(_parse, todo)):
            _PARSED[package] = parsed


def _parse(package: str) -> tuple[tuple[Candidate, ...], int, int]:
    root, files = package_files(package)
    unparsable = 0
    out = []
    for path in files:
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, UnicodeDecodeError):
            unparsable += 1
            continue
        rel = f"{package}:{path.relative_to(root).as_posix()}"
        for cls, node in _definitions(tree):
            if node.name.startswith("_") or _decorator_names(node) & SKIP_DECORATORS:
                continue
            doc = ast.get_docstring(node)
            if doc:
                ref = f"{rel}:{cls + '.' if cls else ''}{node.name}"
                out.append(Candidate(ref, cls, node.name, ast.unparse(node.args), describe(doc)))
    return tuple(out), len(files), unparsable


def collect(package: str, opts: CodeOptions, eval_names: frozenset[str], report: SourceReport,
            seen: set[tuple[str, str]]) -> list[Candidate]:
    """Usable definitions of one package, in file order; skips are counted in `report` and
    (name, description) pairs already in `seen` are skipped as `duplicate_definition`."""
    definitions, num_files, unparsable = parse_package(package)
    out = []
    for c in definitions:
        if c.cls is not None and not opts.methods:
            continue
        reason = _skip_reason(c.name, c.description, c.signature, opts, eval_names)
        if reason is None and (c.name, c.description) in seen:
            reason = "duplicate_definition"
        if reason:
            report.skip(reason, c.ref)
            continue
        seen.add((c.name, c.description))
        out.append(c)
    report.details.setdefault("packages", {})[package] = {
        "version": package_version(package), "licence": package_licence(package),
        "distribution": distribution(package) if package != STDLIB else "python", "files": num_files,
        "unparsable_files": unparsable, "definitions": len(out)}
    return out


def iter_code(source: SourceSpec, seed: int, report: SourceReport, eval_names: frozenset[str],
              workers: int = 1) -> Iterator[tuple[int, Messages]]:
    """(index in the seeded order, one user turn) for every usable definition of the listed
    packages. `eval_names`: HumanEval entry points, never used; `workers`: processes that parse the
    packages (the requests do not depend on it). Raises FileNotFoundError naming the install command
    for a package that is not installed."""
    opts = source.parsed
    parse_packages(list(opts.packages), workers)
    seen: set[tuple[str, str]] = set()
    candidates = [c for package in opts.packages for c in collect(package, opts, eval_names, report, seen)]
    report.details["definitions"] = len(candidates)
    rng = random.Random(f"{seed}/code")
    rng.shuffle(candidates)
    for n, c in enumerate(candidates):
        if c.cls is None:
            text = rng.choice(opts.templates).format(name=c.name, signature=c.signature, description=c.description)
        else:
            text = rng.choice(opts.method_templates).format(name=c.name, signature=c.signature,
                                                            description=c.description, cls=c.cls)
        yield n, [{"role": "user", "content": text}]
