"""`python -m tunix_nb.lessons run [NN ...] --out FILE`: run the lessons headless and record them.
`python -m tunix_nb.lessons table [--readme README.md]`: the README's "Runs on" table from the records.
`python -m tunix_nb.lessons merge PART.json ... --out FILE`: one record from parts run from one commit.
`python -m tunix_nb.lessons carry RECORD RERUN.json ... --at COMMIT --out FILE`: a record brought forward
to a later commit, where only the lessons whose code changed ran again.
`python -m tunix_nb.lessons gap [--readme results/lesson_runs/README.md]`: where the chip's time goes.

Examples:
  python -m tunix_nb.lessons run --out results/lesson_runs/cpu_2core.json        # all 13 lessons
  python -m tunix_nb.lessons run 00 01 --out first_two.json --timeout 300
  python -m tunix_nb.lessons table --readme README.md                            # rewrite the README's table
  python -m tunix_nb.lessons merge tpu_00.json tpu_01.json --out results/lesson_runs/tpu_v5e_1.json
  python -m tunix_nb.lessons carry tpu_v5e_1.json tpu_12.json --at HEAD --out tpu_v5e_1.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from tunix_nb.lessons import carry_forward, records, runner, time_gap

CHIP, CPU = records.ORDER  # the TPU v5e chip's record, the 2-core CPU's


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m tunix_nb.lessons", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 1)[1])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run lessons, each in a fresh process, and write one JSON record")
    run.add_argument("lessons", nargs="*", help="lesson numbers (00 ... 12) or names; default: every lesson")
    run.add_argument("--out", required=True, help="the JSON record to write, e.g. results/lesson_runs/NAME.json")
    run.add_argument("--timeout", type=float, default=runner.DEFAULT_TIMEOUT_S,
                     help="seconds a lesson may take before it is killed (default %(default)s)")
    run.add_argument("--notebooks", type=Path, default=None, help="the lessons' folder (default: notebooks/)")
    run.add_argument("--runtime", default=None,
                     help="the README's name for this machine, e.g. \"TPU v5e, 1 chip (Colab's TPU runtime)\" "
                          "(default: from the backend, device kind and count)")
    run.add_argument("--commit", default=None,
                     help="the commit this tree is, where it is a copy without git (a device machine's); "
                          "tests/test_lesson_runs.py checks the record's hashes against it")
    run.add_argument("--logs", type=Path, default=None,
                     help="a folder for each lesson's full output (default: only a failure's last lines, on stderr)")
    run.add_argument("--profile", type=float, default=None, metavar="SECONDS",
                     help="keep a Python profile (cProfile's top functions) of every cell that took at least "
                          "SECONDS; it slows the cells, so use it to diagnose, not for the stored record")
    table = commands.add_parser("table", help="print the README's table of the records, or write it there")
    table.add_argument("--records", type=Path, default=None, help="default: results/lesson_runs/")
    table.add_argument("--readme", type=Path, default=None, help="rewrite this README's table instead of printing")
    gap = commands.add_parser("gap", help="the chip's record against the CPU's: seconds, compiles, compiling "
                                          "and waiting on children, lesson by lesson")
    gap.add_argument("--readme", type=Path, default=None, help="rewrite this file's table instead of printing")
    merge = commands.add_parser("merge", help="one record from runs of other lessons made from one commit")
    merge.add_argument("parts", nargs="+", type=Path, help="the records to merge")
    merge.add_argument("--out", required=True, type=Path, help="the merged record to write")
    carry = commands.add_parser("carry", help="a record brought forward to a later commit with the lessons "
                                              "whose code changed rerun (checked with git)")
    carry.add_argument("record", type=Path, help="the record to bring forward")
    carry.add_argument("reruns", nargs="*", type=Path, help="records of the lessons run again")
    carry.add_argument("--at", required=True, help="the commit the record stands for afterwards")
    carry.add_argument("--out", required=True, type=Path, help="the record to write (may be RECORD)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.command == "table":
        rendered = records.render_table(records.load_records(args.records))
        if args.readme is None:
            print(rendered, end="")
        else:
            changed = records.write_readme_table(args.readme, rendered)
            print(f"{args.readme}: {'table updated' if changed else 'table already current'}")
        return 0
    if args.command == "gap":
        return _time_gap(args.readme)
    if args.command in ("merge", "carry"):
        try:
            record = (records.merge([json.loads(part.read_text()) for part in args.parts]) if args.command == "merge"
                      else carry_forward.carry_forward(json.loads(args.record.read_text()),
                                                       [json.loads(rerun.read_text()) for rerun in args.reruns],
                                                       args.at))
        except ValueError as err:
            print(err, file=sys.stderr)
            return 2
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{records.outcome(record)} lessons ran to the end on {record['runtime']}; wrote {args.out}")
        return 0
    command = shlex.join(["python", "-m", "tunix_nb.lessons", *argv])
    record = runner.run_lessons(args.lessons, notebooks=args.notebooks, timeout_s=args.timeout,
                                runtime=args.runtime, command=runner.scrub(command), log_dir=args.logs,
                                commit=args.commit, profile_min_seconds=args.profile)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    done = sum(lesson["completed"] for lesson in record["lessons"])
    print(f"{done} of {len(record['lessons'])} lessons ran to the end on {record['runtime']}; wrote {out}")
    return 0 if done == len(record["lessons"]) else 1


def _time_gap(readme: Path | None) -> int:
    stored = records.load_records()
    table = time_gap.render(stored[CHIP], stored[CPU], ("chip", "CPU"))
    if readme is None:
        print(table, end="")
    else:
        changed = time_gap.write_readme_part(readme, table)
        print(f"{readme}: {'table updated' if changed else 'table already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
