"""`regenerate --spec`: the spec's prompts are built once into OUT.prompts.jsonl, reused while the
spec's build fields stay, rebuilt when they change, and a change under a started regeneration is
refused; the regenerated file then feeds `prepare --spec` with any weighting."""

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dflash_trainer.data.mixture import build
from dflash_trainer.data.mixture.prompt_cache import prompts_path, regenerate_input
from dflash_trainer.data.mixture.spec import load_spec
from dflash_trainer.data.mixture.weights import SourceWeights
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.regenerate import RegenerateSettings, regenerate_file
from dflash_trainer.data.responders import Response


def _chat_file(path, n, word):
    """n conversations "Tell me about <word> i." with an answer (the spec keeps only the user turns)."""
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {word} {i}."},
                                                     {"role": "assistant", "content": "old"}]}) + "\n"
                            for i in range(n)))
    return path


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    """Two chat-file sources (3 birds, 2 trees), a spec writer, and a count of mixture builds."""
    birds, trees = _chat_file(tmp_path / "birds.jsonl", 3, "bird"), _chat_file(tmp_path / "trees.jsonl", 2, "tree")
    builds = []
    real = build.build_mixture
    monkeypatch.setattr(build, "build_mixture", lambda spec, **kw: builds.append(spec.seed) or real(spec, **kw))

    def spec(seed=0, trees_weight=1.0):
        path = tmp_path / "spec.yaml"
        path.write_text(f"seed: {seed}\nsources:\n  - name: {birds}\n    options: {{keep_assistant: false}}\n"
                        f"  - name: {trees}\n    weight: {trees_weight}\n    options: {{keep_assistant: false}}\n")
        return str(path)

    return tmp_path, spec, builds, str(birds), str(trees)


def _log():
    buf = io.StringIO()
    return Console(file=buf, width=400), buf


def test_prompts_are_built_once_and_reused_across_weightings(setup):
    """The first call builds OUT.prompts.jsonl (5 prompt-only records with their source); the same
    spec, or one that changes only a weight, reuses it untouched; another seed rebuilds it (no
    regeneration started yet) and says why."""
    tmp, spec, builds, birds, trees = setup
    out = str(tmp / "regen.jsonl")
    console, log = _log()
    path = regenerate_input(None, spec(), out, console)
    assert path == str(prompts_path(out)) == f"{out}.prompts.jsonl" and builds == [0]
    records = [json.loads(x) for x in open(path)]
    assert sorted(r["source"] for r in records) == [birds] * 3 + [trees] * 2
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in records)
    report = json.loads(open(f"{path}.report.json").read())
    assert report["spec_build_sha256"] == load_spec(spec()).build_sha256()
    before = prompts_path(out).stat().st_mtime_ns
    assert regenerate_input(None, spec(trees_weight=0), out, console) == path and builds == [0]
    assert regenerate_input(None, spec(), out, console) == path and builds == [0]
    assert prompts_path(out).stat().st_mtime_ns == before
    assert "reusing" in log.getvalue()
    regenerate_input(None, spec(seed=7), out, console)
    assert builds == [0, 7] and "was built from another spec" in log.getvalue() and "rebuilding" in log.getvalue()
    assert json.loads(open(f"{path}.report.json").read())["spec"]["seed"] == 7


def test_changed_spec_under_a_started_regeneration_is_refused(setup):
    """Once OUT (or its partial file) regenerates the cached prompts, a spec with other build fields
    is an error naming both hashes and the fix, and nothing is rebuilt; the original spec still works."""
    tmp, spec, builds, _, _ = setup
    out = tmp / "regen.jsonl"
    console, _ = _log()
    regenerate_input(None, spec(), str(out), console)
    out.write_text("")  # a finished regeneration of those prompts
    with pytest.raises(ValueError) as e:
        regenerate_input(None, spec(seed=3), str(out), console)
    old, new = load_spec(spec(seed=0)).build_sha256(), load_spec(spec(seed=3)).build_sha256()
    msg = str(e.value)
    assert f"(build sha256 {new[:12]}) is not the spec" in msg and f"(build sha256 {old[:12]})" in msg
    assert "choose another --out" in msg and builds == [0]
    assert regenerate_input(None, spec(), str(out), console) == str(prompts_path(out))
    other = tmp / "other.jsonl"
    other.write_text("")  # regenerated from --data: no prompts cache next to it
    with pytest.raises(ValueError, match="exists but was not regenerated with --spec"):
        regenerate_input(None, spec(), str(other), console)


def test_data_or_spec_exactly_one(setup, tmp_path):
    """--data alone passes through unchanged (nothing built); both or neither is a clear error, also
    from the command line (exit 2)."""
    _, spec, builds, birds, _ = setup
    assert regenerate_input(birds, None, str(tmp_path / "o.jsonl")) == birds and builds == []
    with pytest.raises(ValueError, match="--data and --spec both given: pass one"):
        regenerate_input(birds, spec(), str(tmp_path / "o.jsonl"))
    with pytest.raises(ValueError, match="give --data FILE .* or --spec SPEC"):
        regenerate_input(None, None, str(tmp_path / "o.jsonl"))
    from dflash_trainer.cli.main import app

    result = CliRunner().invoke(app, ["regenerate", "--out", str(tmp_path / "o.jsonl"), "--data", birds,
                                      "--spec", spec()])
    assert result.exit_code == 2 and "--data and --spec both given" in result.output and builds == []


def test_regenerated_spec_prompts_feed_prepare_with_any_weighting(setup, smollm2_tok):
    """End to end without a model: the built prompts answered by a stub target keep their `source`,
    so `prepare --spec` weights them; the same regenerated file serves two weightings."""
    tmp, spec, _, birds, trees = setup
    out = tmp / "regen.jsonl"
    data = regenerate_input(None, spec(), str(out))
    answer = lambda convs, seed: [Response(text=f"Answer {len(c)}.", finished=True) for c in convs]  # noqa: E731
    report = regenerate_file(RegenerateSettings(data=data, out=str(out)), answer)
    assert report.records_written == 5
    for trees_weight, (kept, copies) in {1.0: (5, 5), 0.0: (3, 3)}.items():
        weights = SourceWeights.load(spec(trees_weight=trees_weight), out)
        r = prepare_dataset(out, smollm2_tok, tmp / f"prep{trees_weight}", seq_len=256, validation_fraction=0.0,
                            weights=weights)
        assert r.conversations_kept == kept and sum(s.copies for s in r.spec.sources.values()) == copies
        assert r.spec.sources[birds].copies == 3 and r.spec.sources[trees].records == 2
