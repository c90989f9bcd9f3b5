"""The largest batch that fits one chip: the plan's answer, and the same search by running.

The plan compiles the step ahead of time for the chip at each batch it tries
(`analysis.analyse`) and says it fits when the TPU compiler accepts it and XLA's peak (the
most bytes live at once, arguments included: `peak_memory_in_bytes`), plus the program's own
code, which the chip holds too, stays within what the compiler lets a program use. Not the
plan's "total" (arguments + outputs + temporaries - aliased): the temporaries' buffers are
not all live at once, and on the chip the full fine-tuning step ran at batch 64 with a total of
19.9 GiB and a peak of 15.6 GiB (results/tpu_v5e_training/fit_probes_7f5c452.json). On the chip the
same search runs the training command at each batch instead and watches for
out-of-memory (results/tpu_v5e_training/fit_or_oom.py). Both search `BATCH_GRID`, the
plan by bisection, the chip from the plan's answer outwards; they agree when they land
on the same grid point or on neighbours.

    python -m tunix_nb.memory_plan.largest_batch --strategy lora --scan-layers --attention splash \\
        --vocab-chunk 8192 --out results/tpu_v5e_training/largest_batch_plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

BATCH_GRID = tuple(range(8, 257, 8))
# What the TPU compiler lets one v5e program use: it refuses a bigger one with "exceeds
# available HBM (15.75G)" (results/memory.json's refused row), of the chip's 16 GiB.
USABLE_BYTES = {"v5e": int(15.75 * 2**30)}


def largest_on_grid(fits, grid=BATCH_GRID, start: int | None = None) -> tuple[int | None, dict]:
    """(the largest batch of `grid` for which `fits(batch)` holds, {batch: (fits, details)} of
    every batch tried), `fits(batch) -> (bool, details)` being true up to some batch and false
    beyond. From `start` (a grid point): one step at a time, up while it fits, down while it
    does not; without: bisection. None when not even the smallest fits."""
    grid, tried = sorted(grid), {}

    def probe(i: int) -> bool:
        if grid[i] not in tried:
            tried[grid[i]] = fits(grid[i])
        return tried[grid[i]][0]

    if start is not None:
        i = grid.index(start)
        if probe(i):
            while i + 1 < len(grid) and probe(i + 1):
                i += 1
            return grid[i], tried
        while i > 0 and not probe(i - 1):
            i -= 1
        return (grid[i - 1] if i > 0 else None), tried
    low, high = -1, len(grid)  # grid[low] fits (or low = -1), grid[high] does not (or high = len)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if probe(middle) else (low, middle)
    return (grid[low] if low >= 0 else None), tried


def plan_fits(model, cfg, target: str = "v5e"):
    """fits(batch) -> (bool, details) by the plan: `cfg` at that batch, compiled for `target`."""
    from tunix_nb.memory_plan import analysis

    usable = USABLE_BYTES[target]

    def fits(batch: int):
        started = time.perf_counter()
        try:
            memory = analysis.analyse(model, dataclasses.replace(cfg, batch_size=batch), target)
        except Exception as err:  # noqa: BLE001 - the compiler's refusal is the answer; anything else is raised
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            return False, {"refused": str(err).splitlines()[0][:300],
                           "compile_seconds": time.perf_counter() - started}
        held = memory["peak_bytes"] + memory["generated_code_bytes"]
        details = {key: memory[key] for key in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                                                "total_bytes", "peak_bytes", "generated_code_bytes", "compile_seconds")}
        return held <= usable, {**details, "held_bytes": held}

    return fits


def plan_largest_batch(model, cfg, target: str = "v5e", grid=BATCH_GRID) -> dict:
    """The plan's largest batch of `grid` for `cfg` on `target`, with every batch it compiled."""
    largest, tried = largest_on_grid(plan_fits(model, cfg, target), grid)
    return {"largest_batch": largest, "usable_bytes": USABLE_BYTES[target], "target": target, "grid": list(grid),
            "tried": {str(batch): {"fits": ok, **details} for batch, (ok, details) in sorted(tried.items())}}


def build_parser() -> argparse.ArgumentParser:
    from tunix_nb.memory_plan.config import REMAT_POLICIES

    parser = argparse.ArgumentParser(prog="python -m tunix_nb.memory_plan.largest_batch",
                                     description="The memory plan's largest batch on one TPU v5e chip "
                                                 "(needs libtpu: tunix_nb.memory_plan.targets).")
    parser.add_argument("--model", default="Qwen3-0.6B", help="a name under data/model_configs/ or a folder")
    parser.add_argument("--strategy", choices=("full", "lora", "qlora"), default="lora")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--vocab-chunk", type=int, default=None)
    parser.add_argument("--seq-chunk", type=int, default=None)
    parser.add_argument("--scan-layers", action="store_true")
    parser.add_argument("--attention", choices=("xla", "splash"), default="xla")
    parser.add_argument("--remat-policy", choices=REMAT_POLICIES, default="full",
                        help="what remat keeps (the command's --remat-policy): save_attention keeps splash's output, "
                             "save_projections also the projections' outputs")
    parser.add_argument("--grid", type=lambda text: tuple(sorted(int(b) for b in text.split(","))), default=BATCH_GRID,
                        help="the batch sizes to search, e.g. 8 to plan one batch (default 8, 16, ..., 256)")
    parser.add_argument("--out", type=Path, required=True, help="a JSON file; its record for this strategy is replaced")
    return parser


def main(argv=None) -> int:
    from tunix_nb.memory_plan import config, targets

    args = build_parser().parse_args(argv)
    missing = targets.libtpu_missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    cfg = config.after(config.PlanConfig(strategy=args.strategy, seq_len=args.seq_len, lora_rank=args.lora_rank),
                       vocab_chunk=args.vocab_chunk, seq_chunk=args.seq_chunk)
    cfg = dataclasses.replace(cfg, scan_layers=args.scan_layers, attention=args.attention,
                              remat_policy=args.remat_policy)
    found = plan_largest_batch(args.model, cfg, "v5e", grid=args.grid)
    record = json.loads(args.out.read_text()) if args.out.is_file() else {}
    record[args.strategy] = {"model": str(args.model), "config": dataclasses.asdict(cfg),
                             "command": "python -m tunix_nb.memory_plan.largest_batch " + " ".join(argv or sys.argv[1:]),
                             **found}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({args.strategy: {"largest_batch": found["largest_batch"],
                                      "tried": {b: t["fits"] for b, t in found["tried"].items()}}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
