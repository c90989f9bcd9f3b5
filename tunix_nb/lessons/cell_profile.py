"""A Python profile of each slow cell: where its seconds went, host-side (`--profile SECONDS`).

cProfile sees every Python call, including the ones that wait for a device (`block_until_ready`,
`float()` of a device value, `device_get`), so a cell slower on a chip than on a CPU shows
whether it waits on compiles, on the device, or on host work. It slows Python-heavy cells,
so a run made with it is for diagnosis, not for the record's times.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys

TOP_FUNCTIONS = 15  # per slow cell, by cumulative time
TOP_OWN = 8  # per slow cell, by own time: where the seconds were spent (an XLA compile, a device wait)
# The frames that run every cell: their cumulative time is the cell's, so they say nothing
PLUMBING = ("IPython/", "asyncio/", "~:0(<built-in method builtins.exec>)", "~:0(<method 'send' of 'coroutine' objects>)")


def short_path(filename: str) -> str:
    """'jax/_src/dispatch.py' rather than a machine's site-packages path (records are committed)."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in filename:
            return filename.split(marker, 1)[1]
    for entry in sorted((p for p in sys.path if p), key=len, reverse=True):
        if filename.startswith(entry.rstrip(os.sep) + os.sep):
            return filename[len(entry.rstrip(os.sep)) + 1:]
    return os.path.basename(filename)


def function_rows(profile: cProfile.Profile) -> list[dict]:
    """Every profiled function but the cell-running plumbing: name, calls, own and cumulative seconds."""
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (primitive calls, calls, own, cumulative, callers)
    rows = [{"function": f"{short_path(file)}:{line}({name})", "calls": calls, "own_seconds": round(own, 3),
             "cumulative_seconds": round(cumulative, 3)}
            for (file, line, name), (_, calls, own, cumulative, _) in stats.items()]
    return [row for row in rows if not row["function"].startswith(PLUMBING)]


def top_functions(profile: cProfile.Profile, n: int = TOP_FUNCTIONS) -> list[dict]:
    """The `n` functions with the most cumulative time, the plumbing that runs every cell aside."""
    return sorted(function_rows(profile), key=lambda row: -row["cumulative_seconds"])[:n]


def top_own_time(profile: cProfile.Profile, n: int = TOP_OWN) -> list[dict]:
    """The `n` functions with the most time spent in themselves (not in what they call)."""
    return sorted(function_rows(profile), key=lambda row: -row["own_seconds"])[:n]


class CellProfiler:
    """Profiles every cell; keeps the profile of those that took at least `min_seconds`."""

    def __init__(self, min_seconds: float | None):
        self.min_seconds = min_seconds
        self.profile = None

    def start(self) -> None:
        if self.min_seconds is not None:
            self.profile = cProfile.Profile()
            self.profile.enable()

    def stop(self, seconds: float) -> dict:
        """{"profile": [...]} for a slow cell, else {}."""
        if self.profile is None:
            return {}
        self.profile.disable()
        profile, self.profile = self.profile, None
        if seconds < self.min_seconds:
            return {}
        return {"profile": top_functions(profile), "profile_own_time": top_own_time(profile)}
