"""The headless lesson runner (`python -m tunix_nb.lessons`), and the records it stored.

The runner is checked end to end on tiny synthetic notebooks (no lesson runs here). Each record
in results/lesson_runs/ must be well formed, cover every lesson, name a commit in the history
whose notebooks and `tunix_nb` hash to what it recorded, and appear in the README's table. A
record not made yet is skipped with the command that makes it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
import warnings
from pathlib import Path

import pytest

from tunix_nb.lessons import carry_forward, hashes, records, runner, time_gap
from tunix_nb.lessons.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / records.RECORDS_DIR
STOPPED_12 = RECORDS / "lesson12_at_02b33c8"  # lesson 12's stop on the chip
CHIP_RECORD = "tpu_v5e_1.json"
LESSONS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RECORD_NAMES = sorted(set(records.ORDER) | {p.name for p in RECORDS.glob("*.json")})


def write_notebook(path: Path, cells: list[str]) -> Path:
    cell = lambda source: {"cell_type": "code", "source": source, "metadata": {}, "outputs": [],  # noqa: E731
                           "execution_count": None}
    path.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {},
                                "cells": [{"cell_type": "markdown", "source": "# A lesson", "metadata": {}},
                                          *map(cell, cells)]}))
    return path


def test_the_runner_runs_magics_and_stops_at_the_first_failing_cell(tmp_path, monkeypatch):
    # the entries already there stay (on some machines JAX itself is found through them)
    kept = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e and e != str(ROOT)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*kept, "/kept/entry"]))
    write_notebook(tmp_path / "00_synthetic.ipynb", [
        "out = !echo hello\nassert out == ['hello'], out",
        "%%writefile made.txt\nwritten",
        "import os, matplotlib, tunix_nb\n"
        "assert open('made.txt').read() == 'written\\n' and matplotlib.get_backend().lower() == 'agg'\n"
        f"assert os.environ['PYTHONPATH'].split(os.pathsep) == {[str(ROOT), *kept, '/kept/entry']!r}\n"
        f"assert tunix_nb.__file__.startswith({str(ROOT)!r})",
        "1 / 0",
        "print('never runs')"])
    out = tmp_path / "run.json"
    assert main(["run", "--notebooks", str(tmp_path), "--out", str(out), "--timeout", "60"]) == 1
    record = json.loads(out.read_text())
    assert records.problems(record) == [] and record["schema"] == runner.SCHEMA
    [lesson] = record["lessons"]
    assert (lesson["lesson"], lesson["failed_cell"], lesson["completed"], lesson["timed_out"]) == \
        ("00_synthetic", 3, False, False)
    assert lesson["error"] == "ZeroDivisionError: division by zero"
    assert [cell["index"] for cell in lesson["cells"]] == [0, 1, 2, 3] and lesson["code_cells"] == 5
    assert lesson["backend"] is None  # the notebook never started JAX, and the runner does not either
    assert lesson["notebook_sha256"] == hashes.notebook_hash((tmp_path / "00_synthetic.ipynb").read_text())
    assert record["command"].startswith("python -m tunix_nb.lessons run --notebooks")
    assert f"| 0 of 1 (stopped: 00 at cell 3) | {record['date'][:10]} |" in records.render_table({"x.json": record})


def test_a_lesson_past_its_timeout_is_killed_and_its_cell_recorded(tmp_path):
    write_notebook(tmp_path / "07_slow.ipynb", ["x = 1", "import time\ntime.sleep(60)", "y = 2"])
    lines = []
    record = runner.run_lessons(["7"], notebooks=tmp_path, timeout_s=5, echo=lines.append)
    [lesson] = record["lessons"]
    assert lesson["timed_out"] and not lesson["completed"] and lesson["failed_cell"] == 1
    assert [cell["index"] for cell in lesson["cells"]] == [0] and lesson["process_seconds"] < 30
    assert lines == [runner.progress_line(lesson)] and "stopped at code cell 1: Timeout" in lines[0]
    assert records.outcome(record) == "0 of 1 (stopped: 07 at cell 1, timed out)"


def test_lessons_are_chosen_by_number_or_name(tmp_path):
    for name in ("00_a", "03_b", "12_c"):
        write_notebook(tmp_path / f"{name}.ipynb", ["pass"])
    assert [p.stem for p in runner.find_notebooks(tmp_path, ["3", "12_c"])] == ["03_b", "12_c"]
    assert len(runner.find_notebooks(tmp_path)) == 3
    with pytest.raises(ValueError, match="no lesson"):
        runner.find_notebooks(tmp_path, ["05"])


def test_a_notebooks_hash_counts_its_code_cells_only(tmp_path):
    path = write_notebook(tmp_path / "00_a.ipynb", ["x = 1\n", "!echo hi"])
    notebook = json.loads(path.read_text())
    notebook["cells"][1]["source"] = ["x = ", "1\n"]  # nbformat's list-of-lines form of the same source
    notebook["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "run"}]
    notebook["cells"][0]["source"] = "# Another title"
    expected = hashlib.sha256(json.dumps(["x = 1\n", "!echo hi"]).encode()).hexdigest()
    assert hashes.notebook_hash(path.read_text()) == hashes.notebook_hash(json.dumps(notebook)) == expected


@pytest.mark.needs_git
def test_the_package_hash_reads_committed_files_byte_for_byte():
    """`git cat-file --batch`'s answer, split into files, against `git archive` of the same commit."""
    archive = subprocess.run(["git", "archive", "HEAD", "tunix_nb"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        expected = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".py")}
    assert hashes.package_files_at("HEAD") == expected and len(expected) > 10


