"""Target families end to end (CPU, tiny zoo folders from tests/zoo.py): a stateful family trains with
one target forward per document and says so in its log; refused choices stop at init-config or at
train start with one line (architecture, missing piece, way out)."""

import json

import pytest

from tests.integration.tiny_run import make_prepared, make_target, train_here


def test_stateful_target_trains_one_forward_per_document(tmp_path):
    """LFM2 (short convolutions + attention) on rows of two documents: the run logs that each document
    runs as its own target forward, trains 3 steps with finite losses, and its validation τ exists."""
    target, prepared = make_target(tmp_path / "lfm2", "lfm2"), make_prepared(tmp_path / "prepared", rows=6)
    result, text = train_here(tmp_path / "run", target, prepared, "target_layer_ids=[0,1]", max_steps=3)
    flat = " ".join(text.split())
    assert "target attention: sdpa (target_attention=auto)" in flat
    assert "target forward: one target forward per document (Lfm2ForCausalLM has conv layers (Lfm2ShortConv)" in flat
    assert result.steps == 3
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]
    assert len(losses) == 3 and all(0 < x < 100 for x in losses)


def _stale_drafter_config(path, target):
    """init-config's file for `target`, minus the embedding and logits fields (a file written before
    them: read back, they default to 1 / None)."""
    from dflash_trainer.config.sections import DrafterSection
    from dflash_trainer.drafter.shape import drafter_config_from_target, load_target_config, write_drafter_config

    hf_config, tokenizer, name = load_target_config(str(target))
    dc, info = drafter_config_from_target(hf_config, tokenizer,
                                          DrafterSection(num_layers=1, block_size=8, target_layer_ids=[0, 1]))
    write_drafter_config(path, dc, info, name)
    body = json.loads(path.read_text())
    for key in ("embedding_scale", "logit_scale", "logit_softcap"):
        body.pop(key)
    path.write_text(json.dumps(body))
    return path


@pytest.mark.parametrize(("family", "sets", "needles"), [
    ("gpt_oss", ["target_attention=sdpa"], ["target_attention=sdpa: GptOssForCausalLM has attention sinks",
                                           "use target_attention=auto"]),
    ("gemma3", ["drafter_config={stale}"], ["drafter_config: embedding_scale=1.0 (the target's: 8.0)",
                                            "regenerate it with init-config"]),
])
def test_refused_at_train_start(tmp_path, family, sets, needles):
    """A choice that would train on wrong features, or a drafter config whose block embedding is not the
    target's (Gemma 3 scales its rows by √H), stops the run before the first step, with the line the CLI
    prints."""
    target, prepared = make_target(tmp_path / family, family), make_prepared(tmp_path / "prepared", rows=4)
    stale = _stale_drafter_config(tmp_path / "stale.json", target) if family == "gemma3" else None
    sets = [s.format(stale=stale) for s in sets]
    with pytest.raises(ValueError) as e:
        train_here(tmp_path / "run", target, prepared, "target_layer_ids=[0,1]", *sets, max_steps=2)
    text = " ".join(str(e.value).split())
    for n in needles:
        assert n in text, (n, text)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_init_config_names_what_the_family_needs_or_refuses(tmp_path):
    """init-config prints the per-document forward for a hybrid target, and refuses GPT-2 (no `layers`
    list) with one line and exit 2, writing nothing."""
    from typer.testing import CliRunner

    from dflash_trainer.cli.main import app

    target = make_target(tmp_path / "qwen3_next", "qwen3_next")
    r = CliRunner().invoke(app, ["init-config", "--target", str(target), "--out", str(tmp_path / "d.json"),
                                 "--num-layers", "1", "--target-layer-ids", "0,2"])
    flat = " ".join(r.output.split())
    assert r.exit_code == 0, flat
    assert "target family: one target forward per document (Qwen3NextForCausalLM has linear_attention layers" in flat
    gpt2 = make_target(tmp_path / "gpt2", "gpt2")
    r = CliRunner().invoke(app, ["init-config", "--target", str(gpt2), "--out", str(tmp_path / "g.json")])
    flat = " ".join(r.output.split())
    assert r.exit_code == 2 and "Traceback" not in flat, flat
    assert "error: GPT2LMHeadModel" in flat and "`layers`" in flat
    assert not (tmp_path / "g.json").exists()
