"""GPU-only: the decoding engine on CUDA (decoding/engine.py) equals slow greedy decoding for every
batch size (fp32, T = 0), its replayed CUDA graphs (plain step, speculative round; greedy and
sampled; batch 1 included) equal its eager steps, and a bf16 target runs; continuous batching
(regeneration) equals greedy decoding and its CUDA-graph decode step equals the eager one; the speedup
table's continuous batch over the engine (decoding/stream.py) equals greedy decoding under replays."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_eval_common import greedy_reference, target_and_drafter  # noqa: E402

from dflash_trainer.decoding.engine import PLAIN, SPECULATIVE, DecodeEngine  # noqa: E402
from dflash_trainer.decoding.continuous import ContinuousGenerator  # noqa: E402
from dflash_trainer.decoding.stream import decode_stream  # noqa: E402
from tests.tiny_targets import tiny_bundle  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompts(seed, lengths=(5, 1, 9, 3, 12, 7, 2, 4)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 11, (L,), generator=g).tolist() for L in lengths]


# prompt seeds per target kind, chosen so that each kind's random tiny target exercises partial acceptance (the
# lossless test) and both endings, eos and length (the continuous test): the tiny Gemma 3 mostly repeats one token
# and seldom emits eos, so its seeds differ (checked with the eager path on CPU)
_LOSSLESS_SEED = {"llama": 3, "qwen3": 3, "gemma3": 15}
_CONTINUOUS_SEED = {"llama": 1, "qwen3": 1, "gemma3": 9}


def _lossless_case(kind):
    """A tiny target and drafter of `kind` on CUDA, the lossless test's prompts and their slow greedy
    decodings (20 new tokens, eos 2)."""
    bundle, drafter = target_and_drafter(kind, vocab_size=12, block_size=4)
    bundle.model.to("cuda")
    drafter.to("cuda")
    prompts = _prompts(_LOSSLESS_SEED[kind])
    return bundle, drafter, prompts, [greedy_reference(bundle, p, 20, {2}) for p in prompts]


def _decode(engine, prompts, speculative):
    R = engine.rows
    out = [engine.decode(prompts[c:c + R], speculative=speculative) for c in range(0, len(prompts), R)]
    return [t for d in out for t in d.tokens], [a for d in out for a in d.accepted], [s for d in out for s in d.stop]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_engine_is_lossless_and_batch_size_independent_on_cuda(kind):
    """Prevents CUDA-only divergence (kernels, graphs, per-row masks): at batch 1, 3 and 8, replayed
    plain and speculative decoding equal slow greedy decoding, with the same accepted counts per row;
    continuous batching too."""
    bundle, drafter, prompts, refs = _lossless_case(kind)
    accepted = {}
    for rows in (1, 3, 8):
        engine = DecodeEngine(bundle, drafter, rows=rows, max_prompt_tokens=12, max_new_tokens=20, eos_ids={2})
        assert set(engine.graphs) == {PLAIN, SPECULATIVE}
        for speculative in (False, True):
            tokens, acc, stops = _decode(engine, prompts, speculative)
            assert list(zip(tokens, stops)) == refs, (rows, speculative)
        accepted[rows] = acc
    assert accepted[1] == accepted[3] == accepted[8]
    assert any(0 < n < 3 for rows in accepted[8] for n in rows)
    for overlap in (True, False):  # polls that return while their steps run (the CUDA default), and polls that wait
        gen = ContinuousGenerator(bundle, slots=3, max_prompt_tokens=12, max_new_tokens=20, eos_ids={2}, sync_every=4,
                                  overlap=overlap)
        for i, p in enumerate(prompts):
            gen.submit(i, p)
        cont = {}
        while gen.busy:
            cont.update((f.key, f.tokens) for f in gen.poll())
        assert [cont[i] for i in range(len(prompts))] == [t for t, _ in refs], overlap


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_continuous_cuda_graph_equals_eager(kind):
    """The replayed graphs (span ladder, row attention off; here one span, max_len) give the eager step's tokens;
    3 rows for 6 prompts, so rows are refilled between replays."""
    bundle = tiny_bundle(kind, vocab_size=12)
    bundle.model.to(torch.device("cuda"))
    g = torch.Generator().manual_seed(_CONTINUOUS_SEED[kind])
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (4, 1, 9, 6, 2, 11, 3)]
    runs = {}
    for graph in (True, False):
        gen = ContinuousGenerator(bundle, slots=3, max_prompt_tokens=10, max_new_tokens=9, eos_ids={2},
                                  sync_every=2, prefill_tokens=12, cuda_graph=graph, row_attention=False,
                                  overlap=False)
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
def test_continuous_row_attention_graph_equals_eager_and_greedy(temperature, top_p, loop_ngram):
    """Each row attending its own slots with the compiled Triton kernel (decoding/row_attention.py): one
    graph replayed gives the eager steps' tokens and stops, and at T = 0 in fp32 the tokens of the
    shared-span path."""
    bundle = tiny_bundle("llama", vocab_size=12)
    bundle.model.to(torch.device("cuda"))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 11, (L,), generator=g).tolist() for L in (4, 1, 200, 6, 250, 3, 9, 2)]
    runs = {}
    for graph, rows in ((True, True), (False, True), (True, False)):
        gen = ContinuousGenerator(bundle, slots=3, max_prompt_tokens=250, max_new_tokens=50, eos_ids={2},
                                  sync_every=4, temperature=temperature, top_p=top_p, loop_ngram=loop_ngram,
                                  generator=torch.Generator(device="cuda").manual_seed(7), cuda_graph=graph,
                                  row_attention=rows)
        for i, p in enumerate(prompts):
            gen.submit(i, p)
        got = {}
        while gen.busy:
            got.update((f.key, (f.tokens, f.finished, f.looped)) for f in gen.poll())
        runs[graph, rows] = got
    assert runs[True, True] == runs[False, True]
    if temperature == 0:
        assert runs[True, True] == runs[True, False]


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
                                  generator=torch.Generator(device="cuda").manual_seed(7), cuda_graph=graph,
                                  row_attention=False, overlap=False)
        assert bool(gen.graphs) == graph
        for i, p in enumerate(prompts):
            gen.submit(i, p)
        got = {}
        while gen.busy:
            got.update((f.key, (f.tokens, f.finished, f.looped)) for f in gen.poll())
        runs[graph] = got
        assert set(gen.counts.span_steps) == {"256", "300"}, gen.counts.span_steps  # both paths count by ladder span
    assert runs[True] == runs[False]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("kind", ["llama", "qwen3-swa", "gemma3"])
def test_engine_cuda_graph_equals_eager(kind, temperature):
    """Plain steps and speculative rounds replayed from CUDA graphs (fixed span, uniforms read by an
    on-device counter) give the eager steps' tokens, accepted counts and stops (fp32; a small
    vocabulary so drafts are partly accepted), greedy and sampled, at batch 8 and batch 1, for full
    and sliding-window targets."""
    dev = torch.device("cuda")
    extra = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=3) if kind == "qwen3-swa" else {}
    bundle, drafter = target_and_drafter(kind.split("-")[0], vocab_size=12, block_size=4, **extra)
    bundle.model.to(dev)
    drafter.to(dev)
    prompts = _prompts(7)
    for rows in (8, 1):
        runs = {}
        for graph in (True, False):
            engine = DecodeEngine(bundle, drafter, rows=rows, max_prompt_tokens=12, max_new_tokens=30, eos_ids={2},
                                  temperature=temperature, generator=torch.Generator(device=dev).manual_seed(5),
                                  cuda_graph=graph)
            assert bool(engine.graphs) == graph
            runs[graph] = [_decode(engine, prompts, speculative) for speculative in (False, True)]
        assert runs[True] == runs[False], rows
        assert any(0 < n < 3 for rows_ in runs[True][1][1] for n in rows_)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("mode", ["sdpa", "row"])
def test_step_attention_modes_are_lossless_on_cuda(kind, mode):
    """step_attention "sdpa" and "row" (the compiled row kernel, fp32 dots here) under CUDA-graph replays:
    plain and speculative decoding equal slow greedy decoding at batch 3 and 8, at the full draft length
    and at k = 1 (the graphs recaptured)."""
    bundle, drafter, prompts, refs = _lossless_case(kind)
    for rows in (3, 8):
        engine = DecodeEngine(bundle, drafter, rows=rows, max_prompt_tokens=12, max_new_tokens=20, eos_ids={2},
                              step_attention=mode)
        assert set(engine.graphs) == {PLAIN, SPECULATIVE}
        for k in (engine.B - 1, 1):
            engine.set_draft_length(k)
            for speculative in (False, True):
                tokens, _, stops = _decode(engine, prompts, speculative)
                assert list(zip(tokens, stops)) == refs, (rows, k, speculative)


def test_bf16_target_and_drafter_decode_on_cuda():
    """The eval default on CUDA (bf16 target and drafter): replayed decoding runs, its plain output agrees
    with the eager steps' (bf16 rounding over the longer fixed span may flip a rare near-tie, so on
    at least 3/4 of the tokens), and τ stays within [1, B]."""
    dev = torch.device("cuda")
    bundle, drafter = target_and_drafter(vocab_size=12, block_size=4)
    bundle.model.to(dev, torch.bfloat16)
    drafter.to(dev, torch.bfloat16)
    prompts = _prompts(11)
    runs = {g: DecodeEngine(bundle, drafter, rows=8, max_prompt_tokens=12, max_new_tokens=24, eos_ids={2},
                            cuda_graph=g) for g in (True, False)}
    plain = {g: e.decode(prompts, speculative=False) for g, e in runs.items()}
    spec = runs[True].decode(prompts, speculative=True)
    same = sum(x == y for a, b in zip(plain[True].tokens, plain[False].tokens) for x, y in zip(a, b))
    assert same >= 0.75 * sum(map(len, plain[False].tokens))
    rounds = [n for a in spec.accepted for n in a]
    assert rounds and 1.0 <= 1 + sum(rounds) / len(rounds) <= 4.0


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_stream_refills_rows_under_cuda_graph_replays(kind):
    """Prevents a refill (prefill into finished rows between replays) that a replayed graph does not see,
    or that disturbs the live rows: 8 prompts through 3 rows, replayed, equal slow greedy decoding, and
    the speculative stream's accepted counts equal the batch-1 engine's."""
    bundle, drafter, prompts, refs = _lossless_case(kind)
    alone = DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=12, max_new_tokens=20, eos_ids={2})
    single = [alone.decode([p], speculative=True).accepted[0] for p in prompts]
    engine = DecodeEngine(bundle, drafter, rows=3, max_prompt_tokens=12, max_new_tokens=20, eos_ids={2})
    assert set(engine.graphs) == {PLAIN, SPECULATIVE}
    for speculative in (False, True):
        out = decode_stream(engine, prompts, speculative=speculative)
        assert list(zip(out.tokens, out.stop)) == refs, speculative
        assert out.steady_tokens is not None and out.steady_s < out.wall_s
        if speculative:
            assert out.accepted == single
