"""The options every method shares: the model, the optimisation, checkpoints, tracking, processes.

Each is a dataclass whose fields are the flags of `python -m tunix_nb.train` (through
`tunix_nb.config_flags.option`); a method's own options live in its module (`dpo.DPOConfig`,
...). Fields marked run-defining are recorded in each checkpoint: resuming with other
values would be another run. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses

from tunix_nb.config_flags import option, positive_float, positive_int
from tunix_nb.distributed import DEFAULT_HEARTBEAT_TIMEOUT_S

REMAT_POLICIES = ("full", "save_attention", "save_projections")  # tunix_nb.model's, named here without JAX

# train.PARALLEL_MODES, spelled out: the parser is built before JAX may start.
PARALLEL_CHOICES = ("jit", "pmap", "shard_map", "dp", "fsdp")
MESH_CHOICES = ("shard_map", "dp", "fsdp")  # parallel.MESH_MODES: the strategies that span processes
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
PARAM_DTYPES = ("float32", "bfloat16")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # hf.EXPORT_DTYPES
TRACKERS = ("jsonl", "tensorboard")  # tunix_nb.tracking
EXPORT_FROM = ("last", "best")  # --export-from


def _trackers(text: str) -> str:
    """--report-to: distinct names from TRACKERS, comma-separated, kept as one cleaned-up string."""
    import argparse

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in TRACKERS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct names from {', '.join(TRACKERS)}, "
                                         "separated by commas")
    return ",".join(names)


DEFAULT_STEPS = 300  # --steps without --steps or --epochs
# --max-length's default for a Hugging Face model declaring more positions than this (Qwen3: 40,960):
# TRL's SFTConfig.max_length. Rows are padded to the longest kept, so a cap bounds a step's memory.
DEFAULT_MAX_LENGTH = 1024


def steps_for_epochs(epochs: float, n_examples: int, batch_size: int) -> int:
    """--epochs' steps: enough batches of `batch_size` to see `n_examples` `epochs` times (at least 1)."""
    import math

    return max(1, math.ceil(epochs * n_examples / batch_size - 1e-9))  # 1e-9: 2.0 x 64 / 32 is 4, not 5


def _template_kwargs(text: str) -> str:
    """--chat-template-kwargs: a JSON object, kept as canonical JSON text (recorded in checkpoints)."""
    import argparse
    import json

    from tunix_nb.tokenizer import template_kwargs_from_json

    try:
        return json.dumps(template_kwargs_from_json(text), sort_keys=True)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err))


