"""The lessons that depend on the device count also run top to bottom on a single device.

nbval (the main test run) executes the notebooks with 8 simulated devices; this runs
them again the way a Colab CPU runtime or a laptop without the flag sees them. Lessons
whose code never looks at the device count (everything runs on device 0 under `jit`)
take the same path with 1 device as with 8, so running them again would only add
minutes to the test command; a test below checks that they stay device-independent.
"""

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# What makes a lesson's path depend on how many devices there are.
# (calls and strategy names, not words: lesson 07 prints a stored run's "device_count" and "pmap" step)
DEVICE_DEPENDENT = re.compile(r"device_count\(|local_devices|jax\.devices|has_devices|pmap\(|\"pmap\"|make_mesh|"
                              r"shard_map|parallel_mode=\"(?!jit\")|tunix_nb\.launch|TUNIX_NB_DEVICES")
# Lesson 12 never looks at the device count either, but runs here: issue 26 asks that it run on
# one device and from any working directory, which this test does.
DEVICE_INDEPENDENT = ("01_vmap_kl_distillation.ipynb", "02_distilling_a_student.ipynb", "07_benchmarks.ipynb")


def _code(path) -> str:
    nb = nbformat.read(path, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    return "\n".join(cells[1:])  # the setup cell (the same in every lesson) picks the devices


@pytest.mark.parametrize("name", DEVICE_INDEPENDENT)
def test_skipped_lessons_never_look_at_the_device_count(name):
    found = DEVICE_DEPENDENT.findall(_code(Path(NOTEBOOKS[0]).parent / name))
    assert not found, f"{name} now uses {sorted(set(found))}: run it on one device too (drop it from DEVICE_INDEPENDENT)"


def test_the_device_check_sees_device_code():
    assert DEVICE_DEPENDENT.search(_code(next(p for p in NOTEBOOKS if p.name.startswith("03_"))))


@pytest.mark.cpu_only(reason="one simulated CPU device through a Jupyter kernel; on a chip the lesson record "
                             "(python -m tunix_nb.lessons run) runs each lesson on the one chip, in-process")
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name not in DEVICE_INDEPENDENT],
                         ids=lambda p: p.name)
def test_notebook_runs_on_one_device(path, monkeypatch, tmp_path):
    """Run from a fresh working directory, not notebooks/ (Colab's is /content), so that
    nothing reads a path relative to the notebook's folder."""
    from nbclient import NotebookClient  # Jupyter's, which the chip's lesson install does not hold

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("TUNIX_NB_DEVICES", "1")  # the setup cell then simulates 1 device
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    setup_cell = next(c for c in nb.cells if c.cell_type == "code")
    setup_output = "".join(o.get("text", "") for o in setup_cell.outputs if o.get("output_type") == "stream")
    assert "devices=1 " in setup_output, setup_output
