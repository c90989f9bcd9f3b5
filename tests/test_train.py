import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import compare, data, distill, model, sft, train
from tunix_nb.tokenizer import ByteTokenizer

SEQ_LEN = data.DEFAULT_SEQ_LEN


@pytest.fixture(scope="module")
def uneven_rows():
    """Rows whose completion lengths differ a lot, sorted so devices hold unequal token counts."""
    examples = sorted(data.load_sft()[:256], key=lambda e: len(e["completion"]))
    rows = data.sft_arrays(examples, ByteTokenizer(), SEQ_LEN)
    return rows


def global_batch(rows, step):
    """32 rows; device i's 4 rows come from the i-th eighth of the length-sorted examples,
    so device 0 holds the shortest answers and device 7 the longest."""
    return data.uneven_batch(rows, step, 8)


def run_sft(rows, parallel_mode, steps=10, compute_dtype=None):
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20))
    step = train.make_step(sft.objective(graphdef, compute_dtype=compute_dtype), opt,
                           parallel_mode=parallel_mode)
    params, _, history = train.run(step, params, opt.init(params), lambda s: global_batch(rows, s),
                                   steps=steps, parallel_mode=parallel_mode, progress=False)
    return params, history


def test_devices_really_hold_different_token_counts(uneven_rows):
    counts = global_batch(uneven_rows, 0)["loss_mask"].reshape(8, 4, -1).sum(axis=(1, 2))
    assert counts.min() < counts.max()


def test_pmap_sft_matches_single_device_after_10_steps(uneven_rows):
    jit_params, jit_hist = run_sft(uneven_rows, "jit")
    pmap_params, pmap_hist = run_sft(uneven_rows, "pmap")
    assert compare.max_abs_diff(jit_params, pmap_params) <= 1e-5
    np.testing.assert_allclose([h["loss"] for h in pmap_hist], [h["loss"] for h in jit_hist], rtol=1e-5)
    np.testing.assert_allclose([h["grad_norm"] for h in pmap_hist], [h["grad_norm"] for h in jit_hist], rtol=1e-4)


def test_sft_loss_falls_and_metrics_are_reported(uneven_rows):
    _, history = run_sft(uneven_rows, "jit", steps=10)
    assert set(history[0]) >= {"step", "loss", "grad_norm"}
    assert history[-1]["loss"] < history[0]["loss"]


def test_bfloat16_compute_keeps_float32_params_and_tracks_float32_loss(uneven_rows):
    params, hist_bf16 = run_sft(uneven_rows, "jit", steps=3, compute_dtype=jnp.bfloat16)
    _, hist_f32 = run_sft(uneven_rows, "jit", steps=3)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    np.testing.assert_allclose(hist_bf16[0]["loss"], hist_f32[0]["loss"], rtol=2e-2)


def test_distill_step_pmap_matches_jit(uneven_rows):
    teacher_graphdef, teacher_params = model.split(model.make_model("tiny", seed=1))
    results = {}
    for mode in ("jit", "pmap"):
        graphdef, params = model.split(model.make_model("tiny", seed=0))
        opt = train.make_optimizer(train.OptimizerConfig(warmup_steps=2, total_steps=20))
        step = train.make_step(distill.objective(graphdef, teacher_graphdef), opt, parallel_mode=mode)
        results[mode] = train.run(step, params, opt.init(params), lambda s: global_batch(uneven_rows, s),
                                  steps=5, parallel_mode=mode, frozen=teacher_params, progress=False)
    assert compare.max_abs_diff(results["jit"][0], results["pmap"][0]) <= 1e-5
    assert {"distill/soft_loss", "distill/hard_loss"} <= set(results["pmap"][2][0])


def test_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="Unknown parallel mode 'vmap'"):
        train.make_step(lambda p, b, f: (0.0, 1.0, {}), train.make_optimizer(), parallel_mode="vmap")
    with pytest.raises(ValueError, match="total_steps=10 must exceed warmup_steps=20"):
        train.make_optimizer(train.OptimizerConfig(total_steps=10, warmup_steps=20))


def test_a_nan_loss_stops_the_run_with_a_clear_error():
    def nan_objective(params, batch, frozen):
        return jnp.sum(params["w"]) * jnp.nan, jnp.float32(1.0), {}

    opt = train.make_optimizer(train.OptimizerConfig(warmup_steps=1, total_steps=5))
    step = train.make_step(nan_objective, opt)
    params = {"w": jnp.ones(3)}
    with pytest.raises(FloatingPointError, match="Loss became nan at step 1"):
        train.run(step, params, opt.init(params), lambda s: {}, steps=2, progress=False)


@pytest.mark.parametrize("hand_over", [False, True])
def test_run_commits_a_one_device_state_so_the_step_compiles_once(uneven_rows, hand_over):
    """optax's init leaves some leaves uncommitted and the step's outputs are committed: fed the
    mix, the step would compile again at its second call. Handed over, the state is not copied."""
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20))
    opt_state = opt.init(params)
    assert not all(x.committed for x in jax.tree.leaves(opt_state))  # what the loop must not pass on
    step = train.make_step(sft.objective(graphdef), opt, parallel_mode="jit", donate=True)
    train.run(step, params, opt_state, lambda s: global_batch(uneven_rows, s), steps=3, progress=False,
              hand_over=hand_over)
    assert step._cache_size() == 1
    # a copy leaves the caller's arrays alone; handed over, the donating step deleted them
    assert any(x.is_deleted() for x in jax.tree.leaves(params)) == hand_over
