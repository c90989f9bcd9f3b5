"""The kit's decoder-only transformer in Flax NNX, and greedy generation.

Pre-norm blocks: RMSNorm -> causal self-attention with rotary position embeddings
(RoPE) -> residual, RMSNorm -> gated (SwiGLU) MLP -> residual. This is the Llama
family, and a few config fields cover its relatives: grouped-query attention
(`n_kv_heads`), an explicit `head_dim`, biases on q/k/v (Qwen2), RMSNorm on queries and
keys (Qwen3), tied or separate output embeddings, and Llama 3's RoPE scaling. The
presets are miniatures a laptop CPU trains in seconds; `tunix_nb.hf` fills the same
module from a Hugging Face checkpoint.

Steps elsewhere in the kit are pure functions of a parameter pytree, so the module is
split once (`split`) into a static `graphdef` and its `params`, and `apply` merges them
back inside the step. Padding never changes the logits of real tokens: positions count
only real tokens, and padded keys are masked out of attention. Rows that hold several
examples (`tunix_nb.packing`) pass segment ids: a token then attends only within its own
example, and positions restart at 0 for each.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tunix_nb import fused_attention


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1+'s RoPE frequency rewrite (config.json's `rope_type: "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


REMAT_POLICIES = ("full", "save_attention", "save_projections")  # ModelConfig.remat_policy: `checkpoint_policy`
# the name the blocks give the outputs of their q, k, v, attention-output, gate and up projections
# (`jax.ad_checkpoint.checkpoint_name`), which remat's "save_projections" policy keeps: the backward
# pass then recomputes no projection, only elementwise ops (norms, RoPE, SiLU) and, where splash
# does not run, XLA attention's two einsums. The down projection's output is not named: its
# gradient needs only its input.
PROJECTIONS = "projection_outputs"


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
    # The options real checkpoints need (tunix_nb.hf sets them from config.json).
    n_kv_heads: int | None = None  # grouped-query attention; None: one per query head
    head_dim: int | None = None  # None: d_model // n_heads
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each query and key head, before RoPE
    tie_embeddings: bool = True  # False: a separate `lm_head` projects to the vocabulary
    norm_eps: float = 1e-6
    rope_scaling: Llama3RopeScaling | None = None
    # Rematerialisation: keep only each block's input for the backward pass and recompute
    # the block's activations from it (nnx.remat), trading one more forward pass for
    # memory. The same numbers either way; `with_remat` switches it on a built model.
    remat: bool = False
    # Run the blocks as one jax.lax.scan over their stacked parameters: the compiled
    # forward and backward passes hold one block instead of n_layers copies (stacking the
    # per-block trees and the optimizer's update still grow with depth). The same
    # arithmetic (bit for bit on the CPU); passes with a key/value cache (decoding) stay a
    # loop. See `_scan_blocks`.
    scan_layers: bool = False
    # "xla": `attend`'s einsums; "splash": Pallas's fused TPU kernel for the training pass
    # where its shapes apply (`tunix_nb.fused_attention`; the same attention for real tokens).
    # The command picks it with --attention auto on one TPU computing in bfloat16.
    attention: str = "xla"
    # What remat keeps for the backward pass beside each block's input: "full" keeps nothing
    # (every activation recomputed); "save_attention" keeps the fused kernel's output and
    # softmax statistics, so the backward kernels run without a second forward kernel (one
    # [B, H, L, D] array and one [B, H, L] per block). Only the splash kernel names them.
    # "save_projections" keeps those and every projection's output but the MLP's last (`PROJECTIONS`):
    # no projection is recomputed, for Qwen3-0.6B about 11k more values per token per block.
    remat_policy: str = "full"

    def __post_init__(self):
        if self.attention not in ("xla", "splash"):
            raise ValueError(f"attention={self.attention!r}: use 'xla' or 'splash' ('auto' is the command's).")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r}: use one of {REMAT_POLICIES}.")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "pick n_heads that divides d_model, or set head_dim."
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}; "
                "each key/value head must serve the same number of query heads."
            )
        if self.head_size % 2:
            raise ValueError(f"RoPE needs an even head size, got {self.head_size}.")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


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


def llama3_frequencies(inv_freq_D2: jax.Array, s: Llama3RopeScaling) -> jax.Array:
    """Llama 3's rewrite: slow rotations (wavelength above the original context / low
    factor) slow down `factor` times, fast ones stay, and the band between blends."""
    wavelen_D2 = 2 * jnp.pi / inv_freq_D2
    slowed_D2 = jnp.where(wavelen_D2 > s.original_max_position_embeddings / s.low_freq_factor,
                          inv_freq_D2 / s.factor, inv_freq_D2)
    smooth_D2 = ((s.original_max_position_embeddings / wavelen_D2 - s.low_freq_factor)
                 / (s.high_freq_factor - s.low_freq_factor))
    blended_D2 = (1 - smooth_D2) * slowed_D2 / s.factor + smooth_D2 * slowed_D2
    in_band_D2 = ((wavelen_D2 >= s.original_max_position_embeddings / s.high_freq_factor)
                  & (wavelen_D2 <= s.original_max_position_embeddings / s.low_freq_factor))
    return jnp.where(in_band_D2, blended_D2, slowed_D2)


def rope(x_BxLxHxD: jax.Array, positions_BxL: jax.Array, base: float,
         scaling: Llama3RopeScaling | None = None) -> jax.Array:
    """Rotate pairs of features by an angle proportional to the token's position.

    The pairs are (i, i + D/2), "rotate half" as in Llama and Hugging Face, so a
    checkpoint's q and k projections load without permuting rows.
    """
    half = x_BxLxHxD.shape[-1] // 2
    inv_freq_D2 = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is not None:
        inv_freq_D2 = llama3_frequencies(inv_freq_D2, scaling)
    angle_BxLxD2 = positions_BxL[..., None].astype(jnp.float32) * inv_freq_D2
    # Angles in float32 (a bfloat16 position times a frequency loses the position), the
    # rotation in x's dtype, as Hugging Face casts cos and sin to it: in bfloat16 compute no
    # float32 copy of q or k is made (those copies took 0.009 s of a Qwen3-0.6B LoRA step on
    # a v5e chip at ff4fda4, results/tpu_v5e_training/fused_backward_ff4fda4.json).
    sin_BxLx1xD2 = jnp.sin(angle_BxLxD2)[:, :, None, :].astype(x_BxLxHxD.dtype)
    cos_BxLx1xD2 = jnp.cos(angle_BxLxD2)[:, :, None, :].astype(x_BxLxHxD.dtype)
    x1, x2 = x_BxLxHxD[..., :half], x_BxLxHxD[..., half:]
    return jnp.concatenate([x1 * cos_BxLx1xD2 - x2 * sin_BxLx1xD2,
                            x2 * cos_BxLx1xD2 + x1 * sin_BxLx1xD2], axis=-1)


def attend(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, allowed_BxLxS):
    """Each query's softmax-weighted mix of the values whose keys it may see -> [B, L, H, D].

    The one copy of the attention math: the full forward pass (S = L) and decoding
    against a key/value cache (S = cache length) both call it. With grouped-query
    attention the K key/value heads each serve H / K consecutive query heads, as in
    Hugging Face's `repeat_kv`; the cache stores only the K heads.
    """
    group = q_BxLxHxD.shape[2] // k_BxSxKxD.shape[2]
    k_BxSxHxD = jnp.repeat(k_BxSxKxD, group, axis=2)
    v_BxSxHxD = jnp.repeat(v_BxSxKxD, group, axis=2)
    scores_BxHxLxS = jnp.einsum("bqhd,bkhd->bhqk", q_BxLxHxD, k_BxSxHxD)
    if jnp.finfo(scores_BxHxLxS.dtype).bits < 32:
        # bfloat16 compute: no float32 [B, H, L, S] array at all (jax.nn.dot_product_attention's
        # XLA path makes one: its logits are float32). The scores stay bfloat16, as
        # transformers' eager attention keeps them, and the softmax runs in float32 inside it.
        scores_BxHxLxS = jnp.where(allowed_BxLxS[:, None], scores_BxHxLxS / jnp.sqrt(q_BxLxHxD.shape[-1]), -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", low_precision_softmax(scores_BxHxLxS), v_BxSxHxD)
    # Scores and softmax in float32: bfloat16 softmax loses the small weights.
    scores_BxHxLxS = scores_BxHxLxS.astype(jnp.float32)
    scores_BxHxLxS = scores_BxHxLxS / jnp.sqrt(q_BxLxHxD.shape[-1])
    # A large finite value, not -inf: a row with no allowed key stays finite.
    scores_BxHxLxS = jnp.where(allowed_BxLxS[:, None], scores_BxHxLxS, -1e9)
    weights = jax.nn.softmax(scores_BxHxLxS, axis=-1).astype(v_BxSxHxD.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v_BxSxHxD)


@jax.custom_vjp
def low_precision_softmax(scores_BxHxLxS: jax.Array) -> jax.Array:
    """softmax over the last axis of low-precision (bfloat16) scores, computed in float32
    and returned in the scores' dtype.

    The backward pass keeps only these low-precision weights w (autodiff of a float32
    softmax would keep its float32 output) and computes w * (g - sum(w * g)) in float32
    from them, so every [B, H, L, S] array the step stores is in the compute dtype.
    """
    return jax.nn.softmax(scores_BxHxLxS.astype(jnp.float32), axis=-1).astype(scores_BxHxLxS.dtype)


def _low_precision_softmax_fwd(scores_BxHxLxS):
    weights = low_precision_softmax(scores_BxHxLxS)
    return weights, weights


def _low_precision_softmax_bwd(weights, grad_weights):
    w, g = weights.astype(jnp.float32), grad_weights.astype(jnp.float32)
    return ((w * (g - jnp.sum(w * g, axis=-1, keepdims=True))).astype(weights.dtype),)


low_precision_softmax.defvjp(_low_precision_softmax_fwd, _low_precision_softmax_bwd)


def per_token(layer, x_BxLxD: jax.Array) -> jax.Array:
    """`layer` applied to each token, with the tokens laid out as one [B*L, D] matrix.

    The same numbers as `layer(x_BxLxD)`, but the weight gradient then contracts over one
    axis instead of two (batch and length). XLA's CPU backend canonicalises a two-axis
    contraction by copying the upstream gradient into a transposed layout, and fuses that
    copy into the elementwise loop before it (the SiLU gradient in the MLP), which then
    writes with a stride: 19% of a training step's time in the benchmark's profile
    (`python -m tunix_nb.bench --only mfu`). A reshape costs nothing on any backend.
    """
    *lead, d = x_BxLxD.shape
    return layer(x_BxLxD.reshape(-1, d)).reshape(*lead, -1)


def rms_norm(size: int, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(size, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        linear = functools.partial(nnx.Linear, dtype=cfg.dtype, rngs=rngs)
        q_size, kv_size = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
        self.q = linear(cfg.d_model, q_size, use_bias=cfg.qkv_bias)
        self.k = linear(cfg.d_model, kv_size, use_bias=cfg.qkv_bias)
        self.v = linear(cfg.d_model, kv_size, use_bias=cfg.qkv_bias)
        self.out = linear(q_size, cfg.d_model, use_bias=False)
        self.q_norm = rms_norm(cfg.head_size, cfg, rngs) if cfg.qk_norm else None
        self.k_norm = rms_norm(cfg.head_size, cfg, rngs) if cfg.qk_norm else None

    def _heads(self, projection, norm, x_BxLxD, n_heads):
        """Project to [B, L, n_heads, head_size], then RMSNorm each head if the model has q/k norms."""
        B, L, _ = x_BxLxD.shape
        projected_BxLxF = checkpoint_name(per_token(projection, x_BxLxD), PROJECTIONS)
        heads_BxLxHxD = projected_BxLxF.reshape(B, L, n_heads, self.cfg.head_size)
        return heads_BxLxHxD if norm is None else norm(heads_BxLxHxD)

    def __call__(self, x_BxLxD, positions_BxL, allowed_BxLxS, cache=None, index=None):
        """(output [B, L, D], cache). Without a cache the L tokens attend to each other
        (S = L); with one, their keys and values are written into the cache's slots
        [index, index + L) and the queries attend to all S slots (`allowed` says which)."""
        cfg = self.cfg
        B, L, _ = x_BxLxD.shape
        q = rope(self._heads(self.q, self.q_norm, x_BxLxD, cfg.n_heads), positions_BxL, cfg.rope_base, cfg.rope_scaling)
        k = rope(self._heads(self.k, self.k_norm, x_BxLxD, cfg.kv_heads), positions_BxL, cfg.rope_base, cfg.rope_scaling)
        v = self._heads(self.v, None, x_BxLxD, cfg.kv_heads)
        if cache is not None:
            at = (0, index, 0, 0)
            cache = {"k": jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), at),
                     "v": jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), at)}
            k, v = cache["k"], cache["v"]
        if isinstance(allowed_BxLxS, SelfAttentionMask):  # a pass without a cache
            if cfg.attention == "splash" and fused_attention.applies(q, k):
                mixed_BxLxHxD = fused_attention.attend(q, k, v, allowed_BxLxS.segment_ids_BxL)
            else:
                mixed_BxLxHxD = attend(q, k, v, allowed_BxLxS.allowed_BxLxL)
        else:
            mixed_BxLxHxD = attend(q, k, v, allowed_BxLxS)
        return checkpoint_name(per_token(self.out, mixed_BxLxHxD.reshape(B, L, -1)), PROJECTIONS), cache


class GatedMLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=cfg.dtype, rngs=rngs)
        self.gate = linear(cfg.d_model, cfg.d_ff)
        self.up = linear(cfg.d_model, cfg.d_ff)
        self.down = linear(cfg.d_ff, cfg.d_model)

    def __call__(self, x_BxLxD):
        return per_token(self._mlp, x_BxLxD)

    def _mlp(self, x_NxD):
        gate_NxF, up_NxF = (checkpoint_name(projection(x_NxD), PROJECTIONS) for projection in (self.gate, self.up))
        return self.down(jax.nn.silu(gate_NxF) * up_NxF)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = rms_norm(cfg.d_model, cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = rms_norm(cfg.d_model, cfg, rngs)
        self.mlp = GatedMLP(cfg, rngs=rngs)

    def __call__(self, x_BxLxD, positions_BxL, allowed_BxLxS, cache=None, index=None):
        """(output [B, L, D], cache): see `Attention`."""
        mixed_BxLxD, cache = self.attn(self.attn_norm(x_BxLxD), positions_BxL, allowed_BxLxS, cache, index)
        x_BxLxD = x_BxLxD + mixed_BxLxD
        return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD)), cache


def checkpoint_policy(remat_policy: str):
    """`jax.checkpoint`'s policy for `ModelConfig.remat_policy`: None recomputes everything."""
    if remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy must be one of {REMAT_POLICIES}, got {remat_policy!r}")
    if remat_policy == "full":
        return None
    if remat_policy == "save_projections":
        return jax.checkpoint_policies.save_only_these_names(fused_attention.RESIDUALS, PROJECTIONS)
    return jax.checkpoint_policies.save_only_these_names(fused_attention.RESIDUALS)


