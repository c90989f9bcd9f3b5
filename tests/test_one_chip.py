"""One chip, one holder: every child process the kit and the lessons start leaves the TPU chip
to the process that started it (issue 45).

A TPU chip has one holder at a time; a second process that opens it dies with libtpu's
"multi-process lockfile" error. So children get `devices.child_env()` (JAX on the CPU, the
parent's PYTHONPATH kept and the kit added), or the lesson runs the command in its own
kernel. Where sockets are forbidden, lesson 06's multi-process part says so and skips.
"""

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tunix_nb import compare, devices, launch, preempt, tunix_compare
from tunix_nb.bench import compile as bench_compile
from tunix_nb.bench import remat as bench_remat

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
SITE = "/opt/where/jax/lives"  # a PYTHONPATH entry the child needs, as on the TPU machine of issue 45


@pytest.fixture
def parent_env(monkeypatch):
    """A parent on a TPU VM that simulates 8 devices and finds JAX through PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", SITE)
    monkeypatch.setenv("XLA_FLAGS", f"{devices.DEVICE_COUNT_FLAG}=8")
    monkeypatch.setenv(devices.JAX_COUNT_ENV, "8")
    monkeypatch.setenv(devices.DEVICES_ENV, "8")
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-1")


# ------------------------------------------------------------------ devices.child_env


def test_child_env_runs_jax_on_the_cpu_without_the_parents_device_count(parent_env):
    env = devices.child_env()
    assert env["JAX_PLATFORMS"] == "cpu"
    assert not {"XLA_FLAGS", devices.JAX_COUNT_ENV, devices.DEVICES_ENV} & set(env)
    assert env["TPU_ACCELERATOR_TYPE"] == "v5litepod-1"  # the rest is kept
    assert devices.child_env(XLA_FLAGS="--x=1", PYTHONUNBUFFERED="1")["XLA_FLAGS"] == "--x=1"  # overrides last


def test_child_env_adds_the_kit_to_pythonpath_and_keeps_every_entry(parent_env, monkeypatch):
    assert devices.child_env()["PYTHONPATH"].split(os.pathsep) == [devices.kit_root(), SITE]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([SITE, devices.kit_root(), "/b"]))
    assert devices.child_env()["PYTHONPATH"].split(os.pathsep) == [devices.kit_root(), SITE, "/b"]
    monkeypatch.delenv("PYTHONPATH")
    assert devices.child_env()["PYTHONPATH"] == devices.kit_root()


def test_child_env_leaves_the_accelerator_to_a_child_only_if_this_process_does_not_hold_it(parent_env, monkeypatch):
    monkeypatch.setattr(devices, "holds_accelerator", lambda: False)
    assert devices.child_env(keep_accelerator=True)["JAX_PLATFORMS"] == "tpu"
    monkeypatch.setattr(devices, "holds_accelerator", lambda: True)
    assert devices.child_env(keep_accelerator=True)["JAX_PLATFORMS"] == "cpu"


def test_a_child_finds_the_parents_pythonpath_and_the_kit(tmp_path, monkeypatch):
    """Lesson 00's bug: a child given PYTHONPATH=<the kit> alone lost the entry JAX was found through."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "found_on_pythonpath.py").write_text("WHERE = 'the parent PYTHONPATH'\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    code = ("import os, found_on_pythonpath, tunix_nb.devices as d; "
            "print(found_on_pythonpath.WHERE, '|', d.kit_root(), '|', os.environ['JAX_PLATFORMS'])")
    out = subprocess.run([sys.executable, "-c", code], env=devices.child_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"the parent PYTHONPATH | {devices.kit_root()} | cpu"


# ------------------------------------------------------------------ the kit's children


class Started(Exception):
    """Raised by a fake Popen/run once it has recorded the child's environment."""


def record_env(seen: list, result=None):
    def fake(cmd, *args, env=None, **kwargs):
        seen.append(env)
        if result is None:
            raise Started
        return subprocess.CompletedProcess(cmd, 0, stdout=result, stderr="")
    return fake


def assert_on_cpu_with_the_kit(env):
    assert env is not None and env["JAX_PLATFORMS"] == "cpu"
    assert env["PYTHONPATH"].split(os.pathsep) == [devices.kit_root(), SITE]
    assert devices.DEVICES_ENV not in env


def test_launch_starts_its_processes_with_child_env(parent_env, monkeypatch):
    seen = []
    monkeypatch.setattr(launch.subprocess, "Popen", record_env(seen))
    with pytest.raises(Started):
        launch.launch(["sft", "--parallel", "dp"], processes=2, port=1)
    assert_on_cpu_with_the_kit(seen[0])
    assert seen[0]["PYTHONUNBUFFERED"] == "1" and "XLA_FLAGS" not in seen[0]  # --devices sets the count


def test_preempt_runs_the_command_with_child_env_unless_given_one(parent_env, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(preempt.subprocess, "Popen", record_env(seen))
    for env in (None, {"MINE": "1"}):
        with pytest.raises(Started):
            preempt.run_and_kill(["sft"], ckpt_dir=tmp_path, metrics_file=tmp_path / "m.jsonl",
                                 when="between_saves", env=env)
    assert_on_cpu_with_the_kit(seen[0])
    assert seen[1] == {"MINE": "1"}


def test_the_benchs_children_run_on_the_cpu(parent_env, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")  # the compile child starts with an empty cache
    monkeypatch.setattr(subprocess, "run", record_env(seen, result=json.dumps({"x": 1})))
    assert bench_compile._compile_times_in_child(tmp_path) == {"x": 1}
    assert bench_remat._remat_memory_in_child(4, 128) == {"x": 1}
    for env in seen:
        assert_on_cpu_with_the_kit(env)
    assert "JAX_COMPILATION_CACHE_DIR" not in seen[0] and seen[0]["TUNIX_NB_BENCH_CACHE_CHILD"] == "1"
    assert seen[1]["XLA_FLAGS"] == bench_remat.MEMORY_SCHEDULER_FLAG


def test_tunix_compare_children_may_use_the_accelerator_this_process_does_not_hold(parent_env, monkeypatch):
    seen = []
    monkeypatch.setattr(devices, "holds_accelerator", lambda: False)  # its parent only starts children
    monkeypatch.setattr(subprocess, "run", record_env(seen, result=json.dumps({"x": 1})))
    assert tunix_compare.measure_in_child(1, quick=True)["x"] == 1
    assert seen[0]["JAX_PLATFORMS"] == "tpu" and "XLA_FLAGS" not in seen[0]  # the child measures the chip


# ------------------------------------------------------------------ the lessons' children


def code_cells(name: str) -> list[str]:
    cells = json.loads((NOTEBOOKS / name).read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def test_every_child_a_lesson_starts_gets_child_env():
    """Each subprocess.run/Popen call in a lesson passes env=devices.child_env(...), or a name bound to it;
    and no lesson runs `!python ...` while its kernel may hold the chip."""
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        lines = [line for cell in code_cells(path.name) for line in cell.splitlines()]
        assert not [line for line in lines if line.lstrip().startswith("!python")], path.name
        tree = ast.parse("\n".join(line for line in lines if not line.lstrip().startswith(("%", "!"))))
        from_child_env = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                          and "child_env" in ast.unparse(node.value) for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("subprocess.run", "subprocess.Popen"):
                env = {k.arg: ast.unparse(k.value) for k in node.keywords}.get("env", "")
                assert "devices.child_env(" in env or env in from_child_env, (path.name, ast.unparse(node))


def test_lesson12_runs_the_commands_in_its_kernel():
    sources = "\n".join(code_cells("12_your_model_and_data.ipynb"))
    assert "cli.main(cmd)" in sources and "generate.main(argv)" in sources
    assert "subprocess" not in sources


# ------------------------------------------------------------------ no sockets: lesson 06 skips


class NoSockets:
    """A sandbox's socket module: creating a socket is refused (the TPU test machine refuses it
    with errno 97, others at bind with errno 1)."""

    def __init__(self, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted")


def loopback_listens() -> bool:
    """Whether this machine lets a process listen on 127.0.0.1 (the device machine does not)."""
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            probe.listen(1)
        return True
    except OSError:
        return False


def test_the_loopback_probe_says_why_it_skips(monkeypatch, capsys):
    assert launch.can_listen_on_loopback() is loopback_listens()
    capsys.readouterr()
    monkeypatch.setattr(launch.socket, "socket", NoSockets)
    assert launch.can_listen_on_loopback("The multi-process part") is False
    out = capsys.readouterr().out
    assert out.startswith("The multi-process part needs a TCP socket on 127.0.0.1")
    assert "PermissionError: [Errno 1] Operation not permitted" in out and "skipped" in out


def test_lesson06_multi_process_cells_skip_cleanly_without_sockets(monkeypatch, tmp_path, capsys):
    """The lesson's cells from the probe to the end of the section, run where binding fails: no process
    is started, nothing raises, and the probe's message is the explanation."""
    cells = code_cells("06_beyond_pmap.ipynb")
    first = next(i for i, c in enumerate(cells) if "launch.can_listen_on_loopback(" in c)
    last = next(i for i, c in enumerate(cells) if "1 process x 8 devices" in c)
    monkeypatch.setattr(launch.socket, "socket", NoSockets)
    monkeypatch.setattr(launch, "launch", record_env([]))
    monkeypatch.setattr(subprocess, "run", record_env([]))
    monkeypatch.setattr(subprocess, "Popen", record_env([]))
    monkeypatch.chdir(tmp_path)
    kernel = {"devices": devices, "np": np, "compare": compare}
    for source in cells[first:last + 1]:
        if not source.startswith("%%"):
            exec(compile(source, "<lesson 06>", "exec"), kernel)
    assert kernel["MULTI_PROCESS"] is False and kernel["said"] == []
    assert "The rest of this section needs a TCP socket on 127.0.0.1" in capsys.readouterr().out
