"""The repository's promises: CI runs the README's test command, pins are exact."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_COMMAND = "pip install -r requirements.txt && pytest"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in readme
    assert ci_lines[-1] == TEST_COMMAND


def requirement_lines(name: str) -> list[str]:
    lines = (line.split("#")[0].strip() for line in (ROOT / name).read_text().splitlines())
    return [line for line in lines if line]


@pytest.mark.parametrize("name", ["requirements.txt", "requirements-lessons.txt"])
def test_requirements_are_exact_pins(name):
    for line in requirement_lines(name):
        if line not in ("-e .", "-r requirements-lessons.txt"):
            assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][A-Za-z0-9.]*", line), f"{name}: {line}"


def test_requirements_txt_is_the_lessons_plus_tools_and_the_kit():
    """Local installs (from the repository root) get everything; hosted runtimes take only
    requirements-lessons.txt (tunix_nb.colab), so it must not name a path relative to a cwd."""
    assert {"-r requirements-lessons.txt", "-e ."} <= set(requirement_lines("requirements.txt"))
    assert all(not line.startswith("-") for line in requirement_lines("requirements-lessons.txt"))
    tools = {line.split("==")[0] for line in requirement_lines("requirements.txt") if "==" in line}
    assert tools == {"jupyterlab", "nbval", "pytest", "pytest-xdist"}


def test_binder_start_exports_eight_devices():
    start = (ROOT / "binder" / "start").read_text()
    assert "--xla_force_host_platform_device_count=8" in start and 'exec "$@"' in start


def test_no_tracked_file_holds_a_build_machine_path():
    """Shipped files (checkpoints' commit_success.txt, notebook outputs, tracebacks) must not
    carry the absolute paths of the machine that wrote them. Documented https URLs are fine."""
    import subprocess

    # written so that this file does not match itself: each alternative needs a path character
    machine_path = re.compile(rb"(?<![\w.-])(?:/(?:work|root|tmp)/[\w.-]|/home/[\w.-]+/|/usr/local/lib/(?:python)"
                              rb"|/site-packages/[\w.-])")
    url = re.compile(rb"https?://[^\s\"'<>()\[\]\\]+")
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    found = {}
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file():  # a tracked file deleted in the working tree is not shipped from here
            text = url.sub(b"", path.read_bytes())
            hit = machine_path.search(text)
            if hit:
                found[name] = re.match(rb"[^\s\"'<>]{1,80}", text[hit.start():]).group().decode(errors="replace")
    assert not found, f"machine paths in tracked files (first match each): {found}"
