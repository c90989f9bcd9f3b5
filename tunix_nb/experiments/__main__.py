"""`python -m tunix_nb.experiments <experiment> --seeds N --out FILE`: run every arm over N seeds.

`--set FIELD=VALUE` (repeatable) changes one field of the experiment's config, e.g. a pilot
of another design on the validation split: `python -m tunix_nb.experiments lesson11_gkd
--seeds 2 --set lmbda=0.5 --set eval_split=validation --out results/lesson11_pilots/mixed.json`.

`python -m tunix_nb.experiments checkpoints --out data` remakes the long family's two
shipped checkpoints (`long_family.STUDENT` and `TEACHER`, into data/long_student and
data/long_teacher) and prints the student's pilot gate; with `--family count`, the count
family's three (`count_family`, into data/count_student, data/count_teacher and
data/count_small_student); with `--family count14`, the fixed-length count family's student
(`count14_family`, into data/count14_student).

`python -m tunix_nb.experiments summarise RECORD.json ...` recomputes each stored record's
summary from its runs, after a change to the statistics (`stats`), and writes it back.

`python -m tunix_nb.experiments choose FIELD PILOT.json ...` prints, per arm, the value of FIELD
(e.g. learning_rate) whose validation pilot scored best (`pilots.choose`).

`python -m tunix_nb.experiments page SCRIPT.py --out PAGE.md` remakes a results page from the
stored records (`page`; e.g. docs/lesson11_designs.py, lesson 11's design search).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

from tunix_nb.experiments import EXPERIMENTS

COUNT_FAMILIES = {"count": "count_family", "count14": "count14_family"}  # `--family`: the module that remakes them


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["summarise"]:
        return resummarise(argv[1:])
    if argv[:1] == ["choose"]:
        return choose_from_pilots(argv[1:])
    if argv[:1] == ["page"]:
        return write_page(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m tunix_nb.experiments", description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=[*sorted(EXPERIMENTS), "checkpoints"],
                        help="which lesson's experiment to run, or `checkpoints` to remake the long family's")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 ... N-1 (initialisation and data order)")
    parser.add_argument("--out", required=True, help="the JSON record to write (e.g. results/<experiment>.json); "
                        "for `checkpoints`, the folder that gets long_student/ and long_teacher/")
    parser.add_argument("--family", choices=("long", *COUNT_FAMILIES), default="long",
                        help="for `checkpoints`: which task family's checkpoints to remake")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="change one field of the experiment's config (repeatable)")
    args = parser.parse_args(argv)
    if args.seeds < 2:
        parser.error(f"--seeds {args.seeds}: an interval over seeds needs at least 2")
    from tunix_nb import devices

    devices.use_compile_cache()
    if args.experiment == "checkpoints":
        return remake_checkpoints(Path(args.out), args.family)
    from tunix_nb.experiments import runner

    module = importlib.import_module(f"tunix_nb.experiments.{EXPERIMENTS[args.experiment]}")
    try:
        config = configured(module.CONFIG_CLASS, args.set)
    except ValueError as err:
        parser.error(str(err))
    record = runner.run_experiment(module, config, range(args.seeds), command=runner.command_line(),
                                   progress=lambda line: print(line, file=sys.stderr, flush=True),
                                   partial=f"{args.out}.partial")
    record["summary"] = module.summarise(record)
    print(f"wrote {runner.save(record, args.out)}")
    Path(f"{args.out}.partial").unlink(missing_ok=True)
    return 0


def resummarise(paths: list[str]) -> int:
    """Each record's summary, recomputed from its runs by its experiment's `summarise`."""
    import json

    from tunix_nb.experiments import runner

    if not paths:
        print("usage: python -m tunix_nb.experiments summarise RECORD.json ...", file=sys.stderr)
        return 2
    for path in paths:
        record = json.loads(Path(path).read_text())
        if record.get("experiment") not in EXPERIMENTS:
            print(f"{path}: not an experiment record (its 'experiment' is {record.get('experiment')!r}); "
                  f"expected one of {', '.join(sorted(EXPERIMENTS))}", file=sys.stderr)
            return 2
        module = importlib.import_module(f"tunix_nb.experiments.{EXPERIMENTS[record['experiment']]}")
        record["summary"] = module.summarise(record)
        runner.save(record, path)
        print(f"summarised {path}")
    return 0


def choose_from_pilots(argv: list[str]) -> int:
    """Per arm, the value of a field that validation pilots chose."""
    import json

    from tunix_nb.experiments import pilots

    if len(argv) < 2:
        print("usage: python -m tunix_nb.experiments choose FIELD PILOT.json ...", file=sys.stderr)
        return 2
    field, paths = argv[0], argv[1:]
    try:
        choice = pilots.choose([json.loads(Path(p).read_text()) for p in paths], field)
    except (ValueError, KeyError) as err:
        print(f"choose {field}: {err}", file=sys.stderr)
        return 2
    print(pilots.describe(choice, field))
    return 0


def write_page(argv: list[str]) -> int:
    """A results page remade from its script (`page.render`)."""
    parser = argparse.ArgumentParser(prog="python -m tunix_nb.experiments page",
                                     description="remake a results page from the stored records")
    parser.add_argument("script", type=Path, help="the page's script, e.g. docs/lesson11_designs.py")
    parser.add_argument("--out", type=Path, required=True, help="the markdown page to write")
    args = parser.parse_args(argv)
    if not args.script.is_file():
        parser.error(f"{args.script}: no such script; a page's script is a .py file in the percent format")
    from tunix_nb.experiments import page

    try:
        text, _ = page.render(args.script, args.out)
    except ValueError as err:
        parser.error(str(err))
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


def configured(config_class, assignments: list[str]):
    """`config_class()` with each "FIELD=VALUE" applied, VALUE read as the field's type."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    changes = {}
    for text in assignments:
        name, sep, value = text.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set {text}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}")
        default = getattr(config_class(), name)
        kind = type(default)
        try:
            if kind is tuple:  # "100,300": each item read as the default's items are
                item_kind = type(default[0]) if default else str
                changes[name] = tuple(item_kind(v) for v in value.split(","))
            else:
                changes[name] = read_bool(value) if kind is bool else kind(value)
        except ValueError:
            raise ValueError(f"--set {text}: {name} must be {kind.__name__}, got {value!r}") from None
    return config_class(**changes)


def read_bool(value: str) -> bool:
    """"true"/"false" (any case), "1"/"0": bool("false") would be True."""
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise ValueError(value)


def remake_checkpoints(out: Path, family: str = "long") -> int:
    from tunix_nb import checkpoint
    from tunix_nb.experiments import long_family

    if family in COUNT_FAMILIES:
        counts = importlib.import_module(f"tunix_nb.experiments.{COUNT_FAMILIES[family]}")
        for name, metrics in counts.remake(out).items():
            print(f"{name}: {metrics}", flush=True)
        return 0

    for recipe, name in ((long_family.TEACHER, "long_teacher"), (long_family.STUDENT, "long_student")):
        print(f"{name}: {long_family.train_checkpoint(recipe, out / name)}", flush=True)
    graphdef, params, _ = checkpoint.load_model(out / "long_student")
    print(f"long_student's pilot gate on the validation split: {long_family.gate(graphdef, params)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
