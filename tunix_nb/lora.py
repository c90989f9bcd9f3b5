"""LoRA and QLoRA adapters on the kit's model (and on checkpoints from `tunix_nb.hf`), with qwix.

LoRA (Hu et al., 2021) freezes a weight W [in, out] and learns a low-rank change:
y = x W + (alpha / rank) x A B, with A [in, rank] and B [rank, out]. B starts at zero, so
training starts exactly at the base model. QLoRA (Dettmers et al., 2023) also stores the
frozen W quantised (nf4: 4-bit NormalFloat with a scale per tile; or int8). qwix applies
either to any NNX model by intercepting its matmuls, as Tunix's examples do: the adapters
become `nnx.LoRAParam` leaves beside the base's `nnx.Param` ones.

The training step trains the adapters only: they are the step's `params` (so the
optimizer state exists for them alone), and the base travels in the step's `frozen`
argument, where no gradient reaches it. Any method's objective works unchanged:

    graphdef, adapters, base = lora.apply(graphdef, params, rank=8, alpha=16.0)
    step = train.make_step(lora.objective(sft.objective(graphdef)), opt)
    train.run(step, adapters, opt.init(adapters), batch_fn, steps=..., frozen=lora.frozen(base))
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from tunix_nb import model
from tunix_nb.config_flags import option, positive_float, positive_int

# Tunix's examples adapt every projection of attention and the MLP, with alpha = rank
# (their Gemma GRPO example: rank 64, alpha 64.0), so the adapters' scale is 1.
DEFAULT_TARGETS = r".*(attn/(q|k|v|out)|mlp/(gate|up|down))"
DEFAULT_RANK = 8
QUANTIZE = ("none", "nf4", "int8")
DEFAULT_TILE_SIZE = 32  # values per quantisation scale (nf4/int8), along each kernel's input axis


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA / QLoRA's options (sft, dpo, grpo; PEFT's LoraConfig, qwix's LoraProvider). All None:
    every parameter trains; `resolved` fills in alpha, targets and quantize once a rank is given."""

    TITLE = "LoRA / QLoRA"
    DESCRIPTION = ("train low-rank adapters on a frozen base; checkpoints hold the adapters and their "
                   "optimizer state, --export-params the merged model")

    lora_rank: int | None = option(type=positive_int, help="train LoRA adapters of this rank instead of every "
                                   "parameter (default: off, full fine-tuning)")
    lora_alpha: float | None = option(type=positive_float, help="the adapters' scale is alpha / rank (default: "
                                      "the rank, as Tunix's examples)")
    lora_targets: str | None = option(help=f"regex of the layers that get adapters (default: {DEFAULT_TARGETS}, "
                                      "every projection)")
    quantize: str | None = option(choices=QUANTIZE, help="store the frozen base quantised: nf4 is QLoRA "
                                  "(default: none)")

    def resolved(self) -> "LoRAConfig":
        """The defaults filled in; a ValueError naming the flag for options without a rank or a bad regex."""
        given = [f"--{n.replace('_', '-')}" for n in ("lora_alpha", "lora_targets", "quantize")
                 if getattr(self, n) is not None]
        if self.lora_rank is None:
            if given:
                raise ValueError(f"{', '.join(given)} need(s) --lora-rank: LoRA is off without it")
            return self
        targets = self.lora_targets or DEFAULT_TARGETS
        try:
            re.compile(targets)
        except re.error as err:
            raise ValueError(f"--lora-targets {targets!r} is not a regular expression ({err})")
        return LoRAConfig(self.lora_rank, float(self.lora_rank) if self.lora_alpha is None else self.lora_alpha,
                          targets, self.quantize or "none")


