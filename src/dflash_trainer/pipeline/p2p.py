"""Point-to-point transport between target and drafter ranks over torch.distributed.

Two process groups span every rank: `ctl` (gloo, CPU tensors) carries credits and headers, `data`
(NCCL on GPU, gloo on CPU) carries the micro-batch tensors (pipeline/wire.py), device to device,
with no host or disk staging. Credits and stop notices follow pipeline/flow.py.

Per micro-batch u, drafter d, target t (ctl and data messages between one pair stay in order):

    drafter d                                         target t
    grant(u):  irecv header ← t        (ctl)
               isend credit [u, +1] → t (ctl) ───────▶ wait_credit(u)
                                                       forward rows of u on its stream
               wait header  ◀───────────────────────── send(u): isend header (ctl)
    take(u):   irecv ids, features ← t (data)  ◀────── isend ids, features, [last_hidden] (data)
               compute stream waits for them
    release(u): slot's last-use event; grant(u + D·M)

Who owns which buffer:
  target  the tensors of a sent micro-batch belong to the transport until their sends completed
          (`_inflight`); the target's forward allocates fresh ones, so nothing is overwritten.
  drafter D receive slots (pipeline/wire.py `allocate`), slot of step s = s mod D. A slot is the
          step's until `release(step)`, which records an event on the compute stream; the data
          receives of the slot's next step run on a side stream that first waits for that event,
          so the next transfer never overwrites data the previous step still reads, yet does not
          wait for the step being computed (NCCL would otherwise order it behind all queued work).
Data receives are posted only once the header arrived (the sender is ready), so a spinning NCCL
receive never holds SMs of a drafter that has compute to do.

Every blocking wait has a timeout (gloo `Work.wait(timeout)`; NCCL ops are bounded by the process
group timeout); any failure is raised as flow.PeerFailure naming the peer and what was awaited.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_trainer.pipeline.wire import ProtocolError, TransferBatch, WireSpec, allocate, pack_header, unpack_header
from dflash_trainer.pipeline.flow import PeerFailure, drained_steps, grant_after, initial_grants, stop_notices
from dflash_trainer.telemetry.rank_rates import RankTelemetry

TAG_CREDIT, TAG_HEADER, TAG_IDS, TAG_FEATURES, TAG_HIDDEN = 11, 12, 21, 22, 23


def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    """Block until `work` completes (host wait for gloo; stream wait for NCCL)."""
    try:
        work.wait(timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - every failure here is about a peer
        raise PeerFailure(f"{what}: {type(e).__name__}: {str(e)[:300]}") from e


def _duration_s(work: dist.Work) -> float | None:
    """Device duration of a finished NCCL op (needs TORCH_NCCL_ENABLE_TIMING=1), else None."""
    try:
        return float(work._get_duration()) / 1e3 if work.is_completed() else None
    except Exception:  # noqa: BLE001 - gloo, or timing disabled
        return None


class TargetOutbox:
    """Target side: wait for credits, send micro-batches. One instance per target rank."""

    def __init__(self, spec: WireSpec, *, drafter_rank_of: Callable[[int], int], data_group, ctl_group,
                 timeout_s: float, telemetry: RankTelemetry, max_inflight: int):
        self.spec, self.drafter_rank_of = spec, drafter_rank_of
        self.data_group, self.ctl_group, self.timeout_s = data_group, ctl_group, timeout_s
        self.telemetry = telemetry
        self.max_inflight = max(1, max_inflight)
        # (works, tensors kept alive until the works complete), oldest first
        self._inflight: deque[tuple[list[dist.Work], list[torch.Tensor]]] = deque()

    def wait_credit(self, unit: int) -> bool:
        """Block for micro-batch `unit`'s credit: True = compute and send it, False = stop here."""
        src = self.drafter_rank_of(unit)
        buf = torch.zeros(2, dtype=torch.int64)
        t0 = time.monotonic()
        work = dist.irecv(buf, src=src, group=self.ctl_group, tag=TAG_CREDIT)
        _wait(work, self.timeout_s, f"waiting for the credit of micro-batch {unit} from drafter rank {src}")
        self.telemetry.add_wait(time.monotonic() - t0)
        u, value = buf.tolist()
        if u != unit:
            raise ProtocolError(f"drafter rank {src} sent a credit for micro-batch {u}, expected {unit}")
        self._reap(block=False)
        return value > 0

    def send(self, batch: TransferBatch) -> None:
        """Send `batch` to its drafter (asynchronous; tensors stay referenced until sent)."""
        dst = self.drafter_rank_of(batch.unit)
        header = pack_header(batch, self.spec)
        tensors = [header, batch.ids, batch.features]
        works = [dist.isend(header, dst=dst, group=self.ctl_group, tag=TAG_HEADER),
                 dist.isend(batch.ids, dst=dst, group=self.data_group, tag=TAG_IDS),
                 dist.isend(batch.features, dst=dst, group=self.data_group, tag=TAG_FEATURES)]
        if self.spec.need_last_hidden:
            assert batch.last_hidden is not None
            tensors.append(batch.last_hidden)
            works.append(dist.isend(batch.last_hidden, dst=dst, group=self.data_group, tag=TAG_HIDDEN))
        self._inflight.append((works, tensors))
        self._reap(block=len(self._inflight) > self.max_inflight)

    def inflight(self) -> int:
        return len(self._inflight)

    def _reap(self, block: bool) -> None:
        while self._inflight:
            works, _ = self._inflight[0]
            if block:
                for w in works:
                    _wait(w, self.timeout_s, "sending a micro-batch")
                block = len(self._inflight) - 1 > self.max_inflight
            elif not all(w.is_completed() for w in works):
                return
            # NCCL: device time of the data sends. gloo has no op timing, and host time here would be
            # queueing, not transfer: the drafter side measures gloo transfers (its blocking receives).
            durations = [_duration_s(w) for w in works[1:]]
            if all(d is not None for d in durations):
                self.telemetry.add_transfer(sum(durations))  # type: ignore[arg-type]
            self._inflight.popleft()

    def close(self) -> None:
        """Wait until every send has completed (on GPU: until the copies left this device)."""
        for works, _ in self._inflight:
            for w in works:
                _wait(w, self.timeout_s, "finishing the last sends")
        if torch.cuda.is_available() and any(t.is_cuda for _, ts in self._inflight for t in ts):
            torch.cuda.current_stream().synchronize()
        self._reap(block=False)
        self._inflight.clear()


