"""`python -m tunix_nb.train`: SFT, distillation, DPO and GRPO from the command line, resumable.

One subcommand per method: `python -m tunix_nb.train dpo --help` lists DPO's options
(`dpo.DPOConfig`) and the shared ones (`train.config`), and no other method's. Every
flag is a field of a config dataclass (`tunix_nb.config_flags`): `sft.SFTConfig`,
`dpo.DPOConfig`, `grpo.GRPOConfig`, `distill.DistillConfig` with `gkd.GKDConfig`,
`lora.LoRAConfig` (sft, dpo, grpo), and the shared `train.config.TrainingConfig`,
`ModelSourceConfig`, `DataConfig`, `MemoryConfig`, `CheckpointConfig`, `TrackingConfig`,
`DeviceConfig`, `ProcessConfig`. The run config saved in each checkpoint (`RunConfig.record`) is made
of those configs' run-defining fields.

It saves the training state with Orbax every --save-every steps (in the background),
and resumes on its own from the newest checkpoint in --ckpt-dir, to exactly the run an
uninterrupted one would have been: same parameters, bit for bit, on the same device
count. It refuses (leaving the checkpoints untouched) when that run's config differs
from the flags given.

Resuming, in detail:
- Batches are a pure function of (--seed, step), and no step draws random numbers, so
  the step is the whole data/RNG state. GRPO's rollouts and on-policy distillation's
  batches (distill --lmbda) do sample, with keys that are a pure function of (--seed,
  step, row) (`sampler.rollout_keys`; `gkd.batch_source` for which steps sample), so the
  same holds. Each checkpoint also holds the run key folded with its step (item `rng`),
  which the resumed run checks against its own.
- A save killed midway leaves `<step>.orbax-checkpoint-tmp`, which is not a checkpoint;
  the resumed run ignores it and Orbax replaces it when it saves that step again.
- If the newest checkpoint is damaged, the run warns (step and error), resumes from the
  one before, and renames the damaged one to `<step>.damaged-<time>` so that the step
  can be saved again. It prints the new name; nothing is deleted.
- Checkpoints hold one copy of the state, so a run may resume on another device count
  (--devices, --parallel): bit for bit the same state, replicated onto the new devices.
- A run started before the subcommands existed (its checkpoints record the older, flat
  run config) resumes with the same flags: a field the old config lacks counts as its
  default (`RunConfig.clashes_with`).
- With --eval-every, the best checkpoint by eval loss is kept in `<--ckpt-dir>/best`
  (its own Orbax manager, keeping one), beside the newest ones; a resumed run keeps it
  and replaces it only with a better one.

Several processes (a TPU pod slice, GPU hosts, or `python -m tunix_nb.launch` on one
machine) run the same command with --coordinator/--num-processes/--process-id (or
--distributed, to let JAX read them from the cluster) and --parallel dp, fsdp or
shard_map: each process loads only its share of every batch, they save checkpoints
together into one --ckpt-dir (shared storage), and process 0 prints and writes the
metrics.

`main` is a few named steps over a `RunConfig`: resolve the config, open (and check) the
checkpoint directory, build the method (`build_model`, `training_arrays`), resume, train
with saves. `tunix_nb.preempt` runs this CLI and SIGKILLs it mid-run (tests and notebook 05).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

from tunix_nb import config_flags, devices, distill, distributed, dpo, gkd, grpo, lora, losses, sampler, sft, tracking
from tunix_nb.gkd import GKDConfig
from tunix_nb.lora import LoRAConfig
from tunix_nb.train.config import (  # noqa: F401  (PARALLEL_CHOICES: re-exported, as before)
    MESH_CHOICES, PARALLEL_CHOICES, SHARED_OPTIONS, DataConfig, MemoryConfig, ModelSourceConfig, TrainingConfig)

PROG = "python -m tunix_nb.train"
COMMANDS = ("sft", "distill", "dpo", "grpo")
# Each command's own options (its `learning_rate` default: the config's DEFAULT_LEARNING_RATE).
METHOD_CONFIGS = {"sft": sft.SFTConfig, "distill": distill.DistillConfig, "dpo": dpo.DPOConfig,
                  "grpo": grpo.GRPOConfig}
LORA_COMMANDS = ("sft", "dpo", "grpo")
DPO_LOSS_TYPES = losses.DPO_LOSS_TYPES
LORA_FLAGS = tuple(f.name for f in config_flags.option_fields(lora.LoRAConfig))
LORA_DEFAULT_TARGETS = lora.DEFAULT_TARGETS
HF_MODEL = "huggingface"  # RunConfig.model of a Hugging Face checkpoint (model_sha256 says which)
# What defines a run: resuming with other values would be a different run.
RUN_DEFINING = ("command", "model", *dict.fromkeys(
    name for cls in (TrainingConfig, ModelSourceConfig, DataConfig, *METHOD_CONFIGS.values(), gkd.GKDConfig,
                     lora.LoRAConfig)
    for name in config_flags.run_defining_names(cls) if name != "model"), "model_sha256", "data_sha256")
# The fields of a saved run config, in the flat layout checkpoints have always held: every
# command's fields, None where the command has none.
RECORD_FIELDS = ("command", "model", *dict.fromkeys(
    f.name for cls in (*METHOD_CONFIGS.values(), TrainingConfig, gkd.GKDConfig, lora.LoRAConfig, ModelSourceConfig,
                       DataConfig)
    for f in config_flags.option_fields(cls) if f.name != "model"), "model_sha256", "data_sha256")
# A field a checkpoint's config lacks (it predates the field) counts as this value: the
# run it describes used it.
OLDER_RUN_DEFAULTS = {"grad_accum": 1, "remat": False, "dtype": "float32", "packing": False}
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
        prog=PROG, description=__doc__.splitlines()[0], formatter_class=_HelpFormatter,
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


class RunError(Exception):
    """A run that cannot start as asked: printed as `error: ...`, exit status 2, nothing changed."""


class FlagError(RunError):
    """Flags that cannot make a run: reported like argparse's own errors, with the usage."""


