"""Data files shipped inside PyPI packages (the embedded model, chat data and eval prompts), found
with `importlib.util.find_spec` and never imported (some of those packages' `__init__` needs other
software). Torch-free, so the CLI can check them before any heavy import."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _installed(package: str, relative: str, install: str, why: str, alternative: str = "") -> Path:
    """`relative` under the installed `package`'s folder (not checked); FileNotFoundError naming `install`
    when the package is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{why}the package {package!r} is not installed: run `{install}`{alternative}")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def package_file(package: str, relative: str, install: str, *, why: str = "", alternative: str = "") -> Path:
    """Path of `relative` inside the installed `package`.

    Raises FileNotFoundError naming the install command when the package or the file is missing;
    `why` prefixes the message (what needed it), `alternative` ends it (what else the user can do).
    """
    path = _installed(package, relative, install, why, alternative)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package!r} package: reinstall it with "
                                f"`{install}`{alternative}")
    return path


def package_dir(package: str, relative: str, install: str, *, why: str = "") -> Path:
    """Path of the folder `relative` inside the installed `package`. Raises FileNotFoundError naming the
    install command when the package or the folder is missing; `why` prefixes the message."""
    path = _installed(package, relative, install, why)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is missing from the installed {package!r} package: reinstall it with "
                                f"`{install}`")
    return path
