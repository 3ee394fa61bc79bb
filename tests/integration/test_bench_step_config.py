"""`bench step --config`'s code path on CPU (the numbers only mean something on a GPU): a training
config file's shapes reach the benched step, a target that cannot be loaded is replaced by a random
one of its shape with a note, and a training run's `profile_at_step` writes its breakdown."""

import json
import math

import pytest
import torch

from dflash_trainer.bench.step import bench_step_config
from dflash_trainer.config.load import load_config
from dflash_trainer.config.sections import parse_layer_types
from tests.integration.tiny_run import make_prepared, make_target, train_here
from tests.tiny_targets import tiny_llama

CONFIG = """seq_len: 256
num_layers: 2
block_size: 4
layer_types: last-full
sliding_window: 64
num_anchors: 32
rows_per_step: 2
target_layer_ids: [0, 2]
position_weights: dpace
device: cpu
"""



def test_bench_step_config_uses_the_config_shapes_and_says_the_target_is_random(tmp_path, one_thread):
    """Prevents a config bench that silently benches other shapes than the config's, or a random
    stand-in target passing for the real one: the target folder here has weights but no tokenizer,
    so it cannot be loaded and a random model of its config's shape is benched, said in the JSON."""
    folder = tmp_path / "target"
    tiny_llama(num_layers=4, hidden=64, vocab_size=128).save_pretrained(folder)  # no tokenizer
    (tmp_path / "c.yaml").write_text(CONFIG)
    cfg = load_config(str(tmp_path / "c.yaml"), {"num_anchors": 16})  # a flag overrides the file
    r = bench_step_config(cfg, torch.device("cpu"), target=str(folder), config_file=str(tmp_path / "c.yaml"),
                          num_documents=3, warmup=1, iters=2, profile_steps=2)
    s = r["shape"]
    assert (s["seq_len"], s["rows"], s["num_documents"], s["num_anchors"], s["block_size"]) == (256, 2, 3, 16, 4)
    assert (s["num_layers"], s["sliding_window"]) == (2, 64)
    assert s["layer_types"] == parse_layer_types("last-full", 2) == ["sliding_attention", "full_attention"]
    assert (s["hidden_size"], s["vocab_size"], s["num_target_layers"], s["num_target_features"]) == (64, 128, 4, 2)
    assert r["position_weights"] == "dpace" and r["config"] == str(tmp_path / "c.yaml")
    t = r["target"]
    assert t["source"] == "random" and "RANDOM-WEIGHT" in t["note"] and str(folder) in t["name"]
    assert t["mask_token"].startswith("row 127")
    assert math.isclose(r["context_tok_per_s"], 2 * 256 / (r["step_ms_median"] / 1e3))
    assert r["target_forward_ms_median"] > 0 and r["training_step_ms_median"] > r["target_forward_ms_median"]
    b = r["breakdown"]
    assert b["profiled_steps"] == 2 and "target forward + drafter step" in b["what"]
    assert b["sections"]["target_layers"]["ms"] > 0 and b["sections"]["target_labels"]["ms"] > 0
    assert math.isclose(sum(v["ms"] for v in b["sections"].values()), b["step_ms"], rel_tol=1e-9)
    assert "cached_step_ms_median" not in r  # no feature cache in this config
    json.dumps(r)  # JSON-ready as the CLI writes it


def test_bench_step_config_times_the_cached_step_when_the_config_caches(tmp_path, one_thread):
    """With feature_cache_gib the bench also times an epoch-2 step (target outputs served from the cache,
    then the drafter step): the cache holds both rows, and the cached step skips the target forward."""
    folder = tmp_path / "target"
    tiny_llama(num_layers=4, hidden=64, vocab_size=128).save_pretrained(folder)
    (tmp_path / "c.yaml").write_text(CONFIG + "feature_cache_gib: 0.01\n")
    cfg = load_config(str(tmp_path / "c.yaml"), {})
    r = bench_step_config(cfg, torch.device("cpu"), target=str(folder), num_documents=3, warmup=1, iters=3,
                          profile_steps=0)
    assert r["feature_cache"]["stored_rows"] == 2 and r["feature_cache"]["rows_computed"] == 2
    assert r["cached_all_rows"] is True
    assert r["feature_cache"]["rows_served"] >= 2 * 5  # 2 warm-up + 3 timed steps, 2 rows each
    assert math.isclose(r["cached_tok_per_s"], 2 * 256 / (r["cached_step_ms_median"] / 1e3))
    assert math.isclose(r["cached_speedup_over_series"], r["training_step_ms_median"] / r["cached_step_ms_median"])
    json.dumps(r)


def test_a_training_run_profiles_the_steps_it_is_asked_to(tmp_path, one_thread):
    """Prevents `profile_at_step` doing nothing, or profiling other steps than asked: a 4-step run
    with profile_at_step=1, profile_steps=2 writes the breakdown of steps 1 and 2."""
    target = make_target(tmp_path / "target")
    prepared = make_prepared(tmp_path / "data", rows=8)
    result, text = train_here(tmp_path / "run", target, prepared, "profile_at_step=1", "profile_steps=2",
                              max_steps=4)
    assert result.steps == 4
    got = json.loads((tmp_path / "run" / "step_breakdown.json").read_text())
    assert (got["first_step"], got["steps"]) == (1, 2)
    b = got["breakdown"]
    assert b["sections"]["target_layers"]["ms"] > 0 and b["sections"]["backward_drafter"]["ms"] > 0
    assert "step time by section" in text
