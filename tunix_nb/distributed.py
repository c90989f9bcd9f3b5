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


# How long a process waits at a step for the others to reach it too. They run the same steps in
# lockstep (every step's collectives join them), so only a first compile can keep one far behind;
# a process that died is found by the heartbeat first.
STOP_AGREEMENT_TIMEOUT_S = 3600


def agree_on_stop(round_id: int, signum: int | None) -> int | None:
    """The stop signal every process acts on after this round, the same in all of them: None, or
    a signal one of them got (`signum` here), the lowest-numbered process's if several did.

    Every process calls it once a step, with the same `round_id`s in the same order. A signal
    reaching one process only, or several at different steps, then stops them all after the
    same step, so they save the same checkpoint (Orbax's save is a collective). Through JAX's
    coordination service, on the host: a signalled process posts it under the round's key, a
    barrier waits for every process, each reads the round's keys (about 1 ms on loopback, two
    round trips; the devices go on with the step in flight meanwhile). JAX's own
    `multihost_utils.reached_preemption_sync_point` agrees too, but on SIGTERM alone (its C++
    handler, which a Python handler replaces) and without saying which signal came."""
    from jax._src import distributed as jax_distributed  # the client JAX's initialize made; no public getter

    state = jax_distributed.global_state  # not jax.process_index(): that starts the backend, which waits for all
    key = f"tunix_nb/stop/{round_id}"
    if signum is not None:
        state.client.key_value_set(f"{key}/{state.process_id}", str(signum))
    state.client.wait_at_barrier("tunix_nb/stop", STOP_AGREEMENT_TIMEOUT_S * 1000)  # a barrier id may be reused
    posted = {int(name.rsplit("/", 1)[1]): int(value) for name, value in state.client.key_value_dir_get(f"{key}/")}
    return posted[min(posted)] if posted else None
