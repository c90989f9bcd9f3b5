"""Benchmarks behind lesson 07: `python -m tunix_nb.bench [--quick] [--only NAME] [--out DIR]`.

Every figure is a ratio of two things timed side by side in the same run, because a
shared machine is noisy; absolute times are kept as details. The contenders are timed in
rounds, each timing every contender once, and a figure is the median of its per-round
ratios, stored with their spread (quartiles, min and max). `--quick` runs smaller sizes
with fewer rounds: its figures are marked as not comparable to the targets. Results go
to DIR/bench.json (merged with what is there) and DIR/*.png.

One module per group, named for it, as the methods are: `tunix_nb.bench.dp` measures
the dp group's figures, and `--only dp` runs it (`runner.group` finds a group by its
name). A group that times figures has `FIGURES` and `measure`; `common` holds what they
share (timing in rounds, spreads, XLA's cost, the machine, DIR/bench.json). Three groups
run only when named, each writing a record of its own:

- `--only memory` compiles (never runs) real models' training steps for a TPU v5e chip and
  reports XLA's memory analysis, before and after the memory remedies: DIR/bench.json's
  "memory", and the same plans in DIR/memory.json, which lesson 09 reads
  (`tunix_nb.memory_plan`; the TPU targets need libtpu, see `tunix_nb.memory_plan.targets`).
- `--only packing` times an SFT step on packed rows (`tunix_nb.packing`) against padded
  rows and one padding-free row, on a skewed length distribution: DIR/bench.json's "packing".
- `--only tunix`, the kit's steps against Tunix's trainers, needs google-tunix (not in
  requirements.txt): `tunix_nb.tunix_compare`, which `python -m tunix_nb.tunix_compare`
  also runs (skipped, with the reason and the install commands, where Tunix is not
  installed), into DIR/tunix_compare.json.

Importing this package does not start JAX (the command simulates CPU devices first).
"""

from tunix_nb.bench.common import (RESULTS_DIR, compiled_cost, cost, describe, figure, interleaved_medians,
                                   interleaved_times, machine, median_seconds, medians, read_results, sft_setup,
                                   spread, spread_of_ratio, store, timed_figure, write_results)
from tunix_nb.bench.runner import DEFAULT_DEVICES, FIGURES, GROUPS, OPTIONAL_GROUPS, group, main, run

# The groups' functions under the names lessons, tests and scripts have always called (bench.bench_vmap, ...).
from tunix_nb.bench.vmap import bench_vmap
from tunix_nb.bench.mfu import bench_mfu, linears_on_token_grid, mfu_setup, model_flops_per_step, op_profile
from tunix_nb.bench.dp import bench_dp
from tunix_nb.bench.ckpt import bench_ckpt, fsync_tree
from tunix_nb.bench.dpo import bench_dpo
from tunix_nb.bench.compile import bench_compile, compile_times
from tunix_nb.bench.kv_cache import bench_kv_cache
from tunix_nb.bench.grpo import bench_grpo
from tunix_nb.bench.lora import LORA_SETTINGS, QUICK_LORA_SETTINGS, bench_lora, lora_setups
from tunix_nb.bench.remat import MEMORY_SCHEDULER_FLAG, bench_remat, remat_programs, temp_bytes

__all__ = ["DEFAULT_DEVICES", "FIGURES", "GROUPS", "LORA_SETTINGS", "MEMORY_SCHEDULER_FLAG", "OPTIONAL_GROUPS", "QUICK_LORA_SETTINGS",
           "RESULTS_DIR", "bench_ckpt", "bench_compile", "bench_dp", "bench_dpo", "bench_grpo", "bench_kv_cache",
           "bench_lora", "bench_mfu", "bench_remat", "bench_vmap", "compile_times", "compiled_cost", "cost",
           "describe", "figure", "fsync_tree", "group", "interleaved_medians", "interleaved_times",
           "linears_on_token_grid", "lora_setups", "machine", "main", "median_seconds", "medians", "mfu_setup",
           "model_flops_per_step", "op_profile", "read_results", "remat_programs", "run", "sft_setup", "spread",
           "spread_of_ratio", "store", "temp_bytes", "timed_figure", "write_results"]
