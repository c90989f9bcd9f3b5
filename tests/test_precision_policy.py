"""The precision policy (tunix_nb.compare): checks compare like with like, at float32 with
full-precision matmuls on every backend, with bounds that cover the backend's own functions,
and every changed check's bound still fails its known-wrong version by at least 100x.

CI has no TPU, so "like with like" is exercised here by forcing bfloat16 compute on both
sides of each changed check: they agree as closely as in float32, while a float32 side
against a bfloat16 side does not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import compare, data, distill, losses, model, precision, sampler, sft, train
from tunix_nb.bench import kv_cache
from tunix_nb.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def student():
    return model.split(model.make_model("student", seed=0))


@pytest.fixture(scope="module")
def sft_batch():
    rows = data.sft_arrays(data.load_sft()[:64], TOK, data.DEFAULT_SEQ_LEN)
    return data.batch_at(rows, step=0, batch_size=16, seed=0)


def test_transcendental_errors_cover_the_measured_ones():
    """The bounds' table is at least what results/precision/tpu_v5e.json measured on the chip."""
    import json
    measured = json.loads((data.DATA_DIR.parent / "results" / "precision" / "tpu_v5e.json").read_text())
    assert measured["backend"] == "tpu" and measured["device_kind"].startswith("TPU v5")
    worst = lambda *names: max(measured["elementwise_float32"][n]["max_rel_in_eps"] for n in names)
    tpu = compare.TRANSCENDENTAL_EPS["tpu"]
    assert tpu["exp"] >= worst("exp") and tpu["sigmoid"] >= worst("sigmoid")
    assert tpu["log"] >= worst("log", "log_near_1", "log1p") and tpu["tanh"] >= worst("tanh", "expm1")
    assert tpu["sin_cos"] >= worst("sin", "cos")
    # highest precision makes a TPU's float32 matmul a float32 one; the default does not
    assert measured["matmul_float32"]["highest"]["max_err_over_abs_terms_in_eps"] <= 1
    assert measured["matmul_float32"]["default"]["max_err_over_abs_terms_in_eps"] > 1000


def test_bound_adds_the_backends_functions():
    plain = compare.float32_bound(100)
    assert compare.float32_bound(100, transcendentals={"log": 1}, backend="cpu") == pytest.approx(plain + 4 * compare.FLOAT32_EPS)
    assert compare.float32_bound(100, transcendentals={"log": 1}, backend="tpu") == pytest.approx(plain + 4096 * compare.FLOAT32_EPS)
    assert compare.transcendental_error("exp", "unknown-backend") == compare.transcendental_error("exp", "tpu")
    with pytest.raises(ValueError, match="Unknown function"):
        compare.transcendental_error("erf")
    with pytest.raises(ValueError, match="at least 0"):
        compare.float32_bound(10, transcendentals={"exp": -1})


def test_agreement_precision_sets_float32_and_restores():
    before = precision.resolve_compute_dtype("auto")
    precision.set_auto_compute_dtype("bfloat16")
    try:
        with compare.agreement_precision():
            assert precision.resolve_compute_dtype("auto") is None  # float32
            assert jax.config.jax_default_matmul_precision == "highest"
        assert precision.resolve_compute_dtype("auto") == "bfloat16"
    finally:
        precision.set_auto_compute_dtype(None)
    assert precision.resolve_compute_dtype("auto") == before
    with pytest.raises(ValueError, match="float32"):
        precision.set_auto_compute_dtype("float16")


