"""The repository's promises: CI runs the README's test command, pins are exact."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_COMMAND = "pip install -r requirements.txt && pytest"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in readme
    assert ci_lines[-1] == TEST_COMMAND


def test_requirements_are_exact_pins():
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-e"):
            assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][A-Za-z0-9.]*", line), line
    assert "-e ." in (ROOT / "requirements.txt").read_text()


def test_binder_start_exports_eight_devices():
    start = (ROOT / "binder" / "start").read_text()
    assert "--xla_force_host_platform_device_count=8" in start and 'exec "$@"' in start
