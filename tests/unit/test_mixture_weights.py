"""`prepare --spec`: each source's weight gives the hand-worked number of copies, the report records
the spec and per-source counts, and data whose sources differ from the spec's is refused."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from test_data_prepare import _documents
from typer.testing import CliRunner

from dflash_trainer.data.loader import load_split
from dflash_trainer.data.mixture.spec import load_spec, parse_spec
from dflash_trainer.data.mixture.weights import SourceWeights, extra_copy_count
from dflash_trainer.data.prepare import prepare_dataset

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DOC_TOKENS = 40  # "Question i?" / "Answer i." (i one digit) renders to 40 SmolLM2 tokens (test_data_prepare)

# 10 records, one digit each: chitchat weight 0 (3), math 1 (2), sharegpt 2 (2), code 0.5 (3).
SOURCES = ["chitchat"] * 3 + ["math"] * 2 + ["sharegpt"] * 2 + ["code"] * 3
SPEC_YAML = """seed: 5
sources:
  - name: chitchat
    weight: 0
  - name: math
    count: 10
  - name: sharegpt
    weight: 2
  - name: code
    weight: 0.5
"""


def _data(tmp_path, sources=SOURCES, name="regen.jsonl"):
    data = tmp_path / name
    data.write_text("".join(json.dumps({"id": f"{src}/{i}", "source": src, "messages": [
        {"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}) + "\n"
        for i, src in enumerate(sources)))
    return data


def _spec(tmp_path, text=SPEC_YAML):
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    return spec


def test_copies_follow_the_weight_by_hand():
    """floor(w) copies each plus one for round(n·frac) (half up) of a source: 0 → none, 1 → one each,
    2 → two each, 0.5 of 4 → exactly two, 0.5 of 3 → two, 2.25 of 4 → 2,2,2,3; the same spec picks the
    same conversations, another seed other ones (a Bernoulli draw would not give exact counts)."""
    spec = parse_spec({"seed": 0, "sources": [{"name": "sharegpt", "weight": 0}, {"name": "chitchat", "weight": 1},
                                               {"name": "code", "weight": 2}, {"name": "math", "count": 9, "weight": 0.5}]})
    w = SourceWeights(spec, "s.yaml", "0" * 64, Counter())
    sources = ["sharegpt", "math", "chitchat", "code", "math", "math", "code", "math", "sharegpt"]
    copies = w.copies(sources)
    by = {name: [c for s, c in zip(sources, copies) if s == name] for name in set(sources)}
    assert by["sharegpt"] == [0, 0] and by["chitchat"] == [1] and by["code"] == [2, 2]
    assert sorted(by["math"]) == [0, 0, 1, 1]
    assert w.copies(sources) == copies  # seeded: the same choice every time
    assert [extra_copy_count(n, f) for n, f in [(4, 0.5), (3, 0.5), (4, 0.25), (10, 0.1), (7, 0.0)]] == [2, 2, 1, 1, 0]
    w.weights["math"] = 2.25
    assert sorted(w.copies(["math"] * 4)) == [2, 2, 2, 3]
    w.weights["math"] = 0.5
    picks = {}
    for seed in (0, 1):
        one = parse_spec({"seed": seed, "sources": [{"name": "math", "count": 20, "weight": 0.5}]})
        picks[seed] = SourceWeights(one, "s.yaml", "", Counter()).copies(["math"] * 20)
    assert sum(picks[0]) == sum(picks[1]) == 10 and picks[0] != picks[1]


def test_prepare_with_weights_gives_the_hand_worked_counts(smollm2_tok, tmp_path):
    """Weights 0 / 1 / 2 / 0.5 on 3 / 2 / 2 / 3 records: 0 + 2 + 4 + 2 = 8 copies of 40-token
    documents (320 tokens), 6 conversations kept, 3 skipped as weight_0 (never tokenized) and one
    code conversation as weight_draw; every count of the report's `spec` section by source."""
    data, spec = _data(tmp_path), _spec(tmp_path)
    report = prepare_dataset(data, smollm2_tok, tmp_path / "out", seq_len=128, validation_fraction=0.0, seed=0,
                             weights=SourceWeights.load(spec, data))
    assert report.conversations_read == 10 and report.conversations_kept == 6
    assert report.skipped_by_reason == {"weight_0": 3, "weight_draw": 1}
    assert re.fullmatch(r"line \d+ id=code/\d+", report.skip_examples["weight_draw"][0])  # counted from 1
    assert report.tokens == 8 * DOC_TOKENS
    s = report.spec
    assert s.path == str(spec) and s.seed == 5 and len(s.sha256) == 64
    assert s.build_sha256 == load_spec(spec).build_sha256()
    got = {name: (r.weight, r.records, r.conversations_read, r.conversations_kept, r.copies, r.tokens)
           for name, r in s.sources.items()}
    assert got == {"chitchat": (0.0, 3, 3, 0, 0, 0), "math": (1.0, 2, 2, 2, 2, 80),
                   "sharegpt": (2.0, 2, 2, 2, 4, 160), "code": (0.5, 3, 3, 2, 2, 80)}
    assert list(s.sources) == ["chitchat", "math", "sharegpt", "code"]  # spec order
    per_copy = {r.supervised_tokens // r.copies for r in s.sources.values() if r.copies}
    assert len(per_copy) == 1 and sum(r.supervised_tokens for r in s.sources.values()) == report.supervised_tokens
    assert s.sources["math"].licence.startswith("Apache-2.0") and s.sources["chitchat"].licence.startswith("MIT")
    counts = {k: v.conversations_train + v.conversations_validation for k, v in report.sources.items()}
    assert counts == {"code": 2, "math": 2, "sharegpt": 2}  # conversations, not copies
    saved = json.loads((tmp_path / "out" / "prepare_report.json").read_text())
    assert saved["spec"]["sources"]["sharegpt"]["copies"] == 4
    assert "weighted copies chitchat ×0 (0), math ×1 (2), sharegpt ×2 (4), code ×0.5 (2)" in report.summary_line()
    docs = Counter(_documents(load_split(tmp_path / "out", "train")))
    assert sorted(docs.values()) == [1, 1, 1, 1, 2, 2]  # the two sharegpt documents twice each


def test_copies_of_a_conversation_stay_in_one_split(smollm2_tok, tmp_path):
    """A repeated conversation is one unit of the train/validation split: its copies never reach
    both splits (validation would measure memorization)."""
    data = _data(tmp_path, ["sharegpt"] * 8)
    spec = _spec(tmp_path, "sources:\n  - name: sharegpt\n    weight: 3\n")
    report = prepare_dataset(data, smollm2_tok, tmp_path / "out", seq_len=128, validation_fraction=0.25, seed=0,
                             weights=SourceWeights.load(spec, data))
    assert report.conversations_train == 6 and report.conversations_validation == 2
    assert report.spec.sources["sharegpt"].copies == 24 and report.tokens == 24 * DOC_TOKENS
    train = Counter(_documents(load_split(tmp_path / "out", "train")))
    val = Counter(_documents(load_split(tmp_path / "out", "validation")))
    assert sorted(train.values()) == [3] * 6 and sorted(val.values()) == [3] * 2
    assert not set(train) & set(val)


def test_sources_that_differ_from_the_spec_are_refused(tmp_path):
    """A data source the spec does not name, and records without a `source` field, fail with both file names
    and the fix (prepare the file regenerated from the spec, or name the data's sources in the spec), also
    naming the spec's sources the data lacks; those alone are not an error (a regeneration cut by its time cap
    lacks some), only listed in `missing`."""
    spec = _spec(tmp_path)
    data = _data(tmp_path, ["math", "sharegpt", "chitchat", "poetry", "poetry"])
    with pytest.raises(ValueError) as e:
        SourceWeights.load(spec, data)
    msg = str(e.value)
    assert f"--data {data} does not match --spec {spec}" in msg
    assert "the data has sources the spec does not name: 'poetry' (2 records)" in msg
    assert "the spec also names sources the data lacks: 'code'" in msg
    assert f"regenerate --spec {spec}" in msg
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "q"},
                                                      {"role": "assistant", "content": "a"}]}) + "\n" for _ in range(2)))
    with pytest.raises(ValueError, match=r"records without a `source` field \(2\)"):
        SourceWeights.load(spec, plain)
    assert SourceWeights.load(spec, _data(tmp_path, SOURCES[::-1], "ok.jsonl")).missing == []  # any order: accepted
    assert SourceWeights.load(spec, _data(tmp_path, ["math", "sharegpt"], "part.jsonl")).missing == ["chitchat", "code"]


