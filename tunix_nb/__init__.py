"""tunix_nb: the helper package behind the tunix-notebooks lessons.

One concept per module (see the README's copy map). Importing the package does not
import JAX, so that `tunix_nb.devices.simulate_cpu_devices` can still run first.
"""

__version__ = "0.1.0"
