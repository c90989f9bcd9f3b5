"""pmap helpers for current JAX (replicate, unreplicate, shard a batch), meshes and shardings.

JAX 0.10 removed `jax.device_put_replicated` and `jax.device_put_sharded`. Since JAX 0.8
`pmap` is built on `jit` + `shard_map`, and its inputs are ordinary arrays whose
leading axis is split over the devices by a `NamedSharding`. These helpers build such
arrays directly, with one copy (or one slice) per device and no gather on the host.

pmap's successors (`jax.shard_map`, and `jax.jit` with shardings) run on a `Mesh` and
take arrays without a device axis; the second half of this module builds those meshes
and shardings: replicated or FSDP-sharded state, a row-sharded batch, and a gather
back to one device.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from tunix_nb import layer_stack

DEVICE_AXIS = "devices"  # the name of the leading device axis of pmapped arrays


def _first_devices(have, n_devices: int | None, kind: str = ""):
    """The first `n_devices` of `have` (all by default), or a clear error if there are fewer."""
    n = len(have) if n_devices is None else n_devices
    if not 1 <= n <= len(have):
        raise ValueError(
            f"Asked for {n} devices but JAX has {len(have)} {kind}device(s). Use n_devices <= "
            f"{len(have)}, or restart with more simulated devices (tunix_nb.devices.simulate_cpu_devices)."
        )
    return have[:n]


def _devices(n_devices: int | None):
    return _first_devices(jax.local_devices(), n_devices, "local ")


def leading_axis_sharding(n_devices: int | None = None) -> NamedSharding:
    """Split an array's leading axis (of size n_devices) over the devices, as pmap does."""
    return NamedSharding(Mesh(np.array(_devices(n_devices)), (DEVICE_AXIS,)), P(DEVICE_AXIS))


def replicate(tree, n_devices: int | None = None):
    """One copy of every leaf per device: leaf [...] -> [n_devices, ...] for pmap."""
    sharding = leading_axis_sharding(n_devices)
    n = sharding.mesh.size

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback((n, *x.shape), sharding, lambda _: x[None])

    return jax.tree.map(put, tree)


def unreplicate(tree):
    """Device 0's copy of every replicated leaf: [n_devices, ...] -> [...]."""
    return jax.tree.map(lambda x: x.addressable_shards[0].data[0], tree)


