"""Tests for tunix_nb.progress: in a Jupyter kernel the saved output is the bar's last line."""

from __future__ import annotations

import pytest

from tunix_nb import progress


def test_outside_a_kernel_it_is_tqdms_text_bar():
    with progress.bar(total=3, desc="steps", disable=True) as bar:
        assert type(bar) is progress.text_tqdm


@pytest.mark.cpu_only(reason="a Jupyter kernel needs TCP sockets, which the chip's machine refuses")
def test_a_saved_notebook_keeps_the_bars_last_line_not_its_first():
    """What GitHub shows of a finished loop: 40/40, where tqdm's widget stored 0/40."""
    import nbformat
    from nbclient import NotebookClient  # Jupyter's, which the chip's lesson install does not hold

    cell = ("from tunix_nb import progress\n"
            "for _ in progress.bar(range(40), desc='train'):\n"
            "    pass\n")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    NotebookClient(notebook, timeout=120, kernel_name="python3").execute()
    outputs = notebook.cells[0].outputs
    assert len(outputs) == 1, outputs  # one display, updated in place
    text = outputs[0]["data"]["text/plain"]
    assert text.startswith("train: 100%|") and "40/40" in text, text
    assert "application/vnd.jupyter.widget-view+json" not in outputs[0]["data"]
