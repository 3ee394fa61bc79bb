"""GPU-only: the time breakdown attributes a compiled CUDA training step's kernels to its sections.

On CUDA the breakdown counts kernel time, linked by the profiler from each kernel to the CPU op that
launched it (Triton kernels of compiled code included) and from backward kernels to autograd's
nodes; the CPU tests cannot see those links. A tiny target (flex attention, compiled layers) and a
small drafter (compiled layers, flex masks, compiled loss) run one serial training step.
"""

import math

import pytest
import torch

from dflash_trainer.bench.step_rig import rig_from_config
from dflash_trainer.config.schema import TrainConfig
from dflash_trainer.target_model.load import bundle_from_model
from dflash_trainer.telemetry.breakdown import SECTIONS, profile_steps
from tests.tiny_targets import tiny_llama

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_breakdown_puts_the_kernels_in_their_sections():
    """Prevents a GPU breakdown that loses kernels (a kernel → op link this torch does not make, GPU
    spans of the ranges counted as work) or leaves backward unsplit: every section has kernels, at most
    10 % of the kernel time is outside the sections, and the parts add up to the measured step."""
    dev = torch.device("cuda")
    model = tiny_llama(num_layers=4, hidden=128, num_heads=4, num_kv_heads=2, intermediate=256, vocab_size=4096)
    bundle = bundle_from_model(model.to(dev, torch.bfloat16), name_or_path="tiny-llama")
    cfg = TrainConfig(seq_len=1024, num_layers=2, block_size=8, num_anchors=64, rows_per_step=2, device="cuda",
                      target_layer_ids=[0, 2], mask_token_id=4095)
    rig = rig_from_config(cfg, dev, bundle, num_documents=4)
    assert rig.target_info["attention"] == "flex" and rig.target_info["layers_compiled"]
    for _ in range(3):
        rig.training_step()
    b, _ = profile_steps(lambda: [rig.training_step() for _ in range(3)], 3, dev, what="tiny training step")
    s, parts = b["sections"], b["other_parts"]
    for name in SECTIONS:
        assert s[name]["ms"] > 0 and s[name]["items_per_step"] > 0, (name, s[name])
    kernel_ms = b["attributed_ms"] + parts["unattributed_ms"]
    assert 0 <= parts["unattributed_ms"] < 0.1 * kernel_ms, parts
    assert parts["overlap_ms"] < 0.05 * kernel_ms  # one stream: kernels run one after another
    assert 0 < b["busy_pct"] <= 100.5
    assert math.isclose(sum(v["ms"] for v in s.values()), b["step_ms"], rel_tol=1e-9)
    assert math.isclose(s["other"]["ms"], parts["unattributed_ms"] + parts["idle_ms"] - parts["overlap_ms"],
                        abs_tol=1e-6)
