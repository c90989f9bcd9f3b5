"""`python -m tunix_nb.train`: SFT, distillation, DPO and GRPO from the command line, resumable.

It saves the training state with Orbax every --save-every steps (in the background),
and resumes on its own from the newest checkpoint in --ckpt-dir, to exactly the run an
uninterrupted one would have been: same parameters, bit for bit, on the same device
count. It refuses (leaving the checkpoints untouched) when that run's config differs
from the flags given.

Resuming, in detail:
- Batches are a pure function of (--seed, step), and no step draws random numbers, so
  the step is the whole data/RNG state. GRPO's rollouts and on-policy distillation's
  batches (distill --lmbda) do sample, with keys that are a pure function of (--seed,
  step, row) (`grpo.rollout_keys`; `gkd.batch_source` for which steps sample), so the
  same holds. Each
  checkpoint also holds the run key folded with its step (item `rng`), which the
  resumed run checks against its own.
- A save killed midway leaves `<step>.orbax-checkpoint-tmp`, which is not a checkpoint;
  the resumed run ignores it and Orbax replaces it when it saves that step again.
- If the newest checkpoint is damaged, the run warns (step and error), resumes from the
  one before, and renames the damaged one to `<step>.damaged-<time>` so that the step
  can be saved again. It prints the new name; nothing is deleted.
- Checkpoints hold one copy of the state, so a run may resume on another device count
  (--devices, --parallel): bit for bit the same state, replicated onto the new devices.

Several processes (a TPU pod slice, GPU hosts, or `python -m tunix_nb.launch` on one
machine) run the same command with --coordinator/--num-processes/--process-id (or
--distributed, to let JAX read them from the cluster) and --parallel dp, fsdp or
shard_map: each process loads only its share of every batch, they save checkpoints
together into one --ckpt-dir (shared storage), and process 0 prints and writes the
metrics file.

`main` is a few named steps over a `RunConfig`: resolve the config, open (and check) the
checkpoint directory, build the method, resume, train with saves. `tunix_nb.preempt`
runs this CLI and SIGKILLs it mid-run (tests and notebook 05).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import warnings
from pathlib import Path

from tunix_nb import devices, distributed  # neither starts JAX on import

# train.PARALLEL_MODES, spelled out: the parser is built before JAX may start.
PARALLEL_CHOICES = ("jit", "pmap", "shard_map", "dp", "fsdp")
MESH_CHOICES = ("shard_map", "dp", "fsdp")  # parallel.MESH_MODES: the strategies that span processes
COMMANDS = ("sft", "distill", "dpo", "grpo")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")  # as tunix_nb.losses.DPO_LOSS_TYPES, without importing JAX
# as tunix_nb.losses.ADVANTAGE_ESTIMATORS, GRPO_AGGREGATIONS, KL_ESTIMATORS, and grpo.REWARD_FUNCTIONS
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "drgrpo")
GRPO_AGGREGATIONS = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-scale",
                     "sequence-mean-token-sum-norm")
KL_ESTIMATORS = ("kl", "mse_kl", "low_var_kl")
REWARD_NAMES = ("exact_match", "char_match", "well_formed")
# GRPO's defaults, as TRL's and Tunix's where they agree (beta 0.04, epsilon 0.2, G 8 as TRL)
GRPO_DEFAULTS = {"group_size": 8, "beta": 0.04, "epsilon": 0.2, "advantage": "grpo",
                 "aggregation": "sequence-mean-token-mean", "kl_estimator": "low_var_kl", "num_iterations": 1,
                 "temperature": 1.0, "max_new_tokens": 8, "rewards": "exact_match,char_match"}
# Flags that define a run: resuming with other values would be a different run.
RUN_DEFINING = ("command", "model", "teacher", "init_from", "beta", "loss_type", "sft_weight",
                "length_normalize", "steps", "batch_size", "seed", "learning_rate", "warmup_steps",
                "compute_dtype", "group_size", "epsilon", "epsilon_high", "advantage", "aggregation",
                "kl_estimator", "num_iterations", "temperature", "max_new_tokens", "rewards",
                "lora_rank", "lora_alpha", "lora_targets", "quantize", "grad_accum", "lmbda", "seq_kd")
# as tunix_nb.lora.QUANTIZE and DEFAULT_TARGETS, without importing JAX
QUANTIZE_CHOICES = ("none", "nf4", "int8")
LORA_DEFAULT_TARGETS = r".*(attn/(q|k|v|out)|mlp/(gate|up|down))"
LORA_COMMANDS = ("sft", "dpo", "grpo")
DEFAULT_LEARNING_RATE = {"sft": 3e-3, "distill": 3e-3, "dpo": 1e-3, "grpo": 3e-4}
LORA_FLAGS = ("lora_rank", "lora_alpha", "lora_targets", "quantize")
GRPO_FLAGS = ("group_size", "epsilon", "epsilon_high", "advantage", "aggregation", "kl_estimator",
              "num_iterations", "temperature", "max_new_tokens", "rewards")
# the sampling flags both on-policy methods share
SAMPLING_FLAGS = ("temperature", "max_new_tokens")
GKD_FLAGS = ("lmbda", "seq_kd")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")


def _positive_float(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be greater than 0")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds '(default: x)' only where the help does not say it and the default is a value."""

    def _get_help_string(self, action):
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tunix_nb.train", description=__doc__.splitlines()[0],
        formatter_class=_HelpFormatter,
        epilog="Resume an interrupted run by repeating its command: it continues from the newest "
               "checkpoint in --ckpt-dir.")
    for add_flags in (_add_method_flags, _add_grpo_flags, _add_gkd_flags, _add_peft_flags, _add_training_flags,
                      _add_process_flags):
        add_flags(parser)
    return parser


