"""docs/benchmarks.md shows the stored memory plan (results/bench.json's "memory") as the bench
prints it. Run `python tests/test_docs_benchmarks.py` to rewrite the table after a new run."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tunix_nb.memory_plan import report

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
STORED = ROOT / "results" / "bench.json"
TABLE = re.compile(r"(<!-- begin memory table -->\n)(.*?)(<!-- end memory table -->)", re.S)


def memory_table() -> str:
    return "```text\n" + report.table(stored_plans()) + "\n```\n"


def stored_plans() -> dict:
    return json.loads(STORED.read_text())[report.RECORD]


def test_the_doc_shows_the_stored_memory_plan():
    assert TABLE.search(DOC.read_text()).group(2) == memory_table(), \
        "docs/benchmarks.md is stale: run `python tests/test_docs_benchmarks.py`"


def test_the_chunked_rows_meet_their_targets_on_one_v5e_chip():
    rows = stored_plans()["rows"]
    chunked = [r for r in rows if r["variant"] == report.CHUNKED and r["target"] == "v5e"]
    assert len(chunked) == 3 and all(r["meets_target"] for r in chunked)
    assert all(r["full_depth"]["total_bytes"] <= r["target_gib"] * 2**30 for r in chunked)


if __name__ == "__main__":
    DOC.write_text(TABLE.sub(lambda m: m.group(1) + memory_table() + m.group(3), DOC.read_text()))
    sys.exit(0)
