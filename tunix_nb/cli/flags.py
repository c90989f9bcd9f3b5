"""The training command's first stage: its flags, parsed and checked.

One subcommand per method, with its config's flags (`tunix_nb.config_flags`) and the shared
ones (`train.config`), and no other method's. `check_flags` refuses the combinations
argparse cannot check on its own; its `FlagError`s are reported like argparse's own errors,
with the usage, and exit status 2. Nothing here starts JAX.
"""

from __future__ import annotations

import argparse
import sys

from tunix_nb import config_flags, distill, dpo, gkd, grpo, lora, losses, sft
from tunix_nb.train.config import DEFAULT_STEPS, MESH_CHOICES, SHARED_OPTIONS

PROG = "python -m tunix_nb.train"
DESCRIPTION = "`python -m tunix_nb.train`: SFT, distillation, DPO and GRPO from the command line, resumable."
COMMANDS = ("sft", "distill", "dpo", "grpo")
# Each command's own options (its `learning_rate` default: the config's DEFAULT_LEARNING_RATE).
METHOD_CONFIGS = {"sft": sft.SFTConfig, "distill": distill.DistillConfig, "dpo": dpo.DPOConfig,
                  "grpo": grpo.GRPOConfig}
LORA_COMMANDS = ("sft", "dpo", "grpo")
DPO_LOSS_TYPES = losses.DPO_LOSS_TYPES
LORA_FLAGS = tuple(f.name for f in config_flags.option_fields(lora.LoRAConfig))
LORA_DEFAULT_TARGETS = lora.DEFAULT_TARGETS
LISTING_ORDER = ("sft", "dpo", "grpo", "distill")  # how "applies only to ..." lists commands
PACKING_COMMANDS = ("sft", "distill")  # --packing: the methods whose rows are prompt/completion examples


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds '(default: x)' only where the help does not say it and the default is a value."""

    def _get_help_string(self, action):
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command: one subcommand per method, each with its config's flags and the shared ones."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, formatter_class=_HelpFormatter,
        epilog=f"`{PROG} COMMAND --help` lists a command's options. Resume an interrupted run by repeating "
               "its command: it continues from the newest checkpoint in --ckpt-dir.")
    commands = parser.add_subparsers(dest="command", required=True, title="commands", metavar="{sft,distill,dpo,grpo}",
                                     help="what to train: sft (supervised fine-tuning), distill (from a teacher), dpo "
                                          "(preference pairs, from an SFT checkpoint) or grpo (reinforcement learning "
                                          "with verifiable rewards, from an SFT checkpoint)")
    for command in COMMANDS:
        _add_command(commands, command)
    return parser


def _add_command(commands, command: str) -> None:
    method = METHOD_CONFIGS[command]
    sub = commands.add_parser(command, help=method.SUMMARY, description=f"{command}: {method.SUMMARY}",
                              formatter_class=_HelpFormatter,
                              epilog="Resume an interrupted run by repeating its command: it continues from the "
                                     "newest checkpoint in --ckpt-dir.")
    config_flags.add_options(sub, method, title=f"{command} ({method.__module__}.{method.__name__})")
    if command == "distill":
        config_flags.add_options(sub, gkd.GKDConfig, title=gkd.GKDConfig.TITLE, description=gkd.GKDConfig.DESCRIPTION)
    if command in LORA_COMMANDS:
        config_flags.add_options(sub, lora.LoRAConfig, title=lora.LoRAConfig.TITLE,
                                 description=lora.LoRAConfig.DESCRIPTION)
    for config_cls, title, description in SHARED_OPTIONS:
        config_flags.add_options(sub, config_cls, title=title, description=description)
    sub.set_defaults(learning_rate=method.DEFAULT_LEARNING_RATE)


def help_reference(width: int = 100) -> str:
    """Every command's --help as markdown (docs/cli.md's generated part), at a fixed width so
    it does not depend on the terminal."""
    import os

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)  # argparse's formatter reads the width from here
    try:
        parser = build_parser()
        parts = [("python -m tunix_nb.train --help", parser.format_help())]
        parts += [(f"python -m tunix_nb.train {c} --help", command_parser(parser, c).format_help()) for c in COMMANDS]
    finally:
        os.environ.pop("COLUMNS") if saved is None else os.environ.__setitem__("COLUMNS", saved)
    return "\n".join(f"### `{title}`\n\n```text\n{text.rstrip()}\n```\n" for title, text in parts)


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subcommand's parser (its usage goes with its errors)."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def _flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The flags; another command's flag is an error naming the commands it applies to."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):  # as before the subcommands
        command = next((a for a in argv if a in COMMANDS), None)
        rest = " ".join(a for a in argv if a != command)
        parser.error(f"the command comes first, then its flags: {PROG} {command or '{sft,distill,dpo,grpo}'} {rest}")
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = command_parser(parser, args.command)
        flag = next((e.split("=")[0] for e in extras if e.startswith("--")), None)
        owners = [c for c in LISTING_ORDER if flag in _flags_of(command_parser(parser, c))]
        if owners:
            listed = (", ".join(owners) if owners == list(LORA_COMMANDS)
                      else " and ".join(filter(None, [", ".join(owners[:-1]), owners[-1]])))
            sub.error(f"{flag} applies only to {listed}, not {args.command}")
        sub.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


class RunError(Exception):  # here, in the first stage, as every later stage raises it
    """A run that cannot start as asked: printed as `error: ...`, exit status 2, nothing changed."""


class FlagError(RunError):
    """Flags that cannot make a run: reported like argparse's own errors, with the usage."""


