"""prepare_report.json: everything needed to audit and reproduce a prepared folder, in one format
(PREPARE_FORMAT_VERSION); a folder of another format is refused, never read. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ValidationError

from dflash_trainer.data.chat import skip_summary
from dflash_trainer.data.mixture.leaks import LeakCheck
from dflash_trainer.data.mixture.weights import SpecWeights
from dflash_trainer.data.pack import PackStats
from dflash_trainer.data.sources import SHAREGPT_HELDOUT_CONVERSATIONS

REPORT_NAME = "prepare_report.json"


class SourceConversations(BaseModel):
    """Kept conversations of one prompt-mixture source, per split, and the source's licence."""

    conversations_train: int = 0
    conversations_validation: int = 0
    licence: str


# The one format of prepared folders: each assistant turn's document is what serving renders for it
# (data/serving.py), the report names the tokenizer by its fingerprint, and no user turn repeats an
# eval prompt (4: the eval-leak check, data/mixture/leaks.py). A folder of another version is refused
# (`load_report`); prepare it again. (Records sharing an id fall in one split since 2026-12-07,
# data/prepare.py `validation_set`; with distinct ids the split is the one before, byte for byte, so the
# format stays. Only a folder prepared earlier from `regenerate --samples` output can hold a prompt's
# samples on both sides: prepare it again.)
PREPARE_FORMAT_VERSION = 4


class PrepareReport(BaseModel):
    """Everything needed to audit and reproduce a prepared folder (written as prepare_report.json)."""

    format_version: int = PREPARE_FORMAT_VERSION
    # --- inputs ---
    # the chat file: the packaged ShareGPT by its package name, a file of the prepared folder relative to
    # it, any other as given on the command line (data/sources.recorded_data_path); its bytes' digest and size
    data_path: str
    data_sha256: str
    data_bytes: int
    tokenizer_name: str  # the target's name (smollm2-135m) or its path as given (target_model/paths.recorded_target)
    tokenizer_vocab_size: int
    # how the tokenizer encodes a fixed probe text (target_model/tokenizer_check.tokenizer_fingerprint) and the
    # transformers that built it; training refuses a target whose tokenizer differs
    tokenizer_fingerprint: str
    transformers_version: str
    chat_template_sha256: str
    chat_template_source: str  # "tokenizer" or "explicit"
    enable_thinking: bool | None
    seq_len: int
    seed: int
    validation_fraction: float
    max_conversations: int | None
    long_documents: str
    pad_id: int
    # --- conversations (read = kept + skipped) ---
    conversations_read: int
    conversations_kept: int
    conversations_skipped: int
    skipped_by_reason: dict[str, int]
    skip_examples: dict[str, list[str]]
    leading_assistant_turns_dropped: int
    trailing_turns_dropped: int
    # kept conversations whose single render differs from what serving shows for some assistant turn
    # (e.g. Qwen3 strips earlier reasoning), kept as one document per assistant turn
    expanded_per_turn: int = 0
    expanded_per_turn_documents: int = 0  # the documents those conversations became
    conversations_train: int
    conversations_validation: int
    validation_ids: list[str]  # distinct ids; conversations_validation counts records (a prompt's samples each)
    ids_shared: int = 0  # kept records whose id another kept record has too (split together: prepare.validation_set)
    # the packaged ShareGPT file only: usable-conversation index where its held-out tail starts
    # (never read), where training stops (before the parts of the conversation the tail starts in),
    # and whether reading stopped there; None / False for other files
    heldout_start: int | None = None
    training_end: int | None = None
    stopped_at_heldout: bool = False
    # user turns checked against the eval prompts, leaks by rule / suite / source, conversations cut and
    # skipped (data/mixture/leaks.py)
    eval_leak_check: LeakCheck | None = None  # None only in hand-made reports (tests)
    # records with a `source` field (a prompt mixture): per source; {} otherwise
    sources: dict[str, SourceConversations] = {}
    # `prepare --spec`: the spec file and per source its weight, conversations read / kept, copies, tokens
    spec: SpecWeights | None = None
    # --- packed rows ---
    train: PackStats
    validation: PackStats
    rows_train: int
    rows_validation: int
    tokens: int  # non-padding tokens, both splits
    supervised_tokens: int
    padding_fraction: float

    def summary_line(self) -> str:
        """One console line: conversations kept and skipped (by reason), long documents split or
        truncated, rows and tokens."""
        skipped = skip_summary(self.skipped_by_reason, self.skip_examples)
        parts = [f"{self.conversations_kept} of {self.conversations_read} conversations kept"
                 + (f", skipped: {skipped}" if skipped else "")]
        if self.expanded_per_turn:
            parts.append(f"{self.expanded_per_turn} expanded to {self.expanded_per_turn_documents} per-turn documents "
                         f"(their single render differs from what serving shows)")
        split = self.train.split + self.validation.split
        truncated = self.train.truncated + self.validation.truncated
        if split:
            parts.append(f"{split} longer than T={self.seq_len} split into "
                         f"{self.train.split_pieces + self.validation.split_pieces} pieces")
        if truncated:
            parts.append(f"{truncated} longer than T={self.seq_len} truncated "
                         f"({self.train.tokens_truncated + self.validation.tokens_truncated} tokens dropped)")
        dropped = self.train.skipped_no_supervision + self.validation.skipped_no_supervision
        if dropped:
            parts.append(f"{dropped} documents or pieces without supervised tokens left out")
        if self.ids_shared:
            parts.append(f"{self.ids_shared} records share their id with another (a prompt's samples?): each id "
                         f"goes to one split whole, {len(self.validation_ids)} ids to validation")
        if self.stopped_at_heldout:
            parts.append(f"stopped at usable conversation {self.training_end}: the last "
                         f"{SHAREGPT_HELDOUT_CONVERSATIONS} (from {self.heldout_start}) are held out for "
                         f"`eval --dataset sharegpt-heldout`")
        if self.eval_leak_check is not None:
            parts.append(self.eval_leak_check.summary())
        if self.sources:
            parts.append("sources " + ", ".join(f"{k} {v.conversations_train + v.conversations_validation}"
                                                for k, v in self.sources.items()))
        if self.spec:
            parts.append("weighted copies " + self.spec.summary())
        parts.append(f"rows {self.rows_train} train / {self.rows_validation} validation, {self.tokens:,} tokens")
        return "; ".join(parts)