def _add_method_flags(parser: argparse.ArgumentParser) -> None:
    """The command, the models, and the DPO flags."""
    parser.add_argument("command", choices=COMMANDS,
                        help="what to train: sft (supervised fine-tuning), distill (from a teacher), "
                             "dpo (preference pairs, from an SFT checkpoint) or grpo (reinforcement "
                             "learning with verifiable rewards, from an SFT checkpoint)")
    parser.add_argument("--model", help="model preset: tiny, student or teacher (default: student; "
                        "dpo, grpo: the preset of the --init-from checkpoint)")
    parser.add_argument("--teacher", help="distill: the teacher's checkpoint directory "
                        "(default: the teacher shipped in data/teacher)")
    parser.add_argument("--init-from", help="dpo, grpo: the SFT checkpoint the policy and the frozen reference "
                        "start from (default: the SFT student shipped in data/sft_student); distill: the "
                        "checkpoint the student starts from (default: a fresh model)")
    parser.add_argument("--beta", type=_non_negative_float,
                        help="dpo: strength of the pull towards the reference, > 0 (default: 0.1); grpo: "
                             "weight of the KL penalty to the reference, 0 for none (default: 0.04); distill: "
                             "the divergence, 0 forward KL, 1 reverse KL, between the generalized JSD (default: 0)")
    parser.add_argument("--loss-type", choices=DPO_LOSS_TYPES,
                        help="dpo: sigmoid (DPO), ipo or hinge (SLiC) (default: sigmoid)")
    parser.add_argument("--sft-weight", type=_non_negative_float,
                        help="dpo: weight of an SFT term on the chosen answers (RPO) (default: 0)")
    parser.add_argument("--length-normalize", action="store_true", default=None,
                        help="dpo: compare per-token mean log-probs instead of sums (what IPO wants)")


def _add_grpo_flags(parser: argparse.ArgumentParser) -> None:
    """GRPO's flags."""
    grpo = parser.add_argument_group(
        "grpo", "group relative policy optimisation: each step samples --group-size completions for each "
        "of --batch-size prompts, scores them, and updates --num-iterations times on them")
    grpo.add_argument("--group-size", type=_positive_int,
                      help=f"completions per prompt, G >= 2 (default: {GRPO_DEFAULTS['group_size']})")
    grpo.add_argument("--epsilon", type=_positive_float,
                      help=f"clip range of the ratio, below 1 (default: {GRPO_DEFAULTS['epsilon']})")
    grpo.add_argument("--epsilon-high", type=_positive_float,
                      help="clip range above 1 (DAPO's clip-higher) (default: --epsilon)")
    grpo.add_argument("--advantage", choices=ADVANTAGE_ESTIMATORS,
                      help="group advantage: grpo (std-normalised), rloo (leave-one-out) or drgrpo "
                           "(no std) (default: grpo)")
    grpo.add_argument("--aggregation", choices=GRPO_AGGREGATIONS,
                      help="how token losses become the loss (default: sequence-mean-token-mean, TRL's grpo; "
                           "token-mean is DAPO's, sequence-mean-token-scale Dr. GRPO's)")
    grpo.add_argument("--kl-estimator", choices=KL_ESTIMATORS,
                      help="per-token KL estimate: kl (k1), mse_kl (k2), low_var_kl (k3) (default: low_var_kl)")
    grpo.add_argument("--num-iterations", type=_positive_int,
                      help="updates per rollout batch, Tunix's num_iterations (mu) (default: 1)")
    grpo.add_argument("--temperature", type=_positive_float,
                      help=f"sampling temperature, > 0 (default: {GRPO_DEFAULTS['temperature']}; also distill "
                           "with --lmbda)")
    grpo.add_argument("--max-new-tokens", type=_positive_int,
                      help=f"tokens sampled per completion (default: {GRPO_DEFAULTS['max_new_tokens']}; also "
                           "distill with --lmbda or --seq-kd)")
    grpo.add_argument("--rewards",
                      help=f"comma-separated reward functions, summed: {', '.join(REWARD_NAMES)} "
                           f"(default: {GRPO_DEFAULTS['rewards']})")


