"""Devices: simulate N CPU devices before JAX starts, describe them, pick defaults.

JAX reads the device count once, when its first backend starts (the first array,
`jax.devices()`, ...). So `simulate_cpu_devices` must run before that, and in a
notebook that means before `import jax` in the setup cell.

A TPU chip has one holder at a time, so a child process that runs JAX while this one may
hold the chip gets `child_env()`: the CPU, and the kit on its PYTHONPATH.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import sys
import warnings
from pathlib import Path

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Overrides the device count a notebook's setup cell asks for, e.g. 1 to see the
# single-device path of every lesson: TUNIX_NB_DEVICES=1 jupyter lab notebooks/
DEVICES_ENV = "TUNIX_NB_DEVICES"
# JAX's own setting for the CPU device count; when set, JAX prefers it to the XLA flag.
JAX_COUNT_ENV = "JAX_NUM_CPU_DEVICES"


def _jax_backends_started() -> bool:
    """True once JAX has created a backend; only then is the device count fixed."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # no public API answers this question

    return xla_bridge.backends_are_initialized()


def _with_device_count_flag(xla_flags: str, n: int) -> str:
    """XLA_FLAGS with the device-count flag set to n, replacing any earlier value.

    n = 1 is the CPU default, so then the flag is dropped rather than set.
    """
    kept = re.sub(rf"{DEVICE_COUNT_FLAG}=\S*", "", xla_flags).split()
    return " ".join(kept if n == 1 else [*kept, f"{DEVICE_COUNT_FLAG}={n}"])


def simulate_cpu_devices(n: int = 8) -> None:
    """Make the CPU backend expose `n` devices. Call before JAX starts.

    Sets the XLA flag `--xla_force_host_platform_device_count=n` and selects the CPU
    platform. If JAX has already started, this is fine when it has exactly `n` CPU
    devices, and otherwise raises an error telling you to restart the kernel.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"simulate_cpu_devices(n) needs a positive int, got {n!r}.")
    if _jax_backends_started():
        import jax

        have = jax.devices()
        if len(have) == n and have[0].platform == "cpu":
            return
        raise RuntimeError(
            f"JAX has already started with {len(have)} {have[0].platform} device(s), so it "
            f"cannot switch to {n} simulated CPU devices. Restart the kernel (or the "
            f"Python process) and call tunix_nb.devices.simulate_cpu_devices({n}) "
            "before `import jax` and before anything else that uses JAX."
        )
    os.environ["XLA_FLAGS"] = _with_device_count_flag(os.environ.get("XLA_FLAGS", ""), n)
    os.environ.pop(JAX_COUNT_ENV, None)  # it would win over the flag just set
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported but not started: the config still applies
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)


# accelerator_hint() -> the pip extra of JAX's build for it (which pins libtpu or the CUDA plugin)
JAX_EXTRAS = {"tpu": "tpu", "gpu": "cuda12"}
# The environment variables accelerator_hint() reads. ISTPUVM=1 marks Kaggle's TPU image
# (its TPU v5e-8 is a TPU VM), as TPU_ACCELERATOR_TYPE marks a Cloud TPU VM.
HINT_ENV = ("JAX_PLATFORMS", "COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE", "ISTPUVM", "COLAB_GPU")


# Where accelerator_hint() looks for device files (the tests point it at a folder of their own)
DEV_ROOT = "/dev"


def tpu_device_files(dev_root: str | None = None) -> list[str]:
    """The TPU device files under `dev_root` (default DEV_ROOT): /dev/accel0, /dev/accel1, ...,
    or /dev/vfio/N for any number N, whichever driver the VM uses (a v5e chip has been seen as
    /dev/vfio/2). /dev/vfio/vfio, VFIO's control file, is on machines without a TPU too."""
    root = dev_root or DEV_ROOT
    vfio = [p for p in glob.glob(os.path.join(root, "vfio", "*")) if os.path.basename(p).isdigit()]
    return sorted(glob.glob(os.path.join(root, "accel*")) + vfio)


