"""Where a plan compiles for: the CPU, one TPU v5e chip, or a v5e-8, without the chips.

libtpu (the TPU compiler, about 700 MB) builds a chip's topology on a machine that has
none (`jax.experimental.topologies`), even with JAX_PLATFORMS=cpu. It is not in the
kit's requirements: with it installed where `import libtpu` finds it, every JAX process
that does not pin JAX_PLATFORMS prints libtpu's initialisation warnings and waits for it
(the CLI on a laptop, for one). Install it apart and point JAX's own variable at it:

    pip install --no-deps --target tpu_compiler libtpu==0.0.42.1   # what jax[tpu]==0.10.2 pins
    export TPU_LIBRARY_PATH=$PWD/tpu_compiler/libtpu/libtpu.so

(`pip install "jax[tpu]==0.10.2"` in an environment of its own works too.)
"""

from __future__ import annotations

import importlib.util
import os

import jax
import numpy as np
from jax.sharding import Mesh

from tunix_nb import parallel

TARGETS = ("cpu", "v5e", "v5e-8")
LIBTPU_PIN = "libtpu==0.0.42.1"
# The pinned libtpu refuses "v5e:1x1" (a v5e host holds 2x2 chips): one chip is the first
# device of a 2x2 topology, which the compiler then plans alone.
TOPOLOGY = {"v5e": "v5e:2x2", "v5e-8": "v5e:2x4"}
HBM_BYTES = {"v5e": 16 * 2**30, "v5e-8": 16 * 2**30}  # per chip
INSTALL_HINT = (f"pip install --no-deps --target tpu_compiler {LIBTPU_PIN} && "
                "export TPU_LIBRARY_PATH=$PWD/tpu_compiler/libtpu/libtpu.so")


def libtpu_missing() -> str | None:
    """Why the TPU targets cannot compile here, with the fix; None when libtpu is found."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path:
        if os.path.isfile(path):
            return None
        return f"TPU_LIBRARY_PATH={path} is not a file; point it at libtpu.so ({INSTALL_HINT})."
    if importlib.util.find_spec("libtpu") is not None:
        return None
    return f"libtpu is not installed (it is not in requirements.txt): {INSTALL_HINT}"


def mesh_for(target: str) -> Mesh:
    """A one-axis mesh over the target's devices: one for "cpu" and "v5e", eight for "v5e-8"."""
    if target not in TARGETS:
        raise ValueError(f"Unknown target {target!r}; choose one of {TARGETS}.")
    if target == "cpu":
        devices = jax.devices("cpu")[:1]
    else:
        reason = libtpu_missing()
        if reason:
            raise RuntimeError(f"target {target!r} needs the TPU compiler: {reason}")
        from jax.experimental import topologies

        # libtpu takes a lock file against a second process on the same chips;
        # compiling ahead of time touches no chip, so several processes may (tests, bench).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        topology = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGY[target])
        devices = topology.devices[:1] if target == "v5e" else topology.devices
    return Mesh(np.array(devices), (parallel.MESH_AXIS,))
