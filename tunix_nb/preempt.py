"""Preemption drills: run the training CLI and SIGKILL it between saves or during one, or send
it a stop signal (SIGTERM, SIGINT), which it answers by saving the step in flight; as one
process, or as a group of processes (`tunix_nb.launch`) of which one alone gets the signal.

Notebook 05 and the tests use `preempt` to show that a run killed at any moment
resumes, from its newest complete checkpoint, to the same bits as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tunix_nb import devices

TMP_SUFFIX = ".orbax-checkpoint-tmp"  # where Orbax writes a step before committing it


def _in_flight_saves(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.glob(f"*{TMP_SUFFIX}*")) if ckpt_dir.is_dir() else []


def _last_logged_step(metrics_file: Path) -> int:
    try:
        lines = metrics_file.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def run_and_kill(argv, *, ckpt_dir, metrics_file, when: str, after_step: int = 1, timeout: float = 120.0,
            env=None, cwd=None) -> dict:
    """Run `python -m tunix_nb.train *argv` and SIGKILL it mid-run; returns what was killed when.

    when="between_saves": once the metrics file shows a step > `after_step` and no save
    is in flight; when="during_save": once a step after `after_step` is being written
    (Orbax's `<step>.orbax-checkpoint-tmp` directory exists). To kill at a known moment,
    the process is frozen with SIGSTOP, the condition is checked on the frozen process,
    and then it is SIGKILLed (or let go with SIGCONT to try again). `argv` must include
    the --ckpt-dir and --metrics-file given here. `env` defaults to `devices.child_env()`: the
    run is a process of its own (to be killed), on the CPU, since the caller may hold the TPU chip.

    Returns {"killed": bool, "step": last step logged, "in_flight": tmp dir names, "returncode"}.
    Raises TimeoutError if the run neither finished nor could be killed in time.
    """
    if when not in ("between_saves", "during_save"):
        raise ValueError(f"when={when!r}: use 'between_saves' or 'during_save'")
    ckpt_dir, metrics_file = Path(ckpt_dir), Path(metrics_file)
    if cwd is not None:
        ckpt_dir, metrics_file = Path(cwd) / ckpt_dir, Path(cwd) / metrics_file
    stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen([sys.executable, "-m", "tunix_nb.train", *argv], cwd=cwd,
                            env=devices.child_env() if env is None else env,
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    deadline = time.monotonic() + timeout
    stale = set(_in_flight_saves(ckpt_dir))  # left by an earlier kill: not this run's saves

    def in_flight_saves():
        return [name for name in _in_flight_saves(ckpt_dir) if name not in stale]

    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not reach the kill point within {timeout} s")
            step, in_flight = _last_logged_step(metrics_file), in_flight_saves()
            ready = step > after_step and (bool(in_flight) == (when == "during_save"))
            if when == "during_save":
                ready = ready and any(int(name.split(".")[0]) > after_step for name in in_flight)
            if not ready:
                time.sleep(0.001)
                continue
            os.kill(proc.pid, signal.SIGSTOP)  # freeze it, then check the condition still holds
            step, in_flight = _last_logged_step(metrics_file), in_flight_saves()
            if bool(in_flight) == (when == "during_save"):
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return {"killed": True, "step": step, "in_flight": in_flight, "returncode": proc.returncode}
            os.kill(proc.pid, signal.SIGCONT)
        stderr.seek(0)
        return {"killed": False, "step": _last_logged_step(metrics_file), "in_flight": [],
                "returncode": proc.returncode, "stderr": stderr.read()}
    finally:
        if proc.poll() is None:  # a timeout or an error above: do not leave it running
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        stderr.close()


def run_beside(argv, *, env=None, cwd=None, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run `python -m tunix_nb.train *argv` to the end in a child process where `run_and_kill`
    runs its killed one (`env` defaults to `devices.child_env()`: the CPU). A run compared with
    a killed one bit for bit must compute where it did, also where this process holds a chip."""
    return subprocess.run([sys.executable, "-m", "tunix_nb.train", *map(str, argv)], cwd=cwd,
                          env=devices.child_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def run_and_signal(argv, *, metrics_file, signum: int = signal.SIGTERM, after_step: int = 1,
                   timeout: float = 120.0, env=None, cwd=None) -> dict:
    """Run `python -m tunix_nb.train *argv` and send it `signum` (SIGTERM: a preemption notice;
    SIGINT: Ctrl-C) once the metrics file shows step `after_step`: the run saves the step in
    flight and exits with 128 + signum. `argv` must include the --metrics-file given here.

    Returns {"returncode", "signalled_after": the step logged when the signal went, "stdout", "stderr"}.
    """
    metrics_file = Path(cwd) / metrics_file if cwd is not None else Path(metrics_file)
    out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")  # files: a full pipe stalls
    proc = subprocess.Popen([sys.executable, "-m", "tunix_nb.train", *argv], cwd=cwd,
                            env=devices.child_env() if env is None else env, stdout=out, stderr=err, text=True)
    deadline, signalled_after = time.monotonic() + timeout, None
    try:
        while proc.poll() is None and signalled_after is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not reach step {after_step} within {timeout} s")
            step = _last_logged_step(metrics_file)
            if step >= after_step:
                os.kill(proc.pid, signum)
                signalled_after = step
            time.sleep(0.001)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        out.seek(0), err.seek(0)
        return {"returncode": proc.returncode, "signalled_after": signalled_after, "stdout": out.read(),
                "stderr": err.read()}
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        out.close(), err.close()


def launch_and_signal(train_args, *, metrics_file, signum: int = signal.SIGTERM, after_step: int = 1,
                      process: int = 1, processes: int = 2, devices_per_process: int = 1,
                      timeout: float = 120.0) -> dict:
    """Run the training command as `processes` JAX processes (`tunix_nb.launch`) and send `signum`
    to process `process` alone once the metrics file (process 0 writes it) shows step
    `after_step`: the processes agree on the step to stop after, all save it and exit with
    128 + signum. `train_args` must include the --metrics-file given here.

    Returns {"returncode": the launcher's, "signalled_after": the step logged when the signal
    went, "output": the launcher's lines, each process's prefixed `[process i]`}.
    """
    import threading

    from tunix_nb import launch

    lines, result = [], {}
    group = threading.Thread(target=lambda: result.update(returncode=launch.launch(
        train_args, processes=processes, devices_per_process=devices_per_process, timeout_s=timeout,
        print_fn=lines.append)), daemon=True)
    group.start()
    deadline, signalled_after = time.monotonic() + timeout, None
    while group.is_alive() and signalled_after is None and time.monotonic() < deadline:
        step = _last_logged_step(Path(metrics_file))
        if lines and step >= after_step:  # the launcher's first line names the processes' pids
            os.kill(int(lines[0].split("pids ")[1].split()[process]), signum)
            signalled_after = step
        time.sleep(0.001)
    group.join(timeout=max(1.0, deadline - time.monotonic()) + 30)  # the launcher stops the group at its timeout
    return {"returncode": result.get("returncode"), "signalled_after": signalled_after, "output": "\n".join(lines)}
