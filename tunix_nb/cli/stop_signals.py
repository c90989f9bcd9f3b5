"""SIGTERM and SIGINT during a run: save the step in flight, then stop.

Colab, Kaggle and preemptible TPU VMs send SIGTERM before they take the machine, and Ctrl-C
(or a notebook's interrupt) sends SIGINT. The first of either asks the loop to stop after the
step in flight; the command then saves that step, waits until the checkpoint is committed,
says how to resume and exits with 128 + the signal's number (143, 130), as a shell reports a
process the signal ended. A second signal while that save runs exits at once: the checkpoint
being written is left uncommitted (Orbax writes into a temporary folder first), and the last
committed one stays intact. The handlers are installed for the run only and restored after
it, so `cli.main` in a notebook leaves the kernel's own Ctrl-C handling as it found it.
"""

from __future__ import annotations

import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """`with StopRequest() as stop:` handles STOP_SIGNALS inside; `stop.requested()` tells the
    loop to stop, `stop.exit_code` what the command returns then (None: no signal came)."""

    def __init__(self, enabled: bool = True):
        self.signum: int | None = None
        self.enabled = enabled
        self._previous: dict = {}

    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int | None:
        return None if self.signum is None else 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second: leave now, the last committed checkpoint intact
            print(f"\n{signal.Signals(signum).name} again: stopping now, without finishing the save.",
                  file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        self.signum = signum
        print(f"\n{self.name}: finishing the step in flight, then saving it (send it again to stop at once).",
              file=sys.stderr, flush=True)

    def __enter__(self):
        if self.enabled and threading.current_thread() is threading.main_thread():  # handlers run there only
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
