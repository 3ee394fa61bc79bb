"""GPU-only: batched decoding on CUDA equals the one-sequence loop on CUDA (fp32, T = 0),
continuous batching equals one-sequence greedy decoding, and its CUDA-graph decode step equals
the eager one."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_eval_common import target_and_drafter  # noqa: E402

from dflash_trainer.evaluation.batched import plain_batch, speculative_batch  # noqa: E402
from dflash_trainer.evaluation.draft import DraftSession  # noqa: E402
from dflash_trainer.evaluation.speculate import TargetSession, generate_plain, generate_speculative  # noqa: E402
from dflash_trainer.target_model.continuous import ContinuousGenerator  # noqa: E402
from tests.tiny_targets import tiny_bundle  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_batched_equals_batch_one_on_cuda(kind):
    dev = torch.device("cuda")
    bundle, drafter = target_and_drafter(kind, vocab_size=12, block_size=4)
    bundle.model.to(dev)
    drafter.to(dev)
    ids = drafter.config.target_layer_ids
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (5, 1, 9, 3, 12, 7, 2, 4)]
    tsess, dsess = TargetSession(bundle, ids), DraftSession(drafter)
    plain = plain_batch(bundle, prompts, max_new_tokens=20, eos_ids={2})
    spec = speculative_batch(bundle, drafter, prompts, block_size=4, max_new_tokens=20, eos_ids={2}, layer_ids=ids)
    gen = ContinuousGenerator(bundle, slots=3, max_prompt_tokens=12, max_new_tokens=20, eos_ids={2}, sync_every=4)
    for i, p in enumerate(prompts):
        gen.submit(i, p)
    cont = {}
    while gen.busy:
        cont.update((f.key, f.tokens) for f in gen.poll())
    for r, p in enumerate(prompts):
        ref = generate_plain(tsess, p, max_new_tokens=20, eos_ids={2})
        one = generate_speculative(tsess, dsess, p, block_size=4, max_new_tokens=20, eos_ids={2})
        assert plain.tokens[r] == ref.tokens == cont[r]
        assert spec.tokens[r] == one.tokens and spec.accepted[r] == one.accepted


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_continuous_cuda_graph_equals_eager(kind):
    """The replayed graphs (span ladder; here one span, max_len) give the eager step's tokens; 3 rows for 6 prompts,
    so rows are refilled between replays."""
    bundle = tiny_bundle(kind, vocab_size=12)
    bundle.model.to(torch.device("cuda"))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (4, 1, 9, 6, 2, 11, 3)]
    runs = {}
    for graph in (True, False):
        gen = ContinuousGenerator(bundle, slots=3, max_prompt_tokens=10, max_new_tokens=9, eos_ids={2},
                                  sync_every=2, prefill_tokens=12, cuda_graph=graph)
        assert (gen.graph is not None) == graph
        for i, p in enumerate(prompts):
            gen.submit(i, p)
        got = {}
        while gen.busy:
            got.update((f.key, (f.tokens, f.finished, f.error)) for f in gen.poll())
        assert gen.steps > 0
        runs[graph] = got
    assert sorted(runs[True]) == list(range(len(prompts)))
    assert runs[True] == runs[False]
    assert runs[True][5] == ([], False, "prompt_too_long")
    assert {fin for _, fin, err in runs[True].values() if err is None} == {True, False}  # eos and length endings


@pytest.mark.parametrize("temperature,top_p,loop_ngram", [(0.0, 1.0, 3), (0.9, 1.0, None), (0.8, 0.9, 4)])
def test_continuous_cuda_graph_equals_eager_sampled_and_guarded(temperature, top_p, loop_ngram):
    """Sampling (one uniform per row and step, read inside the graph by an on-device counter) and
    the loop guard give the eager step's tokens and stops when replayed from the span ladder's
    graphs (max_len 300: spans 256 and 300 are both used)."""
    bundle = tiny_bundle("llama", vocab_size=12)
    bundle.model.to(torch.device("cuda"))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (4, 1, 200, 6, 250, 3, 9, 2)]
    runs = {}
    for graph in (True, False):
        gen = ContinuousGenerator(bundle, slots=3, max_prompt_tokens=250, max_new_tokens=50, eos_ids={2},
                                  sync_every=4, temperature=temperature, top_p=top_p, loop_ngram=loop_ngram,
                                  generator=torch.Generator(device="cuda").manual_seed(7), cuda_graph=graph)
        assert bool(gen.graphs) == graph
        for i, p in enumerate(prompts):
            gen.submit(i, p)
        got = {}
        while gen.busy:
            got.update((f.key, (f.tokens, f.finished, f.looped)) for f in gen.poll())
        runs[graph] = got
        assert set(gen.span_steps) == {256, 300}, gen.span_steps  # both paths count by ladder span
    assert runs[True] == runs[False]


@pytest.mark.parametrize("kind", ["llama", "qwen3-swa"])
def test_speculative_cuda_graph_equals_eager(kind):
    """Batched speculative decoding with each round replayed from a CUDA graph (fixed span) gives the
    eager rounds' tokens, accepted counts and stops (fp32; a small vocabulary so drafts are partly
    accepted), for full and sliding-window targets."""
    from dflash_trainer.evaluation.spec_rounds import SpeculativeRounds
    from dflash_trainer.evaluation.batched_draft import BatchedDraftSession
    from dflash_trainer.target_model.batched import BatchedTarget

    dev = torch.device("cuda")
    extra = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=3) if kind == "qwen3-swa" else {}
    bundle, drafter = target_and_drafter(kind.split("-")[0], vocab_size=12, block_size=4, **extra)
    bundle.model.to(dev)
    drafter.to(dev)
    ids = drafter.config.target_layer_ids
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (5, 1, 9, 3, 12, 7, 2, 4)]
    runs = {graph: speculative_batch(bundle, drafter, prompts, block_size=4, max_new_tokens=30, eos_ids={2},
                                     layer_ids=ids, cuda_graph=graph) for graph in (True, False)}
    assert runs[True].tokens == runs[False].tokens and runs[True].accepted == runs[False].accepted
    assert runs[True].stop == runs[False].stop
    assert any(0 < n < 3 for rows in runs[True].accepted for n in rows)
    state = SpeculativeRounds(BatchedTarget(bundle, rows=2, max_len=40, layer_ids=ids),
                              BatchedDraftSession(drafter, rows=2, max_len=40), block_size=4, max_new_tokens=20,
                              eos_ids={2}, cuda_graph=True)
    assert state.graph is not None
