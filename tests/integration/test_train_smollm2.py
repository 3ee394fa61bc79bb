"""End to end on the real embedded target and data: SmolLM2-135M-Instruct + ShareGPT, CPU.

Slow (loads the GGUF, ~40 s, once per test session: the `smollm2_target` fixture, the same call `train`
makes for it); CI runs it. Prevents a pipeline that runs but does not learn (misaligned labels, a
dead mask, a frozen drafter) and a broken run-directory contract.
"""

import json

import pytest
from safetensors.torch import load_file

from dflash_trainer.config.load import load_config
from dflash_trainer.training.run import train

pytestmark = pytest.mark.slow


def test_short_real_run_learns_and_writes_contract(tmp_path, smollm2_target):
    """Loss of the last logs is below the first logs; metrics.jsonl and checkpoint-final follow the contract."""
    cfg = load_config(None, {"out": str(tmp_path / "run"), "device": "cpu", "max_steps": 16, "log_every": 4},
                      ["seq_len=256", "num_anchors=16", "num_layers=1", "block_size=8", "max_conversations=40", "lr=1e-3"])
    result = train(cfg, target=smollm2_target)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(4, 17, 4))
    for r in records:
        assert {"step", "loss", "tokens", "tok_per_s", "acc_per_position", "tau_estimate"} <= set(r)
        assert len(r["acc_per_position"]) == 7  # slots 1..B-1 with B = 8
        assert r["tokens"] == r["step"] * 256
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < 0.8 * first, (first, last)
    ckpt = tmp_path / "run" / "checkpoint-final"
    weights = load_file(str(ckpt / "model.safetensors"))
    assert set(weights) == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.0.{n}" for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                  "input_layernorm.weight", "post_attention_layernorm.weight")}
    cfg_json = json.loads((ckpt / "config.json").read_text())
    assert cfg_json["target_layer_ids"] == [1, 8, 14, 20, 27]
    assert cfg_json["hidden_size"] == 576 and cfg_json["block_size"] == 8
    assert result.validation["valid_slots"] > 0
