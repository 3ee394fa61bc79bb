"""The decoding engine (decoding/engine.py + verify.py) on tiny random targets: plain and
speculative decoding equal slow greedy decoding at T = 0 for every batch size (rows stopping at
different rounds while others go on), τ of oracle / always-wrong drafters, the fixed-span rounds
that CUDA graphs replay, and the output distribution of speculative sampling at T > 0 (chi-square
against the exact target distribution).

Shapes: P prompt tokens, B block size, V vocabulary, R rows.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from test_eval_common import ScriptedRows, greedy_reference, replay_eagerly, target_and_drafter

import dflash_trainer.decoding.engine as engine_mod
from dflash_trainer.decoding.batched import default_step_attention
from dflash_trainer.decoding.engine import PLAIN, SPECULATIVE, DecodeEngine
from dflash_trainer.decoding.verify import accept_sampled
from dflash_trainer.target_model.features import TargetFeatureExtractor

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    dict(kind="llama", vocab_size=12, block_size=4),
    dict(kind="qwen3", vocab_size=12, block_size=5, layer_types=("sliding_attention", "full_attention"),
         sliding_window=3),
    dict(kind="llama", vocab_size=128, block_size=4),
    dict(kind="gemma3", vocab_size=12, block_size=4),  # target layers alternate sliding (window 4) and full
]


def _prompts(vocab, lengths=(5, 1, 9, 3, 12, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (L,), generator=g).tolist() for L in lengths]


def _decode_all(engine, prompts, **kw):
    """Every prompt through the engine in chunks of its rows: (plain, speculative) Decoded lists."""
    outs = {PLAIN: [], SPECULATIVE: []}
    for c0 in range(0, len(prompts), engine.rows):
        chunk = prompts[c0:c0 + engine.rows]
        outs[PLAIN].append(engine.decode(chunk, speculative=False, **kw))
        outs[SPECULATIVE].append(engine.decode(chunk, speculative=True, **kw))
    return {m: ([t for d in ds for t in d.tokens], [a for d in ds for a in d.accepted], [s for d in ds for s in d.stop])
            for m, ds in outs.items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['kind']}-V{c['vocab_size']}-B{c['block_size']}")
def test_lossless_and_batch_size_independent_at_t0(case):
    """Plain and speculative greedy decoding return exactly slow greedy decoding (tokens, stop reason),
    and every row's accepted counts are the same at batch 1, in a partial batch and in one batch:
    catches a wrong verify offset, stale cache slots becoming visible, features written at the wrong
    positions, or a row's stop leaking into another's."""
    case = dict(case)
    kind, B = case.pop("kind"), case["block_size"]
    bundle, drafter = target_and_drafter(kind, **case)
    prompts = _prompts(case["vocab_size"])
    eos = {2}
    refs = {n: [greedy_reference(bundle, p, n, eos) for p in prompts] for n in (1, 6, 25)}
    accepted = {}
    for rows in (1, 4, 6):
        engine = DecodeEngine(bundle, drafter, rows=rows, max_prompt_tokens=12, max_new_tokens=25, eos_ids=eos,
                              cuda_graph=False)
        for n, ref in refs.items():
            got = _decode_all(engine, prompts, max_new_tokens=n)
            for mode in (PLAIN, SPECULATIVE):
                tokens, _, stops = got[mode]
                assert list(zip(tokens, stops)) == ref, (rows, n, mode)
            accepted[rows, n] = got[SPECULATIVE][1]
    for n in refs:
        assert accepted[1, n] == accepted[4, n] == accepted[6, n]
    if case["vocab_size"] == 12:  # the small vocabulary exercises partial acceptance and both stops
        assert any(0 < k < B - 1 for rows in accepted[6, 25] for k in rows)
        assert {s for _, s in refs[25]} == {"eos", "length"}


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"{c['kind']}-V{c['vocab_size']}-B{c['block_size']}")
def test_hf_cache_path_equals_the_static_cache_path(case, monkeypatch):
    """Targets outside the static-cache families decode through the HF model's own cache, one row
    (decoding/hf_cache.py). Forced onto that path, a Llama/Qwen3 target gives exactly the static
    path's tokens, stops and accepted drafts per round, plain and speculative, at T = 0 and with the
    same sampled tokens at T > 0 (the same uniforms): prefill, features, crop of rejected drafts."""
    from dflash_trainer.decoding.hf_cache import HFCacheTarget

    case = dict(case)
    kind = case.pop("kind")
    bundle, drafter = target_and_drafter(kind, **case)
    prompts = _prompts(case["vocab_size"])
    for temperature in (0.0, 0.8):
        runs = {}
        for forced in (False, True):
            monkeypatch.setattr(engine_mod, "unsupported_reason", (lambda _t: "forced for the test") if forced
                                else (lambda _t: None))
            gen = torch.Generator().manual_seed(3)
            engine = DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=12, max_new_tokens=25, eos_ids={2},
                                  temperature=temperature, generator=gen, cuda_graph=False)
            assert isinstance(engine.target, HFCacheTarget) == forced
            runs[forced] = _decode_all(engine, prompts)
        assert runs[True] == runs[False], temperature
        assert any(0 < k < case["block_size"] - 1 for a in runs[True][SPECULATIVE][1] for k in a)  # crops happen
    with pytest.raises(ValueError, match="one sequence at a time"):
        DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=12, max_new_tokens=5, eos_ids={2}, cuda_graph=False)


def test_hf_cache_path_is_lossless(monkeypatch):
    """The HF cache path (families outside the static-cache path: Gemma 2, gpt-oss, …), here on
    Gemma 3 (scaled embeddings, sliding and full layers) sent to it: an untrained drafter's rejected
    drafts are cropped from the model's cache and the output equals slow greedy decoding at T = 0,
    through plain and speculative decoding."""
    from dflash_trainer.decoding.hf_cache import HFCacheTarget

    monkeypatch.setattr(engine_mod, "unsupported_reason", lambda target: "sent to the HF cache path by the test")
    bundle, drafter = target_and_drafter("gemma3", random_weights=False)
    prompts = _prompts(bundle.vocab_size, lengths=(5, 9, 3))
    engine = DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=9, max_new_tokens=20, eos_ids={2},
                          cuda_graph=False)
    assert isinstance(engine.target, HFCacheTarget)
    got = _decode_all(engine, prompts)
    ref = [greedy_reference(bundle, p, 20, {2}) for p in prompts]
    for mode in (PLAIN, SPECULATIVE):
        assert list(zip(got[mode][0], got[mode][2])) == ref, mode
    assert any(k < drafter.config.block_size - 1 for a in got[SPECULATIVE][1] for k in a)  # drafts were rejected


def test_untrained_drafter_at_a_smaller_block_is_lossless():
    """An untrained drafter (default init) at an inference B below the trained one is still lossless."""
    bundle, drafter = target_and_drafter("qwen3", random_weights=False)
    prompts = _prompts(128, lengths=(4, 2, 13))
    engine = DecodeEngine(bundle, drafter, rows=3, max_prompt_tokens=13, max_new_tokens=30, eos_ids={2},
                          block_size=3, cuda_graph=False)
    spec = engine.decode(prompts, speculative=True)
    assert list(zip(spec.tokens, spec.stop)) == [greedy_reference(bundle, p, 30, {2}) for p in prompts]
    assert engine.B == 3 and all(len(a) >= 10 for a in spec.accepted)


def test_oracle_drafter_gives_tau_b_and_is_fed_exact_features(monkeypatch):
    """A drafter proposing the target's own greedy continuation is accepted in full every round:
    τ = B. Every round is anchored at the last committed token, and the context before the anchor
    holds exactly the features one plain forward over the whole sequence computes."""
    bundle, drafter = target_and_drafter(block_size=4)
    B, rounds, prompt = 4, 6, [1, 17, 54, 9]
    seq = prompt + greedy_reference(bundle, prompt, 1 + rounds * B + B, set())[0]
    stub = ScriptedRows([seq], bundle.vocab_size, [True])
    monkeypatch.setattr(engine_mod, "DraftSession", stub)
    engine = DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=4, max_new_tokens=1 + rounds * B,
                          eos_ids={999}, cuda_graph=False)
    out = engine.decode([prompt], speculative=True)
    assert out.tokens[0] == seq[len(prompt):len(prompt) + 1 + rounds * B]
    assert out.accepted[0] == [B - 1] * rounds and out.stop == ["length"]
    calls = [c[0] for c in stub.calls]
    assert [(t, a) for t, a, _ in calls] == [(seq[len(prompt) + r * B], len(prompt) + r * B) for r in range(rounds)]
    L = calls[-1][1]
    want = TargetFeatureExtractor(bundle, drafter.config.target_layer_ids)(
        torch.tensor([seq[:L]]), torch.arange(L)[None]).features[0]  # [L,k·H]
    for _, a, ctx in calls:
        torch.testing.assert_close(ctx, want[:a], atol=1e-4, rtol=1e-4)


def test_rows_stop_mid_round_while_others_go_on(monkeypatch):
    """Oracle rows accept whole blocks and stop mid-round (cap or eos) while always-wrong rows advance
    one token per round (τ = 1) for many more rounds; every row still equals slow greedy decoding,
    and no row runs past its cache."""
    B, max_new = 4, 10
    bundle, drafter = target_and_drafter(vocab_size=40, block_size=B)
    prompts = _prompts(40, lengths=(12, 3, 7, 5), seed=5)
    seqs = [p + greedy_reference(bundle, p, max_new + 2 * B, set())[0] for p in prompts]
    cont = seqs[2][len(prompts[2]):]
    cut = next(i for i in range(2, max_new - 1) if cont[i] not in cont[:i] and i % B != 0)
    eos = {cont[cut]}  # ends row 2 mid-round (an oracle row commits 1 + k·B tokens at round ends)
    correct = [True, False, True, False]
    monkeypatch.setattr(engine_mod, "DraftSession", ScriptedRows(seqs, bundle.vocab_size, correct))
    engine = DecodeEngine(bundle, drafter, rows=4, max_prompt_tokens=12, max_new_tokens=max_new, eos_ids=eos,
                          cuda_graph=False)
    got = engine.decode(prompts, speculative=True)
    for r, p in enumerate(prompts):
        assert (got.tokens[r], got.stop[r]) == greedy_reference(bundle, p, max_new, eos)
        if not correct[r]:
            assert got.accepted[r] == [0] * (len(got.tokens[r]) - 1)  # the first token comes from the prefill
    assert got.accepted[0][:2] == [B - 1, B - 1] and len(got.tokens[0]) == max_new  # cut at the cap mid-round
    assert got.stop[2] == "eos" and len(got.tokens[2]) == cut + 1
    assert int(engine.a.max()) + B <= engine.max_len


@pytest.mark.parametrize("draft_length", [None, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"{c['kind']}-B{c['block_size']}")
def test_fixed_span_replays_equal_bounded_eager_steps(case, temperature, draft_length):
    """What the CUDA graphs replay, checked eagerly: the warm-up and capture steps run while every row
    is done change nothing later output depends on, and steps over the fixed span (all S slots),
    `sync_every` of them between host looks, give the tokens, accepted counts and stops of the
    eager steps bounded by the longest row, with the same uniforms at T > 0; at the full draft
    length and at k = 2 (the round a graph captures after `set_draft_length`)."""
    case = dict(case)
    kind = case.pop("kind")
    bundle, drafter = target_and_drafter(kind, **case)
    prompts = _prompts(case["vocab_size"], seed=4)
    runs = []
    for replayed in (False, True):
        engine = DecodeEngine(bundle, drafter, rows=4, max_prompt_tokens=12, max_new_tokens=25, eos_ids={2},
                              temperature=temperature, generator=torch.Generator().manual_seed(9), cuda_graph=False,
                              draft_length=draft_length)
        if replayed:
            replay_eagerly(engine)  # as capture_graphs runs the steps: 3 warm-ups and the capture, every row done
            assert bool(engine.done.all()) and int(engine.count.sum()) == 0
        runs.append(_decode_all(engine, prompts))
    assert runs[0] == runs[1]
    full = draft_length or case["block_size"] - 1
    assert any(0 < n < full for rows in runs[0][SPECULATIVE][1] for n in rows)


def test_rejection_sampling_first_token_follows_p():
    """With q ≠ p the first committed token of a round is distributed as p_0 (chi-square over 8000
    rows at once, fixed seed); with q = p every draft is accepted."""
    g = torch.Generator().manual_seed(0)
    V, B, R = 6, 3, 8000
    p = torch.softmax(torch.randn(B, V, generator=g) * 1.5, -1).expand(R, B, V)
    q = torch.softmax(torch.randn(B - 1, V, generator=g) * 1.5, -1).expand(R, B - 1, V)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(R, B - 1)
    n, new = accept_sampled(drafts, q, p, torch.rand(R, B - 1, generator=g), torch.rand(R, generator=g))
    counts = torch.bincount(new[:, 0], minlength=V).double()  # slot 0: d_1 if accepted, else the resample
    assert _chisquare_pooled(counts, p[0, 0].double() * R) > 1e-3
    assert 0 < int((n == 0).sum()) < R  # both accept and reject happened
    n_same, _ = accept_sampled(drafts, p[:, :-1], p, torch.rand(R, B - 1, generator=g), torch.rand(R, generator=g))
    assert bool((n_same == B - 1).all())


def _exact_joint(bundle, prompt, steps, temperature):
    """Exact distribution of the next `steps` tokens of the target sampled at `temperature`
    (enumerates every prefix; V^steps cells)."""
    V = bundle.vocab_size
    probs = {(): 1.0}
    for _ in range(steps):
        prefixes = list(probs)
        ids = torch.tensor([prompt + list(pre) for pre in prefixes])
        with torch.no_grad():
            logits = bundle.model(input_ids=ids).logits[:, -1].float()
        nxt = torch.softmax(logits / temperature, -1)
        probs = {pre + (v,): probs[pre] * float(nxt[i, v]) for i, pre in enumerate(prefixes) for v in range(V)}
    return probs


def _chisquare_pooled(obs, exp):
    """p-value of a chi-square test with cells expecting < 5 draws pooled into one."""
    small = exp < 5
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


@pytest.mark.parametrize("draft_length", [None, 1])
def test_speculative_sampling_matches_target_distribution(draft_length):
    """At T > 0 the tokens of batched speculative sampling (drafts accepted with min(1, p/q), residual
    resampling, bonus from p; 800 rows of one prompt in one batch, each with its own uniforms) are
    distributed as the target's own samples: chi-square of the first token, of the joint of
    generated tokens 2–3 (which go through draft acceptance) and of token 3 against the exact
    distribution, on an 8-token vocabulary, fixed seed; at the full draft length and at k = 1 of
    B − 1 = 2 (the bonus then comes from p_1, after one draft)."""
    V, T, R = 8, 0.8, 800
    bundle, drafter = target_and_drafter(vocab_size=V, block_size=3, hidden=32, intermediate=64, num_layers=2,
                                         layer_ids=(0, 1), layer_types=("full_attention",))
    prompt = [1, 5, 3]
    exact = _exact_joint(bundle, prompt, 3, T)
    engine = DecodeEngine(bundle, drafter, rows=R, max_prompt_tokens=3, max_new_tokens=3, eos_ids={99},
                          temperature=T, generator=torch.Generator().manual_seed(1), cuda_graph=False,
                          draft_length=draft_length)
    out = engine.decode([prompt] * R, speculative=True)
    toks = torch.tensor(out.tokens)  # [R,3]
    assert len({n for a in out.accepted for n in a}) >= 2  # rounds accept different numbers of drafts
    want = torch.zeros(V, V, V)
    for (a, b, c), pr in exact.items():
        want[a, b, c] += pr
    first = torch.bincount(toks[:, 0], minlength=V).float()
    assert _chisquare_pooled(first, want.sum((1, 2)) * R) > 1e-3
    joint = torch.zeros(V, V)
    joint.index_put_((toks[:, 1], toks[:, 2]), torch.ones(R), accumulate=True)
    assert _chisquare_pooled(joint.flatten(), want.sum(0).flatten() * R) > 1e-3
    assert _chisquare_pooled(joint.sum(0), want.sum((0, 1)) * R) > 1e-3


def test_engine_refuses_bad_arguments():
    """Errors name the field and the range: empty, too long or too many prompts, a larger B than
    trained, a cap above the engine's, speculative decoding without a drafter."""
    bundle, drafter = target_and_drafter()
    engine = DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=4, max_new_tokens=6, eos_ids={2},
                          cuda_graph=False)
    with pytest.raises(ValueError, match="1 … 4 tokens"):
        engine.decode([[]], speculative=True)
    with pytest.raises(ValueError, match="1 … 4 tokens"):
        engine.decode([[1, 2, 3, 4, 5]], speculative=False)
    with pytest.raises(ValueError, match="3 prompts for an engine of 2 rows"):
        engine.decode([[1], [2], [3]], speculative=True)
    with pytest.raises(ValueError, match="max_new_tokens=7"):
        engine.decode([[1]], speculative=True, max_new_tokens=7)
    with pytest.raises(ValueError, match="block_size=5"):
        DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=4, max_new_tokens=6, eos_ids={2}, block_size=5)
    with pytest.raises(ValueError, match="eos_ids"):
        DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=4, max_new_tokens=6, eos_ids=set())
    plain = DecodeEngine(bundle, None, rows=1, max_prompt_tokens=4, max_new_tokens=6, eos_ids={2})
    with pytest.raises(ValueError, match="needs a drafter"):
        plain.decode([[1]], speculative=True)