def provider(*, rank: int, alpha: float | None = None, targets: str = DEFAULT_TARGETS, quantize: str = "none",
             tile_size: int = DEFAULT_TILE_SIZE) -> qwix.LoraProvider:
    """A qwix LoraProvider for the layers whose path matches `targets` (a regex); alpha
    defaults to the rank."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}.")
    alpha = rank if alpha is None else alpha
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha!r} (the adapters' scale is alpha / rank).")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r}; choose one of {QUANTIZE}.")
    kwargs = {} if quantize == "none" else {"weight_qtype": quantize, "tile_size": tile_size}
    return qwix.LoraProvider(module_path=targets, rank=rank, alpha=float(alpha), **kwargs)


def apply(graphdef, params, *, rank: int = DEFAULT_RANK, alpha: float | None = None, targets: str = DEFAULT_TARGETS,
          quantize: str = "none", tile_size: int = DEFAULT_TILE_SIZE, seed: int = 0):
    """(graphdef, adapters, base): the model with adapters on the matching layers.

    `adapters` holds the LoRAParam leaves (A random, B zero) in float32, `base` everything
    else (quantised where `quantize` says) in `params`' dtype: pass bfloat16 params for a
    bfloat16 base, which a bfloat16 step then uses as it is, with no per-step copy.
    `params` is left as it was.
    """
    rule = provider(rank=rank, alpha=alpha, targets=targets, quantize=quantize, tile_size=tile_size)
    sample_tokens = jnp.ones((1, 2), jnp.int32)  # qwix traces one call to find the layers
    module = nnx.merge(graphdef, params)
    # qwix creates the adapters in that call: not inside a rematerialised block or a scan
    remat, scan_layers = module.cfg.remat, module.cfg.scan_layers
    module.cfg = dataclasses.replace(module.cfg, remat=False, scan_layers=False)
    try:
        adapted = qwix.apply_lora_to_model(module, rule, sample_tokens, rngs=nnx.Rngs(seed))
    except ValueError as err:
        if "cannot be tiled" not in str(err):
            raise
        raise ValueError(f"quantize={quantize!r} with tile_size={tile_size}: a kernel's input size does not "
                         f"divide by it ({err}). Pass a tile_size that divides every adapted layer's "
                         "input size.") from err
    adapted.cfg = dataclasses.replace(adapted.cfg, remat=remat, scan_layers=scan_layers)
    lora_graphdef, adapters, base = nnx.split(adapted, nnx.LoRAParam, ...)
    # qwix makes the adapters in the kernel's dtype; they train in float32 whatever the
    # frozen base is kept in (a bfloat16 base: --dtype bfloat16, as PEFT's adapters do),
    # and the bfloat16 base stays as it is: the frozen half of the memory, never copied.
    adapters = jax.tree.map(lambda x: x.astype(jnp.float32), adapters)
    if not jax.tree.leaves(adapters):
        raise ValueError(f"targets={targets!r} matched no layer. The kit's layers are named like "
                         "'blocks/0/attn/q' and 'blocks/0/mlp/gate'.")
    return lora_graphdef, adapters, base


def combine(adapters, base):
    """The full state (base and adapters) that `model.apply` takes with the LoRA graphdef."""
    return nnx.merge_state(base, adapters)


def frozen(base, method_frozen=None) -> dict:
    """What the step's `frozen` argument carries: the base, and the method's own (a teacher)."""
    return {"base": base, "method": method_frozen}


def objective(method_objective):
    """A method's objective (built with the LoRA graphdef) over the adapters alone."""

    def adapter_objective(adapters, batch, frozen_state):
        if not isinstance(frozen_state, dict) or "base" not in frozen_state:
            raise ValueError("The LoRA objective needs the base in the step's frozen argument: "
                             "pass frozen=lora.frozen(base) to train.run.")
        return method_objective(combine(adapters, frozen_state["base"]), batch, frozen_state["method"])

    return adapter_objective


def rollout(rollout_fn, *, with_reference: bool):
    """An on-policy rollout (`grpo.make_rollout`) for a LoRA policy: it samples with the
    adapted model and scores the reference with the adapters switched off, so the base
    is the reference and no second copy of the weights exists. For `train.run_on_policy`
    with `frozen=lora.frozen(base)` and no `reference`."""

    def lora_rollout_fn(step, adapters, reference, frozen):
        base = frozen["base"]
        reference = combine(switched_off(adapters), base) if with_reference else None
        return rollout_fn(step, combine(adapters, base), reference)

    return lora_rollout_fn


def switched_off(adapters):
    """The adapters with B = 0 (and A = 0): the model then computes exactly the base model,
    which DPO and GRPO use as their reference without a second copy of the weights."""
    return jax.tree.map(jnp.zeros_like, adapters)


def count(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def _dense_kernel(layer) -> jax.Array:
    """A layer's frozen kernel as a float array: dequantised if QLoRA stored it quantised."""
    kernel = layer.kernel
    if isinstance(kernel, nnx.Variable):
        return kernel[...]
    return qwix.dequantize(kernel.array)


def merge(lora_graphdef, adapters, base, *, alpha: float):
    """(graphdef, params) of the plain model, each adapted kernel W + (alpha / rank) A B.

    For QLoRA the base is dequantised first, so the merged model computes what the
    adapted model computes (to float32 rounding) without qwix, ready for
    `hf.save_pretrained` or any code that takes the kit's model.
    """
    adapted = nnx.merge(lora_graphdef, combine(adapters, base))
    plain_graphdef, plain = model.abstract_model(adapted.cfg)  # the plain model's structure, nothing allocated
    pure = nnx.to_pure_dict(base)
    for path, layer in nnx.iter_modules(adapted):
        if not hasattr(layer, "kernel_lora_a"):
            continue
        a, b = layer.kernel_lora_a[...], layer.kernel_lora_b[...]
        node = pure
        for key in path:
            node = node[key]
        # Full float32 precision on every backend: at a TPU's default one bfloat16 pass the
        # export would differ from base + adapters by bfloat16 rounding (lesson 12's check).
        update = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
        node["kernel"] = _dense_kernel(layer) + (alpha / a.shape[-1]) * update
    nnx.replace_by_pure_dict(plain, pure)
    return plain_graphdef, plain
