"""python -m tunix_nb.train: flags, resume (after kills and damage), DPO, metrics file, errors.

Every CLI run is a fresh Python process (about 5 s of JAX start-up and compilation), so
scenarios share runs where they can: one uninterrupted reference run serves the
kill-and-resume, the damaged-checkpoint and the DPO tests. All runs share a persistent
JAX compilation cache, which changes how long a run takes, not what it computes.
"""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from tunix_nb import checkpoint, compare, losses, preempt
from tunix_nb import cli as cli_module

TINY = ["sft", "--model", "tiny", "--batch-size", "16"]
# The run the preemption tests interrupt: long enough (a few ms a step) to be killed mid-run.
RUN = [*TINY, "--steps", "240", "--save-every", "20", "--keep", "3"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The environment of every CLI run: one device, a shared compilation cache."""
    cache = tmp_path_factory.mktemp("jax_cache")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    return env


@pytest.fixture
def cli(env):
    def run(*args, timeout=180):
        return subprocess.run([sys.executable, "-m", "tunix_nb.train", *args], capture_output=True, text=True,
                              env=env, timeout=timeout)
    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    """RUN, uninterrupted: its checkpoint directory and metrics file."""
    root = tmp_path_factory.mktemp("reference")
    out = subprocess.run([sys.executable, "-m", "tunix_nb.train", *RUN, "--ckpt-dir", str(root / "run"),
                          "--metrics-file", str(root / "metrics.jsonl")],
                         capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    return root / "run", root / "metrics.jsonl"


def test_help_documents_every_flag(cli):
    """The command lists its subcommands; each subcommand's --help documents every flag it takes."""
    out = cli("--help")
    assert out.returncode == 0 and "{sft,distill,dpo,grpo}" in out.stdout
    parser = cli_module.build_parser()
    for command in cli_module.COMMANDS:
        sub = cli_module.command_parser(parser, command)
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in sub.format_help()
            assert action.help, f"{command} {action.option_strings or action.dest} has no help text"
    dpo_help = cli("dpo", "--help")
    assert dpo_help.returncode == 0
    for flag in ("--steps", "--batch-size", "--seed", "--ckpt-dir", "--save-every", "--keep", "--devices",
                 "--parallel", "--metrics-file", "--init-from", "--beta", "--loss-type", "--sft-weight"):
        assert flag in dpo_help.stdout
    assert "{sigmoid,ipo,hinge}" in dpo_help.stdout
    assert cli_module.DPO_LOSS_TYPES == losses.DPO_LOSS_TYPES


@pytest.mark.parametrize("args, message", [
    ([*TINY, "--steps", "0"], "argument --steps: 0 must be at least 1"),
    ([*TINY, "--batch-size", "ten"], "argument --batch-size: 'ten' is not an integer"),
    ([*TINY, "--learning-rate", "-1"], "argument --learning-rate: -1.0 must be greater than 0"),
    ([*TINY, "--parallel", "tpu"], "argument --parallel: invalid choice: 'tpu'"),
    ([*TINY, "--model", "huge"], "--model 'huge' is not a preset"),
    pytest.param([*TINY, "--devices", "8", "--parallel", "pmap", "--batch-size", "12"],
                 "--batch-size 12 does not divide by the 8 devices", marks=pytest.mark.needs_devices(8)),
    ([*TINY, "--stop-after", "9"], "--stop-after 9 is beyond --steps 4"),
    ([*TINY, "--stop-after", "2"], "--stop-after needs --ckpt-dir"),
    ([*TINY, "--beta", "0.1"], "--beta applies only to dpo, grpo and distill, not sft"),
    ([*TINY, "--length-normalize"], "--length-normalize applies only to dpo, not sft"),
    (["dpo", "--beta", "0"], "argument --beta: 0.0 must be greater than 0"),
    (["dpo", "--loss-type", "kto"], "argument --loss-type: invalid choice: 'kto'"),
    (["dpo", "--sft-weight", "-1"], "argument --sft-weight: -1.0 must be 0 or more"),
    (["dpo", "--init-from", "no/such/dir"], "--init-from no/such/dir: no checkpoint there"),
    (["dpo", "--model", "teacher"], "--model 'teacher' differs from the --init-from checkpoint's model 'student'"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_flag_values_get_clear_errors(capsys, args, message):
    """In this process (no JAX start-up per case): main() exits 2 with the message, as the CLI does."""
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main([*args, "--steps", "4"] if "--steps" not in args else args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_errors_reach_the_command_line(cli):
    out = cli(*TINY, "--steps", "4", "--loss-type", "ipo")
    assert out.returncode == 2 and "--loss-type applies only to dpo, not sft" in out.stderr


def test_runs_saves_resumes_and_keeps_metrics(cli, tmp_path):
    ckpt, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    first = cli(*TINY, "--steps", "6", "--save-every", "2", "--keep", "2", "--ckpt-dir", str(ckpt),
                "--metrics-file", str(metrics))
    assert first.returncode == 0, first.stderr
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [4, 6]  # keep=2
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6] and all("loss" in line for line in lines)
    again = cli(*TINY, "--steps", "6", "--save-every", "2", "--keep", "2", "--ckpt-dir", str(ckpt),
                "--metrics-file", str(metrics))
    assert "Resuming from the checkpoint at step 6" in again.stdout
    assert len(metrics.read_text().splitlines()) == 6


def test_incompatible_run_is_refused_and_left_untouched(cli, tmp_path):
    ckpt = tmp_path / "run"
    assert cli(*TINY, "--steps", "4", "--save-every", "2", "--ckpt-dir", str(ckpt)).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    out = cli(*TINY, "--steps", "4", "--seed", "1", "--save-every", "2", "--ckpt-dir", str(ckpt))
    assert out.returncode == 2
    assert "holds a different run (seed: saved 0, given 1)" in out.stderr and "Nothing was changed" in out.stderr
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before
    assert checkpoint.load_meta(ckpt)["step"] == 4


def test_stopping_and_resuming_at_any_step_gives_the_same_bits(cli, tmp_path, reference):
    """--stop-after 50 cuts the run between save points (another chunking); the resumed
    run restores params, optimizer state and the schedule's step count exactly."""
    ckpt, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    first = cli(*RUN, "--stop-after", "50", "--ckpt-dir", str(ckpt), "--metrics-file", str(metrics))
    assert first.returncode == 0 and "Stopped after step 50 of 240" in first.stdout
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [20, 40, 50]
    second = cli(*RUN, "--save-every", "70", "--ckpt-dir", str(ckpt), "--metrics-file", str(metrics))
    assert second.returncode == 0 and "Resuming from the checkpoint at step 50" in second.stdout
    assert compare.bitwise_equal(checkpoint.load_params(ckpt), checkpoint.load_params(reference[0]))
    assert metrics.read_text() == reference[1].read_text()  # the same batches, the same losses


def test_killed_between_saves_and_during_a_save_resumes_bitwise(cli, env, tmp_path, reference):
    ckpt, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    argv = [*RUN, "--ckpt-dir", str(ckpt), "--metrics-file", str(metrics)]
    first = preempt.run_and_kill(argv, ckpt_dir=ckpt, metrics_file=metrics, when="between_saves", after_step=30,
                               env=env, timeout=120)
    assert first["killed"] and first["in_flight"] == [], first
    second = preempt.run_and_kill(argv, ckpt_dir=ckpt, metrics_file=metrics, when="during_save",
                                after_step=first["step"], env=env, timeout=120)
    assert second["killed"] and second["in_flight"], second
    assert all((ckpt / name).is_dir() for name in second["in_flight"])  # the half-written save is left
    last = cli(*argv)
    assert last.returncode == 0, last.stderr
    assert "Resuming from the checkpoint at step" in last.stdout
    assert compare.bitwise_equal(checkpoint.load_params(ckpt), checkpoint.load_params(reference[0]))
    assert metrics.read_text() == reference[1].read_text()
    assert not list(ckpt.glob(f"*{preempt.TMP_SUFFIX}*"))  # Orbax replaced it when it saved that step


def test_damaged_latest_checkpoint_resumes_from_the_one_before(cli, tmp_path, reference):
    ckpt, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    argv = [*RUN, "--ckpt-dir", str(ckpt), "--metrics-file", str(metrics)]
    assert cli(*argv, "--stop-after", "60").returncode == 0
    data_files = [p for p in (ckpt / "60" / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    for p in data_files:
        p.write_bytes(p.read_bytes()[:10])
    damaged = {p.relative_to(ckpt / "60"): p.read_bytes() for p in (ckpt / "60").rglob("*") if p.is_file()}
    out = cli(*argv)
    assert out.returncode == 0, out.stderr
    assert "DamagedCheckpointWarning: Checkpoint at step 60 in run could not be restored (ValueError:" in out.stderr
    assert "falling back to step 40" in out.stderr
    assert "The checkpoint at step 60 is damaged: moved it aside to 60.damaged-" in out.stdout
    assert "Resuming from the checkpoint at step 40 in" in out.stdout and "(newest was 60)" in out.stdout
    moved = [p for p in ckpt.iterdir() if p.name.startswith("60.damaged-")]
    assert len(moved) == 1  # kept as it was, file for file
    assert {p.relative_to(moved[0]): p.read_bytes() for p in moved[0].rglob("*") if p.is_file()} == damaged
    assert compare.bitwise_equal(checkpoint.load_params(ckpt), checkpoint.load_params(reference[0]))
    assert metrics.read_text() == reference[1].read_text()
    # every checkpoint damaged: a clear error, and nothing is moved or changed
    for step_dir in ckpt.iterdir():
        if step_dir.name.isdigit():
            (step_dir / "meta" / "metadata").write_text("{cut short")
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    out = cli(*argv)
    assert out.returncode == 2 and "error: No checkpoint in run could be restored" in out.stderr
    assert "Nothing was changed" in out.stderr
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before


def test_dpo_from_an_sft_checkpoint_on_2_devices_then_1(cli, tmp_path, reference):
    ckpt, metrics = tmp_path / "dpo", tmp_path / "metrics.jsonl"
    argv = ["dpo", "--init-from", str(reference[0]), "--batch-size", "16", "--steps", "6", "--save-every", "3",
            "--beta", "0.2", "--loss-type", "hinge", "--sft-weight", "0.5", "--ckpt-dir", str(ckpt),
            "--metrics-file", str(metrics)]
    first = cli(*argv, "--devices", "2", "--parallel", "pmap", "--stop-after", "3")
    assert first.returncode == 0, first.stderr
    config = checkpoint.load_meta(ckpt)["config"]
    assert {k: config[k] for k in ("command", "model", "init_from", "beta", "loss_type", "sft_weight",
                                   "learning_rate")} == {
        "command": "dpo", "model": "tiny", "init_from": str(reference[0]), "beta": 0.2, "loss_type": "hinge",
        "sft_weight": 0.5, "learning_rate": 1e-3}
    second = cli(*argv)  # one device, jit
    assert second.returncode == 0, second.stderr
    assert "Resuming from the checkpoint at step 3" in second.stdout and "Done: dpo tiny, 6 steps." in second.stdout
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert all({"loss", "loss/dpo", "loss/sft", "rewards/accuracy", "rewards/margin"} <= set(line) for line in lines)
    # the first step's policy is the reference: margin 0, hinge loss 1 (+ the SFT term)
    # (the cached reference comes from another compiled program: equal up to float rounding)
    assert abs(lines[0]["rewards/margin"]) < 1e-5
    np.testing.assert_allclose(lines[0]["loss/dpo"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(lines[0]["loss"], lines[0]["loss/dpo"] + lines[0]["loss/sft"], rtol=1e-6)
    clash = cli(*[a if a != "0.2" else "0.3" for a in argv])
    assert clash.returncode == 2 and "(beta: saved 0.2, given 0.3)" in clash.stderr


def test_parallel_choices_are_the_train_modes():
    from tunix_nb import cli, train

    assert cli.PARALLEL_CHOICES == train.PARALLEL_MODES


def test_a_run_saved_under_fsdp_resumes_under_dp_and_matches_jit(tmp_path, cli):
    fsdp_dir, jit_dir = tmp_path / "fsdp", tmp_path / "jit"
    common = ["sft", "--model", "tiny", "--batch-size", "16", "--steps", "4", "--save-every", "2"]
    first = cli(*common, "--devices", "8", "--parallel", "fsdp", "--ckpt-dir", str(fsdp_dir), "--stop-after", "2")
    assert first.returncode == 0, first.stderr
    second = cli(*common, "--devices", "8", "--parallel", "dp", "--ckpt-dir", str(fsdp_dir))
    assert second.returncode == 0 and "Resuming from the checkpoint at step 2" in second.stdout, second.stderr
    ref = cli(*common, "--ckpt-dir", str(jit_dir))
    assert ref.returncode == 0, ref.stderr
    a, b = checkpoint.load_params(fsdp_dir), checkpoint.load_params(jit_dir)
    assert max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))) <= 1e-5


def test_python_m_train_executes_no_module_twice(env):
    """`python -m tunix_nb.train` runs tunix_nb/train/__main__.py; no module of the kit is
    executed a second time under another name (as a train.py run as __main__ would be)."""
    code = ("import runpy, sys\n"
            "sys.argv = ['tunix_nb.train', 'sft', '--model', 'tiny', '--steps', '2', '--batch-size', '8']\n"
            "try:\n    runpy.run_module('tunix_nb.train', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "files = [getattr(m, '__file__', None) or '' for m in list(sys.modules.values())]\n"
            "kit = [f for f in files if 'tunix_nb' in f]\n"
            "print(sorted(f for f in set(kit) if kit.count(f) > 1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_length_normalized_dpo_runs_and_is_part_of_the_run_config(tmp_path, capsys):
    """--length-normalize (what IPO wants) trains, and resuming without it is another run."""
    run = ["dpo", "--loss-type", "ipo", "--beta", "0.5", "--steps", "2", "--batch-size", "8",
           "--ckpt-dir", str(tmp_path / "ipo")]
    assert cli_module.main([*run, "--length-normalize"]) == 0
    assert checkpoint.load_meta(tmp_path / "ipo")["config"]["length_normalize"] is True
    assert cli_module.main(run) == 2
    assert "(length_normalize: saved True, given False)" in capsys.readouterr().err


def test_ctrl_c_in_process_saves_the_step_in_flight_and_resumes_bitwise(tmp_path, capsys, monkeypatch):
    """SIGINT raised in cli.main's own process (a notebook's interrupt) as step 2 is logged, off the
    save interval (5): step 3, the one in flight (steps are dispatched before the last one is logged),
    is saved, main returns 130, the handler of before is back, and the resumed run ends on the bits
    and metrics of a run never stopped. (SFT's SIGTERM through the command, to one of two processes:
    tests/test_multiprocess.py; GRPO's signals: tests/test_grpo.py.)"""
    from stop_signal_probe import signal_at_step

    from tunix_nb import tracking

    def argv(name):
        return [*TINY, "--steps", "6", "--save-every", "5", "--ckpt-dir", str(tmp_path / name),
                "--metrics-file", str(tmp_path / f"{name}.jsonl")]

    assert cli_module.main(argv("whole")) == 0
    before, log = signal.getsignal(signal.SIGINT), tracking.Trackers.log
    signal_at_step(monkeypatch, signal.SIGINT, step=2)
    assert cli_module.main(argv("cut")) == 130
    assert "Stopped by SIGINT after step 3 of 6: saved step 3" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is before
    assert sorted(int(p.name) for p in (tmp_path / "cut").iterdir() if p.name.isdigit()) == [3]
    monkeypatch.setattr(tracking.Trackers, "log", log)
    assert cli_module.main(argv("cut")) == 0
    assert "Resuming from the checkpoint at step 3" in capsys.readouterr().out
    assert compare.bitwise_equal(checkpoint.load_params(tmp_path / "whole"), checkpoint.load_params(tmp_path / "cut"))
    assert (tmp_path / "whole.jsonl").read_text() == (tmp_path / "cut.jsonl").read_text()
