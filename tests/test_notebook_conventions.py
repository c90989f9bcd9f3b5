"""Every lesson follows the notebook anatomy of CONTRIBUTING.md and is stored executed and clean."""

import ast
import json
import re
from pathlib import Path

import pytest

from tunix_nb import colab

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
MACHINE_PATH = re.compile(r"(/root/|/tmp/|/work/|/home/|/usr/local/lib/|site-packages)")


@pytest.fixture(params=NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def notebook(request):
    return request.param, json.loads(request.param.read_text())


def source(cell):
    return "".join(cell["source"])


def test_there_are_lessons():
    assert len(NOTEBOOKS) >= 5


def test_title_badge_and_setup_cell(notebook):
    path, nb = notebook
    cells = nb["cells"]
    assert source(cells[0]).startswith(f"# {path.name[:2]} · ")
    assert colab.badge(path.name) in source(cells[0])
    first_code = next(c for c in cells if c["cell_type"] == "code")
    assert source(first_code) == colab.SETUP_CELL


def test_ends_with_summary_exercises_and_references(notebook):
    _, nb = notebook
    markdown = "\n".join(source(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    positions = [markdown.find(h) for h in ("## Summary", "## Exercises", "## References")]
    assert -1 not in positions and positions == sorted(positions)
    exercises = markdown[positions[1]:positions[2]]
    assert 2 <= len(re.findall(r"^\d+\. ★", exercises, flags=re.M)) <= 4
    assert "<details><summary>Solutions</summary>" in exercises


def test_stored_executed_in_order_without_errors_or_machine_paths(notebook):
    path, nb = notebook
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    for i, cell in enumerate(code):
        for out in cell["outputs"]:
            assert out["output_type"] != "error", f"{path.name} code cell {i} stored an error"
            text = "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
            assert not MACHINE_PATH.search(text), f"{path.name} code cell {i} shows a machine path"


def test_nbval_markers_are_first_lines(notebook):
    _, nb = notebook
    for cell in nb["cells"]:
        src = source(cell)
        for marker in ("NBVAL_CHECK_OUTPUT", "NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP"):
            if marker in src and cell["cell_type"] == "code":
                assert src.startswith(f"# {marker}"), src[:80]
        if "NBVAL_IGNORE_OUTPUT" in src or "NBVAL_SKIP" in src:  # a reason is given
            assert len(src.splitlines()[0]) > len("# NBVAL_IGNORE_OUTPUT") + 3


SOLUTION_REF = re.compile(r"solutions\.(lesson\d\d)\.(\w+)")


def defined_functions(module: str) -> set:
    """Top-level function names of notebooks/solutions/<module>.py, read without importing it."""
    path = REPO / "notebooks" / "solutions" / f"{module}.py"
    if not path.exists():
        return set()
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_every_solution_names_the_function_that_checks_it(notebook):
    """Each exercise's written solution names a solutions.lessonNN function (which
    tests/test_solutions.py checks), and every function named exists."""
    path, nb = notebook
    markdown = "\n".join(source(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    exercises = markdown[markdown.find("## Exercises"):markdown.find("## References")]
    n_exercises = len(re.findall(r"^\d+\. ★", exercises, flags=re.M))
    start = exercises.find("<details><summary>Solutions</summary>")
    block = exercises[start:exercises.find("</details>", start)]
    items = re.split(r"^(?=\d+\. )", block, flags=re.M)[1:]  # one per numbered solution
    assert len(items) == n_exercises, f"{path.name}: {n_exercises} exercises but {len(items)} solutions"
    lesson = f"lesson{path.name[:2]}"
    for k, item in enumerate(items, start=1):
        refs = SOLUTION_REF.findall(item)
        assert refs, f"{path.name} solution {k} names no solutions.{lesson} function"
        for module, name in refs:
            assert module == lesson, f"{path.name} solution {k} names {module}.{name}, not a {lesson} function"
            assert name in defined_functions(module), f"{path.name} solution {k}: no function {module}.{name}"