def shard_batch(batch, n_devices: int | None = None):
    """Split a global batch over devices: leaf [B, ...] -> [n_devices, B // n_devices, ...].

    Device i gets rows i*B/n ... (i+1)*B/n - 1, so the devices together hold exactly the
    global batch a single device would see.
    """
    sharding = leading_axis_sharding(n_devices)
    n = sharding.mesh.size

    def put(x):
        x = np.asarray(x)
        _check_rows(x.shape[0], n)
        return jax.device_put(x.reshape(n, x.shape[0] // n, *x.shape[1:]), sharding)

    return jax.tree.map(put, batch)


# ------------------------------------------------------------------ meshes and shardings
#
# pmap's successors take arrays *without* a leading device axis. A `Mesh` names the
# devices ("data" here), and a `NamedSharding(mesh, PartitionSpec(...))` says how each
# array lies on it: P() replicated (a full copy per device), P("data") split along the
# leading axis, P(None, "data") split along the second axis, ...

MESH_AXIS = "data"  # the name of the mesh axis the batch (and, for FSDP, the state) is split over
MESH_MODES = ("shard_map", "dp", "fsdp")  # strategies that run on a Mesh


def make_mesh(n_devices: int | None = None, axis: str = MESH_AXIS) -> Mesh:
    """A 1-D mesh over the first `n_devices` devices (default: all), axis named `axis`.

    Its axis type is `Auto`: shardings are hints for the compiler, which inserts the
    collectives (JAX 0.10's `jax.make_mesh` defaults to `Explicit`, sharding-in-types).
    """
    devices = _first_devices(jax.devices(), n_devices)
    return jax.make_mesh((len(devices),), (axis,), axis_types=(AxisType.Auto,), devices=devices)


def _axis_size(mesh: Mesh, axis: str = MESH_AXIS) -> int:
    return mesh.shape[axis]


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh: P()."""
    return NamedSharding(mesh, P())


def data_sharding(mesh: Mesh, axis: str = MESH_AXIS) -> NamedSharding:
    """The leading (batch) axis split over the mesh axis: P("data")."""
    return NamedSharding(mesh, P(axis))


def fsdp_spec(shape, n: int, axis: str = MESH_AXIS) -> P:
    """The FSDP rule for one array: split its largest dimension that divides by `n`.

    Ties go to the first such dimension. Arrays with no such dimension (scalars such
    as Adam's step count, or odd sizes such as a 259-token vocabulary axis alone) stay
    replicated. E.g. with n = 8: [259, 32] -> P(None, "data"); [64, 32] -> P("data");
    [7] -> P().
    """
    best = None
    for i, size in enumerate(shape):
        if size >= n and size % n == 0 and (best is None or size > shape[best]):
            best = i
    if best is None:
        return P()
    return P(*([None] * best), axis)


def fsdp_shardings(tree, mesh: Mesh, axis: str = MESH_AXIS):
    """A NamedSharding per leaf of `tree` (arrays or shape-dtype structs) by `fsdp_spec`. A leaf
    of stacked blocks (`layer_stack`, [n_layers, ...]) is never split on its layer axis: the
    scan takes one layer a step, and each layer must stay spread over every device."""
    n = _axis_size(mesh, axis)

    def sharding(path, x):
        shape = np.shape(x)
        if len(shape) > 1 and any(getattr(key, "key", None) == layer_stack.STACKED for key in path):
            return NamedSharding(mesh, P(None, *fsdp_spec(shape[1:], n, axis)))
        return NamedSharding(mesh, fsdp_spec(shape, n, axis))

    return jax.tree_util.tree_map_with_path(sharding, tree)


def state_shardings(tree, mesh: Mesh, parallel_mode: str):
    """Shardings of the training state (params, optimizer state, frozen params).

    "fsdp": split by `fsdp_spec`; "shard_map" and "dp": replicated on every device.
    """
    if parallel_mode == "fsdp":
        return fsdp_shardings(tree, mesh)
    if parallel_mode in ("shard_map", "dp"):
        return jax.tree.map(lambda _: replicated(mesh), tree)
    raise ValueError(f"Unknown mesh strategy {parallel_mode!r}; choose one of {MESH_MODES}.")


def place_state(tree, mesh: Mesh, parallel_mode: str, *, copy: bool = True):
    """Put the training state on the mesh as `parallel_mode` wants it, as new arrays.

    New arrays, so that a donating step cannot delete the caller's: `device_put` may
    reuse the input's buffer as one device's replica (even with may_alias=False), and
    returns an array already placed as it is, so such leaves are copied once more.
    `copy=False`, for a caller that hands its arrays over (the training command): leaves
    already placed stay as they are, so the state is held once.
    """
    placed = jax.device_put(tree, state_shardings(tree, mesh, parallel_mode))
    if not copy:
        return placed

    def fresh(new, old):
        reused = new is old or new.sharding.is_fully_replicated
        return jnp.copy(new) if isinstance(old, jax.Array) and reused else new

    return jax.tree.map(fresh, placed, tree)


def _check_rows(rows: int, n: int) -> None:
    if rows % n:
        raise ValueError(
            f"The global batch of {rows} rows does not divide by the {n} devices. "
            f"Use a batch size that is a multiple of {n} (e.g. {(rows // n + 1) * n}), "
            "or run on fewer devices."
        )


def process_rows(mesh: Mesh, global_rows: int, axis: str = MESH_AXIS) -> slice:
    """The rows of a [global_rows, ...] batch that this process loads: all of them with one process.

    With several processes (`tunix_nb.distributed`), each holds the rows of its own
    devices under P("data"): on a mesh ordered like `jax.devices()`, process p of P
    gets the p-th contiguous block of global_rows / P rows.
    """
    _check_rows(global_rows, _axis_size(mesh, axis))
    index_map = data_sharding(mesh, axis).addressable_devices_indices_map((global_rows,))
    blocks = sorted({(idx[0].start or 0, global_rows if idx[0].stop is None else idx[0].stop)
                     for idx in index_map.values()})
    if any(a[1] != b[0] for a, b in zip(blocks, blocks[1:])):
        raise ValueError("This process's devices hold rows that are not contiguous on the mesh; "
                         "build the mesh with parallel.make_mesh (devices in jax.devices() order).")
    return slice(blocks[0][0], blocks[-1][1])


def place_batch(batch, mesh: Mesh, axis: str = MESH_AXIS):
    """Split a batch's rows over the mesh: leaf [B, ...] becomes the global [B, ...], sharded P("data").

    Device i holds rows i*B/n ... (i+1)*B/n - 1, as with `shard_batch`, but there is no
    leading device axis: the array is the global batch. `batch` holds the rows *this
    process* loaded: the whole global batch with one process; with several, its own
    `process_rows` of it (each process loads only its share, and
    `jax.make_array_from_process_local_data` assembles the global array from them).
    """
    n = _axis_size(mesh, axis)
    n_processes = len({d.process_index for d in mesh.devices.flat})
    sharding = data_sharding(mesh, axis)

    def put(x):
        x = np.asarray(x)
        global_shape = (x.shape[0] * n_processes, *x.shape[1:])
        _check_rows(global_shape[0], n)
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(put, batch)


def to_host(x) -> np.ndarray:
    """The whole value of an array as NumPy, wherever its shards live.

    An array split over several processes' devices (FSDP state) is all-gathered: a
    collective, so every process must call this in the same order. Replicated and
    single-process arrays are read locally.
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather(tree):
    """Every leaf whole on (local) device 0: undoes any mesh placement (all-gathers FSDP shards).

    What a strategy-independent caller (checkpoints, evaluation) wants back. With
    several processes, every process gets its own whole copy (see `to_host`).
    """
    device0 = jax.local_devices()[0]

    def whole(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = to_host(x)
        return jax.device_put(x, device0)

    return jax.tree.map(whole, tree)


def bytes_per_device(tree) -> dict:
    """{device: bytes} that each device holds of `tree`'s arrays, from their shards."""
    held = collections.Counter()
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return dict(sorted(held.items(), key=lambda kv: kv[0].id))
