"""What a lesson run was made from, hashed the same way from the working tree or from a commit,
so that a test can check a stored record against the commit it names.

- A notebook's hash: sha256 of `json.dumps(sources)` encoded as UTF-8, where `sources` is the
  list of its code cells' sources, in order, each one string (`shell.code_cells`). Outputs,
  markdown and metadata do not count: re-executing a lesson keeps its hash.
- `tunix_nb`'s hash: sha256 of the manifest `sha256sum` prints for the package's *.py files
  sorted by path, one line "<file's sha256>  tunix_nb/<path>\\n" each. In a shell, from the
  repository root: `find tunix_nb -name '*.py' | LC_ALL=C sort | xargs sha256sum | sha256sum`.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from tunix_nb.lessons.shell import code_cells

PACKAGE = "tunix_nb"


def repo_root() -> Path:
    """The folder that holds this `tunix_nb` package (a clone's root)."""
    return Path(__file__).resolve().parent.parent.parent


def git(root: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["git", *args], cwd=root, input=stdin, capture_output=True, check=True).stdout


def notebook_hash(notebook_json: str | bytes) -> str:
    sources = code_cells(json.loads(notebook_json))
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


def notebook_hash_at(commit: str, path: str, root: Path | None = None) -> str:
    """The hash of notebook `path` (relative to the root, e.g. notebooks/00_....ipynb) at `commit`."""
    return notebook_hash(git(root or repo_root(), "show", f"{commit}:{path}"))


def package_hash(files: dict[str, bytes]) -> str:
    """`files`: relative path -> contents, for every *.py file of the package."""
    manifest = "".join(f"{hashlib.sha256(files[path]).hexdigest()}  {path}\n" for path in sorted(files))
    return hashlib.sha256(manifest.encode()).hexdigest()


def package_files(root: Path | None = None) -> dict[str, bytes]:
    """The package's *.py files in the working tree, tracked or not (a new module changes the hash)."""
    root = root or repo_root()
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in (root / PACKAGE).rglob("*.py")}


def package_files_at(commit: str, root: Path | None = None) -> dict[str, bytes]:
    """The package's *.py files as committed: `git ls-tree`, then one `git cat-file --batch` for all."""
    root = root or repo_root()
    listing = git(root, "ls-tree", "-r", commit, "--", PACKAGE).decode().splitlines()
    blobs = {}  # path -> blob id
    for line in listing:
        meta, path = line.split("\t", 1)
        _, kind, blob = meta.split()
        if kind == "blob" and path.endswith(".py"):
            blobs[path] = blob
    paths = sorted(blobs)
    out = git(root, "cat-file", "--batch", stdin="".join(f"{blobs[p]}\n" for p in paths).encode())
    files, offset = {}, 0
    for path in paths:  # each answer: "<id> blob <size>\n<contents>\n"
        header_end = out.index(b"\n", offset)
        size = int(out[offset:header_end].split()[2])
        files[path] = out[header_end + 1:header_end + 1 + size]
        offset = header_end + 1 + size + 1
    return files


def commit_state(root: Path | None = None, paths: tuple[str, ...] = ("notebooks", PACKAGE)) -> dict:
    """HEAD's commit, and whether `paths` differ from it (edited, staged or untracked files).
    Both None outside a git checkout."""
    root = root or repo_root()
    try:
        commit = git(root, "rev-parse", "HEAD").decode().strip()
        dirty = bool(git(root, "status", "--porcelain", "--", *paths).strip())
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}
