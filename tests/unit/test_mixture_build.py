"""The mixture build on real packaged data with small counts: every source gives well-formed
records, reports add up, the same spec gives the same records, and nothing leaks from the evals."""

import json
import re

import pytest

from dflash_trainer.data.mixture.build import build_mixture, report_path, write_mixture
from dflash_trainer.data.mixture.leaks import EvalIndex, find_eval_leaks, normalize
from dflash_trainer.data.mixture.records import convention_problem, user_texts
from dflash_trainer.data.mixture.spec import parse_spec

COUNTS = {"sharegpt": 40, "math": 30, "chitchat": 40, "code": 40}


@pytest.fixture(scope="module")
def eval_index():
    try:
        return EvalIndex.load()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _spec(tmp_path, seed=0):
    chat = tmp_path / "extra.jsonl"
    chat.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
                      {"role": "assistant", "content": "7"}]},
        {"conversations": [{"from": "human", "value": "Tell me one fact about otters."}, {"from": "gpt", "value": "..."},
                           {"from": "human", "value": "Can you be more specific?"},
                           {"from": "gpt", "value": "Yes."}]},  # held out (≥ MIN_EXACT_WORDS words)
        {"messages": [{"role": "user", "content": "Compose an engaging travel blog post about a recent trip to "
                                                  "Hawaii, highlighting cultural experiences and must-see attractions."},
                      {"role": "assistant", "content": "..."}]},  # MT-Bench question 81, turn 1
        {"messages": [{"role": "assistant", "content": "no user turn"}]},
    ]) + "\n")
    return parse_spec({"seed": seed, "sources": [
        {"name": "sharegpt", "count": COUNTS["sharegpt"]},
        {"name": "math", "count": COUNTS["math"], "options": {"workers": 2}},
        {"name": "chitchat", "count": COUNTS["chitchat"], "options": {"max_user_turns": 4}},
        {"name": "code", "count": COUNTS["code"], "options": {"packages": ["stdlib"]}},
        {"name": str(chat)},
    ]}), str(chat)


@pytest.fixture(scope="module")
def built(tmp_path_factory, eval_index):
    tmp = tmp_path_factory.mktemp("mixture")
    try:
        spec, chat = _spec(tmp)
        return spec, chat, build_mixture(spec, eval_index=eval_index), tmp
    except FileNotFoundError as e:  # a data package is missing: `make setup` installs them
        pytest.skip(str(e))


def test_records_follow_the_convention(built):
    """Every record is {id, source, messages}; roles follow the convention (conversations with
    answers for sharegpt and chat files, user turns only for the prompt sources); no empty text."""
    _, chat, mix, _ = built
    assert mix.records
    for r in mix.records:
        assert set(r) == {"id", "source", "messages"}
        assert re.fullmatch(re.escape(r["source"]) + r"/\d+", r["id"])
        assert convention_problem(r["messages"]) is None, r
        roles = [m["role"] for m in r["messages"]]
        if r["source"] in ("sharegpt", chat):
            assert "assistant" in roles and roles[-1] == "assistant"
        else:
            assert set(roles) == {"user"}
        assert all(t.strip() for t in user_texts(r))
    assert len({r["id"] for r in mix.records}) == len(mix.records)


def test_counts_and_report_add_up(built):
    """Each source gives its count, and the report's records and turns are those of the records."""
    _, chat, mix, _ = built
    by_source = {}
    for r in mix.records:
        by_source.setdefault(r["source"], []).append(r)
    for s in mix.report.sources:
        recs = by_source.get(s.name, [])
        assert s.records == len(recs)
        assert s.user_turns == sum(len(user_texts(r)) for r in recs)
        if s.name in COUNTS:
            assert s.records == COUNTS[s.name], s
    assert mix.report.records == len(mix.records)
    file_report = mix.report.sources[-1]
    assert file_report.records == 2  # the MT-Bench copy and the record without a user turn are dropped
    assert file_report.skipped == {"eval_leak": 1, "reader_no_user_turn": 1}
    otters = next(r for r in mix.records if r["source"] == chat and "otters" in r["messages"][0]["content"])
    assert len(otters["messages"]) == 2  # cut before "Can you be more specific?", which held-out ShareGPT asks
    check = mix.report.eval_leak_check
    assert check.by_source[chat] == 2 and check.eval_prompts["mt-bench"] == 160 and check.eval_prompts["humaneval"] == 164
    assert check.eval_prompts["sharegpt-heldout"] > 10_000
    assert {(e["suite"], e["rule"]) for e in check.examples if e["record_id"].startswith(chat)} == {
        ("mt-bench", "exact"), ("sharegpt-heldout", "exact")}
    assert {s.licence.split()[0] for s in mix.report.sources[1:3]} == {"Apache-2.0", "MIT"}