def _add_gkd_flags(parser: argparse.ArgumentParser) -> None:
    """On-policy distillation's flags."""
    gkd = parser.add_argument_group(
        "on-policy distillation (distill; GKD, as TRL's GKDTrainer)", "batches whose completions the student "
        "samples itself (--temperature, --max-new-tokens), scored by the teacher with --beta's divergence")
    gkd.add_argument("--lmbda", type=_non_negative_float,
                     help="share of steps whose batch the student samples, in [0, 1] (default: 0, offline)")
    gkd.add_argument("--seq-kd", action="store_true", default=None,
                     help="the other steps train on the teacher's greedy answers instead of the dataset's")


def _add_peft_flags(parser: argparse.ArgumentParser) -> None:
    """LoRA and QLoRA's flags."""
    peft = parser.add_argument_group(
        "LoRA / QLoRA (sft, dpo, grpo): train low-rank adapters on a frozen base; checkpoints hold the "
        "adapters and their optimizer state, --export-params the merged model")
    peft.add_argument("--lora-rank", type=_positive_int, help="train LoRA adapters of this rank instead of "
                      "every parameter (default: off, full fine-tuning)")
    peft.add_argument("--lora-alpha", type=_positive_float,
                      help="the adapters' scale is alpha / rank (default: the rank, as Tunix's examples)")
    peft.add_argument("--lora-targets", help="regex of the layers that get adapters "
                      f"(default: {LORA_DEFAULT_TARGETS.replace('%', '%%')}, every projection)")
    peft.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                      help="store the frozen base quantised: nf4 is QLoRA (default: none)")


