"""Every lesson also runs top to bottom on a single device, with no XLA flag set.

nbval (the main test run) executes the notebooks with 8 simulated devices; this runs
them again the way a Colab CPU runtime or a laptop without the flag sees them.
"""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_on_one_device(path, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("TUNIX_NB_DEVICES", "1")  # the setup cell then skips simulation
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    setup_cell = next(c for c in nb.cells if c.cell_type == "code")
    setup_output = "".join(o.get("text", "") for o in setup_cell.outputs if o.get("output_type") == "stream")
    assert "devices=1 " in setup_output, setup_output