def _distill_loss_by_hand(s_gd, t_gd, s_params, t_params, batch, dtype):
    """Lesson 02's hand-built loss, at `dtype` like the package's objective."""
    cast = lambda p: precision.cast_floats(p, precision.resolve_compute_dtype(dtype))
    s_logits = model.apply(s_gd, cast(s_params), batch["inputs"], batch["attention_mask"])
    t_logits = model.apply(t_gd, cast(t_params), batch["inputs"], batch["attention_mask"])
    loss, _ = losses.distillation_loss(s_logits, t_logits, batch["targets"], batch["loss_mask"], temperature=2.0, alpha=0.5)
    return loss * batch["inputs"].shape[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lesson02_hand_built_loss_like_with_like(student, sft_batch, dtype):
    """Lesson 02: the hand-built loss == distill.objective when both run at one compute dtype
    (bfloat16 forced here, as a TPU's "auto" would); the bound fails a loss without the
    temperature's T^2 scaling (the known-wrong version) by over 100x."""
    t_gd, t_params = distill.load_teacher()
    s_gd, s_params = student
    B = sft_batch["inputs"].shape[0]
    bound = compare.float32_bound(B * data.DEFAULT_SEQ_LEN, transcendentals={"exp": 2, "log": 2})
    with compare.agreement_precision():
        mine = float(_distill_loss_by_hand(s_gd, t_gd, s_params, t_params, sft_batch, dtype))
        pkg = float(distill.objective(s_gd, t_gd, compute_dtype=dtype)(s_params, sft_batch, t_params)[0])
    # bfloat16 on both sides rounds alike, so the float32 bound holds there too
    assert abs(mine - pkg) <= bound * abs(pkg)
    if dtype == "bfloat16":
        f32 = float(distill.objective(s_gd, t_gd, compute_dtype="float32")(s_params, sft_batch, t_params)[0])
        assert abs(f32 - pkg) > bound * abs(pkg)  # unlike with unlike: outside the float32 bound
    else:
        s_logits = model.apply(s_gd, s_params, sft_batch["inputs"], sft_batch["attention_mask"])
        t_logits = model.apply(t_gd, t_params, sft_batch["inputs"], sft_batch["attention_mask"])
        soft = losses.distillation_loss(s_logits, t_logits, sft_batch["targets"], sft_batch["loss_mask"],
                                        temperature=2.0, alpha=1.0)[0] * B
        wrong = mine - 0.5 * float(soft) * (1 - 1 / 4)  # the soft term without its T^2 = 4
        assert abs(wrong - pkg) >= 100 * bound * abs(pkg)


def _run(parallel_mode, objective, params, batch_fn, steps=4):
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=8))
    step = train.make_step(objective, opt, parallel_mode=parallel_mode)
    return train.run(step, params, opt.init(params), batch_fn, steps=steps, parallel_mode=parallel_mode,
                     progress=False)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lesson03_pmap_equals_jit_like_with_like(student, dtype):
    """Lesson 03: pmap on 8 devices == jit on 1 within the policy's bound, at either compute
    dtype on both sides; the per-device-mean trap falls outside by over 100x (float32)."""
    graphdef, params0 = student
    rows = data.sft_arrays(sorted(data.load_sft()[:256], key=lambda e: len(e["completion"])), TOK, data.DEFAULT_SEQ_LEN)
    batch_fn = lambda s: {k: v[(np.arange(32) * 8 + s) % 256] for k, v in rows.items()}  # uneven lengths per device
    bound = compare.float32_bound(32 * data.DEFAULT_SEQ_LEN, transcendentals=compare.log_softmax_transcendentals())
    with compare.agreement_precision():
        objective = sft.objective(graphdef, compute_dtype=dtype)
        jit_params = _run("jit", objective, params0, batch_fn)
        pmap_params = _run("pmap", objective, params0, batch_fn)
        apart = compare.relative_distance(pmap_params, jit_params, params0)
        # a bfloat16 forward/backward is rounded alike on 1 and 8 devices but its sums' order
        # differs: bfloat16's own bound (eps 2**-8 per sum, not 2**-23) is the fair one there
        scale = 1.0 if dtype == "float32" else float(jnp.finfo(jnp.bfloat16).eps) / compare.FLOAT32_EPS
        assert apart <= bound * scale, (apart, bound * scale)
        if dtype == "float32":
            def per_device_mean(params, batch, frozen=None):
                nll, count, _ = objective(params, batch)
                return nll / count, jnp.float32(1.0), {}
            naive = _run("pmap", per_device_mean, params0, batch_fn)
            assert compare.relative_distance(naive, jit_params, params0) >= 100 * bound


def test_kv_cache_check_accepts_greedy_tokens_and_rejects_shifted_ones(student):
    """Lesson 07 / bench kv_cache: each decoder's tokens are greedy choices of a full forward
    pass to the bound; the cache's tokens shifted by one position (a cache off by one) are not,
    by over 100x the bound."""
    graphdef, params = student
    prompts = data.prompt_arrays([e["prompt"] for e in data.load_sft()[:8]], TOK, data.DEFAULT_PROMPT_LEN)
    t, m = prompts["tokens"], prompts["attention_mask"]
    cached = lambda: sampler.generate(graphdef, params, t, m, jax.random.key(0), max_new_tokens=8,
                                      temperature=0, eos_id=-1).tokens
    recompute = lambda: model.greedy_generate(graphdef, params, t, m, max_new_tokens=8, eos_id=-1)
    kv_cache.check_greedy(graphdef, params, t, m, recompute, cached, 8)  # raises if not greedy
    shifted = lambda: jnp.roll(jnp.asarray(cached()), 1, axis=1)
    with pytest.raises(RuntimeError, match="not greedy"):
        kv_cache.check_greedy(graphdef, params, t, m, recompute, shifted, 8)
    # by how much: the slack of the shifted tokens against the bound
    new = jnp.asarray(shifted())
    full = jnp.concatenate([t, new], 1)
    logits = model.apply(graphdef, params, full, jnp.concatenate([m, jnp.ones_like(new, dtype=m.dtype)], 1))[:, t.shape[1] - 1:-1]
    cfg = model.get_config("student")
    bound = 2 * compare.float32_bound(compare.forward_pass_terms(cfg, full.shape[1]),
                                      transcendentals=compare.forward_pass_transcendentals(cfg)) * float(jnp.abs(logits).max())
    assert compare.greedy_slack(logits, new) >= 100 * bound
