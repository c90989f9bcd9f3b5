"""The build stage's model: --model's weights (a preset, its --init-from checkpoint, or a
Hugging Face checkpoint) in --dtype, and what the step trains of them: every parameter, or
LoRA adapters on a frozen base (`Trainable`).
"""

from __future__ import annotations

import dataclasses

from tunix_nb.cli.flags import FlagError
from tunix_nb.cli.run_config import RunConfig


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

    @property
    def exportable(self):
        """params -> (graphdef, params) of the plain model: with LoRA, the adapters merged into the base.
        It keeps no reference to this Trainable, whose `params` (the starting state) the training
        command must not keep alive beside the state it trains."""
        from tunix_nb import lora

        graphdef, base, alpha = self.graphdef, self.base, self.alpha
        if base is None:
            return lambda params: (graphdef, params)
        return lambda params: lora.merge(graphdef, params, base, alpha=alpha)


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
        graphdef, params = model.split(model.make_model(config.model, seed=config.seed))
        tokenizer = ByteTokenizer()
    else:
        try:
            graphdef, params, _ = hf.load_pretrained(config.model_dir, dtype=config.source.dtype)
            tokenizer = HFTokenizer.from_dir(config.model_dir)
        except (hf.CheckpointError, FileNotFoundError, ValueError) as err:
            raise FlagError(f"--model {config.source.model}: {err}")
    graphdef, params = _with_layer_options(graphdef, params, config.training)
    init_from = getattr(config.method, "init_from", None)
    if init_from:  # dpo, grpo: the policy and the reference start from the SFT checkpoint (distill: if given)
        params = checkpoint.params_into(params, checkpoint.load_params(init_from))
    if config.source.dtype != "float32":
        import jax.numpy as jnp

        params = precision.cast_floats(params, jnp.dtype(config.source.dtype))
    return graphdef, params, tokenizer


def _with_layer_options(graphdef, params, training):
    """The model with --remat, --remat-policy, --scan-layers and --attention set in its config: how the blocks
    run, not what they compute, so the parameters are untouched."""
    from flax import nnx

    from tunix_nb import model

    if training.attention == "splash":  # "auto" was resolved by then: "xla" is every model's own
        graphdef = model.with_attention(graphdef, params, "splash")
    if not (training.remat or training.scan_layers):
        return graphdef, params
    module = nnx.merge(graphdef, params)
    module.cfg = dataclasses.replace(module.cfg, remat=training.remat, scan_layers=training.scan_layers,
                                     remat_policy=training.remat_policy)
    return nnx.split(module)
