"""Graceful shutdown: SIGTERM / SIGINT request a stop at the next step boundary.

States: running → stop requested (first SIGTERM or SIGINT; the loop writes a checkpoint and
returns, exit code 0) → a second SIGINT exits at once (code 130). Handlers are installed only in
the main thread and restored on exit.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class StopRequest:
    """`requested` is None while running, else the name of the signal that asked to stop."""

    def __init__(self) -> None:
        self.requested: str | None = None

    def _handle(self, signum: int, _frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            os._exit(130)  # second Ctrl-C: exit at once
        self.requested = signal.Signals(signum).name

    @contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """Install the handlers for the duration of the block (no-op outside the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
