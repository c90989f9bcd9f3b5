"""The largest batch that fits the chip, found by running the training command (issue 47, item 7),
beside the memory plan's answer (`tunix_nb.memory_plan.largest_batch`, stored in
largest_batch_plan.json): for each strategy the plan holds, the command (`measure_command`, 3
steps at Qwen3-0.6B's shapes, --scan-layers, --attention auto, vocabulary chunks) runs at the
plan's batch, then one grid step at a time up while it fits, or down while it runs out of memory.

    python results/tpu_v5e_training/fit_or_oom.py --model $WORK/qwen --rows $WORK/rows.jsonl \\
        --plan results/tpu_v5e_training/largest_batch_plan.json --out $OUT/fit_or_oom.json

run.sh runs it (RUNS=fit_or_oom). The record holds, per strategy, both answers, every batch
tried (its XLA memory analysis and step time, or the out-of-memory message) and whether they
agree: the same grid point, or neighbours.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tunix_nb.memory_plan.largest_batch import BATCH_GRID, largest_on_grid

STRATEGY_FLAGS = {"full": [], "lora": ["--lora-rank", "16"]}
OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|out of memory", re.IGNORECASE)


def command(args, strategy: str, batch) -> list[str]:
    return ["sft", "--model", str(args.model), "--train-file", str(args.rows), "--max-length", str(args.length + 1),
            "--batch-size", str(batch), "--steps", str(args.steps), "--remat", "--compute-dtype", "bfloat16",
            "--vocab-chunk", "auto", "--scan-layers", "--learning-rate", "1e-4", *STRATEGY_FLAGS[strategy]]


def runs_fit(args, strategy: str, work: Path, on_probe=lambda batch, result: None):
    """fits(batch) -> (bool, details): the command at that batch, run to its end or out of memory.
    Any other failure stops the search with the command's output."""

    def fits(batch: int):
        out = work / f"{strategy}_{batch}.json"
        argv = [sys.executable, "-m", "tunix_nb.measure_command", "--out", str(out), "--", *command(args, strategy, batch)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.probe_timeout)
        text = done.stdout + done.stderr
        print(f"{strategy} batch {batch}: exit {done.returncode}", flush=True)
        if done.returncode == 0 and out.is_file():
            run = json.loads(out.read_text())
            result = True, {key: run.get(key) for key in ("xla_memory", "median_step_seconds", "tokens_per_second", "mfu")}
        elif OUT_OF_MEMORY.search(text):
            line = next(line for line in text.splitlines() if OUT_OF_MEMORY.search(line))
            result = False, {"out_of_memory": line.strip()[:400]}
        else:
            raise RuntimeError(f"{strategy} at batch {batch} failed, not for memory:\n{text[-3000:]}")
        on_probe(batch, result)
        return result

    return fits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the Hugging Face folder run.sh wrote")
    parser.add_argument("--rows", type=Path, required=True)
    parser.add_argument("--plan", type=Path, required=True, help="largest_batch_plan.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--probe-timeout", type=int, default=240)
    parser.add_argument("--grid", type=lambda s: tuple(int(b) for b in s.split(",")), default=BATCH_GRID,
                        help="batch sizes to search (a CPU check: 2,4)")
    parser.add_argument("--strategies", default="lora,full")
    args = parser.parse_args(argv)
    plan = json.loads(args.plan.read_text())
    record = {"script": "results/tpu_v5e_training/fit_or_oom.py", "grid": list(args.grid), "strategies": {},
              "probes": {}}

    def save(strategy, batch, result):  # after every run: a search cut short still leaves what it found
        record["probes"][f"{strategy}_{batch}"] = {"fits": result[0], **result[1]}
        args.out.write_text(json.dumps(record, indent=2).replace(str(args.model.parent), "$WORK") + "\n")

    with tempfile.TemporaryDirectory() as work:
        for strategy in args.strategies.split(","):
            planned = plan[strategy]["largest_batch"]
            start = planned if planned in args.grid else min(args.grid)
            fits = runs_fit(args, strategy, Path(work), on_probe=lambda b, r, s=strategy: save(s, b, r))
            largest, tried = largest_on_grid(fits, args.grid, start=start)
            steps_apart = None if largest is None or planned not in args.grid else \
                abs(args.grid.index(largest) - args.grid.index(planned))
            record["strategies"][strategy] = {
                "command": command(args, strategy, "BATCH"), "plan_largest_batch": planned,
                "largest_batch": largest, "grid_steps_apart": steps_apart,
                "agrees": steps_apart is not None and steps_apart <= 1,
                "tried": {str(b): {"fits": ok, **details} for b, (ok, details) in sorted(tried.items())}}
            args.out.write_text(json.dumps(record, indent=2).replace(str(args.model.parent), "$WORK") + "\n")
            print(strategy, {k: record["strategies"][strategy][k] for k in ("plan_largest_batch", "largest_batch",
                                                                              "agrees")}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
