"""What a decode step and a speculative round cost besides their math, checked on the CPU: the
kernels they launch (counted as a CUDA graph replays them, tests/kernel_count.py), their host
syncs, the host looks of a decode, the replays it wastes, and that speeds time decoding only.

Why kernels: at batch 1 a replayed step of a small target is a chain of tiny kernels, each a few µs
whatever its size. SmolLM2-135M (30 layers) on an H200, bf16: 4.4 ms per plain step and 6.2 ms per
round (B = 8) with 1,476 and 2,057 kernels (≈ 3.0 µs each), when a target layer ran HF's modules
(47 kernels per decode step: 8 per RMSNorm, 10 for RoPE, 8 for the attention's scale, mask and
casts), a drafter layer 89 and the step's fixed part 66 (a round's 139). Now, per layer: 20
(Llama, bf16), 21 in a verify step, 20 per drafter layer; 632 per plain step and 803 per round at
the SmolLM2 shape (tokens per second at batch 1 scale about with their inverse).
"""

from __future__ import annotations

import time

import pytest
import torch
from test_eval_common import target_and_drafter

import dflash_trainer.evaluation.speedup as speedup_mod
from dflash_trainer.decoding.engine import PLAIN, SPECULATIVE, DecodeEngine
from dflash_trainer.evaluation.speedup import speedup_table
from tests.kernel_count import KernelCount
from tests.sync_guard import SyncGuard

pytestmark = pytest.mark.usefixtures("one_thread")

# kernels of a replayed step at batch 1 in bf16: per target layer (plain step, verify step), per
# drafter layer, and the rest of a plain step / a round (embedding, masks, RoPE tables, LM heads,
# the drafter's context write, acceptance and the commit)
BUDGET = {
    "llama": dict(plain_layer=20, verify_layer=21, drafter_layer=20, plain_fixed=32, round_fixed=70),
    "qwen3": dict(plain_layer=23, verify_layer=24, drafter_layer=20, plain_fixed=32, round_fixed=70),  # + q/k norms
}


def _kernels(kind: str, target_layers: int, drafter_layers: int, dtype: torch.dtype) -> dict[str, int]:
    """Kernels of one replayed plain step and one round (the captured steps, run eagerly) at batch 1."""
    bundle, drafter = target_and_drafter(kind, vocab_size=64, block_size=4, layer_ids=(0, 1),
                                         layer_types=("full_attention",) * drafter_layers, num_layers=target_layers)
    bundle.model.to(dtype)
    drafter.to(dtype)
    engine = DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=8, max_new_tokens=8, eos_ids={99},
                          cuda_graph=False)
    counts = {}
    for mode, step in engine.graph_steps().items():
        with KernelCount() as k:
            step()
        counts[mode] = k.total
    return counts


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_replayed_steps_launch_few_kernels(kind):
    """Prevents a step that goes back to HF's per-op modules (8 kernels per RMSNorm, RoPE per q and k,
    separate q/k/v projections, scale / mask / casts of the scores) or a drafter that concatenates
    its context every layer: per-layer and fixed kernel counts of a plain step and a round stay
    within the budget (bf16, batch 1; per layer from 2 vs 4 target layers and 1 vs 3 drafter layers)."""
    base, deep, wide = (_kernels(kind, t, d, torch.bfloat16) for t, d in ((2, 1), (4, 1), (2, 3)))
    plain_layer = (deep[PLAIN] - base[PLAIN]) / 2
    verify_layer = (deep[SPECULATIVE] - base[SPECULATIVE]) / 2
    drafter_layer = (wide[SPECULATIVE] - base[SPECULATIVE]) / 2
    got = dict(plain_layer=plain_layer, verify_layer=verify_layer, drafter_layer=drafter_layer,
               plain_fixed=base[PLAIN] - 2 * plain_layer,
               round_fixed=base[SPECULATIVE] - 2 * verify_layer - drafter_layer)
    over = {k: (v, BUDGET[kind][k]) for k, v in got.items() if v > BUDGET[kind][k]}
    assert not over, f"kernels over budget (got, budget): {over}"
    assert wide[PLAIN] == base[PLAIN]  # plain decoding runs no drafter


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_replayed_steps_never_read_the_host(temperature):
    """Prevents a host sync inside what a CUDA graph captures (capture fails on CUDA; on the CPU
    nothing would notice): a plain step and a round, greedy and sampled, run under SyncGuard."""
    bundle, drafter = target_and_drafter("qwen3", vocab_size=12, block_size=4,
                                         layer_types=("sliding_attention", "full_attention"), sliding_window=3)
    engine = DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=6, max_new_tokens=10, eos_ids={2},
                          temperature=temperature, cuda_graph=False)
    engine.start([[3, 4, 5], [6, 7]], speculative=True)
    with SyncGuard():
        for step in engine.graph_steps().values():
            step()


