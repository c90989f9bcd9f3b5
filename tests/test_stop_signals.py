"""The training command's stop signals (`tunix_nb.cli.stop_signals`), in this process: the first
SIGTERM or SIGINT asks the loop to stop, a second exits at once, and the handlers before the
run are back after it (a notebook's Ctrl-C handling, say)."""

import os
import signal

import pytest

from tunix_nb.cli.stop_signals import StopRequest


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_first_signal_asks_to_stop_and_a_second_exits_at_once(signum, code, capsys):
    before = signal.getsignal(signum)
    with StopRequest() as stop:
        assert not stop.requested() and stop.exit_code is None
        os.kill(os.getpid(), signum)
        assert stop.requested() and stop.exit_code == code
        assert "finishing the step in flight" in capsys.readouterr().err
        with pytest.raises(SystemExit) as second:
            os.kill(os.getpid(), signum)
        assert second.value.code == code and "stopping now" in capsys.readouterr().err
    assert signal.getsignal(signum) is before  # the handlers of before the run are back


def test_disabled_it_leaves_the_handlers_alone():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest(enabled=False):
        assert signal.getsignal(signal.SIGTERM) is before
