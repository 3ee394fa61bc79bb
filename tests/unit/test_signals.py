import os
import signal

from dflash_trainer.training import signals
from dflash_trainer.training.signals import StopRequest


def test_sigterm_requests_a_stop_and_handlers_are_restored():
    """A SIGTERM only asks for a stop (named in `requested`); the previous handlers come back after the run."""
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set() and stop.requested == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_first_request_wins_and_watchdog_set_is_seen():
    """The watchdog's forwarded stop and a later signal set the same flag; `requested` keeps the first cause."""
    stop = StopRequest()
    assert not stop.is_set() and stop.requested is None
    stop.set("another rank")
    with stop.installed():
        os.kill(os.getpid(), signal.SIGTERM)
    assert stop.is_set() and stop.requested == "another rank"


def test_second_sigint_exits_at_once(monkeypatch):
    """Only a second SIGINT leaves at once (code 130); a SIGTERM before it does not count."""
    codes = []
    monkeypatch.setattr(signals.os, "_exit", codes.append)
    stop = StopRequest()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert codes == [] and stop.requested == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)
        assert codes == [130]
