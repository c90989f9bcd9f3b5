"""Tunix's own Qwen3 model and its PeftTrainer beside the kit's training command, on one chip, in one
process, at the same shapes, batch, optimizer and LoRA rank (issue 47, item 6).

    python results/tpu_v5e_training/tunix_side_by_side.py --model DIR --rows rows.jsonl --out FILE \\
        [--batch 8 --length 1024 --steps 10 --rank 16 --remat block --flash]

- Tunix: `tunix.models.qwen3` built from the same Hugging Face folder (its safetensors loader), bfloat16
  weights and compute (the kit's `--dtype auto` for a frozen base on a TPU), qwix LoRA on every
  projection of attention and the MLP (rank r, alpha r, as the kit's `--lora-rank r`), `PeftTrainer`
  with its default loss (full logits) and the kit's AdamW (`train.make_optimizer`, the command's
  warmup and schedule), its own jitted step (`jit_train_and_eval_step`). Its remat: `--remat block`
  (Tunix's RematConfig.BLOCK: attention and MLP each rematerialised) or `none`; `--flash` turns on
  its splash-attention kernel.
- The kit: `python -m tunix_nb.train sft --lora-rank r --scan-layers --remat ...` on the same folder,
  measured by `tunix_nb.measure_command` (the median of the steps after the warm-up).
- Each side's step is compiled once and its XLA memory analysis read from that compile; Tunix's step
  is timed as a pipelined loop (the steps dispatched, then the last loss fetched), which is what the
  kit's median measures. Tunix's arrays are freed before the kit's command runs.

Writes FILE (JSON): both sides' compile seconds, step seconds, tokens per second and memory, the
ratio kit / Tunix, versions and the command lines. Needs google-tunix 0.1.7 (`tunix_nb.tunix_compare`
says how to install it beside the kit's pins).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shlex
import sys
import time
from pathlib import Path

WARMUP = 2
TUNIX_WARMUP_CALLS = 3  # its second call compiled the step again on a CPU: the third shows it settled


def tunix_config(model_dir: Path, *, remat: str, flash: bool, length: int):
    """Tunix's Qwen3 ModelConfig from the folder's config.json, in bfloat16."""
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3

    hf = json.loads((model_dir / "config.json").read_text())
    remat_config = {"block": qwen3.RematConfig.BLOCK, "none": qwen3.RematConfig.NONE}[remat]
    return qwen3.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]), norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=hf.get("tie_word_embeddings", False), remat_config=remat_config,
        dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, use_flash_attention=flash,
        flash_attention_block_size=min(512, length))


def tunix_trainer(args, optimizer, mesh):
    """Tunix's LoRA model from the folder (placed on `mesh`, as its CLI does), and its PeftTrainer
    with the kit's optimizer."""
    import jax.numpy as jnp
    import qwix
    from flax import nnx
    from tunix.models.qwen3 import params as qwen3_params
    from tunix.sft import peft_trainer, utils

    config = tunix_config(args.model, remat=args.remat, flash=args.flash, length=args.length)
    base = qwen3_params.create_model_from_safe_tensors(str(args.model), config, mesh=mesh, dtype=jnp.bfloat16)
    provider = qwix.LoraProvider(module_path=".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
                                 rank=args.rank, alpha=float(args.rank))
    model = qwix.apply_lora_to_model(base, provider, rngs=nnx.Rngs(0), **base.get_model_input())
    trainer = peft_trainer.PeftTrainer(model, optimizer, peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9, max_steps=args.steps, pbar_description=None))

    def model_input(x):  # as Tunix's SFT examples feed its default loss
        return {"input_tokens": x.input_tokens, "input_mask": x.input_mask,
                "positions": utils.build_positions_from_mask(x.input_mask),
                "attention_mask": utils.make_causal_attn_mask(x.input_mask)}

    return trainer.with_gen_model_input_fn(model_input), config


def time_tunix(args, optimizer) -> dict:
    """Tunix's step: its compile, XLA's memory analysis of it, and the pipelined step time."""
    import jax

    # Tunix's CLI trains inside a mesh ("fsdp", "tp"); there its trainer places the optimizer's state before
    # the first step. Without one (--no-mesh) it does not, and its step compiles twice (its own comment says so)
    mesh = (jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
            if args.mesh else None)  # Auto axes, as Tunix's own meshes
    with mesh if mesh is not None else contextlib.nullcontext():
        return _time_tunix(args, optimizer, mesh)


