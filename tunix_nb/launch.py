"""`python -m tunix_nb.launch`: run the training CLI as several JAX processes on this machine.

    python -m tunix_nb.launch --processes 2 --devices-per-process 4 -- sft --parallel dp --ckpt-dir runs/mp

starts `python -m tunix_nb.train <args after -->` once per process, each with its own
simulated CPU devices, joined by `jax.distributed` through a coordinator on loopback
(process 0) and all-reducing over gloo. Together they are one 8-device program: the
same command as a single process with `--devices 8`, with each process loading only
its share of every batch and writing its own shards of every checkpoint.

Each output line is prefixed with `[process i]`. If a process fails or is killed, the
launcher stops the others at once and exits non-zero with a message
naming the process and how it ended: a lost process would otherwise leave the rest
blocked in their next collective until JAX's heartbeat timeout ends them.

On a TPU pod slice or several GPU hosts you do not need this launcher: run the same
`python -m tunix_nb.train ... --distributed` command on every host (see the README).
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

from tunix_nb import devices
from tunix_nb.train.config import MESH_CHOICES  # the strategies whose mesh spans processes

# The training command's exit codes after a stop signal made it save and stop (cli.stop_signals):
# 128 + the signal's number, as a shell reports a process the signal ended.
STOPPED_BY = {128 + s: signal.Signals(s).name for s in (signal.SIGTERM, signal.SIGINT)}
DEFAULT_HEARTBEAT_TIMEOUT_S = 10  # on loopback a silent process is a dead one; clusters use JAX's 100 s
# gloo prints a line per connection from several threads at once, word by word, so its
# pieces interleave: drop any line made only of these pieces and numbers
GLOO_PIECES = re.compile(r"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :")


def is_noise(line: str) -> bool:
    """True for gloo's connection chatter or a fragment of it (and blank lines): nothing to show."""
    return all(word.isdigit() for word in GLOO_PIECES.sub(" ", line).split())


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def can_listen_on_loopback(what: str = "This part") -> bool:
    """True if a coordinator could listen on 127.0.0.1 here; otherwise says so and that `what` is skipped.

    The processes of a group meet through process 0's coordinator (a TCP socket on loopback)
    and all-reduce over gloo (TCP too). Some sandboxes forbid sockets altogether.
    """
    try:
        free_port()
    except OSError as err:
        print(f"{what} needs a TCP socket on 127.0.0.1 for the processes' coordinator, and this machine "
              f"refused one ({type(err).__name__}: {err}), so it is skipped. It runs wherever a process "
              "may listen on loopback: a laptop, Colab, Kaggle, Binder.")
        return False
    return True


def _check_train_args(train_args) -> None:
    for flag in ("--coordinator", "--num-processes", "--process-id", "--devices", "--distributed"):
        if any(a == flag or a.startswith(flag + "=") for a in train_args):
            raise ValueError(f"Leave {flag} out of the training arguments: the launcher sets it for each process.")
    parallel = [train_args[i + 1] for i, a in enumerate(train_args[:-1]) if a == "--parallel"]
    parallel += [a.split("=", 1)[1] for a in train_args if a.startswith("--parallel=")]
    if not parallel or parallel[-1] not in MESH_CHOICES:
        raise ValueError("Give the training arguments --parallel dp, fsdp or shard_map: the strategies "
                         "whose mesh spans several processes.")


def process_command(train_args, *, process_id: int, processes: int, devices_per_process: int,
                    coordinator: str, heartbeat_timeout_s: int) -> list[str]:
    """The command line of one process: the training CLI plus where it stands in the group."""
    return [sys.executable, "-u", "-m", "tunix_nb.train", *train_args,
            "--devices", str(devices_per_process), "--coordinator", coordinator,
            "--num-processes", str(processes), "--process-id", str(process_id),
            "--heartbeat-timeout", str(heartbeat_timeout_s)]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(procs) -> list[int]:
    """SIGKILL every process still running, and reap them; returns which it killed.

    Not SIGTERM: the command would finish its step and save (`cli.stop_signals`), which a
    process whose peer is gone cannot do. Committed checkpoints are
    safe; a save cut short stays a `*.orbax-checkpoint-tmp` directory that resuming ignores.
    """
    killed = [i for i, p in enumerate(procs) if not _has_ended(p)]
    for i in killed:
        procs[i].kill()
    for p in procs:
        p.wait()
    return killed


