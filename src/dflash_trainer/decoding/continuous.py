"""Continuous batching: the target generates for many prompts at once, refilling rows as they finish.

Shapes: R = rows (`slots`), S = cache slots per row (`max_len` = longest prompt + new tokens),
N = max_new_tokens, V = vocabulary.

Every row of a `BatchedTarget` holds one sequence. A prompt waits in a queue until a row is free;
free rows are filled by one batched prefill (prompts sorted by length, grouped under a token
budget), then every row advances one token per forward. Decoding state (last token, position,
count, done flag, output tokens) stays on the device; the host looks every `sync_every` steps,
hands out the finished sequences and refills their rows. Rows that finished between two looks
keep stepping on frozen positions and are ignored, so at most `sync_every` wasted steps per
sequence. With `overlap` (the default on CUDA) each `poll` launches the next
`sync_every` steps before it returns, so the caller's work on the finished sequences overlaps the
device's decoding (the stretch is collected by the next `poll`). A freed row is refilled at once
from the prompts already queued; a prompt submitted after a `poll` (e.g. the next turn of the
conversation that just finished) waits for the next one, so with no prompt queued a freed row
idles up to 2 × `sync_every` steps: keep more prompts submitted than rows (data/regenerate.py
does, with `overlap`).

Greedy at temperature 0 (each sequence's output equals one-sequence greedy decoding, checked in
tests/unit/test_continuous.py); sampling at T > 0 draws from softmax(logits / T), optionally
within the top-p nucleus, by inverse CDF (decoding/sampling.py) with one uniform per row and
step, drawn by the host from the given generator before each stretch of `sync_every` steps. A
sequence ends at its first end-of-sequence token (kept in the output, `finished` True), after N
tokens (`finished` False), or, with the loop guard (`loop_ngram`), once its last `loop_ngram`
tokens repeat an earlier stretch of its own output (`looped` True, checked every `sync_every`
steps); rows hold max_prompt_tokens + N slots, so a row never fills up first.

CUDA graph (cuda_graph=True, on CUDA, greedy or sampled): one decode step is L layers × a few dozen small
kernels, so for a small target eager PyTorch is bound by kernel launches, not by the GPU (H200,
SmolLM2-shaped, 512 rows: 83 ms eager, 20.5 ms replayed). The whole device part of a
step (the forward, argmax, and the updates of tok / pos / count / out / eos_hit / done) is then
captured once into a `torch.cuda.CUDAGraph` and replayed, one launch per step. A graph needs
static shapes, so with the shared span (row attention off: its default off CUDA, or a target its
kernel does not take) one graph is captured per span of a ladder (256, 512, 768, … slots, then
max_len; all sharing one memory pool) and each step replays the smallest span that covers every
occupied row's position (a host-side bound, no sync): short sequences do not pay for attention
over all S slots. Slots past a row's position are masked, so the tokens are those of the eager
step (up to rounding, where a kernel sums in another order over a longer span). Sampling reads
its uniforms from a persistent buffer indexed by an on-device step counter, so replays draw
fresh numbers without any RNG call inside the graph. Every state update is in place on the
persistent tensors, so the addresses baked into the graph stay valid; prefill (`_refill`) writes
into the same tensors eagerly between replays. Capture happens in the constructor, while every
row is done and free: live is all False, so the warm-up runs and the capture change no state,
only the cache slot at each row's position (0), which prefill overwrites and which no sequence
sees before it is rewritten. Not for RoPE types that rebuild their tables after a host-side look at
the positions ("dynamic").
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from dflash_trainer.decoding.batched import PREFILL_TOKENS, BatchedTarget, prefill_groups, right_padded, rope_is_static
from dflash_trainer.decoding.gen_counts import GenerationCounts
from dflash_trainer.decoding.row_attention import row_kernel_runs
from dflash_trainer.target_model.load import TargetBundle
from dflash_trainer.decoding.sampling import check_sampling, pick_tokens, repeated_tail

SPAN_STEP = 256  # captured spans are multiples of this many cache slots, up to max_len


def is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """bool, tokens' shape: which tokens (any long tensor) are one of `eos` [E]. Compared with == rather
    than torch.isin, which sorts (and syncs the host) for larger sets: safe inside a CUDA graph."""
    return (tokens[..., None] == eos).any(-1)


@torch.no_grad()
def capture_graphs(device: torch.device, steps: dict[Any, Callable[[], None]], *, warmups: int,
                   reset: Callable[[], Any]) -> dict[Any, torch.cuda.CUDAGraph]:
    """One `torch.cuda.CUDAGraph` per entry of `steps` (key → a step that only updates tensors in
    place), all in one memory pool (they never run at once). Each step first runs `warmups` times
    on a side stream (lazy initialisation, cuBLAS workspaces and allocator state stay out of the
    graphs), then is captured on that stream; `reset` (e.g. a step counter's `zero_`) runs after
    every warm-up and once at the end, undoing what the warm-ups and captures advanced."""
    graphs = {}
    with torch.cuda.device(device):
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for key, step in steps.items():
            with torch.cuda.stream(stream):
                for _ in range(warmups):
                    step()
                    reset()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                step()
            torch.cuda.current_stream().wait_stream(stream)
            graphs[key] = graph
        reset()
    return graphs


@dataclass
class Finished:
    """One generated continuation: the caller's key, new tokens (eos kept when hit), whether it
    ended with an end-of-sequence token, an error reason ("prompt_too_long", "empty_prompt") or
    None, and whether the loop guard stopped it (`looped`; then `finished` is False)."""

    key: Any
    tokens: list[int]
    finished: bool
    error: str | None = None
    looped: bool = False


class ContinuousGenerator:
    """Generate for a stream of prompts with `slots` rows (see the module docstring).

    `submit(key, prompt)` queues a prompt; `poll()` hands back the sequences the last stretch of steps
    finished and starts the next stretch; `busy` says whether anything is queued or running.
    prefill_tokens bounds rows × prompt length of one prefill forward. temperature / top_p: sampling
    (module docstring; generator: the source of the uniforms, on the target's device; None = a fresh
    one seeded 0). loop_ngram: stop a sequence whose last loop_ngram tokens occurred earlier in its
    output (None = no loop guard). shortest_first: free rows take the shortest waiting prompts instead
    of the oldest (with more prompts queued than rows, the rows in flight then hold prompts of similar
    length, so the attended span stays short; long prompts wait until the short ones are done).
    cuda_graph: replay the decode step from CUDA graphs when the target is on CUDA (module docstring);
    the eager step otherwise. overlap: `poll` returns while its stretch of steps runs, the stretch
    collected by the next call (on the CPU nothing runs beside the host, and a multi-turn record's
    next turn would only start one stretch later; None = on CUDA only). row_attention: each decode step
    attends every row's own slots only (its window, or 0 … its position; decoding/row_attention.py, a
    Triton kernel on CUDA), not the span of the longest row; one CUDA graph then serves every step
    (None = where the kernel runs: `row_kernel_runs`; docs/data.md has the measured rates). Raises
    ValueError for bad sizes, bad sampling settings or an empty eos set.
    """

    def __init__(self, target: TargetBundle, *, slots: int, max_prompt_tokens: int, max_new_tokens: int,
                 eos_ids: set[int], temperature: float = 0.0, generator: torch.Generator | None = None,
                 top_p: float = 1.0, loop_ngram: int | None = None, shortest_first: bool = False,
                 sync_every: int = 16, prefill_tokens: int = PREFILL_TOKENS, cuda_graph: bool = True,
                 overlap: bool | None = None, row_attention: bool | None = None):
        if slots < 1 or max_new_tokens < 1 or max_prompt_tokens < 1:
            raise ValueError(f"slots={slots}, max_new_tokens={max_new_tokens}, max_prompt_tokens={max_prompt_tokens}: "
                             "each must be >= 1")
        if not eos_ids:
            raise ValueError("eos_ids is empty: generation needs an end-of-sequence token")
        check_sampling(temperature, top_p)
        if loop_ngram is not None and loop_ngram < 1:
            raise ValueError(f"loop_ngram={loop_ngram}: must be >= 1 (None = no loop guard)")
        self.target = target
        self.max_new, self.max_prompt = max_new_tokens, max_prompt_tokens
        self.max_len = max_prompt_tokens + max_new_tokens
        self.engine = BatchedTarget(target, rows=slots, max_len=self.max_len)
        self.device = self.engine.device
        self.temperature, self.top_p, self.loop_ngram = temperature, top_p, loop_ngram
        self.shortest_first = shortest_first
        if generator is None and temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(0)
        self.generator = generator
        self.sync_every, self.prefill_tokens = sync_every, prefill_tokens
        self.eos = torch.tensor(sorted(eos_ids), device=self.device, dtype=torch.long)
        R = slots
        self.tok = torch.zeros(R, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(R, dtype=torch.long, device=self.device)  # position of `tok` = cached length
        self.count = torch.zeros(R, dtype=torch.long, device=self.device)
        self.done = torch.ones(R, dtype=torch.bool, device=self.device)
        self.eos_hit = torch.zeros(R, dtype=torch.bool, device=self.device)
        self.loop_hit = torch.zeros(R, dtype=torch.bool, device=self.device)
        self.out = torch.zeros(R, max_new_tokens, dtype=torch.long, device=self.device)
        # sampling: one uniform per row and step, refilled by the host before each stretch of steps;
        # `t` (on the device) says which line the next step reads
        self.noise = torch.zeros(sync_every, R, dtype=torch.float32, device=self.device)
        self.t = torch.zeros((), dtype=torch.long, device=self.device)
        self.keys: list[Any] = [None] * R  # host: the key a row serves, None = free
        self.bound = [0] * R  # host: upper bound of each row's position (the eager step's span)
        self.started = [0] * R  # host: decode step at which each row's sequence was prefilled (telemetry)
        self.prompt_len = [0] * R  # host: each row's prompt length (telemetry)
        self.queue: deque[tuple[Any, list[int], int]] = deque()  # (key, prompt, decode step when queued)
        self.rejected: list[Finished] = []
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.in_flight = False  # a stretch launched by the last `poll` whose results are not collected yet
        self.launched: torch.cuda.Event | None = None  # recorded after the stretch's last step (CUDA)
        self.wait_s = 0.0  # host time blocked waiting for launched stretches (counts.device_wait_ms, rounded)
        self.counts = GenerationCounts()  # occupancy, span efficiency, queue waits (gen_counts.py)
        self.row_attention = (row_kernel_runs(self.engine.head_dim, self.device, self.engine.dtype)
                              if row_attention is None else row_attention)
        self.spans = [self.max_len] if self.row_attention else span_ladder(self.max_len)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if cuda_graph and self.device.type == "cuda" and rope_is_static(self.engine.base):
            self.graphs = capture_graphs(self.device, {s: partial(self._advance, s) for s in self.spans},
                                         warmups=2, reset=self.t.zero_)

    @property
    def busy(self) -> bool:
        """Anything queued, running, or finished and not yet handed back."""
        return bool(self.queue) or any(k is not None for k in self.keys) or bool(self.rejected)

    def submit(self, key: Any, prompt: list[int]) -> None:
        """Queue one prompt (token ids). A prompt longer than max_prompt_tokens comes back from
        `poll` as Finished(error="prompt_too_long") without running."""
        if not prompt or len(prompt) > self.max_prompt:
            self.rejected.append(Finished(key, [], False, "prompt_too_long" if prompt else "empty_prompt"))
        else:
            self.queue.append((key, list(prompt), self.steps))

    @property
    def steps(self) -> int:
        """Decode forwards run so far (telemetry: `counts.decode_steps`)."""
        return self.counts.decode_steps

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The widest captured step graph (None on the eager path)."""
        return self.graphs.get(self.max_len)

    def _uniforms(self, n: int) -> torch.Tensor | None:
        """n fresh uniforms from the generator (None when greedy)."""
        if self.temperature <= 0:
            return None
        return torch.rand(n, generator=self.generator, device=self.device)

    def _refill(self) -> None:
        free = [r for r, k in enumerate(self.keys) if k is None]
        take = min(len(free), len(self.queue))
        if self.shortest_first and take < len(self.queue):  # the `take` shortest; the rest keep their order
            order = sorted(range(len(self.queue)), key=lambda i: len(self.queue[i][1]))
            chosen = set(order[:take])
            jobs = [j for i, j in enumerate(self.queue) if i in chosen]
            self.queue = deque(j for i, j in enumerate(self.queue) if i not in chosen)
        else:
            jobs = [self.queue.popleft() for _ in range(take)]
        jobs.sort(key=lambda j: len(j[1]))
        for _, _, queued_at in jobs:
            self.counts.waited(self.steps - queued_at)
        for i, j in prefill_groups([len(p) for _, p, _ in jobs], self.prefill_tokens):
            group, rows = jobs[i:j], free[i:j]
            toks, lengths = right_padded([p for _, p, _ in group], self.device)
            self.counts.prefill(len(group), max(len(p) for _, p, _ in group))
            rows_t = torch.tensor(rows).to(self.device)
            logits, _ = self.engine.prefill(rows_t, toks, lengths)
            first = pick_tokens(logits, self.temperature, self.top_p, self._uniforms(len(rows)))
            self.tok[rows_t] = first
            self.pos[rows_t] = lengths
            self.count[rows_t] = 1
            self.out[rows_t, 0] = first
            self.eos_hit[rows_t] = is_eos(first, self.eos)
            self.loop_hit[rows_t] = False
            self.done[rows_t] = self.eos_hit[rows_t] | (self.max_new <= 1)
            for (key, p, _), r in zip(group, rows):
                self.keys[r], self.bound[r] = key, len(p)
                self.started[r], self.prompt_len[r] = self.steps, len(p)

    def _advance(self, span: int) -> None:
        """The device part of one decode step: forward over `span` slots, pick, update the state.

        Every update is in place (no attribute is rebound) and nothing syncs the host, so this is
        what the CUDA graph captures. Rows that are done keep their state (frozen position).
        """
        logits, _ = self.engine.step(self.tok[:, None], self.pos, span, all_logits=False,
                                     row_attention=self.row_attention)
        live = ~self.done
        # rows that are done or free may attend to nothing valid (a frozen position past a sliding
        # window): their logits are zeroed so sampling never sees NaN; their picks are discarded
        u = self.noise.index_select(0, self.t.view(1))[0] if self.temperature > 0 else None  # [R]
        new = pick_tokens(torch.where(live[:, None], logits, 0.0), self.temperature, self.top_p, u)
        self.t += 1
        idx = self.count.clamp(max=self.max_new - 1)[:, None]
        self.out.scatter_(1, idx, torch.where(live, new, self.out.gather(1, idx)[:, 0])[:, None])
        self.count += live.long()
        self.pos += live.long()
        hit = live & is_eos(new, self.eos)
        self.eos_hit |= hit
        self.done |= hit | (self.count >= self.max_new) | (self.pos >= self.max_len - 1)
        self.tok.copy_(torch.where(live, new, self.tok))

    def _span(self, live_bounds: list[int]) -> tuple[int, int]:
        """(exact, ladder) cache slots the next step must attend: the host-side bound of every
        occupied row's position (`live_bounds`) + 1, and that rounded up to the span ladder."""
        need = min(max(live_bounds, default=0) + 1, self.max_len)
        return need, next(s for s in self.spans if s >= need)

    def _step(self) -> None:
        live_bounds = [b for b, k in zip(self.bound, self.keys) if k is not None]
        need, span = self._span(live_bounds)
        if self.row_attention:  # each row its own slots: a serving row bound + 1, a free one 1 (position 0);
            # counted as in a full-attention layer (a sliding layer reads at most its window)
            own = sum(live_bounds) + len(self.keys)
            self.counts.step(len(self.keys), live_bounds, span, attended_slots=own)
        else:
            self.counts.step(len(self.keys), live_bounds, span, attended=span if self.graphs else need)
        if self.graphs:
            self.graphs[span].replay()
        else:
            self._advance(need)
        self.bound = [min(b + 1, self.max_len - 1) if k is not None else b for b, k in zip(self.bound, self.keys)]

    @torch.no_grad()
    def poll(self) -> list[Finished]:
        """Collect the sequences that the stretch launched by the previous call finished, refill the free
        rows, and launch the next stretch of `sync_every` decode steps without waiting for it; returns
        the finished sequences (possibly none while others run; [] when nothing is left).

        The stretch runs on the device while the caller works on what this call returned (detokenizing,
        rendering the next turns of multi-turn records, writing records), so that host work no longer
        leaves the device idle between stretches. A finished row is refilled from the queue at once; a
        prompt submitted after this call starts at the next one. With `overlap` False (the default on the CPU) the
        call waits for its stretch and returns what it finished."""
        results, self.rejected = self.rejected, []
        if self.in_flight:
            results += self._collect()
            self.in_flight = False
        self._refill()
        if any(k is not None for k in self.keys):
            self._launch()
            self.in_flight = True
            if not self.overlap:  # wait for it here
                results += self._collect()
                self.in_flight = False
        return results

    def _launch(self) -> None:
        """Queue `sync_every` decode steps and the loop guard on the device; no host sync."""
        if self.temperature > 0:  # this stretch's uniforms, drawn in one call
            torch.rand(self.noise.shape, generator=self.generator, device=self.device, out=self.noise)
            self.t.zero_()
        for _ in range(self.sync_every):
            self._step()
        if self.loop_ngram:
            looped = ~self.done & repeated_tail(self.out, self.count, self.loop_ngram)
            self.loop_hit |= looped
            self.done |= looped
        if self.device.type == "cuda":  # the collect waits for this event, whatever stream the caller is on then
            self.launched = torch.cuda.Event()
            self.launched.record()

    def _collect(self) -> list[Finished]:
        """Wait for the launched stretch (the one host sync on CUDA, timed into `device_wait_ms`), hand
        out the sequences that ended and free their rows."""
        results = []
        occupied = [r for r, k in enumerate(self.keys) if k is not None]
        if self.launched is not None:
            t0 = time.perf_counter()
            self.launched.synchronize()
            self.wait_s += time.perf_counter() - t0
            self.counts.device_wait_ms = round(1000 * self.wait_s)
            self.launched = None
        done, count, hit, loop = (t.tolist() for t in (self.done, self.count, self.eos_hit, self.loop_hit))
        ended = [r for r in occupied if done[r]]
        if ended:
            ended_t = torch.tensor(ended, device=self.device)
            rows = self.out[ended_t].tolist()
            for r, toks in zip(ended, rows):
                results.append(Finished(self.keys[r], toks[:count[r]], bool(hit[r]), looped=bool(loop[r])))
                self.keys[r] = None
                # it generated count - 1 tokens after prefill, one per live step; the steps after that it sat done
                first, end = self.started[r] + count[r] - 1, self.steps
                self.counts.unlive([min(self.prompt_len[r] + i - self.started[r], self.max_len - 1)
                                    for i in range(first, end)])
            # A free row keeps stepping (done) at its position; back at 0 it stays inside any span, so a
            # sliding-window layer always sees a key there (a row left past the span would attend to
            # nothing, write NaN keys into its cache and poison the next sequence of that row).
            self.pos[ended_t] = 0
        return results


def span_ladder(max_len: int) -> list[int]:
    """Spans captured as CUDA graphs: the multiples of SPAN_STEP below max_len, then max_len."""
    return list(range(SPAN_STEP, max_len, SPAN_STEP)) + [max_len]


def generate_all(gen: Any, prompts: list[list[int]]) -> list[Finished]:
    """Submit every prompt to `gen` (ContinuousGenerator or HFGenerator), poll until it is idle;
    the Finished results in prompt order."""
    for i, p in enumerate(prompts):
        gen.submit(i, p)
    done: dict[int, Finished] = {}
    while gen.busy:
        done.update((f.key, f) for f in gen.poll())
    return [done[i] for i in range(len(prompts))]

