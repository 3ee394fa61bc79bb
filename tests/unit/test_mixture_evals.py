"""The evals source (data/mixture/evals_registry.py) on a registry written here: samples turned into prompt-only
records by hand-worked cases, the seeded per-eval reservoir, round-robin order, the caps and the errors."""

import json
import random
from collections import Counter

import pytest

from dflash_trainer.data.mixture.build import build_mixture
from dflash_trainer.data.mixture.leaks import EvalIndex
from dflash_trainer.data.mixture.overlap import EvalText
from dflash_trainer.data.mixture.evals_registry import iter_evals, sample_lines, sample_messages
from dflash_trainer.data.mixture.records import SourceReport, convention_problem
from dflash_trainer.data.mixture.spec import parse_spec

S, U, A = "system", "user", "assistant"


def _m(role, content, name=None):
    return {"role": role, "content": content, **({"name": name} if name else {})}


def test_samples_become_prompt_only_records():
    few_shot = {"input": [_m(S, "Translate to French."), _m(S, "cat", "example_user"), _m(S, "chat", "example_assistant"),
                          _m(S, "dog", "example_user"), _m(S, "chien", "example_assistant"), _m(U, "bird")],
                "ideal": "oiseau"}
    assert sample_messages(few_shot, 3) == ([_m(S, "Translate to French."), _m(U, "cat"), _m(U, "dog"), _m(U, "bird")], "")
    # the question comes last: a cap keeps the last turns
    assert sample_messages(few_shot, 1) == ([_m(S, "Translate to French."), _m(U, "bird")], "")
    # two plain system messages before the first user turn are one system turn; assistant turns are dropped
    two = {"input": [_m(S, "Be brief."), _m(S, "Answer in French."), _m(U, "Hi"), _m(A, "Salut"), _m(U, "Bye")]}
    assert sample_messages(two, 3) == ([_m(S, "Be brief.\n\nAnswer in French."), _m(U, "Hi"), _m(U, "Bye")], "")
    # the task in one system message is asked as the user turn; a text input is one user turn
    assert sample_messages({"input": [_m(S, "Name three rivers.")]}, 3) == ([_m(U, "Name three rivers.")], "")
    assert sample_messages({"input": " 2 + 2 = ? "}, 3) == ([_m(U, "2 + 2 = ?")], "")
    for sample, reason in [([1], "not_json_object"), ({"input": None, "words": ["a"]}, "input_not_chat"),
                           ({"input": [{"content": "x"}]}, "input_not_chat"),
                           ({"input": [_m(U, "x"), {"role": U, "content": ["x"]}]}, "content_not_text"),
                           ({"input": [_m(U, "x"), _m(S, "late")]}, "system_after_user"),
                           ({"input": [_m(U, "  "), _m(A, "y")]}, "no_user_turn")]:
        assert sample_messages(sample, 3) == (None, reason)
    for sample in (few_shot, two):
        assert convention_problem(sample_messages(sample, 3)[0]) is None


def test_reservoir_keeps_everything_under_k_and_is_uniform_over_k(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(f"a{i}\n" for i in range(6)) + "\n")  # a blank line is not a sample
    b.write_text("".join(f"b{i}\n" for i in range(4)))
    order = [f"a{i}" for i in range(6)] + [f"b{i}" for i in range(4)]
    lines, n = sample_lines([a, b], 20, random.Random(0))
    assert n == 10 and [(i, x.strip()) for i, x in lines] == list(enumerate(order))
    picked, n = sample_lines([a, b], 3, random.Random(7))
    assert n == 10 and len(picked) == 3
    assert picked == sample_lines([a, b], 3, random.Random(7))[0]  # seeded: the same draw
    # each with its index among the files' lines, in that order
    assert all(order[i] == x.strip() for i, x in picked) and [i for i, _ in picked] == sorted(i for i, _ in picked)
    # each line is kept with probability k / n = 0.3: over 3,000 draws 900 ± 4.5 σ (σ = √(3000 · 0.3 · 0.7) = 25)
    counts = Counter(x.strip() for s in range(3000) for _, x in sample_lines([a, b], 3, random.Random(s))[0])
    assert set(counts) == set(order) and all(abs(c - 900) < 115 for c in counts.values())


def _registry(root):
    data = root / "evals" / "registry" / "data"
    (root / "evals" / "__init__.py").parent.mkdir(parents=True)
    (root / "evals" / "__init__.py").write_text("raise ImportError('never imported')\n")
    files = {
        "alpha/samples.jsonl": [{"input": [_m(S, "Answer yes or no."), _m(U, f"Is {i} even?")]} for i in range(5)],
        "beta/x/one.jsonl": [{"input": [_m(U, f"Spell the number {i} in words.")]} for i in range(2)],
        "beta/x/two.jsonl": [{"input": f"Write a haiku about the number {i}."} for i in range(2)],
        "gamma/g.jsonl": [{"input": [_m(U, "hi")]}, {"input": None, "game_idx": 1},
                          {"input": [_m(U, "Compose an engaging travel blog post about Hawaii please now.")]}],
        "empty/readme.txt": [],
    }
    for rel, samples in files.items():
        p = data / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(json.dumps(s) + "\n" for s in samples) + ("{not json\n" if rel == "gamma/g.jsonl" else ""))
    return data


