"""Lesson 10 (LoRA and QLoRA): adapter sizes in closed form, why B starts at zero, what
quantising the base costs.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from tunix_nb import checkpoint, compare, data, lora, model, sft
from tunix_nb.tokenizer import ByteTokenizer

PROJECTIONS = ("q", "k", "v", "out", "gate", "up", "down")


def projection_shapes(config: model.ModelConfig) -> dict:
    """(in, out) of each projection LoRA adapts by default, per layer."""
    q, kv = config.n_heads * config.head_size, config.kv_heads * config.head_size
    d, f = config.d_model, config.d_ff
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "out": (q, d), "gate": (d, f), "up": (d, f), "down": (f, d)}


def adapter_params(config: model.ModelConfig, rank: int) -> int:
    """Exercise 1: rank x (in + out) per adapted projection (A is [in, r], B is [r, out]),
    over every layer. Qwen3-0.6B at rank 16: 10,092,544, 1.7% of its 596M parameters."""
    per_layer = sum(rank * (fan_in + fan_out) for fan_in, fan_out in projection_shapes(config).values())
    return config.n_layers * per_layer


def start_with_random_b(rank: int = 16) -> dict:
    """Exercise 2: the largest logit change at the start, with B = 0 (LoRA's choice) and
    with B drawn like A. With B random the "fine-tune" starts from a different model:
    the base's skills are perturbed before the first step, and DPO's reference (the base)
    no longer equals the policy at step 1. "float32_bound": how far two float32 forward passes
    of one model may differ (lesson 10's merge bound): B = 0 gives 0.0 on a CPU, where the
    adapted program computes the base's products alike, and stays within it elsewhere."""
    graphdef, params, meta = checkpoint.load_model(data.DATA_DIR / "sft_student")
    config = model.get_config(checkpoint.model_preset(meta, data.DATA_DIR / "sft_student"))
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=rank)
    tokens = jnp.asarray(data.sft_arrays(data.load_sft()[:16], ByteTokenizer(), 24)["inputs"])
    start = model.apply(graphdef, params, tokens)
    key = jax.random.key(0)

    def draw_b(path, x):  # B gets A's distribution (he_uniform, as qwix draws A)
        if not jax.tree_util.keystr(path).endswith("['kernel_lora_b'].value"):
            return x
        k = jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()))
        return jax.random.uniform(k, x.shape, minval=-1.0, maxval=1.0) * np.sqrt(6 / x.shape[0])

    randomised = jax.tree_util.tree_map_with_path(draw_b, adapters)
    diff = lambda a: float(jnp.abs(model.apply(lora_graphdef, lora.combine(a, base), tokens) - start).max())  # noqa: E731
    terms = compare.forward_pass_terms(config, tokens.shape[1]) + rank
    bound = compare.float32_bound(terms, transcendentals=compare.forward_pass_transcendentals(config))
    return {"b_zero": diff(adapters), "b_random": diff(randomised),
            "float32_bound": bound * float(jnp.abs(start).max())}


def quantisation_cost(n_eval: int = 200) -> dict:
    """Exercise 3: each quantisation's relative kernel error (||W_q - W|| / ||W||, over all
    adapted kernels) and the held-out loss of the quantised base (adapters off)."""
    graphdef, params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    rows = data.sft_arrays(data.load_sft(data.DATA_DIR / "sft_eval.jsonl")[:n_eval], ByteTokenizer(), 24)
    out = {"none": {"kernel_rel_error": 0.0, "eval_loss": sft.eval_loss(graphdef, params, rows)}}
    for quantize in ("int8", "nf4"):
        lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=1, quantize=quantize)
        _, dequantised = lora.merge(lora_graphdef, lora.switched_off(adapters), base, alpha=1.0)
        err2 = norm2 = 0.0
        for (path, w), (_, wq) in zip(jax.tree_util.tree_leaves_with_path(params),
                                      jax.tree_util.tree_leaves_with_path(dequantised)):
            if any(getattr(k, "key", None) == "kernel" for k in path):
                err2 += float(jnp.sum((wq - w) ** 2))
                norm2 += float(jnp.sum(w ** 2))
        out[quantize] = {"kernel_rel_error": (err2 / norm2) ** 0.5,
                         "eval_loss": sft.eval_loss(lora_graphdef, lora.combine(lora.switched_off(adapters), base), rows)}
    return out
