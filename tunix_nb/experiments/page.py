"""A results page made from stored records: a script in the percent format (`# %%` starts a
code cell, `# %% [markdown]` a cell of prose, each line of it behind `# `) run top to bottom
in one namespace, then written as markdown with each code cell's printed output under it.

`python -m tunix_nb.experiments page docs/lesson11_designs.py --out docs/lesson11_designs.md`
remakes lesson 11's design search (`tests/test_notebook_prose.py` checks that the stored page is
what its script prints now, and that its prose quotes only figures the page printed or the
records it reads store).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

CODE, PROSE = "# %%", "# %% [markdown]"


def read_cells(source: str, name: str = "<page>") -> list[dict]:
    """The script's cells, as a notebook's: {"cell_type", "source"}; text before the first
    marker is the script's header (what it is, how to remake it) and is left out."""
    cells, kind, lines = [], None, []
    for number, line in enumerate(source.splitlines(), 1):
        marker = line.rstrip()
        if marker in (CODE, PROSE):
            cells.append((kind, lines))
            kind, lines = ("markdown" if marker == PROSE else "code"), []
        elif kind == "markdown" and line and not line.startswith("#"):
            raise ValueError(f"{name}, line {number}: a prose cell's lines start with '# ' (got {line[:40]!r}); "
                             "start a code cell with '# %%' first")
        else:
            lines.append(prose_line(line) if kind == "markdown" else line)
    cells.append((kind, lines))
    return [{"cell_type": kind, "source": "\n".join(lines).strip("\n")} for kind, lines in cells if kind]


def prose_line(line: str) -> str:
    """A prose line without its comment mark: "# text" -> "text", a bare "#" -> ""."""
    return "" if line.rstrip() == "#" else line.removeprefix("# ")


def run_cells(cells: list[dict], name: str = "<page>") -> list[dict]:
    """Each code cell run in one namespace, its printed output kept as a notebook's stream output."""
    namespace: dict = {"__name__": "__page__"}
    ran = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            ran.append(cell)
            continue
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(cell["source"], f"{name} (code cell {index})", "exec"), namespace)  # noqa: S102
        ran.append({**cell, "outputs": [{"output_type": "stream", "name": "stdout", "text": printed.getvalue()}]})
    return ran


def to_markdown(cells: list[dict], remake: str) -> str:
    """The page: the prose as it is, each code cell folded under its printed output."""
    parts = [f"<!-- Made by `{remake}` from the records in results/: edit the script, not this page. -->"]
    for cell in cells:
        if cell["cell_type"] == "markdown":
            parts.append(cell["source"])
            continue
        printed = "".join(out["text"] for out in cell["outputs"]).rstrip("\n")
        if printed:
            parts.append(f"```text\n{printed}\n```")
        parts.append(f"<details><summary>the code that printed it</summary>\n\n```python\n{cell['source']}\n```\n\n"
                     "</details>")
    return "\n\n".join(parts) + "\n"


def render(script: Path, out: Path | None = None) -> tuple[str, list[dict]]:
    """(the page's markdown, its cells with their outputs) for `script`; the page names both
    files relative to the repository, never by this machine's paths."""
    cells = run_cells(read_cells(script.read_text(), script.name), script.name)
    out = out or script.with_suffix(".md")
    remake = f"python -m tunix_nb.experiments page {in_repository(script)} --out {in_repository(out)}"
    return to_markdown(cells, remake), cells


def in_repository(path: Path) -> str:
    root = Path(__file__).resolve().parents[2]
    resolved = Path(path).resolve()
    return resolved.relative_to(root).as_posix() if resolved.is_relative_to(root) else Path(path).name
