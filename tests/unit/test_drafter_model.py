"""DFlash drafter forward checked against an independent dense oracle written here.

The oracle uses only the drafter's named weights and plain matmul/softmax over Python loops;
masks are built by brute force from the visibility definition (docs/architecture.md).
Shapes: R rows, T context positions, N anchors, B block size, Q = N·B, H hidden.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.loss import block_loss
from dflash_trainer.drafter.model import DFlashDrafter

B = 4
W = 5
V = 40
MASK_ID = 39


def tiny_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=V, block_size=B, mask_token_id=MASK_ID,
                target_layer_ids=[0, 2], num_target_layers=4, layer_types=["full_attention", "sliding_attention"],
                sliding_window=W, rope_theta=10000.0, rms_norm_eps=1e-6)
    base.update(kw)
    return DrafterConfig(**base)


def make_drafter(cfg: DrafterConfig, seed: int = 0, **kw) -> DFlashDrafter:
    """A drafter with *all* weights random (norm weights too: with unit norms, a norm applied twice
    or to the wrong stream is invisible)."""
    g = torch.Generator().manual_seed(seed)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape, generator=g))
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.3)
    model = DFlashDrafter(cfg, embed, head, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
    return model


def make_case(doc_lens: list[list[int]], anchors: list[list[int | None]], seed: int = 0):
    """Packed rows with documents and anchors -> features, positions, block tensors, lo/hi (by hand)."""
    g = torch.Generator().manual_seed(seed)
    r, t = len(doc_lens), sum(doc_lens[0])
    n = len(anchors[0])
    pos = torch.zeros(r, t, dtype=torch.long)
    starts = torch.zeros(r, t, dtype=torch.long)
    for ri, lens in enumerate(doc_lens):
        assert sum(lens) == t
        p0 = 0
        for ln in lens:
            for i in range(ln):
                pos[ri, p0 + i] = i
                starts[ri, p0 + i] = p0
            p0 += ln
    tokens = torch.randint(0, V - 1, (r, t), generator=g)
    lo = torch.zeros(r, n, dtype=torch.int32)
    hi = torch.zeros(r, n, dtype=torch.int32)
    ids = torch.full((r, n * B), MASK_ID, dtype=torch.long)
    bpos = torch.zeros(r, n * B, dtype=torch.long)
    for ri in range(r):
        for j, a in enumerate(anchors[ri]):
            if a is not None:
                lo[ri, j], hi[ri, j] = int(starts[ri, a]), a
                ids[ri, j * B] = tokens[ri, a]
            base = int(pos[ri, a]) if a is not None else 0
            for k in range(B):
                bpos[ri, j * B + k] = base + k
    features = torch.randn(r, t, 2 * 32, generator=g)
    return features, pos, ids, bpos, lo, hi


def dense_mask_loops(lo: torch.Tensor, hi: torch.Tensor, t: int, window: int | None) -> torch.Tensor:
    """[R,Q,T+Q] bool from the definition, one element at a time."""
    r, n = lo.shape
    q = n * B
    m = torch.zeros(r, q, t + q, dtype=torch.bool)
    for ri in range(r):
        for qi in range(q):
            j, k = divmod(qi, B)
            l, h = int(lo[ri, j]), int(hi[ri, j])
            for p in range(t):
                if l <= p < h and (window is None or (h + k) - p < window):
                    m[ri, qi, p] = True
            for i in range(q):
                if i // B == j:
                    m[ri, qi, t + i] = True
    return m


def oracle_forward(sd: dict[str, torch.Tensor], cfg: DrafterConfig, embed_w: torch.Tensor, features, ctx_pos,
                   ids, bpos, masks) -> torch.Tensor:
    """Dense fp64 reference: loops over rows, layers and heads; matmul + softmax; no drafter code."""
    d = cfg.head_dim
    eps = cfg.rms_norm_eps
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    w = {k: v.double() for k, v in sd.items()}

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def rope(x, positions):  # x [L,D], positions [L]: pairs (i, i + D/2) rotated by pos·θ^(−2i/D)
        out = x.clone()
        half = d // 2
        for i in range(half):
            ang = positions.double() * cfg.rope_theta ** (-2.0 * i / d)
            c, s = torch.cos(ang), torch.sin(ang)
            out[:, i] = x[:, i] * c - x[:, i + half] * s
            out[:, i + half] = x[:, i + half] * c + x[:, i] * s
        return out

    outs = []
    for r in range(features.shape[0]):
        ctx = rms(features[r].double() @ w["fc.weight"].T, w["hidden_norm.weight"])  # [T,H]
        x = embed_w.double()[ids[r]]  # [Q,H]
        key_pos = torch.cat([ctx_pos[r], bpos[r]])
        for li in range(cfg.num_hidden_layers):
            p = f"layers.{li}."
            window = cfg.sliding_window if cfg.layer_types[li] == "sliding_attention" else None
            mask = masks[window][r]
            h = rms(x, w[p + "input_layernorm.weight"])
            q_all = h @ w[p + "self_attn.q_proj.weight"].T
            k_all = torch.cat([ctx @ w[p + "self_attn.k_proj.weight"].T, h @ w[p + "self_attn.k_proj.weight"].T])
            v_all = torch.cat([ctx @ w[p + "self_attn.v_proj.weight"].T, h @ w[p + "self_attn.v_proj.weight"].T])
            heads = []
            for hq in range(cfg.num_attention_heads):
                g = hq // group
                qh = rope(rms(q_all[:, hq * d:(hq + 1) * d], w[p + "self_attn.q_norm.weight"]), bpos[r])
                kh = rope(rms(k_all[:, g * d:(g + 1) * d], w[p + "self_attn.k_norm.weight"]), key_pos)
                vh = v_all[:, g * d:(g + 1) * d]
                scores = (qh @ kh.T) / math.sqrt(d)
                scores = scores.masked_fill(~mask, float("-inf"))
                heads.append(torch.softmax(scores, dim=-1) @ vh)
            x = x + torch.cat(heads, dim=-1) @ w[p + "self_attn.o_proj.weight"].T
            h2 = rms(x, w[p + "post_attention_layernorm.weight"])
            gate = h2 @ w[p + "mlp.gate_proj.weight"].T
            up = h2 @ w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + torch.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        outs.append(rms(x, w["norm.weight"]))
    return torch.stack(outs)


# Three packed shapes: several documents, an invalid (padded) anchor, anchors near doc starts.
CASES = [
    ([[7, 8, 4], [12, 7]], [[3, 9, 16], [5, 14, None]]),
    ([[12], [5, 7]], [[0, 6], [2, 9]]),
    ([[10, 10, 12], [20, 12]], [[2, 11, 13, 25], [4, 19, 21, None]]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_matches_dense_oracle(case):
    """Drafter forward = plain-loop oracle: catches input_layernorm applied to the context, RoPE on the
    wrong positions or wrong half-rotation, GQA head mapping, a wrong window per layer, q/k_norm misuse."""
    cfg = tiny_config()
    model = make_drafter(cfg, seed=case)
    doc_lens, anchors = CASES[case]
    features, pos, ids, bpos, lo, hi = make_case(doc_lens, anchors, seed=case)
    t = features.shape[1]
    masks = {None: dense_mask_loops(lo, hi, t, None), W: dense_mask_loops(lo, hi, t, W)}
    with torch.no_grad():
        out = model(features, pos, ids, bpos, masks)
        ref = oracle_forward(model.state_dict(), cfg, model.embed_tokens.weight, features, pos, ids, bpos, masks)
    assert out.shape == (len(doc_lens), len(anchors[0]) * B, cfg.hidden_size)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-5, err
    # The sliding layer must actually differ from full attention here (else the test checks nothing).
    full_only = {None: masks[None], W: masks[None]}
    with torch.no_grad():
        alt = model(features, pos, ids, bpos, full_only)
        with_head_axis = model(features, pos, ids, bpos, {w: m[:, None] for w, m in masks.items()})
    assert (alt - out).abs().max() > 1e-3
    assert torch.equal(with_head_axis, out)  # [R,1,Q,K] masks (head axis included) are read the same


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_equals_dense_path():
    """BlockMask (flex) and dense-bool (SDPA) realizations give the same forward: the two backends
    must not drift (e.g. GQA expansion or mask orientation differing between them)."""
    from torch.nn.attention.flex_attention import create_block_mask

    cfg = tiny_config()
    model = make_drafter(cfg, seed=3)
    features, pos, ids, bpos, lo, hi = make_case(*CASES[2], seed=3)
    t = features.shape[1]
    r, q = ids.shape
    lo_l, hi_l = lo.long(), hi.long()

    def make_mod(window):
        def mask_mod(b, h, q_idx, kv_idx):
            j, k = q_idx // B, q_idx % B
            l, u = lo_l[b, j], hi_l[b, j]
            ctx = (kv_idx < t) & (kv_idx >= l) & (kv_idx < u)
            if window is not None:
                ctx = ctx & ((u + k) - kv_idx < window)
            own = (kv_idx >= t) & ((kv_idx - t) // B == j)
            return ctx | own
        return mask_mod

    flex_masks = {w: create_block_mask(make_mod(w), B=r, H=None, Q_LEN=q, KV_LEN=t + q, device="cpu")
                  for w in (None, W)}
    dense_masks = {w: dense_mask_loops(lo, hi, t, w) for w in (None, W)}
    with torch.no_grad():
        out_dense = model(features, pos, ids, bpos, dense_masks)
        out_flex = model(features, pos, ids, bpos, flex_masks)
    err = (out_flex - out_dense).abs().max() / out_dense.abs().max()
    assert err <= 1e-5, err


def _loss(model, features, pos, ids, bpos, masks, seed=0):
    hidden = model(features, pos, ids, bpos, masks)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, ids.shape, generator=g)
    weight = torch.rand(ids.shape, generator=g)
    sums = block_loss(hidden, model.lm_head_weight, labels, weight, block_size=B)
    return sums.loss_sum / sums.weight_sum


EXPECTED_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}" for i in range(2) for name in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}


def test_gradients_and_saved_keys():
    """Gradients reach fc, hidden_norm and every layer weight but never the target's embedding/LM head,
    and a checkpoint holds exactly the HF-named drafter weights (no embed/lm_head copies)."""
    cfg = tiny_config()
    model = make_drafter(cfg, seed=1)
    features, pos, ids, bpos, lo, hi = make_case(*CASES[0], seed=1)
    t = features.shape[1]
    masks = {w: dense_mask_loops(lo, hi, t, w) for w in (None, W)}
    _loss(model, features, pos, ids, bpos, masks).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert not model.embed_tokens.weight.requires_grad and model.embed_tokens.weight.grad is None
    assert not model.lm_head.weight.requires_grad and model.lm_head.weight.grad is None
    assert set(model.state_dict()) == EXPECTED_KEYS
    assert set(model.trainable_state_dict()) == EXPECTED_KEYS
    assert {n for n, _ in model.named_parameters()} == EXPECTED_KEYS

    other = make_drafter(cfg, seed=2)
    other.load_trainable_state_dict(model.trainable_state_dict())
    for k, v in other.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    with pytest.raises(ValueError, match="missing"):
        other.load_trainable_state_dict({k: v for k, v in model.trainable_state_dict().items() if k != "fc.weight"})


@pytest.mark.parametrize("policy", ["all", [1]])
def test_checkpointing_matches_plain(policy):
    """Activation checkpointing changes memory, never numbers: same loss and gradients as without it."""
    cfg = tiny_config()
    features, pos, ids, bpos, lo, hi = make_case(*CASES[0], seed=4)
    t = features.shape[1]
    masks = {w: dense_mask_loops(lo, hi, t, w) for w in (None, W)}
    plain = make_drafter(cfg, seed=4)
    ckpt = make_drafter(cfg, seed=4, checkpoint_layers=policy)
    assert ckpt.checkpoint_layers == ({0, 1} if policy == "all" else {1})
    l1 = _loss(plain, features, pos, ids, bpos, masks)
    l2 = _loss(ckpt, features, pos, ids, bpos, masks)
    l1.backward()
    l2.backward()
    torch.testing.assert_close(l2, l1, rtol=0, atol=0)
    grads = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-6, atol=1e-8, msg=name)


def test_checkpoint_policy_rejects_bad_indices():
    """A typo in checkpoint_layers fails loudly instead of silently checkpointing nothing."""
    with pytest.raises(ValueError, match="checkpoint_layers"):
        make_drafter(tiny_config(), checkpoint_layers=[2])


def test_bf16_target_and_autocast():
    """A bf16 target (embedding, features) drives an fp32 drafter without autocast, and the bf16
    autocast forward stays close to fp32 and backpropagates (no dtype mismatch in q/k/v or norms)."""
    cfg = tiny_config()
    model = make_drafter(cfg, seed=5)
    features, pos, ids, bpos, lo, hi = make_case(*CASES[1], seed=5)
    t = features.shape[1]
    masks = {w: dense_mask_loops(lo, hi, t, w) for w in (None, W)}
    with torch.no_grad():
        ref = model(features, pos, ids, bpos, masks)
        model.embed_tokens.to(torch.bfloat16)
        out = model(features.bfloat16(), pos, ids, bpos, masks)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() / ref.abs().max() < 0.05
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model, features.bfloat16(), pos, ids, bpos, masks)
    loss.backward()
    assert torch.isfinite(loss) and model.fc.weight.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_matches_dense_on_cuda():
    """Compiled flex (the CUDA training path) = dense SDPA in fp32, forward and gradients: the fast
    kernel must train the same model the CPU reference does."""
    from torch.nn.attention.flex_attention import create_block_mask

    cfg = tiny_config(hidden_size=64, head_dim=16, block_size=16, num_attention_heads=4, num_key_value_heads=2,
                      sliding_window=40)
    b, t, n, r = 16, 128, 8, 2
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    lo = torch.zeros(r, n, dtype=torch.int32)
    hi = torch.zeros(r, n, dtype=torch.int32)
    bpos = torch.zeros(r, n * b, dtype=torch.long)
    pos = torch.cat([torch.arange(70), torch.arange(58)]).repeat(r, 1)
    for ri in range(r):
        anchors = torch.randperm(t - 1, generator=g)[:n - 1].sort().values + 1
        for j, a in enumerate(anchors.tolist()):
            lo[ri, j], hi[ri, j] = (0 if a < 70 else 70), a
            bpos[ri, j * b:(j + 1) * b] = int(pos[ri, a]) + torch.arange(b)
    ids = torch.randint(0, V, (r, n * b), generator=g)
    features = torch.randn(r, t, 2 * 64, generator=g)
    lo_d, hi_d = lo.long().to(dev), hi.long().to(dev)

    def make_mod(window):
        def mask_mod(bb, h, q_idx, kv_idx):
            j, k = q_idx // b, q_idx % b
            l, u = lo_d[bb, j], hi_d[bb, j]
            ctx = (kv_idx < t) & (kv_idx >= l) & (kv_idx < u)
            if window is not None:
                ctx = ctx & ((u + k) - kv_idx < window)
            return ctx | ((kv_idx >= t) & ((kv_idx - t) // b == j))
        return mask_mod

    windows = (None, 40)
    flex = {w: create_block_mask(make_mod(w), B=r, H=None, Q_LEN=n * b, KV_LEN=t + n * b, device=dev) for w in windows}
    dense = {}
    for w in windows:
        m = torch.zeros(r, n * b, t + n * b, dtype=torch.bool)
        for ri in range(r):
            for qi in range(n * b):
                j, k = divmod(qi, b)
                for p in range(t):
                    m[ri, qi, p] = bool(lo[ri, j] <= p < hi[ri, j] and (w is None or (hi[ri, j] + k) - p < w))
                m[ri, qi, t + j * b:t + (j + 1) * b] = True
        dense[w] = m.to(dev)
    model = make_drafter(cfg, seed=7).to(dev)
    model.embed_tokens.to(dev)
    model.lm_head.to(dev)
    inputs = [x.to(dev) for x in (features, pos, ids, bpos)]
    labels = torch.randint(0, V, (r, n * b), generator=g).to(dev)
    weight = torch.rand(r, n * b, generator=g).to(dev)
    outs, grads = [], []
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for masks in (dense, flex):
            model.zero_grad(set_to_none=True)
            hidden = model(*inputs, masks)
            sums = block_loss(hidden, model.lm_head_weight, labels, weight, block_size=b)
            (sums.loss_sum / sums.weight_sum).backward()
            outs.append(hidden.detach())
            grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    assert (outs[1] - outs[0]).abs().max() / outs[0].abs().max() <= 1e-5
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-6, msg=k)
