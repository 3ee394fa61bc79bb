"""Prepared rows carry their tokenizer's fingerprint; training refuses a target that tokenizes otherwise."""

import json
from io import StringIO

import pytest
from rich.console import Console

from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.data.loader import check_prepared_tokenizer
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.sources import default_sharegpt_path
from dflash_trainer.target_model.tokenizer_check import PROBE_TEXT, tokenizer_fingerprint
from dflash_trainer.training.run_data import prepared_rows

T = 256


@pytest.fixture(scope="module")
def folder(smollm2_tok, tmp_path_factory):
    """20 ShareGPT conversations prepared with the real SmolLM2 tokenizer."""
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare_dataset(default_sharegpt_path(), smollm2_tok, out, seq_len=T, max_conversations=20,
                    validation_fraction=0.1, seed=0)
    return out


class _MisSplit:
    """The SmolLM2 tokenizer with " world" cut into " w" + "orld": the same vocabulary, other ids
    (what a wrong rebuild of a GGUF vocabulary does, tokenizer_check.py)."""

    def __init__(self, inner):
        self.inner = inner
        self.name_or_path = "mis-split"

    def __len__(self):
        return len(self.inner)

    def __call__(self, text, add_special_tokens=False):
        parts = text.split(" world")
        ids = self.inner(parts[0], add_special_tokens=add_special_tokens)["input_ids"]
        for part in parts[1:]:
            ids += self.inner(" w", add_special_tokens=False)["input_ids"]
            ids += self.inner("orld" + part, add_special_tokens=False)["input_ids"]
        return {"input_ids": ids}


def test_report_records_the_fingerprint(folder, smollm2_tok):
    """Prevents an unchecked folder: prepare writes the tokenizer's fingerprint and transformers version."""
    import transformers

    report = json.loads((folder / "prepare_report.json").read_text())
    assert report["tokenizer_fingerprint"] == tokenizer_fingerprint(smollm2_tok)
    assert len(report["tokenizer_fingerprint"]) == 16
    assert report["transformers_version"] == transformers.__version__
    assert " world" in PROBE_TEXT and "def " in PROBE_TEXT
    assert check_prepared_tokenizer(folder, smollm2_tok) is None


def test_a_tokenizer_that_splits_otherwise_is_refused(folder, smollm2_tok):
    """Prevents training on ids the target never produces: one word segmented differently is enough."""
    bad = _MisSplit(smollm2_tok)
    assert tokenizer_fingerprint(bad) != tokenizer_fingerprint(smollm2_tok)
    with pytest.raises(ValueError, match=r"encodes the same text to other ids.*prepare. again"):
        check_prepared_tokenizer(folder, bad)


def test_another_models_tokenizer_is_refused(folder, qwen3_tok):
    """Prevents rows of one model's tokenizer training another model's drafter."""
    with pytest.raises(ValueError, match=r"vocabulary 49152.*vocabulary 151669.*encodes the same text to other ids"):
        check_prepared_tokenizer(folder, qwen3_tok)


def test_training_refuses_before_the_target_loads(folder, smollm2_tok, tmp_path):
    """Prevents the check being skipped on the `--prepared` path of a run (run_data.prepared_rows)."""
    cfg = TrainConfig(prepared=str(folder), seq_len=T, out=str(tmp_path / "run"))
    console = Console(file=StringIO())
    train, _ = prepared_rows(cfg, lambda: smollm2_tok, tmp_path / "run", console)
    assert len(train) > 0
    with pytest.raises(ValueError, match="encodes the same text to other ids"):
        prepared_rows(cfg, lambda: _MisSplit(smollm2_tok), tmp_path / "run", console)
    train, _ = prepared_rows(cfg, lambda: None, tmp_path / "run", console)  # an in-memory target without one
    assert len(train) > 0


def test_rows_without_a_report_warn(smollm2_tok, tmp_path):
    """Prevents a crash (or a silent pass) on rows saved without prepare's report."""
    warning = check_prepared_tokenizer(tmp_path, smollm2_tok)
    assert warning is not None and "no prepare_report.json" in warning