def check_flags(args) -> None:
    """Flag combinations argparse cannot check on its own (FlagError); fills in the warmup."""
    if args.warmup_steps is None:
        args.warmup_steps = min(20, args.steps // 10)
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        raise FlagError(f"--warmup-steps {args.warmup_steps} must be >= 0 and below --steps {args.steps}")
    if args.stop_after is not None and args.stop_after > args.steps:
        raise FlagError(f"--stop-after {args.stop_after} is beyond --steps {args.steps}")
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
    if args.distributed and args.parallel not in MESH_CHOICES:
        raise FlagError(f"--parallel {args.parallel} runs within one process; with several processes use "
                        f"one of {', '.join(MESH_CHOICES)}")


def _check_data_and_export_flags(args) -> None:
    if args.eval_file and not args.train_file:
        raise FlagError("--eval-file goes with --train-file (without it the shipped task's eval split is used)")
    if args.train_file and args.eval_every is not None and not args.eval_file:
        raise FlagError("--eval-every with --train-file needs --eval-file: the split to score, in the same format")
    if args.max_length is not None and not args.train_file:
        raise FlagError("--max-length applies to --train-file's rows (the shipped task has its own length)")
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


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What defines a run, with every default resolved; `record()` is saved in each checkpoint's
    meta, and resuming with other `RUN_DEFINING` values would be a different run."""

    command: str
    model: str  # a preset, or HF_MODEL for a Hugging Face checkpoint (model_sha256 says which)
    training: TrainingConfig  # learning rate, warmup and compute dtype resolved
    method: object  # the command's config: sft.SFTConfig, dpo.DPOConfig, grpo.GRPOConfig, distill.DistillConfig
    source: ModelSourceConfig = ModelSourceConfig()
    lora: LoRAConfig = LoRAConfig()  # resolved; all None: every parameter trains
    gkd: GKDConfig | None = None  # distill only (resolved; all None: offline)
    model_dir: str | None = None  # a Hugging Face checkpoint's local folder (not recorded: the hash is)
    model_sha256: str | None = None  # hf.source_fingerprint of that folder
    data: DataConfig = DataConfig()
    data_sha256: str | None = None  # the --train-file's content hash (None: the shipped task)
    memory: MemoryConfig = MemoryConfig()

    def record(self) -> dict:
        """The flat run config saved in checkpoints (the layout of runs before the subcommands)."""
        record = dict.fromkeys(RECORD_FIELDS)
        parts = [self.method, self.training, self.lora, self.gkd, self.source, self.data]
        for part in filter(None, parts):
            record.update({f.name: getattr(part, f.name) for f in config_flags.option_fields(type(part))})
        record.update(command=self.command, model=self.model, model_sha256=self.model_sha256,
                      data_sha256=self.data_sha256)
        return record

    def clashes_with(self, saved: dict) -> dict:
        """{field: (saved, given)} for every run-defining field that differs from a saved config."""
        given = self.record()
        saved = {k: saved.get(k, OLDER_RUN_DEFAULTS.get(k)) for k in RUN_DEFINING}
        return {k: (saved[k], given[k]) for k in RUN_DEFINING if saved[k] != given[k]}

    @property
    def steps(self) -> int:
        return self.training.steps

    @property
    def batch_size(self) -> int:
        return self.training.batch_size

    @property
    def seed(self) -> int:
        return self.training.seed

    @property
    def num_iterations(self) -> int:
        return getattr(self.method, "num_iterations", 1)


def config_from_argv(argv) -> RunConfig:
    """The RunConfig a command line makes (for scripts and tests; starts JAX, reads --init-from)."""
    parser = build_parser()
    args = parse_args(parser, argv)
    check_flags(args)
    return resolve_config(args)


def resolve_config(args) -> RunConfig:
    """The run's config from the flags: the model, the checkpoints it starts from, the defaults."""
    from tunix_nb import devices

    method = config_flags.from_args(METHOD_CONFIGS[args.command], args)
    model_name, model_dir, model_sha256 = resolve_model(args.model, args.revision)
    if args.command in ("dpo", "grpo") or getattr(args, "init_from", None):
        method = dataclasses.replace(method, init_from=_init_from(args, model_name, model_dir))
        model_name = model_name or _preset_of(method.init_from)
    model_name = model_name or "student"
    compute_dtype = args.compute_dtype
    if compute_dtype == "auto":
        chosen = devices.defaults_for()
        compute_dtype = chosen.compute_dtype
        print(f"--compute-dtype auto: {compute_dtype} ({chosen.reason})")
    training = config_flags.from_args(TrainingConfig, args, compute_dtype=compute_dtype)
    lora_config, gkd_config = LoRAConfig(), None
    try:
        if args.command in LORA_COMMANDS:
            lora_config = config_flags.from_args(LoRAConfig, args).resolved()
        if args.command == "distill":
            gkd_config, beta = config_flags.from_args(GKDConfig, args).resolved(method.beta)
            method = dataclasses.replace(method, beta=beta, teacher=method.teacher or str(distill.TEACHER_DIR))
        if args.command == "grpo":
            method.check()
            method = dataclasses.replace(method, rewards=",".join(method.reward_names))
    except ValueError as err:
        raise FlagError(str(err))
    data_config = config_flags.from_args(DataConfig, args)
    memory, chose = config_flags.from_args(MemoryConfig, args).resolved(vocab_size_of(model_name, model_dir))
    if chose:
        print(f"--vocab-chunk auto: {chose}")
    return RunConfig(command=args.command, model=model_name, training=training, method=method,
                     source=config_flags.from_args(ModelSourceConfig, args, model=args.model),
                     lora=lora_config, gkd=gkd_config, model_dir=model_dir and str(model_dir),
                     model_sha256=model_sha256, data=data_config, data_sha256=data_hash(data_config.train_file),
                     memory=memory)


def vocab_size_of(model_name: str, model_dir: str | None) -> int:
    """The vocabulary size of --model: a preset's, or a Hugging Face folder's config.json."""
    from tunix_nb import hf, model

    if model_dir is None:
        return model.PRESETS[model_name].vocab_size
    try:
        return hf.model_config(hf.read_config(model_dir)).vocab_size
    except hf.CheckpointError as err:
        raise FlagError(f"--model {model_dir}: {err}")


def data_hash(train_file: str | None) -> str | None:
    """sha256 of a local --train-file's bytes (a resume with other data is refused); a Hub
    dataset id is recorded as itself; None for the shipped task."""
    import hashlib

    if train_file is None:
        return None
    path = Path(train_file)
    if not path.is_file():
        return f"hub:{train_file}" if train_file.count("/") == 1 and not path.exists() else _missing(train_file)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _missing(train_file: str):
    raise FlagError(f"--train-file {train_file}: no such file; give a .jsonl, .json or .parquet file, or a Hub "
                    "dataset id such as trl-lib/Capybara")


def resolve_model(name: str | None, revision: str | None):
    """(preset or HF_MODEL or None (not given), local folder or None, content hash or None) of --model:
    a preset, a local Hugging Face checkpoint folder, or a Hub id (downloaded at --revision)."""
    from tunix_nb import hf, model

    if name is None or name in model.PRESETS:
        if revision is not None:
            raise FlagError("--revision applies only to a Hub id given as --model (e.g. Qwen/Qwen3-0.6B)")
        return name, None, None
    path = Path(name)
    if path.is_dir() and revision is not None:
        raise FlagError(f"--revision applies only to a Hub id; --model {name} is a local folder")
    if not path.is_dir() and (path.exists() or name.count("/") != 1):
        raise FlagError(f"--model {name!r} is not a preset; choose one of {sorted(model.PRESETS)}, a Hugging Face "
                        "checkpoint folder (config.json, *.safetensors, tokenizer.json) or a Hub id such as "
                        "Qwen/Qwen3-0.6B")
    try:
        directory = hf.resolve(name, revision=revision)
        return HF_MODEL, directory, hf.source_fingerprint(directory)
    except (hf.CheckpointError, FileNotFoundError) as err:
        raise FlagError(f"--model {name}: {err}")


def _init_from(args, model_name, model_dir) -> str | None:
    """dpo, grpo: the SFT checkpoint the policy and reference start from (the shipped student by
    default, unless --model is a Hugging Face checkpoint); distill: the student's, if given."""
    from tunix_nb import data

    if args.init_from is None and (args.command == "distill" or model_dir is not None):
        return None
    init_from = args.init_from or str(data.DATA_DIR / "sft_student")
    init_model = _preset_of(init_from) if model_dir is None else None
    if model_name is not None and model_dir is None and model_name != init_model:
        raise FlagError(f"--model {model_name!r} differs from the --init-from checkpoint's model "
                        f"{init_model!r}; leave --model out")
    return init_from


def _preset_of(init_from: str) -> str:
    from tunix_nb import checkpoint

    try:
        return checkpoint.model_preset(checkpoint.load_meta(init_from), "The --init-from checkpoint")
    except FileNotFoundError:
        raise FlagError(f"--init-from {init_from}: no checkpoint there; train one with "
                        f"`python -m tunix_nb.train sft --ckpt-dir {init_from}` first")


def check_devices(config: RunConfig, parallel_mode: str) -> None:
    import jax

    n_devices = 1 if parallel_mode == "jit" else jax.device_count()
    if config.batch_size % n_devices:
        raise FlagError(f"--batch-size {config.batch_size} does not divide by the {n_devices} devices; "
                        f"use a multiple of {n_devices}")
    rows = config.batch_size * (getattr(config.method, "group_size", None) or 1)  # grpo trains on every completion
    grad_accum = config.training.grad_accum
    if rows % (n_devices * grad_accum):
        raise FlagError(f"--grad-accum {grad_accum}: the {rows // n_devices} rows per device do not "
                        f"divide into {grad_accum} micro-batches; use a --batch-size whose rows per "
                        f"device are a multiple of {grad_accum}")


def open_checkpoints(args, config: RunConfig):
    """The run's CheckpointManager (None without --ckpt-dir), refusing one that holds another run."""
    from tunix_nb import checkpoint

    if not args.ckpt_dir:
        return None
    manager = checkpoint.make_manager(args.ckpt_dir, keep=args.keep, save_every=args.save_every,
                                      async_save=not args.sync_save)
    saved = checkpoint.newest_readable_meta(manager)
    if saved is not None:
        saved_config = saved.get("config", {})
        saved_hash = saved_config.get("model_sha256")
        if saved_hash != config.model_sha256 and (saved_hash or config.model_sha256):
            raise RunError(f"--ckpt-dir {args.ckpt_dir} holds a run of another model: its config.json and "
                           f"weights hash to {saved_hash or 'none (a preset, ' + repr(saved_config.get('model')) + ')'}"
                           f", --model {args.model} to {config.model_sha256 or 'none (a preset)'}. Pass the "
                           "--model that run trained (and its --revision), or use another --ckpt-dir. "
                           "Nothing was changed.")
        clashes = config.clashes_with(saved_config)
        if clashes:
            detail = ", ".join(f"{k}: saved {a!r}, given {b!r}" for k, (a, b) in clashes.items())
            raise RunError(f"--ckpt-dir {args.ckpt_dir} holds a different run ({detail}). "
                           "Use another --ckpt-dir, or the same flags to resume it. Nothing was changed.")
    return manager


@dataclasses.dataclass
class Method:
    """What one command trains: the model, its rows, its objective and what stays frozen."""

    graphdef: object
    params: object
    rows: dict
    objective: object
    frozen: object = None
    # on-policy methods (grpo): (parallel_mode, mesh) -> rollout_fn for train.run_on_policy,
    # and the reference the rollout scores with
    make_rollout: object = None
    reference: object = None
    # the trained params -> (graphdef, params) of the plain model to export (LoRA: merged)
    exportable: object = None
    # the eval split's rows, which `objective` scores (with --eval-every; None: no eval loss)
    eval_rows: dict | None = None
    tokenizer: object = None
    lora_alpha: float | None = None  # LoRA: the adapters' alpha (scale alpha / rank), for --export-adapter
    # --packing: how each step's examples become packed rows (packing.PackingConfig, its num_rows
    # set in `prepare`); and the objective of the unpacked eval rows where `objective` wants packed ones
    packing: object = None
    eval_objective: object = None


@dataclasses.dataclass
class Trainable:
    """What the step trains: every parameter, or (LoRA) adapters on a frozen base."""

    graphdef: object
    params: object
    base: object = None  # LoRA: the frozen base (quantised for QLoRA); None: full fine-tuning
    alpha: float | None = None

    @property
    def lora(self) -> bool:
        return self.base is not None

    def objective(self, method_objective):
        from tunix_nb import lora

        return lora.objective(method_objective) if self.lora else method_objective

    def frozen(self, method_frozen=None):
        from tunix_nb import lora

        return lora.frozen(self.base, method_frozen) if self.lora else method_frozen

    def reference(self):
        """The starting model's state: with LoRA, the base with the adapters switched off."""
        from tunix_nb import lora

        return lora.combine(lora.switched_off(self.params), self.base) if self.lora else self.params

    def exportable(self, params):
        """(graphdef, params) of the plain model: with LoRA, the adapters merged into the base."""
        from tunix_nb import lora

        return lora.merge(self.graphdef, params, self.base, alpha=self.alpha) if self.lora else (self.graphdef, params)


def trainable(config: RunConfig, graphdef, params) -> Trainable:
    """Every parameter, or LoRA adapters (float32, whatever --dtype keeps the base in) on a frozen base."""
    from tunix_nb import lora

    options = config.lora
    if options.lora_rank is None:
        return Trainable(graphdef, params)
    try:
        lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=options.lora_rank, alpha=options.lora_alpha,
                                                   targets=options.lora_targets, quantize=options.quantize,
                                                   seed=config.seed)
    except ValueError as err:  # targets that match nothing, a tile size that does not divide
        raise FlagError(f"--lora-targets / --quantize: {err}")
    return Trainable(lora_graphdef, adapters, base, options.lora_alpha)


