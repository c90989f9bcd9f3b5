"""Every unit test and every nbval kernel sees 8 simulated CPU devices.

This runs before any test module imports JAX. nbval starts its kernels as child
processes, and they inherit the environment set here.
"""

import os

from tunix_nb import devices

N_TEST_DEVICES = 8

os.environ["JAX_PLATFORMS"] = "cpu"
devices.simulate_cpu_devices(N_TEST_DEVICES)
