"""The temperature explorer works in a real JupyterLab, in a real browser.

Starts JupyterLab (this environment's Python, so its kernel is this environment's too)
on loopback with a random token, opens a copy of notebook 01 in headless Chromium
driven by Playwright, runs it (Run > Run All Cells) up to and including the cell that
builds `widgets.temperature_explorer(...)`, then moves the "temperature T" slider with
the keyboard and checks that the kernel redrew: the KL line and the figure (the PNG
inside the ipywidgets Output) both change. Screenshots land in pytest's tmp dir.

Needs Debian's chromium (/usr/bin/chromium) and Playwright for Python, driving that
system browser (Playwright's own browser download is not used):
    apt-get install -y chromium && pip install -r tests/browser/requirements.txt
.ci/run installs both. Without them the test skips, except under CI=true, where it fails.
The notebook runs on 1 device (TUNIX_NB_DEVICES=1): the widget does not need 8.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "01_vmap_kl_distillation.ipynb"
WIDGET_CALL = "widgets.temperature_explorer("
SLIDER_LABEL = "temperature T"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SERVER_START_S = 60    # JupyterLab answering /api/status
NOTEBOOK_RUN_S = 180   # the cells up to the widget (about 30 s on 2 cores)
REDRAW_S = 30          # one slider move -> new KL text and figure
ARROW_PRESSES = 4      # 4 steps of 0.25: T from 1.0 to 2.0


def _chromium() -> str | None:
    return shutil.which("chromium") or (
        "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)


@pytest.fixture
def chromium() -> str:
    """The Chromium binary; skip (or fail under CI=true) when the browser stack is missing."""
    missing = []
    chromium = _chromium()
    if chromium is None:
        missing.append("Debian's chromium (apt-get install -y chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("Playwright for Python (pip install -r tests/browser/requirements.txt)")
    if missing:
        reason = "browser test needs " + " and ".join(missing)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason}; CI=true, so it must run (.ci/run installs both)")
        pytest.skip(reason)
    return chromium


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook_up_to_widget(dest: Path) -> int:
    """Write notebook 01's cells up to and including the widget cell, outputs cleared."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    idx = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code" and WIDGET_CALL in c.source), None)
    assert idx is not None, f"no cell of {NOTEBOOK.name} calls {WIDGET_CALL}...)"
    nb.cells = nb.cells[: idx + 1]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)  # no stored widget state: everything shown comes from the kernel
    nbformat.write(nb, dest)
    return sum(c.cell_type == "code" for c in nb.cells)


