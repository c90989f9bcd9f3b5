"""The training command's second stage: the run's config, every default resolved.

`resolve_config` turns the checked flags into a `RunConfig`: the model (a preset, a Hugging
Face folder or a Hub id, fingerprinted), the checkpoint dpo and grpo start from, the compute
dtype and vocabulary chunks chosen for the backend, the training data's hash.
`RunConfig.record()` is what each checkpoint saves; a resume whose `RUN_DEFINING` values
differ from the saved ones is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tunix_nb import config_flags, data, distill, gkd, grpo, lora
from tunix_nb.cli.flags import (LORA_COMMANDS, METHOD_CONFIGS, FlagError, RunError, build_parser, check_flags,
                                check_schedule, parse_args)
from tunix_nb.gkd import GKDConfig
from tunix_nb.lora import LoRAConfig
from tunix_nb.train.config import (DEFAULT_MAX_LENGTH, DataConfig, MemoryConfig, ModelSourceConfig, TrainingConfig,
                                   steps_for_epochs)

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
    # run-defining fields a default rule chose, not a flag: resuming, the run's recorded value wins
    defaulted: tuple[str, ...] = ()

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

    def with_recorded(self, saved: dict) -> tuple[RunConfig, dict]:
        """(this config with each `defaulted` field set to the value a saved run config holds,
        {field: (today's default, recorded)} for those that differed): a default that changed since
        a run began does not make it another run."""
        config, adopted = self, {}
        for name in self.defaulted:
            today, recorded = self.record()[name], saved.get(name, OLDER_RUN_DEFAULTS.get(name))
            if recorded != today:
                part = next(p for p in ("source", "data", "training", "method") if hasattr(getattr(self, p), name))
                config = dataclasses.replace(config, **{part: dataclasses.replace(getattr(config, part),
                                                                                  **{name: recorded})})
                adopted[name] = (today, recorded)
        return config, adopted

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
    from tunix_nb import precision

    method = config_flags.from_args(METHOD_CONFIGS[args.command], args)
    model_name, model_dir, model_sha256 = resolve_model(args.model, args.revision)
    if args.command in ("dpo", "grpo") or getattr(args, "init_from", None):
        method = dataclasses.replace(method, init_from=_init_from(args, model_name, model_dir))
        model_name = model_name or _preset_of(method.init_from)
    model_name = model_name or "student"
    compute_dtype = args.compute_dtype
    if compute_dtype == "auto":  # as `precision.resolve_compute_dtype` reads it: a policy set in-process holds
        compute_dtype, reason = precision.auto_compute_dtype()
        print(f"--compute-dtype auto: {compute_dtype} ({reason})")
    if args.epochs is not None:
        _steps_from_epochs(args)
    training = config_flags.from_args(TrainingConfig, args, compute_dtype=compute_dtype,
                                      attention=resolve_attention(args, compute_dtype))
    dtype = param_dtype(args, model_dir, compute_dtype)
    lora_config, gkd_config, defaulted = LoRAConfig(), None, ()
    try:
        if args.command in LORA_COMMANDS:
            lora_config = config_flags.from_args(LoRAConfig, args).resolved()
        if args.command == "distill":
            gkd_config, beta = config_flags.from_args(GKDConfig, args).resolved(method.beta)
            method = dataclasses.replace(method, beta=beta, teacher=method.teacher or str(distill.TEACHER_DIR))
        if args.command == "grpo":
            method, defaulted = resolve_grpo(method, model_dir)
    except ValueError as err:
        raise FlagError(str(err))
    data_config, chosen_length = default_max_length(config_flags.from_args(DataConfig, args), method, model_dir)
    defaulted += chosen_length
    memory, chose = config_flags.from_args(MemoryConfig, args).resolved(vocab_size_of(model_name, model_dir))
    if chose:
        print(f"--vocab-chunk auto: {chose}")
    return RunConfig(command=args.command, model=model_name, training=training, method=method,
                     source=config_flags.from_args(ModelSourceConfig, args, model=args.model, dtype=dtype),
                     lora=lora_config, gkd=gkd_config, model_dir=model_dir and str(model_dir),
                     model_sha256=model_sha256, data=data_config, data_sha256=data_hash(data_config.train_file),
                     memory=memory, defaulted=defaulted + (("dtype",) if args.dtype == "auto" else ()))


def resolve_attention(args, compute_dtype: str) -> str:
    """--attention, "auto" resolved (`fused_attention.choose`); said on stdout when it picks the kernel."""
    from tunix_nb import fused_attention

    try:
        attention, why = fused_attention.choose(args.attention, compute_dtype=compute_dtype,
                                                one_device=args.parallel == "jit")
    except ValueError as err:
        raise FlagError(f"--attention: {err}")
    if args.attention == "auto" and attention == "splash":
        print(f"--attention auto: splash ({why})")
    if args.remat_policy == "save_attention" and attention != "splash":
        raise FlagError(f"--remat-policy save_attention keeps the splash kernel's output, and this run's attention "
                        f"is XLA's einsums ({why}): use --remat-policy full, or run splash attention "
                        "(one TPU computing in bfloat16)")
    return attention


def param_dtype(args, model_dir, compute_dtype: str) -> str:
    """--dtype, "auto" resolved: a Hugging Face model's frozen LoRA base in bfloat16 where the step
    computes in bfloat16 (an accelerator with native bfloat16), else float32 (full fine-tuning keeps
    float32 weights, so AdamW never updates bfloat16 ones; the presets stay as they were)."""
    if args.dtype != "auto":
        return args.dtype
    frozen_base = getattr(args, "lora_rank", None) is not None and model_dir is not None
    if frozen_base and compute_dtype == "bfloat16":
        print("--dtype auto: bfloat16 (the frozen base under --lora-rank, where the step computes in bfloat16: "
              "half the memory; the adapters stay float32)")
        return "bfloat16"
    if model_dir is not None:
        why = "full fine-tuning: AdamW updates float32 weights" if not frozen_base else "the step computes in float32"
        print(f"--dtype auto: float32 ({why})")
    return "float32"


def resolve_grpo(method, model_dir) -> tuple[object, tuple[str, ...]]:
    """(grpo's config with --rewards and --max-new-tokens resolved, the names a default chose). The
    shipped task's rewards unless --reward-funcs is given; completions of 8 tokens fit the task's
    answers, not a real model's: a Hugging Face model samples up to grpo.HF_MAX_NEW_TOKENS (TRL's
    default), or half its positions (room for the prompt), said on stdout."""
    method.check()
    defaulted = ("rewards",) if method.rewards is None else ()
    method = dataclasses.replace(method, rewards=",".join(method.reward_names))
    if method.max_new_tokens is not None:
        return method, defaulted
    if model_dir is None:
        return dataclasses.replace(method, max_new_tokens=data.MAX_NEW_TOKENS), defaulted + ("max_new_tokens",)
    from tunix_nb import hf

    positions = hf.read_config(model_dir).get("max_position_embeddings") or 2 * grpo.HF_MAX_NEW_TOKENS
    tokens = min(grpo.HF_MAX_NEW_TOKENS, positions // 2)
    print(f"--max-new-tokens default: {tokens} tokens a completion (TRL's {grpo.HF_MAX_NEW_TOKENS}"
          f"{'' if tokens == grpo.HF_MAX_NEW_TOKENS else f', halved to fit {positions} positions'}; a longer "
          "completion is cut and scored as cut); --max-new-tokens N chooses another")
    return dataclasses.replace(method, max_new_tokens=tokens), defaulted + ("max_new_tokens",)


def default_max_length(data_config: DataConfig, method, model_dir) -> tuple[DataConfig, tuple[str, ...]]:
    """--max-length's default, with --train-file on a Hugging Face model that declares more positions
    than DEFAULT_MAX_LENGTH (grpo: room for --max-new-tokens too): DEFAULT_MAX_LENGTH, said on stdout.
    A model with fewer positions gets none: its rows must fit them (rows.check_positions)."""
    if data_config.max_length is not None or data_config.train_file is None or model_dir is None:
        return data_config, ()
    from tunix_nb import hf

    positions = hf.read_config(model_dir).get("max_position_embeddings")
    room = positions - (getattr(method, "max_new_tokens", 0) or 0) if positions else None
    if room is None or room <= DEFAULT_MAX_LENGTH:
        return data_config, ()
    print(f"--max-length default: {DEFAULT_MAX_LENGTH} tokens a row (the model declares {positions:,} positions; "
          "longer rows lose their prompt's beginning, counted below); --max-length N chooses another")
    return dataclasses.replace(data_config, max_length=DEFAULT_MAX_LENGTH), ("max_length",)


def _steps_from_epochs(args) -> None:
    """--epochs: `args.steps` from the number of training examples; then the schedule's checks."""
    n_examples = count_examples(args.command, args.train_file)
    args.steps = steps_for_epochs(args.epochs, n_examples, args.batch_size)
    print(f"--epochs {args.epochs:g}: {args.steps} steps ({n_examples} training examples, {args.batch_size} a step)")
    check_schedule(args)


def count_examples(command: str, train_file: str | None) -> int:
    """How many examples (dpo: pairs; grpo: prompts) one epoch of `command` sees: --train-file's rows,
    or the shipped task's training split."""
    from tunix_nb import data, user_data

    if train_file is None:
        if command == "dpo":
            return len(data.load_preferences(data.DATA_DIR / "preferences_train.jsonl"))
        return len(data.load_sft(data.DATA_DIR / "sft_train.jsonl"))
    try:  # read once more when the rows are encoded; `datasets` keeps the file's Arrow copy in its cache
        return len(user_data.read_table(train_file).rows)
    except (data.DataError, FileNotFoundError) as err:
        raise RunError(f"--train-file: {err}")


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


def chunks_of(config: RunConfig) -> dict:
    """--vocab-chunk / --seq-chunk as the objectives' keywords (tunix_nb.vocab_chunks); a
    RunConfig built without the command, whose vocab_chunk is still "auto", gets it resolved here."""
    memory = config.memory
    if memory.vocab_chunk == "auto":
        memory, _ = memory.resolved(vocab_size_of(config.model, config.model_dir))
    return {"vocab_chunk": memory.vocab_chunk, "seq_chunk": memory.seq_chunk}
