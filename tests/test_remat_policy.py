"""Remat's "save_projections" policy (issue 47, item 5): the blocks name their projections'
outputs, remat keeps them, and the backward pass recomputes no matmul, for the same gradient."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import cli, model
from tunix_nb.cli.flags import FlagError


def small_model(remat: bool, policy: str = "full", scan_layers: bool = False):
    """A 2-layer Qwen3-shaped model (q/k norms, grouped heads) computing in float32, XLA's attention."""
    cfg = model.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, qk_norm=True,
                            remat=remat, remat_policy=policy, scan_layers=scan_layers)
    return model.split(model.Transformer(cfg, rngs=model.nnx.Rngs(0)))


def loss_of(graphdef):
    tokens_BxL = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    mask_BxL = jnp.ones((2, 16), jnp.int32).at[-1, 12:].set(0)
    return lambda params: jnp.sum(jax.nn.log_softmax(model.nnx.merge(graphdef, params)(tokens_BxL, mask_BxL))[..., 3]
                                  * mask_BxL)


def gradient_program(graphdef, params):
    """The gradient's program as JAX hands it to XLA: remat's recomputation is already in it
    (JAX applies the policy as it traces, and fences each recomputed block from XLA's common
    subexpressions), and so is the pruning of what the backward pass does not need."""
    return jax.jit(jax.grad(loss_of(graphdef))).lower(params)


def matmuls_in(program_text: str) -> int:
    """The dots in a program's text, lowered (StableHLO's dot_general) or compiled (HLO's dot)."""
    return len(re.findall(r"stablehlo\.dot_general|\sdot\(", program_text))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_saving_the_projections_recomputes_no_projection(scan_layers):
    """Full remat recomputes eight matmuls per block in the backward pass (q, k, v, attention's
    scores and weighted sum, attention output, gate, up; not down, whose output the backward
    does not need). "save_projections" keeps six of their outputs, so only XLA attention's two
    einsums run again (splash attention keeps its output too: test_fused_attention). Scanned, the
    program holds one block, so the counts are per block. Counted in the programs JAX lowers, and
    checked once against the program XLA compiles for this CPU, full remat's: the same dots,
    none merged away or added."""
    blocks = 1 if scan_layers else 2
    programs = {name: gradient_program(*small_model(remat, policy, scan_layers))
                for name, remat, policy in (("none", False, "full"), ("full", True, "full"),
                                            ("save_projections", True, "save_projections"))}
    counts = {name: matmuls_in(program.as_text()) for name, program in programs.items()}
    assert counts["full"] - counts["none"] == 8 * blocks, counts
    assert counts["save_projections"] - counts["none"] == 2 * blocks, counts
    if not scan_layers:  # the program the next test compiles and runs too
        assert matmuls_in(programs["full"].compile().as_text()) == counts["full"]


def test_saving_the_projections_gives_the_same_gradient():
    """What remat keeps changes what the backward pass reads, not what it computes: the
    gradient under "save_projections" equals full remat's and no remat's on the CPU in float32."""
    grads = {}
    for name, remat, policy in (("none", False, "full"), ("full", True, "full"),
                                ("save_projections", True, "save_projections")):
        graphdef, params = small_model(remat, policy)
        grads[name] = jax.tree.leaves(jax.jit(jax.grad(loss_of(graphdef)))(params))
    for name in ("full", "save_projections"):
        for got, want in zip(grads[name], grads["none"]):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert max(float(jnp.max(jnp.abs(g))) for g in grads["none"]) > 0


def test_the_command_passes_save_projections_on_any_attention():
    """Unlike save_attention, the projections are named whatever the attention: XLA's einsums serve."""
    from tunix_nb.cli import models

    config = cli.config_from_argv(["sft", "--model", "tiny", "--steps", "1", "--remat", "--remat-policy",
                                   "save_projections", "--attention", "xla"])
    built = model.nnx.merge(*models.build_model(config)[:2]).cfg
    assert (built.remat, built.remat_policy, built.attention) == (True, "save_projections", "xla")
    with pytest.raises(FlagError, match="--remat-policy save_projections says what --remat keeps: add --remat"):
        cli.config_from_argv(["sft", "--model", "tiny", "--steps", "1", "--remat-policy", "save_projections"])


def test_the_policy_names_agree_across_the_configs():
    """The model, the command's options and the memory plan name the same policies (the latter
    two without importing JAX)."""
    from tunix_nb.memory_plan import config as plan_config
    from tunix_nb.train import config as train_config

    assert model.REMAT_POLICIES == train_config.REMAT_POLICIES == plan_config.REMAT_POLICIES
    assert model.REMAT_POLICIES == ("full", "save_attention", "save_projections")
