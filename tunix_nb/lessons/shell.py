"""The child process: one notebook's code cells, in order, in an in-process IPython shell.

`python -m tunix_nb.lessons.shell NOTEBOOK RESULT_JSON [PROFILE_MIN_SECONDS]`, started by `runner` in a fresh
process with the notebook's folder as its working directory. IPython transforms `!cmd`,
`%magic` and `%%writefile` as Jupyter's kernel would, without a kernel's sockets. It stops
at the first failing cell. RESULT_JSON is rewritten before and after every cell, so a
parent that kills this process at its timeout still reads which cell was running.

Imports nothing of JAX itself: the lesson's setup cell chooses the devices first.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time

from tunix_nb.lessons.cell_profile import CellProfiler
from tunix_nb.lessons.compiles import CompileMeter

ERROR_CHARS = 2000  # an error's message is cut to this many characters


def code_cells(notebook: dict) -> list[str]:
    """The sources of a notebook's code cells, in order (nbformat 4 stores a string or a list of lines)."""
    sources = (cell.get("source", "") for cell in notebook["cells"] if cell.get("cell_type") == "code")
    return [src if isinstance(src, str) else "".join(src) for src in sources]


def package_version(*names: str) -> str | None:
    """The installed version of the first of `names` found, without importing it."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def jax_facts() -> dict:
    """Backend and devices, once the lesson has started JAX's backends (never starting them itself:
    that would fix the devices before the lesson's setup cell chose them)."""
    if "jax" not in sys.modules:
        return {}
    from jax._src import xla_bridge  # no public API says whether the backends have started

    if not xla_bridge.backends_are_initialized():
        return {}
    import jax

    devices = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind,
            "device_count": len(devices)}


def error_text(error: BaseException | None) -> str | None:
    if error is None:
        return None
    return f"{type(error).__name__}: {error}"[:ERROR_CHARS]


def write_json(path: str, result: dict) -> None:
    """Replace `path` whole, so a parent never reads half a file."""
    with open(path + ".part", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".part", path)


def new_shell():
    """An IPython shell in this process; matplotlib draws off screen (Agg), as no display is there.
    Its history stays in memory: a read-only or shared home must not stop a lesson."""
    os.environ["MPLBACKEND"] = "Agg"
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    return InteractiveShell.instance(config=config, colors="nocolor")


def run_notebook(notebook_path: str, result_path: str, profile_min_seconds: float | None = None) -> dict:
    """Run the code cells in order until the first error; the result also lands in `result_path`.
    `profile_min_seconds`: keep a Python profile of each cell that took at least that long."""
    with open(notebook_path) as f:
        sources = code_cells(json.load(f))
    result = {"cells": [], "code_cells": len(sources), "running": None, "failed_cell": None, "error": None,
              "backend": None, "device_kind": None, "device_count": None,
              "jax": package_version("jax"), "jaxlib": package_version("jaxlib"),
              "libtpu": package_version("libtpu", "libtpu-nightly")}
    shell, meter, profiler = new_shell(), CompileMeter(), CellProfiler(profile_min_seconds)
    for index, source in enumerate(sources):
        result["running"] = index
        write_json(result_path, result)
        meter.listen_once_jax_is_imported()
        profiler.start()
        start = time.perf_counter()
        outcome = shell.run_cell(source, store_history=True)
        seconds = round(time.perf_counter() - start, 3)
        result["cells"].append({"index": index, "seconds": seconds, **meter.take(), **profiler.stop(seconds)})
        if result["backend"] is None:
            result.update(jax_facts())
        if not outcome.success:
            result["failed_cell"] = index
            result["error"] = error_text(outcome.error_before_exec or outcome.error_in_exec)
            break
    result["running"] = None
    write_json(result_path, result)
    return result


if __name__ == "__main__":
    notebook, out, *profile = sys.argv[1:4]
    min_seconds = float(profile[0]) if profile else None
    sys.exit(0 if run_notebook(notebook, out, min_seconds)["failed_cell"] is None else 1)
