"""The ckpt group: an Orbax save against the disk's write bandwidth, how long an async save
blocks, and the restore time."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from tunix_nb.bench.common import figure, spread, timed_figure

# the save's share of a physical limit is at most 1
FIGURES = {"ckpt_save_over_disk_bandwidth": (0.5, "min"), "async_block_share": (0.10, "max"),
           "ckpt_restore_seconds": (None, None)}


def measure(*, quick: bool, repeats: int) -> dict:
    return bench_ckpt(16 if quick else 128, 3 if quick else 5)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under root: its bytes are on disk, not in the page cache."""
    for path in [root, *root.rglob("*")]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_and_fsync(path: Path, payload: bytes) -> float:
    """Seconds to write payload to a new file and fsync it (the disk-bandwidth probe)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def _orbax_save(directory: Path, state, *, async_save: bool, restore: bool = False) -> dict:
    """Seconds an Orbax save blocks the caller, takes until its files are on disk (fsync'd
    like the probe's), and, if asked, takes to restore; the checkpoint is deleted after."""
    import shutil

    import jax
    import orbax.checkpoint as ocp

    from tunix_nb import checkpoint

    manager = checkpoint.make_manager(directory, keep=1, async_save=async_save)
    t0 = time.perf_counter()
    manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(state)))
    out = {"blocked": time.perf_counter() - t0}
    manager.wait_until_finished()
    fsync_tree(directory)
    out["total"] = time.perf_counter() - t0
    if restore:
        t0 = time.perf_counter()
        restored = manager.restore(1, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
        jax.block_until_ready(dict(restored["params"]))
        out["restore"] = time.perf_counter() - t0
    manager.close()
    out["bytes_on_disk"] = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    shutil.rmtree(directory)
    return out


def bench_ckpt(megabytes, repeats):
    """An Orbax save against the disk's write bandwidth, both timed until their bytes are
    on disk; how long an async save blocks; the restore time.

    Rounds rotate the order (probe, sync save, async save), after one warm-up round: the
    first write of a process ran 4x slower here, and one contender must not always
    follow another's writes.
    """
    import jax
    import numpy as np

    n_arrays = 8
    per = int(megabytes * 2**20 / 4 / n_arrays)
    state = {f"w{i}": jax.numpy.asarray(np.random.default_rng(i).standard_normal(per, np.float32))
             for i in range(n_arrays)}
    nbytes = sum(x.nbytes for x in state.values())
    payload = np.random.default_rng(0).bytes(nbytes)
    runs = {"disk": [], "sync": [], "async": [], "memory": []}
    # the same save into RAM (tmpfs), where no disk is involved: what the save costs the CPU
    memory_root = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=".") as root, tempfile.TemporaryDirectory(dir=memory_root) as in_memory:
        contenders = {"disk": lambda r: _write_and_fsync(Path(root) / f"disk{r}.bin", payload),
                      "sync": lambda r: _orbax_save(Path(root) / f"sync{r}", state, async_save=False, restore=True),
                      "async": lambda r: _orbax_save(Path(root) / f"async{r}", state, async_save=True)}
        if memory_root is not None:
            contenders["memory"] = lambda r: _orbax_save(Path(in_memory) / f"sync{r}", state, async_save=False)
        names = list(contenders)
        for r in range(-1, repeats):  # round -1 warms up
            for name in names[r % len(names):] + names[:r % len(names)]:
                out = contenders[name](r)
                if r >= 0:
                    runs[name].append(out)
    med = lambda xs: float(np.median(xs))
    disk_s = np.asarray(runs["disk"])
    sync_s = np.asarray([x["total"] for x in runs["sync"]])
    blocked_s = np.asarray([x["blocked"] for x in runs["async"]])
    restore_s = [x["restore"] for x in runs["sync"]]
    disk_bw, save_bw = nbytes / med(disk_s), nbytes / med(sync_s)
    in_memory_s = med([x["total"] for x in runs["memory"]]) if runs["memory"] else None
    return {**timed_figure(FIGURES, "ckpt_save_over_disk_bandwidth", spread(disk_s / sync_s),
                           state_bytes=nbytes, save_bytes_per_second=save_bw, disk_write_bytes_per_second=disk_bw,
                           bytes_on_disk=runs["sync"][0]["bytes_on_disk"], repeats=repeats,
                           save_to_memory_seconds=in_memory_s,
                           note="both timed until their bytes are on disk: the probe writes one file of the "
                                "same size and fsyncs it; the sync Orbax save waits, then fsyncs every file "
                                "and folder it wrote"),
            **timed_figure(FIGURES, "async_block_share", spread(blocked_s / sync_s),
                           async_blocked_seconds=med(blocked_s),
                           async_total_seconds=med([x["total"] for x in runs["async"]]),
                           sync_seconds=med(sync_s), repeats=repeats),
            **figure(FIGURES, "ckpt_restore_seconds", med(restore_s), spread=spread(restore_s), state_bytes=nbytes,
                     restore_bytes_per_second=nbytes / med(restore_s), repeats=repeats)}
