"""The notebooks' shared first cells: the Open-in-Colab badge and the setup cell.

The repository URL lives here and only here; `tests/test_notebook_conventions.py`
checks that every notebook's badge and setup cell are the ones below. Standard library
only: on Colab the setup cell imports this module before the kit's stack is installed.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tunix_nb import devices

REPO = "tunix-notebooks/tunix-notebooks"  # GitHub owner/name
REPO_URL = f"https://github.com/{REPO}"
CLONE = "/content/tunix-notebooks"  # where the setup cell clones the kit on Colab
LESSONS_REQUIREMENTS = "requirements-lessons.txt"


def pinned_version(requirements: str | Path, name: str) -> str:
    """The version `name==VERSION` pins in a requirements file."""
    for line in Path(requirements).read_text().splitlines():
        match = re.fullmatch(rf"{re.escape(name)}==(\S+)", line.split("#")[0].strip())
        if match:
            return match.group(1)
    raise ValueError(f"{requirements} pins no {name}==VERSION; add one so the TPU/GPU build can match it.")


def pip_args(clone: str | Path, accelerator: str | None = "auto") -> str:
    """What follows `pip install` to set up a hosted runtime (Colab) from the kit's clone.

    The lessons' pinned stack (requirements-lessons.txt: not requirements.txt, whose
    Jupyter and test pins would replace the runtime's own), JAX's TPU or GPU build at the
    pinned version where the runtime has one (the plain pins drive only a CPU), and the
    kit itself, editable. All paths are absolute, so any working directory will do.
    `accelerator` is "tpu", "gpu", None (CPU) or "auto" (ask devices.accelerator_hint()).
    Returns one shell-quoted string, which the setup cell puts into its %pip line.
    """
    clone = Path(clone).resolve()
    if accelerator == "auto":
        accelerator = devices.accelerator_hint()
    if accelerator is not None and accelerator not in devices.JAX_EXTRAS:
        raise ValueError(f"accelerator={accelerator!r}: use one of {sorted(devices.JAX_EXTRAS)}, None (CPU) or 'auto'.")
    requirements = clone / LESSONS_REQUIREMENTS
    args = ["-r", str(requirements)]
    if accelerator is not None:
        args.append(f"jax[{devices.JAX_EXTRAS[accelerator]}]=={pinned_version(requirements, 'jax')}")
    return shlex.join([*args, "-e", str(clone)])


SETUP_CELL = f'''# Setup: every lesson starts with this cell.
import sys
if "google.colab" in sys.modules:  # on Colab: fetch the kit and its stack for this chip
    !test -d {CLONE} || git clone -q --depth 1 {REPO_URL} {CLONE}
    sys.path.insert(0, "{CLONE}")
    from tunix_nb import colab
    %pip install -q {{colab.pip_args("{CLONE}")}}
from tunix_nb import devices
devices.setup(n_cpu_devices=8)  # CPU: simulate 8 devices. Must run before JAX starts.
import jax
print(devices.describe())
devices.check_backend()  # warns if a TPU/GPU is here but JAX runs on CPU (then restart)'''


def badge(notebook_name: str) -> str:
    """Markdown for the Open-in-Colab badge of notebooks/<notebook_name>."""
    return ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"(https://colab.research.google.com/github/{REPO}/blob/main/notebooks/{notebook_name})")