def _time_tunix(args, optimizer, mesh) -> dict:
    import jax
    import numpy as np
    from flax import nnx
    from tunix.sft import peft_trainer

    from tunix_nb import measure_command
    from tunix_nb.memory_plan.analysis import memory_of

    trainer, config = tunix_trainer(args, optimizer, mesh)
    tokens = np.random.default_rng(0).integers(3, 259, (args.batch, args.length)).astype(np.int32)
    batch = peft_trainer.TrainingInput(input_tokens=jax.numpy.asarray(tokens),
                                       input_mask=jax.numpy.ones(tokens.shape, bool))
    train_step, _ = trainer.jit_train_and_eval_step()
    with measure_command.compile_log() as log:
        started = time.perf_counter()
        compiled = train_step.func.lower(*train_step.args, batch).compile()
        compile_seconds = time.perf_counter() - started
        memory = memory_of(compiled)
        losses, warmup_seconds = [], []
        for _ in range(TUNIX_WARMUP_CALLS):  # as its loop calls it: the persistent cache serves the compile above
            started = time.perf_counter()
            losses.append(float(train_step(batch)[0]))
            warmup_seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        outputs = [train_step(batch) for _ in range(args.steps)]
        losses.append(float(outputs[-1][0]))
        step_seconds = (time.perf_counter() - started) / args.steps
    compiles = [{"program": r["program"], "seconds": r["seconds"]} for r in log.records if r["phase"] == "xla_compile"]
    result = {"compile_seconds": compile_seconds, "xla_compiles": compiles, "warmup_call_seconds": warmup_seconds,
              "step_compiles": sum("train_step" in c["program"] for c in compiles), "step_seconds": step_seconds,
              "tokens_per_second": args.batch * args.length / step_seconds, "xla_memory": memory,
              "loss": {"first": losses[0], "last": losses[-1]}, "remat": args.remat, "flash_attention": args.flash, "mesh": args.mesh,
              "trained_params": sum(x.size for x in jax.tree.leaves(nnx.state(trainer.model, nnx.LoRAParam)))}
    del trainer, outputs, compiled, train_step
    gc.collect()
    return result


def kit_command(args) -> list[str]:
    return ["sft", "--model", str(args.model), "--train-file", str(args.rows), "--max-length", str(args.length + 1),
            "--batch-size", str(args.batch), "--steps", str(args.steps + WARMUP + 1), "--remat",
            "--compute-dtype", "bfloat16", "--vocab-chunk", "auto", *args.kit_flags,
            "--learning-rate", str(args.learning_rate), "--lora-rank", str(args.rank), "--scan-layers"]


def kit_optimizer(args):
    """The optimizer the kit's command builds for `kit_command`: its own resolution of the flags
    (the warmup default included), as `cli.command` passes them to `train.make_optimizer`."""
    from tunix_nb import train
    from tunix_nb.cli.run_config import config_from_argv

    config = config_from_argv(kit_command(args))
    return train.make_optimizer(train.OptimizerConfig(learning_rate=config.training.learning_rate,
                                                      warmup_steps=config.training.warmup_steps,
                                                      total_steps=config.steps))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face Qwen3 folder")
    parser.add_argument("--rows", type=Path, required=True, help="JSONL rows of text, longer than --length")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--remat", choices=("block", "none"), default="block")
    parser.add_argument("--flash", action="store_true", help="Tunix's splash-attention kernel (a TPU's)")
    parser.add_argument("--kit-flags", type=shlex.split, default=[],
                        help="more flags for the kit's command, one string: --kit-flags='--seq-chunk 256' as "
                             "7ebc29c's run (since, the loss's positions go at once, and --attention auto "
                             "picks splash on the chip)")
    parser.add_argument("--no-mesh", dest="mesh", action="store_false",
                        help="Tunix without the mesh its CLI trains in (its step then compiles twice)")
    args = parser.parse_args(argv)
    from tunix_nb import devices, measure_command

    devices.use_compile_cache()  # Tunix's jit then reads back the step compiled ahead of time for its memory

    tunix = time_tunix(args, kit_optimizer(args))
    kit = measure_command.measure(kit_command(args))
    if kit.get("exit_code") != 0:
        print(f"error: the kit's command failed: {kit}", file=sys.stderr)
        return 1
    kit_step = kit["median_step_seconds"]
    record = {"script": "results/tpu_v5e_training/tunix_side_by_side.py", "argv": sys.argv[1:] if argv is None else argv,
              "device": kit["device"], "versions": {**kit["versions"], **tunix_versions()},
              "batch": args.batch, "length": args.length, "rank": args.rank, "tunix": tunix,
              "kit": {"command": kit["command"], "compile_seconds": kit["step_compile_seconds"]["xla_compile"],
                      "step_seconds": kit_step, "tokens_per_second": kit["tokens_per_second"],
                      "xla_memory": kit["xla_memory"], "loss": kit["loss"], "mfu": kit["mfu"],
                      "trained_params": kit["model"]["trained_params"]},
              "kit_over_tunix_step": kit_step / tunix["step_seconds"],
              "kit_over_tunix_peak_memory": kit["xla_memory"]["peak_bytes"] / tunix["xla_memory"]["peak_bytes"]}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("kit_over_tunix_step", "kit_over_tunix_peak_memory")}))
    return 0


def tunix_versions() -> dict:
    from importlib import metadata

    return {name: metadata.version(name) for name in ("google-tunix", "qwix", "flax")}


if __name__ == "__main__":
    sys.exit(main())
