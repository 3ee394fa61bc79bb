"""Stage records: RUN/stages/<stage>.json, written last and atomically when a stage finished.

A record holds the stage's `key` (its settings and inputs: file digests or the upstream stages'
record hashes) and `hash`, the sha256 of that key's canonical JSON. RUN/stages/<stage>.started.json
holds the same while the stage runs, so a rerun knows whether outputs left on disk belong to the
same inputs (resume them) or to other ones (remove them and redo). `same_inputs` compares a record's key,
perhaps written by an earlier version, with a stage's key now."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Optional


def key_hash(key: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON (sorted keys) of `key`."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def file_digest(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, or of a folder's files (relative names and bytes, in name order).
    Raises FileNotFoundError when the path does not exist."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: not found")
    h = hashlib.sha256()
    files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
    for q in files:
        h.update(str(q.relative_to(p) if p.is_dir() else q.name).encode())
        with q.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: Path, body: dict[str, Any]) -> None:
    """Write JSON to a temporary file beside `path`, fsync, rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(json.dumps(body, indent=2, sort_keys=True, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class StageRecords:
    """The records of one run folder (RUN/stages/)."""

    def __init__(self, run: str | Path):
        self.run = Path(run)
        self.dir = self.run / "stages"

    def _relative(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """`outputs` with each top-level string naming an existing path inside RUN written relative to RUN (a
        record stays true when the run folder moves); other values unchanged."""
        root = self.run.resolve()
        out = {}
        for name, value in outputs.items():
            if isinstance(value, str) and value:
                try:
                    if Path(value).exists():
                        value = str(Path(value).resolve().relative_to(root))
                except (OSError, ValueError):  # not a path (too long a name), or not inside RUN
                    pass
            out[name] = value
        return out

    def _read(self, path: Path) -> Optional[dict[str, Any]]:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # absent, or a half-written file from before atomic writes
            return None

    def finished(self, stage: str) -> Optional[dict[str, Any]]:
        """The stage's finished record, or None."""
        return self._read(self.dir / f"{stage}.json")

    def started(self, stage: str) -> Optional[dict[str, Any]]:
        """The record of the stage's unfinished run, or None."""
        return self._read(self.dir / f"{stage}.started.json")

    def start(self, stage: str, key: dict[str, Any]) -> None:
        """Note that `stage` runs with `key`; its finished record is removed first (it no longer holds)."""
        (self.dir / f"{stage}.json").unlink(missing_ok=True)
        write_json_atomic(self.dir / f"{stage}.started.json", {"stage": stage, "hash": key_hash(key), "key": key,
                                                                "started": time.time()})

    def finish(self, stage: str, key: dict[str, Any], seconds: float, outputs: dict[str, Any]) -> dict[str, Any]:
        """Write the finished record (atomically, last) and drop the started one; returns the record. Paths
        inside RUN among `outputs` are written relative to RUN."""
        body = {"stage": stage, "hash": key_hash(key), "key": key, "seconds": round(seconds, 3),
                "finished": time.time(), "outputs": self._relative(outputs)}
        write_json_atomic(self.dir / f"{stage}.json", body)
        (self.dir / f"{stage}.started.json").unlink(missing_ok=True)
        return body


# settings of how a training keeps its files, gets its target features and uses the CPU, not of the drafter it
# makes (train resumes across them: training/checkpoint.RESUME_MUTABLE): left out of the key, so a rerun on a card
# with other free memory (another feature cache), or with `--set runtime.threads=1` as a busy CPU's note advises,
# resumes or keeps the training; records made while the key held them stay valid (same_inputs)
NOT_IN_TRAIN_KEY = ("runtime.keep_last", "runtime.save_every", "target.feature_cache_gib", "runtime.threads", "threads")


def train_key_sets(sets: list[Any]) -> list[Any]:
    """The train `--set` entries a key holds: all but those naming NOT_IN_TRAIN_KEY settings."""
    return [s for s in sets if str(s).partition("=")[0].strip() not in NOT_IN_TRAIN_KEY]


def same_inputs(recorded: dict[str, Any], key: dict[str, Any]) -> bool:
    """Whether a stage record's key (as it was written, perhaps by an earlier version) names the same inputs
    as `key`: equal once the train `sets` that cannot change the drafter (NOT_IN_TRAIN_KEY) are left
    out of both, and, when the record predates folder keys holding the target's `weights` sample
    (stages.weights_id), that sample too; a mixture's `spec_file` (its spec's file digest: a comment changes it)
    is left out, and a record from before build-digest keys, whose `spec` is that file digest, matches the
    build digest. Such a run is not redone, nor its killed training restarted."""
    if "spec_file" in key and recorded.get("spec") == key["spec_file"]:  # a mixture keyed by its spec file's digest
        recorded = {**recorded, "spec": key["spec"]}

    def comparable(k: dict[str, Any]) -> dict[str, Any]:
        out = {n: v for n, v in k.items() if (n != "weights" or "weights" in recorded) and n != "spec_file"}
        if isinstance(out.get("sets"), list):
            out["sets"] = train_key_sets(out["sets"])
        return out

    return comparable(recorded) == comparable(key)


def recorded_form(key: dict[str, Any], *records: dict[str, Any] | None) -> dict[str, Any]:
    """`key`, or the key of the first record (finished or started) that names the same inputs in another form
    (`same_inputs`) and whose hash is its key's: kept as recorded, so its hash, and the hashes downstream
    stages were keyed on, stay what they were."""
    for r in records:
        rk = r.get("key") if r else None
        if isinstance(rk, dict) and rk != key and r.get("hash") == key_hash(rk) and same_inputs(rk, key):
            return rk
    return key