def _add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The optimizer, the loop, checkpoints and devices."""
    parser.add_argument("--steps", type=_positive_int, default=300,
                        help="total training steps (grpo: rollouts, each followed by --num-iterations updates)")
    parser.add_argument("--batch-size", type=_positive_int, default=64,
                        help="global batch size (examples, pairs for dpo, prompts for grpo), split over the devices")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial params and the data order")
    parser.add_argument("--learning-rate", type=_positive_float,
                        help="peak learning rate (default: 3e-3; dpo: 1e-3; grpo: 3e-4)")
    parser.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: 10%% of --steps, at most "
                        "20; grpo: counted in rollouts, the schedule in updates)")
    parser.add_argument("--grad-accum", type=_positive_int, default=1,
                        help="split each device's share of the batch into K micro-batches, summed and divided "
                             "once: the same update with one micro-batch's activations at a time")
    parser.add_argument("--remat", action="store_true",
                        help="rematerialise each block: keep only its input for the backward pass and "
                             "recompute the rest, trading about one more forward pass for activation memory "
                             "(the same update; a run may resume with or without it)")
    parser.add_argument("--compute-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: float32 on CPU, bfloat16 on TPU/GPU (params stay float32)")
    parser.add_argument("--ckpt-dir", help="where to save checkpoints; resumes from the newest one there")
    parser.add_argument("--save-every", type=_positive_int, default=50,
                        help="save every K steps (and at the last step), asynchronously")
    parser.add_argument("--keep", type=_positive_int, default=3, help="keep the newest N checkpoints")
    parser.add_argument("--sync-save", action="store_true",
                        help="block training while a checkpoint is written (default: write in the background)")
    parser.add_argument("--stop-after", type=_positive_int,
                        help="stop after this step, saving a checkpoint there, as if preempted; "
                             "run the same command again (without it) to resume")
    parser.add_argument("--devices", type=_positive_int,
                        help="on CPU, simulate N devices (per process, with several processes)")
    parser.add_argument("--parallel", choices=PARALLEL_CHOICES, default="jit",
                        help="jit: one device; pmap: data parallel, replicated state; shard_map: the pmap "
                             "step on a Mesh; dp: jit with a batch-sharded NamedSharding; fsdp: dp with "
                             "params and optimizer state sharded too. Checkpoints restore under any of them")


def _add_process_flags(parser: argparse.ArgumentParser) -> None:
    """Several processes, metrics and export."""
    group = parser.add_argument_group(
        "several processes", "one process per host (python -m tunix_nb.launch starts them on one machine); "
        "needs --parallel dp, fsdp or shard_map")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0, where JAX's coordination service listens")
    group.add_argument("--num-processes", type=_positive_int, help="how many processes take part")
    group.add_argument("--process-id", type=int, help="this process's index, 0 ... --num-processes - 1")
    group.add_argument("--distributed", action="store_true",
                       help="join a multi-process run whose coordinator, process count and index JAX "
                            "detects (Cloud TPU pod slice, SLURM, Open MPI, Kubernetes)")
    group.add_argument("--heartbeat-timeout", type=_positive_int, default=distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
                       help="seconds after which a silent process counts as dead and the others stop")
    parser.add_argument("--metrics-file", help="write one JSON line per step (step, loss, ...)")
    parser.add_argument("--export-params", help="at the end, also write a params-only checkpoint here")


def _check_flags(parser, args) -> None:
    """Flag combinations argparse cannot check on its own; fills in per-command defaults."""
    only = {"teacher": ("distill",), "init_from": ("dpo", "grpo", "distill"), "beta": ("dpo", "grpo", "distill"),
            "loss_type": ("dpo",), "sft_weight": ("dpo",), "length_normalize": ("dpo",),
            **{name: ("grpo",) for name in GRPO_FLAGS}, **{name: ("grpo", "distill") for name in SAMPLING_FLAGS},
            **{name: ("distill",) for name in GKD_FLAGS}}
    for name, commands in only.items():
        if getattr(args, name) is not None and args.command not in commands:
            listed = " and ".join(filter(None, [", ".join(commands[:-1]), commands[-1]]))
            parser.error(f"--{name.replace('_', '-')} applies only to {listed}, not {args.command}")
    _check_lora_flags(parser, args)
    if args.command == "dpo" and args.beta is not None and not args.beta > 0:
        parser.error(f"argument --beta: {args.beta} must be greater than 0")
    if args.command == "grpo":
        _check_grpo_flags(parser, args)
    if args.command == "distill":
        _check_distill_flags(parser, args)
    if args.command == "dpo":
        args.beta = 0.1 if args.beta is None else args.beta
        args.loss_type = args.loss_type or "sigmoid"
        args.sft_weight = 0.0 if args.sft_weight is None else args.sft_weight
        args.length_normalize = bool(args.length_normalize)
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATE[args.command]
    if args.warmup_steps is None:
        args.warmup_steps = min(20, args.steps // 10)
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps} must be >= 0 and below --steps {args.steps}")
    if args.stop_after is not None and args.stop_after > args.steps:
        parser.error(f"--stop-after {args.stop_after} is beyond --steps {args.steps}")
    if args.stop_after is not None and not args.ckpt_dir:
        parser.error("--stop-after needs --ckpt-dir: the run saves a checkpoint there to resume from")
    given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
             "--process-id": args.process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            parser.error(f"several processes need all of --coordinator, --num-processes and --process-id; "
                         f"missing {', '.join(missing)} (or use --distributed on a cluster JAX detects)")
        if not 0 <= args.process_id < args.num_processes:
            parser.error(f"--process-id {args.process_id} must be in 0 ... {args.num_processes - 1}")
        args.distributed = True
    if args.distributed and args.command == "grpo":
        parser.error("grpo runs in one process (its rewards are computed on one host); drop --distributed "
                     "and the process flags, and use --devices with any --parallel")
    if args.distributed and args.command == "distill" and (args.lmbda or args.seq_kd):
        parser.error("on-policy distillation (--lmbda, --seq-kd) runs in one process (its batches are sampled "
                     "on one host); drop --distributed and the process flags, and use --devices with any --parallel")
    if args.distributed and args.parallel not in MESH_CHOICES:
        parser.error(f"--parallel {args.parallel} runs within one process; with several processes use "
                     f"one of {', '.join(MESH_CHOICES)}")


def _check_lora_flags(parser, args) -> None:
    """LoRA's flags need --lora-rank and a command that takes them; fill in their defaults."""
    given = [f"--{n.replace('_', '-')}" for n in ("lora_alpha", "lora_targets", "quantize")
             if getattr(args, n) is not None]
    if args.lora_rank is None:
        if given:
            parser.error(f"{', '.join(given)} need(s) --lora-rank: LoRA is off without it")
        return
    if args.command not in LORA_COMMANDS:
        parser.error(f"--lora-rank applies only to {', '.join(LORA_COMMANDS)}, not {args.command}")
    if args.distributed or args.coordinator is not None:
        parser.error("--lora-rank runs in one process: drop --distributed and the process flags, and use "
                     "--devices with any --parallel")
    args.lora_alpha = float(args.lora_rank) if args.lora_alpha is None else args.lora_alpha
    args.lora_targets = args.lora_targets or LORA_DEFAULT_TARGETS
    try:
        re.compile(args.lora_targets)
    except re.error as err:
        parser.error(f"--lora-targets {args.lora_targets!r} is not a regular expression ({err})")
    args.quantize = args.quantize or "none"