def load_report(out_dir: str | Path) -> PrepareReport:
    """The prepare_report.json of a folder written by `prepare`.

    Raises FileNotFoundError when there is none, PrepareFormatMismatch (a ValueError) when it is
    not JSON or was written in another format than PREPARE_FORMAT_VERSION (the folder is prepared
    again or refused), ValueError naming the field when a report of this format is damaged (never
    rebuilt silently: a resumed run would change its rows)."""
    path = Path(out_dir) / REPORT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {out_dir} is not a folder written by `dflash-train prepare`")
    try:
        body = json.loads(path.read_text())
    except ValueError:
        body = None
    version = body.get("format_version") if isinstance(body, dict) else None
    if version != PREPARE_FORMAT_VERSION:
        raise PrepareFormatMismatch(f"{out_dir} holds prepared rows of format {version}, this version reads format "
                                    f"{PREPARE_FORMAT_VERSION}: run `dflash-train prepare` again")
    try:
        return PrepareReport.model_validate(body)
    except ValidationError as e:
        raise ValueError(f"{path} is not a valid format-{PREPARE_FORMAT_VERSION} report "
                         f"({e.error_count()} errors, first: {e.errors()[0]['loc']}): run "
                         "`dflash-train prepare` again") from None


class PrepareFormatMismatch(ValueError):
    """A prepared folder of another format, or a report that is not JSON: prepared again (a run's own
    OUT/data) or refused (`--prepared`), never read."""
