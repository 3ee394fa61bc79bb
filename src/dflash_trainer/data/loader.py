"""Read prepared rows back: one split as a `datasets.Dataset`, batches of R rows as tensors.

Shapes: R = rows in a batch, T = tokens per row.

`iterate_rows` visits every row once per epoch in an order fixed by (seed, epoch), so a run can be
resumed exactly: a batch's `row_index` says which dataset rows it holds, and `start` skips the rows
of the epoch's order already consumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_trainer.data.prepare import SPLITS, file_sha256, tokenizer_name
from dflash_trainer.data.prepare_report import REPORT_NAME, PrepareReport, load_report
from dflash_trainer.data.tokenize import chat_template_sha256, resolve_chat_template
from dflash_trainer.target_model.tokenizer_check import tokenizer_fingerprint


def load_split(out_dir: str | Path, split: str) -> Any:
    """The `split` ("train" or "validation") of a prepared folder as a torch-formatted Dataset."""
    from datasets import load_from_disk

    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    path = Path(out_dir) / split
    if not path.is_dir():
        raise FileNotFoundError(f"{path} not found: run `dflash-train prepare --out {out_dir}` first")
    return load_from_disk(str(path)).with_format("torch")


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The row order of one epoch: a permutation of range(num_rows) fixed by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def iterate_rows(dataset: Any, rows_per_batch: int, seed: int, epoch: int, *, start: int = 0
                 ) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of R=rows_per_batch rows in the (seed, epoch) order; the last batch may be smaller.

    Yields input_ids [R,T] int64, loss_mask [R,T] bool, position_ids [R,T] int64 and row_index [R]
    int64 (dataset rows of the batch). `start` = rows of this epoch's order already consumed.
    """
    if rows_per_batch <= 0:
        raise ValueError(f"rows_per_batch={rows_per_batch} must be positive")
    order = epoch_order(len(dataset), seed, epoch)
    for b in range(start, len(order), rows_per_batch):
        idx = order[b:b + rows_per_batch]
        rows = dataset[idx.tolist()]
        yield {
            "input_ids": _as_2d(rows["input_ids"]).long(),  # [R,T]
            "loss_mask": _as_2d(rows["loss_mask"]).bool(),  # [R,T]
            "position_ids": _as_2d(rows["position_ids"]).long(),  # [R,T]
            "row_index": torch.from_numpy(idx.astype(np.int64)),  # [R]
        }


def _as_2d(col: Any) -> torch.Tensor:
    if isinstance(col, torch.Tensor):
        return col
    if isinstance(col, (list, tuple)) and col and isinstance(col[0], torch.Tensor):
        return torch.stack(list(col))
    return torch.as_tensor(np.asarray(col))


def verify_prepared(out_dir: str | Path, data_path: str | Path) -> PrepareReport:
    """The folder's report, after checking that `data_path` is the file it was prepared from.

    Raises ValueError when the file's sha256 differs from the report's (the data changed since
    `prepare`, so the rows no longer reflect it).
    """
    report = load_report(out_dir)
    digest = file_sha256(data_path)
    if digest != report.data_sha256:
        raise ValueError(f"{data_path} changed since {out_dir} was prepared (sha256 {digest[:12]} != "
                         f"{report.data_sha256[:12]} in the report): run `dflash-train prepare` again")
    return report


class TokenizerMismatch(ValueError):
    """Prepared rows tokenized otherwise than the target's tokenizer tokenizes (check_prepared_tokenizer)."""


def check_prepared_tokenizer(out_dir: str | Path, tokenizer: Any, chat_template: str | None = None) -> str | None:
    """Check that the rows in `out_dir` were tokenized as `tokenizer` (the target's) tokenizes.

    Compares the report's `tokenizer_fingerprint` (written by `prepare`) with this tokenizer's. Returns
    None when they agree, or a warning line when there is nothing to compare (no report) or when the
    rows were rendered with another chat template than
    `chat_template` (the run's explicit template text) or else the tokenizer's own (a warning: an
    explicit template given to `prepare` may be meant).
    Raises PrepareFormatMismatch (a ValueError) for a folder of another prepare format, and
    TokenizerMismatch (a ValueError) naming both tokenizers and transformers versions when the
    fingerprints differ: the rows hold
    ids the target would not produce for the same text (another tokenizer, or one rebuilt wrongly from
    a GGUF by another transformers release), so the drafter would learn a token stream the served
    model never sees. The fix: prepare again with this target.
    """
    if not (Path(out_dir) / REPORT_NAME).is_file():
        return (f"{out_dir} holds no {REPORT_NAME} (rows saved by other means): its token ids cannot be checked "
                "against this target's tokenizer")
    report = load_report(out_dir)
    now = tokenizer_fingerprint(tokenizer)
    if now != report.tokenizer_fingerprint:
        import transformers

        raise TokenizerMismatch(
            f"{out_dir} was tokenized by {report.tokenizer_name} (vocabulary {report.tokenizer_vocab_size}, "
            f"transformers {report.transformers_version}, fingerprint {report.tokenizer_fingerprint}), but this "
            f"target's tokenizer {tokenizer_name(tokenizer)} (vocabulary {len(tokenizer)}, transformers "
            f"{transformers.__version__}) encodes the same text to other ids (fingerprint {now}): the rows are not "
            f"what the target reads. Run `dflash-train prepare` again with this target, or train with the target "
            f"and transformers release the rows were prepared with.")
    try:
        template = chat_template_sha256(resolve_chat_template(tokenizer, chat_template))
    except ValueError:  # no template to compare with (prepare would have refused such a tokenizer)
        return None
    if template != report.chat_template_sha256:
        return (f"{out_dir} was rendered with another chat template ({report.chat_template_source}, sha256 "
                f"{report.chat_template_sha256[:12]}) than this run's ({template[:12]}): the drafter learns the "
                "prepared conversations' formatting; prepare again if that is not the serving template")
    return None


def check_mask_token_unused(rows: Any, mask_token_id: int) -> None:
    """Raise ValueError when the mask token occurs in the training rows (`load_split` output): the
    anchor slot would be ambiguous. Every layout checks this before training (one Arrow pass)."""
    import pyarrow.compute as pc

    column = rows.data.table.column("input_ids")
    hits = pc.sum(pc.equal(pc.list_flatten(column), mask_token_id)).as_py() or 0
    if hits:
        raise ValueError(f"mask_token_id={mask_token_id} occurs {hits} times in the training rows; pick a token the data "
                         "never uses (--set mask_token_id=ID, see `dflash-train init-config`)")
