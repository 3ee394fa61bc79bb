"""Messy input end to end on a tiny CPU target: unusable records are skipped, counted and reported
while the valid ones train; bad settings stop with one clear line (exit 2, no traceback) that names
the field and the fix. The CLI's mapping of an error to that one line is checked through the CLI
(no chat template, data changed since prepare; tests/integration/test_cli_fast.py has more); the
other refusals are the same command's run in this process (`train_here`), checked by the error's
text, which is the line the CLI prints."""

import json
import random
import shutil

import pytest

from tests.integration.tiny_run import make_target, run, train_cmd, train_here

T = 128


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, 100)}" for _ in range(n))


def _messy_jsonl(path, rng: random.Random, valid: int = 30) -> None:
    """`valid` good conversations, then one record of each bad kind, then one longer than T."""
    lines = [json.dumps({"id": f"ok{i}", "conversations": [{"from": "human", "value": _words(rng, 12)},
                                                          {"from": "gpt", "value": _words(rng, 30)}]})
             for i in range(valid)]
    lines += [
        '{"id": "broken", "conversations": [{"from": "human", "value": "w3',  # malformed JSON line
        json.dumps({"id": "noanswer", "conversations": [{"from": "human", "value": "w4 w5"}]}),
        json.dumps({"id": "empty", "conversations": [{"from": "human", "value": "   "}, {"from": "gpt", "value": "w5"}]}),
        json.dumps({"id": "narrator", "conversations": [{"from": "narrator", "value": "w4"},
                                                        {"from": "gpt", "value": "w5"}]}),
        json.dumps({"id": "long", "conversations": [{"from": "human", "value": _words(rng, 10)},
                                                    {"from": "gpt", "value": _words(rng, 3 * T)}]}),
    ]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("badinput")
    target = make_target(d / "target")
    data = d / "chats.jsonl"
    _messy_jsonl(data, random.Random(0))
    return d, target, data


def _train(out, target, *extra):
    """train_cmd without --prepared: data is prepared from chats by the run itself."""
    cmd = train_cmd(out, target, out / "unused", "--max-steps", "4", *extra)
    i = cmd.index("--prepared")
    return cmd[:i] + cmd[i + 2:]


def test_unusable_records_are_counted_reported_and_the_rest_trains(setup):
    """Prevents silent data loss and crashes on messy data: each bad record kind is one counted skip
    in the console line and prepare_report.json, the long one is split (counted), training runs."""
    d, target, data = setup
    out = d / "messy"
    # the run of _train(out, target, "--data", data, ...) in this process: the run reports, not the CLI
    result, text = train_here(out, target, None, "max_conversations=null", "validation_fraction=0.1", max_steps=4,
                              data=data)
    assert result.steps == 4
    text = " ".join(text.split())
    assert ("31 of 35 conversations kept, skipped: empty_turn 1 (a turn's text is empty; e.g. line ") in text, text
    assert ("unknown_role 1 (roles are system, human, user, gpt, assistant, chatgpt, bing, bard; e.g. line 34 "
            "id=narrator)") in text, text
    assert "invalid_json 1 (each line must be one JSON object; e.g. line " in text, text
    report = json.loads((out / "data" / "prepare_report.json").read_text())
    assert report["skipped_by_reason"] == {"invalid_json": 1, "no_assistant_turn": 1, "empty_turn": 1,
                                           "unknown_role": 1}
    assert report["skip_examples"]["unknown_role"] == ["line 34 id=narrator"]
    assert report["train"]["split"] + report["validation"]["split"] == 1
    assert "longer than T=128 split into" in text
    assert report["conversations_kept"] == 31
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["first_loss"] is not None
    assert "peak_memory_gib" in summary and summary["peak_memory_gib"] is None  # CUDA only


def _one_line_error(r, *needles):
    assert r.returncode == 2, r.stdout + r.stderr
    both = " ".join((r.stdout + r.stderr).split())
    assert "Traceback" not in both, both
    for n in needles:
        assert n in both, (n, both)


def _refused_here(out, target, prepared, *sets, needles, data=None):
    """The run of `_train(out, target, ...)` (prepared None: from `data`) or `train_cmd` in this
    process raises the ValueError whose text the CLI prints as its one line (exit 2)."""
    with pytest.raises(ValueError) as e:
        train_here(out, target, prepared, *sets, max_steps=4, data=data)
    text = " ".join(str(e.value).split())
    for n in needles:
        assert n in text, (n, text)


def test_tokenizer_without_chat_template(setup, tmp_path):
    d, target, data = setup
    bare = tmp_path / "bare"
    shutil.copytree(target, bare)
    cfg_file = bare / "tokenizer_config.json"
    body = json.loads(cfg_file.read_text())
    body.pop("chat_template", None)
    cfg_file.write_text(json.dumps(body))
    for f in bare.glob("chat_template*"):
        f.unlink()
    r = run(_train(tmp_path / "run", bare, "--data", str(data)))
    _one_line_error(r, "has no chat template", "--chat-template")


def test_target_layer_ids_out_of_range(setup, tmp_path):
    d, target, data = setup
    _refused_here(tmp_path / "run", target, None, "target_layer_ids=[0,7]", data=data,
                  needles=("target_layer_ids", "[0, 7]"))


def test_mask_token_that_is_a_real_token(setup, tmp_path):
    d, target, data = setup
    _refused_here(tmp_path / "run", target, None, "mask_token_id=5", data=data,
                  needles=("mask_token_id=5: the tokenizer uses it for the real token 'w5'", "spare special token"))


def test_mask_token_used_by_the_data(setup, tmp_path):
    """Rows prepared elsewhere that contain the mask row (100, the first unused embedding row)."""
    from datasets import Dataset

    from tests.integration.tiny_run import make_prepared

    d, target, _ = setup
    prepared = make_prepared(tmp_path / "prepared")
    rows = Dataset.load_from_disk(str(prepared / "train")).to_dict()
    rows["input_ids"][3][7] = 100
    shutil.rmtree(prepared / "train")
    Dataset.from_dict(rows).save_to_disk(str(prepared / "train"))
    _refused_here(tmp_path / "run", target, prepared,
                  needles=("mask_token_id=100 occurs 1 times in the training rows", "--set mask_token_id=ID"))


def test_drafter_config_that_does_not_match_the_target(setup, tmp_path):
    d, target, data = setup
    from dflash_trainer.drafter.config import DrafterConfig

    dc = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=128, block_size=8, mask_token_id=100,
                       target_layer_ids=[0, 2], num_target_layers=3)
    (tmp_path / "drafter.json").write_text(dc.model_dump_json())
    _refused_here(tmp_path / "run", target, None, f"drafter_config={tmp_path / 'drafter.json'}", data=data,
                  needles=("do not match the target", "hidden 32", "init-config"))


def test_data_changed_since_prepare(setup, tmp_path):
    d, target, data = setup
    copy = tmp_path / "chats.jsonl"
    shutil.copy(data, copy)
    from dflash_trainer.cli.main import prepare  # the `dflash-train prepare` command's function, in this process

    prepare(out=str(tmp_path / "prep"), data=str(copy), target=str(target), seq_len=T)
    report = json.loads((tmp_path / "prep" / "prepare_report.json").read_text())
    assert (report["conversations_read"], report["conversations_kept"]) == (35, 31)
    copy.write_text(copy.read_text() + copy.read_text().splitlines()[0] + "\n")
    cmd = train_cmd(tmp_path / "run", target, tmp_path / "prep", "--data", str(copy), "--max-steps", "2")
    _one_line_error(run(cmd), "changed since", "prepare")
