"""`dflash-train bench regen-shapes` on CPU with the tiny shape (the command's wiring and fields; CPU
timings mean nothing), and the shapes' parameter counts against the public checkpoints' sizes."""

import json
import subprocess
import sys

import pytest

from dflash_trainer.bench.regen_shapes import SHAPES, shape_numbers


@pytest.mark.parametrize("name,params", [
    ("smollm2-135m", 134_515_008),   # SmolLM2-135M: 134.5M (tied embeddings)
    ("qwen2.5-0.5b", 494_032_768),   # Qwen2.5-0.5B: 0.49B (tied), as its model card counts
    ("qwen3-1.7b", 1_720_574_976),   # Qwen3-1.7B: 1.7B (tied), 1.4B without the embedding
    ("qwen3-8b", 8_190_735_360),     # Qwen3-8B: 8.2B, untied
])
def test_shape_params_match_the_checkpoints(name, params):
    """Norm weights aside (a few hundred thousand), the counted parameters are the checkpoints' own.
    Prevents a mistyped field from scaling the plan's regeneration rate of every target."""
    n = shape_numbers(name)
    assert abs(n["params"] - params) / params < 0.001, (name, n["params"])


def test_tiny_run_writes_every_field(tmp_path):
    out = tmp_path / "rs.json"
    r = subprocess.run([sys.executable, "-m", "dflash_trainer.cli.main", "bench", "regen-shapes", "--shapes", "tiny",
                        "--device", "cpu", "--rows", "4", "--new-tokens", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    s = d["shapes"]["tiny"]
    assert (s["rows"], s["prompts"], s["layers"], s["vocab"]) == (4, 8, 2, 10_240)
    # each of the 8 prompts generates at most 3 tokens; an early id 0 (the bench's eos) ends one sooner
    assert 8 <= s["tokens"] <= 24 and s["tokens_per_s"] > 0 and s["vs_first"] == 1.0
    assert 64 <= s["mean_prompt_tokens"] <= 1024 and d["transformers"] and d["torch"]


def test_unknown_shape_is_refused_with_the_names():
    r = subprocess.run([sys.executable, "-m", "dflash_trainer.cli.main", "bench", "regen-shapes", "--shapes",
                        "tiny,llama-70b", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "llama-70b" in r.stderr + r.stdout and all(n in r.stderr + r.stdout for n in SHAPES)


def test_a_shape_out_of_memory_is_reported_and_the_others_run(monkeypatch):
    """--rows above what a shape's KV cache fits (the 8B shape at 256 rows on 80 GiB did this): that shape gets
    an error naming its rows and the fix, the run goes on, and the ratios skip it."""
    import torch

    from dflash_trainer.bench import regen_shapes

    def fake(name, rows, device, new_tokens):
        if name == "qwen3-8b":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {"rows": rows, "tokens_per_s": 100.0 if name == "tiny" else 50.0}

    monkeypatch.setattr(regen_shapes, "_run_shape", fake)
    d = regen_shapes.bench_regen_shapes(["tiny", "qwen3-8b", "smollm2-135m"], device=torch.device("cpu"), rows=256)
    assert d["shapes"]["qwen3-8b"]["error"].startswith("CUDA out of memory at 256 rows: lower --rows")
    assert "vs_first" not in d["shapes"]["qwen3-8b"]
    assert d["shapes"]["smollm2-135m"]["vs_first"] == 0.5 and d["shapes"]["tiny"]["vs_first"] == 1.0
