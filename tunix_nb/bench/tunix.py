"""The tunix group (`--only tunix`): the kit's SFT, DPO and distillation steps against Tunix
0.1.7's trainers, on the same model and batches (`tunix_nb.tunix_compare`, which
`python -m tunix_nb.tunix_compare` also runs). Optional: it needs google-tunix, which
requirements.txt leaves out, and is skipped, saying why, where it is missing. Its record
is its own, DIR/tunix_compare.json and DIR/tunix_compare.png: each device count runs in a
process of its own, with its own machine description.
"""

from __future__ import annotations

from pathlib import Path


def run_alone(out_dir: Path, *, quick: bool, options) -> int:
    from tunix_nb import tunix_compare

    return tunix_compare.main([*(["--quick"] if quick else []), "--out", str(out_dir)])
