"""Every figure a lesson's prose quotes is one the lesson printed, one it was given, or one stored in results/.

The README's figures are checked one by one (test_readme_figures.py); a lesson's markdown
quotes many more, often right under the cell that printed them. A figure here is a number
in markdown with a decimal point or an exponent (0.83, 2.4e-07), a percentage (12.5%), a
ratio (1.67x), or a number with thousands separators (127,872); counts and indices (8
devices, step 300, lesson 03) are not. Each must be, at the precision the prose prints it:

- printed by one of the notebook's code cells (its stored outputs), possibly as a
  fraction the prose gives in percent, or in the unit the prose names (k, M, B, MB, GB);
- written in one of its code cells or in its exercises' solution code (a setting the
  lesson or an exercise chose, such as a learning rate);
- asserted by its exercises' tests (`tests/test_solutions.py`, the `test_lessonNN_...` functions),
  which keep an exercise's answer in step with its solution;
- stored in a part of results/ the lesson quotes (`QUOTES_RESULTS`);
- or a number that is no measurement at all, listed in `NOT_MEASURED` with the phrase
  around it and why (a section of a cited book, a published hardware constant).

Code spans, math and link targets are left out: they are code and formulas, not claims.
When this test fails, print the figure from the computed value in a cell and quote what
it printed, or say in prose what you cannot store.
"""

from __future__ import annotations

import ast
import json
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))

# A figure in prose (see the module docstring); the look-behind keeps the digits inside
# names, sections and identifiers out ("Qwen3-0.6B", "§10.1.2", "arXiv:2306.13649").
FIGURE = re.compile(r"(?<![\w.\-/§:])(\d{1,3}(?:,\d{3})+|\d+\.\d+(?:e[-+]?\d+)?|\d+(?:\.\d+)?e[-+]?\d+"
                    r"|\d+(?:\.\d+)?(?=\s?%)|\d+(?:\.\d+)?(?=\s?[x×](?!\w)))(\s?(?:%|[x×]|[kMB]\b|[KMG]i?B\b)?)")
NOT_PROSE = re.compile(r"```.*?```|`[^`\n]*`|\$\$.*?\$\$|\$[^$\n]*\$|\]\([^)]*\)|<[^>\n]+>", re.S)
PRINTED = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
# a figure with a unit matches a printed number in that unit, or in ones (bytes, parameters)
UNIT_SCALES = {"%": (1, 100), "k": (1, 1e-3), "M": (1, 1e-6), "B": (1, 1e-9), "KB": (1, 1e-3), "MB": (1, 1e-6),
               "GB": (1, 1e-9), "KiB": (1, 2 ** -10), "MiB": (1, 2 ** -20), "GiB": (1, 2 ** -30)}

# notebook -> the parts of results/ its prose quotes (a file, or a file and a key path)
QUOTES_RESULTS = {
    "02_distilling_a_student": [("lesson02_distillation.json",)],
    "07_benchmarks": [("bench.json",)],
    "08_grpo": [("lesson08_grpo.json",)],
    "09_hf_checkpoints": [("memory.json", "rows")],
    "10_lora_qlora": [("bench.json", "figures", "lora_exact_match_over_full"),
                      ("bench.json", "figures", "lora_optimizer_state_share"),
                      ("bench.json", "figures", "lora_step_time_ratio")],
    "11_on_policy_distillation": [("lesson11_gkd.json",), ("lesson11_gkd_count.json",),
                                  ("lesson11_gkd_small_student.json",), ("lesson11_gkd_small_student_1000_steps.json",),
                                  ("lesson11_gkd_count14.json",)],
}

# notebook -> {a phrase of its prose, literally: why the number in it is no measurement}
NOT_MEASURED: dict[str, dict[str, str]] = {
    "06_beyond_pmap": {"since JAX 0.8": "a release of JAX"},
}


def notebook(path: Path) -> dict:
    return json.loads(path.read_text())


