"""What the small things cost on this backend: an eager op's first call (a compile), its cached
call (a dispatch), a jitted call, a scalar's trip to the host, a small transfer to the device,
with JAX's persistent compilation cache off and on. Run it in a fresh process:

    python results/compile_costs/eager_and_dispatch.py > eager_and_dispatch_BACKEND.json

The lessons' slow cells on a TPU are read against these figures (README.md here).
"""

import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

REPEATS = 30


def median_ms(fn, repeats=REPEATS):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 4)


def first_call_ms(make_op, sizes):
    """Median time of an eager op's first call at each new shape: JAX compiles it then."""
    times = []
    for n in sizes:
        x = jnp.ones((n,), jnp.float32).block_until_ready()
        start = time.perf_counter()
        make_op(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def costs(tag: str, size_offset: int) -> dict:
    sizes = [size_offset + 8 * i for i in range(1, 21)]  # shapes no earlier call compiled
    x = jnp.ones((1024,), jnp.float32).block_until_ready()
    small_jit = jax.jit(lambda a: jnp.sin(a) * 2.0 + 1.0)
    small_jit(x).block_until_ready()
    host = np.ones((1024,), np.float32)
    return {
        f"{tag}/eager_op_first_call_ms": first_call_ms(lambda a: jnp.sin(a), sizes),
        f"{tag}/eager_fused_three_ops_first_call_ms": first_call_ms(lambda a: jnp.sin(a) * 2.0 + 1.0, sizes),
        f"{tag}/eager_op_cached_call_ms": median_ms(lambda: jnp.sin(x).block_until_ready()),
        f"{tag}/jitted_call_ms": median_ms(lambda: small_jit(x).block_until_ready()),
        f"{tag}/float_of_device_scalar_ms": median_ms(lambda: float(x[0])),
        f"{tag}/device_get_1k_floats_ms": median_ms(lambda: jax.device_get(x)),
        f"{tag}/device_put_1k_floats_ms": median_ms(lambda: jax.device_put(host).block_until_ready()),
    }


def main():
    figures = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
               "jax": jax.__version__}
    figures.update(costs("no_cache", 10_000))
    with tempfile.TemporaryDirectory() as cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        figures.update(costs("persistent_cache_cold", 20_000))
        figures["persistent_cache_files"] = len(os.listdir(cache))
    json.dump(figures, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