def build_model(config: RunConfig):
    """(graphdef, params, tokenizer) of --model, kept in --dtype: a preset's fresh model (--seed) or
    its --init-from checkpoint, with the byte tokenizer; or a Hugging Face checkpoint's weights and
    tokenizer. Extension point: another source of models goes here."""
    from tunix_nb import checkpoint, hf, model, precision
    from tunix_nb.tokenizer import ByteTokenizer, HFTokenizer

    if config.model_dir is None:
        graphdef, params = model.split(model.make_model(config.model, seed=config.seed, remat=config.training.remat))
        tokenizer = ByteTokenizer()
    else:
        try:
            graphdef, params, _ = hf.load_pretrained(config.model_dir, dtype=config.source.dtype)
            tokenizer = HFTokenizer.from_dir(config.model_dir)
        except (hf.CheckpointError, FileNotFoundError, ValueError) as err:
            raise FlagError(f"--model {config.source.model}: {err}")
        if config.training.remat:
            graphdef, params = _rematerialised(graphdef, params)
    init_from = getattr(config.method, "init_from", None)
    if init_from:  # dpo, grpo: the policy and the reference start from the SFT checkpoint (distill: if given)
        params = checkpoint.params_into(params, checkpoint.load_params(init_from))
    if config.source.dtype != "float32":
        import jax.numpy as jnp

        params = precision.cast_floats(params, jnp.dtype(config.source.dtype))
    return graphdef, params, tokenizer