def stored(name: str) -> dict:
    path = RECORDS / name
    if not path.exists():
        pytest.skip(f"{records.RECORDS_DIR}/{name} is not recorded yet: `python -m tunix_nb.lessons run "
                    f"--out {records.RECORDS_DIR}/{name}` on that machine makes it")
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", RECORD_NAMES)
def test_a_record_is_well_formed_and_covers_every_lesson(name):
    record = stored(name)
    assert records.problems(record) == [] and record["schema"] == runner.SCHEMA
    assert [lesson["lesson"] for lesson in record["lessons"]] == LESSONS and record["notebooks"] == "notebooks"
    backend = name.split("_")[0]  # tpu_..., cpu_..., gpu_...
    started = {lesson["backend"] for lesson in record["lessons"] if lesson["backend"]}
    assert started <= {backend}, f"{name} holds runs on {started}"


@pytest.mark.needs_git
@pytest.mark.parametrize("name", RECORD_NAMES)
def test_a_record_matches_the_notebooks_and_package_at_its_commit(name):
    assert_made_at_its_commit(stored(name), name)


def assert_made_at_its_commit(record: dict, name: str) -> None:
    commit = record["commit"]
    assert commit and not record["dirty"], f"{name} was made from uncommitted notebooks or tunix_nb"
    # (dirty is None where the tree was a copy without git, given --commit: the hashes below are the check)
    exists = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
    assert exists.returncode == 0, f"{name}'s commit {commit} is not in this repository's history"
    assert hashes.package_hash(hashes.package_files_at(commit)) == record["tunix_nb_sha256"]
    for lesson in record["lessons"]:
        at_commit = hashes.notebook_hash_at(commit, f"notebooks/{lesson['lesson']}.ipynb")
        assert at_commit == lesson["notebook_sha256"], f"{name}: {lesson['lesson']} differs from {commit[:7]}'s"


def test_the_readme_table_is_the_records():
    readme = (ROOT / "README.md").read_text()
    assert records.readme_table(readme) == records.render_table(records.load_records()), \
        "README's 'Runs on' table is stale: run `python -m tunix_nb.lessons table --readme README.md`"


def test_list_the_lessons_changed_since_the_chips_record():
    """Never fails: CI has no TPU to run them again. It warns with the lessons to rerun on the chip."""
    record = stored(CHIP_RECORD)
    changed = [lesson["lesson"] for lesson in record["lessons"]
               if hashes.notebook_hash((ROOT / "notebooks" / f"{lesson['lesson']}.ipynb").read_bytes())
               != lesson["notebook_sha256"]]
    package_changed = hashes.package_hash(hashes.package_files()) != record["tunix_nb_sha256"]
    if changed or package_changed:
        message = (f"since {CHIP_RECORD} ({record['commit'][:7]}), code cells changed in {changed or 'no lesson'}"
                   f"{' and tunix_nb changed' if package_changed else ''}: rerun them on the chip")
        print(message)
        warnings.warn(message)


def test_records_name_no_machine_paths(monkeypatch):
    monkeypatch.setenv("OUT", "/device/out/")
    command = f"python -m tunix_nb.lessons run --out /device/out/x.json --notebooks {ROOT}/notebooks --logs {Path.home()}/l"
    assert runner.scrub(command) == "python -m tunix_nb.lessons run --out $OUT/x.json --notebooks notebooks --logs ~/l"