def _remat_block(block, x_BxLxD, positions_BxL, allowed_BxLxS, policy=None):
    """One block whose activations the backward pass recomputes instead of storing, but for
    what `policy` (`checkpoint_policy`) keeps.

    jax.checkpoint on the block as a pure function of its state (what nnx.remat does,
    written out): LoRA layers from qwix then compose with it as well.
    """
    graphdef, state = nnx.split(block)

    def run(state, x_BxLxD, positions_BxL, allowed_BxLxS):
        return nnx.merge(graphdef, state)(x_BxLxD, positions_BxL, allowed_BxLxS)[0]

    return jax.checkpoint(run, policy=policy)(state, x_BxLxD, positions_BxL, allowed_BxLxS)


def _qwix_paths_as_block_zero(blocks) -> list:
    """qwix (LoRA, QLoRA) names each module it adapts by its path, the block's index included,
    which would make every block's structure another: they are named as block 0's while the
    blocks are split for the scan, then renamed back (the returned (module, path) pairs). qwix
    finds the rule of a call by that name; one provider's rule matched the same modules in
    every block whose structure is the same, so block 0's name finds the same rule."""
    renamed = []
    for block in blocks:
        for _, module in nnx.iter_modules(block):
            path = getattr(module, "qwix_path", None)
            if isinstance(path, tuple) and len(path) > 1 and path[0] == "blocks" and path[1] != 0:
                renamed.append((module, path))
                module.qwix_path = (path[0], 0, *path[2:])
    return renamed