def prose_figures(nb: dict) -> list[tuple[int, str, str, str]]:
    """(cell index, the figure, its unit, the sentence around it) for every figure in the markdown."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        text = " ".join(NOT_PROSE.sub(" ", "".join(cell["source"])).split())
        for m in FIGURE.finditer(text):
            found.append((i, m.group(1), m.group(2).strip(), text[max(0, m.start() - 70):m.end() + 30]))
    return found


def outputs_text(nb: dict) -> str:
    texts = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            t = out.get("text") or out.get("data", {}).get("text/plain") or ""
            texts.append("".join(t) if isinstance(t, list) else t)
    return "\n".join(texts)


def numbers_in(text: str) -> set[float]:
    return {float(s.replace(",", "")) for s in PRINTED.findall(text)}


def numbers_in_record(node) -> set[float]:
    if isinstance(node, dict):
        return set().union(*map(numbers_in_record, node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*map(numbers_in_record, node)) if node else set()
    return {abs(float(node))} if isinstance(node, (int, float)) and not isinstance(node, bool) else set()


def constants(nodes) -> set[float]:
    return {abs(float(node.value)) for tree in nodes for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and type(node.value) in (int, float)}


def asserted_by_exercise_tests(lesson: str) -> set[float]:
    """The numbers written in tests/test_solutions.py's tests of lesson `lesson` ("03")."""
    tree = ast.parse((ROOT / "tests" / "test_solutions.py").read_text())
    return constants(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith(f"test_lesson{lesson}_"))


def set_in_solutions(lesson: str) -> set[float]:
    """The numbers written in the lesson's solution code (notebooks/solutions/lessonNN.py)."""
    path = ROOT / "notebooks" / "solutions" / f"lesson{lesson}.py"
    return constants([ast.parse(path.read_text())]) if path.exists() else set()


@cache
def sources(path: Path) -> tuple[frozenset, frozenset]:
    """(numbers the notebook printed, stored results or exercise tests hold, numbers its code cells write)."""
    nb = notebook(path)
    known = numbers_in(outputs_text(nb))
    for file, *keys in QUOTES_RESULTS.get(path.stem, []):
        node = json.loads((ROOT / "results" / file).read_text())
        for key in keys:
            node = node[key]
        known |= numbers_in_record(node)
    known |= asserted_by_exercise_tests(path.stem[:2])
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    return frozenset(known), frozenset(numbers_in(code) | set_in_solutions(path.stem[:2]))


def at_precision(figure: str, value: float) -> bool:
    """Whether `value` printed like `figure` (its decimals, or its mantissa's) reads `figure`."""
    text = figure.replace(",", "")
    if "e" in text:
        mantissa = text.split("e")[0]
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return f"{value:.{decimals}e}" == f"{float(text):.{decimals}e}"
    decimals = len(text.split(".")[1]) if "." in text else 0
    return f"{value:.{decimals}f}" == f"{float(text):.{decimals}f}"


def is_traced(path: Path, figure: str, unit: str) -> bool:
    known, written = sources(path)
    scales = UNIT_SCALES.get(unit, (1,))
    if any(at_precision(figure, v * s) for v in known for s in scales):
        return True
    return float(figure.replace(",", "")) in written


def untraced(path: Path) -> list[str]:
    allowed = NOT_MEASURED.get(path.stem, {})
    return [f"cell {i}: {figure}{unit} in “…{around}…”" for i, figure, unit, around in prose_figures(notebook(path))
            if not is_traced(path, figure, unit) and not any(phrase in around for phrase in allowed)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def test_every_figure_in_the_prose_is_printed_set_or_stored(path):
    missing = untraced(path)
    assert not missing, (f"notebooks/{path.name} quotes figures no cell printed, set or stored "
                         "(print each from its computed value and quote the output):\n" + "\n".join(missing))


def test_not_measured_phrases_still_occur():
    for stem, phrases in NOT_MEASURED.items():
        text = " ".join(" ".join("".join(c["source"]) for c in notebook(ROOT / "notebooks" / f"{stem}.ipynb")["cells"]
                                 if c["cell_type"] == "markdown").split())
        gone = [p for p in phrases if p not in text]
        assert not gone, f"NOT_MEASURED lists phrases notebooks/{stem}.ipynb no longer has: {gone}"


def test_a_misquoted_figure_is_caught():
    """Lesson 10's prose as it was: rank 16 "63.0%" where its table printed 62.5%."""
    nb = {"cells": [{"cell_type": "code", "source": "print(r)", "outputs": [{"text": "rank 16  62.5%\n"}]},
                    {"cell_type": "markdown", "source": "Rank 16 and full fine-tuning reach 63.0% both."}]}
    figures = prose_figures(nb)
    assert [(f, u) for _, f, u, _ in figures] == [("63.0", "%")]
    assert not any(at_precision("63.0", v * s) for v in numbers_in(outputs_text(nb)) for s in (1, 100))
    assert at_precision("62.5", 0.625 * 100) and at_precision("2.4e-07", 2.4e-7) and not at_precision("12", 12.6)
