"""The memory group (`--only memory`): compiles (never runs) real models' training steps for a TPU
v5e chip, a v5e-8 and the CPU, and reports XLA's memory analysis, before and after the memory
remedies (`tunix_nb.memory_plan`; the TPU targets need libtpu, see
`tunix_nb.memory_plan.targets`). A table on stdout; DIR/bench.json's "memory" record, written
after each row, so a long run keeps what it has, and the same plans in DIR/memory.json,
which lesson 09 reads (`memory_plan.fit.stored_row`).

Run only when named: a full-size row takes minutes to compile on a CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path


def run_alone(out_dir: Path, *, quick: bool, options) -> int:
    """--quick plans the three rows with targets (report.QUICK_ROWS) instead of all six;
    --targets picks the targets, --full-depth compiles every row at full depth, and
    --vocab-chunk / --seq-chunk set the "after, chunked" rows' chunks."""
    from tunix_nb.memory_plan import report

    target_names = tuple(t.strip() for t in options.targets.split(",") if t.strip())
    unknown = sorted(set(target_names) - set(report.targets.TARGETS))
    if unknown or not target_names:
        print(f"--targets {options.targets}: choose from {', '.join(report.targets.TARGETS)}", file=sys.stderr)
        return 2
    results = report.run(out_dir, rows=report.QUICK_ROWS if quick else report.ROWS, target_names=target_names,
                         layers=None if options.full_depth else (1, 2), vocab_chunk=options.vocab_chunk,
                         seq_chunk=options.seq_chunk, command=options.command_line,
                         progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.table(results))
    if results["rows"]:
        print(f"Wrote {Path(out_dir) / 'bench.json'} (its \"{report.RECORD}\" record) and the same plans to "
              f"{Path(out_dir) / report.COPY}")
    else:  # every target skipped: the stored plans stay as they are
        print(f"Nothing was planned, so {Path(out_dir) / 'bench.json'} is unchanged")
    return 0