class _CountingGraph:
    """The CPU twin of a captured graph (a replay runs the fixed-span step eagerly), counting replays."""

    def __init__(self, step):
        self.step, self.replays = step, 0

    def replay(self):
        self.replays += 1
        self.step()


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the host syncs of SyncGuard's list (.tolist, .item, bool(), nonzero, …)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SyncGuard.BANNED:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_a_decode_reads_the_host_once_per_stretch_and_wastes_no_replays_at_the_cap():
    """Prevents per-step host reads and replays past the end: a replayed plain decode of N tokens
    (no eos) reads the host once per look (every `sync_every` replays) plus the results once, and
    replays exactly N − 1 steps (the first token comes from the prefill); a speculative decode's
    looks are one per stretch of at most `sync_every` rounds."""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    for new in (23, 25):
        engine = DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=4, max_new_tokens=new, eos_ids={99},
                              cuda_graph=False, sync_every=4)
        engine.graphs = {mode: _CountingGraph(step) for mode, step in engine.graph_steps().items()}
        with _HostReads() as plain_reads:
            out = engine.decode(prompts, speculative=False)
        assert [len(t) for t in out.tokens] == [new, new]
        assert engine.graphs[PLAIN].replays == new - 1
        assert plain_reads.reads == 1 + -(-(new - 1) // 4) + 3  # looks, then count, eos_hit and out
        with _HostReads() as spec_reads:
            spec = engine.decode(prompts, speculative=True)
        rounds = engine.graphs[SPECULATIVE].replays
        assert max(map(len, spec.accepted)) <= rounds
        assert spec_reads.reads == 1 + -(-rounds // 4) + 5  # looks, then the results and accepted / rounds
        assert spec.tokens == out.tokens


def test_speedup_table_times_decoding_only(monkeypatch):
    """Prevents timing that includes the engine's construction (CUDA-graph capture on CUDA; here a
    1 s stand-in) or the warm-up decodes: the table's walls are the timed decodes' own."""
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    build, stream = DecodeEngine.__init__, speedup_mod.decode_stream
    walls = {PLAIN: [], SPECULATIVE: []}

    def slow_build(self, *args, **kwargs):
        build(self, *args, **kwargs)
        time.sleep(1.0)

    def recorded(engine, prompts, *, speculative, **kw):  # the timed streams (warm-ups are `decode` calls)
        out = stream(engine, prompts, speculative=speculative, **kw)
        walls[SPECULATIVE if speculative else PLAIN].append(out.wall_s)
        return out

    monkeypatch.setattr(speedup_mod.DecodeEngine, "__init__", slow_build)
    monkeypatch.setattr(speedup_mod, "decode_stream", recorded)
    (rec,) = speedup_table(bundle, drafter, [[5, 6, 7], [8, 3]], [2], max_new_tokens=8, cuda_graph=False)
    assert rec["plain_wall_s"] == pytest.approx(sum(walls[PLAIN])) and len(walls[PLAIN]) == 1
    assert rec["speculative_wall_s"] == pytest.approx(sum(walls[SPECULATIVE]))
    assert rec["plain_wall_s"] + rec["speculative_wall_s"] < 1.0
    assert rec["cuda_graphs"] == []  # eager here; ["plain", "speculative"] when replayed on CUDA
