"""Where the lessons' time goes on one machine against another, from two lesson records.

For each lesson: its cells' seconds on both, the programs compiled on both, and, within the
cells each record profiled (`--profile SECONDS`: those that took at least that long), the
seconds spent compiling (trace, lower and compile) and the seconds spent waiting on a child
process (a training command the lesson starts, whose own work the parent's profile cannot see).
What is left of a profiled cell is this process's own computing. The table goes into
results/lesson_runs/README.md between its markers; tests/test_lesson_runs.py keeps it current.
"""

from __future__ import annotations

from pathlib import Path

from tunix_nb.lessons import records

MARKER = "time gap"  # results/lesson_runs/README.md's <!-- begin time gap ... --> ... <!-- end time gap -->
# Python's own functions in which a parent waits on its children: subprocess.run's
# communicate polls the pipes, Popen.wait blocks in waitpid.
CHILD_WAITS = ("'poll' of 'select.poll'", "'poll' of 'select.epoll'", "posix.waitpid")


def _profiled(lesson: dict) -> list[dict]:
    return lesson.get("slowest_cells") or []


def compile_seconds(lesson: dict) -> float:
    """Tracing, lowering and compiling, in the profiled cells."""
    return sum((cell.get(key) or 0.0) for cell in _profiled(lesson)
               for key in ("trace_seconds", "lower_seconds", "compile_seconds"))


def child_wait_seconds(lesson: dict) -> float:
    """Waiting on child processes, in the profiled cells (their profiles' own time)."""
    return sum(entry["own_seconds"] for cell in _profiled(lesson) for entry in cell.get("profile_own_time") or []
               if any(name in entry["function"] for name in CHILD_WAITS))


def rows(first: dict, second: dict) -> list[dict]:
    """One row a lesson that both records hold, in the first record's order."""
    by_name = {lesson["lesson"]: lesson for lesson in second["lessons"]}
    out = []
    for lesson in first["lessons"]:
        other = by_name.get(lesson["lesson"])
        if other is None:
            continue
        out.append({"lesson": lesson["lesson"], "seconds": (lesson["cells_seconds"], other["cells_seconds"]),
                    "compiles": tuple(sum(c.get("compiles") or 0 for c in x["cells"]) for x in (lesson, other)),
                    "compiling": (compile_seconds(lesson), compile_seconds(other)),
                    "child_wait": (child_wait_seconds(lesson), child_wait_seconds(other))})
    return out


def render(first: dict, second: dict, names: tuple[str, str]) -> str:
    """The markdown table of `rows`: each pair as first / second."""
    a, b = names
    header = (f"| lesson | cells' seconds, {a} / {b} | difference | programs compiled | "
              f"compiling in profiled cells (s) | waiting on a child process in profiled cells (s) |")
    lines = [header, "|---|---|---|---|---|---|"]
    for row in rows(first, second):
        (s1, s2), (c1, c2) = row["seconds"], row["compiles"]
        (k1, k2), (w1, w2) = row["compiling"], row["child_wait"]
        lines.append(f"| {row['lesson'][:2]} | {s1:.1f} / {s2:.1f} | {s1 - s2:+.1f} | {c1} / {c2} | "
                     f"{k1:.1f} / {k2:.1f} | {w1:.1f} / {w2:.1f} |")
    return "\n".join(lines) + "\n"


def readme_part(text: str) -> str:
    return records.marked_part(text, MARKER)


def write_readme_part(readme: Path, table: str) -> bool:
    """Put `table` between the markers; True if that changed the file."""
    return records.write_marked_part(readme, MARKER, table)