def _scan_blocks(blocks, x_BxLxD, positions_BxL, allowed_BxLxS, *, remat: bool, policy=None):
    """The blocks applied in turn, as one `jax.lax.scan` over their parameters stacked on a
    leading layer axis ([n_layers, ...] per leaf), with `jax.checkpoint` inside under remat
    (keeping what `policy` keeps).

    The parameters stay one tree per block, as Hugging Face, PEFT, Orbax and the lessons
    name them: the stack is built inside the step. Where parameters are cast for compute
    (float32 kept, bfloat16 computed) the stack fuses with that cast; a tree kept in the
    compute dtype (a bfloat16 frozen base) is copied once more, and XLA's memory analysis
    of the step counts that copy. Blocks of different structure (an adapter on some layers
    only) cannot share one body: they run as a loop, as do blocks that change the dtype they
    carry.
    """
    renamed = _qwix_paths_as_block_zero(blocks)
    try:
        graphdefs, states = zip(*(nnx.split(block) for block in blocks))
    finally:
        for module, path in renamed:
            module.qwix_path = path

    def one_block(x_BxLxD, state):
        return nnx.merge(graphdefs[0], state)(x_BxLxD, positions_BxL, allowed_BxLxS)[0], None

    same_body = all(graphdef == graphdefs[0] for graphdef in graphdefs[1:])
    # a block whose output dtype is not its input's (bfloat16 in, float32 adapters out, no
    # compute dtype) cannot be a scan's carry: the loop promotes after the first block
    if not same_body or jax.eval_shape(one_block, x_BxLxD, states[0])[0].dtype != x_BxLxD.dtype:
        for block in blocks:
            x_BxLxD = (_remat_block(block, x_BxLxD, positions_BxL, allowed_BxLxS, policy) if remat
                       else block(x_BxLxD, positions_BxL, allowed_BxLxS)[0])
        return x_BxLxD
    stacked_states = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)
    body = jax.checkpoint(one_block, policy=policy) if remat else one_block
    return jax.lax.scan(body, x_BxLxD, stacked_states)[0]


