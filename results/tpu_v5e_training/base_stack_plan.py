"""The scanned LoRA step's memory on one TPU v5e chip, its frozen base one tree per block (the
command before the base was stacked) against stacked (`layer_stack.layout`), compiled ahead of
time for the chip (`tunix_nb.memory_plan`, libtpu: see tunix_nb/memory_plan/targets.py).

At Qwen3-0.6B's shapes as the chip's runs (splash_dc282f3.json): LoRA r16, batch 8 x 1024,
bfloat16 compute and base, remat, donation, vocabulary chunks of 8192, --scan-layers, with
the splash kernel (--attention auto on the chip) and with the einsums. The per-block row with
splash is the step the chip ran in splash_dc282f3.json, so its bytes can be read beside the
chip's own memory analysis.

    TPU_LIBRARY_PATH=tpu_compiler/libtpu/libtpu.so JAX_PLATFORMS=cpu \\
        python results/tpu_v5e_training/base_stack_plan.py --out results/tpu_v5e_training/base_stack_plan.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from unittest import mock

FIELDS = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "generated_code_bytes", "total_bytes")


def base_per_block():
    """`layer_stack.layout` as it was: the trainable blocks stacked, the base left one tree per block."""
    from tunix_nb import layer_stack

    stacked = layer_stack.layout
    return mock.patch.object(layer_stack, "layout",
                             lambda params, frozen=None: layer_stack.Layout(stacked(params, frozen).params_like, None))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import jax

    from tunix_nb.memory_plan import analysis, config, targets

    if targets.libtpu_missing():
        print(f"error: {targets.libtpu_missing()}", file=sys.stderr)
        return 2
    base = dataclasses.replace(config.after(config.PlanConfig(strategy="lora"), vocab_chunk=8192), scan_layers=True)
    rows = {}
    for attention in ("splash", "xla"):
        cfg = dataclasses.replace(base, attention=attention)
        for base_layout in ("per_block", "stacked"):
            with base_per_block() if base_layout == "per_block" else contextlib.nullcontext():
                memory = analysis.analyse("Qwen3-0.6B", cfg, "v5e")
            rows[f"{attention}/{base_layout}"] = {key: memory[key] for key in FIELDS}
            print(attention, base_layout, rows[f"{attention}/{base_layout}"], flush=True)
    record = {"script": "results/tpu_v5e_training/base_stack_plan.py", "model": "Qwen3-0.6B",
              "config": dataclasses.asdict(base), "target": "v5e", "jax": jax.__version__,
              "libtpu": targets.LIBTPU_PIN, "rows": rows,
              "temp_saved_bytes": {a: rows[f"{a}/per_block"]["temp_bytes"] - rows[f"{a}/stacked"]["temp_bytes"]
                                   for a in ("splash", "xla")}}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
