"""A record brought forward to a later commit: only the lessons whose code changed run again.

A chip's record costs device time a lesson at a time. When a commit changes one lesson, the
others' runs still stand for the new commit if their code cells and `tunix_nb` are the same
there, byte for byte by their hashes. `carry_forward` checks that with git, puts the rerun
lessons in, and names each lesson's own commit and date (`ran_at`), so nothing is claimed
for a commit a lesson did not run its code from.

`python -m tunix_nb.lessons carry RECORD RERUN.json ... --at COMMIT --out FILE`
"""

from __future__ import annotations

from pathlib import Path

from tunix_nb.lessons import hashes, records


def _ran_at(lesson: dict, run: dict) -> dict:
    return lesson.get("ran_at") or {"commit": run["commit"], "date": run["date"]}


def _stale(lesson: dict, at: str, root: Path) -> bool:
    """True where the lesson's code cells at commit `at` differ from the ones it ran."""
    return hashes.notebook_hash_at(at, f"notebooks/{lesson['lesson']}.ipynb", root) != lesson["notebook_sha256"]


def carry_forward(record: dict, reruns: list[dict], at: str, root: Path | None = None) -> dict:
    """`record` with the lessons of `reruns` replacing its own, as a record of commit `at`.

    Every run must share the record's runtime and schema, and `tunix_nb` must hash the same at
    `at` as in each run; every lesson's code cells must be those at `at`. Else a ValueError
    names what to rerun."""
    root = root or hashes.repo_root()
    at = hashes.git(root, "rev-parse", "--verify", f"{at}^{{commit}}").decode().strip()
    package_at = hashes.package_hash(hashes.package_files_at(at, root))
    lessons = {lesson["lesson"]: {**lesson, "ran_at": _ran_at(lesson, record)} for lesson in record["lessons"]}
    for run in [record, *reruns]:
        for key in ("schema", "runtime"):
            if run[key] != record[key]:
                raise ValueError(f"carry: a rerun has {key} {run[key]!r}, the record {record[key]!r}.")
        if run["tunix_nb_sha256"] != package_at:
            raise ValueError(f"carry: tunix_nb at {at[:7]} is not the package the run from "
                             f"{(run['commit'] or 'no commit')[:7]} used; rerun every lesson from {at[:7]}.")
    for run in reruns:
        lessons.update({lesson["lesson"]: {**lesson, "ran_at": _ran_at(lesson, run)} for lesson in run["lessons"]})
    stale = sorted(name for name, lesson in lessons.items() if _stale(lesson, at, root))
    if stale:
        raise ValueError(f"carry: the code cells of {', '.join(stale)} at {at[:7]} differ from the ones "
                         f"recorded; rerun them from {at[:7]} and pass their records.")
    runs = [record, *reruns]
    return {**record, "commit": at, "dirty": False, "date": max(run["date"] for run in runs),
            "command": " ; ".join(run["command"] or "unknown" for run in runs),
            "timeout_s": max(run["timeout_s"] for run in runs),
            "lessons": sorted(lessons.values(), key=lambda lesson: lesson["lesson"])}