def test_prepare_cli_spec(smollm2_tok, tmp_path, monkeypatch):
    """`prepare --spec`: a data source the spec lacks fails with exit 2 before the tokenizer loads; a spec
    source the data lacks is a note; a matching file is prepared with the weights (the report's `spec`
    section)."""
    from dflash_trainer.cli.main import app
    from dflash_trainer.target_model import load

    calls = []
    monkeypatch.setattr(load, "load_tokenizer", lambda target: calls.append(target) or smollm2_tok)
    spec = _spec(tmp_path)
    bad = _data(tmp_path, ["math", "poetry"], "bad.jsonl")
    result = CliRunner().invoke(app, ["prepare", "--out", str(tmp_path / "o1"), "--data", str(bad), "--spec", str(spec),
                                      "--seq-len", "128"])
    assert result.exit_code == 2 and "the data has sources the spec does not name: 'poetry' (1 records)" in result.output
    assert calls == []  # refused before the tokenizer was loaded
    part = _data(tmp_path, ["math", "sharegpt"], "part.jsonl")
    result = CliRunner().invoke(app, ["prepare", "--out", str(tmp_path / "o0"), "--data", str(part), "--spec", str(spec),
                                      "--seq-len", "128", "--validation-fraction", "0"])
    assert result.exit_code == 0, result.output
    assert "note: --spec names sources --data lacks: chitchat, code (their weights apply to nothing)" in result.output
    result = CliRunner().invoke(app, ["prepare", "--out", str(tmp_path / "o2"), "--data", str(_data(tmp_path)),
                                      "--spec", str(spec), "--seq-len", "128", "--validation-fraction", "0"])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "o2" / "prepare_report.json").read_text())
    assert saved["spec"]["path"] == str(spec) and saved["conversations_kept"] == 6 and saved["tokens"] == 320


def test_shipped_no_code_spec_is_the_mixture_with_code_weight_0():
    """configs/mixture-smollm2-no-code.yaml builds the same prompts as mixture-smollm2.yaml (same
    build sha256, so one regeneration serves both) and differs only by code's weight 0."""
    base, no_code = load_spec(CONFIGS / "mixture-smollm2.yaml"), load_spec(CONFIGS / "mixture-smollm2-no-code.yaml")
    assert no_code.build_sha256() == base.build_sha256()
    assert {s.name: s.weight for s in base.sources} == {"sharegpt": 1, "math": 1, "chitchat": 1, "code": 1}
    assert {s.name: s.weight for s in no_code.sources} == {"sharegpt": 1, "math": 1, "chitchat": 1, "code": 0}