def accelerator_hint() -> str | None:
    """'tpu', 'gpu' or None, judged without starting JAX (so simulation stays possible).

    Looks at what the runtime exposes: Colab's accelerator variables, a TPU VM's (Cloud's
    or Kaggle's), TPU device files, an NVIDIA device file, or an explicit JAX_PLATFORMS.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        first = platforms.split(",")[0]
        return {"tpu": "tpu", "cuda": "gpu", "gpu": "gpu", "rocm": "gpu"}.get(first)
    if any(os.environ.get(name) for name in ("COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE", "ISTPUVM")):
        return "tpu"
    if tpu_device_files():
        return "tpu"
    if os.path.exists(os.path.join(DEV_ROOT, "nvidia0")) or os.environ.get("COLAB_GPU"):
        return "gpu"
    return None


def holds_accelerator() -> bool:
    """True once this process has started JAX on a TPU or GPU, which it then holds until it exits."""
    if not _jax_backends_started():
        return False
    import jax

    return jax.default_backend() != "cpu"


# What a child process must not inherit: this process's device count (XLA's flag, JAX's
# count, the kit's override). XLA_FLAGS goes whole, since XLA aborts on a flag it does not
# know, and flags meant for this process's accelerator are unknown to a CPU child's XLA.
CHILD_DROPS = ("XLA_FLAGS", JAX_COUNT_ENV, DEVICES_ENV)


def kit_root() -> str:
    """The folder that holds this `tunix_nb` package (the repository root of a clone)."""
    return str(Path(__file__).resolve().parent.parent)


def child_env(*, keep_accelerator: bool = False, **overrides: str) -> dict[str, str]:
    """The environment for a child Python process that runs JAX beside this one.

    One process at a time can hold a TPU chip: a second process that opens it dies with
    libtpu's "multi-process lockfile" error, and on Colab's v5e-1 the notebook's kernel holds
    the only chip. So the child runs JAX on the CPU (JAX_PLATFORMS=cpu), with one CPU device
    unless it simulates more (`--devices N`, `simulate_cpu_devices`, or an XLA_FLAGS override).
    `keep_accelerator=True` lets it open the TPU or GPU instead, where this process does not
    hold it (`holds_accelerator`): a parent that only starts children, one at a time.

    Everything else of this environment is kept (PYTHONPATH, TPU_* variables, the compilation
    cache's), and the kit's root is put on PYTHONPATH in front of this process's entries, never
    in their place: on some runtimes JAX itself is found through PYTHONPATH. `overrides`
    (NAME="value") come last.
    """
    env = {k: v for k, v in os.environ.items() if k not in CHILD_DROPS}
    if not keep_accelerator or holds_accelerator():
        env["JAX_PLATFORMS"] = "cpu"
    entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    env["PYTHONPATH"] = os.pathsep.join([kit_root(), *(e for e in entries if e != kit_root())])
    env.update(overrides)
    return env


def _count_from(name: str, value: str) -> int:
    """A device count read from the environment, or an error naming the variable to fix."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name}={value!r} is not a positive integer; set it to e.g. 1 or 8.")
    return n


def requested_cpu_devices(default: int) -> tuple[int, str]:
    """(count, where it came from) for CPU simulation, the most explicit source first.

    TUNIX_NB_DEVICES (this kit's override), then a count the user already gave JAX
    (JAX_NUM_CPU_DEVICES, or the device-count flag in XLA_FLAGS, as JAX's docs suggest),
    then `default`, the notebook's own choice.
    """
    if os.environ.get(DEVICES_ENV):
        return _count_from(DEVICES_ENV, os.environ[DEVICES_ENV]), f"from {DEVICES_ENV}"
    if os.environ.get(JAX_COUNT_ENV):
        return _count_from(JAX_COUNT_ENV, os.environ[JAX_COUNT_ENV]), f"from {JAX_COUNT_ENV}"
    flags = re.findall(rf"{DEVICE_COUNT_FLAG}=(\S*)", os.environ.get("XLA_FLAGS", ""))
    if flags:  # XLA takes the last one
        return _count_from(f"XLA_FLAGS {DEVICE_COUNT_FLAG}", flags[-1]), "from XLA_FLAGS"
    return default, f"the notebook's default; set {DEVICES_ENV} to change it"


COMPILE_CACHE_ENV = "TUNIX_NB_COMPILE_CACHE"


def compile_cache_dir() -> Path | None:
    """Where JAX's persistent compilation cache goes: $TUNIX_NB_COMPILE_CACHE, or
    $XDG_CACHE_HOME/tunix_nb/jax (~/.cache/tunix_nb/jax); None if that variable is "off".
    Outside the repository, so a clone never carries compiled programs."""
    chosen = os.environ.get(COMPILE_CACHE_ENV, "")
    if chosen.lower() in ("off", "0", "false", "none"):
        return None
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tunix_nb" / "jax"


