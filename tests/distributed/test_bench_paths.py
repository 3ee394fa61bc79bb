"""The throughput benchmarks' code paths on CPU at tiny sizes (the numbers only mean something on GPUs;
this checks that a GPU run will not fail on a wiring error and that the ratios are formed)."""

import math

from dflash_trainer.bench.colocated import bench_colocated
from dflash_trainer.bench.common import BenchShape
from dflash_trainer.bench.pipeline import bench_pipeline

TINY = BenchShape(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=256, num_target_layers=6, num_target_features=2, seq_len=128, num_documents=2,
                  num_anchors=8, block_size=4, layer_types="full")
TINY_TARGET = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)


def test_colocated_bench_runs_and_forms_its_ratios(tmp_path):
    r = bench_colocated(tmp_path, steps=6, warmup_steps=2, log_every=2, probe_iters=2, shape=TINY,
                        target_fields=TINY_TARGET, cpu=True)
    t, d = r["target_standalone_tok_per_s"], r["drafter_standalone_tok_per_s"]
    assert t > 0 and d > 0
    assert math.isclose(r["serial_bound_tok_per_s"], 1 / (1 / t + 1 / d))
    assert r["end_to_end_tok_per_s"] > 0
    assert math.isclose(r["ratio_end_to_end_over_serial"], r["end_to_end_tok_per_s"] / r["serial_bound_tok_per_s"])
    assert [x["step"] for x in r["intervals"]] == [2, 4, 6]
    assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
    b = r["breakdown"]  # the profiled feed + step stretch: target forward and drafter step, by section
    assert b["profiled_steps"] == 6 and b["time_kind"] == "cpu_op_self"
    for name in ("target_layers", "target_labels", "drafter_forward", "lm_head_loss", "backward_drafter", "optimizer"):
        assert b["sections"][name]["ms"] > 0, name
    assert math.isclose(sum(v["ms"] for v in b["sections"].values()), b["step_ms"], rel_tol=1e-9)
    assert math.isnan(r["gpu_busy_pct"])  # no GPU


def test_pipeline_bench_runs_and_forms_its_ratios(tmp_path):
    r = bench_pipeline(tmp_path, steps=6, warmup_steps=2, log_every=2, probe_iters=2, shape=TINY,
                       target_fields=TINY_TARGET, cpu=True)
    assert r["target_standalone_tok_per_s"] > 0 and r["end_to_end_tok_per_s"] > 0
    assert math.isclose(r["ratio_end_to_end_over_target"], r["end_to_end_tok_per_s"] / r["target_standalone_tok_per_s"])
    assert r["drafter_wait_pct"] is not None and 0 <= r["drafter_wait_pct"] <= 100


def test_pipeline_bench_with_a_measured_split_forms_its_ratios(tmp_path):
    """The `bench pipeline --gpus` path (here 3 CPU processes): measured rates, the chosen layout run,
    end to end against the projection of the chosen split."""
    r = bench_pipeline(tmp_path, steps=4, warmup_steps=2, log_every=2, probe_iters=2, shape=TINY,
                       target_fields=TINY_TARGET, cpu=True, split="3")
    chosen = r["auto_split"]["chosen"]
    assert chosen["targets"] + chosen["drafters"] == 3 and r["projected_tok_per_s"] == chosen["projected_tok_per_s"] > 0
    assert f"{chosen['targets']} target + {chosen['drafters']} drafter processes" in r["what"]
    assert math.isclose(r["ratio_end_to_end_over_projected"], r["end_to_end_tok_per_s"] / r["projected_tok_per_s"])