def _has_ended(proc) -> bool:
    """Whether `proc` has ended, asked of the kernel without reaping it: `Popen.poll` answers
    None while the process's wait thread holds its lock, even for a process already dead."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # its wait thread has reaped it: it has ended
        return True


def _cause_first(exits):
    """`exits` (process, code) with the failure to name as the cause first. A peer of a killed
    process aborts (SIGABRT, in gloo) within milliseconds, and the two wait threads may report
    in either order; so a failure other than an abort goes before the aborts."""
    failures = [e for e in exits if e[1] != 0]
    cause = next((e for e in failures if e[1] != -signal.SIGABRT), failures[0])
    return [e for e in exits if e[1] == 0] + [cause] + [e for e in failures if e != cause]


def launch(train_args, *, processes: int = 2, devices_per_process: int = 4, port: int | None = None,
           heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S, timeout_s: float | None = None,
           print_fn: Callable[[str], None] = print) -> int:
    """Run `python -m tunix_nb.train *train_args` as `processes` JAX processes; returns the exit code.

    0 when every process finished cleanly; 143 or 130 when a SIGTERM or SIGINT to any of
    them made them all save the same step and stop. Otherwise the first failure's code (1
    for a process killed by a signal, or for `timeout_s` running out), after stopping the
    rest. Every output line goes through `print_fn`, prefixed `[process i]`.
    """
    if processes < 1 or devices_per_process < 1:
        raise ValueError(f"processes={processes} and devices_per_process={devices_per_process} must be >= 1.")
    train_args = list(train_args)
    _check_train_args(train_args)
    coordinator = f"127.0.0.1:{port or free_port()}"
    # on the CPU, whatever this process holds: a TPU chip has one holder at a time
    env = devices.child_env(PYTHONUNBUFFERED="1")
    lines: queue.Queue = queue.Queue()
    procs = []
    for i in range(processes):
        cmd = process_command(train_args, process_id=i, processes=processes,
                              devices_per_process=devices_per_process, coordinator=coordinator,
                              heartbeat_timeout_s=heartbeat_timeout_s)
        # its own session: a signal meant for the launcher's terminal does not hit it directly
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env, start_new_session=True))

    def pump(i, stream):
        for line in stream:
            lines.put((i, line.rstrip("\n")))
        lines.put((i, None))

    # one thread per process blocks in its wait: each reports the moment its process ends,
    # so the order seen is the order of death even when the main loop is slow to look (the
    # survivor of a SIGKILLed peer aborts within milliseconds, long before the next poll)
    ended: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=pump, args=(i, p.stdout), daemon=True) for i, p in enumerate(procs)]
    threads += [threading.Thread(target=lambda i=i, p=p: ended.put((i, p.wait())), daemon=True)
                for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    print_fn(f"launch: {processes} processes x {devices_per_process} CPU devices, coordinator {coordinator}, "
             f"pids {' '.join(str(p.pid) for p in procs)}")

    def drain(block_s):
        try:
            i, line = lines.get(timeout=block_s)
        except queue.Empty:
            return
        while True:
            if line is not None and not is_noise(line):
                print_fn(f"[process {i}] {line}")
            try:
                i, line = lines.get_nowait()
            except queue.Empty:
                return

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    exits = _watch(ended, drain, processes, deadline)
    killed = _stop(procs) if _failed(exits) or len(exits) < processes else []
    for t in threads:
        t.join(timeout=5)
    drain(0)
    while not ended.empty():  # those that ended on their own before the launcher looked again
        i, code = ended.get()
        if i not in killed and i not in {k for k, _ in exits}:
            exits.append((i, code))
    return _report(exits, procs, timeout_s, print_fn)


def _failed(exits) -> list[tuple[int, int]]:
    """The exits that are failures: not 0, and not a stop signal's code after saving."""
    return [(i, code) for i, code in exits if code != 0 and code not in STOPPED_BY]