class SelfAttentionMask(NamedTuple):
    """A pass without a cache says who sees whom twice: as the [B, L, L] matrix `attend` reads
    and as the segment ids [B, L] (0 = padding) the fused kernel reads. XLA drops the unused one."""

    allowed_BxLxL: jax.Array
    segment_ids_BxL: jax.Array


def real_segment_ids(shape_BxL, attention_mask_BxL=None, segment_ids_BxL=None):
    """Segment ids [B, L] with padding 0: the given ones (one segment of 1s without), zeroed
    where the attention mask is 0."""
    if segment_ids_BxL is None:
        segment_ids_BxL = jnp.ones(shape_BxL, jnp.int32) if attention_mask_BxL is None else attention_mask_BxL
    segment_ids_BxL = jnp.asarray(segment_ids_BxL)
    if segment_ids_BxL.shape != tuple(shape_BxL):
        raise ValueError(f"segment_ids has shape {segment_ids_BxL.shape} but tokens have shape {tuple(shape_BxL)}; "
                         "give one segment id per token (tunix_nb.packing builds them).")
    if attention_mask_BxL is not None:
        segment_ids_BxL = jnp.where(jnp.asarray(attention_mask_BxL) > 0, segment_ids_BxL, 0)
    return segment_ids_BxL.astype(jnp.int32)


