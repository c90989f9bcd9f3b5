"""DPO steps: one concatenated forward pass, cached reference, pmap equivalence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import data, losses, model, train
from tunix_nb.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def setup():
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    pairs = data.preference_arrays(data.load_preferences()[:64], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    return graphdef, params, train.reference_log_probs(graphdef, params, pairs, batch_size=48)


def batch(pairs, step, size=16):
    return data.batch_at(pairs, step, size, seed=0)


def max_param_diff(a, b):
    return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_concatenated_forward_equals_two_forwards(setup):
    graphdef, params, pairs = setup
    b = batch(pairs, 0)
    chosen, rejected = train.pair_log_probs(graphdef, params, b)
    for side, got in (("chosen", chosen), ("rejected", rejected)):
        logits = model.apply(graphdef, params, b[f"{side}_inputs"], b[f"{side}_attention_mask"])
        expected = losses.sequence_log_probs(logits, b[f"{side}_targets"], b[f"{side}_loss_mask"])
        np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_cached_reference_matches_the_reference_model(setup):
    graphdef, params, pairs = setup
    assert pairs["ref_chosen_logps"].shape == (64,)  # tail of 64 rows in batches of 48 handled
    b = {k: v[40:56] for k, v in pairs.items()}
    chosen, rejected = train.pair_log_probs(graphdef, params, b)
    np.testing.assert_allclose(b["ref_chosen_logps"], chosen, rtol=1e-5)
    np.testing.assert_allclose(b["ref_rejected_logps"], rejected, rtol=1e-5)


def run_dpo(setup, parallel_mode, cached=True, steps=10, loss_type="sigmoid"):
    graphdef, params, pairs = setup
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20))
    objective = train.dpo_objective(graphdef, cached_reference=cached, loss_type=loss_type)
    step = train.make_step(objective, opt, parallel_mode=parallel_mode)
    return train.run(step, params, opt.init(params), lambda s: batch(pairs, s), steps=steps,
                     parallel_mode=parallel_mode, frozen=None if cached else params, progress=False)


def test_first_step_loss_is_ln2_when_policy_equals_reference(setup):
    _, _, history = run_dpo(setup, "jit", steps=1)
    np.testing.assert_allclose(history[0]["loss"], np.log(2), rtol=1e-5)
    assert history[0]["rewards/accuracy"] == 0.0  # all ties


def test_cached_and_recomputed_reference_train_identically(setup):
    cached, _, hist_c = run_dpo(setup, "jit", cached=True, steps=5)
    recomputed, _, hist_r = run_dpo(setup, "jit", cached=False, steps=5)
    assert max_param_diff(cached, recomputed) <= 1e-5
    np.testing.assert_allclose([h["loss"] for h in hist_c], [h["loss"] for h in hist_r], rtol=1e-5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_pmap_dpo_matches_single_device_after_10_steps(setup, loss_type):
    jit_params, _, jit_hist = run_dpo(setup, "jit", loss_type=loss_type)
    pmap_params, _, pmap_hist = run_dpo(setup, "pmap", loss_type=loss_type)
    assert max_param_diff(jit_params, pmap_params) <= 1e-5
    for key in ("loss", "rewards/margin"):
        np.testing.assert_allclose([h[key] for h in pmap_hist], [h[key] for h in jit_hist], rtol=1e-4, atol=1e-6)
    # At step 1 policy == reference: every reward is 0 up to float rounding, and rounding
    # (which differs with the per-device batch shape) decides the ties. Compare after it.
    assert [h["rewards/accuracy"] for h in pmap_hist[2:]] == [h["rewards/accuracy"] for h in jit_hist[2:]]
    assert jit_hist[-1]["rewards/margin"] > 0  # it learns to prefer the chosen answers


def test_unknown_loss_type_is_refused_when_building():
    with pytest.raises(ValueError, match="Unknown loss_type 'kto'"):
        train.dpo_objective(None, loss_type="kto")


def test_sft_weight_adds_the_chosen_per_token_nll(setup):
    graphdef, params, pairs = setup
    b = batch(pairs, 1)
    plain = train.dpo_objective(graphdef)(params, b)
    rpo = train.dpo_objective(graphdef, sft_weight=0.5)(params, b)
    chosen, _ = train.pair_log_probs(graphdef, params, b)
    nll_per_token = -(chosen / b["chosen_loss_mask"].sum(-1)).mean()
    np.testing.assert_allclose(rpo[0] / rpo[1], plain[0] / plain[1] + 0.5 * nll_per_token, rtol=1e-5)
    np.testing.assert_allclose(rpo[2]["sft/chosen_nll"], nll_per_token, rtol=1e-5)


def test_auto_compute_dtype_is_float32_on_cpu():
    assert train.resolve_compute_dtype("auto") is None
    assert train.resolve_compute_dtype("bfloat16") == "bfloat16"
    assert train.resolve_compute_dtype(jnp.float32) is None