def test_prefill_groups_by_hand():
    """Consecutive groups with rows × longest ≤ budget; a prompt alone over the budget is its own group."""
    from dflash_trainer.decoding.batched import prefill_groups

    assert prefill_groups([10, 10, 30, 30], 60) == [(0, 2), (2, 4)]
    assert prefill_groups([10, 10, 30, 30], 1000) == [(0, 4)]
    assert prefill_groups([5, 100, 5], 50) == [(0, 1), (1, 2), (2, 3)]
    assert prefill_groups([7], 1) == [(0, 1)]
    assert prefill_groups([], 10) == []


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"{c['kind']}-V{c['vocab_size']}-B{c['block_size']}")
def test_grouped_prefill_decodes_the_same(case):
    """Prompts prefilled in groups (a budget of 16 rows × tokens: one or two prompts a group) decode to
    the same tokens, stops and accepted counts as one prefill of the whole batch, plain and speculative:
    catches features or caches written to the wrong rows, or logits out of row order."""
    case = dict(case)
    bundle, drafter = target_and_drafter(case.pop("kind"), **case)
    prompts = _prompts(case["vocab_size"])
    outs = {}
    for budget in (16, 32768):
        engine = DecodeEngine(bundle, drafter, rows=6, max_prompt_tokens=12, max_new_tokens=25, eos_ids={2},
                              cuda_graph=False, prefill_tokens=budget)
        outs[budget] = _decode_all(engine, prompts, max_new_tokens=25)
    assert outs[16] == outs[32768]


