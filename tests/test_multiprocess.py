"""Multi-process training on localhost: `python -m tunix_nb.launch` and `tunix_nb.distributed`.

Two JAX processes with 4 simulated CPU devices each must train to the parameters of one
process with 8 (same global batches), save and restore Orbax checkpoints together,
shut down cleanly, and stop when one of them dies.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tunix_nb import checkpoint, cli, compare, data, devices, launch, parallel, preempt

REPO = Path(__file__).resolve().parents[1]
RUN = ["sft", "--model", "tiny", "--steps", "10", "--batch-size", "16", "--save-every", "5", "--seed", "3"]




def _launch(args, lines, **kwargs) -> int:
    return launch.launch(args, processes=2, devices_per_process=4, timeout_s=240, print_fn=lines.append, **kwargs)


# ------------------------------------------------------------------ the 2x4 run against 1x8


@pytest.mark.cpu_only(reason="processes of simulated CPU devices, started as children")
def test_two_processes_save_resume_and_match_one_process(tmp_path, capsys):
    """2x4 fsdp, stopped at step 5 and resumed from the checkpoint both processes wrote,
    ends within 1e-5 of an uninterrupted 1x8 run; so does resuming that checkpoint in one
    process; every process leaves with exit code 0."""
    lines = []
    two = tmp_path / "two_by_four"
    assert _launch([*RUN, "--parallel", "fsdp", "--ckpt-dir", str(two), "--stop-after", "5"], lines) == 0, lines
    assert sorted(int(p.name) for p in two.iterdir() if p.name.isdigit()) == [5]
    assert {p.name for p in (two / "5" / "params").glob("ocdbt.process_*")} == {"ocdbt.process_0",
                                                                                "ocdbt.process_1"}
    resumed_alone = tmp_path / "resumed_in_one_process"
    shutil.copytree(two, resumed_alone)
    assert _launch([*RUN, "--parallel", "fsdp", "--ckpt-dir", str(two)], lines) == 0, lines
    text = "\n".join(lines)
    assert "[process 0] Resuming from the checkpoint at step 5" in text
    assert "[process 0] Done: sft tiny, 10 steps, 2 processes." in text
    assert "launch: all 2 processes finished" in text
    assert "[process 1] Done" not in text  # process 0 speaks for the group
    assert "Gloo" not in text  # gloo's connection chatter is filtered out

    # this test process has 8 simulated devices: the 1x8 runs happen here
    one = tmp_path / "one_by_eight"
    assert cli.main([*RUN, "--parallel", "dp", "--ckpt-dir", str(one)]) == 0
    assert cli.main([*RUN, "--parallel", "dp", "--ckpt-dir", str(resumed_alone)]) == 0
    assert "Resuming from the checkpoint at step 5" in capsys.readouterr().out
    reference = checkpoint.load_params(one)
    for run in (two, resumed_alone):
        diff = compare.max_abs_diff(checkpoint.load_params(run), reference)
        assert diff <= 1e-5, f"{run.name} vs one process x 8 devices: largest parameter difference {diff}"
        assert checkpoint.load_meta(run)["step"] == 10


# The run a stop signal interrupts: 2 processes x 1 device, so that one process with 2 devices
# (a sum of two terms either way) is the uninterrupted run to the bit.
STOP_RUN = ["sft", "--model", "tiny", "--parallel", "fsdp", "--steps", "12", "--batch-size", "16",
            "--save-every", "10", "--seed", "3"]


@pytest.mark.cpu_only(reason="processes of simulated CPU devices, started as children")
def test_a_signal_to_one_process_stops_both_after_the_same_step_and_resumes_bitwise(tmp_path):
    """SIGTERM to process 1 alone, at a seeded step off the save interval: the processes agree on
    the step to stop after, both write their shards of that step, every process exits 143 and the
    launcher too; the group resumes from it to the bits and metrics of a run never stopped."""
    after_step = random.Random(48).randrange(2, 6)  # the step in flight lies before the first save, at 10
    ckpt, metrics = tmp_path / "cut", tmp_path / "cut.jsonl"
    argv = [*STOP_RUN, "--ckpt-dir", str(ckpt), "--metrics-file", str(metrics)]
    stopped = preempt.launch_and_signal(argv, metrics_file=metrics, signum=signal.SIGTERM, after_step=after_step,
                                        process=1, timeout=240)
    out = stopped["output"]
    assert stopped["returncode"] == 143, out[-3000:]
    saved = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    print(f"SIGTERM to process 1 after step {stopped['signalled_after']}: both saved step {saved}")
    assert stopped["signalled_after"] <= saved <= stopped["signalled_after"] + 3  # the step in flight, not 10
    assert {p.name for p in (ckpt / str(saved) / "params").glob("ocdbt.process_*")} == {"ocdbt.process_0",
                                                                                       "ocdbt.process_1"}
    assert "[process 1] SIGTERM: finishing the step in flight, then saving it (with the other processes" in out
    assert "[process 0] SIGTERM:" not in out  # process 0 stopped on the agreement alone
    assert f"[process 0] Stopped by SIGTERM after step {saved} of 12: saved step {saved}" in out
    assert "launch: all 2 processes stopped by SIGTERM, after saving the step they agreed on" in out
    assert "Traceback" not in out and not list(ckpt.glob(f"*{preempt.TMP_SUFFIX}*"))
    whole, errors = tmp_path / "whole", tempfile.TemporaryFile(mode="w+")  # a file: a full pipe would stall it
    # the run never stopped, beside the resumed one: their processes wait on each other, it fills the gaps
    never_stopped = subprocess.Popen([sys.executable, "-m", "tunix_nb.train", *STOP_RUN, "--devices", "2",
                                      "--ckpt-dir", str(whole), "--metrics-file", str(tmp_path / "whole.jsonl")],
                                     stdout=subprocess.DEVNULL, stderr=errors, text=True, env=devices.child_env())
    lines = []
    try:
        resumed = launch.launch(argv, processes=2, devices_per_process=1, timeout_s=240, print_fn=lines.append)
    finally:
        never_stopped_code = never_stopped.wait(timeout=240)
    errors.seek(0)
    assert resumed == 0 and never_stopped_code == 0, (lines, errors.read()[-3000:])
    assert f"[process 0] Resuming from the checkpoint at step {saved}" in "\n".join(lines)
    assert compare.bitwise_equal(checkpoint.load_params(ckpt), checkpoint.load_params(whole))
    assert metrics.read_text() == (tmp_path / "whole.jsonl").read_text()


AGREEMENT_WORKER = textwrap.dedent("""
    import signal, sys
    from tunix_nb import distributed
    distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
    round_id = 0  # every process asks at the same rounds, as the training loop does after each step
    for signum, first_round in zip(map(int, sys.argv[3::2]), map(int, sys.argv[4::2])):
        agreed = None
        while agreed is None:
            round_id += 1
            agreed = distributed.agree_on_stop(round_id, signum if round_id >= first_round else None)
        print("agreed", round_id, signal.Signals(agreed).name, flush=True)
    distributed.shutdown()
