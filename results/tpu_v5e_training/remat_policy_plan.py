"""The scanned step's memory on one TPU v5e chip with remat recomputing everything (`--remat-policy
full`), keeping splash attention's output and statistics (`save_attention`), and keeping those and
the projections' outputs (`save_projections`), compiled ahead of time for the chip
(`tunix_nb.memory_plan`, libtpu: see tunix_nb/memory_plan/targets.py), with the number of splash
forward-kernel programs in each compiled step (2: remat runs the kernel again in the backward pass;
1: the backward kernels read the kept residuals) and of its matmuls (dots and convolutions in the
compiled program, the scanned block's once: fewer where remat recomputes fewer).

At Qwen3-0.6B's shapes as the chip's runs: LoRA r16 and full fine-tuning, batch 8 x 1024,
bfloat16 compute, remat, donation, vocabulary chunks of 8192, --scan-layers, splash attention.

    TPU_LIBRARY_PATH=tpu_compiler/libtpu/libtpu.so JAX_PLATFORMS=cpu \\
        python results/tpu_v5e_training/remat_policy_plan.py --out results/tpu_v5e_training/remat_policy_plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

FIELDS = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "generated_code_bytes", "total_bytes",
          "peak_bytes")


def forward_kernels(hlo_text: str) -> int:
    """The splash forward-kernel calls in a compiled step's instructions (each scan body once)."""
    return len(re.findall(r"^\s*%splash_mha_fwd_[\w.]+ = ", hlo_text, re.M))


def matmuls(hlo_text: str) -> int:
    """The dot and convolution instructions in a compiled step (how XLA's TPU backend writes a matmul)."""
    return len(re.findall(r" (?:dot|convolution)\(", hlo_text))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    import jax

    from tunix_nb import fused_attention
    from tunix_nb.memory_plan import analysis, config, targets

    if targets.libtpu_missing():
        print(f"error: {targets.libtpu_missing()}", file=sys.stderr)
        return 2
    hf_config, mesh = analysis.read_model_config("Qwen3-0.6B"), targets.mesh_for("v5e")
    rows = {}
    for strategy in ("lora", "full"):
        base = config.after(config.PlanConfig(strategy=strategy, batch_size=args.batch), vocab_chunk=8192)
        for policy in config.REMAT_POLICIES:
            cfg = dataclasses.replace(base, scan_layers=True, attention="splash", remat_policy=policy)
            step, step_args, _ = analysis.abstract_step(hf_config, cfg, parallel_mode="jit", mesh=mesh)
            with fused_attention.lowering_for("tpu"):
                compiled = analysis.lower(step, step_args, mesh, "jit").compile()
            memory, text = analysis.memory_of(compiled), compiled.as_text()
            rows[f"{strategy}/{policy}"] = {**{key: memory[key] for key in FIELDS},
                                            "forward_kernels": forward_kernels(text), "matmuls": matmuls(text)}
            print(strategy, policy, rows[f"{strategy}/{policy}"], flush=True)
    record = {"script": "results/tpu_v5e_training/remat_policy_plan.py", "model": "Qwen3-0.6B",
              "config": dataclasses.asdict(dataclasses.replace(base, scan_layers=True, attention="splash")),
              "target": "v5e", "jax": jax.__version__, "libtpu": targets.LIBTPU_PIN, "rows": rows}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
