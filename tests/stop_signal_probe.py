"""Raise a signal from inside a training run, at a logged step (the stop-signal tests of
test_cli.py and test_grpo.py): the command's handler must be the one installed then."""

import signal

from tunix_nb import tracking
from tunix_nb.cli.stop_signals import StopRequest


def signal_at_step(monkeypatch, signum, step: int) -> None:
    """After the run logs `step`, check its handler is installed and raise `signum` in-process."""
    log = tracking.Trackers.log

    def log_and_signal(self, record):
        log(self, record)
        if record["step"] == step:
            handler = signal.getsignal(signum)
            assert isinstance(getattr(handler, "__self__", None), StopRequest), "the run's handler is not installed"
            signal.raise_signal(signum)

    monkeypatch.setattr(tracking.Trackers, "log", log_and_signal)
