"""Writes the self-tests of tests/test_notebook_prose.py: each row of issue 50's table, with the
cells it names as they were at commit 409e62a (before the fixes), the outputs they refer to and
the part of results/ they quote, so that the tests need no git history (CI clones may be shallow).

Run from the repository root, in a clone that has the commit: python tests/prose_selftests/make_fixtures.py
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
COMMIT = "409e62a"
sys.path.insert(0, str(HERE.parent))
from test_notebook_prose import constants  # noqa: E402


def at_commit(path: str) -> str:
    return subprocess.run(["git", "show", f"{COMMIT}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def text_only(cell: dict, index: int) -> dict:
    """The cell with its text outputs only (no images), and its index in the stored notebook."""
    outputs = [{"text": o.get("text") or o.get("data", {}).get("text/plain", "")} for o in cell.get("outputs", [])
               if o.get("text") or "text/plain" in o.get("data", {})]
    kept = {"cell_type": cell["cell_type"], "source": "".join(cell["source"]), "index": index}
    return kept | ({"outputs": outputs} if cell["cell_type"] == "code" else {})


def bench_figures(*names):
    return lambda r: {"figures": {n: r["figures"][n] for n in names}}


def without_scores(record: dict) -> dict:
    """lesson02's record less its per-prompt scores (30,000 zeros and ones)."""
    runs = {s: {arm: [{k: v for k, v in run.items() if k not in ("scores", "agrees_with_teacher")} for run in arms[arm]]
                for arm in arms} for s, arms in record["runs"].items()}
    return record | {"runs": runs}


L01, L02, L07, L08, L11 = ("01_vmap_kl_distillation", "02_distilling_a_student", "07_benchmarks", "08_grpo",
                           "11_on_policy_distillation")
ALL = None  # every cell of the lesson: the figure must be untied in the whole of it
# (file name, row, lesson, cells, records (file, trim), caught_by, prose, outputs)
ROWS = [
    ("01_40_close_to_1", "01 [40]", L01, [38, 39, 40], [], r"^cell 40: .*close to 1.*vmap/hand-batched printed",
     "`vmap / hand-batched` stays close to 1", "[38]: B=4 vmap 0.429 ms, hand-batched 0.155 ms (2.8x)"),
    ("01_40_8_to_27_times", "01 [40] 8 to 27 times", L01, [38, 40], [], r"^cell 40: .*8 to 27 times.*loop/vmap ranges",
     "the loop was 8 to 27 times slower than `vmap` from B=4 on", "[38]: loop/vmap 16.5, 13.0, 12.6, 19.2 from B=4 on"),
    ("01_74_as_fast_as", "01 [74] as fast as", L01, [38, 74], [], r"^cell 74: .*as fast as.*vmap/hand-batched printed",
     "vmap runs as fast as the hand-batched one", "[38]: B=4 vmap 0.429 ms, hand-batched 0.155 ms (2.8x)"),
    ("01_74_further_behind", "01 [74] further behind", L01, [38, 74], [], r"^cell 74: .*further behind.*loop/\S* printed",
     "the loop falls further behind as B grows", "[38]: loop/vmap 16.5x -> 13.0x -> 12.6x -> 19.2x, flat"),
    ("02_9_shorter_than_stored", "02 [9]", L02, [8, 9], [("lesson02_distillation_budgets.json", lambda r: {"config": r["config"]})],
     r"^cell 9: .*shorter than the stored run.*'steps': 300", "shorter than the stored run (300 steps, ...)",
     "the stored config has steps: 300 too"),
    ("02_16_overfit", "02 [16] overfit", L02, [12, 15, 16], [("lesson02_distillation_budgets.json", without_scores)],
     r"^cell 16: .*then overfit.*stored curves", "the students with 100 labels alone peaked at the first checkpoint "
     "and then overfit", "every labels=100 validation curve is flat; step 75 wins a tie"),
    ("02_16_95_percent", "02 [16] 95%", L02, ALL, [("lesson02_distillation_budgets.json", without_scores)],
     r"^cell 16: untied 95%", "95% of its mass on the right token", "no cell, record or test holds it"),
    ("07_3_met", "07 [3]", L07, [3], [("bench.json", bench_figures("allreduce_share", "vmap_over_batched_ratio"))],
     r"^cell 3 prints .*allreduce_share.*rounds range .* across the target", "allreduce_share ... met",
     "the share's stored minimum is -2.5%, its maximum 5.2% against a target of 5%"),
    ("07_5_near_1", "07 [5]", L07, [3, 5, 6], [("bench.json", bench_figures("allreduce_share", "vmap_over_batched_ratio"))],
     r"^cell 5: .*stays near 1.*vmap/hand-batched printed 1\.05", "`vmap / hand-batched` stays near 1",
     "vmap's IQR is 0.64-1.15"),
    ("07_17_more_than_twice", "07 [17]", L07, [8, 16, 17], [],
     r"^cell 17: .*more than twice.*backward/forward printed \[2\.0, 1\.8\] in cell 16",
     "the backward pass still takes more than twice the forward's time", "[16]: 2.0 in FLOPs, 1.8 in time"),
    ("07_23_faster", "07 [23]", L07, [8, 23], [], r"^cell 23: .*1\.4x faster.*1\.33", "1.4x faster step",
     "[8]: 1.33 (IQR 1.31-1.37)"),
    ("08_26_between", "08 [26]", L08, [26, 27, 28, 46, 47], [], r"^cell 26: .*between 0\.02 and 0\.15.*kl printed \[0\.015, 0\.033\]",
     "the KL stays between 0.02 and 0.15", "[47]: 0.015 -> 0.033"),
    ("08_54_same_samples", "08 [54]", L08, [49, 54], [], r"^cell 54: .*on the same samples",
     "RFT trains on the same samples", "train_rft draws its own samples; [49] says the same number"),
    ("11_13_at_most_7", "11 [13]", L11, [8, 9, 10, 11, 12, 13, 14], [], r"^cell 13: .*at most 7 tokens.*prints 7",
     "answers of at most 7 tokens (eos included)", "[10]'s table has positions 0-5"),
]


def fixture(row) -> dict:
    name, label, stem, indices, records, caught_by, prose, outputs = row
    nb = json.loads(at_commit(f"notebooks/{stem}.ipynb"))
    lesson, whole = stem[:2], indices is ALL
    indices = range(len(nb["cells"])) if whole else indices
    # the whole lesson's pool of set numbers, where the row is a figure nothing ties
    solutions = at_commit(f"notebooks/solutions/lesson{lesson}.py") if whole else ""
    tests = ast.parse(at_commit("tests/test_solutions.py"))
    asserted = constants(f for f in tests.body if isinstance(f, ast.FunctionDef) and f.name.startswith(f"test_lesson{lesson}_"))
    return {"row": label, "prose": prose, "outputs": outputs, "commit": COMMIT, "lesson": stem,
            "caught_by": caught_by, "cells": [text_only(nb["cells"][i], i) for i in indices],
            "records": [trim(json.loads(at_commit(f"results/{file}"))) for file, trim in records],
            "set_numbers": sorted(constants([ast.parse(solutions)])) if solutions else [],
            "asserted": sorted(asserted)}


if __name__ == "__main__":
    for row in ROWS:
        (HERE / f"{row[0]}.json").write_text(json.dumps(fixture(row), indent=1, ensure_ascii=False) + "\n")