@pytest.fixture
def registry(tmp_path, monkeypatch):
    data = _registry(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return data


def _records(options, count=None, seed=0):
    spec = parse_spec({"sources": [{"name": "evals", "count": count, "options": options}]})
    report = SourceReport(name="evals", kind="evals", licence="-")
    return list(iter_evals(spec.sources[0], seed, report)), report


def test_round_robin_over_evals_with_per_eval_caps(registry):
    recs, report = _records({"per_eval": 3})
    assert report.details["evals"] == report.details["evals_in_registry"] == 3  # `empty` has no .jsonl
    assert report.details["lines"] == 5 + 4 + 4 and report.details["drawn"] == {"alpha": 3, "beta": 3, "gamma": 3}
    # round-robin: the draws of rank r of alpha, beta, gamma are ids 3r, 3r + 1, 3r + 2 (skipped ones keep theirs);
    # gamma draws 3 of its 4 lines: "hi" (2 chars) is too short, a `None` input is not chat, a bad line not JSON,
    # and only the travel post is kept
    by_id = {n: m[-1]["content"] for n, m in recs}
    assert [n for n in by_id if n % 3 == 0] == [0, 3, 6] and all(by_id[n].startswith("Is ") for n in (0, 3, 6))
    assert [n for n in by_id if n % 3 == 1] == [1, 4, 7] and all(by_id[n].startswith(("Spell", "Write")) for n in (1, 4, 7))
    assert [n for n in by_id if n % 3 == 2] == [5] and by_id[5].startswith("Compose")  # seed 0 draws it at rank 1
    assert len(recs) + report.num_skipped == 9
    # a count cap takes the first ranks of every eval, not one eval's draws
    spec = parse_spec({"sources": [{"name": "evals", "count": 2, "options": {"per_eval": 3}}]})
    capped = build_mixture(spec, eval_index=EvalIndex([], []))
    assert [r["id"] for r in sorted(capped.records, key=lambda r: r["id"])] == ["evals/0", "evals/1"]
    assert set(report.skipped) <= {"too_short", "input_not_chat", "not_json"}
    # the same seed draws the same samples; another seed may not, but its counts obey the same caps
    assert _records({"per_eval": 3})[0] == recs
    assert len(_records({"per_eval": 100})[0]) == 5 + 4 + 1  # every line: gamma keeps only the travel post


def test_selection_options_and_errors(registry):
    recs, report = _records({"evals": ["beta"], "per_eval": 10})
    assert report.details["drawn"] == {"beta": 4} and len(recs) == 4
    recs, _ = _records({"exclude": ["alpha", "gamma"]})
    assert all(not m[-1]["content"].startswith("Is ") for _, m in recs) and len(recs) == 4
    long_out, report = _records({"evals": ["beta"], "max_chars": 30})
    assert [m[-1]["content"] for _, m in long_out] == ["Spell the number 0 in words.", "Spell the number 1 in words."]
    assert report.skipped == {"too_long": 2}
    with pytest.raises(ValueError, match=r"sources\.evals\.options\.exclude: 'delta' \(did you mean 'beta'\?\): not a "
                                         r"task of the registry at .*; its 3 tasks are the folders there"):
        _records({"exclude": ["delta"]})
    with pytest.raises(ValueError, match=r"sources\.evals\.options\.evals: 'omega': not a task"):
        _records({"evals": ["omega"]})
    with pytest.raises(ValueError, match=r"sources\.evals\.options: `evals` and `exclude` leave no task"):
        _records({"evals": ["beta"], "exclude": ["beta"]})
    for bad, field in (({"per_eval": 0}, "per_eval"), ({"evals": []}, "evals")):
        with pytest.raises(ValueError, match=f"sources.0.options.{field}"):
            parse_spec({"sources": [{"name": "evals", "options": bad}]})


def test_build_checks_leaks_and_duplicates(registry):
    """Through the mixture build: the MT-Bench-like post is caught by the leak check (exact, after normalizing),
    records follow the convention, the source's report counts everything."""
    post = "Compose an engaging travel blog post about Hawaii please now."
    index = EvalIndex([EvalText("mt-bench/81#0", "mt-bench", post.upper())], [])
    spec = parse_spec({"sources": [{"name": "evals", "options": {"per_eval": 100}}]})
    mixture = build_mixture(spec, eval_index=index)
    src = mixture.report.sources[0]
    assert src.skipped.get("eval_leak") == 1 and src.records == 9 == len(mixture.records)
    assert src.package == "evals" and src.licence.startswith("MIT")
    assert all(convention_problem(r["messages"]) is None and r["id"].startswith("evals/") for r in mixture.records)
    assert post not in {r["messages"][-1]["content"] for r in mixture.records}


def test_missing_package_or_registry_names_the_install_command(tmp_path, monkeypatch):
    from dflash_trainer.files.packaged import package_dir

    with pytest.raises(FileNotFoundError, match="needs the package 'no_such_pkg_xyz' is not installed: run `pip x`"):
        package_dir("no_such_pkg_xyz", "registry/data", "pip x", why="needs ")
    (tmp_path / "evals").mkdir()
    (tmp_path / "evals" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"registry/data is missing from the installed 'evals' package: "
                                                r"reinstall it with `pip install --no-deps evals==3.0.1.post1`"):
        _records({})