def test_each_cell_records_its_compiles_and_the_slowest_cells_are_listed(tmp_path):
    write_notebook(tmp_path / "01_compiles.ipynb", [
        "import jax, jax.numpy as jnp",
        "f = jax.jit(lambda x: jnp.sin(x) * 2.0)\nf(jnp.ones(3)).block_until_ready()",
        "f(jnp.ones(3)).block_until_ready()  # cached: no compile",
        "import time\ntime.sleep(0.3)"])
    record = runner.run_lessons(["1"], notebooks=tmp_path, timeout_s=120, echo=lambda line: None)
    [lesson] = record["lessons"]
    assert lesson["completed"] and records.problems(record) == []
    first, jitted, cached, sleep = lesson["cells"]
    assert first["compiles"] is None  # JAX was imported by this cell: listening starts after it
    assert jitted["compiles"] >= 1 and jitted["compile_seconds"] > 0
    assert cached["compiles"] == 0 and sleep["compiles"] == 0
    assert lesson["slowest_cells"][0]["index"] in (0, 1, 3) and len(lesson["slowest_cells"]) == 4
    assert [c["seconds"] for c in lesson["slowest_cells"]] == sorted((c["seconds"] for c in lesson["cells"]),
                                                                      reverse=True)


def test_profile_keeps_the_top_functions_of_slow_cells_only(tmp_path):
    write_notebook(tmp_path / "02_profiled.ipynb", [
        "def busy_wait(seconds):\n    import time\n    end = time.perf_counter() + seconds\n"
        "    while time.perf_counter() < end:\n        pass\nbusy_wait(0.6)",
        "x = 1"])
    record = runner.run_lessons(["2"], notebooks=tmp_path, timeout_s=120, profile_min_seconds=0.5,
                                echo=lambda line: None)
    slow, fast = record["lessons"][0]["cells"]
    assert record["profile_min_seconds"] == 0.5 and "profile" not in fast
    assert any("busy_wait" in row["function"] and row["cumulative_seconds"] >= 0.5 for row in slow["profile"])
    assert not any(str(ROOT) in row["function"] for row in slow["profile"])  # no machine paths
    assert not any(row["function"].startswith("IPython/") for row in slow["profile"])  # the cell's plumbing
    # by own time: the busy loop spends its seconds in itself and in the clock it reads
    assert sum(row["own_seconds"] for row in slow["profile_own_time"]
               if "busy_wait" in row["function"] or "perf_counter" in row["function"]) >= 0.5


def test_the_quick_compile_figures_are_the_chips_measurement():
    """`devices.use_quick_compile` quotes results/compile_costs/effort_tpu.json."""
    from tunix_nb import devices

    chip = json.loads((ROOT / "results" / "compile_costs" / "effort_tpu.json").read_text())["settings"]
    default, quick = chip["default"], chip["effort-1"]
    assert default["backend"] == quick["backend"] == "tpu"
    assert quick["env"] == {devices.COMPILE_EFFORT_ENV: devices.QUICK_COMPILE_EFFORT}
    step, decode = "agreement/sft_step", "agreement/greedy_generate"
    said = " ".join(devices.use_quick_compile.__doc__.split())
    for phrase in (f"compiles in {quick[step]['compile_s']:.1f} s instead of {default[step]['compile_s']:.1f}",
                   f"decoder in {quick[decode]['compile_s']:.1f} s instead of {default[decode]['compile_s']:.1f}",
                   f"run in {quick[step]['run_median_ms']:.1f} ms instead of {default[step]['run_median_ms']:.1f}",
                   f"{quick[decode]['run_median_ms']:.1f} ms instead of {default[decode]['run_median_ms']:.1f}"):
        assert phrase in said, phrase
    assert quick[step]["compile_s"] < 0.7 * default[step]["compile_s"]


