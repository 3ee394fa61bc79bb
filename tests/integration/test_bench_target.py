"""`dflash-train bench target` end to end on CPU with a tiny random target: the command runs every
variant and writes the JSON the GPU run will fill with real numbers (the CPU timings mean nothing)."""

import json
import math
import subprocess
import sys

PATHS = ("plain_causal", "sdpa_dense_mask", "flex_block_mask", "flex_compiled")


def test_bench_target_writes_every_field(tmp_path):
    """Prevents a GPU run from failing on a wiring error or a missing field after the model load."""
    out = tmp_path / "bench-target.json"
    r = subprocess.run([sys.executable, "-m", "dflash_trainer.cli.main", "bench", "target", "--device", "cpu", "--shape",
                        "tiny", "--seq-len", "256", "--docs", "3", "--iters", "2", "--warmup", "1",
                        "--sliding-window", "100", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert (d["seq_len"], d["num_documents"], d["rows"], d["dtype"], d["device_name"]) == (256, 3, 1, "float32", "cpu")
    for mode in ("labels", "features_only"):
        for path in PATHS:
            v = d["results"][mode][path]
            assert v["ms_per_row"] > 0 and math.isclose(v["tok_per_s"], 256 / (v["ms_per_row"] / 1e3))
        s = d["speedup"][mode]
        res = d["results"][mode]
        assert math.isclose(s["flex_over_sdpa_dense"],
                            res["sdpa_dense_mask"]["ms_per_row"] / res["flex_block_mask"]["ms_per_row"])
        assert math.isclose(s["compiled_over_flex"],
                            res["flex_block_mask"]["ms_per_row"] / res["flex_compiled"]["ms_per_row"])
        assert s["flex_over_plain_causal"] > 0 and s["sdpa_dense_over_plain_causal"] > 0
        assert s["compiled_over_plain_causal"] > 0
    assert d["lm_head"]["ms_per_row"] > 0
    assert set(d["lm_head"]["share_of_labels_time"]) == set(PATHS)
    assert all(0 < x for x in d["lm_head"]["share_of_labels_time"].values())
    assert d["mask_build_ms"]["sdpa_dense"] > 0 and d["mask_build_ms"]["flex_block"] > 0
    # fp32: the flex path reproduces the SDPA path (sliding layers included)
    assert d["flex_vs_sdpa"]["features_max_rel_diff"] < 1e-5
    assert d["flex_vs_sdpa"]["labels_equal_fraction"] == 1.0
    assert d["layers_compiled"] is False  # compiled layers are the CUDA default; the CPU path stays eager
    assert d["compiled_vs_sdpa"]["features_max_rel_diff"] < 1e-5
    assert d["target_fields"]["layer_types"][:2] == ["sliding_attention", "full_attention"]


def test_bench_target_refuses_bad_flags_at_once():
    r = subprocess.run([sys.executable, "-m", "dflash_trainer.cli.main", "bench", "target", "--device", "cpu",
                        "--seq-len", "1000"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--seq-len 1000: must be a positive multiple of 128" in r.stderr