def _rematerialised(graphdef, params):
    from flax import nnx

    module = nnx.merge(graphdef, params)
    module.cfg = dataclasses.replace(module.cfg, remat=True)
    return nnx.split(module)


def training_examples(config: RunConfig, split: str = "train") -> list[dict]:
    """The shipped task's examples of `split` ("train" or "eval") for the method."""
    from tunix_nb import data

    if config.command == "dpo":
        return data.load_preferences(data.DATA_DIR / f"preferences_{split}.jsonl")
    return data.load_sft(data.DATA_DIR / f"sft_{split}.jsonl")


def user_file(config: RunConfig, split: str = "train") -> str | None:
    """--train-file or --eval-file (None: the shipped task's split)."""
    return config.data.train_file if split == "train" else config.data.eval_file


def encoded_user_data(config: RunConfig, tokenizer, split: str = "train"):
    """--train-file / --eval-file through tunix_nb.user_data (TRL's formats, the chat template,
    --max-length's truncation policy): a user_data.Encoded, its cut rows reported."""
    from tunix_nb import data, user_data

    source = user_file(config, split)
    encode = user_data.ENCODERS["dpo" if config.command == "dpo" else "grpo" if config.command == "grpo" else "sft"]
    try:
        encoded = encode(source, tokenizer, max_length=config.data.max_length)
    except (data.DataError, FileNotFoundError, ValueError) as err:
        raise RunError(f"--{'train' if split == 'train' else 'eval'}-file: {err}")
    if encoded.n_cut:
        _say(f"{source}: {encoded.n_cut} rows lost the beginning of their prompt to fit --max-length "
             f"{config.data.max_length}")
    return encoded