def segment_attention(shape_BxL, attention_mask_BxL=None, segment_ids_BxL=None, positions_BxL=None):
    """(allowed [B, L, L], positions [B, L]) for rows that hold several examples.

    A query sees a key when the key is not after it and both carry the same segment id
    (0 is padding: never seen). Without positions, a token's position counts the earlier
    tokens of its own segment, so RoPE restarts at 0 for each example. Without segment
    ids the attention mask is the one segment (1 = real token).
    """
    B, L = shape_BxL
    segment_ids_BxL = real_segment_ids(shape_BxL, attention_mask_BxL, segment_ids_BxL)
    causal_LxL = jnp.tril(jnp.ones((L, L), bool))
    same_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    allowed_BxLxL = causal_LxL[None] & same_BxLxL & (segment_ids_BxL > 0)[:, None, :]
    if positions_BxL is None:
        positions_BxL = jnp.maximum(jnp.sum(allowed_BxLxL, axis=-1) - 1, 0)
    elif jnp.shape(positions_BxL) != (B, L):
        raise ValueError(f"positions has shape {jnp.shape(positions_BxL)} but tokens have shape {(B, L)}; "
                         "give one position per token.")
    return allowed_BxLxL, positions_BxL


class Transformer(nnx.Module):
    """tokens [B, L] int32 (+ attention_mask [B, L], 1 = real token) -> logits [B, L, V] float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = rms_norm(cfg.d_model, cfg, rngs)
        self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
            cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens_BxL, attention_mask_BxL=None, *, segment_ids_BxL=None, positions_BxL=None,
                 entry=None, **entry_kwargs):
        """Logits [B, L, V] float32. `segment_ids_BxL` (packed rows, `tunix_nb.packing`): a
        token attends only to earlier tokens of its own segment (1, 2, ...; 0 is padding),
        and positions restart per segment unless `positions_BxL` gives them.

        `entry` ("hidden_states" or "extend") runs that pass instead, inside this call:
        qwix's LoRA and QLoRA intercept `__call__` only, so a pass that entered the model
        by another method would compute the base model without its adapters.
        """
        if entry == "extend":
            return self.extend(tokens_BxL, attention_mask_BxL, **entry_kwargs)
        hidden_BxLxD = self.hidden_states(tokens_BxL, attention_mask_BxL, segment_ids_BxL=segment_ids_BxL,
                                          positions_BxL=positions_BxL)
        if entry == "hidden_states":
            return hidden_BxLxD
        if entry is not None:
            raise ValueError(f"entry={entry!r}: use None (logits), 'hidden_states' or 'extend'")
        return self.project(hidden_BxLxD)

    def hidden_states(self, tokens_BxL, attention_mask_BxL=None, *, segment_ids_BxL=None, positions_BxL=None):
        """The final-normed hidden states [B, L, D] in the compute dtype: everything but the head.

        `project` turns them into logits; a loss that reads a few positions, or the
        vocabulary in chunks (`tunix_nb.vocab_chunks`), projects only what it needs.
        """
        if tokens_BxL.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens_BxL.shape}.")
        if segment_ids_BxL is not None or positions_BxL is not None:
            allowed_BxLxL, positions_BxL = segment_attention(
                tokens_BxL.shape, attention_mask_BxL, segment_ids_BxL, positions_BxL)
            mask = SelfAttentionMask(allowed_BxLxL, real_segment_ids(tokens_BxL.shape, attention_mask_BxL,
                                                                      segment_ids_BxL))
            return self._hidden(tokens_BxL, positions_BxL, mask)[0]
        if attention_mask_BxL is None:
            attention_mask_BxL = jnp.ones(tokens_BxL.shape, jnp.int32)
        real_BxL = attention_mask_BxL.astype(bool)
        # Positions count real tokens only, so left padding does not shift RoPE.
        positions_BxL = jnp.maximum(jnp.cumsum(real_BxL, axis=-1) - 1, 0)
        L = tokens_BxL.shape[1]
        causal_LxL = jnp.tril(jnp.ones((L, L), bool))
        allowed_BxLxL = causal_LxL[None] & real_BxL[:, None, :]
        mask = SelfAttentionMask(allowed_BxLxL, real_BxL.astype(jnp.int32))
        return self._hidden(tokens_BxL, positions_BxL, mask)[0]

    def project(self, x_BxLxD):
        """The output head: hidden states [..., D] -> logits [..., V] float32 (tied embedding or lm_head)."""
        logits = self.embed.attend(x_BxLxD) if self.lm_head is None else self.lm_head(x_BxLxD)
        # Logits in float32 for the losses.
        return logits.astype(jnp.float32)

    def head_weight(self):
        """The head's weight as [V, D] (the tied embedding, or lm_head's kernel transposed):
        logits = x @ weight.T, what `project` computes, for a loss that slices the vocabulary."""
        head = self.embed if self.lm_head is None else self.lm_head
        weight = self.embed.embedding[...] if self.lm_head is None else self.lm_head.kernel[...]
        # An adapter or a quantised kernel on the head would be bypassed by slicing its weight.
        if jax.tree.leaves(nnx.state(head, nnx.LoRAParam)) or not isinstance(weight, jax.Array) or weight.ndim != 2:
            raise ValueError("the output head carries an adapter or a quantised kernel: leave the embedding and "
                             "lm_head out of the LoRA targets (lora.DEFAULT_TARGETS does), or use vocab_chunk=None.")
        return weight if self.lm_head is None else weight.T

    def _run(self, tokens_BxL, positions_BxL, allowed_BxLxS, caches=None, index=None, last_only=False):
        """(logits [B, L, V] float32 (L = 1 with `last_only`), the caches with these tokens written in, or None)."""
        x, caches = self._hidden(tokens_BxL, positions_BxL, allowed_BxLxS, caches, index)
        return self.project(x[:, -1:] if last_only else x), caches

    def _hidden(self, tokens_BxL, positions_BxL, allowed_BxLxS, caches=None, index=None):
        """(final-normed hidden states [B, L, D], the caches with these tokens written in, or None)."""
        x = self.embed(tokens_BxL)
        if self.cfg.dtype is None:  # compute follows the params: nnx.Embed fixed float32 when it was built
            x = x.astype(jnp.result_type(self.embed.embedding[...]))
        policy = checkpoint_policy(self.cfg.remat_policy)
        if caches is None and self.cfg.scan_layers and len(self.blocks) > 1:
            x = _scan_blocks(self.blocks, x, positions_BxL, allowed_BxLxS, remat=self.cfg.remat, policy=policy)
            caches = [None]
        elif caches is None and self.cfg.remat:  # a training pass: no cache to fill
            for block in self.blocks:
                x = _remat_block(block, x, positions_BxL, allowed_BxLxS, policy)
            caches = [None]
        else:
            caches = [None] * len(self.blocks) if caches is None else list(caches)
            for i, block in enumerate(self.blocks):
                x, caches[i] = block(x, positions_BxL, allowed_BxLxS, caches[i], index)
        return self.final_norm(x), None if caches[0] is None else caches

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """An empty key/value cache of `max_len` slots per row, in the compute dtype.

        {"layers": [{"k", "v": [B, S, K, D]} per block], "mask": [B, S] (1 = slot holds a
        real token)}, with K the key/value heads.
        """
        cfg = self.cfg
        dtype = cfg.dtype or self.embed.embedding[...].dtype
        shape = (batch_size, max_len, cfg.kv_heads, cfg.head_size)
        layers = [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in self.blocks]
        return {"layers": layers, "mask": jnp.zeros((batch_size, max_len), jnp.int32)}

    def extend(self, tokens_BxL, attention_mask_BxL, cache, index, *, last_only=False):
        """Run L new tokens against a cache holding slots [0, index): (logits [B, L, V], cache).

        `last_only`: logits of the last position only, [B, 1, V] (a prefill samples from
        nothing else, so the other L - 1 positions get no logits).

        Writes the tokens into slots [index, index + L). Positions and masking are those
        `__call__` gives the same tokens in one sequence (positions count real tokens, a
        query sees itself and the real tokens before it), so prefill then decoding one
        token at a time reproduces the full forward pass.
        """
        L, S = tokens_BxL.shape[1], cache["mask"].shape[1]
        real_BxL = attention_mask_BxL.astype(jnp.int32)
        # Slots >= index are still empty (0), so this counts the real tokens before index.
        before_B = jnp.sum(cache["mask"], axis=-1)
        positions_BxL = jnp.maximum(before_B[:, None] + jnp.cumsum(real_BxL, axis=-1) - 1, 0)
        mask_BxS = jax.lax.dynamic_update_slice(cache["mask"], real_BxL, (0, index))
        causal_LxS = jnp.arange(S)[None, :] <= index + jnp.arange(L)[:, None]
        allowed_BxLxS = causal_LxS[None] & mask_BxS.astype(bool)[:, None, :]
        logits, layers = self._run(tokens_BxL, positions_BxL, allowed_BxLxS, cache["layers"], index, last_only)
        return logits, {"layers": layers, "mask": mask_BxS}


def make_model(preset: str | ModelConfig = "student", *, seed: int = 0, **overrides) -> Transformer:
    """A freshly initialised model, e.g. `make_model("teacher", seed=1, dtype="bfloat16")`."""
    return Transformer(get_config(preset, **overrides), rngs=nnx.Rngs(seed))


def split(model: Transformer):
    """(graphdef, params): the static structure and the float32 parameter pytree."""
    return nnx.split(model)


def abstract_model(config: ModelConfig):
    """(graphdef, params of ShapeDtypeStructs): the model's structure, nothing allocated."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))


