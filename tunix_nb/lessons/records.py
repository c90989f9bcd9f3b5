"""The stored runs (results/lesson_runs/*.json): their schema, and the README table made from them.

The README's "Runs on" section holds, between two markers, exactly what `render_table` returns
for the records; `python -m tunix_nb.lessons table --readme README.md` rewrites it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tunix_nb.lessons import hashes

RECORDS_DIR = Path("results") / "lesson_runs"  # relative to the repository root
# The chip's record first, then the CPU's, then any other, by name.
ORDER = ("tpu_v5e_1.json", "cpu_2core.json")
NO_RECORDS = "No run is recorded in `results/lesson_runs/` yet.\n"

# key -> the types its value may have (None: not known, e.g. the backend of a lesson stopped before JAX started)
NUMBER, TEXT_OR_NONE, INT_OR_NONE = (int, float), (str, type(None)), (int, type(None))
RUN_KEYS = {"schema": str, "runtime": str, "date": str, "commit": TEXT_OR_NONE, "dirty": (bool, type(None)),
            "tunix_nb_sha256": str, "notebooks": str, "machine": dict, "command": TEXT_OR_NONE,
            "timeout_s": NUMBER, "lessons": list}
LESSON_KEYS = {"lesson": str, "notebook_sha256": str, "backend": TEXT_OR_NONE, "device_kind": TEXT_OR_NONE,
               "device_count": INT_OR_NONE, "jax": TEXT_OR_NONE, "jaxlib": TEXT_OR_NONE, "libtpu": TEXT_OR_NONE,
               "code_cells": INT_OR_NONE, "cells": list, "cells_seconds": NUMBER, "completed": bool,
               "failed_cell": INT_OR_NONE, "error": TEXT_OR_NONE, "timed_out": bool, "process_seconds": NUMBER}
CELL_KEYS = {"index": int, "seconds": NUMBER}


def _type_problems(record: dict, keys: dict, where: str) -> list[str]:
    problems = [f"{where}: no {key!r}" for key in keys if key not in record]
    return problems + [f"{where}: {key!r} is {type(record[key]).__name__}, not {types}"
                       for key, types in keys.items() if key in record and not isinstance(record[key], types)]


def problems(record: dict) -> list[str]:
    """What makes `record` not a well-formed run record (nothing: an empty list). Keys beyond
    the schema's are allowed (say, a slow lesson's profile)."""
    found = _type_problems(record, RUN_KEYS, "run")
    for i, lesson in enumerate(record.get("lessons") or []):
        where = f"lesson {lesson.get('lesson', i)}"
        found += _type_problems(lesson, LESSON_KEYS, where)
        for cell in lesson.get("cells") or []:
            found += _type_problems(cell, CELL_KEYS, f"{where}, a cell")
        if lesson.get("completed") and (lesson.get("failed_cell") is not None or
                                        len(lesson.get("cells", [])) != lesson.get("code_cells")):
            found.append(f"{where}: completed, yet it has a failed cell or not every cell's time")
    return found


# What every part of a merged record must share: it was made from one tree, on one kind of machine.
SHARED_KEYS = ("schema", "runtime", "commit", "tunix_nb_sha256")


def merge(parts: list[dict]) -> dict:
    """One record from runs of different lessons made from the same commit on the same runtime
    (a device call returns few files and runs at most minutes, so a chip's record comes in parts).
    Lessons in lesson order; the latest date; every part's command."""
    if not parts:
        raise ValueError("merge: no records given.")
    first = parts[0]
    if first["commit"] is None:
        raise ValueError("merge: the records name no commit; record with --commit, so the parts can be matched.")
    for i, part in enumerate(parts[1:], start=2):
        for key in SHARED_KEYS:
            if part[key] != first[key]:
                raise ValueError(f"merge: record {i} has {key} {part[key]!r}, record 1 {first[key]!r}; "
                                 "merge only runs made from one commit on one runtime.")
    lessons = [lesson for part in parts for lesson in part["lessons"]]
    names = [lesson["lesson"] for lesson in lessons]
    if len(set(names)) != len(names):
        raise ValueError(f"merge: a lesson appears in two records: {sorted(n for n in set(names) if names.count(n) > 1)}")
    dirty = [part["dirty"] for part in parts]
    return {**first, "date": max(part["date"] for part in parts),
            "dirty": True if True in dirty else (None if None in dirty else False),
            "timeout_s": max(part["timeout_s"] for part in parts),
            "command": " ; ".join(part["command"] or "unknown" for part in parts),
            "lessons": sorted(lessons, key=lambda lesson: lesson["lesson"])}


def load_records(folder: Path | None = None) -> dict[str, dict]:
    """file name -> record, in the table's order."""
    folder = folder or hashes.repo_root() / RECORDS_DIR
    names = sorted((p.name for p in folder.glob("*.json")), key=lambda n: (ORDER.index(n) if n in ORDER
                                                                          else len(ORDER), n))
    return {name: json.loads((folder / name).read_text()) for name in names}


def outcome(record: dict) -> str:
    """E.g. "13 of 13", or "11 of 13 (stopped: 02 at cell 3; 05 at cell 4, timed out)"."""
    lessons = record["lessons"]
    stopped = [f"{lesson['lesson'][:2]} at cell {lesson['failed_cell']}" + (", timed out" if lesson["timed_out"]
                                                                           else "")
               for lesson in lessons if not lesson["completed"]]
    done = f"{len(lessons) - len(stopped)} of {len(lessons)}"
    return f"{done} (stopped: {'; '.join(stopped)})" if stopped else done


def render_table(records: dict[str, dict]) -> str:
    """The README's table: runtime (linking its record), lessons run to the end, date, commit."""
    if not records:
        return NO_RECORDS
    rows = ["| runtime | lessons run to the end | date | commit |", "|---|---|---|---|"]
    for name, record in records.items():
        commit = (record["commit"] or "none")[:7] + (" (modified)" if record["dirty"] else "")
        link = f"[{record['runtime']}]({RECORDS_DIR.as_posix()}/{name})"
        rows.append(f"| {link} | {outcome(record)} | {record['date'][:10]} | {commit} |")
    return "\n".join(rows) + "\n"


def marked_part(text: str, name: str) -> str:
    """What stands between `<!-- begin NAME ... -->` and `<!-- end NAME -->` in `text`."""
    found = _marked(name).search(text)
    if not found:
        raise ValueError(f"no '<!-- begin {name} -->' ... '<!-- end {name} -->' part")
    return found.group(2)


def write_marked_part(path: Path, name: str, table: str) -> bool:
    """Put `table` between the file's NAME markers; True if that changed the file."""
    text = path.read_text()
    marked_part(text, name)  # the markers must be there
    new = _marked(name).sub(lambda m: m.group(1) + table + m.group(3), text)
    path.write_text(new)
    return new != text


def _marked(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- begin {re.escape(name)}[^\n]*-->\n)(.*?)(<!-- end {re.escape(name)} -->)", re.S)


def readme_table(readme_text: str) -> str:
    """What stands between the README's "lesson runs" markers."""
    return marked_part(readme_text, "lesson runs")


def write_readme_table(readme: Path, table: str) -> bool:
    """Put `table` between the README's markers; True if that changed the file."""
    return write_marked_part(readme, "lesson runs", table)
