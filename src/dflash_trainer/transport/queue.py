"""In-process transport: the co-located layout's target thread hands micro-batches to the drafter
thread through a bounded queue with the same interface as the P2P transport (p2p.py), so the two
role loops run unchanged in one process.

One target and one drafter: micro-batch u = step s. Credits are the same as between ranks
(transport/flow.py): the target may compute step u only when u < `granted_until`, which the drafter
advances in `open`/`release`; `finish` drains and sets `stop_from`, where the target's
`wait_credit` answers False.

Buffers and streams: the target thread runs its forward on its own CUDA stream and allocates fresh
tensors per micro-batch; `send` records an event on that stream and enqueues (batch, event). `take`
makes the drafter's current stream wait for the event and marks the tensors as used on it
(`record_stream`), so the caching allocator does not hand their memory back to the target stream
while the drafter still reads them. After `send` the batch belongs to the drafter.

Failure: `fail(exc)` (either side) wakes the other side, which raises flow.PeerFailure; every
blocking call also gives up after `timeout_s`.
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from dflash_trainer.transport.batch import TransferBatch
from dflash_trainer.transport.flow import PeerFailure, drained_steps, grant_after, initial_grants
from dflash_trainer.telemetry.rank_rates import RankTelemetry


class LocalChannel:
    """Both ends of the co-located queue (target: wait_credit/send/close; drafter: open/take/release/finish)."""

    def __init__(self, *, depth: int, total_steps: int, timeout_s: float,
                 target_telemetry: RankTelemetry | None = None, drafter_telemetry: RankTelemetry | None = None):
        if depth < 1:
            raise ValueError(f"queue_depth={depth} must be >= 1")
        self.depth, self.total_steps, self.timeout_s = depth, total_steps, timeout_s
        self.t_tel, self.d_tel = target_telemetry, drafter_telemetry
        self._cond = threading.Condition()
        self._items: collections.deque[tuple[TransferBatch, torch.cuda.Event | None]] = collections.deque()
        self._granted_until = 0  # steps < this have a credit
        self._stop_from: int | None = None
        self._failure: BaseException | None = None

    # --- shared ---
    def fail(self, exc: BaseException) -> None:
        """Record that one side failed; the other side's next (or current) wait raises PeerFailure."""
        with self._cond:
            if self._failure is None:
                self._failure = exc
            self._cond.notify_all()

    def _wait_until(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if self._failure is not None:
                raise PeerFailure(f"{what}: the other side failed ({type(self._failure).__name__}: {self._failure})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerFailure(f"{what}: nothing happened for {self.timeout_s:.0f} s")
            self._cond.wait(min(left, 1.0))

    # --- target side ---
    def wait_credit(self, unit: int) -> bool:
        t0 = time.monotonic()
        with self._cond:
            self._wait_until(lambda: unit < self._granted_until or (self._stop_from is not None and unit >= self._stop_from),
                             f"waiting for the credit of step {unit}")
            go = unit < self._granted_until and (self._stop_from is None or unit < self._stop_from)
        if self.t_tel is not None:
            self.t_tel.add_wait(time.monotonic() - t0)
        return go

    def send(self, batch: TransferBatch) -> None:
        ev = None
        if batch.features.is_cuda:
            ev = torch.cuda.Event()
            ev.record()  # on the target thread's current stream
        with self._cond:
            if self._failure is not None:
                raise PeerFailure(f"sending step {batch.step}: the other side failed ({self._failure})")
            self._items.append((batch, ev))
            self._cond.notify_all()

    def inflight(self) -> int:
        with self._cond:
            return len(self._items)

    def close(self) -> None:
        """Nothing to flush: the queue holds references, not copies."""

    # --- drafter side ---
    def open(self, first_step: int) -> None:
        grants = initial_grants(first_step, self.total_steps, self.depth)
        with self._cond:
            self._granted_until = grants.stop if len(grants) else first_step
            self._cond.notify_all()

    def arrived(self) -> int:
        with self._cond:
            return len(self._items)

    def take(self, step: int) -> TransferBatch:
        if self.d_tel is not None:
            self.d_tel.add_occupancy(self.arrived())
        t0 = time.monotonic()
        with self._cond:
            self._wait_until(lambda: bool(self._items), f"waiting for the micro-batch of step {step}")
            batch, ev = self._items.popleft()
            self._cond.notify_all()
        if self.d_tel is not None:
            self.d_tel.add_wait(time.monotonic() - t0)
        if batch.step != step:
            raise RuntimeError(f"in-process queue delivered step {batch.step}, expected {step}")
        if ev is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(ev)
            for t in (batch.ids, batch.features, batch.last_hidden):
                if t is not None:
                    t.record_stream(stream)
        return batch

    def release(self, step: int) -> None:
        nxt = grant_after(step, self.total_steps, self.depth)
        if nxt is not None:
            with self._cond:
                self._granted_until = max(self._granted_until, nxt + 1)
                self._cond.notify_all()

    def finish(self, stop_after: int) -> None:
        for s in drained_steps(stop_after, self.total_steps, self.depth):
            self.take(s)
        with self._cond:
            self._stop_from = stop_after + self.depth
            self._cond.notify_all()