def test_math_report_names_modules(built):
    """The math report says which generator modules ran and which failed, and which shims applied."""
    math = next(s for s in built[2].report.sources if s.name == "math")
    assert len(math.details["modules_ran"]) == COUNTS["math"]  # one question per module per round
    assert isinstance(math.details["modules_failed"], dict) and isinstance(math.details["shims"], list)
    assert math.package == "mathematics-dataset" and math.version == "1.0.1"


def test_chitchat_turns_are_one_speakers_messages(built, eval_index):
    """A chitchat record's user turns are its first speaker's messages, in order, cut at max_user_turns,
    or earlier before a turn that repeats an eval prompt of at least MIN_EXACT_WORDS (4) words."""
    from dflash_trainer.data.mixture.chitchat import CHITCHAT_FILE, CHITCHAT_INSTALL, CHITCHAT_PACKAGE
    from dflash_trainer.files.packaged import package_file

    data = list(json.loads(package_file(CHITCHAT_PACKAGE, CHITCHAT_FILE, CHITCHAT_INSTALL).read_text()).values())
    for r in [r for r in built[2].records if r["source"] == "chitchat"][:10]:
        conv = data[int(r["id"].split("/")[1])]["messages"]
        first = conv[0][0]["sender"]
        expected = ["\n".join(u["text"].strip() for u in m if u["text"].strip()) for m in conv if m[0]["sender"] == first]
        want = [t for t in expected if t][:4]
        got = user_texts(r)
        assert got == want[:len(got)]
        if len(got) < len(want):
            assert eval_index.text_leaks(want[len(got)])


def test_same_spec_same_records(built, eval_index):
    """Determinism: building the same spec again gives identical records in identical order, also
    with one math process instead of two (each math module has its own seeded random states, and
    its process a fixed hash seed); another seed gives another order."""
    spec, _, mix, tmp = built
    data = spec.model_dump()
    data["sources"][1]["options"]["workers"] = 1
    again = build_mixture(parse_spec(data), eval_index=eval_index)
    assert again.records == mix.records
    # the machine's override (the recipe gives every CPU): the same records, spec and build hash; the count is reported
    more = build_mixture(spec, eval_index=eval_index, math_workers=3)
    assert more.records == mix.records
    assert (more.report.spec, more.report.spec_build_sha256) == (mix.report.spec, mix.report.spec_build_sha256)
    assert [s.details["workers"] for s in more.report.sources if s.name == "math"] == [3]
    assert [s.details["workers"] for s in mix.report.sources if s.name == "math"] == [2]
    small = {"sources": [{"name": "chitchat", "count": 20}, {"name": "code", "count": 20,
                                                              "options": {"packages": ["stdlib"]}}]}
    orders = [[r["id"] for r in build_mixture(parse_spec({**small, "seed": seed}), eval_index=eval_index).records]
              for seed in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) and orders[0] != orders[1]


def test_written_file_and_report(built):
    """The JSONL holds the records line by line; the report sits next to it with size and sha256."""
    _, _, mix, tmp = built
    out = tmp / "prompts.jsonl"
    path = write_mixture(mix, out)
    assert path == report_path(out) and path.name == "prompts.jsonl.report.json"
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x) for x in lines] == mix.records
    report = json.loads(path.read_text())
    assert report["output"]["bytes"] == out.stat().st_size and len(report["output"]["sha256"]) == 64
    assert [s["name"] for s in report["sources"]][:4] == list(COUNTS)


def test_no_eval_leak_in_mixture_or_any_code_prompt(built, eval_index):
    """No training prompt equals or contains an MT-Bench turn or a HumanEval prompt, and no code
    request names a HumanEval entry point: checked on the built mixture and on everything the code
    source can produce from the standard library and numpy."""
    from dflash_trainer.data.mixture.code_prompts import iter_code
    from dflash_trainer.data.mixture.records import SourceReport, make_record

    assert find_eval_leaks(built[2].records, eval_index) == []
    spec = parse_spec({"sources": [{"name": "code", "options": {"packages": ["stdlib", "numpy"]}}]})
    report = SourceReport(name="code", kind="code", licence="-")
    records = [make_record("code", n, m) for n, m in iter_code(spec.sources[0], 0, report, eval_index.humaneval_names)]
    assert len(records) > 3000
    assert find_eval_leaks(records, eval_index) == []
    names = eval_index.humaneval_names
    requested = {name for r in records for name in re.findall(r"(?:`|def |\.)(\w+)\(", user_texts(r)[0])}
    assert len(requested) > 1000 and not requested & names


