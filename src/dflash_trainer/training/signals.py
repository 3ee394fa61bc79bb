"""Graceful shutdown: SIGTERM / SIGINT request a stop at the next step boundary.

States: running → stop requested (a SIGTERM or SIGINT, or a peer's request forwarded by the
watchdog; the loop writes a checkpoint and returns, exit code 0) → a second SIGINT exits at once
(code 130). Handlers are installed only in the main thread. The co-located run and the pipeline
launcher restore the previous handlers on exit (`installed`); a pipeline rank keeps them for the
life of its process (`install`).
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator


class StopRequest:
    """One stop flag per process, safe to set from a signal handler or the watchdog thread.

    `requested` is None while running, else who asked first: a signal name ("SIGTERM", "SIGINT")
    or the `by` given to `set`.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._sigints = 0
        self.requested: str | None = None

    def set(self, by: str = "peer") -> None:
        if self.requested is None:
            self.requested = by
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints >= 2:
                os._exit(130)  # second Ctrl-C: exit at once
        self.set(signal.Signals(signum).name)

    def install(self) -> dict[int, Any]:
        """Install the SIGTERM / SIGINT handlers; returns the previous ones ({} off the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    @contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """Install the handlers for the duration of the block (no-op outside the main thread)."""
        previous = self.install()
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
