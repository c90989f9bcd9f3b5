"""DPO steps: one concatenated forward pass, cached reference, pmap equivalence."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import compare, data, dpo, losses, model, precision, train
from tunix_nb.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def setup():
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    pairs = data.preference_arrays(data.load_preferences()[:64], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    return graphdef, params, dpo.reference_log_probs(graphdef, params, pairs, batch_size=48)


def batch(pairs, step, size=16):
    return data.batch_at(pairs, step, size, seed=0)


def test_concatenated_forward_equals_two_forwards(setup):
    graphdef, params, pairs = setup
    b = batch(pairs, 0)
    chosen, rejected = dpo.pair_log_probs(graphdef, params, b)
    for side, got in (("chosen", chosen), ("rejected", rejected)):
        logits = model.apply(graphdef, params, b[f"{side}_inputs"], b[f"{side}_attention_mask"])
        expected = losses.sequence_log_probs(logits, b[f"{side}_targets"], b[f"{side}_loss_mask"])
        np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_cached_reference_matches_the_reference_model(setup):
    graphdef, params, pairs = setup
    assert pairs["ref_chosen_logps"].shape == (64,)  # tail of 64 rows in batches of 48 handled
    b = {k: v[40:56] for k, v in pairs.items()}
    chosen, rejected = dpo.pair_log_probs(graphdef, params, b)
    np.testing.assert_allclose(b["ref_chosen_logps"], chosen, rtol=1e-5)
    np.testing.assert_allclose(b["ref_rejected_logps"], rejected, rtol=1e-5)


def run_dpo(setup, parallel_mode, cached=True, steps=10, loss_type="sigmoid", compute_dtype="auto"):
    graphdef, params, pairs = setup
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20))
    objective = dpo.objective(graphdef, cached_reference=cached, loss_type=loss_type, compute_dtype=compute_dtype)
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
    assert compare.max_abs_diff(cached, recomputed) <= 1e-5
    np.testing.assert_allclose([h["loss"] for h in hist_c], [h["loss"] for h in hist_r], rtol=1e-5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_pmap_dpo_matches_single_device_after_10_steps(setup, loss_type):
    jit_params, _, jit_hist = run_dpo(setup, "jit", loss_type=loss_type)
    pmap_params, _, pmap_hist = run_dpo(setup, "pmap", loss_type=loss_type)
    assert compare.max_abs_diff(jit_params, pmap_params) <= 1e-5
    for key in ("loss", "rewards/margin"):
        np.testing.assert_allclose([h[key] for h in pmap_hist], [h[key] for h in jit_hist], rtol=1e-4, atol=1e-6)
    # At step 1 policy == reference: every reward is 0 up to float rounding, and rounding
    # (which differs with the per-device batch shape) decides the ties. Compare after it.
    assert [h["rewards/accuracy"] for h in pmap_hist[2:]] == [h["rewards/accuracy"] for h in jit_hist[2:]]
    assert jit_hist[-1]["rewards/margin"] > 0  # it learns to prefer the chosen answers


def test_unknown_loss_type_is_refused_when_building():
    with pytest.raises(ValueError, match="Unknown loss_type 'kto'"):
        dpo.objective(None, loss_type="kto")


def chosen_token_nll(graphdef, params, b):
    """Mean NLL over every chosen completion token of the batch, with numpy from the model's logits."""
    logits = np.asarray(model.apply(graphdef, params, b["chosen_inputs"], b["chosen_attention_mask"]), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target_logp = np.take_along_axis(logp, b["chosen_targets"][..., None].astype(np.int64), -1)[..., 0]
    mask = b["chosen_loss_mask"] > 0
    per_answer = [-target_logp[i, mask[i]].mean() for i in range(len(mask))]
    return -target_logp[mask].mean(), np.mean(per_answer)  # (all tokens' mean, mean of answers' means)


@pytest.mark.parametrize("length_normalize", [False, True])
def test_sft_weight_adds_the_mean_nll_of_all_chosen_tokens(setup, length_normalize):
    """RPO as TRL's `rpo_alpha`: cross-entropy over all chosen tokens of the batch, whatever DPO sees."""
    graphdef, params, pairs = setup
    pairs = dpo.reference_log_probs(graphdef, params, pairs, length_normalize=length_normalize, batch_size=48)
    b = batch(pairs, 1)
    nll, mean_of_answer_means = chosen_token_nll(graphdef, params, b)
    assert abs(nll - mean_of_answer_means) > 1e-4 * nll  # answers of different lengths tell the two apart
    kw = dict(loss_type="ipo", beta=0.5, length_normalize=True) if length_normalize else {}
    plain = dpo.objective(graphdef, **kw)(params, b)
    rpo = dpo.objective(graphdef, sft_weight=0.5, **kw)(params, b)
    sums, counts = rpo[0], rpo[1]  # two named terms, each over its own count
    np.testing.assert_allclose(sums["dpo"] / counts["dpo"], plain[0] / plain[1], rtol=1e-6)
    np.testing.assert_allclose(sums["sft"] / counts["sft"], 0.5 * nll, rtol=1e-5)


def test_bfloat16_reference_is_cached_in_bfloat16(setup):
    """compute_dtype reaches the cached reference, and a step with the cached reference equals
    one that runs the reference in the step. Scored in the step's program shape (batches of 16):
    bfloat16 sums round differently with the batch shape (at 48: 3e-4 off ln 2 at step 1)."""
    graphdef, params, pairs = setup
    pairs = dpo.reference_log_probs(graphdef, params, pairs, batch_size=16, compute_dtype=jnp.bfloat16)
    b = batch(pairs, 0)
    score = jax.jit(lambda p, rows: dpo.pair_log_probs(graphdef, p, rows)[0])
    in_bf16, in_f32 = score(precision.cast_floats(params, jnp.bfloat16), b), score(params, b)
    assert np.abs(in_bf16 - in_f32).max() > 1e-3  # the two precisions are told apart
    np.testing.assert_allclose(b["ref_chosen_logps"], in_bf16, rtol=1e-6)
    runs = {cached: run_dpo((graphdef, params, pairs), "jit", cached=cached, steps=1, compute_dtype=jnp.bfloat16)
            for cached in (True, False)}
    (cached, _, hist_c), (recomputed, _, hist_r) = runs[True], runs[False]
    np.testing.assert_allclose(hist_c[0]["loss"], hist_r[0]["loss"], atol=1e-6)
    # bfloat16 gradients round the policy's forward apart from the reference's: near ln 2, not at it
    np.testing.assert_allclose(hist_c[0]["loss"], np.log(2), atol=1e-3)
    assert compare.max_abs_diff(cached, recomputed) <= 1e-6


def without_reference(pairs):
    return {k: v for k, v in pairs.items() if not k.startswith("ref_")}


def test_reference_keys_say_summed_or_per_token(setup):
    graphdef, params, pairs = setup
    per_token = dpo.reference_log_probs(graphdef, params, without_reference(pairs), length_normalize=True,
                                        batch_size=48)
    assert "ref_chosen_logps" not in per_token and "ref_rejected_logps" not in per_token
    b = batch(per_token, 0)
    chosen, rejected = dpo.pair_log_probs(graphdef, params, b, length_normalize=True)
    np.testing.assert_allclose(b["ref_chosen_logps_per_token"], chosen, rtol=1e-5)
    np.testing.assert_allclose(b["ref_rejected_logps_per_token"], rejected, rtol=1e-5)


def test_summed_and_per_token_references_are_never_mixed(setup):
    graphdef, params, pairs = setup  # pairs carry summed reference log-probs only
    b = batch(pairs, 0)
    fix = r"reference_log_probs\(\.\.\., length_normalize=True\)"
    with pytest.raises(ValueError, match=r"summed reference log-probs.*length_normalize=True.*" + fix):
        dpo.objective(graphdef, loss_type="ipo", length_normalize=True)(params, b)
    with pytest.raises(ValueError, match=fix):
        dpo.eval_metrics(graphdef, params, b, loss_type="ipo", length_normalize=True)
    per_token = dpo.reference_log_probs(graphdef, params, without_reference(pairs), length_normalize=True,
                                        batch_size=48)
    with pytest.raises(ValueError, match=r"per-token reference log-probs.*reference_log_probs\(\.\.\., "
                                         r"length_normalize=False\)"):
        dpo.objective(graphdef)(params, batch(per_token, 0))
    with pytest.raises(ValueError, match=r"no cached reference log-probs.*cached_reference=False"):
        dpo.objective(graphdef)(params, batch(without_reference(pairs), 0))


def test_each_objective_reads_the_reference_of_its_kind(setup):
    graphdef, params, pairs = setup
    both = dpo.reference_log_probs(graphdef, params, pairs, length_normalize=True, batch_size=48)
    b = batch(both, 0)  # policy == reference, so h = 0 for either kind
    summed = dpo.objective(graphdef)(params, b)
    per_token = dpo.objective(graphdef, beta=0.5, loss_type="ipo", length_normalize=True)(params, b)
    np.testing.assert_allclose(summed[0] / summed[1], np.log(2), rtol=1e-5)
    np.testing.assert_allclose(per_token[0] / per_token[1], (1 / (2 * 0.5)) ** 2, rtol=1e-5)
    metrics = dpo.eval_metrics(graphdef, params, b, beta=0.5, loss_type="ipo", length_normalize=True)
    np.testing.assert_allclose(metrics["eval/loss"], 1.0, rtol=1e-5)


def test_reference_log_probs_compiles_once(setup, caplog):
    graphdef, params, pairs = setup
    rows = {k: v[:24] for k, v in without_reference(pairs).items()}

    def compiles():
        n = sum(r.getMessage().startswith("Compiling") for r in caplog.records)
        caplog.clear()
        return n

    caplog.set_level(logging.WARNING)
    with jax.log_compiles():
        dpo.reference_log_probs(graphdef, params, rows, batch_size=24)  # a shape not seen before
        first = compiles()
        dpo.reference_log_probs(graphdef, params, rows, batch_size=24)
        second = compiles()
    assert first >= 1 and second == 0


def test_auto_compute_dtype_is_float32_on_cpu():
    assert precision.resolve_compute_dtype("auto") is None
    assert precision.resolve_compute_dtype("bfloat16") == "bfloat16"
    assert precision.resolve_compute_dtype(jnp.float32) is None


def test_the_command_caches_the_reference_as_a_step_scores_it_in_bfloat16(tmp_path):
    """The cached reference is scored in the step's batch shape, so step 1 of the command equals
    step 1 with `--reference-in-step` to 1e-6 in bfloat16 (scored in chunks of 256 while the policy
    stepped on 8, the two were 2e-4 apart), and both start at ln 2 to within bfloat16's rounding."""
    import json
    import math

    from tunix_nb import cli

    losses_by_mode = {}
    for extra in ([], ["--reference-in-step"]):
        metrics = tmp_path / f"m{len(extra)}.jsonl"
        assert cli.main(["dpo", "--steps", "1", "--batch-size", "8", "--compute-dtype", "bfloat16",
                         "--metrics-file", str(metrics), *extra]) == 0
        losses_by_mode[bool(extra)] = json.loads(metrics.read_text())["loss"]
    assert losses_by_mode[False] == pytest.approx(losses_by_mode[True], abs=1e-6)
    assert losses_by_mode[False] == pytest.approx(math.log(2), abs=1e-3)


def test_the_command_starts_at_ln2_in_float32(tmp_path):
    import json
    import math

    from tunix_nb import cli

    metrics = tmp_path / "m.jsonl"
    assert cli.main(["dpo", "--steps", "1", "--batch-size", "8", "--reference-in-step", "--compute-dtype", "float32",
                     "--metrics-file", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["loss"] == pytest.approx(math.log(2), abs=1e-6)