def test_leak_rules_catch_copies(eval_index):
    """The check flags a prompt that embeds an MT-Bench turn (other case and spacing: near) or asks
    for a HumanEval function with its docstring, and passes ordinary prompts."""
    turn = max((t.text for t in eval_index.texts), key=len)  # the longest eval text
    mt = next(t.text for t in eval_index.texts if t.suite == "mt-bench")
    fn = eval_index.functions[0]
    records = [
        {"id": "a/0", "messages": [{"role": "user", "content": "Please:\n  " + mt.upper().replace(" ", "\n ")}]},
        {"id": "b/0", "messages": [{"role": "user", "content": f"Write `{fn.name}(x)`: {fn.docstring_key}."}]},
        {"id": "c/0", "messages": [{"role": "user", "content": "What is 2 + 2?"},
                                   {"role": "assistant", "content": turn}]},  # assistant text is not a prompt
        {"id": "d/0", "messages": [{"role": "user", "content": f"Explain {fn.name} in one line."}]},
    ]
    camel = next(f for f in eval_index.functions if f.name != f.name.lower())  # e.g. digitSum
    records.append({"id": "e/0", "messages": [{"role": "user", "content": f"Write {camel.name}. {camel.docstring_key}"}]})
    leaks = find_eval_leaks(records, eval_index)
    assert [(x.record_id, x.rule) for x in leaks] == [("a/0", "near"), ("b/0", "humaneval_function"),
                                                      ("e/0", "humaneval_function")]
    assert normalize("  A\n\tB  ") == "a b"


def test_missing_packages_name_the_install_command(monkeypatch):
    """A source whose package is missing stops with the pip command that fixes it."""
    import importlib.util

    from dflash_trainer.data.mixture import maths
    from dflash_trainer.data.mixture.code_prompts import iter_code
    from dflash_trainer.data.mixture.records import SourceReport

    spec = parse_spec({"sources": [{"name": "code", "options": {"packages": ["no_such_package_xyz"]}},
                                   {"name": "math", "count": 1}]})
    report = SourceReport(name="code", kind="code", licence="-")
    with pytest.raises(FileNotFoundError, match="run `pip install no_such_package_xyz` or remove it"):
        next(iter_code(spec.sources[0], 0, report, frozenset()))
    real = importlib.util.find_spec
    monkeypatch.setattr(maths.importlib.util, "find_spec", lambda name: None if name == "absl" else real(name))
    with pytest.raises(FileNotFoundError, match=r"needs absl: run `pip install --no-deps mathematics-dataset==1.0.1"):
        next(maths.iter_math(spec.sources[1], 0, SourceReport(name="math", kind="math", licence="-")))


def test_cli_writes_file_and_report_or_fails_cleanly(tmp_path):
    """`dflash-train mixture` writes OUT and OUT.report.json and prints the per-source report; a bad
    spec exits 2 with one line naming the field."""
    from typer.testing import CliRunner

    from dflash_trainer.cli.main import app

    spec = tmp_path / "spec.yaml"
    spec.write_text("seed: 3\nsources:\n  - name: code\n    count: 5\n    options: {packages: [stdlib]}\n")
    out = tmp_path / "p.jsonl"
    result = CliRunner().invoke(app, ["mixture", "--spec", str(spec), "--out", str(out), "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 5 and report_path(out).is_file()
    assert "code: 5 records, 5 user turns" in result.output and "stdlib==" in result.output
    result = CliRunner().invoke(app, ["mixture", "--spec", str(spec), "--out", str(tmp_path / "w.jsonl"), "--workers", "0"])
    assert result.exit_code == 2 and "--workers 0: give 1 … 16 math generator processes" in result.output
    result = CliRunner().invoke(app, ["mixture", "--spec", str(spec), "--out", str(tmp_path / "w.jsonl"), "--workers", "17"])
    assert result.exit_code == 2 and "--workers 17: give 1 … 16 math generator processes" in result.output
    spec.write_text("sources:\n  - name: code\n    cuont: 5\n")
    result = CliRunner().invoke(app, ["mixture", "--spec", str(spec), "--out", str(out)])
    assert result.exit_code == 2 and "sources.0.cuont: unknown field; did you mean 'count'?" in result.output


def test_code_packages_parsed_in_processes_give_the_same_definitions():
    """The code source's packages parsed in 2 forked processes (`parse_packages`, the recipe's --workers)
    give exactly the definitions, file counts and unparsable counts of one process; a missing package
    still names its install command."""
    from dflash_trainer.data.mixture import code_prompts

    packages = ["jinja2", "requests", "werkzeug"]
    one = {p: code_prompts._parse(p) for p in packages}
    assert all(len(one[p][0]) > 50 for p in packages)  # real definitions, not an empty parse
    for p in packages:
        code_prompts._PARSED.pop(p, None)
    code_prompts.parse_packages(packages, workers=2)
    assert {p: code_prompts._PARSED[p] for p in packages} == one
    code_prompts._PARSED.pop("jinja2")
    with pytest.raises(FileNotFoundError, match="pip install"):
        code_prompts.parse_packages(["jinja2", "no_such_package_xyz"], workers=2)
