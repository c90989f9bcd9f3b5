"""`python -m tunix_nb.bench`: the groups, each found by its name (`tunix_nb.bench.<group>`), a
run of them into DIR/bench.json, and the command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from tunix_nb import devices
from tunix_nb.bench.common import describe, machine, read_results, write_results
from tunix_nb.config_flags import positive_int

# Run by default, in this order. Each module has FIGURES (name -> (target, "max" if the
# figure must stay below it, "min" above)) and measure(quick=, repeats=), which times them
# into DIR/bench.json's "figures".
GROUPS = ("vmap", "mfu", "dp", "ckpt", "dpo", "compile", "kv_cache", "grpo", "lora", "remat")
# Run only when named (--only), each by its run_alone(out_dir, quick=, options=), which
# writes a record of its own: "memory" compiles real models' steps for a TPU chip (minutes
# per step on a CPU) into bench.json's "memory" (and memory.json); "packing" times packed rows against
# padded ones into its "packing"; "tunix", the kit against Tunix's trainers (needs
# google-tunix), writes tunix_compare.json.
OPTIONAL_GROUPS = ("memory", "packing", "tunix")
DEFAULT_DEVICES = 8  # simulated CPU devices, unless a group names its own (DEVICES)
DESCRIPTION = "Benchmarks behind lesson 07: python -m tunix_nb.bench [--quick] [--only NAME] [--out DIR]."


def group(name: str):
    """The module of a group, found by its name: `tunix_nb.bench.<name>`."""
    if name not in GROUPS + OPTIONAL_GROUPS:
        raise ValueError(f"there is no benchmark group {name!r}; choose one of {', '.join(GROUPS + OPTIONAL_GROUPS)}")
    return importlib.import_module(f"tunix_nb.bench.{name}")


# figure name -> (group that measures it, target, "max" if the figure must stay below it)
FIGURES = {name: (g, *target) for g in GROUPS for name, target in group(g).FIGURES.items()}


def run(groups, *, quick: bool, out_dir: Path, progress: bool = True, repeats: int | None = None) -> dict:
    """Time the figures of `groups` (names from GROUPS) into DIR/bench.json (merged with what
    is there) and write the plots; returns the results."""
    from tunix_nb import progress as progress_bars

    alone = [g for g in groups if g not in GROUPS]
    if alone:
        raise ValueError(f"{alone} are not figure groups ({', '.join(GROUPS)}); run "
                         f"`python -m tunix_nb.bench --only {alone[0]}`, which writes its own record")
    repeats = repeats or (3 if quick else 10)
    results = read_results(out_dir)
    results.setdefault("figures", {})
    results["machine"] = machine()
    results["settings"] = {"quick": quick, "repeats": repeats, "comparable_to_targets": not quick,
                           "method": "each figure is the median of per-round ratios (spread: quartiles, min, "
                           "max): every round times each contender once, in rotating order, after 2 "
                           "warm-up calls; fast calls several per sample"}
    bar = progress_bars.bar(groups, desc="bench", disable=not progress)
    for name in bar:
        bar.set_postfix(figure=name)
        figures = group(name).measure(quick=quick, repeats=repeats)
        for fig in figures.values():
            # --quick measures smaller sizes over fewer rounds: an orientation, not a check
            fig["comparable_to_target"] = not quick
        results["figures"].update(figures)
        write_results(out_dir, results)
    from tunix_nb import plots

    plots.save_bench_plots(results, out_dir)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tunix_nb.bench", description=DESCRIPTION,
                                     epilog="The kit's steps against Tunix's trainers (optional, needs google-tunix): "
                                            "--only tunix, or python -m tunix_nb.tunix_compare")
    parser.add_argument("--quick", action="store_true", help="a CI-sized run (about a minute)")
    parser.add_argument("--only", choices=sorted(set(GROUPS) | set(FIGURES) | set(OPTIONAL_GROUPS)),
                        help="run one figure (or its group, e.g. dp_overhead runs the dp group); memory, packing "
                             "and tunix run only when named")
    parser.add_argument("--out", default="results", help="directory for bench.json and the plots")
    parser.add_argument("--devices", type=int, default=None,
                        help=f"simulated CPU devices (CPU only; default {DEFAULT_DEVICES}, packing 1)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed rounds per figure (default 10, with --quick 3)")
    parser.add_argument("--vocab-chunk", type=positive_int, default=8192,
                        help="memory: the vocabulary chunk of the 'after, chunked' rows' log-probs (default 8192, "
                             "the training command's --vocab-chunk auto)")
    parser.add_argument("--seq-chunk", type=positive_int, default=256,
                        help="memory: positions per row at a time on the chunked path (default 256)")
    parser.add_argument("--full-depth", action="store_true",
                        help="memory: compile every row at the model's full depth (minutes a row on a CPU) "
                             "instead of extrapolating from 1 and 2 layers")
    parser.add_argument("--targets", default="cpu,v5e,v5e-8",
                        help="memory: the targets to plan for, comma-separated from cpu, v5e (one chip) and v5e-8 "
                             "(per chip, fsdp)")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = build_parser().parse_args(argv)
    args.command_line = " ".join(["python -m tunix_nb.bench", *argv])
    alone = group(args.only) if args.only in OPTIONAL_GROUPS else None
    if devices.accelerator_hint() is None:  # before JAX starts; the groups import it when they run
        devices.simulate_cpu_devices(args.devices or getattr(alone, "DEVICES", DEFAULT_DEVICES))
    if alone is not None:  # its own record
        return alone.run_alone(Path(args.out), quick=args.quick, options=args)
    groups = GROUPS if args.only is None else (args.only if args.only in GROUPS else FIGURES[args.only][0],)
    results = run(groups, quick=args.quick, out_dir=Path(args.out), progress=sys.stderr.isatty(),
                  repeats=args.repeats)
    for name, fig in sorted(results["figures"].items()):
        print(f"{name}: {describe(fig)}")
    out = Path(args.out)
    print(f"Wrote {out / 'bench.json'} and the plots {', '.join(sorted(p.name for p in out.glob('*.png')))} "
          f"in {out}")
    return 0