def test_parts_made_from_one_commit_merge_into_one_record(tmp_path):
    for name in ("00_a", "01_b", "02_c"):
        write_notebook(tmp_path / f"{name}.ipynb", ["x = 1"])
    commit = "0" * 40
    parts = []
    for lessons in (["2"], ["0", "1"]):
        out = tmp_path / f"part_{lessons[0]}.json"
        assert main(["run", *lessons, "--notebooks", str(tmp_path), "--out", str(out), "--commit", commit]) == 0
        parts.append(out)
    merged = tmp_path / "merged.json"
    assert main(["merge", *map(str, parts), "--out", str(merged)]) == 0
    record = json.loads(merged.read_text())
    assert records.problems(record) == [] and record["commit"] == commit and record["dirty"] is None
    assert [lesson["lesson"] for lesson in record["lessons"]] == ["00_a", "01_b", "02_c"]
    assert record["command"].count("tunix_nb.lessons run") == 2
    other = {**json.loads(parts[0].read_text()), "commit": "1" * 40}
    with pytest.raises(ValueError, match="record 2 has commit '1111111"):
        records.merge([json.loads(parts[1].read_text()), other])
    with pytest.raises(ValueError, match=r"a lesson appears in two records: \['02_c'\]"):
        records.merge([json.loads(parts[0].read_text())] * 2)


def test_the_time_gap_table_is_the_records():
    readme = (RECORDS / "README.md").read_text()
    chip, cpu = stored(records.ORDER[0]), stored(records.ORDER[1])
    assert time_gap.readme_part(readme) == time_gap.render(chip, cpu, ("chip", "CPU")), \
        "results/lesson_runs/README.md's time table is stale: run `python -m tunix_nb.lessons gap --readme " \
        "results/lesson_runs/README.md`"


def test_the_time_gap_counts_compiling_and_waiting_on_children_in_profiled_cells():
    def lesson(seconds, cells, slowest):
        return {"lesson": "00_a", "cells_seconds": seconds, "cells": cells, "slowest_cells": slowest}

    wait = {"function": "~:0(<method 'poll' of 'select.poll' objects>)", "own_seconds": 4.0}
    other = {"function": "x.py:1(f)", "own_seconds": 9.0}
    chip = {"lessons": [lesson(12.0, [{"index": 0, "compiles": 3}, {"index": 1, "compiles": 2}],
                               [{"index": 0, "trace_seconds": 1.0, "lower_seconds": 0.5, "compile_seconds": 2.0,
                                 "profile_own_time": [wait, other]}])]}
    cpu = {"lessons": [lesson(7.0, [{"index": 0, "compiles": 4}], [])]}
    [row] = time_gap.rows(chip, cpu)
    assert row["seconds"] == (12.0, 7.0) and row["compiles"] == (5, 4)
    assert row["compiling"] == (3.5, 0.0) and row["child_wait"] == (4.0, 0.0)
    assert "| 00 | 12.0 / 7.0 | +5.0 | 5 / 4 | 3.5 / 0.0 | 4.0 / 0.0 |" in time_gap.render(chip, cpu, ("a", "b"))


def test_the_child_cost_figures_are_the_two_machines_measurements():
    readme = " ".join((RECORDS / "README.md").read_text().split())
    chip, cpu = (json.loads((RECORDS / "child_cost" / f"{name}.json").read_text()) for name in ("tpu_machine", "cpu_2core"))
    assert f"`import jax` takes {chip['import_jax_seconds']:.2f} s on the TPU machine against " \
           f"{cpu['import_jax_seconds']:.2f} s" in readme
    assert f"20 steps of the command {chip['command_20_steps_seconds']:.2f} s against " \
           f"{cpu['command_20_steps_seconds']:.2f} s" in readme
    ratio = chip["command_20_steps_seconds"] / cpu["command_20_steps_seconds"]
    waits = [time_gap.child_wait_seconds(next(x for x in stored(name)["lessons"] if x["lesson"].startswith("05")))
             for name in records.ORDER[:2]]
    assert f"{ratio:.1f} times, close to the ratio of lesson 05's waits in the record ({waits[0]:.1f} s against " \
           f"{waits[1]:.1f}, {waits[0] / waits[1]:.1f} times)" in readme


def lesson_of(record: dict, number: str) -> dict:
    return next(x for x in record["lessons"] if x["lesson"].startswith(number))


