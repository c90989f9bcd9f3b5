"""The notebooks' shared first cells: the Open-in-Colab and Open-in-Kaggle badges and the setup cell.

The repository URL lives here and only here; `tests/test_notebook_conventions.py`
checks that every notebook's badges and setup cell are the ones below. Standard library
only: on Colab and Kaggle the setup cell imports this module before the kit's stack is
installed.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tunix_nb import devices

REPO = "tunix-notebooks/tunix-notebooks"  # GitHub owner/name
REPO_URL = f"https://github.com/{REPO}"
# Where the setup cell clones the kit on a hosted runtime. The cell tells the runtimes
# apart before the kit exists, so the checks are written into it: Colab by its module,
# Kaggle by KAGGLE_KERNEL_RUN_TYPE (set in its notebooks; Kaggle's kagglehub checks it).
CLONE = "/content/tunix-notebooks"  # Colab
KAGGLE_CLONE = "/kaggle/working/tunix-notebooks"  # Kaggle: its notebooks' working directory
# Said when the clone fails: the kit's first download, so on Kaggle the sign that the
# notebook's Internet setting is off.
NO_INTERNET_LINES = ("Could not clone the kit from GitHub: no Internet. On Kaggle, switch on Internet ",
                     "in the notebook's settings panel (it needs a phone-verified account) and run this cell again.")
NO_INTERNET = "".join(NO_INTERNET_LINES)
LESSONS_REQUIREMENTS = "requirements-lessons.txt"


def pinned_version(requirements: str | Path, name: str) -> str:
    """The version `name==VERSION` pins in a requirements file."""
    for line in Path(requirements).read_text().splitlines():
        match = re.fullmatch(rf"{re.escape(name)}==(\S+)", line.split("#")[0].strip())
        if match:
            return match.group(1)
    raise ValueError(f"{requirements} pins no {name}==VERSION; add one so the TPU/GPU build can match it.")


def pip_args(clone: str | Path, accelerator: str | None = "auto") -> str:
    """What follows `pip install` to set up a hosted runtime (Colab, Kaggle) from the kit's clone.

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
import os, sys
clone = ("{CLONE}" if "google.colab" in sys.modules else
         "{KAGGLE_CLONE}" if "KAGGLE_KERNEL_RUN_TYPE" in os.environ else None)
if clone:  # on Colab or Kaggle: fetch the kit and its stack for this chip
    !test -d {{clone}} || git clone -q --depth 1 {REPO_URL} {{clone}}
    if not os.path.isdir(clone):
        raise RuntimeError("{NO_INTERNET_LINES[0]}"
                           "{NO_INTERNET_LINES[1]}")
    sys.path.insert(0, clone)
    from tunix_nb import colab
    %pip install -q {{colab.pip_args(clone)}}
from tunix_nb import devices
devices.setup(n_cpu_devices=8)  # CPU: simulate 8 devices. Must run before JAX starts.
import jax
print(devices.describe())
devices.check_backend()  # warns if a TPU/GPU is here but JAX runs on CPU (then restart)'''


def notebook_url(notebook_name: str) -> str:
    """notebooks/<notebook_name> on GitHub, the main branch."""
    return f"{REPO_URL}/blob/main/notebooks/{notebook_name}"


def badge(notebook_name: str) -> str:
    """Markdown for the Open-in-Colab and Open-in-Kaggle badges of notebooks/<notebook_name>, side by side."""
    on_colab = ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
                f"(https://colab.research.google.com/github/{REPO}/blob/main/notebooks/{notebook_name})")
    on_kaggle = ("[![Open In Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]"
                 f"(https://kaggle.com/kernels/welcome?src={notebook_url(notebook_name)})")
    return f"{on_colab} {on_kaggle}"
