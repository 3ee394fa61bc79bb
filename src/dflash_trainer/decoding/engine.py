"""The one decoding engine of eval and of measured τ: plain and DFlash speculative decoding of R ≥ 1
rows over static caches, greedy or sampled, eager on the CPU, CUDA-graph replays on CUDA.

Shapes: R = rows, B = block size, N = max_new_tokens, P = max_prompt_tokens, S = P + N + B cache
slots per row rounded up to a multiple of 16 (`max_len`), V = vocabulary.

State, per row, on the device (long unless noted): anchor [R] (the last committed token, not yet in
the caches), a [R] (its position: the target's cache and the drafter's context hold 0 … a−1),
out [R,N+B] (committed tokens up to count, scratch beyond), count [R], eos_hit / done [R] bool,
accepted [R,N] (drafts accepted in each round), rounds [R]. A call with m < R prompts leaves rows
m … R−1 done from the start (they ride along unchanged). `refill` starts new prompts in finished rows
while the others go on (continuous batching, decoding/stream.py).

  plain step (greedy: the lossless reference and the speed baseline): the target runs the anchor
      at a over its cache; its argmax is committed.
  speculative round (as z-lab/dflash `dflash_generate`, `dflash/model.py`): at draft length k
      (1 … B−1, default B−1) the drafter runs the block [anchor, MASK × k] of k+1 slots at a … a+k
      (draft.py) and proposes its k drafts; the target verifies [anchor, k drafts] in one forward of
      k+1 tokens; verify.py decides n ≤ k accepted drafts and the next token (greedy, or
      speculative sampling at T > 0); the verified features are written to the drafter's context.
      A draft length k is a block of k+1 as the serving engines run it: vLLM's DFlash proposer
      (`v1/spec_decode/dflash.py` @01046b9a, read, not run: 1 + num_speculative_tokens query slots
      a request) and SGLang's DFLASH worker (`--speculative-num-draft-tokens` = its block, anchor
      included). In-block attention is bidirectional, so the drafts of a shorter block can differ
      from the first k of the whole block; a shorter k saves drafter and verify work alike. k = 0 is
      plain decoding: no drafter call, no features (`set_draft_length`; the speedup table picks k
      per batch size, evaluation/draft_length.py).
  commit (both): the leading tokens are committed up to and including the first end-of-sequence
      token and at most up to the cap of new tokens, mid-round if needed; a advances by what was
      committed and the last committed token anchors the next step. Plain and speculative stop by
      this one rule, so at T = 0 the outputs must be identical token for token.

Every update is in place on tensors made once and nothing reads the host, so on CUDA one plain step
and (with a drafter, at a draft length k ≥ 1) one speculative round are each captured into a CUDA
graph in the constructor (each in its own memory pool) and the round again by `set_draft_length` (while every row
is done: the warm-ups and captures commit nothing and write only cache slots that a prefill or a
later round rewrites before any query sees them) and replayed. A replay attends over all S slots
instead of the eager step's host-side bound (the longest row); slots at or past a row's anchor are
masked, so the tokens are the same up to rounding. Sampling reads its uniforms (2B−1 per row and
round) from a buffer of `sync_every` rounds that the host refills from the seeded generator at the
same rounds eagerly and replayed, so graph and eager draw the same numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.decoding.draft import DraftSession
from dflash_trainer.decoding.verify import accept_greedy, accept_sampled, sample_from
from dflash_trainer.decoding.batched import (PREFILL_TOKENS, BatchedTarget, check_step_attention, default_step_attention,
                                             prefill_groups, right_padded, rope_is_static, unsupported_reason)
from dflash_trainer.decoding.continuous import capture_graphs, is_eos
from dflash_trainer.decoding.hf_cache import HFCacheTarget
from dflash_trainer.target_model.load import TargetBundle

PLAIN, SPECULATIVE = "plain", "speculative"


def check_draft_length(k: int, block_size: int) -> int:
    """k itself when 0 ≤ k ≤ B−1 (the drafts a round can verify; 0 = plain decoding), else
    ValueError naming draft_length and the range."""
    if not 0 <= k <= block_size - 1:
        raise ValueError(f"draft_length={k}: must be 0 … {block_size - 1} (B−1 for block size {block_size}; "
                         "0 = plain decoding)")
    return k


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); no-op on the CPU. For wall-clock timing only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: honest wall-clock timing of async GPU work


@dataclass
class Decoded:
    """One `decode` call, per prompt: new tokens (eos kept when hit), accepted drafts per round
    (empty for plain decoding), stop "eos" | "length"; wall_s: host wall-clock of the call
    (prefill, steps and the read of the results)."""

    tokens: list[list[int]]
    accepted: list[list[int]]
    stop: list[str]
    wall_s: float


class DecodeEngine:
    """R rows of plain and speculative decoding over one target cache (module docstring).

    drafter None: plain decoding only. block_size: B at inference (≤ the trained B; default the
    trained B). draft_length: k, the drafts each round proposes and verifies, from a drafter block of
    k+1 slots (0 … B−1; default B−1; 0 makes a speculative decode plain decoding; `set_draft_length`
    changes it). temperature: 0 = greedy
    speculative decoding, > 0 = speculative sampling (plain decoding is always greedy); generator: the source of the uniforms, on the target's device
    (None: seeded 0). zero_features: feed the drafter zeros (control drafters). cuda_graph: capture
    a plain step and a speculative round (CUDA, static RoPE). sync_every: rounds between host
    looks when replaying. prefill_tokens: a decode's prompts are prefilled in groups of at most this
    many rows × longest prompt (`prefill_groups`). step_attention: how the target's steps attend over
    its cache (decoding/batched.py STEP_ATTENTION; the HF-cache path ignores it); None =
    decoding/batched.py `default_step_attention`. Raises ValueError for bad sizes, a bad block
    size, an unknown step_attention or no eos id.
    """

    def __init__(self, target: TargetBundle, drafter: DFlashDrafter | None, *, rows: int, max_prompt_tokens: int,
                 max_new_tokens: int, eos_ids: set[int], block_size: int | None = None, temperature: float = 0.0,
                 generator: torch.Generator | None = None, zero_features: bool = False, cuda_graph: bool = True,
                 sync_every: int = 4, draft_length: int | None = None, prefill_tokens: int = PREFILL_TOKENS,
                 step_attention: str | None = None):
        if rows < 1 or max_prompt_tokens < 1 or max_new_tokens < 1:
            raise ValueError(f"rows={rows}, max_prompt_tokens={max_prompt_tokens}, max_new_tokens={max_new_tokens}: "
                             "each must be >= 1")
        if not eos_ids:
            raise ValueError("eos_ids is empty: decoding needs an end-of-sequence token")
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
        self.B = drafter.config.inference_block_size(block_size) if drafter is not None else 1
        self.k = self.B - 1 if draft_length is None else check_draft_length(draft_length, self.B)
        self.rows, self.max_prompt, self.max_new = rows, max_prompt_tokens, max_new_tokens
        self.prefill_tokens = prefill_tokens
        # S ≥ P + N + B, a multiple of 16: the drafter's additive mask then needs no padding in SDPA (its rows
        # are aligned) when a round attends over all S slots
        self.max_len = -(-(max_prompt_tokens + max_new_tokens + self.B) // 16) * 16
        layer_ids = drafter.config.target_layer_ids if drafter is not None else None
        # the static-cache path for the families it implements, the HF model's own forward (one row) for the rest
        if step_attention is None:
            step_attention = default_step_attention(target.embed_tokens.weight.dtype, rows)
        check_step_attention(step_attention)  # here too: the HF-cache path would not look at it
        if unsupported_reason(target):
            self.target = HFCacheTarget(target, rows=rows, max_len=self.max_len, layer_ids=layer_ids)
            self.step_attention = None  # the HF model's own attention
        else:
            self.target = BatchedTarget(target, rows=rows, max_len=self.max_len, layer_ids=layer_ids,
                                        step_attention=step_attention)
            self.step_attention = step_attention
        self.draft = (DraftSession(drafter, rows=rows, max_len=self.max_len, zero_features=zero_features)
                      if drafter is not None else None)
        self.device = dev = self.target.device
        self.temperature, self.sync_every, self.sampling = temperature, sync_every, temperature > 0
        if generator is None and self.sampling:
            generator = torch.Generator(device=dev).manual_seed(0)
        self.generator = generator
        R, N, B = rows, max_new_tokens, self.B
        long = {"dtype": torch.long, "device": dev}
        self.eos = torch.tensor(sorted(eos_ids), **long)
        self.anchor, self.a, self.count, self.rounds = (torch.zeros(R, **long) for _ in range(4))  # module docstring
        self.out = torch.full((R, N + B), -1, **long)
        self.limit = torch.full((), N, **long)  # this call's cap on new tokens (≤ N)
        self.done = torch.ones(R, dtype=torch.bool, device=dev)
        self.eos_hit = torch.zeros_like(self.done)
        self.accepted = torch.zeros(R, N, **long)
        self.slot = torch.arange(B, device=dev)[None]  # [1,B]
        self._one = torch.ones(R, **long)  # a plain step's tokens per row
        self.noise = torch.zeros(sync_every, R, 2 * B - 1, dtype=torch.float32, device=dev)  # uniforms per round
        self.t = torch.zeros((), **long)  # which line of `noise` the next round reads
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.graphed = (cuda_graph and dev.type == "cuda" and getattr(self.target, "graphable", True)
                        and rope_is_static(self.target.base))
        if self.graphed:
            self.graphs = self._capture(self.graph_steps())

    def _capture(self, steps: dict[str, Callable[[], None]]) -> dict[str, torch.cuda.CUDAGraph]:
        """One CUDA graph per mode, each in its own memory pool (`capture_graphs` per mode), so that
        `set_draft_length` replaces the speculative round's graph and frees its pool without touching the
        plain step's."""
        return {mode: capture_graphs(self.device, {mode: step}, warmups=3, reset=self.t.zero_)[mode]
                for mode, step in steps.items()}

    def set_draft_length(self, k: int) -> None:
        """Rounds of k drafts from a drafter block of k+1 slots from the next decode on (0 … B−1;
        0 = plain decoding). Call between decodes: on CUDA the speculative round's graph is dropped (its
        pool with it) and, at k ≥ 1, captured anew; the plain step's graph does not depend on k and stays
        (every row is marked done first, as in the constructor; the next `start` resets the rows).
        Raises ValueError for k outside 0 … B−1."""
        k = check_draft_length(k, self.B)
        if k == self.k:
            return
        self.k = k
        if self.graphed and self.draft is not None:
            self.graphs.pop(SPECULATIVE, None)  # first: its pool goes before the new one is made
            self.done.fill_(True)
            steps = self.graph_steps()
            if SPECULATIVE in steps:
                self.graphs.update(self._capture({SPECULATIVE: steps[SPECULATIVE]}))

    def speculating(self, speculative: bool) -> bool:
        """Whether a decode asked to be `speculative` runs speculative rounds: a draft length of 0
        decodes plainly."""
        return speculative and self.k > 0

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], *, speculative: bool, max_new_tokens: int | None = None,
               on_round: Callable[[int], None] | None = None) -> Decoded:
        """Decode every prompt (m ≤ R, each 1 … max_prompt_tokens tokens) to its end; plain or
        speculative. max_new_tokens: this call's cap (≤ the engine's N; default N). on_round(tokens):
        called with the tokens committed so far (all rows) at every host look (progress; cheap)."""
        sync_device(self.device)
        t0 = time.perf_counter()
        m = self.start(prompts, speculative=speculative, max_new_tokens=max_new_tokens)
        speculative = self.speculating(speculative)
        self.run(speculative=speculative, on_round=on_round)
        # host sync: the results, once
        counts, hits, out = self.count[:m].tolist(), self.eos_hit[:m].tolist(), self.out[:m].tolist()
        accepted = [r[:k] for r, k in zip(self.accepted[:m].tolist(), self.rounds[:m].tolist())] if speculative \
            else [[] for _ in range(m)]
        sync_device(self.device)
        return Decoded(tokens=[t[:c] for t, c in zip(out, counts)], accepted=accepted,
                       stop=["eos" if h else "length" for h in hits], wall_s=time.perf_counter() - t0)

    def warm_up(self, prompt: list[int]) -> None:
        """Untimed first calls (allocations, lazy kernels): a short plain and speculative decode."""
        self.decode([prompt], speculative=False, max_new_tokens=min(2, self.max_new))
        self.decode([prompt], speculative=True, max_new_tokens=min(2 * self.B, self.max_new))

    @torch.no_grad()
    def start(self, prompts: list[list[int]], *, speculative: bool, max_new_tokens: int | None = None) -> int:
        """Prefill rows 0 … m−1 from the prompts and reset the state (rows m … R−1 done); the
        target's first token (greedy, or sampled at T > 0 when speculative) anchors round 1.
        Returns m. Raises ValueError for no prompts, too many, an empty or too long one, or a
        speculative decode without a drafter. At draft length 0 a speculative start is a plain one."""
        m = len(prompts)
        if not 1 <= m <= self.rows:
            raise ValueError(f"{m} prompts for an engine of {self.rows} rows: pass 1 … {self.rows}")
        self.check_prompts(prompts, speculative=speculative)
        speculative = self.speculating(speculative)
        cap = self.max_new if max_new_tokens is None else max_new_tokens
        if not 1 <= cap <= self.max_new:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be 1 … {self.max_new} (the engine's)")
        if speculative:
            self.draft.refresh()  # the drafter's current weights (they change between decodes of measured τ)
        for t in (self.anchor, self.a, self.count, self.accepted, self.rounds, self.eos_hit):
            t.zero_()
        self.out.fill_(-1)
        self.done.fill_(True)
        self.limit.fill_(cap)
        self.refill(list(range(m)), prompts, speculative=speculative)
        return m

    def check_prompts(self, prompts: list[list[int]], *, speculative: bool) -> None:
        """Raise ValueError for an empty or too long prompt (1 … max_prompt_tokens tokens each), or a
        speculative decode without a drafter."""
        if any(not 1 <= len(p) <= self.max_prompt for p in prompts):
            raise ValueError(f"every prompt needs 1 … {self.max_prompt} tokens (max_prompt_tokens); got lengths "
                             f"{sorted({len(p) for p in prompts})}")
        if speculative and self.draft is None:
            raise ValueError("speculative decoding needs a drafter (the engine was built with drafter=None)")

    @torch.no_grad()
    def refill(self, rows: list[int], prompts: list[list[int]], *, speculative: bool) -> None:
        """Start the prompts in rows `rows` (one each, finished or unused rows: the others decode on
        untouched): prefill them in groups (`prefill_groups`, in the given order), with the drafter's
        context when speculative (at draft length > 0), and reset those rows' state; the call's cap on new
        tokens (`limit`) stays. `start` runs it for rows 0 … m−1; a continuous batch (decoding/stream.py)
        for the rows that finished. Prompts are checked by the caller (`check_prompts`)."""
        speculative = self.speculating(speculative)
        dev = self.device
        parts = []
        for i, j in prefill_groups([len(p) for p in prompts], self.prefill_tokens):
            toks, lengths = right_padded(prompts[i:j], dev)  # [g,P], [g]
            group = torch.tensor(rows[i:j], device=dev)
            group_logits, feats = self.target.prefill(group, toks, lengths, with_features=speculative)
            if speculative:
                self.draft.extend(feats, torch.zeros(j - i, dtype=torch.long, device=dev), group)
            parts.append(group_logits)
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]  # [m,V]
        if speculative and self.sampling:
            u = torch.rand(len(prompts), generator=self.generator, device=dev)
            first = sample_from(torch.softmax(logits / self.temperature, -1), u)
        else:
            first = logits.argmax(-1)
        idx = torch.tensor(rows, device=dev)
        self.out[idx] = -1
        self.accepted[idx] = 0
        self.rounds[idx] = 0
        self.anchor[idx] = first
        self.a[idx] = torch.tensor([len(p) for p in prompts]).to(dev)
        self.out[idx, 0] = first
        self.count[idx] = 1
        hit = is_eos(first, self.eos)
        self.eos_hit[idx] = hit
        self.done[idx] = hit | (self.limit <= 1)

    def run(self, *, speculative: bool, on_round: Callable[[int], None] | None = None) -> None:
        """Steps (plain, or speculative at draft length 0) or rounds (speculative) until every row is
        done. Eager: one host read per step (all done, the longest row, which bounds the attended
        span; tokens so far). Replayed: `sync_every` replays between reads (extra steps of finished rows change nothing), fewer
        when every live row is closer than that to its cap: a step or round commits ≥ 1 token per
        live row, so that stretch ends them all and is the last (no replays wasted at the cap; the
        uniforms of later rounds are never drawn, so graph and eager still draw the same)."""
        speculative = self.speculating(speculative)
        since = self.sync_every  # uniforms are drawn before the first round
        while True:
            all_done, longest, tokens, bound = torch.stack([self.done.all().long(), self.a.max(), self.count.sum(),
                                                            self.steps_to_end()]).tolist()  # host sync, once per look
            if on_round is not None:
                on_round(tokens)
            if all_done:
                return
            since = self.advance(speculative, min(self.sync_every, bound), longest, since)

    def steps_to_end(self) -> torch.Tensor:
        """Steps or rounds that surely end every live row (each commits ≥ 1 token a live row): the largest
        tokens left to a live row's cap, 0 when none is live. A 0-d long tensor on the device (no sync)."""
        return (self.limit - self.count).masked_fill(self.done, 0).max()

    def advance(self, speculative: bool, replays: int, longest: int, since: int) -> int:
        """What runs between two host looks (`run`'s, and a continuous batch's in decoding/stream.py): with a
        captured graph for the mode, fresh uniforms and `replays` replays; else one eager step or round over
        the slots up to `longest` (≥ every live row's position a), with uniforms drawn every `sync_every`
        rounds as the replays draw them. `since`: eager rounds since the last draw; returns its new value."""
        graph = self.graphs.get(SPECULATIVE if speculative else PLAIN)
        if graph is not None:
            self.draw_uniforms(speculative)
            for _ in range(replays):
                graph.replay()
            return since
        if since == self.sync_every:
            self.draw_uniforms(speculative)
            since = 0
        self.round(longest) if speculative else self.plain_step(longest + 1)
        return since + 1

    def draw_uniforms(self, speculative: bool) -> None:
        """The next `sync_every` rounds' uniforms, in one call (speculative sampling only)."""
        if speculative and self.sampling:
            torch.rand(self.noise.shape, generator=self.generator, device=self.device, out=self.noise)
            self.t.zero_()

    def plain_step(self, span: int) -> None:
        """One greedy decode step on every row, in place; span: cache slots attended (> max(a))."""
        logits, _ = self.target.step(self.anchor[:, None], self.a, span, all_logits=False, greedy=True)  # [R,V]
        new = logits.argmax(-1)[:, None]  # [R,1]
        self._commit(new, self._one)

    def round(self, span: int) -> None:
        """One speculative round of draft length k ≥ 1 on every row, in place; span: context slots
        the drafter reads (≥ max(a), ≤ S − k − 1; the drafter and the target read span + k + 1)."""
        B, k = self.B, self.k
        live = ~self.done
        greedy = not self.sampling  # argmax only: logits may stay in the model's dtype (the same argmax)
        d_logits = self.draft.propose(self.anchor, self.a, span, k + 1, greedy=greedy)  # [R,k,V]: a block of k+1
        if self.sampling:
            u = self.noise.index_select(0, self.t.view(1))[0]  # [R,2B−1]
            self.t += 1
            q = torch.softmax(d_logits / self.temperature, -1)
            drafts = sample_from(q, u[:, :k])  # [R,k]
        else:
            drafts = d_logits.argmax(-1)  # [R,k]
        logits, vfeats = self.target.step(torch.cat([self.anchor[:, None], drafts], 1), self.a, span + k + 1,
                                          with_features=True, greedy=greedy)  # [R,k+1,V], [R,k+1,k·H]
        if self.sampling:
            p = torch.softmax(logits / self.temperature, -1)
            n, new = accept_sampled(drafts, q, p, u[:, B - 1:B - 1 + k], u[:, 2 * B - 2])
        else:
            n, new = accept_greedy(drafts, logits)
        # rounds ≤ N − 2 while a row is live (each commits ≥ 1 token after the first), so a done row's write
        # (its n means nothing) lands past its record
        self.accepted.scatter_(1, self.rounds[:, None].clamp(max=self.max_new - 1), n[:, None])
        self.rounds += live
        self.draft.extend(vfeats, self.a)  # positions a … a+k; valid up to the new anchor
        self._commit(new, n + 1)

    def _commit(self, new: torch.Tensor, avail: torch.Tensor) -> None:
        """The stopping rule (module docstring): commit the leading `avail` [R] of new [R,k] on live
        rows, cut after the first eos and at the cap; advance a and the anchor."""
        k = new.shape[1]
        slot = self.slot[:, :k]
        # the first eos's slot, k when none (an eos at or past `avail` cuts nothing: take ≤ avail ≤ that slot)
        first_eos = (~is_eos(new, self.eos)).cumprod(1).sum(1)  # [R]: the leading slots without an eos
        # tokens taken per row: none on a done row, else ≥ 1 (count < limit while live)
        take = torch.minimum(torch.minimum(avail, first_eos + 1), self.limit - self.count).masked_fill_(self.done, 0)
        # all k slots are written from `count` on; only the first `take` count (the rest is scratch, rewritten by the
        # next commit; count + k ≤ N + B on every row)
        self.out.scatter_(1, self.count[:, None] + slot, new)
        hit = first_eos < take
        self.eos_hit |= hit
        self.count += take
        self.done |= hit | (self.count >= self.limit)
        # the anchor is the last committed token (a row never started: a token of the scratch, unused)
        torch.gather(self.out, 1, (self.count - 1).clamp(min=0)[:, None], out=self.anchor[:, None])
        # a row cut mid-round (eos, cap) stops at its last committed token: a + B stays inside the cache
        self.a += take

    def timed_step(self, *, speculative: bool) -> float:
        """Host wall-clock seconds of one plain step or speculative round (at the current draft
        length) on every row, from the state a `start` left (a replay where a graph was captured,
        else eager over the longest row, as `run` steps). The uniforms are drawn and the span read
        before the clock starts. For the round costs of evaluation/draft_length.py."""
        speculative = self.speculating(speculative)
        self.draw_uniforms(speculative)
        longest = int(self.a.max())  # host sync: the eager span, before the clock
        graph = self.graphs.get(SPECULATIVE if speculative else PLAIN)
        sync_device(self.device)
        t0 = time.perf_counter()
        if graph is not None:
            graph.replay()
        elif speculative:
            self.round(longest)
        else:
            self.plain_step(longest + 1)
        sync_device(self.device)
        return time.perf_counter() - t0

    def graph_steps(self) -> dict[str, Callable[[], None]]:
        """What a replay runs, per mode: `plain_step(S)` and (with a drafter, at k ≥ 1) `round(S − k − 1)`, the
        fixed spans of a static graph (captured by `capture_graphs`; tests run them eagerly as the
        graphs' CPU twin)."""
        steps = {PLAIN: lambda: self.plain_step(self.max_len)}
        if self.draft is not None and self.k > 0:
            # the drafter's block of k+1 and the verify both read span + k + 1 = S keys: a multiple of 16, no mask padding
            steps[SPECULATIVE] = lambda: self.round(self.max_len - self.k - 1)
        return steps