def _check_distill_flags(parser, args) -> None:
    """GKD's flags: in range, and the sampling ones only where something is sampled. Offline
    distillation (lmbda 0, beta 0, no seq_kd) leaves them all None: today's run, as before."""
    if args.lmbda is not None and args.lmbda > 1:
        parser.error(f"argument --lmbda: {args.lmbda} is a share of steps, in [0, 1]")
    if args.beta is not None and args.beta > 1:
        parser.error(f"argument --beta: {args.beta} must be in [0, 1] for distill (0 forward KL, 1 reverse KL)")
    lmbda, seq_kd, beta = args.lmbda or 0.0, bool(args.seq_kd), args.beta or 0.0
    if args.temperature is not None and lmbda == 0:
        parser.error("--temperature samples the student's batches: it needs --lmbda > 0")
    if args.max_new_tokens is not None and lmbda == 0 and not seq_kd:
        parser.error("--max-new-tokens needs --lmbda > 0 or --seq-kd: offline distillation samples nothing")
    if lmbda == 0 and not seq_kd and beta == 0:
        args.lmbda = args.seq_kd = args.beta = None  # offline distillation, described as before
        return
    args.lmbda, args.seq_kd, args.beta = float(lmbda), seq_kd, float(beta)
    if lmbda > 0 or seq_kd:
        args.max_new_tokens = args.max_new_tokens or GRPO_DEFAULTS["max_new_tokens"]
    if lmbda > 0:
        args.temperature = args.temperature or GRPO_DEFAULTS["temperature"]


def _check_grpo_flags(parser, args) -> None:
    """Fill in GRPO's defaults, and refuse settings that cannot train."""
    for name, default in GRPO_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.group_size < 2:
        parser.error(f"--group-size {args.group_size} must be at least 2: an advantage compares a completion "
                     "with the other completions of its prompt")
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    unknown = [n for n in names if n not in REWARD_NAMES]
    if not names or unknown or len(set(names)) != len(names):
        parser.error(f"--rewards {args.rewards!r}: give distinct names from {', '.join(REWARD_NAMES)}, "
                     "separated by commas")
    args.rewards = ",".join(names)


class RunError(Exception):
    """A run that cannot start as asked: printed as `error: ...`, exit status 2, nothing changed."""


class FlagError(RunError):
    """Flags that cannot make a run: reported like argparse's own errors, with the usage."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What defines a run, with every default resolved. Saved in each checkpoint's meta:
    resuming with other values would be a different run (`RUN_DEFINING`)."""

    command: str
    model: str
    teacher: str | None
    init_from: str | None
    beta: float | None
    loss_type: str | None
    sft_weight: float | None
    length_normalize: bool | None
    steps: int
    batch_size: int
    seed: int
    learning_rate: float
    warmup_steps: int
    compute_dtype: str
    grad_accum: int = 1
    remat: bool = False  # how the step computes, not what: not run-defining
    # grpo only (None for the other commands)
    group_size: int | None = None
    epsilon: float | None = None
    epsilon_high: float | None = None
    advantage: str | None = None
    aggregation: str | None = None
    kl_estimator: str | None = None
    num_iterations: int | None = None
    temperature: float | None = None
    max_new_tokens: int | None = None
    rewards: str | None = None
    # distill's on-policy batches (GKD; None: offline distillation)
    lmbda: float | None = None
    seq_kd: bool | None = None
    # LoRA / QLoRA (None: every parameter trains)
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: str | None = None
    quantize: str | None = None

    def clashes_with(self, saved: dict) -> dict:
        """{field: (saved, given)} for every run-defining field that differs from a saved config."""
        given = dataclasses.asdict(self)
        # a field newer than the checkpoint counts as its default (the run it describes used it)
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.default is not dataclasses.MISSING}
        saved = {k: saved.get(k, defaults.get(k)) for k in RUN_DEFINING}
        return {k: (saved[k], given[k]) for k in RUN_DEFINING if saved[k] != given[k]}


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


