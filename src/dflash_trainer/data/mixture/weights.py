"""Source weights of a mixture spec, applied by `prepare --spec`: how many times each conversation
of a source enters the packed rows.

    weight 0     the source is left out: its conversations are read and counted (skip reason
                 `weight_0`), never tokenized
    weight 1     each conversation once, as without a spec
    weight 2     each conversation twice
    weight 0.5   a seeded half of them, once each

In general a source whose n usable conversations have weight w = k + f (k whole, 0 ≤ f < 1) gives
each of them k copies, and one more copy to round(n·f) of them (rounded half up), picked by a
shuffle seeded from the spec's `seed` and the source's name. A conversation that ends with no copy
is counted under the skip reason `weight_draw`. The same spec and data give the same choice,
whatever `prepare --seed` is.

The copies of one conversation stay one unit of the train/validation split (its document list
repeated), so no conversation is both trained and validated on; packing shuffles the documents, so
copies land in different rows.

Weights act at `prepare`, after regeneration: one regenerated file serves every weighting (the
weights are not part of `MixtureSpec.build_sha256`). The data must match the spec: every `source`
its records carry is named by the spec and every source the spec names occurs in it, else
`SourceWeights.load` raises naming both files and the fix.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from dflash_trainer.data.mixture.licences import source_licence
from dflash_trainer.data.mixture.spec import MixtureSpec, load_spec
from dflash_trainer.files.portable import portable_path

NO_SOURCE = "(no source field)"  # how records without a `source` string are named in errors


class SourceWeightReport(BaseModel):
    """One source of `prepare --spec` (prepare_report.json `spec.sources[name]`)."""

    weight: float
    licence: str
    records: int  # records of the data file that carry this source name
    conversations_read: int = 0  # of them, usable conversations prepare read (data/chat.py rules, max_conversations)
    conversations_kept: int = 0  # of those, the ones in the rows: tokenized with supervised tokens, drawn by the weight
    copies: int = 0  # times they enter the rows (each kept conversation once or more)
    tokens: int = 0  # tokens of all copies before packing (under long_documents=truncate some are cut there)
    supervised_tokens: int = 0  # of those, assistant tokens


class SpecWeights(BaseModel):
    """What `prepare --spec` applied: the spec file and each source's weight and counts."""

    path: str
    sha256: str  # of the spec file's bytes
    build_sha256: str  # MixtureSpec.build_sha256(): the same as the mixture report of the prompts it matches
    seed: int  # the spec's seed: seeds the draw of fractional weights
    sources: dict[str, SourceWeightReport]  # in spec order

    def portable(self, folder: str | Path) -> "SpecWeights":
        """A copy whose `path` is as a record in `folder` writes it (files/portable.py)."""
        return self.model_copy(update={"path": portable_path(self.path, folder)})

    def summary(self) -> str:
        """One console phrase: each source's weight and the copies it gave, e.g. `code ×0 (0), math ×2 (6)`."""
        return ", ".join(f"{name} ×{r.weight:g} ({r.copies})" for name, r in self.sources.items())


def data_sources(data_path: str | Path) -> Counter[str]:
    """Records per `source` field in a chat file (NO_SOURCE for records without a string one)."""
    from dflash_trainer.data.chat import ReadStats, iter_records

    found: Counter[str] = Counter()
    for _, record in iter_records(Path(data_path), ReadStats()):
        if isinstance(record, dict):
            source = record.get("source")
            found[source if isinstance(source, str) else NO_SOURCE] += 1
    return found


def check_sources_match(spec: MixtureSpec, found: Counter[str], spec_path: str | Path, data_path: str | Path) -> None:
    """Raise ValueError, naming both files and the fix, when the data has a source the spec does not name (it
    would have no weight). A spec source the data lacks is allowed (SourceWeights.missing)."""
    named = [s.name for s in spec.sources]
    extra = [f"{name!r} ({n} records)" if name != NO_SOURCE else f"records without a `source` field ({n})"
             for name, n in sorted(found.items()) if name not in named]
    missing = [name for name in named if name not in found]
    if extra:
        lacks = f"; the spec also names sources the data lacks: {', '.join(map(repr, missing))}" if missing else ""
        raise ValueError(f"--data {data_path} does not match --spec {spec_path}: the data has sources the spec does not "
                         f"name: {', '.join(extra)}{lacks}. Prepare the file regenerated from this spec (`regenerate "
                         f"--spec {spec_path}`), or name every source of the data in the spec's `sources` (a weight of "
                         "0 leaves a source out)")


