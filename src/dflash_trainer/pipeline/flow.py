"""Flow control and shutdown: credits, the stop protocol, failure reports, the watchdog.

Symbols: N targets, M drafters, D = queue depth, s = step, u = micro-batch (see pipeline/layout.py).

Credits (backpressure). A drafter owns D receive slots. Before step s it has posted the receives
of its micro-batches of steps [s, s + D) and sent one credit [u, +1] per posted micro-batch to the
target that computes it. A target computes micro-batch u only after it holds u's credit, so no
target is ever more than D of a drafter's micro-batches ahead of that drafter, and every send lands
in a receive that is already posted. After the drafter has enqueued step s it reuses step s's
slot for step s + D (`grant_after`).

Stop. Drafters agree (one all-reduce of a flag per step) to stop after step s*. Everything granted
was then for steps ≤ s* + D − 1: those micro-batches still arrive and are drained unread. Each
target t then waits for the credit of its first micro-batch that was never granted; the drafter of
that micro-batch sends [u, −1] instead (`stop_notices`), and the target ends. The normal end of
a run is the same with s* = last step: nothing to drain, no notices. No message is left unmatched.

Failures. Every rank writes what went wrong to the rendezvous store (`FailureBoard`) and sets the
`abort` key; a watchdog thread in every rank polls that key (and its own progress) and ends the
process with `os._exit(1)` within about a second, even when the main thread is blocked inside a
collective. The launcher (or torchrun's agent) holds the store, so it survives any rank. The
original error is the earliest report of a rank's own exception, else the earliest death, else the
earliest peer failure (`choose_original`); it is printed once.

Store keys (under a "dflash/" prefix): abort, stop, error_seq, error/<rank>, telemetry/<rank>,
pid/<rank>, and whatever the pipeline publishes (run_info, final/<rank>).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_trainer.training.signals import StopRequest

# ----------------------------------------------------------------------------------------------
# Credits


def initial_grants(first_step: int, total_steps: int, depth: int) -> range:
    """Steps a drafter grants before its first step."""
    return range(first_step, min(first_step + depth, total_steps))


def grant_after(step: int, total_steps: int, depth: int) -> int | None:
    """The step whose slot opens once `step` is enqueued (None past the end)."""
    nxt = step + depth
    return nxt if nxt < total_steps else None


def drained_steps(stop_after: int, total_steps: int, depth: int) -> range:
    """Steps granted but not trained when the drafters stop after step `stop_after`."""
    return range(stop_after + 1, min(stop_after + depth, total_steps))


def stop_notices(stop_after: int, total_steps: int, depth: int, num_targets: int,
                 first_unit_of_target: Callable[[int, int, int], int | None]) -> dict[int, int]:
    """target index → the micro-batch whose credit it waits for after a stop (only targets with work left).

    That micro-batch is the target's first one at or after step stop_after + D (the first step never
    granted); its drafter (u mod M) sends the −1 credit. first_unit_of_target(t, from_step, total):
    Layout.first_unit_of_target.
    """
    out = {}
    for t in range(num_targets):
        u = first_unit_of_target(t, stop_after + depth, total_steps)
        if u is not None:
            out[t] = u
    return out


# ----------------------------------------------------------------------------------------------
# Errors


class PeerFailure(RuntimeError):
    """Another rank failed or went away; this rank stops because of it (not an error of its own)."""


def is_peer_failure(exc: BaseException) -> bool:
    """Errors that mean "a peer is gone" rather than a bug here: lost connections, comm timeouts."""
    if isinstance(exc, PeerFailure):
        return True
    text = str(exc)
    lost = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "pair closure",
            "Broken pipe", "NCCL communicator was aborted", "ProcessGroupNCCL is being aborted", "Socket Timeout",
            "failed to recv", "failed to send")
    return any(s in text for s in lost)


def describe_exit(exitcode: int | None) -> str:
    """'exit code 1' / 'killed by signal 9 (SIGKILL)'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "?"
        return f"killed by signal {-exitcode} ({name})"
    return f"exit code {exitcode}"


@dataclass
class FailureReport:
    """What one rank says went wrong. kind: error (its own exception), died (no report, seen by the
    launcher), peer (stopped because another rank failed), stalled (no progress)."""

    rank: int
    role: str
    device: str
    kind: str
    type: str
    message: str
    traceback: str = ""
    seq: int = 0

    @classmethod
    def from_exception(cls, rank: int, role: str, device: str, exc: BaseException) -> "FailureReport":
        kind = "peer" if is_peer_failure(exc) else "error"
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank=rank, role=role, device=device, kind=kind, type=type(exc).__name__, message=str(exc), traceback=tb)

    @property
    def user_error(self) -> bool:
        """A bad setting or input (printed as one line, exit code 2) rather than a failure."""
        return self.kind == "error" and self.type in ("ValueError", "FileNotFoundError", "NonFiniteError")

    def headline(self) -> str:
        where = f"rank {self.rank} ({self.role}, {self.device})"
        if self.kind == "died":
            return f"{where} died: {self.message}"
        return f"{where}: {self.type}: {self.message}"


def choose_original(reports: list[FailureReport]) -> FailureReport | None:
    """The report to show: the earliest own error, else the earliest death, else the earliest other."""
    for kinds in (("error",), ("died",), ("stalled", "peer")):
        hits = sorted((r for r in reports if r.kind in kinds), key=lambda r: r.seq)
        if hits:
            return hits[0]
    return None