def resolve_config(args) -> RunConfig:
    """The run's config from the flags: the model preset and the checkpoints it starts from."""
    from tunix_nb import checkpoint, data, devices, model

    teacher = init_from = None
    preset = args.model
    if args.command == "distill":
        teacher = args.teacher or str(data.DATA_DIR / "teacher")
    if args.command in ("dpo", "grpo") or args.init_from:
        init_from = args.init_from or str(data.DATA_DIR / "sft_student")
        try:
            init_model = checkpoint.model_preset(checkpoint.load_meta(init_from), "The --init-from checkpoint")
        except FileNotFoundError:
            raise FlagError(f"--init-from {init_from}: no checkpoint there; train one with "
                           f"`python -m tunix_nb.train sft --ckpt-dir {init_from}` first")
        if preset is not None and preset != init_model:
            raise FlagError(f"--model {preset!r} differs from the --init-from checkpoint's model "
                           f"{init_model!r}; leave --model out")
        preset = init_model
    preset = preset or "student"
    if preset not in model.PRESETS:
        raise FlagError(f"--model {preset!r} is not a preset; choose one of {sorted(model.PRESETS)}")
    compute_dtype = (devices.defaults_for().compute_dtype if args.compute_dtype == "auto"
                     else args.compute_dtype)
    return RunConfig(command=args.command, model=preset, teacher=teacher, init_from=init_from,
                     beta=args.beta, loss_type=args.loss_type, sft_weight=args.sft_weight,
                     length_normalize=args.length_normalize, steps=args.steps, batch_size=args.batch_size,
                     seed=args.seed, learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
                     compute_dtype=compute_dtype, grad_accum=args.grad_accum, remat=args.remat,
                     **{name: getattr(args, name) for name in GRPO_FLAGS if args.command == "grpo"},
                     **{name: getattr(args, name) for name in SAMPLING_FLAGS + GKD_FLAGS
                        if args.command == "distill"},
                     **{name: getattr(args, name) for name in LORA_FLAGS})


def check_devices(config: RunConfig, parallel_mode: str) -> None:
    import jax

    n_devices = 1 if parallel_mode == "jit" else jax.device_count()
    if config.batch_size % n_devices:
        raise FlagError(f"--batch-size {config.batch_size} does not divide by the {n_devices} devices; "
                       f"use a multiple of {n_devices}")
    rows = config.batch_size * (config.group_size or 1)  # grpo trains on every completion
    if rows % (n_devices * config.grad_accum):
        raise FlagError(f"--grad-accum {config.grad_accum}: the {rows // n_devices} rows per device do not "
                       f"divide into {config.grad_accum} micro-batches; use a --batch-size whose rows per "
                       f"device are a multiple of {config.grad_accum}")


def open_checkpoints(args, config: RunConfig):
    """The run's CheckpointManager (None without --ckpt-dir), refusing one that holds another run."""
    from tunix_nb import checkpoint

    if not args.ckpt_dir:
        return None
    manager = checkpoint.make_manager(args.ckpt_dir, keep=args.keep, save_every=args.save_every,
                                      async_save=not args.sync_save)
    saved = checkpoint.newest_readable_meta(manager)
    if saved is not None:
        clashes = config.clashes_with(saved.get("config", {}))
        if clashes:
            detail = ", ".join(f"{k}: saved {a!r}, given {b!r}" for k, (a, b) in clashes.items())
            raise RunError(f"--ckpt-dir {args.ckpt_dir} holds a different run ({detail}). "
                           "Use another --ckpt-dir, or the same flags to resume it. Nothing was changed.")
    return manager


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
    from tunix_nb import lora

    if config.lora_rank is None:
        return Trainable(graphdef, params)
    try:
        lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=config.lora_rank, alpha=config.lora_alpha,
                                                   targets=config.lora_targets, quantize=config.quantize,
                                                   seed=config.seed)
    except ValueError as err:  # targets that match nothing, a tile size that does not divide
        raise FlagError(f"--lora-targets / --quantize: {err}")
    return Trainable(lora_graphdef, adapters, base, config.lora_alpha)