def training_arrays(config: RunConfig, tokenizer, split: str = "train", examples=None) -> dict:
    """The rows the method trains (or evaluates) on, as arrays: prompt/completion rows (sft,
    distill), preference pairs (dpo) or prompts (grpo); from --train-file / --eval-file when given."""
    from tunix_nb import data

    if user_file(config, split) is not None:
        return encoded_user_data(config, tokenizer, split).arrays
    examples = training_examples(config, split) if examples is None else examples
    if config.command == "dpo":
        return data.preference_arrays(examples, tokenizer, data.DEFAULT_SEQ_LEN)
    if config.command == "grpo":
        return sampler.prompt_rows(examples, tokenizer)
    return data.sft_arrays(examples, tokenizer, data.DEFAULT_SEQ_LEN)


def build_method(config: RunConfig, *, with_eval: bool = False) -> Method:
    """The model, data rows, objective and frozen parameters of `config.command` (with the eval
    split's rows too when `with_eval`)."""
    from tunix_nb import precision

    graphdef, params, tokenizer = build_model(config)
    dtype = precision.resolve_compute_dtype(config.training.compute_dtype)
    build = {"sft": _sft_method, "dpo": _dpo_method, "grpo": _grpo_method, "distill": _distill_method}
    method = build[config.command](config, graphdef, params, tokenizer, dtype, with_eval)
    method.tokenizer = tokenizer
    return method


def _sft_method(config, graphdef, params, tokenizer, dtype, with_eval) -> Method:
    t = trainable(config, graphdef, params)
    return Method(t.graphdef, t.params, training_arrays(config, tokenizer),
                  t.objective(sft.objective(t.graphdef, compute_dtype=dtype, **chunks_of(config))), frozen=t.frozen(),
                  exportable=t.exportable, eval_rows=training_arrays(config, tokenizer, "eval") if with_eval else None,
                  lora_alpha=t.alpha)


def _dpo_method(config, graphdef, params, tokenizer, dtype, with_eval) -> Method:
    t, options = trainable(config, graphdef, params), config.method
    objective = dpo.objective(t.graphdef, beta=options.beta, loss_type=options.loss_type,
                              sft_weight=options.sft_weight, length_normalize=options.length_normalize,
                              cached_reference=not options.reference_in_step, compute_dtype=dtype,
                              **chunks_of(config))
    if options.reference_in_step:  # the step scores the reference: its own copy, as the policy's is donated
        import jax
        import jax.numpy as jnp

        reference = t.frozen(jax.tree.map(jnp.copy, t.reference()))
        with_reference = lambda rows: rows  # noqa: E731
    else:
        reference = t.frozen()

        # cached once: the reference never changes (LoRA: the base, adapters off). Scored in the step's
        # batch shape: in bfloat16 another shape rounds apart, and step 1 would not start at ln 2.
        def with_reference(rows):
            return dpo.reference_log_probs(t.graphdef, t.reference(), rows, length_normalize=options.length_normalize,
                                           compute_dtype=dtype, batch_size=config.batch_size, **chunks_of(config))

    eval_rows = with_reference(training_arrays(config, tokenizer, "eval")) if with_eval else None
    return Method(t.graphdef, t.params, with_reference(training_arrays(config, tokenizer)), t.objective(objective),
                  frozen=reference, exportable=t.exportable, eval_rows=eval_rows, lora_alpha=t.alpha)


def _grpo_method(config, graphdef, params, tokenizer, dtype, with_eval) -> Method:
    from tunix_nb import lora

    t, options = trainable(config, graphdef, params), config.method  # the SFT checkpoint stays as the reference
    if config.data.train_file is None:
        examples, rows = training_examples(config), None
    else:  # the prompts as the chat template renders them; every column reaches the rewards
        encoded = encoded_user_data(config, tokenizer)
        examples, rows = encoded.examples, encoded.arrays
    reward_set = make_reward_set(options, examples)
    objective = grpo.objective(t.graphdef, epsilon=options.epsilon, epsilon_high=options.epsilon_high,
                               beta=options.beta, kl_estimator=options.kl_estimator,
                               aggregation=options.aggregation, compute_dtype=dtype, **chunks_of(config))

    def make_rollout(parallel_mode, mesh):
        rollout_fn = grpo.make_rollout(
            t.graphdef, examples, reward_set, batch_size=config.batch_size, group_size=options.group_size,
            seed=config.seed, estimator=options.advantage, num_iterations=options.num_iterations,
            beta=options.beta, max_new_tokens=options.max_new_tokens, temperature=options.temperature,
            compute_dtype=dtype, parallel_mode=parallel_mode, mesh=mesh, tokenizer=tokenizer, rows=rows,
            **chunks_of(config))
        # with LoRA the reference is the base itself: no second copy of the weights
        return lora.rollout(rollout_fn, with_reference=options.beta > 0) if t.lora else rollout_fn

    reference = t.params if options.beta > 0 and not t.lora else None
    rows = training_arrays(config, tokenizer, examples=examples) if rows is None else rows
    return Method(t.graphdef, t.params, rows, t.objective(objective),
                  frozen=t.frozen(), make_rollout=make_rollout, reference=reference, exportable=t.exportable,
                  lora_alpha=t.alpha)


def _distill_method(config, graphdef, params, tokenizer, dtype, with_eval) -> Method:
    options, sampling = config.method, config.gkd
    rows = training_arrays(config, tokenizer)
    eval_rows = training_arrays(config, tokenizer, "eval") if with_eval else None
    teacher_graphdef, teacher_params = distill.load_teacher(options.teacher)
    objective = distill.objective(graphdef, teacher_graphdef, beta=options.beta or 0.0, compute_dtype=dtype,
                                  **chunks_of(config))
    if config.data.packing:  # per-example means taken per segment; the eval rows stay unpacked
        from tunix_nb import packing

        packed = packing.distill_objective(graphdef, teacher_graphdef, beta=options.beta or 0.0, compute_dtype=dtype,
                                           **chunks_of(config))
        return Method(graphdef, params, rows, packed, frozen=teacher_params, eval_rows=eval_rows,
                      eval_objective=objective)
    if not (sampling.lmbda or sampling.seq_kd):  # offline: the dataset's answers
        return Method(graphdef, params, rows, objective, frozen=teacher_params, eval_rows=eval_rows)

    def make_batches(parallel_mode, mesh):  # GKD: the student's samples, the teacher's answers
        return gkd.make_batches(graphdef, teacher_graphdef, training_examples(config),
                                batch_size=config.batch_size, seed=config.seed, lmbda=sampling.lmbda,
                                seq_kd=sampling.seq_kd, temperature=sampling.temperature or 1.0,
                                max_new_tokens=sampling.max_new_tokens, compute_dtype=dtype,
                                parallel_mode=parallel_mode, mesh=mesh, tokenizer=tokenizer)

    return Method(graphdef, params, rows, objective, frozen=teacher_params, make_rollout=make_batches,
                  eval_rows=eval_rows)


