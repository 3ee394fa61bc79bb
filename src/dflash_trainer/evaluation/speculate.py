"""DFlash speculative decoding of one sequence: draft a block, verify it with the target in one pass.

Shapes: P = prompt tokens, B = block size (anchor + B−1 drafts), V = vocabulary, k·H = width of
the target features (k target layers of width H).

One round (FIELD_NOTES §2, inference loop). Invariant at the start of a round: the committed
sequence is x_0 … x_a, the target's KV cache and the drafter's context both hold positions
0 … a−1, and x_a (the last committed token, the previous round's bonus token) is the anchor.
  1. draft:  the drafter sees the features of positions < a and the block [x_a, MASK × (B−1)] at
             positions a … a+B−1; slot k proposes d_k for position a+k (k = 1 … B−1).
  2. verify: the target runs [x_a, d_1 … d_{B−1}] at positions a … a+B−1 over its KV cache;
             logits at position a+j give its prediction t_{j+1} for position a+j+1, and hooks on
             the target layers give the features of positions a … a+B−1.
  3. accept: T = 0: n = length of the leading run with d_k = t_k. T > 0: speculative rejection
             sampling (below). Commit d_1 … d_n and a bonus token (t_{n+1}, or the sample).
  4. update: keep the target cache for positions ≤ a+n (the anchor and the accepted drafts; the
             rejected positions are cropped) and append their n+1 features to the drafter's
             context. The bonus token, at position a+n+1, anchors the next round.
A round adds n+1 tokens for one target forward; τ = mean(n+1) over rounds.

Sampling (T > 0): q_k = softmax(drafter logits of slot k / T), p_j = softmax(target logits at
position a+j / T). The drafts of a DFlash block come from one pass, so q_k depends only on the
committed prefix, which is a valid proposal. Draft d_k is accepted with probability
min(1, p_{k−1}(d_k) / q_k(d_k)); at the first rejection the token is drawn from
norm(max(0, p_{k−1} − q_k)); when all B−1 are accepted the bonus is drawn from p_{B−1}. Every
committed token is then distributed exactly as the target's own sampling at temperature T
(checked by a chi-square test in tests/unit/test_eval_speculate.py).

Stopping: generation ends after `max_new_tokens` tokens or at the first end-of-sequence token
(kept in the output), whichever comes first, mid-round if needed; plain decoding (`generate_plain`)
stops the same way, so at T = 0 the two outputs must be identical token for token.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import nn

from dflash_trainer.target_model.layers import check_target_layer_ids
from dflash_trainer.target_model.load import TargetBundle, find_decoder_layers


class Proposer(Protocol):
    """What the loop needs from a drafter (DraftSession, or a test stub)."""

    def reset(self) -> None: ...

    def extend(self, features: torch.Tensor, start: int) -> None: ...

    def propose(self, anchor_token: int, anchor_pos: int, block_size: int | None = None) -> torch.Tensor: ...


def _cache_kwarg(model: nn.Module) -> str:
    """Name of the KV-cache argument of the model's forward (`cache` in transformers ≥ 5.2x,
    `past_key_values` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class TargetSession:
    """The frozen target decoding one sequence with a KV cache (batch 1, no padding).

    layer_ids: target layers whose outputs are the drafter's features (id ℓ = output of decoder
    layer ℓ, as in training). `forward` appends tokens to the cache and returns their logits (fp32)
    and, when asked, their features [n,k·H]; `crop` drops cached positions.
    """

    def __init__(self, target: TargetBundle, layer_ids: list[int] | None = None):
        from transformers import DynamicCache

        self.target = target
        self.model = target.model
        self.layer_ids = check_target_layer_ids(layer_ids, target.num_layers) if layer_ids else []
        self.layers = find_decoder_layers(self.model)
        self._cache_cls = DynamicCache
        self._cache_arg = _cache_kwarg(self.model)
        self.device = target.embed_tokens.weight.device
        self.reset()

    def reset(self) -> None:
        self.cache = self._cache_cls()
        self.length = 0

    @torch.no_grad()
    def forward(self, tokens: list[int], *, last_only: bool = False,
                with_features: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `tokens` at positions length … length+n−1.

        Returns (logits fp32 [n,V] — [1,V] for the last token only when last_only —, features
        [n,k·H] in the target's dtype or None).
        """
        n = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1,n]
        pos = torch.arange(self.length, self.length + n, device=self.device)[None]  # [1,n]
        H = self.target.hidden_size
        feats = None
        handles = []
        if with_features:
            if not self.layer_ids:
                raise ValueError("with_features=True but the session has no target layer ids")
            feats = torch.empty(n, len(self.layer_ids) * H, device=self.device,
                                dtype=self.target.embed_tokens.weight.dtype)  # [n,k·H]

            def make_hook(j: int):
                def hook(_module: nn.Module, _args: Any, output: Any) -> None:
                    hidden = output[0] if isinstance(output, (tuple, list)) else output  # [1,n,H]
                    feats[:, j * H:(j + 1) * H].copy_(hidden[0])
                return hook

            handles = [self.layers[i].register_forward_hook(make_hook(j)) for j, i in enumerate(self.layer_ids)]
        try:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1 if last_only else 0,
                             **{self._cache_arg: self.cache})
        finally:
            for h in handles:
                h.remove()
        self.length += n
        return out.logits[0].float(), feats

    def crop(self, length: int) -> None:
        """Keep the cached positions 0 … length−1 (drop the rejected drafts)."""
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"crop({length}) beyond the cached length {self.length}")
        if drop:
            self.cache.crop(-drop)  # negative = tokens to remove (accepted by every transformers 5 release)
        self.length = length


@dataclass
class Generation:
    """One decoded continuation. tokens: the new tokens (prompt excluded), eos included when hit.
    accepted: per round, the number n of drafts the target accepted (0 … B−1). wall_s: host time
    of the whole call (prefill included). stop: "eos" or "length"."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    stop: str = "length"


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); no-op on the CPU. For wall-clock timing only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: honest wall-clock timing of async GPU work


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy (T = 0) or a sample at temperature T from logits [V]."""
    if temperature <= 0:
        return int(logits.argmax())  # host sync: the token decides what runs next
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_greedy(drafts: list[int], target_pred: list[int]) -> tuple[int, int]:
    """Greedy verification. drafts d_1 … d_{B−1}; target_pred t_1 … t_B (t_{j+1} = target argmax
    at position anchor+j). Returns (n, bonus): the leading run with d_k = t_k and t_{n+1}."""
    n = 0
    while n < len(drafts) and drafts[n] == target_pred[n]:
        n += 1
    return n, target_pred[n]


def verify_sampling(drafts: list[int], q: torch.Tensor, p: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling. drafts d_1 … d_{B−1} drawn from q [B−1,V] (row k−1 = q_k);
    p [B,V] target probabilities (row j at position anchor+j). Returns (n accepted, next token).

    Accept d_k with probability min(1, p_{k−1}(d_k)/q_k(d_k)); at the first rejection draw from
    norm(max(0, p_{k−1} − q_k)); after B−1 acceptances draw the bonus from p_{B−1}.
    """
    for k, d in enumerate(drafts):
        pk, qk = p[k, d], q[k, d]
        u = torch.rand((), generator=generator, device=p.device)
        if u * qk <= pk:  # u < p/q without dividing (q(d) > 0 since d was drawn from q)
            continue
        residual = (p[k] - q[k]).clamp_min(0.0)
        total = residual.sum()
        dist = residual / total if total > 0 else p[k]  # total = 0 only when p = q, where nothing is rejected
        return k, int(torch.multinomial(dist, 1, generator=generator))  # host sync: the token is needed
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


def _commit(out: list[int], tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> str | None:
    """Append `tokens` to `out` up to and including the first EOS and at most up to `max_new_tokens`
    in all; returns why generation stops ("eos", "length") or None to go on."""
    for tok in tokens:
        out.append(tok)
        if tok in eos_ids:
            return "eos"
        if len(out) >= max_new_tokens:
            return "length"
    return None


def generate_plain(target: TargetSession, prompt: list[int], *, max_new_tokens: int, eos_ids: set[int],
                   temperature: float = 0.0, generator: torch.Generator | None = None,
                   on_token: Callable[[int], None] | None = None) -> Generation:
    """Target-only decoding, one token per forward over the KV cache (the reference for
    losslessness and the baseline for tokens/s). on_token(n): called with the tokens committed so
    far after each one (progress heartbeats; keep it cheap, it runs inside the timed region)."""
    sync_device(target.device)
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt, last_only=True)
    out: list[int] = []
    while True:
        tok = _pick(logits[-1], temperature, generator)
        if stop := _commit(out, [tok], eos_ids, max_new_tokens):
            break
        if on_token is not None:
            on_token(len(out))
        logits, _ = target.forward([tok], last_only=True)
    sync_device(target.device)
    return Generation(tokens=out, wall_s=time.perf_counter() - t0, stop=stop)


def generate_speculative(target: TargetSession, drafter: Proposer, prompt: list[int], *, block_size: int,
                         max_new_tokens: int, eos_ids: set[int], temperature: float = 0.0,
                         generator: torch.Generator | None = None,
                         on_token: Callable[[int], None] | None = None) -> Generation:
    """DFlash speculative decoding of one prompt (see the module docstring for one round).

    block_size: B (anchor + B−1 drafts). temperature 0 = greedy verification; > 0 = rejection
    sampling (then `generator` seeds the draws of both sides). on_token(n): called with the tokens
    committed so far after each round (progress heartbeats; cheap, inside the timed region).
    Raises ValueError on an empty prompt.
    """
    if not prompt:
        raise ValueError("empty prompt: speculative decoding needs at least one prompt token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    sync_device(target.device)
    t0 = time.perf_counter()
    target.reset()
    drafter.reset()
    logits, feats = target.forward(prompt, last_only=True, with_features=True)  # feats [P,k·H]
    drafter.extend(feats, 0)
    anchor = _pick(logits[-1], temperature, generator)
    out: list[int] = []
    accepted: list[int] = []
    stop = _commit(out, [anchor], eos_ids, max_new_tokens)
    while stop is None:
        a = len(prompt) + len(out) - 1  # position of the anchor; target and drafter hold 0 … a−1
        d_logits = drafter.propose(anchor, a, block_size)  # [B−1,V]
        if temperature <= 0:
            drafts = d_logits.argmax(-1).tolist()  # host sync: the drafts feed the target
        else:
            q = torch.softmax(d_logits / temperature, dim=-1)  # [B−1,V]
            drafts = torch.multinomial(q, 1, generator=generator)[:, 0].tolist()
        v_logits, v_feats = target.forward([anchor, *drafts], with_features=True)  # [B,V], [B,k·H]
        if temperature <= 0:
            n, bonus = verify_greedy(drafts, v_logits.argmax(-1).tolist())
        else:
            n, bonus = verify_sampling(drafts, q, torch.softmax(v_logits / temperature, dim=-1), generator)
        accepted.append(n)
        if stop := _commit(out, [*drafts[:n], bonus], eos_ids, max_new_tokens):
            break
        if on_token is not None:
            on_token(len(out))
        target.crop(a + n + 1)
        drafter.extend(v_feats[:n + 1], a)
        anchor = bonus
    sync_device(target.device)
    return Generation(tokens=out, accepted=accepted, wall_s=time.perf_counter() - t0, stop=stop)
