"""Every unit test and every nbval kernel sees 8 simulated CPU devices and shares JAX's
persistent compilation cache.

This runs before any test module imports JAX. nbval starts its kernels as child
processes, and they inherit the environment set here.
"""

import os
import sys
from pathlib import Path

import pytest

from tunix_nb import devices

# The exercises' solutions live beside the lessons, in notebooks/solutions/.
sys.path.insert(0, str(Path(__file__).resolve().parent / "notebooks"))

N_TEST_DEVICES = 8

# TUNIX_NB_TEST_ON_ACCELERATOR=1 runs the unit tests on the machine's TPU or GPU instead
# (`pytest tests/ -n 0`: one process holds the chip); tests of CPU-only facts are skipped there.
ON_ACCELERATOR = os.environ.get("TUNIX_NB_TEST_ON_ACCELERATOR") == "1"
if not ON_ACCELERATOR:
    os.environ["JAX_PLATFORMS"] = "cpu"
    devices.simulate_cpu_devices(N_TEST_DEVICES)
else:
    import jax

    jax.devices()  # this process opens the chip now, before its children's platform is set below
    # One process at a time can hold a TPU: the processes the tests start (the training
    # command, launches, probes) run JAX on the CPU, with the CPU suite's simulated devices.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = devices._with_device_count_flag(os.environ.get("XLA_FLAGS", ""), N_TEST_DEVICES)
    # The session's precision, for module-scoped fixtures too (see agreement_precision_on_accelerators)
    from tunix_nb import compare

    compare.use_agreement_precision()
# Programs compiled once are read back by every later process (workers, kernels, the
# training command's runs) and by the next run of the suite: see devices.use_compile_cache.
devices.use_compile_cache()


@pytest.fixture(autouse=True)
def agreement_precision_on_accelerators():
    """The unit tests are agreement checks, so on a TPU or GPU each runs under the precision
    policy of tunix_nb.compare: float32 compute and float32 matmuls at float32's precision, as
    a CPU computes anyway (a TPU would multiply float32 in bfloat16 passes, and "auto" would
    compute in bfloat16). Tests of bfloat16 itself ask for it by name. Set for the whole session
    above, and again around each test, so that a test that changes it changes no other."""
    if not ON_ACCELERATOR:
        yield
        return
    from tunix_nb import compare

    with compare.agreement_precision():
        yield


def pytest_terminal_summary(terminalreporter):
    """List every notebook nbval executed, with its wall time, at the end of the run."""
    times: dict[str, float] = {}
    failed: set[str] = set()
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            path = getattr(report, "nodeid", "").split("::")[0]
            if path.endswith(".ipynb") and getattr(report, "when", "call") == "call":
                times[path] = times.get(path, 0.0) + report.duration
                if outcome in ("failed", "error"):
                    failed.add(path)
    if times:
        terminalreporter.write_sep("=", "notebooks executed by nbval")
        for path, seconds in sorted(times.items()):
            status = "FAILED" if path in failed else "ok"
            terminalreporter.write_line(f"{path}: {seconds:.1f} s of cells, {status}")


# nbval waits at most 5 s (IPyNbCell.output_timeout) for each output message after a cell
# has run; on a loaded 2-core machine a cell that printed a progress bar can miss that
# and fail with "Timeout of 5 seconds exceeded waiting for output". The cells' own
# limit stays --nbval-cell-timeout.
NBVAL_OUTPUT_TIMEOUT_S = 60


def pytest_collection_modifyitems(items):
    for item in items:
        if hasattr(item, "output_timeout"):
            item.output_timeout = NBVAL_OUTPUT_TIMEOUT_S


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only(reason): asserts a fact of the CPU (XLA's CPU code, the CPU "
                                       "backend); skipped when the tests run on an accelerator")
    config.addinivalue_line("markers", "needs_devices(n): compares n devices with one, or splits work over n; "
                                       "skipped on an accelerator with fewer (one TPU chip, one GPU)")
    config.addinivalue_line("markers", "needs_network: installs packages from an index over the network; "
                                       "skipped where no internet socket can be made (the TPU test machine)")
    config.addinivalue_line("markers", "needs_loopback: processes meet through a coordinator on 127.0.0.1; "
                                       "skipped where no loopback socket can listen (as lesson 06 skips)")
    config.addinivalue_line("markers", "needs_git: reads the repository's history; skipped in a copy of the "
                                       "tree without .git (the TPU test machine gets one)")


def _can_make_internet_socket() -> bool:
    import socket

    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("cpu_only")
    if marker is not None and ON_ACCELERATOR:
        pytest.skip(f"CPU only: {marker.kwargs.get('reason') or (marker.args or [''])[0]}")
    marker = item.get_closest_marker("needs_devices")
    if marker is not None and ON_ACCELERATOR:
        import jax

        if jax.device_count() < marker.args[0]:
            pytest.skip(f"needs {marker.args[0]} devices; this machine has {jax.device_count()}")
    if item.get_closest_marker("needs_network") is not None and not _can_make_internet_socket():
        pytest.skip("needs a package index over the network: this machine refuses internet sockets")
    if item.get_closest_marker("needs_loopback") is not None:
        from tunix_nb import launch

        if not launch.can_listen_on_loopback("This test"):
            pytest.skip("needs a TCP socket on loopback for the processes' coordinator")
    if item.get_closest_marker("needs_git") is not None and not (Path(__file__).parent / ".git").exists():
        pytest.skip("needs the repository's history: this copy of the tree has no .git")