def use_compile_cache() -> Path | None:
    """Turn on JAX's persistent compilation cache (`compile_cache_dir`): a program compiled
    once is read back from disk by every later process, instead of compiled again.

    Set through the environment before JAX starts, so child processes (nbval's kernels,
    the training command run from a test) share it; JAX's own variables, if already set,
    win. Every program is cached, whatever its compile time: the kit's compile in 0.1-2 s,
    below JAX's default threshold of 1 s. Returns the folder (None: switched off).
    """
    cache = compile_cache_dir()
    if cache is None:
        return None
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if "jax" in sys.modules:  # JAX read its config already: set it directly too
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


# XLA's "least effort on execution time", for the lessons on a TPU chip (see `use_quick_compile`).
COMPILE_EFFORT_ENV = "JAX_EXEC_TIME_OPTIMIZATION_EFFORT"
QUICK_COMPILE_EFFORT = "-1"


def use_quick_compile() -> str:
    """Ask XLA to spend the least effort on execution time: for lesson-sized programs on a TPU.

    A TPU's compiler takes 3 to 12 times a CPU's per program, and a lesson compiles a few
    hundred; its models are small, so compiling is most of its time. Measured on a TPU v5e
    (results/compile_costs/effort_tpu.json): the student's SFT step compiles in 4.3 s
    instead of 7.0, the greedy decoder in 1.1 s instead of 4.4, and they run in 2.7 ms instead
    of 2.0 and 6.2 ms instead of 3.1. A CPU compiles no faster so. Set through the environment
    (children inherit it) and in JAX's config; a value already set wins. Returns a line to print.
    """
    os.environ.setdefault(COMPILE_EFFORT_ENV, QUICK_COMPILE_EFFORT)
    if "jax" in sys.modules:
        import jax

        jax.config.update("jax_exec_time_optimization_effort", float(os.environ[COMPILE_EFFORT_ENV]))
    return (f"TPU: XLA compiles for the least effort on execution time ({COMPILE_EFFORT_ENV}="
            f"{os.environ[COMPILE_EFFORT_ENV]}): quicker compiles of these small programs, slower steps")


def setup(n_cpu_devices: int = 8, *, simulate_on_accelerator: bool = False, quick_compile: bool = True) -> int:
    """The notebooks' setup call: on CPU, simulate devices; on TPU/GPU, use them.

    Returns the number of CPU devices simulated (0 when an accelerator is used), and
    prints that number and its source. The count is TUNIX_NB_DEVICES if set, else a
    count already in JAX_NUM_CPU_DEVICES or XLA_FLAGS, else `n_cpu_devices`.
    TUNIX_NB_DEVICES also forces CPU simulation where an accelerator is present, as does
    `simulate_on_accelerator=True` (Colab's single chip, for the multi-device parts).
    It also turns on the persistent compilation cache (`use_compile_cache`), so a rerun
    of a lesson reads its compiled steps back instead of compiling them again, and on a TPU
    `use_quick_compile` unless `quick_compile=False` (to time programs as XLA optimises them
    by default).
    """
    use_compile_cache()
    n, source = requested_cpu_devices(n_cpu_devices)
    forced = simulate_on_accelerator or bool(os.environ.get(DEVICES_ENV))
    hint = accelerator_hint()
    if not forced and hint is not None:
        if hint == "tpu" and quick_compile:
            print(use_quick_compile())
        return 0
    simulate_cpu_devices(n)
    print(f"Simulating {n} CPU device{'s' if n != 1 else ''} ({source})")
    return n


def describe() -> str:
    """One line: backend, device count and kind, JAX version."""
    import jax

    devs = jax.devices()
    kinds = sorted({d.device_kind for d in devs})
    return (
        f"backend={jax.default_backend()} devices={len(devs)} kind={','.join(kinds)} "
        f"processes={jax.process_count()} jax={jax.__version__}"
    )


