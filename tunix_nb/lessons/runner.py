"""A fresh Python process per lesson (JAX fixes its devices when it starts), and the run's record.

Each child is `python -m tunix_nb.lessons.shell` in the notebook's folder, with this process's
environment (PYTHONPATH, TPU_* and XLA_FLAGS kept; nothing forces a platform: the lesson's
setup cell chooses the devices) and the kit's root added in front of PYTHONPATH. A child past
its timeout is killed with everything it started, and the cell it was running is recorded.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from tunix_nb.lessons import hashes

SCHEMA = "tunix_nb.lessons/1"
DEFAULT_TIMEOUT_S = 600
# The environment that decides where and how the lessons ran; recorded when set.
RECORDED_ENV = ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "TUNIX_NB_DEVICES", "TPU_ACCELERATOR_TYPE")
KIND_NAMES = {"TPU v5 lite": "TPU v5e", "TPU v6 lite": "TPU v6e"}  # JAX's device_kind -> the product's name
OUTPUT_TAIL_LINES = 30  # of a failing lesson's output, printed to stderr
SLOWEST_CELLS = 5  # listed per lesson with their compile profile, where a slow lesson's time went


def find_notebooks(folder: Path, wanted: list[str] | None = None) -> list[Path]:
    """The lessons in `folder` (NN_name.ipynb), or those whose number or name is in `wanted` ("3", "03", ...)."""
    lessons = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if not wanted:
        return lessons
    picked = [p for p in lessons if any(p.name[:2] == w.zfill(2) or p.stem == w for w in wanted)]
    found = {p.name[:2] for p in picked} | {p.stem for p in picked}
    unknown = [w for w in wanted if w.zfill(2) not in found and w not in found]
    if unknown:
        raise ValueError(f"no lesson {unknown} in {folder}; there are {[p.name[:2] for p in lessons]}")
    return picked


def child_env() -> dict[str, str]:
    """This environment, with the kit's root in front of PYTHONPATH (added, never replacing:
    on some runtimes JAX itself is found through PYTHONPATH)."""
    env, root = dict(os.environ), str(hashes.repo_root())
    entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e and e != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *entries])
    return env


def scrub(text: str | None) -> str | None:
    """`text` without this machine's paths (records are committed)."""
    if text is None:
        return None
    root, home = str(hashes.repo_root()), str(Path.home())
    out = os.environ.get("OUT")  # a device machine's folder of returned files
    if out:
        text = text.replace(out.rstrip(os.sep), "$OUT")
    return text.replace(root + os.sep, "").replace(root, ".").replace(home, "~")


def run_child(notebook: Path, timeout_s: float, log_path: Path,
              profile_min_seconds: float | None = None) -> tuple[dict, int | None, float]:
    """Run one notebook in a fresh process: (the child's result, its exit status or None when
    it was killed at the timeout, its wall time)."""
    profile = [] if profile_min_seconds is None else [str(profile_min_seconds)]
    with tempfile.TemporaryDirectory(prefix="lesson_run_") as tmp:
        result_path = Path(tmp) / "result.json"
        with open(log_path, "w") as log:
            start = time.perf_counter()
            child = subprocess.Popen(
                [sys.executable, "-m", "tunix_nb.lessons.shell", str(notebook.resolve()), str(result_path),
                 *profile],
                cwd=notebook.parent, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)  # its own group: a timeout ends its children too
            try:
                status = child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                status = None
            seconds = time.perf_counter() - start
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
    return result, status, seconds


