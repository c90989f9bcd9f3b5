"""The package's shape: no import cycle between tunix_nb modules, no module over 600 lines.

Read from the source with `ast`, not by importing: every import counts, the ones inside
functions too (a cycle hidden behind a function-local import is still a cycle: neither
module can be read, tested or copied without the other). Relative imports are resolved,
and `from tunix_nb import x` counts as importing the module `x` when there is one.
Importing `a.b.c` counts as importing that module alone, not also the packages `a.b` and
`a` whose `__init__` Python runs first: a package that re-exports its own modules (as
`tunix_nb.cli` does) would otherwise form a cycle with each of them.
A module's length is its lines with the docstrings taken out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tunix_nb"
MAX_LINES = 600
# Modules allowed past MAX_LINES, each with the reason; an entry that no longer needs it fails.
LONG_MODULE_ALLOWLIST: dict[str, str] = {}
# The training command's stages, in the order data flows: a module imports only its own
# stage's modules and earlier ones (`command` wires them all together).
CLI_STAGES = (("flags", "output_paths"), ("run_config",), ("models", "rows", "methods"), ("checkpoints", "loop", "stop_signals"), ("export",),
              ("command",))


def module_names(package_dir: Path) -> dict[str, Path]:
    """{dotted name: file} of every module of the package (a package is its __init__.py)."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _base_of(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The module an ImportFrom names, its relative dots resolved against `name`."""
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _known(dotted: str, modules) -> str | None:
    """The longest known module that `dotted` is or lies inside (`import a.b.c` runs a.b.c)."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def imports_of(name: str, path: Path, modules) -> dict[str, int]:
    """{imported module of the package: first line importing it}, from anywhere in the file."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [_known(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base_of(name, path, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _known(base, modules)
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target is not None and target != name:
                found[target] = min(found.get(target, node.lineno), node.lineno)
    return found


def import_graph(package_dir: Path) -> dict[str, dict[str, int]]:
    modules = module_names(package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules (Tarjan), as the path that closes it."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:  # v is the root of a group: it and everything above it on the stack
            group = set(stack[stack.index(v):])
            del stack[stack.index(v):]
            on_stack.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_closing_path(graph, group) for group in groups]


def _closing_path(graph, group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, within the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in group and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group always has one


def describe(graph, cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def code_lines(path: Path) -> int:
    """The module's lines, its docstrings (module, class, function) taken out."""
    source = path.read_text()
    docstring_lines = set()
    for node in ast.walk(ast.parse(source, str(path))):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            docstring_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return len(source.splitlines()) - len(docstring_lines)


def long_modules(package_dir: Path, max_lines: int = MAX_LINES) -> dict[str, int]:
    """{path relative to the package's parent: code lines} of the modules over `max_lines`."""
    lengths = {path.relative_to(package_dir.parent).as_posix(): code_lines(path)
               for path in sorted(package_dir.rglob("*.py"))}
    return {name: n for name, n in lengths.items() if n > max_lines}


def structure_problems(package_dir: Path, allowlist: dict[str, str]) -> list[str]:
    """Every import cycle and every module over MAX_LINES that the allowlist does not excuse."""
    graph = import_graph(package_dir)
    problems = [f"import cycle: {describe(graph, cycle)}" for cycle in cycles(graph)]
    too_long = long_modules(package_dir)
    problems += [f"{name} has {n} lines, docstrings aside (over {MAX_LINES}): split it by concept"
                 for name, n in too_long.items() if name not in allowlist]
    problems += [f"{name} is allowlisted ({allowlist[name]!r}) but no longer over {MAX_LINES} lines: drop the entry"
                 for name in allowlist if name not in too_long]
    return problems


def test_no_import_cycles_and_no_overlong_modules():
    problems = structure_problems(PACKAGE, LONG_MODULE_ALLOWLIST)
    assert not problems, "\n".join(problems)


def test_every_allowlist_entry_gives_a_reason():
    assert all(reason.strip() for reason in LONG_MODULE_ALLOWLIST.values())


def test_the_training_command_s_stages_import_only_earlier_ones():
    graph = import_graph(PACKAGE)
    stage_of = {f"tunix_nb.cli.{m}": i for i, stage in enumerate(CLI_STAGES) for m in stage}
    modules = {n for n in graph if n.startswith("tunix_nb.cli.")}
    assert set(stage_of) == modules, f"CLI_STAGES names {sorted(stage_of)}, tunix_nb/cli/ holds {sorted(modules)}"
    backwards = [f"{a} imports the later stage's {b} (line {line})" for a in stage_of
                 for b, line in graph[a].items() if stage_of.get(b, -1) > stage_of[a]]
    assert not backwards, "\n".join(backwards)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checker_finds_a_function_local_cycle_and_a_long_module(tmp_path):
    pkg = tmp_path / "pkg"
    _write(pkg / "__init__.py", '"""A package."""\n')
    _write(pkg / "a.py", "from pkg import b\n\n\ndef f():\n    return b.g()\n")
    _write(pkg / "b.py", "def g():\n    from . import a  # hidden in a function: still a cycle\n    return a\n")
    _write(pkg / "sub" / "__init__.py", "")
    _write(pkg / "sub" / "c.py", "from ..a import f\nfrom pkg.sub import d\n")  # no cycle: c -> a, c -> d
    _write(pkg / "sub" / "d.py", "import pkg.b\n")
    code = "".join(f"x{i} = {i}\n" for i in range(MAX_LINES + 1))
    _write(pkg / "long.py", code)
    docstring = '"""' + "words\n" * 200 + '"""\n'
    _write(pkg / "documented.py", docstring + code[:-len(f"x{MAX_LINES} = {MAX_LINES}\n")])  # 600 code lines

    graph = import_graph(pkg)
    assert graph["pkg.sub.c"] == {"pkg.a": 1, "pkg.sub.d": 2} and graph["pkg.sub.d"] == {"pkg.b": 1}
    problems = structure_problems(pkg, allowlist={})
    assert problems == ["import cycle: pkg.a (line 1) -> pkg.b (line 2) -> pkg.a",
                        f"pkg/long.py has {MAX_LINES + 1} lines, docstrings aside (over {MAX_LINES}): "
                        "split it by concept"]
    assert structure_problems(pkg, allowlist={"pkg/long.py": "a reason"}) == problems[:1]
    assert "no longer over" in structure_problems(pkg, allowlist={"pkg/documented.py": "a reason"})[-1]
