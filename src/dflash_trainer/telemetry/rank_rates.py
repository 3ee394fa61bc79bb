"""Per-rank pipeline telemetry: tokens/s, queue occupancy, time waiting for data, transfer time,
GPU-busy %; published through the store and aggregated on the logging rank.

Definitions (all counters cumulative since the rank started its loop; rates come from the
difference of two snapshots):
  tokens        context tokens of valid rows this rank finished (target: sent; drafter: trained)
  wait_s        host seconds blocked on the other side: a target waiting for a credit (the drafter
                is behind), a drafter waiting for a header (the targets are behind)
  transfer_s    seconds moving micro-batches: NCCL op durations when available
                (TORCH_NCCL_ENABLE_TIMING), else host time blocked in data receives/sends
  occupancy     a drafter's received-but-untrained micro-batches at the start of each step
                (0 = starved, D = full), averaged; a target's sends in flight
  busy_pct      GPU time inside this rank's work items over the GPU time span they cover (CUDA
                events on the compute stream: host gaps between items and waits for data count as
                idle); nvml_util_pct is NVML's own utilization sampled every 0.2 s, when available
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch


class GpuBusyMeter:
    """Busy fraction of one CUDA stream from events recorded around each work item (no host sync:
    finished event pairs are read lazily with `query()`)."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._open: torch.cuda.Event | None = None
        self._first: torch.cuda.Event | None = None
        self._last: torch.cuda.Event | None = None
        self.busy_ms = 0.0
        self.span_ms = 0.0

    def start(self) -> None:
        if self.enabled:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()

    def stop(self) -> None:
        if self.enabled and self._open is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._open, end))
            self._open = None
            self.poll()

    def poll(self) -> None:
        """Fold in every finished item (events are only read after `query()` says they completed)."""
        while self._pending and self._pending[0][1].query():
            s, e = self._pending.popleft()
            self.busy_ms += s.elapsed_time(e)
            if self._first is None:
                self._first = s
            self._last = e
            self.span_ms = self._first.elapsed_time(self._last)



class NvmlSampler(threading.Thread):
    """Samples NVML GPU utilization of one device every `period_s` (silently absent without pynvml)."""

    def __init__(self, device: torch.device, period_s: float = 0.2):
        super().__init__(name="dflash-nvml", daemon=True)
        self.period_s = period_s
        self.samples = 0
        self.total = 0.0
        self._done = threading.Event()
        self._handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            idx = device.index if device.index is not None else torch.cuda.current_device()
            # NVML numbers physical devices; CUDA numbers visible ones: match them by PCI address.
            try:
                props = torch.cuda.get_device_properties(idx)
                bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                self._handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
            except Exception:  # noqa: BLE001 - no PCI fields or older bindings: trust the index
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(idx)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - NVML missing or not permitted: report nothing
            self._handle = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def run(self) -> None:
        while self._handle is not None and not self._done.wait(self.period_s):
            try:
                self.total += float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                self.samples += 1
            except Exception:  # noqa: BLE001
                return

    def close(self) -> None:
        self._done.set()


class RankTelemetry:
    """Counters of one rank; `snapshot()` is what the watchdog publishes."""

    def __init__(self, rank: int, role: str, device: torch.device):
        self.rank, self.role, self.device = rank, role, str(device)
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self.items = 0
        self.tokens = 0
        self.wait_s = 0.0
        self.transfer_s = 0.0
        self.occupancy_sum = 0.0
        self.occupancy_n = 0
        self.busy = GpuBusyMeter(device)
        self.nvml = NvmlSampler(device)
        if self.nvml.available:
            self.nvml.start()

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self.wait_s += seconds

    def add_transfer(self, seconds: float) -> None:
        with self._lock:
            self.transfer_s += seconds

    def add_occupancy(self, n: int) -> None:
        with self._lock:
            self.occupancy_sum += n
            self.occupancy_n += 1

    def finish_item(self, tokens: int) -> None:
        with self._lock:
            self.items += 1
            self.tokens += tokens

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            snap = {"rank": self.rank, "role": self.role, "device": self.device,
                    "elapsed_s": time.monotonic() - self.t0, "items": self.items, "tokens": self.tokens,
                    "wait_s": self.wait_s, "transfer_s": self.transfer_s,
                    "occupancy_sum": self.occupancy_sum, "occupancy_n": self.occupancy_n}
        # Events are polled by the main thread only (it owns the deque): the values published are the
        # last ones it folded in.
        snap.update(busy_ms=self.busy.busy_ms, span_ms=self.busy.span_ms, nvml_sum=self.nvml.total,
                    nvml_samples=self.nvml.samples)
        return snap

    def close(self) -> None:
        self.nvml.close()


def rates(prev: dict[str, Any] | None, cur: dict[str, Any]) -> dict[str, Any]:
    """Per-interval view of one rank from two snapshots (or since the start when prev is None)."""
    p = prev or {"elapsed_s": 0.0, "tokens": 0, "wait_s": 0.0, "transfer_s": 0.0, "items": 0, "busy_ms": 0.0,
                 "span_ms": 0.0, "nvml_sum": 0.0, "nvml_samples": 0, "occupancy_sum": 0.0,
                 "occupancy_n": 0}
    dt = max(cur["elapsed_s"] - p["elapsed_s"], 1e-9)
    span = cur["span_ms"] - p["span_ms"]
    n_nvml = cur["nvml_samples"] - p["nvml_samples"]
    n_occ = cur["occupancy_n"] - p["occupancy_n"]
    return {"rank": cur["rank"], "role": cur["role"], "device": cur["device"], "seconds": dt,
            "tok_per_s": (cur["tokens"] - p["tokens"]) / dt, "items": cur["items"] - p["items"],
            "wait_pct": 100.0 * (cur["wait_s"] - p["wait_s"]) / dt,
            "transfer_pct": 100.0 * (cur["transfer_s"] - p["transfer_s"]) / dt,
            "occupancy_mean": (cur["occupancy_sum"] - p["occupancy_sum"]) / n_occ if n_occ > 0 else None,
            "busy_pct": 100.0 * (cur["busy_ms"] - p["busy_ms"]) / span if span > 0 else None,
            "nvml_util_pct": (cur["nvml_sum"] - p["nvml_sum"]) / n_nvml if n_nvml > 0 else None}


def format_line(rows: list[dict[str, Any]]) -> str:
    """One compact line: per rank role/tok-s/wait/queue/busy."""

    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    parts = []
    for r in rows:
        tag = "T" if r["role"] == "target" else "D"
        parts.append(f"{tag}{r['rank']} {f(r['tok_per_s'], ',.0f')} tok/s wait {f(r['wait_pct'], '.0f')}% "
                     f"xfer {f(r['transfer_pct'], '.1f')}% q {f(r['occupancy_mean'], '.1f')} busy {f(r['busy_pct'], '.0f')}%")
    return " | ".join(parts)