class FailureBoard:
    """Failure reports, the abort and stop flags and per-rank snapshots, in the rendezvous store.

    Every method is safe to call from the watchdog thread (the c10d store client serializes calls).
    """

    PREFIX = "dflash/"

    def __init__(self, store: Any):
        self.store = store

    def _k(self, key: str) -> str:
        return self.PREFIX + key

    def report(self, rep: FailureReport, *, abort: bool = True) -> FailureReport:
        rep.seq = int(self.store.add(self._k("error_seq"), 1))
        self.store.set(self._k(f"error/{rep.rank}"), json.dumps(rep.__dict__))
        if abort:
            self.store.set(self._k("abort"), str(rep.rank))
        return rep

    def reports(self, world_size: int) -> list[FailureReport]:
        out = []
        for r in range(world_size):
            key = self._k(f"error/{r}")
            if self.store.check([key]):
                out.append(FailureReport(**json.loads(self.store.get(key))))
        return out

    def abort_set(self) -> bool:
        return bool(self.store.check([self._k("abort")]))

    def stop_set(self) -> bool:
        return bool(self.store.check([self._k("stop")]))

    def request_stop(self) -> None:
        self.store.set(self._k("stop"), "1")

    def publish(self, key: str, value: Any) -> None:
        self.store.set(self._k(key), json.dumps(value))

    def read(self, key: str) -> Any | None:
        k = self._k(key)
        return json.loads(self.store.get(k)) if self.store.check([k]) else None

    def wait_for(self, key: str, timeout_s: float, poll_s: float = 0.1) -> Any:
        """Wait until `key` exists; returns its value. Polls (short store calls) rather than blocking in
        `store.wait`, which would hold the store client the watchdog thread shares. Raises PeerFailure
        after `timeout_s`."""
        k = self._k(key)
        deadline = time.monotonic() + timeout_s
        while not self.store.check([k]):
            if time.monotonic() > deadline:
                raise PeerFailure(f"waited {timeout_s:.0f} s for {key!r} from another rank")
            time.sleep(poll_s)
        return json.loads(self.store.get(k))


# ----------------------------------------------------------------------------------------------
# The watchdog


class Watchdog(threading.Thread):
    """Per-rank daemon thread: leaves the process when another rank aborted, when this rank made no
    progress for `stall_timeout_s`, or when the store is gone; forwards stop requests both ways and
    publishes this rank's snapshot every `publish_every_s`.

    The main thread calls `beat(state)` whenever it makes progress; `state` says what it waits for
    next (shown in the stall report).
    """

    def __init__(self, board: FailureBoard, *, rank: int, role: str, device: str, stop: StopRequest,
                 stall_timeout_s: float, snapshot: Callable[[], dict] | None = None,
                 publish_every_s: float = 0.25, poll_s: float = 0.25, quiet: bool = True):
        super().__init__(name=f"dflash-watchdog-{rank}", daemon=True)
        self.board, self.rank, self.role, self.device = board, rank, role, device
        self.stop_request, self.stall_timeout_s = stop, stall_timeout_s
        self.snapshot, self.publish_every_s, self.poll_s = snapshot, publish_every_s, poll_s
        self.quiet = quiet  # the launcher prints the original error; torchrun ranks print their own
        self._last_beat = time.monotonic()
        self._state = "starting"
        self._state_since = time.monotonic()
        self._done = threading.Event()
        self._stop_forwarded = False

    def beat(self, state: str) -> None:
        now = time.monotonic()
        self._last_beat = now
        if state != self._state:
            self._state, self._state_since = state, now

    def close(self) -> None:
        self._done.set()

    def run(self) -> None:
        last_pub = 0.0
        while not self._done.wait(self.poll_s):
            try:
                if self.board.abort_set():
                    self._leave(None)
                if self.stop_request.is_set() and not self._stop_forwarded:
                    self.board.request_stop()
                    self._stop_forwarded = True
                elif not self.stop_request.is_set() and self.board.stop_set():
                    self.stop_request.set("another rank")
                    self._stop_forwarded = True
                idle = time.monotonic() - self._last_beat
                if idle > self.stall_timeout_s:
                    rep = FailureReport(rank=self.rank, role=self.role, device=self.device, kind="stalled",
                                        type="Stalled", message=f"no progress for {idle:.0f} s while {self._state}")
                    self.board.report(rep)
                    self._leave(rep)
                now = time.monotonic()
                if self.snapshot is not None and now - last_pub >= self.publish_every_s:
                    snap = self.snapshot()
                    snap.update(state=self._state, state_s=now - self._state_since)
                    self.board.publish(f"telemetry/{self.rank}", snap)
                    last_pub = now
            except Exception as e:  # noqa: BLE001 - the store is gone: the launcher or rank 0 died
                if self._done.is_set():
                    return
                self._leave(None, note=f"lost the rendezvous store ({type(e).__name__}: {str(e)[:120]})")

    def _leave(self, rep: FailureReport | None, note: str | None = None) -> None:
        if self._done.is_set():
            return
        if rep is None and note is None:  # aborted by another rank: say so, so nobody counts this as a death
            try:
                if self.board.read(f"error/{self.rank}") is None:  # keep this rank's own report if it wrote one
                    self.board.report(FailureReport(rank=self.rank, role=self.role, device=self.device, kind="peer",
                                                      type="Aborted", message="stopped because another rank failed"),
                                      abort=False)
            except Exception:  # noqa: BLE001
                pass
        if not self.quiet:
            if rep is not None:
                print(f"[rank {self.rank}] error: {rep.message}", file=sys.stderr)
            else:
                print(f"[rank {self.rank}] stopping: {note or 'another rank failed (its error is shown by that rank)'}",
                      file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
