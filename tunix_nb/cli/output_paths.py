"""The command's outputs checked before anything trains: every folder it will write (--ckpt-dir,
--logging-dir, the exports, --metrics-file's folder) must be one it can create and write in.

Otherwise the first save fails minutes in, in the background, and the next one blocks until
Orbax gives up. A folder is tried by making a temporary file where it is, or in its nearest
existing parent (nothing is left behind, and nothing is created that the run would not create).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tunix_nb.cli.flags import FlagError

# (flag, attribute, whether the value is a file, whose folder is checked)
OUTPUTS = (("--ckpt-dir", "ckpt_dir", False), ("--logging-dir", "logging_dir", False),
           ("--metrics-file", "metrics_file", True), ("--export-params", "export_params", False),
           ("--export-hf", "export_hf", False), ("--export-adapter", "export_adapter", False))


def check_output_paths(args) -> None:
    """FlagError naming the flag and the folder the run could not write in."""
    for flag, attribute, is_file in OUTPUTS:
        value = getattr(args, attribute, None)
        if value:
            _check_writable(flag, Path(value).parent if is_file else Path(value))


def _check_writable(flag: str, folder: Path) -> None:
    existing = folder.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise FlagError(f"{flag}: {existing} is a file, so the folder {folder} cannot be made there; "
                        "choose another path")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        where = "in it" if existing == folder.absolute() else f"in {existing}, where it would be made"
        raise FlagError(f"{flag} {folder}: cannot write {where} ({err.strerror}); choose a folder you can write "
                        "to") from None
