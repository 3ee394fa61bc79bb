"""GPU-only: measured τ during training on CUDA (training/tau_probe.py): the captured round over a
bf16 target with a bf16 copy of the fp32 drafter equals eval's engine decoding of the same
weights, follows weight updates, and a co-located CUDA run trains the same with it as without."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_eval_common import target_and_drafter  # noqa: E402

from dflash_trainer.drafter.model import DFlashDrafter  # noqa: E402
from dflash_trainer.decoding.engine import DecodeEngine  # noqa: E402
from dflash_trainer.training.tau_probe import TauProbe  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_probe_graph_on_cuda_equals_eval_decoding_of_the_same_weights():
    """Prevents a captured round that decodes stale weights (the copy refreshed out of place) or other
    tokens than eval's batched decoding of a bf16 drafter with the same weights."""
    dev = torch.device("cuda")
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    bundle.model.to(dev, torch.bfloat16)
    drafter.to(dev).train().requires_grad_(True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (5, 1, 9, 3, 12, 7, 2, 4)]
    rng = torch.cuda.get_rng_state(dev)
    probe = TauProbe(bundle, drafter, prompts, max_new_tokens=20, eos_ids={2})
    assert probe.uses_cuda_graph and probe.decoder.fc.weight.dtype == torch.bfloat16
    for scale in (1.0, 1.3):
        with torch.no_grad():
            drafter.fc.weight.mul_(scale)
        m = probe.measure(1)
        rows = probe.last_decoded.tokens
        evald = DFlashDrafter(drafter.config, bundle.embed_tokens, bundle.lm_head, compile_flex=False)
        evald.load_trainable_state_dict(drafter.trainable_state_dict())
        evald = evald.to(dev, torch.bfloat16).eval()
        engine = DecodeEngine(bundle, evald, rows=len(prompts), max_prompt_tokens=12, max_new_tokens=20, eos_ids={2})
        spec = engine.decode(sorted(prompts, key=len), speculative=True)
        assert rows == spec.tokens
        assert m.rounds == sum(len(a) for a in spec.accepted) and 1.0 <= m.tau <= 4.0
    assert torch.equal(torch.cuda.get_rng_state(dev), rng) and drafter.training


def test_cuda_run_trains_the_same_with_measured_tau(tmp_path):
    """Prevents a measurement that perturbs a CUDA run (streams, compiled layers, overlap feed): losses
    and final weights equal those of the run without; records at steps 2, 4, 5."""
    import io

    from rich.console import Console
    from safetensors.torch import load_file

    from dflash_trainer.config.load import load_config
    from dflash_trainer.training.run import train
    from tests.integration.tiny_run import TINY_SETS, make_chats, make_prepared, make_target

    target, prepared = make_target(tmp_path / "target"), make_prepared(tmp_path / "prepared")
    chats = make_chats(tmp_path / "chats.jsonl", 40)
    runs = {}
    for name, sets in (("tau", ["tau_every=2", f"tau_dataset={chats}"]), ("plain", [])):
        cfg = load_config(None, {"out": str(tmp_path / name), "target.path": str(target), "prepared": str(prepared),
                                 "device": "cuda", "log_every": 1, "max_steps": 5}, [*TINY_SETS, *sets])
        console = Console(file=io.StringIO(), width=200)
        runs[name] = train(cfg, console)
        print(console.file.getvalue())
    recs = {n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in runs}
    tau = [r for r in recs["tau"] if "tau_measured" in r]
    assert [r["step"] for r in tau] == [2, 4, 5] and all(1.0 <= r["tau_measured"] <= 8 for r in tau)
    print("tau records", tau)
    assert [r["loss"] for r in recs["tau"] if "loss" in r] == [r["loss"] for r in recs["plain"]]
    wa, wb = (load_file(str(tmp_path / n / "checkpoint-final" / "model.safetensors")) for n in ("tau", "plain"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert runs["tau"].tau_measured == tau[-1]["tau_measured"]
