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


# A checked cell (# NBVAL_CHECK_OUTPUT) prints only what holds on every machine: verdicts
# against a tolerance, exact integers, bitwise equalities, trained results that stay put.
# A difference or residual computed at run time is rounding, whose last bits differ
# between processors; it goes in a # NBVAL_IGNORE_OUTPUT cell beside an assert of its
# tolerance. A tolerance is a constant, printed right after "≤" or "<" in a verdict
# ("... ≤ 9.2e-05: True"). Other numbers below SMALL that checked cells may print, each
# with its reason:
SMALL = 1e-3
NUMBER = re.compile(r"(?<![\w.])(?<!≤ )(?<!< )[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
ALLOWED_SMALL = {
    "01_vmap_kl_distillation.ipynb": {
        r"^T=16\.0: +\|grad KL\| = 0\.00034 ": "a gradient norm the lesson shows shrinking as 1/T², "
                                               "printed to two significant digits, not a rounding residual",
        r"^beta=0\.0001 +T²·JSD 0\.0005$": "the constant beta = 1e-4, and the JSD's limit near beta = 0, "
                                           "printed to one significant digit",
        r"^beta=0\.9999 +T²·JSD 0\.0005$": "the JSD's limit near beta = 1, printed to one significant digit",
    },
    "08_grpo.ipynb": {
        r"^grpo +0\.0003 +\[600\] ":
            "GRPO's learning rate, 3e-4, a config value of the stored results/lesson08_grpo_budgets.json",
    },
    "09_hf_checkpoints.ipynb": {
        r"^rms_norm_eps +1e-06$": "a constant of the fixture's config.json",
        r"^ModelConfig\(.*norm_eps=1e-06,": "the same constant, in the kit's config",
        r"^  \w+ +largest logits difference \d\.\de-\d\d$":
            "read from the stored tests/fixtures/hf/transformers_reads_kit.json, not computed here",
    },
    "11_on_policy_distillation.ipynb": {
        r"^long (offline|on_policy): learning_rate 0\.001: ":
            "the budget pilots' learning rates (3e-4 prints 0.0003): config values of their stored records",
        r"^on-policy - offline, edit similarity: [-+]\d\.\d{4} \(95% interval":
            "the ten-seed gain read from the stored results/lesson11_gkd_count14_budgets.json, not computed here",
        r"^step +\d+: on-policy - offline, validation edit similarity [-+]\d\.\d{4} \(95% interval":
            "the gap between the validation curves stored in results/lesson11_gkd_count14_budgets.json",
    },
}


def small_numbers_not_allowed(name: str, text: str) -> list[str]:
    """The lines of a checked cell's output that hold a number in (0, SMALL) not on the allowlist."""
    allowed = ALLOWED_SMALL.get(name, {})
    return [line for line in text.splitlines()
            if any(0 < abs(float(x)) < SMALL for x in NUMBER.findall(line))
            and not any(re.search(pattern, line) for pattern in allowed)]


def checked_outputs(nb) -> list[tuple[int, str]]:
    """(code cell index, output text) of every # NBVAL_CHECK_OUTPUT cell."""
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    return [(i, "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                        for o in c["outputs"]))
            for i, c in enumerate(code) if source(c).startswith("# NBVAL_CHECK_OUTPUT")]


def test_checked_cells_print_no_rounding_residuals(notebook):
    path, nb = notebook
    for i, text in checked_outputs(nb):
        lines = small_numbers_not_allowed(path.name, text)
        assert not lines, (f"{path.name} code cell {i} is # NBVAL_CHECK_OUTPUT but prints a number below {SMALL}, "
                           f"which differs between processors: {lines}. Print a verdict against a tolerance "
                           "there, and the figure in a # NBVAL_IGNORE_OUTPUT cell with an assert of its tolerance "
                           "(or add a constant, or a value read from a stored file, to ALLOWED_SMALL with its reason)")


def test_the_residual_check_catches_a_printed_difference():
    assert small_numbers_not_allowed("03_pmap_sft.ipynb", "largest parameter difference 1.0e-06\nsteps 10")
    assert small_numbers_not_allowed("10_lora_qlora.ipynb", "relative error 0.00004 of the 0.5 travelled")
    assert not small_numbers_not_allowed("03_pmap_sft.ipynb", "largest difference ≤ 1e-4 (float32's bound): True\n0.0e+00")
    assert not small_numbers_not_allowed("09_hf_checkpoints.ipynb", "rms_norm_eps           1e-06")


def test_every_allowed_small_number_is_still_printed():
    """An allowlist entry that no longer matches anything is stale: drop it."""
    for name, patterns in ALLOWED_SMALL.items():
        nb = json.loads((REPO / "notebooks" / name).read_text())
        lines = [line for _, text in checked_outputs(nb) for line in text.splitlines()]
        for pattern in patterns:
            assert any(re.search(pattern, line) for line in lines), f"{name}: {pattern!r} matches no checked output"


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