def _report(exits, procs, timeout_s, print_fn) -> int:
    """Say how the group ended; -> the launcher's exit code: the processes' own when they all ended
    alike (0, or a stop signal's code after they saved the same step), else the first failure's."""
    codes = {code for _, code in exits}
    if not _failed(exits) and len(exits) == len(procs) and len(codes) == 1:
        code = codes.pop()
        if code == 0:
            print_fn(f"launch: all {len(procs)} processes finished")
        else:
            print_fn(f"launch: all {len(procs)} processes stopped by {STOPPED_BY[code]}, after saving the step "
                     "they agreed on; rerun the same command to resume")
        return code
    if not _failed(exits) and len(exits) < len(procs):
        print_fn(f"launch: error: the run took longer than {timeout_s} s; stopped all {len(procs)} processes.")
        return 1
    exits = _cause_first(exits)
    print_fn(_failure_message(exits, procs))
    code = next(code for _, code in exits if code != 0)
    return code if code > 0 else 1


def _watch(ended: queue.Queue, drain, processes: int, deadline: float | None) -> list[tuple[int, int]]:
    """(process, exit code) in the order they ended, until one fails, all end, or the deadline passes
    (a process stopped by a signal has not failed: the others are saving the same step)."""
    exits = []
    while len(exits) < processes and not _failed(exits):
        drain(0.2)
        while not ended.empty():
            exits.append(ended.get())
        if deadline is not None and time.monotonic() > deadline:
            break
    return exits


def _failure_message(exits, procs) -> str:
    """Names the first process to fail (the cause), the ones the launcher stopped, and any that
    ended after the first before it could stop them. `exits`: (process, code) in order of ending."""
    first = next(n for n, (_, code) in enumerate(exits) if code != 0)
    i, code = exits[first]
    stopped = [j for j in range(len(procs)) if j not in {k for k, _ in exits}]
    message = f"launch: error: process {i} (pid {procs[i].pid}) {_describe_exit(code)}"
    if stopped:
        message += (f"; stopped the other process{'es' if len(stopped) > 1 else ''} "
                    f"({', '.join(map(str, stopped))}), which would otherwise wait for it in their next collective")
    for j, later_code in exits[first + 1:]:
        message += f". Process {j} then {_describe_exit(later_code)}, before the launcher could stop it"
    return (message + ". Any error it printed is above. Rerun the same command to resume from the newest "
            "checkpoint in --ckpt-dir.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tunix_nb.launch", description=__doc__.splitlines()[0],
        usage="python -m tunix_nb.launch [--processes N] [--devices-per-process D] -- {sft,distill,dpo} ...",
        epilog="Everything after -- goes to python -m tunix_nb.train (see its --help); it must include "
               "--parallel dp, fsdp or shard_map.")
    parser.add_argument("--processes", type=int, default=2, help="how many JAX processes (default: 2)")
    parser.add_argument("--devices-per-process", type=int, default=4,
                        help="simulated CPU devices per process (default: 4)")
    parser.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--heartbeat-timeout", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                        help="seconds of silence after which JAX declares a process dead "
                             f"(default: {DEFAULT_HEARTBEAT_TIMEOUT_S})")
    parser.add_argument("--timeout", type=float, help="stop every process after this many seconds")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "--" not in argv:
        if "-h" in argv or "--help" in argv:
            parser.parse_args(["--help"])  # prints the help and exits
        parser.error("put the training command after --, e.g. -- sft --parallel dp --steps 20")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    try:
        return launch(argv[split + 1:], processes=args.processes, devices_per_process=args.devices_per_process,
                      port=args.port, heartbeat_timeout_s=args.heartbeat_timeout, timeout_s=args.timeout,
                      print_fn=lambda line: print(line, flush=True))
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    raise SystemExit(main())