def record_at(commit: str, name: str = CHIP_RECORD) -> dict:
    """A record as it stood at `commit` (the chip's record of 0406ff5 is 8e59526's)."""
    shown = subprocess.run(["git", "show", f"{commit}:results/lesson_runs/{name}"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout
    return json.loads(shown)


RECORD_0406FF5 = "8e59526"  # the last commit whose chip record was 0406ff5's


@pytest.mark.needs_git
def test_the_record_notes_quote_the_runs_they_come_from():
    """results/lesson_runs/README.md's figures on the chip's record of 0406ff5: lesson 08 with an
    empty and with a filled compilation cache, lesson 12 stopped at 02b33c8 and then run from its fix."""
    readme = " ".join((RECORDS / "README.md").read_text().split())
    chip = record_at(RECORD_0406FF5)
    warm = json.loads((RECORDS / "compile_cache_rerun" / "tpu_08.json").read_text())["lessons"][0]["cells_seconds"]
    assert f"lesson 08 took {warm:.1f} s against {lesson_of(chip, '08')['cells_seconds']:.1f} s in the empty cache" in readme
    stopped_run = json.loads((STOPPED_12 / "tpu_12.json").read_text())
    stopped = stopped_run["lessons"][0]
    assert stopped_run["commit"].startswith("02b33c8") and not stopped["completed"]
    assert f"Lesson 12 stopped at its code cell {stopped['failed_cell']}" in readme
    tail = (STOPPED_12 / "tail.log").read_text()
    apart = re.search(r"kit vs transformers: \S+; base \+ adapter vs merged \(above\): (\S+)", tail)[1]
    bound = re.search(r"merged export, largest logit difference ≤ (\S+) \(float32's bound\): False", tail)[1]
    assert f"(it was {apart} apart, the bound {bound})" in readme
    fixed = lesson_of(chip, "12")
    assert fixed["completed"] and fixed["ran_at"]["commit"].startswith("0406ff5") and chip["commit"].startswith("0406ff5")
    assert f"ran to the end on the chip, {fixed['cells_seconds']:.1f} s" in readme


@pytest.mark.needs_git
@pytest.mark.parametrize("name", RECORD_NAMES)
def test_each_lesson_ran_from_code_its_own_commit_holds(name):
    """A record brought forward (`lessons carry`) names each lesson's own commit: the lesson's
    code cells there are the ones it ran, and that commit is the record's or an ancestor of it."""
    record = stored(name)
    for lesson in record["lessons"]:
        ran_at = lesson.get("ran_at", {"commit": record["commit"]})["commit"]
        assert hashes.notebook_hash_at(ran_at, f"notebooks/{lesson['lesson']}.ipynb") == lesson["notebook_sha256"]
        ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", ran_at, record["commit"]], cwd=ROOT)
        assert ancestor.returncode == 0, f"{name}: {lesson['lesson']} ran at {ran_at}, not before {record['commit']}"


def without_ran_at(lesson: dict) -> dict:
    return {k: v for k, v in lesson.items() if k != "ran_at"}


@pytest.mark.needs_git
def test_carrying_a_record_forward_takes_unchanged_lessons_and_names_changed_ones():
    """From 02b33c8 to 0406ff5 only lesson 12's code cells changed: carrying the record without
    its rerun names lesson 12; with it, every lesson stands and keeps its own commit."""
    chip, stopped_run = record_at(RECORD_0406FF5), json.loads((STOPPED_12 / "tpu_12.json").read_text())
    before = {**stopped_run, "lessons": [without_ran_at(x) for x in chip["lessons"][:12]] + stopped_run["lessons"]}
    with pytest.raises(ValueError, match="the code cells of 12_your_model_and_data at 0406ff5 differ"):
        carry_forward.carry_forward(before, [], "0406ff5")
    rerun = {**before, "commit": "0406ff5", "lessons": [without_ran_at(lesson_of(chip, "12"))]}
    carried = carry_forward.carry_forward(before, [rerun], "0406ff5")
    assert records.outcome(carried) == "13 of 13" and carried["commit"].startswith("0406ff5")
    assert [x["ran_at"]["commit"][:7] for x in carried["lessons"]] == ["02b33c8"] * 12 + ["0406ff5"]
    with pytest.raises(ValueError, match="a rerun has runtime 'CPU'"):
        carry_forward.carry_forward(before, [{**rerun, "runtime": "CPU"}], "0406ff5")
    with pytest.raises(ValueError, match="tunix_nb at ea2bb2d is not the package"):
        carry_forward.carry_forward(before, [rerun], "ea2bb2d")  # tunix_nb changed in 02b33c8


@pytest.mark.needs_git
def test_unchanged_lessons_ran_longer_on_this_lease_than_at_the_first_record():
    """The README's ranges: lessons whose cells did not change (completed at both), against the
    chip's first full record (032e986), in the record of 0406ff5 (another lease) and in this one."""
    first = record_at("0406ff5")
    assert first["commit"].startswith("032e986")

    def change(now: dict) -> tuple[str, int, int]:
        ratios = {x["lesson"][:2]: lesson_of(now, x["lesson"][:2])["cells_seconds"] / x["cells_seconds"]
                  for x in first["lessons"]
                  if x["notebook_sha256"] == lesson_of(now, x["lesson"][:2])["notebook_sha256"]
                  and lesson_of(now, x["lesson"][:2])["completed"]}
        named = ", ".join(sorted(ratios)[:-1]) + " and " + sorted(ratios)[-1]
        return named, round(100 * (min(ratios.values()) - 1)), round(100 * (max(ratios.values()) - 1))

    readme = " ".join((RECORDS / "README.md").read_text().split())
    then = record_at(RECORD_0406FF5)
    named, low, high = change(then)
    assert f"Lessons {named}, whose cells did not change, took {low}% to {high}% longer" in readme
    assert f"({lesson_of(then, '00')['cells_seconds']:.1f} s against {lesson_of(first, '00')['cells_seconds']:.1f} for lesson 00)" in readme
    named, low, high = change(stored(CHIP_RECORD))
    assert f"in the record of {stored(CHIP_RECORD)['commit'][:7]} the same lessons took {low}% to {high}% " \
           f"against 032e986's" in readme


def test_the_lessons_where_compiling_is_most_of_the_gap_are_the_tables():
    rows = time_gap.rows(stored(records.ORDER[0]), stored(records.ORDER[1]))
    most = [r["lesson"][:2] for r in rows if r["seconds"][0] > r["seconds"][1]
            and r["compiling"][0] - r["compiling"][1] >= (r["seconds"][0] - r["seconds"][1]) / 2]
    less = [r["lesson"][:2] for r in rows if r["seconds"][0] > r["seconds"][1] and r["lesson"][:2] not in most
            and r["lesson"][:2] != "05"]
    readme = " ".join((RECORDS / "README.md").read_text().split())
    assert f"In lessons {', '.join(most[:-1])} and {most[-1]} that extra compiling is at least half the difference" in readme
    assert f"In {', '.join(less[:-1])} and {less[-1]} it is less" in readme
    no_slower = [r["lesson"][:2] for r in rows if r["seconds"][0] <= r["seconds"][1]]
    if no_slower:
        assert f"The lessons no slower on the chip ({', '.join(no_slower)})" in readme
    else:
        assert "No lesson is faster on the chip in this record" in readme


def test_the_depth_figures_are_the_stored_measurement():
    """results/compile_costs/README.md quotes depth_cpu.json: per-layer and stacked compile seconds."""
    costs = ROOT / "results" / "compile_costs"
    depth = json.loads((costs / "depth_cpu.json").read_text())
    readme = " ".join((costs / "README.md").read_text().split())
    per_layer, stacked = depth["per_layer"], depth["stacked"]
    assert (f"{per_layer['compile_seconds']['2']:.2f} s at 2 layers, {per_layer['compile_seconds']['28']:.2f} s at 28 "
            f"({per_layer['ratio']:.2f} times)") in readme
    assert (f"{stacked['compile_seconds']['2']:.2f} s and {stacked['compile_seconds']['28']:.2f} s "
            f"({stacked['ratio']:.2f} times)") in readme
    assert depth["same_step"]["largest_parameter_difference"] == 0.0
    assert depth["same_step"]["loss"]["per_layer"] == depth["same_step"]["loss"]["stacked"]


RECORDS_5B5DE38 = "cc79713"  # the last commit whose records were 5b5de38's in full


def test_lesson_09_ran_again_and_the_records_were_brought_forward():
    """Lesson 09 alone ran again at cb59e3d on both runtimes; the other lessons are 5b5de38's runs."""
    readme = " ".join((RECORDS / "README.md").read_text().split())
    seconds = {}
    for name in (CHIP_RECORD, "cpu_2core.json"):
        now, before = stored(name), record_at(RECORDS_5B5DE38, name)
        assert now["commit"].startswith("cb59e3d") and before["commit"].startswith("5b5de38")
        ran = {x["lesson"][:2]: x.get("ran_at", {}).get("commit", now["commit"])[:7] for x in now["lessons"]}
        assert ran.pop("09") == "cb59e3d" and set(ran.values()) == {"5b5de38"}
        seconds[name] = (lesson_of(now, "09")["cells_seconds"], lesson_of(before, "09")["cells_seconds"])
    chip, cpu = seconds[CHIP_RECORD], seconds["cpu_2core.json"]
    assert f"on the chip in one call ({chip[0]:.1f} s of cells against {chip[1]:.1f} s at 5b5de38)" in readme
    assert f"({cpu[0]:.1f} s against {cpu[1]:.1f} s)" in readme