def check_backend() -> None:
    """Warn if the runtime has a TPU or GPU but JAX runs on CPU.

    On Colab this can follow the setup cell's install of JAX's TPU/GPU build, which a
    running runtime may not pick up until it restarts.
    """
    import jax

    hint = accelerator_hint()
    if hint is None or jax.default_backend() != "cpu":
        return
    warnings.warn(
        f"This runtime has a {hint.upper()}, but JAX is running on CPU. On Colab: restart the runtime "
        "(Runtime > Restart session) and run this cell again. Elsewhere: install JAX's "
        f"{hint.upper()} build, pip install 'jax[{JAX_EXTRAS[hint]}]=={jax.__version__}', then restart the kernel.",
        stacklevel=2,
    )


@dataclasses.dataclass(frozen=True)
class BackendDefaults:
    """What to compute in on a backend. Parameters always stay float32."""

    backend: str
    compute_dtype: str  # "float32" or "bfloat16"
    param_dtype: str = "float32"
    reason: str = ""  # why this compute dtype, for `--compute-dtype auto` to say


def defaults_for(backend: str | None = None, *, compute_capability: str | None = None) -> BackendDefaults:
    """Per-backend defaults: float32 compute on CPU, bfloat16 on TPU and on GPUs with native
    bfloat16 (NVIDIA compute capability 8.0 and up: A100, L4, H100, ...), float32 on older GPUs.

    CPUs have no fast bfloat16 matmul, so bfloat16 there is slower, not faster. A GPU
    below 8.0 (Colab's T4 is 7.5) emulates bfloat16; its fast half type is float16, which
    needs loss scaling the kit does not do, so it trains in float32. `compute_capability`
    ("7.5"): the GPU's, read from the first device when None.
    """
    if backend is None:
        import jax

        backend = jax.default_backend()
    backend = backend.lower()
    if backend in ("gpu", "cuda"):
        capability = compute_capability or _gpu_compute_capability()
        if capability is not None and float(capability) < MIN_BF16_COMPUTE_CAPABILITY:
            return BackendDefaults(backend=backend, compute_dtype="float32", reason=(
                f"a GPU of compute capability {capability} has no native bfloat16, and float16 would "
                "need loss scaling"))
    if backend in ("tpu", "gpu", "cuda", "rocm"):
        return BackendDefaults(backend=backend, compute_dtype="bfloat16",
                               reason=f"{backend} has native bfloat16 matmuls")
    if backend == "cpu":
        return BackendDefaults(backend=backend, compute_dtype="float32",
                               reason="CPUs have no fast bfloat16 matmul")
    raise ValueError(f"Unknown backend {backend!r}; expected 'cpu', 'gpu' or 'tpu'.")


MIN_BF16_COMPUTE_CAPABILITY = 8.0  # NVIDIA Ampere: the first GPUs with bfloat16 tensor cores


def _gpu_compute_capability() -> str | None:
    """The first device's compute capability ("8.0"), or None where JAX does not report one."""
    import jax

    return getattr(jax.devices()[0], "compute_capability", None)


def has_devices(n: int, what: str = "This part") -> bool:
    """True if JAX has at least n devices; otherwise says so and how to simulate them.

    On Colab's single TPU chip or a single GPU, a lesson's multi-device parts call this
    and skip with the printed reason; everything else runs on the accelerator.
    """
    import jax

    have = jax.device_count()
    if have >= n:
        return True
    print(f"{what} needs at least {n} devices; this runtime has {have} {jax.default_backend()} device(s), "
          f"so it is skipped. To run it, restart the runtime and change the setup cell's call to "
          f"devices.setup(n_cpu_devices=8, simulate_on_accelerator=True) (simulated CPU devices; "
          f"the accelerator then sits idle), or set TUNIX_NB_DEVICES=8 before starting Jupyter.")
    return False


def bytes_on_device(tree) -> dict:
    """{device: bytes} that each device has allocated for `tree`'s arrays, shard by shard.

    What the device spends, not the arrays' `nbytes`: a TPU lays an array out in tiles, for
    32-bit types of (8, 128) elements, its last two dimensions padded up to them (in the order
    that pads least), so on a TPU v5e a [259, 32] float32 array takes 48 KiB, not 32.4 KiB. On a
    CPU the two are equal. XLA's `memory_analysis()` counts arguments the same way, so this is
    what to compare it with.
    """
    import jax

    held = collections.Counter()
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device] += shard.data.on_device_size_in_bytes()
    return dict(sorted(held.items(), key=lambda kv: kv[0].id))
