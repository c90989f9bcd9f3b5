"""The notebooks' shared first cells: the Open-in-Colab badge and the setup cell.

The repository URL lives here and only here; `tests/test_notebook_conventions.py`
checks that every notebook's badge and setup cell are the ones below.
"""

REPO = "tunix-notebooks/tunix-notebooks"  # GitHub owner/name
REPO_URL = f"https://github.com/{REPO}"

SETUP_CELL = f'''# Setup: every lesson starts with this cell.
import sys
if "google.colab" in sys.modules:  # on Colab: fetch the kit and its pinned stack
    !git clone -q --depth 1 {REPO_URL} /content/tunix-notebooks
    %pip install -q -r /content/tunix-notebooks/requirements.txt
    sys.path.insert(0, "/content/tunix-notebooks")
from tunix_nb import devices
devices.setup(n_cpu_devices=8)  # CPU: simulate 8 devices. Must run before JAX starts.
import jax
print(devices.describe())'''


def badge(notebook_name: str) -> str:
    """Markdown for the Open-in-Colab badge of notebooks/<notebook_name>."""
    return ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"(https://colab.research.google.com/github/{REPO}/blob/main/notebooks/{notebook_name})")