def extra_copy_count(n: int, fraction: float) -> int:
    """How many of n conversations get the extra copy of a weight's fractional part: round(n·fraction), half up."""
    return math.floor(n * fraction + 0.5)


class SourceWeights:
    """The weights of one spec checked against one data file, and the counts of one `prepare`
    (make a new one per prepare run)."""

    def __init__(self, spec: MixtureSpec, spec_path: str | Path, spec_sha256: str, found: Counter[str]):
        self.spec = spec
        self.weights = {s.name: s.weight for s in spec.sources}
        self.report = SpecWeights(
            path=str(spec_path), sha256=spec_sha256, build_sha256=spec.build_sha256(), seed=spec.seed,
            sources={s.name: SourceWeightReport(weight=s.weight, licence=source_licence(s.name), records=found[s.name])
                     for s in spec.sources})

    @classmethod
    def load(cls, spec_path: str | Path, data_path: str | Path) -> "SourceWeights":
        """Read the spec and count the data's sources (one pass over the file, no tokenizing).
        Raises FileNotFoundError / ValueError for a bad spec, ValueError when the data has a source the spec
        does not name; the spec's sources the data lacks are in `missing`."""
        spec = load_spec(spec_path)
        if not Path(data_path).is_file():
            raise FileNotFoundError(f"--data {data_path}: file not found (the file regenerated from --spec)")
        found = data_sources(data_path)
        check_sources_match(spec, found, spec_path, data_path)
        return cls(spec, spec_path, hashlib.sha256(Path(spec_path).read_bytes()).hexdigest(), found)

    @property
    def missing(self) -> list[str]:
        """The spec's sources the data lacks, in spec order: their weights apply to nothing (a regeneration cut
        by its time cap, a small source whose every record was skipped; prepare says so)."""
        return [name for name, r in self.report.sources.items() if r.records == 0]

    def take(self, source: str | None) -> bool:
        """Count a conversation prepare read; False when its source's weight is 0 (leave it out untokenized)."""
        name = source if source is not None else NO_SOURCE
        self.report.sources[name].conversations_read += 1  # load() checked every name is the spec's
        return self.weights[name] > 0

    def copies(self, sources: Sequence[str | None]) -> list[int]:
        """Copies of each conversation (by its source, in order): floor(w) each, plus one for
        `extra_copy_count` of each source's conversations, chosen by a shuffle seeded from
        (spec seed, source name)."""
        out = [0] * len(sources)
        by_source: dict[str, list[int]] = {}
        for i, name in enumerate(sources):
            by_source.setdefault(name if name is not None else NO_SOURCE, []).append(i)
        for name, idx in by_source.items():
            whole = math.floor(self.weights[name])
            extra = set(random.Random(f"{self.spec.seed}/{name}").sample(
                range(len(idx)), extra_copy_count(len(idx), self.weights[name] - whole)))
            for j, i in enumerate(idx):
                out[i] = whole + (j in extra)
        return out

    def apply(self, convs: list[list[Any]], sources: list[str | None],
              stats: Any) -> tuple[list[list[Any]], list[str | None]]:
        """Weight prepare's kept conversations (each a list of documents with `id`, `input_ids`, `loss_mask`
        and `ref`, how a skip example names the conversation): a conversation with c copies
        becomes its documents repeated c times, one with none is left out and moved to `stats`'s skips as
        `weight_draw`. Fills the per-source counts."""
        kept_convs: list[list[Any]] = []
        kept_sources: list[str | None] = []
        for docs, source, c in zip(convs, sources, self.copies(sources)):
            if c == 0:
                stats.reject("weight_draw", docs[0].ref)
                continue
            r = self.report.sources[source if source is not None else NO_SOURCE]
            r.conversations_kept += 1
            r.copies += c
            r.tokens += c * sum(len(d.input_ids) for d in docs)
            r.supervised_tokens += c * sum(int(np.asarray(d.loss_mask, dtype=np.int64).sum()) for d in docs)
            kept_convs.append(docs * c)
            kept_sources.append(source)
        return kept_convs, kept_sources
