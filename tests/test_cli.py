"""python -m tunix_nb.train: flags, resume, metrics file, and its errors."""

import json
import os
import subprocess
import sys

import pytest

from tunix_nb import checkpoint

TINY = ["sft", "--model", "tiny", "--batch-size", "16"]


def cli(*args, cwd=None, timeout=180):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "tunix_nb.train", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def test_help_documents_every_flag():
    out = cli("--help")
    assert out.returncode == 0
    for flag in ("--steps", "--batch-size", "--seed", "--ckpt-dir", "--save-every", "--keep", "--devices",
                 "--parallel", "--metrics-file", "--model", "--teacher", "--learning-rate"):
        assert flag in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "argument --steps: 0 must be at least 1"),
    (["--batch-size", "ten"], "argument --batch-size: 'ten' is not an integer"),
    (["--learning-rate", "-1"], "argument --learning-rate: -1.0 must be greater than 0"),
    (["--parallel", "tpu"], "argument --parallel: invalid choice: 'tpu'"),
    (["--model", "huge"], "--model 'huge' is not a preset"),
    (["--devices", "8", "--parallel", "pmap", "--batch-size", "12"], "--batch-size 12 does not divide by the 8 devices"),
])
def test_bad_flag_values_get_clear_errors(args, message):
    out = cli(*TINY, "--steps", "4", *args)
    assert out.returncode == 2
    assert message in out.stderr


def test_runs_saves_resumes_and_keeps_metrics(tmp_path):
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


def test_incompatible_run_is_refused_and_left_untouched(tmp_path):
    ckpt = tmp_path / "run"
    assert cli(*TINY, "--steps", "4", "--save-every", "2", "--ckpt-dir", str(ckpt)).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    out = cli(*TINY, "--steps", "4", "--seed", "1", "--save-every", "2", "--ckpt-dir", str(ckpt))
    assert out.returncode == 2
    assert "holds a different run (seed: saved 0, given 1)" in out.stderr and "Nothing was changed" in out.stderr
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before
    assert checkpoint.load_meta(ckpt)["step"] == 4
