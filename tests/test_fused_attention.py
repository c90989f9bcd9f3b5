"""The fused attention kernel (tunix_nb.fused_attention): the einsums' attention for every real
token, checked here in Pallas's interpreter on the CPU; where the command picks it; and the
model that runs it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import cli, compare, fused_attention, model
from tunix_nb.cli.flags import FlagError


def apart(a, b) -> float:
    """||a - b|| / ||b|| over whole trees."""
    return compare.relative_distance(a, b, jax.tree.map(jnp.zeros_like, b))


def qkv(batch=2, length=256, heads=4, kv_heads=2, head_size=128, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, length, heads, head_size))
    k = jax.random.normal(keys[1], (batch, length, kv_heads, head_size))
    v = jax.random.normal(keys[2], (batch, length, kv_heads, head_size))
    return q, k, v


def padded_segments(batch, length, pad):
    """Row 0 one example; row 1 two packed examples, then `pad` padding tokens."""
    ids = np.ones((batch, length), np.int32)
    ids[1, length // 3:] = 2
    ids[1, length - pad:] = 0
    return jnp.asarray(ids)


def test_the_kernel_is_the_einsums_attention_for_real_tokens():
    """Outputs and gradients for q, k and v, through a cotangent that reads real tokens only,
    within float32's bound for a softmax over 256 keys; the kernel without its 1/sqrt(D) (a
    known-wrong scale) lands over 100 times further."""
    q, k, v = qkv()
    seg_BxL = padded_segments(2, 256, pad=40)
    allowed_BxLxL = model.segment_attention(seg_BxL.shape, None, seg_BxL)[0]
    cotangent = jax.random.normal(jax.random.key(9), q.shape) * (seg_BxL > 0)[:, :, None, None]

    def loss(attention, q, k, v):
        return jnp.sum(attention(q, k, v) * cotangent)

    def grads(attention, q=q):
        with compare.agreement_precision():
            return jax.jit(jax.value_and_grad(lambda *x: loss(attention, *x), argnums=(0, 1, 2)))(q, k, v)

    def kernel(q, k, v):
        return fused_attention.attend(q, k, v, seg_BxL)

    einsums = grads(lambda q, k, v: model.attend(q, k, v, allowed_BxLxL))
    fused = grads(kernel)
    unscaled = grads(kernel, q=q * np.sqrt(128.0))  # the kernel's program again, on queries that undo its scale
    bound = compare.float32_bound(256 * 128)
    distance = max(apart(a, b) for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(einsums)))
    wrong = max(apart(a, b) for a, b in zip(jax.tree.leaves(unscaled), jax.tree.leaves(einsums)))
    assert distance <= bound < wrong / 100, (distance, bound, wrong)


def test_shapes_the_kernel_cannot_take_are_named():
    q, k, v = qkv(length=200)
    assert not fused_attention.applies(q, k) and fused_attention.block_size(200) is None
    with pytest.raises(ValueError, match="length divisible by one of"):
        fused_attention.attend(q, k, v, jnp.ones((2, 200), jnp.int32))
    q, k, v = qkv(length=128, head_size=64)
    assert not fused_attention.applies(q, k)
    assert fused_attention.block_size(1024) == 512 and fused_attention.block_size(384) == 128


@pytest.mark.parametrize("requested, backend, dtype, one_device, chosen", [
    ("auto", "tpu", "bfloat16", True, "splash"),
    ("auto", "tpu", "bfloat16", False, "xla"),
    ("auto", "tpu", "float32", True, "xla"),
    ("auto", "gpu", "bfloat16", True, "xla"),
    ("auto", "cpu", "float32", True, "xla"),
    ("xla", "tpu", "bfloat16", True, "xla"),
    ("splash", "cpu", "float32", True, "splash"),
])
def test_auto_picks_the_kernel_on_one_tpu_computing_in_bfloat16(requested, backend, dtype, one_device, chosen):
    assert fused_attention.choose(requested, compute_dtype=dtype, one_device=one_device, backend=backend)[0] == chosen


def test_the_kernel_on_several_devices_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="use --parallel jit, or --attention xla"):
        fused_attention.choose("splash", compute_dtype="bfloat16", one_device=False)
    with pytest.raises(FlagError, match="--attention: splash attention runs on one device"):
        cli.config_from_argv(["sft", "--model", "tiny", "--steps", "1", "--attention", "splash",
                              "--parallel", "fsdp", "--devices", "2"])


def test_a_model_with_the_kernel_gives_the_einsums_logits_and_gradients():
    """A 2-layer model with heads of 128 over 128 tokens, right-padded: the same logits at real
    tokens and the same loss gradient, within float32's bound for its depth; a pass with a
    cache (decoding) keeps the einsums."""
    cfg = model.ModelConfig(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128, d_ff=256,
                            qk_norm=True)
    graphdef, params = model.split(model.Transformer(cfg, rngs=model.nnx.Rngs(0)))
    fused_graphdef = model.with_attention(graphdef, params, "splash")
    tokens_BxL = jax.random.randint(jax.random.key(1), (2, 128), 0, 259)
    mask_BxL = jnp.ones((2, 128), jnp.int32).at[1, 100:].set(0)

    def loss_and_grad(graphdef):
        def loss(params):
            logits = model.nnx.merge(graphdef, params)(tokens_BxL, mask_BxL)
            return jnp.sum(jax.nn.log_softmax(logits)[..., 7] * mask_BxL), logits
        with compare.agreement_precision():
            return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (loss_x, logits_x), grad_x = loss_and_grad(graphdef)
    (loss_s, logits_s), grad_s = loss_and_grad(fused_graphdef)
    real = mask_BxL.astype(bool)
    bound = compare.float32_bound(compare.forward_pass_terms(cfg, 128),
                                  transcendentals=compare.forward_pass_transcendentals(cfg))
    assert apart(logits_s[real], logits_x[real]) <= bound
    assert apart(grad_s, grad_x) <= bound
    assert all(layer.cfg.attention == "splash" for _, layer in model.nnx.iter_modules(model.nnx.merge(fused_graphdef, params))
               if isinstance(getattr(layer, "cfg", None), model.ModelConfig))
    cache = model.init_cache(fused_graphdef, params, 2, 130)
    # one program, as a sampler runs it (op by op, the pass compiles each op: 3 s against 1)
    extend = jax.jit(lambda params, cache: model.extend(fused_graphdef, params, tokens_BxL, mask_BxL, cache, 0))
    logits, _ = extend(params, cache)
    assert apart(logits[real], logits_x[real]) <= bound


def test_the_model_refuses_an_unknown_attention():
    with pytest.raises(ValueError, match="attention='auto': use 'xla' or 'splash'"):
        model.ModelConfig(attention="auto")


def test_a_plan_for_a_tpu_traces_the_compiled_kernel_on_any_backend(monkeypatch):
    """Under `lowering_for("tpu")` (a memory plan compiling a chip's step ahead of time) the
    kernel is traced for Mosaic, not for Pallas's interpreter, whatever this process's backend;
    outside it, the backend decides."""
    traced = []
    kernel = fused_attention._kernel
    monkeypatch.setattr(fused_attention, "_kernel",
                        lambda length, group, interpret: traced.append(interpret) or kernel(length, group, True))
    q, k, v = qkv(batch=1, length=128)
    segments = jnp.ones((1, 128), jnp.int32)
    with fused_attention.lowering_for("tpu"):  # a new function each time: JAX caches a function's trace
        jax.eval_shape(lambda *x: fused_attention.attend(*x), q, k, v, segments)
    jax.eval_shape(lambda *x: fused_attention.attend(*x), q, k, v, segments)
    assert traced == [False, jax.default_backend() != "tpu"]


def remat_model(policy: str, **overrides):
    """A 2-layer model with heads of 128, splash attention, its blocks rematerialised and scanned."""
    cfg = model.ModelConfig(d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=128, d_ff=128, qk_norm=True,
                            attention="splash", remat=True, scan_layers=True, remat_policy=policy, **overrides)
    return model.split(model.Transformer(cfg, rngs=model.nnx.Rngs(0)))


def splash_loss(graphdef):
    tokens_BxL = jax.random.randint(jax.random.key(1), (2, 128), 0, 259)
    mask_BxL = jnp.ones((2, 128), jnp.int32).at[-1, 100:].set(0)
    return lambda params: jnp.sum(jax.nn.log_softmax(model.nnx.merge(graphdef, params)(tokens_BxL, mask_BxL))[..., 7]
                                  * mask_BxL)


def test_remat_saving_attention_runs_the_forward_kernel_once():
    """The step lowered for a TPU (Mosaic kernels, on any backend): remat recomputes the block,
    splash's forward kernel included, so the backward pass holds a second forward program;
    "save_attention" keeps the kernel's output and statistics, and the backward kernels read them;
    "save_projections" keeps them too."""
    import collections
    import re

    programs = {}
    for policy in ("full", "save_attention", "save_projections"):
        graphdef, params = remat_model(policy, dtype="bfloat16")
        with fused_attention.lowering_for("tpu"):
            text = jax.jit(jax.grad(splash_loss(graphdef))).trace(params).lower(lowering_platforms=("tpu",)).as_text()
        programs[policy] = collections.Counter(re.findall(r"splash_mqa_(fwd|dq|dkv)_segmented", text))
    assert programs["full"] == {"fwd": 2, "dkv": 1}  # the fused backward: one kernel for dq, dk and dv
    assert programs["save_attention"] == programs["save_projections"] == {"fwd": 1, "dkv": 1}


def test_remat_saving_attention_gives_the_same_gradient():
    """Keeping the kernel's residuals changes what the backward pass reads, not what it computes:
    the gradient of a rematerialised attention is the same, bit for bit in Pallas's interpreter.
    (The model passes the policy to its blocks: the lowering test above.)"""
    q, k, v = qkv(batch=1, length=128, heads=1, kv_heads=1)
    segments = jnp.ones((1, 128), jnp.int32)
    cotangent = jax.random.normal(jax.random.key(9), q.shape)
    grads = {}
    for policy in ("full", "save_attention"):
        attention = jax.checkpoint(lambda q, k, v: fused_attention.attend(q, k, v, segments),
                                   policy=model.checkpoint_policy(policy))
        grads[policy] = jax.jit(jax.grad(lambda *x: jnp.sum(attention(*x) * cotangent), argnums=(0, 1, 2)))(q, k, v)
    assert all(np.array_equal(a, b) for a, b in zip(grads["full"], grads["save_attention"]))
    assert min(float(jnp.max(jnp.abs(g))) for g in grads["full"]) > 0


def test_the_remat_policy_is_checked():
    with pytest.raises(ValueError, match="remat_policy must be one of"):
        model.checkpoint_policy("save_everything")
    with pytest.raises(ValueError, match="remat_policy='dots': use one of"):
        model.ModelConfig(remat_policy="dots")
    from tunix_nb.memory_plan import config as plan_config
    with pytest.raises(ValueError, match="PlanConfig.remat_policy='dots'"):
        plan_config.PlanConfig(remat_policy="dots")


def test_the_command_passes_the_remat_policy_to_the_model_and_names_misuse():
    from tunix_nb.cli import models

    config = cli.config_from_argv(["sft", "--model", "tiny", "--steps", "1", "--remat", "--remat-policy",
                                   "save_attention", "--attention", "splash", "--compute-dtype", "bfloat16"])
    graphdef, params, _ = models.build_model(config)
    built = model.nnx.merge(graphdef, params).cfg
    assert (built.remat, built.remat_policy, built.attention) == (True, "save_attention", "splash")
    with pytest.raises(FlagError, match="--remat-policy save_attention says what --remat keeps: add --remat"):
        cli.config_from_argv(["sft", "--model", "tiny", "--steps", "1", "--remat-policy", "save_attention"])
    with pytest.raises(FlagError, match="keeps the splash kernel's output, and this run's attention is XLA's einsums"):
        cli.config_from_argv(["sft", "--model", "tiny", "--steps", "1", "--remat", "--remat-policy", "save_attention",
                              "--attention", "xla"])
