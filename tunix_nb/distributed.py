"""Multi-process JAX: several processes, one controller each, training as one program.

On a TPU pod slice or a cluster of GPU hosts, one Python process runs per host and
drives that host's devices. `jax.distributed.initialize` connects them through a
coordinator (process 0), after which `jax.devices()` lists *every* process's devices,
a `Mesh` can span them all, and a jitted step's collectives cross the processes. Each
process still runs the same program: it only ever touches its own devices' shards
(`jax.local_devices()`), and loads only its own part of each batch.

On one machine the same thing runs with CPU devices: each process simulates some CPU
devices (`devices.simulate_cpu_devices`), the collectives between processes go over
TCP with gloo, and the coordinator listens on loopback. `tunix_nb.launch` starts such
a group of processes.

Call `initialize` once per process, after the device count is fixed and before
anything asks JAX for its devices.
"""

from __future__ import annotations

CPU_COLLECTIVES = "gloo"  # how CPU devices of different processes all-reduce (TCP); "mpi" needs an MPI install
DEFAULT_HEARTBEAT_TIMEOUT_S = 100  # JAX's default: a process silent this long counts as dead


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
               init_timeout_s: int = 120) -> None:
    """Join a multi-process run (`jax.distributed.initialize`), with CPU collectives over gloo.

    `coordinator` is "host:port" of process 0, which starts the coordination service
    there. Leave all three of coordinator/num_processes/process_id out on a cluster JAX
    recognises (Cloud TPU pod slices, SLURM, Open MPI, Kubernetes with JobSet): it then
    reads them from the environment.

    If a process stops sending heartbeats for `heartbeat_timeout_s` (it died, or its
    host did), JAX terminates every other process with an error naming the lost task,
    instead of leaving them blocked in a collective forever. A process that cannot
    reach the coordinator within `init_timeout_s` fails with an error too.
    """
    given = (coordinator, num_processes, process_id)
    if any(v is not None for v in given) and any(v is None for v in given):
        raise ValueError(
            "Give all of coordinator, num_processes and process_id (e.g. '127.0.0.1:12355', 2, 0), "
            "or none of them to let JAX detect the cluster (TPU pod slice, SLURM, Open MPI, ...).")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} must be in 0 ... {num_processes - 1} "
                         f"for num_processes={num_processes}.")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               initialization_timeout=init_timeout_s)


def shutdown() -> None:
    """Leave the run: waits (within JAX's shutdown timeout) for the other processes to leave too."""
    import jax

    jax.distributed.shutdown()


def is_main_process() -> bool:
    """True in process 0, the one that prints and writes shared files (metrics, logs)."""
    import jax

    return jax.process_index() == 0


def print_once(message: str) -> None:
    """Print what every process would print alike: once, from process 0."""
    if is_main_process():
        print(message, flush=True)