def apply(graphdef, params, tokens_BxL, attention_mask_BxL=None, *, segment_ids_BxL=None, positions_BxL=None):
    """Pure forward pass: logits [B, L, V] from a parameter pytree (packed rows: see
    `Transformer.__call__`). Called outside a traced function, it runs as one compiled
    program (see `_forward`)."""
    return _forward(graphdef, params, tokens_BxL, attention_mask_BxL, segment_ids_BxL, positions_BxL, None)


def hidden_states(graphdef, params, tokens_BxL, attention_mask_BxL=None, *, segment_ids_BxL=None,
                  positions_BxL=None):
    """Pure forward pass up to the final norm: hidden states [B, L, D] (see `Transformer.hidden_states`)."""
    return _forward(graphdef, params, tokens_BxL, attention_mask_BxL, segment_ids_BxL, positions_BxL,
                    "hidden_states")


def _merged_call(graphdef, params, tokens_BxL, attention_mask_BxL, segment_ids_BxL, positions_BxL, entry):
    return nnx.merge(graphdef, params)(tokens_BxL, attention_mask_BxL, segment_ids_BxL=segment_ids_BxL,
                                       positions_BxL=positions_BxL, entry=entry)


_merged_call_jit = jax.jit(_merged_call, static_argnums=(0, 6))