@dataclasses.dataclass(frozen=True)
class ModelSourceConfig:
    """Which model trains, and the dtype its parameters are kept in."""

    model: str | None = option(help="a preset (tiny, student, teacher), a local Hugging Face checkpoint folder "
                               "(config.json, *.safetensors, tokenizer.json), or a Hub id such as Qwen/Qwen3-0.6B "
                               "(online) (default: student; dpo, grpo: the preset of the --init-from checkpoint)")
    revision: str | None = option(run_defining=False, help="with a Hub id: the branch, tag or commit to download "
                                  "(default: main; the run records the files' hash, not the revision)")
    dtype: str = option("auto", choices=("auto", *PARAM_DTYPES),
                        help="the dtype the parameters are kept in; with --lora-rank the frozen base's "
                             "(the adapters stay float32). auto: bfloat16 for a Hugging Face model's frozen base "
                             "under --lora-rank where the step computes in bfloat16 (--compute-dtype auto: on a "
                             "TPU, or a GPU from compute capability 8.0), float32 otherwise: full fine-tuning keeps float32 "
                             "weights for AdamW; said on stdout. A resumed run keeps the dtype it recorded")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The examples: the shipped task, or your own files in TRL's dataset formats (tunix_nb.user_data)."""

    train_file: str | None = option(run_defining=False, help="your training data in one of TRL's dataset formats "
                                    "(sft, distill: prompt/completion, messages or text; dpo: prompt/chosen/"
                                    "rejected; grpo: prompt, other columns reach the reward functions): a .jsonl, "
                                    ".json or .parquet file, or a Hub dataset id (online). The run records the "
                                    "file's content hash (default: the shipped task)")
    eval_file: str | None = option(run_defining=False, help="the eval split, in the same format (--eval-every "
                                   "scores it; default: the shipped task's eval split, without --train-file)")
    max_length: int | None = option(type=positive_int, help="with --train-file: at most this many tokens per row "
                                    "(grpo: per prompt). A prompt that does not fit loses its beginning; the "
                                    "completion is never cut; a row whose completion alone does not fit is an "
                                    f"error (default: {DEFAULT_MAX_LENGTH} for a Hugging Face model that declares "
                                    "more positions (max_position_embeddings), said on stdout; otherwise the "
                                    "longest row, which must fit the model's positions)")
    chat_template_kwargs: str | None = option(type=_template_kwargs, metavar="JSON",
                                              help="with --train-file: variables for the chat template, as a JSON "
                                                   "object, passed when rows and prompts are rendered (transformers' "
                                                   "apply_chat_template(**kwargs)), e.g. '{\"enable_thinking\": "
                                                   "false}' for Qwen3: what you will generate with (docs/cli.md: "
                                                   "what the loss covers)")
    packing: bool = option(False, switch=True,
                           help="sft, distill: lay each step's examples end to end in as few rows as they fit "
                                "(tunix_nb.packing), each attending only to itself with positions restarting "
                                "per example, so the loss is the unpacked batch's; the rows are as long as "
                                "unpacked ones, and as many as the run's fullest step needs, rounded up to a "
                                "multiple of the devices x --grad-accum")


AUTO_VOCAB_CHUNK = 8192  # --vocab-chunk auto's chunk for a vocabulary larger than it (issue 27's memory rows)


def auto_vocab_chunk(vocab_size: int) -> int | None:
    """--vocab-chunk auto's choice: AUTO_VOCAB_CHUNK for a vocabulary larger than it (a real
    tokenizer's), None (the full logits, today's path) for the presets' 259 entries."""
    return AUTO_VOCAB_CHUNK if vocab_size > AUTO_VOCAB_CHUNK else None


