"""The setup cell's hosted paths (Colab, Kaggle): what it installs on each runtime, and that the install works.

Colab runs notebooks from /content, with the kit cloned to /content/tunix-notebooks, and
Kaggle from /kaggle/working, with the kit cloned to /kaggle/working/tunix-notebooks, so
nothing here may depend on the working directory being the repository root.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tunix_nb import colab, devices

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "requirements-lessons.txt"
JAX_PIN = colab.pinned_version(LESSONS, "jax")
HINT_ENV = devices.HINT_ENV
KAGGLE_ENV = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "KAGGLE_URL_BASE": "https://www.kaggle.com"}


def fake_runtime(monkeypatch, **env):
    """Make accelerator_hint see only `env` (no device files, no JAX_PLATFORMS from conftest)."""
    for key in HINT_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(devices, "DEV_ROOT", "/nonexistent/dev")  # no device files


@pytest.mark.parametrize("env, jax_build", [
    ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, [f"jax[tpu]=={JAX_PIN}"]),
    ({"TPU_ACCELERATOR_TYPE": "v5litepod-1"}, [f"jax[tpu]=={JAX_PIN}"]),
    ({"ISTPUVM": "1"}, [f"jax[tpu]=={JAX_PIN}"]),
    ({"COLAB_GPU": "1"}, [f"jax[cuda12]=={JAX_PIN}"]),
    ({}, []),
], ids=["colab-tpu", "tpu-vm", "kaggle-tpu", "colab-gpu", "cpu"])
def test_pip_args_per_runtime(monkeypatch, env, jax_build):
    """The lessons' pins, JAX's build for the chip at the pinned version, the kit (editable)."""
    fake_runtime(monkeypatch, **env)
    assert shlex.split(colab.pip_args(ROOT)) == ["-r", str(LESSONS), *jax_build, "-e", str(ROOT)]


def test_pip_args_are_absolute_whatever_the_working_directory(monkeypatch):
    monkeypatch.chdir(ROOT.parent)
    assert shlex.split(colab.pip_args(ROOT.name, None)) == ["-r", str(LESSONS), "-e", str(ROOT)]


def test_jax_and_jaxlib_pins_agree():
    """jax[tpu]/jax[cuda12]==JAX_PIN require jaxlib at the same version as jax."""
    assert JAX_PIN == colab.pinned_version(LESSONS, "jaxlib")


def test_pip_args_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"accelerator='npu': use one of \['gpu', 'tpu'\], None \(CPU\) or 'auto'"):
        colab.pip_args(ROOT, "npu")
    (tmp_path / "requirements-lessons.txt").write_text("flax==0.12.8\n")
    with pytest.raises(ValueError, match="pins no jax==VERSION; add one"):
        colab.pip_args(tmp_path, "gpu")


def test_colab_module_needs_only_the_standard_library():
    """On Colab it runs before the kit's stack is installed, so it must not import it."""
    code = (f"import sys; from tunix_nb import colab; colab.pip_args({str(ROOT)!r}); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'numpy', 'flax', 'optax', 'orbax'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# The setup cell's runs fake a hosted runtime on a machine whose JAX ends on the CPU (the
# stored lesson 00 output, Colab's CPU, a TPU hint with no chip behind it). Where the tests
# run on a chip, the test process holds it and the cell's JAX would find it.
HOSTED_ON_A_CPU = "fakes a hosted runtime whose JAX ends on the CPU; on a chip the test process holds the TPU"


def run_setup_cell(tmp_path, *, on_colab=True, relocate=None, git=None, **env) -> subprocess.CompletedProcess:
    """The setup cell, run by IPython in a fresh process that looks like a hosted runtime.

    `on_colab` fakes google.colab (Kaggle is recognised by its variables, passed in `env`).
    `relocate` rewrites paths in the cell: Colab's clone to this checkout, by default.
    `!` commands and `%pip` are recorded (after IPython expands their {expressions}) and
    not run, unless `git` is given: then `!` commands run, with a fake `git` first on the
    PATH, whose shell script body `git` is ("$last" is its last argument, the clone's target).
    """
    relocate = {colab.CLONE: str(ROOT)} if relocate is None else relocate
    script = tmp_path / "hosted_cell.py"
    script.write_text(f"""
import json, subprocess, sys, types
if {on_colab!r}:
    sys.modules["google.colab"] = types.ModuleType("google.colab")
    sys.modules["google.colab"].output = types.ModuleType("google.colab.output")  # jax's debugger imports it
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
calls = []
def system(cmd):
    calls.append(["!", shell.var_expand(cmd)])
    if {git is not None!r}:
        subprocess.run(calls[-1][1], shell=True, executable="/bin/bash")
shell.system = system
shell.register_magic_function(lambda line: calls.append(["%pip", line]), "line", "pip")
from tunix_nb import colab
cell = colab.SETUP_CELL
for old, new in {relocate!r}.items():
    cell = cell.replace(old, new)
result = shell.run_cell(cell)
print("CALLS", json.dumps(calls))
sys.exit(0 if result.success else 1)
""")
    dropped = (*HINT_ENV, *KAGGLE_ENV, "XLA_FLAGS", devices.DEVICES_ENV)
    keep = {k: v for k, v in os.environ.items() if k not in dropped}
    if git is not None:
        (tmp_path / "bin").mkdir()
        fake_git = tmp_path / "bin" / "git"
        fake_git.write_text(f'#!/bin/sh\nfor last; do :; done\n{git}\n')
        fake_git.chmod(0o755)
        keep["PATH"] = f"{fake_git.parent}{os.pathsep}{keep['PATH']}"
    return subprocess.run([sys.executable, str(script)], env={**keep, **env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def recorded_calls(out: subprocess.CompletedProcess) -> list:
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("CALLS "))
    return json.loads(line[len("CALLS "):])


@pytest.mark.cpu_only(reason=HOSTED_ON_A_CPU)
def test_setup_cell_off_hosted_runtimes_prints_what_the_lessons_stored(tmp_path):
    """Neither Colab nor Kaggle (a laptop, CI): no clone, no install, and exactly the output
    the stored lessons show."""
    out = run_setup_cell(tmp_path, on_colab=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert recorded_calls(out) == []
    nb = json.loads((ROOT / "notebooks" / "00_devices_and_setup.ipynb").read_text())
    setup = next(c for c in nb["cells"] if c["cell_type"] == "code")
    stored = "".join("".join(o["text"]) for o in setup["outputs"] if o["output_type"] == "stream")
    printed = "".join(ln for ln in out.stdout.splitlines(keepends=True) if not ln.startswith("CALLS "))
    assert printed == stored


@pytest.mark.cpu_only(reason=HOSTED_ON_A_CPU)
def test_setup_cell_on_colab_cpu_installs_lessons_and_simulates(tmp_path):
    out = run_setup_cell(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert recorded_calls(out)[1] == ["%pip", f"install -q {colab.pip_args(ROOT, None)}"]
    assert "Simulating 8 CPU devices (the notebook's default" in out.stdout
    assert "backend=cpu devices=8 " in out.stdout
    assert "JAX is running on CPU" not in out.stderr


@pytest.mark.cpu_only(reason=HOSTED_ON_A_CPU)
def test_setup_cell_on_colab_tpu_installs_jax_tpu_and_warns_when_it_is_not_used(tmp_path):
    """Here there is no TPU behind the fake hint, so JAX ends on CPU: the case after Colab
    replaced JAX without a restart. The cell must say so and name the fix."""
    out = run_setup_cell(tmp_path, COLAB_TPU_ADDR="10.0.0.2:8470")
    assert out.returncode == 0, out.stdout + out.stderr
    calls = recorded_calls(out)
    assert calls[0][0] == "!" and f"git clone -q --depth 1 {colab.REPO_URL} {ROOT}" in calls[0][1]
    assert calls[1] == ["%pip", f"install -q {colab.pip_args(ROOT, 'tpu')}"]
    assert f"jax[tpu]=={JAX_PIN}" in calls[1][1]
    assert "Simulating" not in out.stdout and "backend=cpu devices=1 " in out.stdout
    assert "This runtime has a TPU, but JAX is running on CPU" in out.stderr
    assert "restart the runtime (Runtime > Restart session) and run this cell again" in out.stderr


def kaggle_working(tmp_path) -> Path:
    """A writable stand-in for /kaggle/working: where the Kaggle tests' cell clones the kit."""
    assert colab.KAGGLE_CLONE.startswith("/kaggle/working/") and colab.KAGGLE_CLONE in colab.SETUP_CELL
    working = tmp_path / "kaggle" / "working"
    working.mkdir(parents=True)
    return working / Path(colab.KAGGLE_CLONE).name


@pytest.mark.cpu_only(reason=HOSTED_ON_A_CPU)
def test_setup_cell_on_kaggle_tpu_clones_into_kaggle_working_and_installs_jax_tpu(tmp_path):
    """Kaggle's TPU v5e-8: no google.colab, Kaggle's variables, and its TPU image's ISTPUVM=1.
    The clone runs (a fake git, as if GitHub answered, links the target to this checkout);
    then the lessons' pins with JAX's TPU build. No TPU is behind the hint here, so JAX
    ends on CPU and the cell warns, as on Colab."""
    clone = kaggle_working(tmp_path)
    out = run_setup_cell(tmp_path, on_colab=False, relocate={colab.KAGGLE_CLONE: str(clone)},
                         git=f'ln -s {ROOT} "$last"', ISTPUVM="1", **KAGGLE_ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    calls = recorded_calls(out)
    assert calls[0] == ["!", f"test -d {clone} || git clone -q --depth 1 {colab.REPO_URL} {clone}"]
    assert clone.resolve() == ROOT  # the clone ran, into Kaggle's working directory
    assert calls[1] == ["%pip", f"install -q {colab.pip_args(ROOT, 'tpu')}"]
    assert f"jax[tpu]=={JAX_PIN}" in calls[1][1] and len(calls) == 2
    assert "Simulating" not in out.stdout and "backend=cpu devices=1 " in out.stdout
    assert "This runtime has a TPU, but JAX is running on CPU" in out.stderr


def test_setup_cell_on_kaggle_without_internet_says_to_switch_it_on(tmp_path):
    """A Kaggle notebook whose Internet setting is off: git cannot reach GitHub. The cell
    stops there, before any install, and says where to switch the Internet on."""
    clone = kaggle_working(tmp_path)
    no_github = (f'echo "fatal: unable to access \'{colab.REPO_URL}/\': Could not resolve host: github.com" >&2; '
                 "exit 128")
    out = run_setup_cell(tmp_path, on_colab=False, relocate={colab.KAGGLE_CLONE: str(clone)},
                         git=no_github, ISTPUVM="1", **KAGGLE_ENV)
    assert out.returncode == 1, out.stdout + out.stderr
    assert recorded_calls(out) == [["!", f"test -d {clone} || git clone -q --depth 1 {colab.REPO_URL} {clone}"]]
    assert not clone.exists()
    assert "Could not resolve host: github.com" in out.stderr  # the clone was tried; git says why it failed
    shown = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout)  # IPython colours its traceback
    assert f"RuntimeError: {colab.NO_INTERNET}" in shown
    assert "switch on Internet in the notebook's settings panel" in colab.NO_INTERNET


@pytest.mark.needs_network
def test_lessons_install_into_a_fresh_venv_from_another_directory(tmp_path):
    """The real install: exactly the setup cell's pip arguments on a CPU runtime, run from
    a working directory that is not the clone, into an empty virtual environment.

    Run by the current pip of the environment running the tests (`pip --python <fresh venv>`,
    as Colab's `%pip` is a current pip) with `--no-compile`, as tests/test_binder.py does: the
    same packages land, without the venv's bundled pip 23.2 compiling each one's bytecode,
    which was most of this test's 51-64 s on the 2-core machine."""
    venv, cwd, elsewhere = tmp_path / "venv", tmp_path / "content", tmp_path / "elsewhere"
    cwd.mkdir(), elsewhere.mkdir()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile",
                              *shlex.split(colab.pip_args(ROOT, None))],
                             cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    check = subprocess.run(
        [python, "-c", "import tunix_nb, jax, flax, optax, orbax.checkpoint, matplotlib, ipywidgets, tqdm; "
                       "from tunix_nb import devices; print(tunix_nb.__file__, jax.__version__)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.split() == [str(ROOT / "tunix_nb" / "__init__.py"), JAX_PIN]
    print(f"fresh venv + lessons install + imports: {time.perf_counter() - start:.0f} s")
