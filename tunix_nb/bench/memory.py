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
    """--quick plans the three rows with targets on one v5e chip only; --vocab-chunk and
    --seq-chunk make the remedied rows "after, chunked"."""
    from tunix_nb.memory_plan import report

    rows, target_names = (report.QUICK_ROWS, ("v5e",)) if quick else (report.ROWS, report.targets.TARGETS)
    results = report.run(out_dir, rows=rows, target_names=target_names, vocab_chunk=options.vocab_chunk,
                         seq_chunk=options.seq_chunk, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.table(results))
    if results["rows"]:
        print(f"Wrote {Path(out_dir) / 'bench.json'} (its \"{report.RECORD}\" record) and the same plans to "
              f"{Path(out_dir) / report.COPY}")
    else:  # every target skipped: the stored plans stay as they are
        print(f"Nothing was planned, so {Path(out_dir) / 'bench.json'} is unchanged")
    return 0