def test_pipeline_launcher_checks_prepared_rows(folder, tmp_path):
    """Prevents the multi-rank layouts skipping the check: the launcher compares `--prepared` rows with the
    target's own tokenizer (here the embedded SmolLM2, loaded from its GGUF) before any rank starts."""
    import shutil

    from dflash_trainer.pipeline.launch import _prepare_in_launcher
    from dflash_trainer.pipeline.target_source import CheckpointTarget

    cfg = TrainConfig(prepared=str(folder), seq_len=T, out=str(tmp_path / "run"))
    console = Console(file=StringIO())
    assert _prepare_in_launcher(cfg, CheckpointTarget(None), console).data.prepared == str(folder)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    report = json.loads((other / "prepare_report.json").read_text())
    report["tokenizer_fingerprint"] = "0" * 16  # rows of a tokenizer that segments the probe text otherwise
    (other / "prepare_report.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match="encodes the same text to other ids"):
        _prepare_in_launcher(cfg.updated({"prepared": str(other)}), CheckpointTarget(None), console)


def test_out_data_of_another_tokenizer_is_prepared_again(smollm2_tok, tmp_path):
    """Prevents a run reusing its own OUT/data after the target's tokenizer changed (another target or
    transformers release): the rows are prepared again with this tokenizer, not refused, not reused."""
    out = tmp_path / "run"
    cfg = TrainConfig(seq_len=T, max_conversations=12, out=str(out))
    console = Console(file=StringIO(), width=10_000)  # no wrapping inside the checked phrases
    prepared_rows(cfg, lambda: smollm2_tok, out, console)
    report = json.loads((out / "data" / "prepare_report.json").read_text())
    report["tokenizer_fingerprint"] = "0" * 16
    (out / "data" / "prepare_report.json").write_text(json.dumps(report))
    prepared_rows(cfg, lambda: smollm2_tok, out, console)
    assert "encodes the same text to other ids" in console.file.getvalue()
    assert "Preparing" in console.file.getvalue() and "again with this target's tokenizer" in console.file.getvalue()
    again = json.loads((out / "data" / "prepare_report.json").read_text())
    assert again["tokenizer_fingerprint"] == tokenizer_fingerprint(smollm2_tok)


def test_fingerprint_ignores_vocabulary_padding(smollm2_tok):
    """Prevents a false alarm between one model's HF tokenizer and its GGUF's, which lists padding
    entries beyond the vocabulary: the same ids for the probe text give the same fingerprint."""

    class _Padded(_MisSplit):
        def __len__(self):
            return len(self.inner) + 271

        def __call__(self, text, add_special_tokens=False):
            return self.inner(text, add_special_tokens=add_special_tokens)

    assert tokenizer_fingerprint(_Padded(smollm2_tok)) == tokenizer_fingerprint(smollm2_tok)


def test_another_chat_template_warns(folder, smollm2_tok):
    """Prevents rows rendered with another model's template passing unnoticed when the two tokenizers
    tokenize plain text alike: the check warns, naming the template's source."""
    other = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
    warning = check_prepared_tokenizer(folder, smollm2_tok, other)
    assert warning is not None and "another chat template (tokenizer" in warning
    assert check_prepared_tokenizer(folder, smollm2_tok, None) is None


def test_a_broken_report_is_not_taken_for_another_tokenizer(folder, smollm2_tok, tmp_path):
    """Prevents a damaged report of a run's own OUT/data being rebuilt silently under a resume: only a
    fingerprint mismatch prepares again; a report that does not parse is an error."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(folder, out / "data")
    cfg = TrainConfig(seq_len=T, max_conversations=20, out=str(out))
    report = json.loads((out / "data" / "prepare_report.json").read_text())
    cfg = cfg.updated({"data.chats": report["data_path"], "validation_fraction": 0.1})
    del report["tokenizer_name"]
    (out / "data" / "prepare_report.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match="tokenizer_name"):
        prepared_rows(cfg, lambda: smollm2_tok, out, Console(file=StringIO()))