def chunks_of(config: RunConfig) -> dict:
    """--vocab-chunk / --seq-chunk as the objectives' keywords (tunix_nb.vocab_chunks); a
    RunConfig built without the command, whose vocab_chunk is still "auto", gets it resolved here."""
    memory = config.memory
    if memory.vocab_chunk == "auto":
        memory, _ = memory.resolved(vocab_size_of(config.model, config.model_dir))
    return {"vocab_chunk": memory.vocab_chunk, "seq_chunk": memory.seq_chunk}


def make_reward_set(options: grpo.GRPOConfig, examples):
    """--rewards' built-in functions and --reward-funcs' own, each under its name (metric
    rewards/<name>/...); own functions are tried once on the first examples before training."""
    from tunix_nb import rewards

    funcs = {name: grpo.REWARD_FUNCTIONS[name] for name in options.reward_names}
    if options.reward_funcs:
        try:
            own = rewards.load_reward_funcs(options.reward_funcs)
        except ValueError as err:
            raise FlagError(str(err))
        both = sorted(set(own) & set(funcs))
        if both:
            raise FlagError(f"--reward-funcs: {', '.join(both)} is also a --rewards name; each reward logs "
                            "rewards/<name>, so rename your function or drop it from --rewards")
        funcs.update(own)
    reward_set = rewards.combine(funcs)
    if options.reward_funcs:
        _try_rewards(reward_set, examples[:4])
    return reward_set


def _try_rewards(reward_set, examples) -> None:
    """Call the reward functions on `examples` with their reference answers (or empty strings) as the completions:
    a function that fails, or returns the wrong length or NaN, stops the run before it starts."""
    from tunix_nb import rewards

    columns = {k: [e[k] for e in examples] for k in examples[0] if k != "prompt"}
    # the reference answers where the data has them (the shipped task), else empty completions
    prompts = [e["prompt"] for e in examples]
    completions = rewards.for_reward_functions(prompts, [e.get("completion", "") for e in examples])
    try:
        reward_set(prompts, completions, **columns)
    except rewards.RewardError as err:
        raise RunError(f"--reward-funcs: {err} (tried on the first {len(examples)} examples, their reference "
                       "answers as the completions). Nothing was changed.")
    except Exception as err:  # the user's function raised: show what it was called with
        raise RunError(f"--reward-funcs: a reward function raised {type(err).__name__}: {err}, called as "
                       f"fn(prompts, completions, {', '.join(f'{k}=' for k in columns)}) on the first "
                       f"{len(examples)} examples. Nothing was changed.")


def resume(manager, args, params, opt_state, run_key, mesh):
    """(params, opt_state, start step): from the newest checkpoint that restores, or as given.

    Damaged newer steps are moved aside (renamed, never deleted) so they can be saved again.
    """
    import jax

    from tunix_nb import checkpoint, distributed

    if manager is None or not manager.all_steps():
        return params, opt_state, 0
    newest = manager.latest_step()
    with warnings.catch_warnings(record=True) as caught:  # printed below, without file names
        warnings.simplefilter("always", checkpoint.DamagedCheckpointWarning)
        try:
            params, opt_state, meta = checkpoint.restore(
                manager, params_like=params, opt_state_like=opt_state, mesh=mesh,
                parallel_mode=args.parallel if mesh is not None else None)
        except checkpoint.DamagedCheckpointError as err:
            raise RunError(f"{err}. Move the damaged steps out of --ckpt-dir {args.ckpt_dir} (or use "
                           "another --ckpt-dir) to start over. Nothing was changed.")
        finally:
            for w in caught if distributed.is_main_process() else ():
                print(f"warning: {w.category.__name__}: {w.message}", file=sys.stderr, flush=True)
    start = meta["step"]
    if "rng" in meta and not (jax.random.key_data(meta["rng"]) ==
                              jax.random.key_data(jax.random.fold_in(run_key, start))).all():
        raise RunError(f"the RNG key saved at step {start} is not this run's; "
                       "the checkpoint was not written by this command. Nothing was changed.")
    _set_aside_newer(manager, start)
    _say(f"Resuming from the checkpoint at step {start} in {args.ckpt_dir}"
         + (f" (newest was {newest})" if newest != start else ""))
    return params, opt_state, start


def _set_aside_newer(manager, start):
    """Rename the steps after `start` (they failed to restore), once, from process 0."""
    import jax

    from tunix_nb import checkpoint, distributed

    for step in sorted(s for s in manager.all_steps() if s > start):
        if distributed.is_main_process():
            moved = checkpoint.set_aside(manager, step)
            _say(f"The checkpoint at step {step} is damaged: moved it aside to {moved.name} "
                 "(nothing deleted), so that step can be saved again.")
    if jax.process_count() > 1:  # nobody saves before the renames are done
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("checkpoints set aside")
        manager.reload()


def _say(message):
    """Print what every process would print alike: once, from process 0."""
    if distributed.is_main_process():
        print(message, flush=True)


def open_trackers(args, start: int) -> tracking.Trackers:
    """--report-to's trackers, resumed at `start` (process 0 only; the others log nothing)."""
    if not distributed.is_main_process():
        return tracking.Trackers([])
    logging_dir = args.logging_dir or (str(Path(args.ckpt_dir) / "tensorboard") if args.ckpt_dir else None)
    return tracking.open_trackers(args.report_to, start=start, metrics_file=args.metrics_file,
                                  logging_dir=logging_dir)