def build_method(config: RunConfig) -> Method:
    """The model, data rows, objective and frozen parameters of `config.command`."""
    from tunix_nb import checkpoint, data, distill, dpo, gkd, grpo, lora, model, precision, rewards, sft
    from tunix_nb.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    graphdef, params = model.split(model.make_model(config.model, seed=config.seed, remat=config.remat))
    dtype = precision.resolve_compute_dtype(config.compute_dtype)
    if config.init_from:  # dpo, grpo: the policy and the reference start from the SFT checkpoint (distill: if given)
        params = checkpoint.params_into(params, checkpoint.load_params(config.init_from))
    t = trainable(config, graphdef, params)
    if config.command == "dpo":
        rows = data.preference_arrays(data.load_preferences(), tokenizer, data.DEFAULT_SEQ_LEN)
        # cached once: the reference never changes (with LoRA: the base, adapters switched off)
        rows = dpo.reference_log_probs(t.graphdef, t.reference(), rows, length_normalize=config.length_normalize,
                                       compute_dtype=dtype)
        objective = dpo.objective(t.graphdef, beta=config.beta, loss_type=config.loss_type,
                                  sft_weight=config.sft_weight, length_normalize=config.length_normalize,
                                  compute_dtype=dtype)
        return Method(t.graphdef, t.params, rows, t.objective(objective), frozen=t.frozen(), exportable=t.exportable)
    if config.command == "grpo":  # the SFT checkpoint stays as the reference
        examples = data.load_sft()
        reward_set = rewards.combine([grpo.REWARD_FUNCTIONS[n] for n in config.rewards.split(",")])
        objective = grpo.objective(t.graphdef, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
                                   beta=config.beta, kl_estimator=config.kl_estimator,
                                   aggregation=config.aggregation, compute_dtype=dtype)

        def make_rollout(parallel_mode, mesh):
            rollout_fn = grpo.make_rollout(
                t.graphdef, examples, reward_set, batch_size=config.batch_size, group_size=config.group_size,
                seed=config.seed, estimator=config.advantage, num_iterations=config.num_iterations,
                beta=config.beta, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                compute_dtype=dtype, parallel_mode=parallel_mode, mesh=mesh, tokenizer=tokenizer)
            # with LoRA the reference is the base itself: no second copy of the weights
            return lora.rollout(rollout_fn, with_reference=config.beta > 0) if t.lora else rollout_fn

        reference = t.params if config.beta > 0 and not t.lora else None
        return Method(t.graphdef, t.params, grpo.prompt_rows(examples, tokenizer), t.objective(objective),
                      frozen=t.frozen(), make_rollout=make_rollout, reference=reference, exportable=t.exportable)
    rows = data.sft_arrays(data.load_sft(), tokenizer, data.DEFAULT_SEQ_LEN)
    if config.command == "sft":
        return Method(t.graphdef, t.params, rows, t.objective(sft.objective(t.graphdef, compute_dtype=dtype)),
                      frozen=t.frozen(), exportable=t.exportable)
    teacher_graphdef, teacher_params = distill.load_teacher(config.teacher)
    objective = distill.objective(graphdef, teacher_graphdef, beta=config.beta or 0.0, compute_dtype=dtype)
    if not (config.lmbda or config.seq_kd):  # offline: the dataset's answers
        return Method(graphdef, params, rows, objective, frozen=teacher_params)

    def make_batches(parallel_mode, mesh):  # GKD: the student's samples, the teacher's answers
        return gkd.make_batches(graphdef, teacher_graphdef, data.load_sft(),
                                batch_size=config.batch_size, seed=config.seed, lmbda=config.lmbda,
                                seq_kd=config.seq_kd, temperature=config.temperature or 1.0,
                                max_new_tokens=config.max_new_tokens, compute_dtype=dtype,
                                parallel_mode=parallel_mode, mesh=mesh, tokenizer=tokenizer)

    return Method(graphdef, params, rows, objective, frozen=teacher_params, make_rollout=make_batches)


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


def open_metrics_file(args, start: int):
    """The metrics file, keeping the lines of steps already done (process 0 only; else None)."""
    if not args.metrics_file or not distributed.is_main_process():
        return None
    path = Path(args.metrics_file)
    kept = _read_metrics(path, start) if path.exists() and start > 0 else []
    path.write_text("".join(line + "\n" for line in kept))
    return path


