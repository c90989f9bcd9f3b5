"""`python -m tunix_nb.train`: SFT, distillation, DPO and GRPO from the command line, resumable.

One subcommand per method: `python -m tunix_nb.train dpo --help` lists DPO's options
(`dpo.DPOConfig`) and the shared ones (`train.config`), and no other method's. Every
flag is a field of a config dataclass (`tunix_nb.config_flags`): `sft.SFTConfig`,
`dpo.DPOConfig`, `grpo.GRPOConfig`, `distill.DistillConfig` with `gkd.GKDConfig`,
`lora.LoRAConfig` (sft, dpo, grpo), and the shared `train.config.TrainingConfig`,
`ModelSourceConfig`, `DataConfig`, `MemoryConfig`, `CheckpointConfig`, `TrackingConfig`,
`DeviceConfig`, `ProcessConfig`. The run config saved in each checkpoint (`RunConfig.record`) is made
of those configs' run-defining fields.

It saves the training state with Orbax every --save-every steps and resumes on its own
from the newest checkpoint in --ckpt-dir, to exactly the run an uninterrupted one would
have been, bit for bit; it refuses (leaving the checkpoints untouched) when that run's
config differs from the flags given. `cli.checkpoints` says how, in detail.

Several processes (a TPU pod slice, GPU hosts, or `python -m tunix_nb.launch` on one
machine) run the same command with --coordinator/--num-processes/--process-id (or
--distributed, to let JAX read them from the cluster) and --parallel dp, fsdp or
shard_map: each process loads only its share of every batch, they save checkpoints
together into one --ckpt-dir (shared storage), and process 0 prints and writes the
metrics.

One module per stage, and data flows one way: a stage imports only the stages before it.

    flags        parse and check the flags                       flags
    config       RunConfig: the model, its hash, the defaults    run_config
    build        the model, what trains of it, the rows: Method  models, rows, methods
    run          open and resume checkpoints; train with saves   checkpoints, loop
    export       --export-params, --export-hf, --export-adapter  export

`command.main` runs them in that order. The names scripts and tests have always used
from `tunix_nb.cli` are re-exported here. `tunix_nb.preempt` runs this command and
SIGKILLs it mid-run (tests and notebook 05).
"""

# The public names of tunix_nb.cli, from the stage that now holds each.
from tunix_nb import gkd, lora  # noqa: F401  (cli.gkd, cli.lora: as before the split)
from tunix_nb.cli.checkpoints import BestCheckpoint, open_checkpoints, resume  # noqa: F401
from tunix_nb.cli.command import main, prepare, start_jax  # noqa: F401
from tunix_nb.cli.export import export_folders, export_run  # noqa: F401
from tunix_nb.cli.flags import (  # noqa: F401
    COMMANDS, DESCRIPTION, DPO_LOSS_TYPES, LISTING_ORDER, LORA_COMMANDS, LORA_DEFAULT_TARGETS, LORA_FLAGS,
    METHOD_CONFIGS, PACKING_COMMANDS, PROG, FlagError, RunError, build_parser, check_flags, command_parser,
    help_reference, parse_args)
from tunix_nb.cli.loop import batch_source, make_eval_loss, open_trackers, packing_of, train_with_saves  # noqa: F401
from tunix_nb.cli.methods import Method, build_method, make_reward_set  # noqa: F401
from tunix_nb.cli.models import Trainable, build_model, trainable  # noqa: F401
from tunix_nb.cli.rows import encoded_user_data, training_arrays, training_examples, user_file  # noqa: F401
from tunix_nb.cli.run_config import (  # noqa: F401
    HF_MODEL, OLDER_RUN_DEFAULTS, RECORD_FIELDS, RUN_DEFINING, RunConfig, check_devices, chunks_of,
    config_from_argv, data_hash, resolve_config, resolve_model, vocab_size_of)
from tunix_nb.gkd import GKDConfig  # noqa: F401
from tunix_nb.lora import LoRAConfig  # noqa: F401
from tunix_nb.train.config import (  # noqa: F401
    MESH_CHOICES, PARALLEL_CHOICES, SHARED_OPTIONS, DataConfig, MemoryConfig, ModelSourceConfig, TrainingConfig)