def last_lines(path: Path, n: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def slowest_cells(cells: list[dict], n: int = SLOWEST_CELLS) -> list[dict]:
    """The `n` slowest cells, slowest first, each with its compile profile (compiles and their seconds)."""
    return sorted(cells, key=lambda cell: -cell["seconds"])[:n]


def lesson_record(notebook: Path, timeout_s: float, log_path: Path, profile_min_seconds: float | None = None) -> dict:
    """One lesson's entry of the run's record."""
    child, status, seconds = run_child(notebook, timeout_s, log_path, profile_min_seconds)
    cells = child.get("cells", [])
    failed, error = child.get("failed_cell"), child.get("error")
    if status is None:
        failed, error = child.get("running"), f"Timeout: the lesson passed {timeout_s:g} s"
    elif failed is None and (status != 0 or len(cells) != child.get("code_cells")):
        tail = last_lines(log_path, 1)
        failed, error = child.get("running"), f"the process ended with exit status {status}: {tail}"
    return {
        "lesson": notebook.stem,
        "notebook_sha256": hashes.notebook_hash(notebook.read_bytes()),
        **{key: child.get(key) for key in ("backend", "device_kind", "device_count", "jax", "jaxlib", "libtpu")},
        "code_cells": child.get("code_cells"),
        "cells": cells,
        "cells_seconds": round(sum(cell["seconds"] for cell in cells), 1),
        "slowest_cells": slowest_cells(cells),
        "completed": failed is None and error is None,
        "failed_cell": failed,
        "error": scrub(error),
        "timed_out": status is None,
        "process_seconds": round(seconds, 1),
    }


def machine_facts() -> dict:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "usable_cpus": usable,
            "env": {name: scrub(os.environ[name]) for name in RECORDED_ENV if name in os.environ}}


def runtime_label(lessons: list[dict], machine: dict) -> str:
    """E.g. "TPU v5e, 1 chip" or "CPU, 2 cores, 8 simulated devices", from what the lessons saw."""
    seen = [lesson for lesson in lessons if lesson["backend"]]
    if not seen:
        return "unknown (no lesson started JAX)"
    counts = sorted({lesson["device_count"] for lesson in seen})
    count = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    plural = "" if count == "1" else "s"
    if seen[0]["backend"] == "cpu":
        simulated = "" if count == "1" else " simulated"
        return f"CPU, {machine['usable_cpus']} cores, {count}{simulated} device{plural}"
    kind = seen[0]["device_kind"]
    unit = "chip" if seen[0]["backend"] == "tpu" else "device"
    return f"{KIND_NAMES.get(kind, kind)}, {count} {unit}{plural}"


def progress_line(lesson: dict) -> str:
    head = f"{lesson['lesson']}: "
    if lesson["completed"]:
        head += f"ran to the end, {len(lesson['cells'])} cells in {lesson['cells_seconds']:.1f} s"
    else:
        head += f"stopped at code cell {lesson['failed_cell']}: {(lesson['error'] or '')[:160]}"
    where = f"{lesson['backend']} x{lesson['device_count']}" if lesson["backend"] else "JAX not started"
    return f"{head} (process {lesson['process_seconds']:.1f} s, {where})"


def run_lessons(wanted: list[str] | None = None, *, notebooks: Path | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, runtime: str | None = None,
                command: str | None = None, log_dir: Path | None = None, commit: str | None = None,
                profile_min_seconds: float | None = None, echo=print) -> dict:
    """Run the lessons one after another, each in a fresh process; the run's record.
    `commit`: the commit this tree is, for a copy without git's history (then "dirty" is unknown, None).
    `profile_min_seconds`: a Python profile of every cell that took at least that long (it slows
    the cells: a diagnostic run's times are not the lessons' times)."""
    root = hashes.repo_root()
    folder = Path(notebooks) if notebooks else root / "notebooks"
    paths = find_notebooks(folder, wanted)
    record = {"schema": SCHEMA, "runtime": None,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              **({"commit": commit, "dirty": None} if commit else hashes.commit_state(root)),
              "tunix_nb_sha256": hashes.package_hash(hashes.package_files(root)),
              "notebooks": scrub(str(folder.resolve())), "machine": machine_facts(),
              "command": command, "timeout_s": timeout_s, "profile_min_seconds": profile_min_seconds,
              "lessons": []}
    with tempfile.TemporaryDirectory(prefix="lesson_logs_") as tmp:
        for path in paths:
            log_path = Path(log_dir or tmp) / f"{path.stem}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            lesson = lesson_record(path, timeout_s, log_path, profile_min_seconds)
            record["lessons"].append(lesson)
            echo(progress_line(lesson))
            if not lesson["completed"]:
                print(last_lines(log_path, OUTPUT_TAIL_LINES), file=sys.stderr)
    record["runtime"] = runtime or runtime_label(record["lessons"], record["machine"])
    return record