def _read_metrics(path: Path, upto: int) -> list[str]:
    """The lines of steps <= upto; a line cut short by a kill is dropped."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= upto:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    return kept


def train_with_saves(args, config, method, step_fn, opt_state, start, manager, metrics_file, mesh, run_key):
    """Train from `start` to --stop-after or --steps, saving every --save-every steps; -> (params, step)."""
    import jax

    from tunix_nb import checkpoint, data, parallel, train

    # this process's share of every global batch: all of it, unless several processes run
    my_rows = parallel.process_rows(mesh, config.batch_size) if mesh is not None else None

    def batch_fn(step):
        return data.batch_at(method.rows, step, config.batch_size, seed=config.seed, rows=my_rows)

    def log(step, record):
        if metrics_file is not None:
            with metrics_file.open("a") as f:
                f.write(json.dumps(record) + "\n")

    rollout_fn = None if method.make_rollout is None else method.make_rollout(args.parallel, mesh)
    params = method.params
    progress = sys.stderr.isatty() and distributed.is_main_process()
    stop = config.steps if args.stop_after is None else args.stop_after
    step = start
    while step < stop:  # run to the next save point, save (in the background), repeat
        chunk = min(args.save_every - step % args.save_every, stop - step)
        # under pmap train.run hands back one (unreplicated) copy; on a mesh the state stays
        # placed, and every process saves its own shards of it
        common = dict(steps=chunk, start_step=step, parallel_mode=args.parallel, progress=progress, on_step=log,
                      desc=f"{config.command} {step}->{step + chunk}", keep_placement=mesh is not None)
        if rollout_fn is None:
            params, opt_state, _ = train.run(step_fn, params, opt_state, batch_fn, frozen=method.frozen, **common)
        else:  # on-policy: each step samples its batch with the current params
            params, opt_state, _ = train.run_on_policy(step_fn, params, opt_state, rollout_fn,
                                                       num_iterations=config.num_iterations or 1,
                                                       reference=method.reference, frozen=method.frozen, **common)
        step += chunk
        if manager is not None:
            checkpoint.save(manager, step, params=params, opt_state=opt_state,
                            meta={"config": dataclasses.asdict(config), "seed": config.seed},
                            rng=jax.random.fold_in(run_key, step), force=step == stop)
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    return params, step


def start_jax(args) -> None:
    """Fix the device count, share compiled programs across runs (the persistent
    compilation cache) and join the other processes: all before JAX starts."""
    if args.devices:
        devices.simulate_cpu_devices(args.devices)
    devices.use_compile_cache()
    if args.distributed:  # jax.devices() then lists every process's devices
        distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               heartbeat_timeout_s=args.heartbeat_timeout)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_flags(parser, args)
    start_jax(args)
    import jax

    from tunix_nb import checkpoint, parallel, train

    try:
        config = resolve_config(args)
        check_devices(config, args.parallel)
        manager = open_checkpoints(args, config)  # checked first: a clash changes nothing
        method = build_method(config)
        n_rows = len(next(iter(method.rows.values())))
        if config.batch_size > n_rows:
            raise FlagError(f"--batch-size {config.batch_size} is larger than the {n_rows} training examples")
        updates = config.num_iterations or 1  # grpo: the schedule counts updates, mu per step
        optimizer = train.make_optimizer(train.OptimizerConfig(
            learning_rate=config.learning_rate, warmup_steps=config.warmup_steps * updates,
            total_steps=config.steps * updates))
        mesh = parallel.make_mesh() if args.parallel in MESH_CHOICES else None  # every process's devices
        step_fn = train.make_step(method.objective, optimizer, parallel_mode=args.parallel, donate=True, mesh=mesh,
                                  grad_accum=config.grad_accum)
        run_key = jax.random.key(config.seed)
        method.params, opt_state, start = resume(manager, args, method.params, optimizer.init(method.params),
                                                 run_key, mesh)
    except FlagError as err:
        parser.error(str(err))
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    metrics_file = open_metrics_file(args, start)
    params, step = train_with_saves(args, config, method, step_fn, opt_state, start, manager, metrics_file,
                                    mesh, run_key)
    if step < config.steps:
        _say(f"Stopped after step {step} of {config.steps} (--stop-after); run the same command "
             "without it to resume.")
    else:
        if args.export_params:  # with LoRA: the adapters merged into the base, a plain model
            if method.exportable is not None:
                _, params = method.exportable(params)
            checkpoint.export_params(params, args.export_params, step=step,
                                     meta={"model": config.model, "config": dataclasses.asdict(config)})
        _say(f"Done: {config.command} {config.model}, {config.steps} steps"
             + (f", {jax.process_count()} processes." if jax.process_count() > 1 else "."))
    if args.distributed:  # leave together: waits for the other processes to finish too
        distributed.shutdown()
    return 0
