"""The rows a co-located run trains and validates on: prepared into OUT/data with the target's
tokenizer (redone when the chat file or a data setting changed, `same_source`), or read from
`prepared`; a warning when they were written by an older prepare format."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.data.loader import TokenizerMismatch, check_prepared_tokenizer, load_split, verify_prepared
from dflash_trainer.data.prepare import file_sha256, prepare_dataset
from dflash_trainer.data.prepare_report import REPORT_NAME, PrepareFormatMismatch, load_report
from dflash_trainer.data.sources import data_path_of_record, default_sharegpt_path, recorded_data_path


def prepared_rows(cfg: TrainConfig, tokenizer: Callable[[], Any], out: Path, console: Console):
    """(train, validation) rows: prepared now into OUT/data with `tokenizer()`, or read from `prepared`
    (checked against `data`) or from an earlier OUT/data. Rows read are checked to be tokenized as
    `tokenizer()` tokenizes (loader.check_prepared_tokenizer): `prepared` rows that are not raise
    ValueError, an OUT/data that is not is prepared again; so is an OUT/data of another prepare format,
    while a `prepared` folder of one raises PrepareFormatMismatch. A `tokenizer()` of None (an in-memory target without
    one) skips that check."""
    prepared = Path(cfg.data.prepared) if cfg.data.prepared else out / "data"
    if cfg.data.prepared and (prepared / REPORT_NAME).is_file():
        load_report(prepared)  # refuses another prepare format before anything else is read
    if cfg.data.prepared and cfg.data.chats:
        verify_prepared(prepared, cfg.data.chats)
    reuse = bool(cfg.data.prepared) or ((prepared / "prepare_report.json").is_file() and same_source(prepared, cfg))
    tok = tokenizer() if reuse else None
    chat_template = cfg.data.chat_template_text()
    warning = None
    if reuse and tok is not None:
        try:
            warning = check_prepared_tokenizer(prepared, tok, chat_template)
        except TokenizerMismatch as e:
            if cfg.data.prepared:
                raise
            # OUT/data from another target or transformers release: this run's rows are made again (a resumed
            # run goes on over the new rows)
            console.print(f"{e}\nPreparing {prepared} again with this target's tokenizer.", highlight=False,
                          markup=False)
            reuse = False
    if not reuse:
        data_path = cfg.data.chats or str(default_sharegpt_path())
        report = prepare_dataset(data_path, tok if tok is not None else tokenizer(), prepared, seq_len=cfg.data.seq_len,
                                 max_conversations=cfg.data.max_conversations, validation_fraction=cfg.data.validation_fraction,
                                 seed=cfg.runtime.seed, chat_template=chat_template, enable_thinking=cfg.data.enable_thinking)
        console.print(f"data: {report.summary_line()}", highlight=False, markup=False)
    else:
        if (prepared / REPORT_NAME).is_file():
            console.print(f"data: {load_report(prepared).summary_line()} (in {prepared})", highlight=False, markup=False)
        if warning:
            console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    train_rows, val_rows = load_split(prepared, "train"), load_split(prepared, "validation")
    if len(train_rows) == 0:
        raise ValueError(f"{prepared} holds no training rows: every conversation was skipped (see prepare_report.json)")
    seq_len = len(train_rows[0]["input_ids"])
    if seq_len != cfg.data.seq_len:
        raise ValueError(f"seq_len={cfg.data.seq_len} but {prepared} holds rows of {seq_len} tokens; set --set seq_len={seq_len}")
    return train_rows, val_rows


def same_source(prepared: Path, cfg: TrainConfig) -> bool:
    """Whether OUT/data was prepared from this run's chat file (same recorded name, or the same file
    from here, and the same size and sha256: a different file of the same name is not reused; the
    folder may have moved since) with its data
    settings (seq_len, seed, max_conversations, validation_fraction, enable_thinking): reused on
    resume, redone otherwise, so a run re-pointed at other data never trains on the old rows."""
    try:
        rep = load_report(prepared)  # a damaged report of this format raises: never rebuilt silently
    except (OSError, PrepareFormatMismatch):  # none, or another prepare format: prepared again
        return False
    data = Path(cfg.data.chats) if cfg.data.chats else default_sharegpt_path()
    try:  # the report names the file portably (data/sources.recorded_data_path): as written, or where it is from here
        same_name = rep.data_path == recorded_data_path(data, prepared) or os.path.realpath(
            data_path_of_record(rep.data_path, prepared)) == os.path.realpath(data)
        # a name says nothing of the bytes (`chats.jsonl` of another folder, or rewritten): the digest decides
        same_file = same_name and rep.data_bytes == data.stat().st_size and rep.data_sha256 == file_sha256(data)
    except OSError:
        return False
    return (same_file and rep.seq_len == cfg.data.seq_len and rep.seed == cfg.runtime.seed
            and rep.max_conversations == cfg.data.max_conversations
            and rep.validation_fraction == cfg.data.validation_fraction
            and rep.enable_thinking == cfg.data.enable_thinking)