def check_flags(args) -> None:
    """Flag combinations argparse cannot check on its own (FlagError); fills in --steps' default and the
    warmup (with --epochs both wait for the data: `check_schedule` then runs in run_config)."""
    if args.epochs is not None and args.steps is not None:
        raise FlagError(f"--epochs {args.epochs:g} and --steps {args.steps} both set the length of the run; give one")
    if args.epochs is None:
        args.steps = DEFAULT_STEPS if args.steps is None else args.steps
        check_schedule(args)
    if args.stop_after is not None and not args.ckpt_dir:
        raise FlagError("--stop-after needs --ckpt-dir: the run saves a checkpoint there to resume from")
    _check_process_flags(args)
    _check_tracking_flags(args)
    _check_data_and_export_flags(args)
    if args.command in LORA_COMMANDS and args.lora_rank is not None and args.distributed:
        raise FlagError("--lora-rank runs in one process: drop --distributed and the process flags, and use "
                        "--devices with any --parallel")
    if args.command == "grpo" and args.distributed:
        raise FlagError("grpo runs in one process (its rewards are computed on one host); drop --distributed "
                        "and the process flags, and use --devices with any --parallel")
    if args.command == "distill" and args.distributed and (args.lmbda or args.seq_kd):
        raise FlagError("on-policy distillation (--lmbda, --seq-kd) runs in one process (its batches are sampled "
                        "on one host); drop --distributed and the process flags, and use --devices with any "
                        "--parallel")
    if args.remat_policy != "full" and not args.remat:
        raise FlagError(f"--remat-policy {args.remat_policy} says what --remat keeps: add --remat, or drop it")
    if (getattr(args, "devices", None) or 1) > 1 and args.parallel == "jit":
        raise FlagError(f"--devices {args.devices} with --parallel jit would train on one of them; add --parallel "
                        f"dp, fsdp, shard_map or pmap to use all {args.devices}, or drop --devices")
    if args.distributed and args.parallel not in MESH_CHOICES:
        raise FlagError(f"--parallel {args.parallel} runs within one process; with several processes use "
                        f"one of {', '.join(MESH_CHOICES)}")