class DrafterInbox:
    """Drafter side: D receive slots, credits, headers, drain and stop notices."""

    def __init__(self, spec: WireSpec, *, drafter_index: int, num_drafters: int, num_targets: int,
                 target_rank_of: Callable[[int], int], first_unit_of_target: Callable[[int, int, int], int | None],
                 device: torch.device, data_group, ctl_group,
                 depth: int, total_steps: int, timeout_s: float, telemetry: RankTelemetry):
        if depth < 1:
            raise ValueError(f"queue_depth={depth} must be >= 1")
        self.spec, self.d, self.m, self.n = spec, drafter_index, num_drafters, num_targets
        self.target_rank_of, self.first_unit_of_target, self.device = target_rank_of, first_unit_of_target, device
        self.data_group, self.ctl_group = data_group, ctl_group
        self.depth, self.total_steps, self.timeout_s, self.telemetry = depth, total_steps, timeout_s, telemetry
        self.slots = [allocate(spec, device) for _ in range(depth)]
        self._headers = [torch.zeros(spec.header_numel, dtype=torch.int64) for _ in range(depth)]
        self._header_work: dict[int, dist.Work] = {}  # step → pending header receive
        self._data_work: dict[int, list[dist.Work]] = {}  # step → data receives (until released)
        self._credit_sends: deque[tuple[dist.Work, torch.Tensor]] = deque()
        cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device=device) if cuda else None
        self._slot_free: list[torch.cuda.Event | None] = [None] * depth

    def unit(self, step: int) -> int:
        return step * self.m + self.d

    def open(self, first_step: int) -> None:
        """Grant the first D steps."""
        for s in initial_grants(first_step, self.total_steps, self.depth):
            self._grant(s)

    def _grant(self, step: int) -> None:
        k, u = step % self.depth, self.unit(step)
        src = self.target_rank_of(u)
        self._header_work[step] = dist.irecv(self._headers[k], src=src, group=self.ctl_group, tag=TAG_HEADER)
        self._send_credit(u, src, +1)

    def _send_credit(self, unit: int, dst: int, value: int) -> None:
        buf = torch.tensor([unit, value], dtype=torch.int64)
        self._credit_sends.append((dist.isend(buf, dst=dst, group=self.ctl_group, tag=TAG_CREDIT), buf))
        while self._credit_sends and self._credit_sends[0][0].is_completed():
            self._credit_sends.popleft()

    def arrived(self) -> int:
        """Granted micro-batches whose header is already here (queue occupancy, no blocking)."""
        return sum(1 for w in self._header_work.values() if w.is_completed())

    def take(self, step: int) -> TransferBatch:
        """The micro-batch of `step`: waits for its header, then receives its tensors into the step's slot.

        On CUDA the returned tensors are ready for the current stream (it waits for the receives).
        """
        k, u = step % self.depth, self.unit(step)
        src = self.target_rank_of(u)
        self.telemetry.add_occupancy(self.arrived())
        t0 = time.monotonic()
        _wait(self._header_work.pop(step), self.timeout_s,
              f"waiting for the header of micro-batch {u} (step {step}) from target rank {src}")
        t1 = time.monotonic()
        self.telemetry.add_wait(t1 - t0)
        epoch, row_index, zero = unpack_header(self._headers[k], self.spec, unit=u, step=step, src=src)
        slot = self.slots[k]
        slot.unit, slot.step, slot.epoch, slot.row_index, slot.zero_features = u, step, epoch, row_index, zero
        parts = [(slot.ids, TAG_IDS), (slot.features, TAG_FEATURES)]
        if self.spec.need_last_hidden:
            parts.append((slot.last_hidden, TAG_HIDDEN))
        if self._side is not None:
            with torch.cuda.stream(self._side):
                if self._slot_free[k] is not None:
                    self._side.wait_event(self._slot_free[k])
                works = [dist.irecv(t, src=src, group=self.data_group, tag=tag) for t, tag in parts]
        else:
            works = [dist.irecv(t, src=src, group=self.data_group, tag=tag) for t, tag in parts]
        for w in works:
            _wait(w, self.timeout_s, f"receiving micro-batch {u} (step {step}) from target rank {src}")
        if self._side is None:
            self.telemetry.add_transfer(time.monotonic() - t1)
        self._data_work[step] = works
        return slot

    def release(self, step: int) -> None:
        """The step's compute is enqueued: free its slot (after that compute) and grant step + D."""
        k = step % self.depth
        if self._side is not None:
            ev = torch.cuda.Event()
            ev.record()
            self._slot_free[k] = ev
        for w in self._data_work.pop(step, []):
            d = _duration_s(w)
            if d is not None:
                self.telemetry.add_transfer(d)
        nxt = grant_after(step, self.total_steps, self.depth)
        if nxt is not None:
            self._grant(nxt)

    def finish(self, stop_after: int) -> None:
        """End after step `stop_after`: drain what was granted beyond it, send the stop notices, and
        wait until every credit was received."""
        for s in drained_steps(stop_after, self.total_steps, self.depth):
            self.take(s)
            self.release_without_grant(s)
        for u in stop_notices(stop_after, self.total_steps, self.depth, self.n, self.first_unit_of_target).values():
            if u % self.m == self.d:
                self._send_credit(u, self.target_rank_of(u), -1)
        for w, _ in self._credit_sends:
            _wait(w, self.timeout_s, "waiting for the targets to take their last credits")
        self._credit_sends.clear()
        if self._side is not None:
            self._side.synchronize()

    def release_without_grant(self, step: int) -> None:
        self._data_work.pop(step, None)
