"""`speculation.json`, the sidecar `dflash-train export` writes next to config.json: the draft length
to serve at each batch size, from an eval's speedup table (`export --speedup-from EVAL.json`), or,
without one, only the most the drafter can propose (B−1). Torch-free; no engine reads this file:
it tells the person who starts the server what to pass (README "Export and serve"; fields in
docs/formats.md "speculation.json").

B = the exported drafter's block size; k = draft length (drafts per round, from a drafter block of k+1
slots as vLLM and SGLang run it, 0 … B−1; 0 = plain decoding, i.e. serve without speculation at that
batch size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECULATION_FILE = "speculation.json"
SPECULATION_FORMAT = "dflash-trainer/speculation"
SPECULATION_VERSION = 1

# eval JSON keys a speedup-table row must carry (evaluation/speedup.py), and the sidecar's name for each
_ROW_KEYS = {"batch_size": "batch_size", "recommended_draft_length": "draft_length", "recommended_speedup": "speedup",
             "chosen_draft_length": "predicted_draft_length", "chosen_predicted_speedup": "predicted_speedup",
             "chosen_speedup": "predicted_choice_speedup", "full_draft_length": "full_draft_length",
             "speedup": "full_speedup", "chosen_tau": "tau", "chosen_lossless": "lossless"}
# eval JSON keys copied into `source` (what was measured, and how)
_SOURCE_KEYS = ("dataset", "target", "target_dtype", "temperature", "block_size", "max_new_tokens")


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def read_speedup_eval(path: str | Path) -> dict[str, Any]:
    """The result JSON of an eval run with `--batch-sizes` (evaluation/run.py), checked: a readable
    JSON object whose `speedup_table` rows carry the chosen draft length (evals before the draft
    length was chosen per batch size do not). Raises ValueError / FileNotFoundError naming
    --speedup-from and the fix."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--speedup-from {path}: no such file; pass the --json file of "
                                "`dflash-train eval --batch-sizes 1,4,16,64,256`")
    try:
        body = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--speedup-from {path}: not a JSON file ({e})") from None
    table = body.get("speedup_table") if isinstance(body, dict) else None
    if not table:
        raise ValueError(f"--speedup-from {path}: no speedup_table; rerun eval with --batch-sizes 1,4,16,64,256 "
                         "--json FILE")
    if not isinstance(table, list) or not all(isinstance(row, dict) for row in table):
        raise ValueError(f"--speedup-from {path}: speedup_table is not a list of rows; pass the --json file of "
                         "`dflash-train eval --batch-sizes`")
    drafter = body.get("drafter")
    sha = drafter.get("weights_sha256") if isinstance(drafter, dict) else None
    if (drafter is not None and not isinstance(drafter, dict)) or (
            sha is not None and not (isinstance(sha, str) and _is_sha256(sha))):
        raise ValueError(f"--speedup-from {path}: its drafter record is not an eval's (drafter.weights_sha256 must "
                         "be a 64-digit hex string); pass the --json file of `dflash-train eval --batch-sizes`")
    missing = sorted({k for row in table for k in _ROW_KEYS if k not in row})
    if missing:
        raise ValueError(f"--speedup-from {path}: speedup_table rows lack {', '.join(missing)} (an eval from "
                         "before draft lengths were chosen per batch size); rerun eval with --batch-sizes")
    return body


def speculation_sidecar(block_size: int, speedup_eval: dict[str, Any] | None = None,
                        eval_name: str | None = None, drafter_fingerprints: tuple[str, ...] = ()) -> dict[str, Any]:
    """The sidecar's content (docs/formats.md "speculation.json") for a drafter of block size B:
    format, version, block_size, max_draft_length (B−1), measured, source (the eval's file name and
    settings, the exported drafter's weights fingerprint and whether the eval's matched, or null) and
    by_batch_size (one row per measured batch size, or [] without an eval).
    speedup_eval: a `read_speedup_eval` result. drafter_fingerprints: `weights_fingerprint`s
    (interop/fingerprint.py) of the exported weights first (recorded), then of the export's source
    when the export casts them (an eval of either is this drafter's). Raises ValueError naming
    --speedup-from when the eval ran at a block size above B (its draft lengths could exceed what
    this drafter proposes), or measured weights with none of these fingerprints. An eval written
    before fingerprints were recorded is taken with `source.same_drafter` null (not checked)."""
    out: dict[str, Any] = {"format": SPECULATION_FORMAT, "version": SPECULATION_VERSION, "block_size": block_size,
                           "max_draft_length": block_size - 1, "measured": speedup_eval is not None, "source": None,
                           "by_batch_size": []}
    if speedup_eval is None:
        return out
    eval_b = speedup_eval.get("block_size")
    if eval_b is not None and eval_b > block_size:
        raise ValueError(f"--speedup-from {eval_name}: measured at block size {eval_b}, above this drafter's "
                         f"{block_size}; pass the eval of this drafter")
    measured = (speedup_eval.get("drafter") or {}).get("weights_sha256")
    if measured is not None and drafter_fingerprints and measured not in drafter_fingerprints:
        raise ValueError(f"--speedup-from {eval_name}: measured with another drafter (weights sha256 "
                         f"{measured[:12]}…, this one {drafter_fingerprints[0][:12]}…); pass the eval of this drafter, "
                         "or rerun `dflash-train eval --drafter <this drafter> --target <its target> "
                         "--batch-sizes 1,4,16,64,256 --json FILE`")
    same = None if measured is None or not drafter_fingerprints else True
    out["source"] = {"eval_json": eval_name, **{k: speedup_eval.get(k) for k in _SOURCE_KEYS},
                     "drafter_weights_sha256": drafter_fingerprints[0] if drafter_fingerprints else None,
                     "same_drafter": same}
    rows = sorted(speedup_eval["speedup_table"], key=lambda r: r["batch_size"])
    out["by_batch_size"] = [{name: row[key] for key, name in _ROW_KEYS.items()} for row in rows]
    return out
