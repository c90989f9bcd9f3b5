"""A pytest plugin for the chip's shares of the suite: each failure's report is appended to
$OUT/unit_tests_failures_$CHUNK.txt as soon as the test ends, so that a share cut short by the
device call's limit still brings back why its tests failed (pytest prints them only at the end)."""

import os


def pytest_runtest_logreport(report):
    if report.outcome != "failed":
        return
    path = os.path.join(os.environ.get("OUT", "."), f"unit_tests_failures_{os.environ.get('CHUNK', 'share')}.txt")
    with open(path, "a") as out:
        out.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
