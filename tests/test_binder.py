"""binder/ builds a working environment the way repo2docker does, and binder/start gives 8 devices.

What repo2docker does with this repository (its Python buildpack): because binder/
exists, it reads only binder/ (the top-level requirements.txt is not looked at on its
own, and no setup.py/pyproject install happens). binder/runtime.txt picks the Python
version. binder/requirements.txt names a local file (`-r ../requirements.txt`, which in
turn has `-e .`), so repo2docker copies the whole repository first and then runs
`pip install --no-cache-dir -r "binder/requirements.txt"` from the repository root (its
working directory); pip resolves `-r` relative to the requirements file and `-e .`
relative to the working directory, i.e. the repository root. binder/start becomes the
image's entrypoint: it runs before the Jupyter server and every other process, and must
end with `exec "$@"`.

This test repeats that in a fresh virtual environment made from a copy of the
repository's files, then runs `binder/start python -c ...` in an environment without
XLA_FLAGS and expects 8 devices (and 1 without binder/start, so the 8 is start's doing).

Speed (measured on the 2-core machine): the install runs the current pip of the
environment running the tests (`pip --python <fresh venv>`, as repo2docker also runs a
current pip) with `--no-compile`; both only change how fast the same packages land, not
which. That is 25-40 s (the resolver, about 50 downloads, unpacking), against 75-110 s
for the venv's bundled pip 23.2 with bytecode compilation. pip's cache does not help
here: the package index answers without cache headers, so pip stores nothing.
"""

import os
import re
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PIP_TIMEOUT_S = 600
RUN_TIMEOUT_S = 120
PRINT_DEVICES = "import jax, tunix_nb; print(jax.device_count(), jax.default_backend(), tunix_nb.__file__)"
# Variables that would leak this test run's own setup into the fresh environment:
# conftest.py sets XLA_FLAGS and JAX_PLATFORMS; the outer venv sets VIRTUAL_ENV.
LEAKY_ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "TUNIX_NB_DEVICES", "VIRTUAL_ENV", "PYTHONPATH",
             "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")


def _repo_files() -> list[Path]:
    """The files a clone of the repository has (tracked and new, not ignored)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
        return [Path(p) for p in out.decode().split("\0") if p and (ROOT / p).is_file()]
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout: walk the tree
        skip = {".git", "__pycache__", ".ipynb_checkpoints", "runs", "checkpoints", "build"}
        return [p.relative_to(ROOT) for p in ROOT.rglob("*")
                if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
                and not any(part.startswith(".venv") or part.endswith(".egg-info")
                            for part in p.relative_to(ROOT).parts)]


def _copy_repo(dest: Path) -> None:
    for rel in _repo_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)  # copy2 keeps binder/start executable


def _pip_version() -> tuple[int, ...]:
    try:
        from pip import __version__
    except ImportError:
        return (0,)
    return tuple(int(x) for x in re.findall(r"\d+", __version__)[:2])


def _clean_env(venv_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV}
    env["PATH"] = f"{venv_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_binder_files_follow_repo2docker_conventions():
    binder = ROOT / "binder"
    runtime = (binder / "runtime.txt").read_text().strip()
    assert re.fullmatch(r"python-3\.\d+", runtime), f"binder/runtime.txt: {runtime!r}, want e.g. python-3.11"
    reqs = [line.split("#")[0].strip() for line in (binder / "requirements.txt").read_text().splitlines()]
    assert "-r ../requirements.txt" in reqs, "binder/requirements.txt must reuse the pins: -r ../requirements.txt"
    start = binder / "start"
    assert os.access(start, os.X_OK), "binder/start must be executable (git mode 100755)"
    lines = [line.strip() for line in start.read_text().splitlines() if line.strip()]
    assert lines[0].startswith("#!"), "binder/start needs a shebang line"
    assert lines[-1] == 'exec "$@"', "binder/start must end with exec \"$@\" (repo2docker's entrypoint contract)"


@pytest.mark.needs_network
def test_binder_start_gives_eight_devices_in_a_fresh_venv(tmp_path):
    repo, venv_dir = tmp_path / "repo", tmp_path / "venv"
    _copy_repo(repo)
    t0 = time.perf_counter()
    outer_pip_ok = _pip_version() >= (22, 3)  # `pip --python` needs pip 22.3 or newer
    venv.EnvBuilder(with_pip=not outer_pip_ok, clear=True).create(venv_dir)
    env = _clean_env(venv_dir)
    python = str(venv_dir / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python] if outer_pip_ok else [python, "-m", "pip"]
    t_venv = time.perf_counter()
    # As repo2docker does it: from the repository root, binder/'s requirements file.
    install = subprocess.run([*pip, "install", "--quiet", "--no-compile", "-r", "binder/requirements.txt"],
                             cwd=repo, env=env, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    assert install.returncode == 0, f"pip install -r binder/requirements.txt failed:\n{install.stdout}\n{install.stderr}"
    t_pip = time.perf_counter()

    with_start = subprocess.run([str(repo / "binder" / "start"), "python", "-c", PRINT_DEVICES],
                                cwd=repo, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert with_start.returncode == 0, with_start.stderr
    count, backend, module = with_start.stdout.split()
    assert (count, backend) == ("8", "cpu"), with_start.stdout
    # `-e .` resolved against the repository root: the kit imports from the copy, editable.
    assert Path(module).resolve().is_relative_to(repo.resolve()), module

    without_start = subprocess.run(["python", "-c", PRINT_DEVICES], cwd=repo, env=env,
                                   capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert without_start.returncode == 0, without_start.stderr
    assert without_start.stdout.split()[0] == "1", without_start.stdout
    t_end = time.perf_counter()
    print(f"binder: venv {t_venv - t0:.1f} s, pip install {t_pip - t_venv:.1f} s, "
          f"two device-count runs {t_end - t_pip:.1f} s", file=sys.stderr)