def _kernels(server_pid: int) -> list[int]:
    """Pids of the ipykernel processes the server started (Linux /proc; [] elsewhere)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == server_pid and b"ipykernel" in _cmdline(int(stat.parent.name)):
            kids.append(int(stat.parent.name))
    return kids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture
def jupyter_lab(tmp_path, chromium):
    """A JupyterLab on 127.0.0.1 serving a temp dir holding the trimmed notebook 01."""
    root, home = tmp_path / "notebooks", tmp_path / "jupyter"
    root.mkdir()
    n_code_cells = _notebook_up_to_widget(root / NOTEBOOK.name)
    # Our own Jupyter config/data/runtime dirs: no user kernelspecs, settings or workspaces.
    # Settings: no "get notified about Jupyter news?" toast over the page.
    settings = home / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JUPYTER_PATH")}
    env.update(TUNIX_NB_DEVICES="1", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"))
    port, token = _free_port(), secrets.token_hex(16)
    log = (tmp_path / "jupyterlab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.extension_manager=readonly"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited ({server.returncode}):\n{(tmp_path / 'jupyterlab.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab not up after {SERVER_START_S} s:\n{(tmp_path / 'jupyterlab.log').read_text()}")
            time.sleep(0.25)
        yield {"url": f"{base}/lab/tree/{NOTEBOOK.name}?token={token}", "pid": server.pid,
               "n_code_cells": n_code_cells, "log": tmp_path / "jupyterlab.log"}
    finally:
        kernels = _kernels(server.pid)
        server.send_signal(signal.SIGTERM)  # jupyter_server shuts its kernels down on SIGTERM
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # the process group we started
            server.wait(timeout=5)
        for pid in kernels:  # kernels run in sessions of their own: end any the server left
            if b"ipykernel" in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()


def _errors_on_page(page) -> str:
    texts = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').all_inner_texts()
    return "\n---\n".join(t[-2000:] for t in texts) or "(no stderr/error output on the page)"


def _wait_for(predicate, timeout_s: float, what: str, page):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; page errors:\n"
                                 f"{_errors_on_page(page)}")
        page.wait_for_timeout(200)


def test_temperature_slider_redraws_in_jupyterlab(chromium, jupyter_lab, tmp_path):
    from playwright.sync_api import sync_playwright

    t0 = time.monotonic()
    times = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=chromium, headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1280, "height": 900})
        page = browser.new_page()
        try:
            page.goto(jupyter_lab["url"])
            # The notebook has loaded and its kernel (this environment's Python, see below) is idle.
            page.get_by_text(re.compile(r"^Python 3 \(ipykernel\) \| Idle$")).wait_for(
                timeout=SERVER_START_S * 1000)
            if Path("/proc/self").is_dir():
                kernels = _kernels(jupyter_lab["pid"])
                assert len(kernels) == 1, f"ipykernel processes under the server: {kernels}"
                exe = _cmdline(kernels[0]).split(b"\0")[0].decode()
                assert Path(exe) == Path(sys.executable), (exe, sys.executable)
            times["lab open"] = time.monotonic() - t0

            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()

            explorer = page.locator(".widget-vbox").filter(
                has=page.locator(".widget-label", has_text=SLIDER_LABEL)).first
            image = explorer.locator(".widget-output img")
            kl_line = explorer.locator(".widget-html-content")
            _wait_for(lambda: image.count() == 1 and "KL" in (kl_line.text_content() or ""),
                      NOTEBOOK_RUN_S, "the temperature explorer to render", page)
            times["cells run"] = time.monotonic() - t0 - times["lab open"]
            setup_output = page.locator(".jp-CodeCell").first.locator(".jp-OutputArea").text_content()
            assert "devices=1 " in setup_output, setup_output  # TUNIX_NB_DEVICES reached the kernel
            # Every code cell ran once, in order: the widget cell's prompt is the last count.
            widget_prompt = page.locator(".jp-CodeCell").last.locator(".jp-InputPrompt").text_content()
            assert widget_prompt.strip() == f"[{jupyter_lab['n_code_cells']}]:", widget_prompt
            assert "T = 1:" in kl_line.text_content()
            src_before, kl_before = image.get_attribute("src"), kl_line.text_content()
            assert src_before.startswith("data:image/png;base64,"), src_before[:80]
            explorer.screenshot(path=tmp_path / "explorer_T1.png")

            # Move the slider: focus its handle and press the right arrow, as a keyboard user would.
            handle = explorer.locator(".noUi-handle")
            handle.focus()
            for _ in range(ARROW_PRESSES):
                handle.press("ArrowRight")
            t_move = time.monotonic()
            _wait_for(lambda: "T = 2:" in (kl_line.text_content() or "")
                      and image.count() == 1 and image.get_attribute("src") != src_before,
                      REDRAW_S, "the KL line and the figure to show T = 2", page)
            times["redraw"] = time.monotonic() - t_move
            assert explorer.locator(".widget-readout").inner_text().strip() == "2.00"
            kl_after, src_after = kl_line.text_content(), image.get_attribute("src")
            assert kl_after != kl_before and src_after != src_before
            explorer.screenshot(path=tmp_path / "explorer_T2.png")
            page.screenshot(path=tmp_path / "jupyterlab.png")
        except Exception:
            page.screenshot(path=tmp_path / "failure.png")  # for the person reading the failure
            raise
        finally:
            browser.close()

    for name in ("explorer_T1.png", "explorer_T2.png", "jupyterlab.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name
    if os.environ.get("TUNIX_NB_WIDGET_SCREENSHOT"):  # opt-in copy, e.g. results/widget_screenshot.png
        shutil.copyfile(tmp_path / "explorer_T2.png", os.environ["TUNIX_NB_WIDGET_SCREENSHOT"])
    print("browser test: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
          + f"; before: {kl_before!r}; after: {kl_after!r}", file=sys.stderr)
