"""Lesson 09 (real checkpoints): parameters from config.json alone, exporting the kit's
student as a Llama checkpoint, untying an output layer.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_nb import checkpoint, data, hf, model

# Qwen3-0.6B's config.json (the fields that set its sizes), as published on the Hub.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "use_sliding_window": False,
}


def param_count(hf_config: dict) -> dict:
    """Exercise 1: parameters of a checkpoint from its config.json alone (nothing allocated),
    and the memory a full AdamW fine-tune in float32 needs for its state.

    For Qwen3-0.6B: 596,049,920 parameters, 440,467,456 without the embedding (the model
    card says 0.6B and 0.44B); weights + gradients + Adam's two moments at 4 bytes each
    are 16 bytes per parameter: 9.5 GB before activations.
    """
    _, abstract = hf.abstract_model(hf.model_config(hf_config))
    sizes = {hf.kit_name(p): x.size for p, x in jax.tree_util.tree_leaves_with_path(abstract)}
    total = sum(sizes.values())
    return {"params": total, "non_embedding": total - sizes["embed/embedding"],
            "adamw_float32_gb": total * 16 / 1e9}


def export_student(out_dir) -> Path:
    """Exercise 2: the kit's trained SFT student as a Hugging Face Llama checkpoint.

    The presets are tied-embedding Llamas with RMSNorm epsilon 1e-6 and RoPE base 1e4, so
    `save_pretrained` needs nothing but the preset's config; transformers then computes
    the same logits (recorded by tests/fixtures/hf/make_fixtures.py: 6.2e-06).
    """
    graphdef, params, meta = checkpoint.load_model(data.DATA_DIR / "sft_student")
    config = model.get_config(checkpoint.model_preset(meta))
    return hf.save_pretrained(out_dir, graphdef, params, config,
                              extra_config={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})


def untie(graphdef, params, config: model.ModelConfig):
    """Exercise 3: the same function with a separate output layer: (graphdef, params, config).

    The tied model's logits are x @ embedding.T, so `lm_head.kernel = embedding.T` gives
    the same logits; the two can then be trained apart, and the checkpoint gains
    `lm_head.weight` (twice the embedding memory for a model with a large vocabulary).
    """
    untied = model.get_config(config, tie_embeddings=False)
    new_graphdef, abstract = hf.abstract_model(untied)
    pure = nnx.to_pure_dict(params)
    pure["lm_head"] = {"kernel": jnp.asarray(pure["embed"]["embedding"]).T}
    nnx.replace_by_pure_dict(abstract, pure)  # fills the abstract tree in place
    return new_graphdef, abstract, untied
