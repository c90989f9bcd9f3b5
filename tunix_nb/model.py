"""A miniature decoder-only transformer in Flax NNX, and greedy generation.

Pre-norm blocks: RMSNorm -> causal self-attention with rotary position embeddings
(RoPE) -> residual, RMSNorm -> gated (SwiGLU) MLP -> residual; tied input/output
embeddings. The same architecture family as Gemma or Llama, at a size a laptop CPU
trains in seconds.

Steps elsewhere in the kit are pure functions of a parameter pytree, so the module is
split once (`split`) into a static `graphdef` and its `params`, and `apply` merges them
back inside the step. Padding never changes the logits of real tokens: positions count
only real tokens, and padded keys are masked out of attention.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 259  # tunix_nb.tokenizer.ByteTokenizer().vocab_size
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128
    rope_base: float = 10_000.0
    # Compute dtype of every layer. None follows the parameters, so a training step can
    # run in bfloat16 by casting a float32 parameter tree (tunix_nb.train does).
    dtype: str | None = None

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "pick n_heads that divides d_model."
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"RoPE needs an even head size, got {self.d_model // self.n_heads}.")


PRESETS = {
    "tiny": ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64),  # unit tests
    "student": ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=192),
    "teacher": ModelConfig(d_model=128, n_layers=4, n_heads=4, d_ff=384),
}


def get_config(preset: str | ModelConfig, **overrides) -> ModelConfig:
    """A preset by name (or a config), with fields replaced by `overrides`."""
    if isinstance(preset, ModelConfig):
        return dataclasses.replace(preset, **overrides)
    if preset not in PRESETS:
        raise ValueError(f"Unknown model preset {preset!r}; choose one of {sorted(PRESETS)}.")
    return dataclasses.replace(PRESETS[preset], **overrides)


def rope(x_BxLxHxD: jax.Array, positions_BxL: jax.Array, base: float) -> jax.Array:
    """Rotate pairs of features by an angle proportional to the token's position."""
    half = x_BxLxHxD.shape[-1] // 2
    inv_freq_D2 = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BxLxD2 = positions_BxL[..., None].astype(jnp.float32) * inv_freq_D2
    sin, cos = jnp.sin(angle_BxLxD2)[:, :, None, :], jnp.cos(angle_BxLxD2)[:, :, None, :]
    x1, x2 = x_BxLxHxD[..., :half], x_BxLxHxD[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxLxHxD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=cfg.dtype, rngs=rngs)
        self.q = linear(cfg.d_model, cfg.d_model)
        self.k = linear(cfg.d_model, cfg.d_model)
        self.v = linear(cfg.d_model, cfg.d_model)
        self.out = linear(cfg.d_model, cfg.d_model)

    def __call__(self, x_BxLxD, positions_BxL, allowed_BxLxL):
        B, L, D = x_BxLxD.shape
        H = self.cfg.n_heads
        heads = lambda t: t.reshape(B, L, H, D // H)
        q = rope(heads(self.q(x_BxLxD)), positions_BxL, self.cfg.rope_base)
        k = rope(heads(self.k(x_BxLxD)), positions_BxL, self.cfg.rope_base)
        v = heads(self.v(x_BxLxD))
        # Scores and softmax in float32: bfloat16 softmax loses the small weights.
        scores_BxHxLxL = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        scores_BxHxLxL = scores_BxHxLxL / jnp.sqrt(D // H)
        # A large finite value, not -inf: a row with no allowed key stays finite.
        scores_BxHxLxL = jnp.where(allowed_BxLxL[:, None], scores_BxHxLxL, -1e9)
        weights = jax.nn.softmax(scores_BxHxLxL, axis=-1).astype(v.dtype)
        mixed_BxLxHxD = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return self.out(mixed_BxLxHxD.reshape(B, L, D))


class GatedMLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=cfg.dtype, rngs=rngs)
        self.gate = linear(cfg.d_model, cfg.d_ff)
        self.up = linear(cfg.d_model, cfg.d_ff)
        self.down = linear(cfg.d_ff, cfg.d_model)

    def __call__(self, x_BxLxD):
        return self.down(jax.nn.silu(self.gate(x_BxLxD)) * self.up(x_BxLxD))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.mlp = GatedMLP(cfg, rngs=rngs)

    def __call__(self, x_BxLxD, positions_BxL, allowed_BxLxL):
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_BxL, allowed_BxLxL)
        return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))


