"""The device state of batched DFlash speculative decoding and one round over it (T = 0).

Shapes: R = rows, B = block size, N = max_new_tokens, S = cache slots per row (`max_len`).

A round, for every row at once (the one-sequence loop of `speculate.py`, FIELD_NOTES §2): the
drafter proposes B−1 tokens from the block [anchor, MASK × (B−1)] at the row's anchor position a;
the target verifies [anchor, drafts] at a … a+B−1 in one forward; the leading run of drafts equal
to the target's greedy tokens is accepted, plus the target's bonus token; the committed tokens stop
at the first end-of-sequence token or at N; the verified features are written to the drafter's
context cache; a advances by what was committed. Rows that are done ride along unchanged.

Every update is in place on tensors made once (no attribute is rebound) and nothing reads the
host, so on CUDA one round is captured into a `torch.cuda.CUDAGraph` and replayed: a round is a
few hundred small kernels (target layers + drafter layers), launch-bound for small models, like
the decode step of target_model/continuous.py. A graph needs static shapes, so the replayed round
attends over all S cache slots instead of the host-side bound of the eager round; slots at or
past a row's anchor are masked, so the tokens are the same (up to rounding, where a kernel sums
in another order over the longer span). Capture happens in the constructor, before any prompt is
prefilled, while every row is done: the warm-up and captured rounds commit nothing and only
write cache slots 0 … B−1, which the prefill overwrites or a later round rewrites before any
query sees them.
"""

from __future__ import annotations

import torch

from dflash_trainer.evaluation.batched_draft import BatchedDraftSession
from dflash_trainer.target_model.batched import BatchedTarget
from dflash_trainer.target_model.continuous import is_eos, rope_is_static