""")


@pytest.mark.needs_loopback
def test_processes_signalled_at_different_steps_agree_on_the_first(tmp_path):
    """Process 0 gets SIGTERM at round 16, process 1 SIGINT at round 13: both stop at 13, for SIGINT.
    Both at round 40: both stop there, for process 0's signal."""
    script = tmp_path / "worker.py"
    script.write_text(AGREEMENT_WORKER)
    address, term, int_ = f"127.0.0.1:{launch.free_port()}", str(int(signal.SIGTERM)), str(int(signal.SIGINT))
    signals = {0: [term, "16", term, "40"], 1: [int_, "13", int_, "40"]}
    procs = [subprocess.Popen([sys.executable, str(script), address, str(i), *signals[i]], cwd=REPO,
                              env=devices.child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for out in outs:
        assert "agreed 13 SIGINT" in out and "agreed 40 SIGTERM" in out, out[-2000:]


@pytest.mark.needs_loopback
def test_launcher_stops_the_others_when_a_process_dies(tmp_path):
    """SIGKILL one process mid-run: the launcher kills the other and names the dead one.

    No wall-clock assert (it flakes on a loaded machine); what shows that JAX's heartbeat
    did not end process 0: the launcher names process 1 as the first to die (process 0
    either was stopped by the launcher or aborted in gloo on the closed connection at once,
    and then the message says so), nothing mentions the heartbeat, and neither process is left.
    """
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "tunix_nb.launch", "--", "sft", "--model", "tiny", "--parallel", "dp",
           "--steps", "5000", "--batch-size", "16", "--save-every", "1000", "--metrics-file", str(metrics)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        pids = [int(p) for p in first.split("pids ")[1].split()]
        deadline = time.monotonic() + 300  # a guard against a hang, not a speed requirement
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, f"no training steps: {first}"
            time.sleep(0.2)
        os.kill(pids[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)  # likewise a hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    stopped, aborted = "; stopped the other process (0)", ". Process 0 then was killed by SIGABRT"
    assert any(f"process 1 (pid {pids[1]}) was killed by SIGKILL{how}" in out for how in (stopped, aborted)), out
    assert "heartbeat" not in out.lower() and "another task died" not in out  # not stopped by JAX's heartbeat
    assert "Done:" not in out and len(metrics.read_text().splitlines()) < 5000  # the run was cut short
    for pid in pids:  # both gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_launcher_names_the_first_process_to_die_not_the_lowest_numbered():
    """Process 1 is SIGKILLed and process 0 aborts in gloo a moment later: both have ended by
    the time the launcher looks, and the message blames process 1, the order they ended in."""
    ended = launch.queue.Queue()
    for exit_ in [(1, -signal.SIGKILL), (0, -signal.SIGABRT)]:
        ended.put(exit_)
    exits = launch._watch(ended, drain=lambda block_s: None, processes=2, deadline=None)
    assert exits == [(1, -signal.SIGKILL), (0, -signal.SIGABRT)]
    procs = [type("Proc", (), {"pid": pid})() for pid in (100, 101)]
    message = launch._failure_message(exits, procs)
    assert message.startswith("launch: error: process 1 (pid 101) was killed by SIGKILL. Process 0 then was "
                              "killed by SIGABRT, before the launcher could stop it. Any error"), message
    # reported the other way round (process 0's wait thread ran first): the abort is still the consequence
    exits = launch._cause_first([(0, -signal.SIGABRT), (1, -signal.SIGKILL)])
    assert exits == [(1, -signal.SIGKILL), (0, -signal.SIGABRT)]
    assert launch._cause_first([(0, 0), (1, -signal.SIGABRT), (2, -signal.SIGABRT)])[1] == (1, -signal.SIGABRT)
    # three processes: 0 finished cleanly, then 2 exited with an error while 1 still ran
    message = launch._failure_message([(0, 0), (2, 3)], procs + procs[:1])
    assert message.startswith("launch: error: process 2 (pid 100) exited with code 3; stopped the other "
                              "process (1), which would"), message


def test_the_launcher_kills_only_the_processes_still_running_and_says_which():
    """`_stop` asks the kernel, not `Popen.poll` (which answers None while a wait thread holds
    the lock): a process that already ended, reaped or not, is not counted as stopped."""
    import threading

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    reaped.wait()
    while not launch._has_ended(done):  # a zombie until someone waits for it
        time.sleep(0.01)
    assert launch._has_ended(reaped) and not launch._has_ended(running)
    waiter = threading.Thread(target=running.wait)  # holds the lock poll() would need
    waiter.start()
    time.sleep(0.1)
    assert launch._stop([done, reaped, running]) == [2]
    waiter.join(timeout=5)
    assert running.returncode == -signal.SIGKILL and done.returncode == 0


def test_the_launcher_waits_while_every_process_runs_and_stops_at_its_deadline():
    ended = launch.queue.Queue()
    ended.put((0, 0))  # one finished cleanly, the other still runs
    drained = []
    exits = launch._watch(ended, drain=drained.append, processes=2, deadline=time.monotonic() + 0.5)
    assert exits == [(0, 0)] and len(drained) >= 2  # it kept looking until the deadline


HEARTBEAT_WORKER = textwrap.dedent("""
    import os, sys, time
    from tunix_nb import devices, distributed
    devices.simulate_cpu_devices(2)
    distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), heartbeat_timeout_s=3)
    import jax, jax.numpy as jnp
    from tunix_nb import parallel
    mesh = parallel.make_mesh()
    total = jax.jit(lambda x: x.sum(), out_shardings=parallel.replicated(mesh))
    x = parallel.place_batch(jnp.ones((2,)), mesh)  # each process's rows: one per device
    print("ready", float(total(x)), flush=True)
    if sys.argv[2] == "1":
        os._exit(0)  # dies without leaving the group
    for _ in range(600):  # would block in its next all-reduce for good without heartbeats
        float(total(x))
        time.sleep(0.1)
    print("never stopped", flush=True)
""")


@pytest.mark.needs_loopback
def test_without_launcher_a_lost_process_stops_the_others_by_heartbeat(tmp_path):
    """On a cluster there is no launcher: JAX's heartbeat ends the survivors with an error."""
    script = tmp_path / "worker.py"
    script.write_text(HEARTBEAT_WORKER)
    address = f"127.0.0.1:{launch.free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), address, str(i)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        out0, _ = procs[0].communicate(timeout=90)
        out1, _ = procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "ready 4.0" in out0 and "ready 4.0" in out1  # 2 rows per process, summed across both
    assert procs[0].returncode != 0 and "never stopped" not in out0
    assert "another task died" in out0 or "stopped sending heartbeats" in out0, out0[-2000:]


# ------------------------------------------------------------------ pieces, on one process


@pytest.mark.cpu_only(reason="processes of simulated CPU devices, started as children")
def test_process_rows_and_place_batch_on_one_process():
    mesh = parallel.make_mesh()
    assert parallel.process_rows(mesh, 16) == slice(0, 16)  # one process loads every row
    batch = {"x": np.arange(32).reshape(16, 2)}
    placed = parallel.place_batch(batch, mesh)
    assert placed["x"].shape == (16, 2) and placed["x"].sharding.spec == parallel.data_sharding(mesh).spec
    np.testing.assert_array_equal(np.asarray(placed["x"]), batch["x"])
    with pytest.raises(ValueError, match="does not divide by the 8 devices"):
        parallel.process_rows(mesh, 12)


def test_batch_at_rows_loads_only_that_part():
    arrays = {"a": np.arange(100) * 10}
    whole = data.batch_at(arrays, 7, 16, seed=1)
    part = data.batch_at(arrays, 7, 16, seed=1, rows=slice(8, 16))
    np.testing.assert_array_equal(part["a"], whole["a"][8:16])


@pytest.mark.cpu_only(reason="processes of simulated CPU devices, started as children")
def test_to_host_and_gather_whole_values():
    mesh = parallel.make_mesh()
    x = parallel.place_state({"w": np.arange(64.0).reshape(16, 4)}, mesh, "fsdp")["w"]
    assert not x.sharding.is_fully_replicated
    np.testing.assert_array_equal(parallel.to_host(x), np.arange(64.0).reshape(16, 4))
    assert parallel.gather(x).sharding.device_set == {jax.local_devices()[0]}


@pytest.mark.parametrize("args, message", [
    (["sft", "--parallel", "dp"], "put the training command after --"),
    (["--", "sft"], "--parallel dp, fsdp or shard_map"),
    (["--", "sft", "--parallel", "pmap"], "--parallel dp, fsdp or shard_map"),
    (["--", "sft", "--parallel", "dp", "--devices", "2"], "Leave --devices out"),
    (["--", "sft", "--parallel=dp", "--process-id=1"], "Leave --process-id out"),
])
def test_launcher_refuses_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--coordinator", "127.0.0.1:1234", "--parallel", "dp"], "missing --num-processes, --process-id"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2", "--parallel", "dp"],
     "--process-id 2 must be in 0 ... 1"),
    (["--distributed"], "--parallel jit runs within one process"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0", "--parallel", "pmap"],
     "--parallel pmap runs within one process"),
])
def test_cli_refuses_incomplete_multi_process_flags(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sft", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_launcher_help_names_the_form(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--help"])
    assert exit_info.value.code == 0
    assert "--devices-per-process" in capsys.readouterr().out


def test_gloo_chatter_is_noise_and_real_output_is_not():
    assert launch.is_noise("[Gloo] Rank 5 is connected to 7[Gloo] Rank 6 is connected to 7 peer ranks. "
                           "Expected number of connected peer ranks is : 7")
    assert launch.is_noise(" peer ranks. Expected number of connected peer ranks is : 7")
    assert launch.is_noise("7")
    assert not launch.is_noise("Done: sft tiny, 10 steps.")
    assert not launch.is_noise("ValueError: 3")
