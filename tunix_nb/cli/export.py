"""The last stage: what a finished run writes beside its checkpoints; --export-params (the
plain model's parameters, as an Orbax checkpoint), --export-hf (a Hugging Face folder) and
--export-adapter (the LoRA adapters as a PEFT adapter folder).
"""

from __future__ import annotations

from tunix_nb.cli.methods import Method
from tunix_nb.cli.run_config import RunConfig
from tunix_nb.distributed import print_once


def export_run(args, config: RunConfig, method: Method, params, step: int) -> None:
    """Every export the flags ask for, from the trained `params` (with LoRA: the adapters), or with
    --export-from best from the best checkpoint by eval loss."""
    from tunix_nb import checkpoint

    if not (args.export_params or args.export_hf or args.export_adapter):
        return
    if method.unstack is not None:  # --scan-layers trained the blocks stacked: the model's own layout again
        params = method.unstack(params)
    if args.export_from == "best":
        params, step = best_params(args.ckpt_dir, params)
    if args.export_params:  # with LoRA: the adapters merged into the base, a plain model
        plain = method.exportable(params)[1] if method.exportable is not None else params
        checkpoint.export_params(plain, args.export_params, step=step,
                                 meta={"model": config.model, "config": config.record()})
    export_folders(args, config, method, params)


def best_params(ckpt_dir, params_like):
    """(params, step) of <ckpt_dir>/best, in the structure of `params_like` (with LoRA: the adapters)."""
    from pathlib import Path

    import jax

    from tunix_nb import checkpoint

    best = Path(ckpt_dir) / "best"
    pure, meta = checkpoint.load_params_and_meta(best)
    print_once(f"--export-from best: step {meta['step']}, eval/loss {meta['eval_loss']:.4f} ({best})")
    return jax.device_put(checkpoint.params_into(params_like, pure)), meta["step"]


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
        print_once(f"Wrote a Hugging Face checkpoint to {args.export_hf}")
    if args.export_adapter:
        peft_adapter.save_adapter(args.export_adapter, params, model_config, alpha=method.lora_alpha,
                                  base_model_name_or_path=base_model_name(config),
                                  revision=config.source.revision)
        print_once(f"Wrote a PEFT LoRA adapter to {args.export_adapter}")


def base_model_name(config: RunConfig) -> str:
    """What the adapter's base_model_name_or_path names, so that PEFT finds the base from anywhere: a
    local --model folder as an absolute path (as typed, a relative one would resolve against the
    loader's working directory), a Hub id as itself, a preset by its name."""
    from pathlib import Path

    model = config.source.model or config.model
    return str(Path(model).resolve()) if config.model_dir is not None and Path(model).is_dir() else model