class SpeculativeRounds:
    """Rows of speculative decoding over a `BatchedTarget` and a `BatchedDraftSession` of the same
    R rows and max_len S = P + N + B (P = longest prompt).

    Tensors (on the device, long unless noted): anchor [R] (the last committed token), a [R] (its
    position), out [R,N+B] (committed tokens, −1 beyond count), count [R], eos_hit / done [R] bool,
    accepted [R,N] (drafts accepted in each round), rounds [R].
    cuda_graph: capture one round (CUDA, static RoPE only). Raises ValueError when the two caches
    differ in rows or length, or max_len < N + B + 1.
    """

    def __init__(self, engine: BatchedTarget, draft: BatchedDraftSession, *, block_size: int, max_new_tokens: int,
                 eos_ids: set[int], cuda_graph: bool = True):
        if (engine.rows, engine.max_len) != (draft.rows, draft.max_len):
            raise ValueError(f"target cache {engine.rows}×{engine.max_len} and drafter cache {draft.rows}×{draft.max_len} "
                             "must have the same rows and length")
        if engine.max_len < max_new_tokens + block_size + 1:
            raise ValueError(f"max_len={engine.max_len} must hold a prompt token, max_new_tokens={max_new_tokens} "
                             f"and a block of {block_size}")
        self.engine, self.draft = engine, draft
        self.B, self.max_new, self.max_len = block_size, max_new_tokens, engine.max_len
        R, dev = engine.rows, engine.device
        self.device = dev
        self.eos = torch.tensor(sorted(eos_ids), device=dev, dtype=torch.long)
        self.anchor = torch.zeros(R, dtype=torch.long, device=dev)
        self.a = torch.zeros(R, dtype=torch.long, device=dev)
        self.out = torch.full((R, max_new_tokens + block_size), -1, dtype=torch.long, device=dev)
        self.count = torch.zeros(R, dtype=torch.long, device=dev)
        self.eos_hit = torch.zeros(R, dtype=torch.bool, device=dev)
        self.done = torch.ones(R, dtype=torch.bool, device=dev)
        self.accepted = torch.zeros(R, max_new_tokens, dtype=torch.long, device=dev)
        self.rounds = torch.zeros(R, dtype=torch.long, device=dev)
        self.slot = torch.arange(block_size, device=dev)[None]  # [1,B]
        self.graph: torch.cuda.CUDAGraph | None = None
        if cuda_graph and dev.type == "cuda" and rope_is_static(engine.base):
            self.graph = self._capture()

    @torch.no_grad()
    def start(self, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prefill every row from its prompt (tokens [R,P] right-padded, lengths [R]) and reset the
        state: the target's first token anchors round 1."""
        R = self.engine.rows
        rows = torch.arange(R, device=self.device)
        logits, feats = self.engine.prefill(rows, tokens, lengths, with_features=True)
        self.draft.extend(feats, torch.zeros(R, dtype=torch.long, device=self.device))
        first = logits.argmax(-1)
        self.anchor.copy_(first)
        self.a.copy_(lengths)
        self.out.fill_(-1)
        self.out[:, 0] = first
        self.count.fill_(1)
        self.eos_hit.copy_(is_eos(first, self.eos))
        self.done.copy_(self.eos_hit | (self.count >= self.max_new))
        self.accepted.zero_()
        self.rounds.zero_()

    def round(self, span: int) -> None:
        """One round on every row, in place; span: context slots the drafter reads (≥ max(a),
        ≤ max_len − B; the target reads span + B)."""
        B, slot = self.B, self.slot
        drafts = self.draft.propose(self.anchor, self.a, span, B).argmax(-1)  # [R,B−1]
        logits, vfeats = self.engine.step(torch.cat([self.anchor[:, None], drafts], 1), self.a, span + B,
                                          with_features=True)
        pred = logits.argmax(-1)  # [R,B] the target's tokens for positions a+1 … a+B
        n = torch.cumprod((drafts == pred[:, :-1]).long(), 1).sum(1)  # [R] accepted drafts
        bonus = pred.gather(1, n[:, None])[:, 0]
        new = torch.where(slot < n[:, None], torch.cat([drafts, bonus[:, None]], 1), bonus[:, None])  # [R,B]
        eos_at = is_eos(new, self.eos) & (slot <= n[:, None])  # [R,B] committed slots holding an eos
        first_eos = torch.where(eos_at.any(1), eos_at.long().argmax(1), B)
        take = torch.minimum(torch.minimum(n + 1, first_eos + 1), self.max_new - self.count)  # tokens committed
        live = ~self.done
        write = live[:, None] & (slot < take[:, None])
        idx = self.count[:, None] + slot  # [R,B] < N + B
        self.out.scatter_(1, idx, torch.where(write, new, self.out.gather(1, idx)))
        # rounds ≤ N − 1 (each commits ≥ 1 token after the first), so a done row's write lands past its record
        self.accepted.scatter_(1, self.rounds[:, None].clamp(max=self.max_new - 1), torch.where(live, n, 0)[:, None])
        self.rounds += live.long()
        self.count += torch.where(live, take, 0)
        hit = live & (first_eos < take)
        self.eos_hit |= hit
        self.done |= hit | (self.count >= self.max_new)
        self.draft.extend(vfeats, self.a)  # positions a … a+B−1; valid up to the new anchor
        self.anchor.copy_(torch.where(live, bonus, self.anchor))
        # a row cut mid-round (eos, cap) stops at its last committed position: a.max() stays in the cache
        self.a.copy_(torch.where(live, self.a + take, self.a))

    @torch.no_grad()
    def _capture(self) -> torch.cuda.CUDAGraph:
        """Capture `round(max_len − B)` (called while every row is done; see the module docstring)."""
        span = self.max_len - self.B
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):  # lazy initialisation, cuBLAS workspaces, allocator state
                    self.round(span)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                self.round(span)
            torch.cuda.current_stream().wait_stream(stream)
        return graph

    @torch.no_grad()
    def run(self, sync_every: int = 4) -> None:
        """Rounds until every row is done. Eager: one host read per round (all done; the longest
        context, which bounds the span). Graph: `sync_every` replays between looks (extra rounds of
        finished rows change nothing)."""
        while True:
            if self.graph is not None:
                if bool(self.done.all()):  # host sync, every few rounds
                    return
                for _ in range(sync_every):
                    self.graph.replay()
                continue
            all_done, longest = torch.stack([self.done.all().long(), self.a.max()]).tolist()  # host sync
            if all_done:
                return
            self.round(int(longest))