def make_eval_loss(method: Method, batch_size: int, mesh):
    """params -> the objective's loss over the whole eval split (sums and weights over chunks of
    `batch_size` rows, divided once: the token mean for sft, the pair mean for dpo)."""
    import jax

    from tunix_nb import parallel

    objective = jax.jit(method.eval_objective or method.objective)
    rows = method.eval_rows
    n_rows = len(next(iter(rows.values())))

    def eval_loss(params) -> float:
        params = parallel.gather(params) if mesh is not None else params
        total = weight = 0.0
        for lo in range(0, n_rows, batch_size):
            loss_sum, chunk_weight, _ = objective(params, {k: v[lo:lo + batch_size] for k, v in rows.items()},
                                                  method.frozen)
            total, weight = total + float(loss_sum), weight + float(chunk_weight)
        return total / weight

    return eval_loss


class BestCheckpoint:
    """The best checkpoint by eval loss, in <ckpt_dir>/best: its own Orbax manager, keeping one.

    A separate manager, not Orbax's `best_fn` on the run's: that one would keep the best N
    instead of the newest N, and --keep and resuming rely on the newest. A resumed run reads
    the best eval loss so far from its meta and replaces it only with a lower one.
    """

    def __init__(self, ckpt_dir, *, async_save: bool):
        from tunix_nb import checkpoint

        self.manager = checkpoint.make_manager(Path(ckpt_dir) / "best", keep=1, save_every=1, async_save=async_save)
        meta = checkpoint.newest_readable_meta(self.manager)
        self.eval_loss = float("inf") if meta is None else float(meta["eval_loss"])

    def offer(self, step: int, eval_loss: float, **state) -> bool:
        """Save `state` (checkpoint.save's arguments) at `step` if `eval_loss` is the lowest yet."""
        from tunix_nb import checkpoint

        latest = self.manager.latest_step()
        if not eval_loss < self.eval_loss or (latest is not None and step <= latest):
            return False  # (a step at or before the best's: a resumed run's replay, which can only tie)
        state["meta"] = {**state["meta"], "eval_loss": eval_loss}
        checkpoint.save(self.manager, step, force=True, **state)
        self.eval_loss = eval_loss
        return True

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def train_with_saves(args, config, method, step_fn, opt_state, start, manager, trackers, mesh, run_key):
    """Train from `start` to --stop-after or --steps, saving every --save-every steps and evaluating
    every --eval-every steps; -> (params, step)."""
    import jax

    from tunix_nb import checkpoint

    evaluate = make_eval_loss(method, config.batch_size, mesh) if args.eval_every else None
    best = BestCheckpoint(args.ckpt_dir, async_save=not args.sync_save) if evaluate and manager else None
    pending = {}  # an evaluating step's record, logged once its eval loss is in

    def log(step, record):
        if evaluate is not None and step % args.eval_every == 0:
            pending[step] = record
        else:
            trackers.log(record)

    rollout_fn = None if method.make_rollout is None else method.make_rollout(args.parallel, mesh)
    params, step = method.params, start
    stop = config.steps if args.stop_after is None else args.stop_after
    while step < stop:  # run to the next save (or eval) point, save (in the background), repeat
        chunk = min(args.save_every - step % args.save_every, stop - step,
                    args.eval_every - step % args.eval_every if evaluate else stop)
        params, opt_state = _train_chunk(args, config, method, step_fn, params, opt_state, rollout_fn, step, chunk,
                                         log, mesh)
        step += chunk
        state = dict(params=params, opt_state=opt_state, rng=jax.random.fold_in(run_key, step),
                     meta={"config": config.record(), "seed": config.seed})
        if manager is not None:
            checkpoint.save(manager, step, force=step == stop, **state)
        if step in pending:
            record = {**pending.pop(step), "eval/loss": evaluate(params)}
            trackers.log(record)
            if best is not None:
                best.offer(step, record["eval/loss"], **state)
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    if best is not None:
        best.close()
    return params, step


def _train_chunk(args, config, method, step_fn, params, opt_state, rollout_fn, step, chunk, log, mesh):
    """`chunk` steps from `step`: -> (params, opt_state)."""
    from tunix_nb import train

    # under pmap train.run hands back one (unreplicated) copy; on a mesh the state stays
    # placed, and every process saves its own shards of it
    common = dict(steps=chunk, start_step=step, parallel_mode=args.parallel,
                  progress=sys.stderr.isatty() and distributed.is_main_process(), on_step=log,
                  desc=f"{config.command} {step}->{step + chunk}", keep_placement=mesh is not None)
    if rollout_fn is None:
        params, opt_state, _ = train.run(step_fn, params, opt_state, batch_source(method, config, mesh),
                                         frozen=method.frozen, **common)
    else:  # on-policy: each step samples its batch with the current params
        params, opt_state, _ = train.run_on_policy(step_fn, params, opt_state, rollout_fn,
                                                   num_iterations=config.num_iterations, reference=method.reference,
                                                   frozen=method.frozen, **common)
    return params, opt_state


def batch_source(method: Method, config: RunConfig, mesh):
    """step -> this process's rows of the step's batch: `data.batch_at`'s examples, a pure
    function of (--seed, step), packed into `method.packing.num_rows` rows with --packing."""
    from tunix_nb import data, packing

    if method.packing is None:
        my_rows = _process_rows(mesh, config.batch_size)
        return lambda k: data.batch_at(method.rows, k, config.batch_size, seed=config.seed, rows=my_rows)
    my_rows = _process_rows(mesh, method.packing.num_rows) or slice(None)

    def packed_batch(k):  # every process packs the global batch, then keeps its rows
        batch, _ = packing.packed_batch_at(method.rows, k, config.batch_size, seed=config.seed, cfg=method.packing)
        return {key: rows[my_rows] for key, rows in batch.items()}

    return packed_batch