@pytest.mark.parametrize("kind,kw", [("llama", {}), ("qwen3", dict(layer_types=("sliding_attention", "full_attention"),
                                                                  sliding_window=3))], ids=["llama", "qwen3-swa"])
@pytest.mark.parametrize("mode", ["sdpa", "row"])
def test_step_attention_modes_are_lossless(kind, kw, mode, monkeypatch):
    """step_attention="sdpa" (torch's fused attention with a boolean mask over the cache slots) and "row"
    (each row over its own slots, a verify block causal within it: decoding/row_attention.py, its torch
    path on the CPU), for decode and verify steps (`cache_attention` never runs), decode exactly what slow
    greedy decoding does, plain and speculative, at every draft length, sliding window included; an fp32
    target defaults to "cache"; an unknown name is refused with the choices."""
    import dflash_trainer.decoding.static_layer as static_layer

    bundle, drafter = target_and_drafter(kind, vocab_size=12, block_size=4, **kw)
    default = DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=4, max_new_tokens=4, eos_ids={2}, cuda_graph=False)
    assert default.step_attention == default.target.step_attention == "cache"  # fp32: the exact path
    assert [default_step_attention(d, r) for d, r in ((torch.float32, 64), (torch.bfloat16, 1), (torch.bfloat16, 2),
                                                       (torch.float16, 64))] == ["cache", "cache", "sdpa", "sdpa"]

    def refuse(*_a, **_k):
        raise AssertionError(f"cache_attention ran under step_attention={mode!r}")
    monkeypatch.setattr(static_layer, "cache_attention", refuse)
    prompts = [[5, 3, 9, 4, 7], [8], [3, 4, 5, 6, 7, 8, 9, 10, 3], [6, 3, 9]]
    refs = [greedy_reference(bundle, p, 20, {2}) for p in prompts]
    engine = DecodeEngine(bundle, drafter, rows=2, max_prompt_tokens=9, max_new_tokens=20, eos_ids={2},
                          cuda_graph=False, step_attention=mode)
    assert engine.target.step_attention == mode
    for k in (3, 1):
        engine.set_draft_length(k)
        for speculative in (False, True):
            got = [engine.decode(prompts[c:c + 2], speculative=speculative) for c in (0, 2)]
            assert [(t, s) for g in got for t, s in zip(g.tokens, g.stop)] == refs, (k, speculative)
    with pytest.raises(ValueError, match="step_attention='flash': use one of cache, sdpa, row"):
        DecodeEngine(bundle, drafter, rows=1, max_prompt_tokens=4, max_new_tokens=4, eos_ids={2}, step_attention="flash")
