"""SIGTERM and SIGINT during a run: save the step in flight, then stop.

Colab, Kaggle and preemptible TPU VMs send SIGTERM before they take the machine, and Ctrl-C
(or a notebook's interrupt) sends SIGINT. The first of either asks the loop to stop after the
step in flight; the command then saves that step, waits until the checkpoint is committed,
says how to resume and exits with 128 + the signal's number (143, 130), as a shell reports a
process the signal ended. A second signal while that save runs exits at once: the checkpoint
being written is left uncommitted (Orbax writes into a temporary folder first), and the last
committed one stays intact. The handlers are installed for the run only and restored after
it, so `cli.main` in a notebook leaves the kernel's own Ctrl-C handling as it found it.

With several processes the signal may reach one of them, or each at another step, while
Orbax's save is a collective that all must join at the same step. So every process asks the
others after each step (`distributed.agree_on_stop`), and all stop after the step at which
the first signal was posted, each exiting with that signal's code.
"""

from __future__ import annotations

import signal
import sys
import threading

from tunix_nb import distributed

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """`with StopRequest() as stop:` handles STOP_SIGNALS inside. The loop asks `stop.should_stop()`
    once after every step (with several processes: all of them, at the same steps); then
    `stop.requested()` says whether the run stopped for a signal, `stop.exit_code` what the command
    returns (None: no signal stopped it)."""

    def __init__(self, enabled: bool = True, processes: int = 1):
        self.received: int | None = None  # the signal this process got
        self.signum: int | None = None  # the signal the run stops for: with several processes, as agreed
        self.enabled, self.processes = enabled, processes
        self._rounds = 0
        self._previous: dict = {}

    def should_stop(self) -> bool:
        """Whether to stop after the step just queued; with several processes, the same answer in each."""
        if self.processes > 1 and self.signum is None:
            self._rounds += 1
            self.signum = distributed.agree_on_stop(self._rounds, self.received)
        return self.requested()

    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int | None:
        return None if self.signum is None else 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # the second: leave now, the last committed checkpoint intact
            print(f"\n{signal.Signals(signum).name} again: stopping now, without finishing the save.",
                  file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        self.received = signum
        if self.processes == 1:
            self.signum = signum
        others = " (with the other processes, at the step they agree on)" if self.processes > 1 else ""
        print(f"\n{signal.Signals(signum).name}: finishing the step in flight, then saving it{others} (send it "
              "again to stop at once).", file=sys.stderr, flush=True)

    def __enter__(self):
        if self.enabled and threading.current_thread() is threading.main_thread():  # handlers run there only
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