def _vocab_chunk(text: str) -> int | str | None:
    """--vocab-chunk: "auto", "none" (None: the full logits) or a positive number of entries."""
    import argparse

    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err}; give a number of vocabulary entries such as 8192, auto or none")


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """How the step spends memory on the vocabulary (tunix_nb.vocab_chunks): the same loss."""

    vocab_chunk: int | str | None = option("auto", type=_vocab_chunk, run_defining=False, metavar="N|auto|none",
                                           help="compute log-probs from the hidden states in chunks of N "
                                                "vocabulary entries, forward and backward, with logits only at "
                                                "the positions the loss reads: no [batch, length, vocab] array. "
                                                f"auto: chunks of {AUTO_VOCAB_CHUNK} when the model's "
                                                f"vocabulary is larger than {AUTO_VOCAB_CHUNK} (a real "
                                                "tokenizer's), else the full logits (the presets' 259 entries); "
                                                "none: always the full logits, the reference path")
    seq_chunk: int | None = option(type=positive_int, run_defining=False,
                                   help="with the chunked path: also take the loss positions this many at a time")

    def resolved(self, vocab_size: int) -> tuple[MemoryConfig, str | None]:
        """(this config with vocab_chunk "auto" made a number or None for a model with
        `vocab_size` entries, what auto chose and why; None when nothing was automatic)."""
        if self.vocab_chunk != "auto":
            return self, None
        if auto_vocab_chunk(vocab_size) is not None:
            why = (f"the vocabulary's {vocab_size:,} entries would make [batch, length, {vocab_size}] float32 "
                   "logits; --vocab-chunk none keeps them")
        elif self.seq_chunk is not None:
            why = f"--seq-chunk takes the chunked path; the vocabulary's {vocab_size} entries fit one chunk"
        else:
            return dataclasses.replace(self, vocab_chunk=None), None  # the toy presets: today's path, unchanged
        return dataclasses.replace(self, vocab_chunk=AUTO_VOCAB_CHUNK), f"{AUTO_VOCAB_CHUNK} ({why})"


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """The optimisation and the loop: what every method's run shares."""

    steps: int | None = option(type=positive_int,
                               help="total training steps (grpo: rollouts, each followed by --num-iterations "
                                    f"updates) (default: {DEFAULT_STEPS}, or what --epochs makes)")
    epochs: float | None = option(type=positive_float, run_defining=False,
                                  help="instead of --steps: passes over the training examples (pairs for dpo, "
                                       "prompts for grpo), steps = ceil(epochs x examples / --batch-size), said "
                                       "on stdout; the run records the steps")
    batch_size: int = option(64, type=positive_int, help="global batch size (examples, pairs for dpo, prompts "
                             "for grpo), split over the devices")
    seed: int = option(0, type=int, help="seed of the initial params and the data order")
    learning_rate: float | None = option(type=positive_float, help="peak learning rate")
    warmup_steps: int | None = option(type=int, help="linear warmup steps (default: 10% of --steps, at most 20; "
                                      "grpo: counted in rollouts, the schedule in updates)")
    grad_accum: int = option(1, type=positive_int, help="split each device's share of the batch into K "
                             "micro-batches, summed and divided once: the same update with one micro-batch's "
                             "activations at a time")
    remat: bool = option(False, switch=True, run_defining=False,
                         help="rematerialise each block: keep only its input for the backward pass and "
                              "recompute the rest, trading about one more forward pass for activation memory "
                              "(the same update; a run may resume with or without it)")
    remat_policy: str = option("full", choices=REMAT_POLICIES, run_defining=False,
                               help="what --remat keeps beside each block's input: full keeps nothing; "
                                    "save_attention keeps the splash kernel's output and softmax statistics, "
                                    "so the backward pass skips the kernel's second forward run (one "
                                    "[batch, heads, length, head_dim] array more per block; only with "
                                    "--attention splash); save_projections keeps those and the q, k, v, "
                                    "attention-output, gate and up projections' outputs, so the backward pass "
                                    "recomputes no projection (for Qwen3-0.6B about 11k values more per token "
                                    "and block)")
    scan_layers: bool = option(False, switch=True, run_defining=False,
                               help="run the blocks as one scan and train their parameters stacked on a layer "
                                    "axis: the compiled step holds one block instead of one per layer and the "
                                    "optimizer one leaf per stack, so the compile does not grow with the depth "
                                    "(the same update; a run may resume with or without it, its checkpoints "
                                    "convert; the exports keep one tree per block)")
    attention: str = option("auto", choices=("auto", "xla", "splash"), run_defining=False,
                            help="auto: Pallas's fused splash-attention kernel on one TPU computing in "
                                 "bfloat16 (where the length is a multiple of 128 and heads of 128: "
                                 "tunix_nb.fused_attention), XLA's einsums elsewhere; the same attention "
                                 "for every real token (a run may resume with either)")
    compute_dtype: str = option("auto", choices=COMPUTE_DTYPES,
                                help="auto: float32 on CPU, bfloat16 on TPU and on GPUs with native bfloat16 "
                                     "(compute capability 8.0 and up), float32 on older GPUs such as the T4 "
                                     "(params stay in --dtype)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often the run saves, and what it does at the end."""

    ckpt_dir: str | None = option(help="where to save checkpoints; resumes from the newest one there")
    save_every: int = option(50, type=positive_int, help="save every K steps (and at the last step), "
                             "asynchronously")
    keep: int = option(3, type=positive_int, help="keep the newest N checkpoints")
    sync_save: bool = option(False, switch=True, help="block training while a checkpoint is written "
                             "(default: write in the background)")
    stop_after: int | None = option(type=positive_int, help="stop after this step, saving a checkpoint there, "
                                    "as if preempted; run the same command again (without it) to resume")
    export_params: str | None = option(help="at the end, also write a params-only checkpoint here")
    export_from: str = option("last", choices=EXPORT_FROM, run_defining=False,
                              help="what --export-params, --export-hf and --export-adapter write: the last "
                                   "step's parameters, or the best checkpoint by eval loss (<--ckpt-dir>/best, "
                                   "kept with --eval-every)")
    export_hf: str | None = option(help="at the end, write a Hugging Face checkpoint folder here (config.json, "
                                   "safetensors, the source's tokenizer files) that transformers and vLLM load; "
                                   "with LoRA/QLoRA, the adapters merged into the weights")
    export_adapter: str | None = option(help="with --lora-rank: at the end, write the adapters here as a PEFT LoRA "
                                        "adapter folder (adapter_config.json, adapter_model.safetensors)")
    export_dtype: str | None = option(choices=EXPORT_DTYPES, help="the dtype of --export-hf's weights (default: "
                                      "the parameters' dtype, --dtype)")
    max_shard_size: str | None = option(help="--export-hf: split the weights into safetensors shards of at most "
                                        "this size, e.g. 5GB (default: one file)")


@dataclasses.dataclass(frozen=True)
class TrackingConfig:
    """Metrics and evaluation during training."""

    metrics_file: str | None = option(help="write one JSON line per step (step, loss, ...)")
    report_to: str = option("jsonl", type=_trackers, metavar="{jsonl,tensorboard}",
                            help="where the metrics go, comma-separated: jsonl (--metrics-file) and/or "
                                 "tensorboard (event files in --logging-dir)")
    logging_dir: str | None = option(help="tensorboard: the event files' folder (default: "
                                     "<--ckpt-dir>/tensorboard)")
    eval_every: int | None = option(type=positive_int, help="every N steps, the eval loss on the eval split "
                                    "(metric eval/loss); with --ckpt-dir the best checkpoint by it is kept in "
                                    "<--ckpt-dir>/best (default: off)")


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """Devices and parallelism."""

    devices: int | None = option(type=positive_int, help="on CPU, simulate N devices (per process, with "
                                 "several processes)")
    parallel: str = option("jit", choices=PARALLEL_CHOICES,
                           help="jit: one device; pmap: data parallel, replicated state; shard_map: the pmap "
                                "step on a Mesh; dp: jit with a batch-sharded NamedSharding; fsdp: dp with "
                                "params and optimizer state sharded too. Checkpoints restore under any of them")


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
    """Several processes: one per host (python -m tunix_nb.launch starts them on one machine)."""

    coordinator: str | None = option(metavar="HOST:PORT", help="address of process 0, where JAX's "
                                     "coordination service listens")
    num_processes: int | None = option(type=positive_int, help="how many processes take part")
    process_id: int | None = option(type=int, help="this process's index, 0 ... --num-processes - 1")
    distributed: bool = option(False, switch=True, help="join a multi-process run whose coordinator, process "
                               "count and index JAX detects (Cloud TPU pod slice, SLURM, Open MPI, Kubernetes)")
    heartbeat_timeout: int = option(DEFAULT_HEARTBEAT_TIMEOUT_S, type=positive_int, help="seconds after which a silent process counts "
                                    "as dead and the others stop")


# Shared options, in the order --help lists them: (config class, group title, group description).
SHARED_OPTIONS = (
    (ModelSourceConfig, "model", None),
    (DataConfig, "data", None),
    (TrainingConfig, "training", None),
    (MemoryConfig, "memory", None),
    (CheckpointConfig, "checkpoints", None),
    (TrackingConfig, "tracking and evaluation", None),
    (DeviceConfig, "devices", None),
    (ProcessConfig, "several processes", "one process per host (python -m tunix_nb.launch starts them on one "
     "machine); needs --parallel dp, fsdp or shard_map"),
)