def _forward(graphdef, params, *arrays_and_entry):
    """The merged module's call; jitted when nothing is being traced.

    Eagerly, every operation of the pass is its own small program: a first call
    compiles about a hundred of them, each 3 to 12 times slower to compile on a TPU than
    on a CPU. One jitted program compiles once per shape. Inside a traced function (a
    step, `jax.grad`, `vmap`) the operations join the caller's program as they are.
    """
    inputs = (params, arrays_and_entry[:-1])
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(inputs)):
        return _merged_call(graphdef, params, *arrays_and_entry)
    return _merged_call_jit(graphdef, params, *arrays_and_entry)


def segment_keywords(batch) -> dict:
    """A packed batch's segment ids and positions (`tunix_nb.packing`) as `apply`'s and
    `hidden_states`' keywords; {} for plain rows, which the model then reads as before."""
    if "segment_ids" not in batch:
        return {}
    return {"segment_ids_BxL": batch["segment_ids"], "positions_BxL": batch["positions"]}


class OutputHead(NamedTuple):
    """The output projection, for losses that compute logits where and as they need them.

    `project(x [..., D]) -> logits [..., V] float32` is exactly the model's own head;
    `weight_VxD` is its weight (logits = x @ weight.T) in the parameters' dtype, and
    `dtype` the compute dtype of the product (None: promote x and the weight).
    """

    project: Callable
    weight_VxD: jax.Array
    dtype: Any