def check_schedule(args) -> None:
    """--warmup-steps (its default filled in) and --stop-after against --steps."""
    if args.warmup_steps is None:
        args.warmup_steps = min(20, args.steps // 10)
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        raise FlagError(f"--warmup-steps {args.warmup_steps} must be >= 0 and below --steps {args.steps}")
    if args.stop_after is not None and args.stop_after > args.steps:
        raise FlagError(f"--stop-after {args.stop_after} is beyond --steps {args.steps}")
    if args.export_from == "best" and args.eval_every is not None and args.eval_every > args.steps:
        raise FlagError(f"--export-from best: --eval-every {args.eval_every} is beyond --steps {args.steps}, so no "
                        "eval would make a best checkpoint; evaluate more often")


def _check_data_and_export_flags(args) -> None:
    if args.eval_file and not args.train_file:
        raise FlagError("--eval-file goes with --train-file (without it the shipped task's eval split is used)")
    if args.train_file and args.eval_every is not None and not args.eval_file:
        raise FlagError("--eval-every with --train-file needs --eval-file: the split to score, in the same format")
    if args.max_length is not None and not args.train_file:
        raise FlagError("--max-length applies to --train-file's rows (the shipped task has its own length)")
    if args.chat_template_kwargs is not None and not args.train_file:
        raise FlagError("--chat-template-kwargs applies to --train-file's conversations (the shipped task has no "
                        "chat template)")
    if args.command == "distill" and args.train_file and (args.lmbda or args.seq_kd):
        raise FlagError("on-policy distillation (--lmbda, --seq-kd) samples from the shipped task's prompts; with "
                        "--train-file use offline distillation (--lmbda 0, no --seq-kd)")
    _check_packing_flags(args)
    if args.seq_chunk is not None and args.vocab_chunk is None:
        raise FlagError("--seq-chunk needs the chunked path (the positions are taken in chunks within it): drop "
                        "--vocab-chunk none, or give --vocab-chunk N")
    if args.export_adapter and getattr(args, "lora_rank", None) is None:
        raise FlagError("--export-adapter writes LoRA adapters: add --lora-rank (or use --export-hf for the "
                        "whole model)")
    if (args.export_hf or args.export_adapter) and args.distributed:
        raise FlagError("--export-hf / --export-adapter write from one process; drop them, and export the run's "
                        "final checkpoint afterwards in one process (hf.save_pretrained, peft_adapter.save_adapter)")
    if args.export_from == "best" and not (args.eval_every and args.ckpt_dir):
        raise FlagError("--export-from best exports <--ckpt-dir>/best, the best checkpoint by eval loss: add "
                        "--eval-every N and --ckpt-dir (and --eval-file with --train-file)")
    if args.export_from == "best" and not (args.export_params or args.export_hf or args.export_adapter):
        raise FlagError("--export-from best chooses what --export-params, --export-hf or --export-adapter write: "
                        "add one of them")
    if (args.export_dtype or args.max_shard_size) and not args.export_hf:
        raise FlagError("--export-dtype and --max-shard-size shape --export-hf's folder: add --export-hf DIR")


def _check_packing_flags(args) -> None:
    if not args.packing:
        return
    if args.command not in PACKING_COMMANDS:
        raise FlagError(f"--packing applies only to {' and '.join(PACKING_COMMANDS)}, not {args.command}: it packs "
                        "prompt/completion examples, not preference pairs or prompts")
    if args.command == "distill" and (args.lmbda or args.seq_kd):
        raise FlagError("--packing packs the dataset's examples; on-policy distillation (--lmbda, --seq-kd) trains "
                        "on rows it samples, unpacked: drop --packing or the on-policy flags")


def _check_process_flags(args) -> None:
    given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
             "--process-id": args.process_id}
    if all(v is None for v in given.values()):
        return
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise FlagError(f"several processes need all of --coordinator, --num-processes and --process-id; "
                        f"missing {', '.join(missing)} (or use --distributed on a cluster JAX detects)")
    if not 0 <= args.process_id < args.num_processes:
        raise FlagError(f"--process-id {args.process_id} must be in 0 ... {args.num_processes - 1}")
    args.distributed = True


def _check_tracking_flags(args) -> None:
    trackers = args.report_to.split(",")
    if args.metrics_file and "jsonl" not in trackers:
        raise FlagError(f"--metrics-file is the jsonl tracker's file, but --report-to {args.report_to} leaves it "
                        "out; add jsonl to --report-to or drop --metrics-file")
    if "tensorboard" in trackers and not (args.logging_dir or args.ckpt_dir):
        raise FlagError("--report-to tensorboard needs --logging-dir (or --ckpt-dir, whose tensorboard/ folder "
                        "is the default)")
    if args.logging_dir and "tensorboard" not in trackers:
        raise FlagError("--logging-dir is for --report-to tensorboard; add it there or drop --logging-dir")
    if args.eval_every is not None and args.command == "grpo":
        raise FlagError("--eval-every: grpo has no eval loss (its loss needs rollouts); follow the rewards in "
                        "the metrics instead")
    if args.eval_every is not None and args.distributed:
        raise FlagError("--eval-every evaluates in one process: drop --distributed and the process flags")