def packing_of(config: RunConfig, rows: dict, parallel_mode: str):
    """--packing: the packing.PackingConfig of every step (None without it). Rows as long as the
    unpacked ones; as many as the run's fullest step needs (`packing.rows_needed`), rounded
    up to a multiple of the devices x --grad-accum so that every batch splits evenly: a pure
    function of the run's data and flags, so a resumed run packs as it did."""
    if not config.data.packing:
        return None
    import jax

    from tunix_nb import packing

    cfg = packing.PackingConfig(max_length=int(rows["inputs"].shape[1]))
    needed = packing.rows_needed(rows, steps=config.steps, batch_size=config.batch_size, seed=config.seed, cfg=cfg)
    multiple = (1 if parallel_mode == "jit" else jax.device_count()) * config.training.grad_accum
    return dataclasses.replace(cfg, num_rows=-(-needed // multiple) * multiple)


def _process_rows(mesh, batch_size):
    """This process's share of every global batch: all of it, unless several processes run."""
    from tunix_nb import parallel

    return parallel.process_rows(mesh, batch_size) if mesh is not None else None


def export_folders(args, config: RunConfig, method: Method, params) -> None:
    """--export-hf: a Hugging Face folder (LoRA merged, the source's config fields and tokenizer
    files); --export-adapter: the LoRA adapters as a PEFT adapter folder."""
    from flax import nnx

    from tunix_nb import hf, peft_adapter

    if not (args.export_hf or args.export_adapter):
        return
    graphdef, plain = method.exportable(params) if method.exportable is not None else (method.graphdef, params)
    model_config = nnx.merge(graphdef, plain).cfg
    if args.export_hf:
        hf.save_pretrained(args.export_hf, graphdef, plain, model_config, source=config.model_dir,
                           dtype=args.export_dtype or config.source.dtype, max_shard_size=args.max_shard_size)
        _say(f"Wrote a Hugging Face checkpoint to {args.export_hf}")
    if args.export_adapter:
        peft_adapter.save_adapter(args.export_adapter, params, model_config, alpha=method.lora_alpha,
                                  base_model_name_or_path=config.source.model or config.model,
                                  revision=config.source.revision)
        _say(f"Wrote a PEFT LoRA adapter to {args.export_adapter}")


def start_jax(args) -> None:
    """Fix the device count, share compiled programs across runs (the persistent
    compilation cache) and join the other processes: all before JAX starts."""
    if args.devices:
        devices.simulate_cpu_devices(args.devices)
    devices.use_compile_cache()
    if args.distributed:  # jax.devices() then lists every process's devices
        distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               heartbeat_timeout_s=args.heartbeat_timeout)


def prepare(args):
    """(config, manager, method, step_fn, opt_state, start step, mesh, run key): everything up to
    the first step, checked, with the state restored from --ckpt-dir when it holds this run."""
    import jax

    from tunix_nb import parallel, train

    config = resolve_config(args)
    check_devices(config, args.parallel)
    manager = open_checkpoints(args, config)  # checked first: a clash changes nothing
    method = build_method(config, with_eval=args.eval_every is not None)
    n_rows = len(next(iter(method.rows.values())))
    if config.batch_size > n_rows:
        raise FlagError(f"--batch-size {config.batch_size} is larger than the {n_rows} training examples")
    method.packing = packing_of(config, method.rows, args.parallel)
    if method.packing is not None:
        _say(f"--packing: each step's {config.batch_size} examples in {method.packing.num_rows} rows of "
             f"{method.packing.max_length} tokens")
    updates = config.num_iterations  # grpo: the schedule counts updates, mu per step
    optimizer = train.make_optimizer(train.OptimizerConfig(
        learning_rate=config.training.learning_rate, warmup_steps=config.training.warmup_steps * updates,
        total_steps=config.steps * updates))
    mesh = parallel.make_mesh() if args.parallel in MESH_CHOICES else None  # every process's devices
    step_fn = train.make_step(method.objective, optimizer, parallel_mode=args.parallel, donate=True, mesh=mesh,
                              grad_accum=config.training.grad_accum)
    run_key = jax.random.key(config.seed)
    method.params, opt_state, start = resume(manager, args, method.params, optimizer.init(method.params),
                                             run_key, mesh)
    return config, manager, method, step_fn, opt_state, start, mesh, run_key


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    usage = command_parser(parser, args.command)
    try:
        check_flags(args)
    except FlagError as err:
        usage.error(str(err))
    start_jax(args)
    import jax

    from tunix_nb import checkpoint, rewards

    try:
        config, manager, method, step_fn, opt_state, start, mesh, run_key = prepare(args)
    except FlagError as err:
        usage.error(str(err))
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    trackers = open_trackers(args, start)
    try:
        params, step = train_with_saves(args, config, method, step_fn, opt_state, start, manager, trackers,
                                        mesh, run_key)
    except rewards.RewardError as err:  # a reward function went wrong mid-run: its message names it
        print(f"error: --rewards / --reward-funcs: {err}. The checkpoints saved so far are kept.", file=sys.stderr)
        return 2
    finally:
        trackers.close()
    if step < config.steps:
        _say(f"Stopped after step {step} of {config.steps} (--stop-after); run the same command "
             "without it to resume.")
    else:
        if args.export_params:  # with LoRA: the adapters merged into the base, a plain model
            if method.exportable is not None:
                _, params = method.exportable(params)
            checkpoint.export_params(params, args.export_params, step=step,
                                     meta={"model": config.model, "config": config.record()})
        export_folders(args, config, method, params)
        _say(f"Done: {config.command} {config.model}, {config.steps} steps"
             + (f", {jax.process_count()} processes." if jax.process_count() > 1 else "."))
    if args.distributed:  # leave together: waits for the other processes to finish too
        distributed.shutdown()
    return 0