def output_head(graphdef, params) -> OutputHead:
    """The model's output head (tied embedding or lm_head) from a parameter pytree."""
    module = nnx.merge(graphdef, params)
    return OutputHead(module.project, module.head_weight(), module.cfg.dtype)


def init_cache(graphdef, params, batch_size: int, max_len: int) -> dict:
    """An empty key/value cache for `extend` (see `Transformer.init_cache`)."""
    return nnx.merge(graphdef, params).init_cache(batch_size, max_len)


def extend(graphdef, params, tokens_BxL, attention_mask_BxL, cache, index, *, last_only=False):
    """Pure cached forward pass: (logits [B, L, V] or [B, 1, V] with `last_only`, cache)
    (see `Transformer.extend`)."""
    return nnx.merge(graphdef, params)(tokens_BxL, attention_mask_BxL, entry="extend", cache=cache, index=index,
                                       last_only=last_only)


def with_remat(graphdef, params, remat: bool = True):
    """The graphdef of the same model with rematerialisation on (or off): same params."""
    module = nnx.merge(graphdef, params)
    module.cfg = dataclasses.replace(module.cfg, remat=remat)
    return nnx.split(module)[0]


def with_attention(graphdef, params, attention: str):
    """The graphdef of the same model whose attention layers run `attention` ("xla" or
    "splash"; see ModelConfig.attention): same params. Each layer reads its own config."""
    module = nnx.merge(graphdef, params)
    for _, layer in nnx.iter_modules(module):
        if isinstance(getattr(layer, "cfg", None), ModelConfig):
            layer.cfg = dataclasses.replace(layer.cfg, attention=attention)
    return nnx.split(module)[0]


def param_name(path) -> str:
    """'blocks/0/attn/k/kernel': the '/'-joined name of a parameter's path in a pytree, the
    same for int and str dict keys, attributes and indices, and without the trailing
    `.value` of an nnx.State leaf (what Orbax's checkpoints and `tunix_nb.hf` name)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return "/".join(parts[:-1] if parts and parts[-1] == "value" else parts)


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
