"""pmap helpers for current JAX: replicate, unreplicate, shard a batch.

JAX 0.10 removed `jax.device_put_replicated` and `jax.device_put_sharded`. Since JAX 0.8
`pmap` is built on `jit` + `shard_map`, and its inputs are ordinary arrays whose
leading axis is split over the devices by a `NamedSharding`. These helpers build such
arrays directly, with one copy (or one slice) per device and no gather on the host.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DEVICE_AXIS = "devices"  # the name of the leading device axis of pmapped arrays


def _devices(n_devices: int | None):
    local = jax.local_devices()
    n = len(local) if n_devices is None else n_devices
    if not 1 <= n <= len(local):
        raise ValueError(
            f"Asked for {n} devices but JAX has {len(local)} local device(s). Use n_devices <= "
            f"{len(local)}, or restart with more simulated devices (tunix_nb.devices.simulate_cpu_devices)."
        )
    return local[:n]


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
        if x.shape[0] % n:
            raise ValueError(
                f"The global batch of {x.shape[0]} rows does not divide by the {n} devices. "
                f"Use a batch size that is a multiple of {n} (e.g. {(x.shape[0] // n + 1) * n}), "
                "or run on fewer devices."
            )
        return jax.device_put(x.reshape(n, x.shape[0] // n, *x.shape[1:]), sharding)

    return jax.tree.map(put, batch)