class Transformer(nnx.Module):
    """tokens [B, L] int32 (+ attention_mask [B, L], 1 = real token) -> logits [B, L, V] float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens_BxL, attention_mask_BxL=None):
        if tokens_BxL.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens_BxL.shape}.")
        if attention_mask_BxL is None:
            attention_mask_BxL = jnp.ones(tokens_BxL.shape, jnp.int32)
        real_BxL = attention_mask_BxL.astype(bool)
        # Positions count real tokens only, so left padding does not shift RoPE.
        positions_BxL = jnp.maximum(jnp.cumsum(real_BxL, axis=-1) - 1, 0)
        L = tokens_BxL.shape[1]
        causal_LxL = jnp.tril(jnp.ones((L, L), bool))
        allowed_BxLxL = causal_LxL[None] & real_BxL[:, None, :]
        x = self.embed(tokens_BxL)
        for block in self.blocks:
            x = block(x, positions_BxL, allowed_BxLxL)
        # Tied output embedding; logits in float32 for the losses.
        return self.embed.attend(self.final_norm(x)).astype(jnp.float32)


def make_model(preset: str | ModelConfig = "student", *, seed: int = 0, **overrides) -> Transformer:
    """A freshly initialised model, e.g. `make_model("teacher", seed=1, dtype="bfloat16")`."""
    return Transformer(get_config(preset, **overrides), rngs=nnx.Rngs(seed))


def split(model: Transformer):
    """(graphdef, params): the static structure and the float32 parameter pytree."""
    return nnx.split(model)


def apply(graphdef, params, tokens_BxL, attention_mask_BxL=None):
    """Pure forward pass: logits [B, L, V] from a parameter pytree."""
    return nnx.merge(graphdef, params)(tokens_BxL, attention_mask_BxL)


def count_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_id", "pad_id"))
def greedy_generate(graphdef, params, prompt_BxP, prompt_mask_BxP, *, max_new_tokens: int,
                    eos_id: int = 2, pad_id: int = 0):
    """Greedy decoding with fixed shapes: returns new tokens [B, max_new_tokens].

    Prompts are left-padded. Each step reruns the model on a fixed [B, P + G] buffer
    (no KV cache): for these small models and short answers that is cheap, and one
    compiled program serves every prompt. After a row emits eos it emits pad.
    """
    B, P = prompt_BxP.shape
    G = max_new_tokens
    tokens = jnp.concatenate([prompt_BxP, jnp.full((B, G), pad_id, prompt_BxP.dtype)], axis=1)
    mask = jnp.concatenate([prompt_mask_BxP, jnp.zeros((B, G), prompt_mask_BxP.dtype)], axis=1)

    def step(i, carry):
        tokens, mask, done = carry
        logits = apply(graphdef, params, tokens, mask)
        next_B = jnp.argmax(logits[:, P + i - 1], axis=-1).astype(tokens.dtype)
        next_B = jnp.where(done, pad_id, next_B)
        tokens = tokens.at[:, P + i].set(next_B)
        mask = mask.at[:, P + i].set(jnp.where(done, 0, 1).astype(mask.dtype))
        return tokens, mask, done | (next_B == eos_id)

    done = jnp.zeros((B,), bool)
    tokens, _, _ = jax.lax.fori_loop(0, G, step, (tokens, mask, done))
    return tokens[:, P:]
