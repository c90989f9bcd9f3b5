"""Gradient accumulation: K micro-batches give the whole batch's update, for every method
and strategy, even when the micro-batches hold different numbers of tokens."""

import numpy as np
import pytest
from flax import nnx

from tunix_nb import compare, data, distill, dpo, model, train
from tunix_nb import sft as sft_method
from tunix_nb.tokenizer import ByteTokenizer

N = 8  # conftest.py simulates 8 CPU devices
K = 4
STEPS = 10
# Error analysis (tunix_nb.compare.float32_bound): K micro-batches add each gradient
# entry's per-token terms in another order than the whole batch does, so the two
# gradients differ by about n x eps of the terms' size, n the batch's token positions
# (32 rows x 24 here), and AdamW carries that relative error into its steps. The runs are
# compared by relative_distance: how far apart they end, per distance travelled. Measured
# after 10 steps: 3e-7 to 1.2e-6 under XLA's default, AVX2, AVX and SSE4.2 code; the known-wrong
# version (the mean of micro-batch means) ends 4e-2 to 1e-1 away, over 100x the tolerance.
TOLERANCE = compare.float32_bound(N * K * data.DEFAULT_SEQ_LEN)


def optimizer():
    return train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20))


@pytest.fixture(scope="module")
def tiny():
    return model.split(model.make_model("tiny", seed=0))


@pytest.fixture(scope="module")
def sft_rows():
    """Rows sorted by completion length, so micro-batches hold very different token counts."""
    examples = sorted(data.load_sft()[:256], key=lambda e: len(e["completion"]))
    return data.sft_arrays(examples, ByteTokenizer(), data.DEFAULT_SEQ_LEN)


def ragged_batch(rows, step):
    """32 rows of length-sorted `rows`: device d's j-th row comes from the j-th quarter, so
    micro-batch j (rows j, j + K, ...: the j-th row of every device) holds the j-th
    quarter's lengths, on one device or eight."""
    quarter = len(next(iter(rows.values()))) // K
    index = np.array([j * quarter + (step * N + d) % quarter for d in range(N) for j in range(K)])
    return {k: v[index] for k, v in rows.items()}


def mean_of_micro_batch_means(objective):
    """The known-wrong accumulation: each micro-batch (and device) contributes its own
    mean with weight 1, so short answers count as much as long ones."""
    def wrong(params, batch, frozen):
        loss_sum, weight, metrics = objective(params, batch, frozen)
        return loss_sum / weight, 1.0, metrics
    return wrong


def run(objective, params, rows, mode, grad_accum, frozen=None, steps=STEPS):
    opt = optimizer()
    step = train.make_step(objective, opt, parallel_mode=mode, grad_accum=grad_accum)
    return train.run(step, params, opt.init(params), lambda s: ragged_batch(rows, s), steps=steps,
                     parallel_mode=mode, frozen=frozen, progress=False)


def test_the_micro_batches_are_ragged(sft_rows):
    """The trap this guards against: the mean of per-micro-batch means is not the batch mean."""
    batch = ragged_batch(sft_rows, 0)
    micro = train.step._micro_batches(batch["loss_mask"], K)
    counts = micro.sum(axis=(1, 2))
    assert counts.max() > 1.5 * counts.min()
    per_token = np.arange(np.prod(batch["loss_mask"].shape)).reshape(batch["loss_mask"].shape) % 7
    naive = np.mean([(per_token_k * m).sum() / m.sum()
                     for per_token_k, m in zip(train.step._micro_batches(per_token, K), micro)])
    exact = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    assert abs(naive - exact) > 1e-3


@pytest.mark.parametrize("mode", train.PARALLEL_MODES)
def test_sft_with_k_micro_batches_equals_the_whole_batch(tiny, sft_rows, mode):
    graphdef, params = tiny
    objective = sft_method.objective(graphdef, compute_dtype=None)
    whole, _, h_whole = run(objective, params, sft_rows, mode, 1)
    accumulated, _, h_acc = run(objective, params, sft_rows, mode, K)
    assert compare.relative_distance(accumulated, whole, params) <= TOLERANCE
    np.testing.assert_allclose([h["loss"] for h in h_acc], [h["loss"] for h in h_whole], rtol=1e-5)


def test_the_tolerance_fails_the_mean_of_micro_batch_means_by_100x(tiny, sft_rows):
    graphdef, params = tiny
    objective = sft_method.objective(graphdef, compute_dtype=None)
    whole = run(objective, params, sft_rows, "jit", 1)[0]
    wrong = run(mean_of_micro_batch_means(objective), params, sft_rows, "jit", K)[0]
    assert compare.relative_distance(wrong, whole, params) >= 100 * TOLERANCE


def test_distillation_with_k_micro_batches_equals_the_whole_batch(tiny, sft_rows):
    graphdef, params = tiny
    teacher_graphdef, teacher = model.split(model.make_model("tiny", seed=1))
    objective = distill.objective(graphdef, teacher_graphdef, compute_dtype=None)
    whole = run(objective, params, sft_rows, "shard_map", 1, frozen=teacher)[0]
    accumulated = run(objective, params, sft_rows, "shard_map", K, frozen=teacher)[0]
    assert compare.relative_distance(accumulated, whole, params) <= TOLERANCE


def test_dpo_with_an_sft_term_over_its_own_count_equals_the_whole_batch(tiny):
    """Two terms over different counts (pairs; chosen tokens): each is summed over the
    micro-batches and divided by its own global count."""
    graphdef, params = tiny
    pairs = data.preference_arrays(data.load_preferences()[:256], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    pairs = dpo.reference_log_probs(graphdef, params, pairs)
    objective = dpo.objective(graphdef, sft_weight=0.5, compute_dtype=None)
    whole, _, h_whole = run(objective, params, pairs, "dp", 1)
    accumulated, _, h_acc = run(objective, params, pairs, "dp", K)
    assert compare.relative_distance(accumulated, whole, params) <= TOLERANCE
    for key in ("loss/dpo", "loss/sft"):
        np.testing.assert_allclose(h_acc[-1][key], h_whole[-1][key], rtol=1e-5)


def test_grpo_with_k_micro_batches_equals_the_whole_batch(tiny):
    from tunix_nb import grpo, rewards

    graphdef, params = tiny
    rollout_fn = grpo.make_rollout(graphdef, data.load_sft()[:64], rewards.combine([rewards.char_match]),
                                   batch_size=8, group_size=4, seed=0, num_iterations=2)
    batch, _ = rollout_fn(0, params, params)
    objective = grpo.objective(graphdef, compute_dtype=None)
    opt = optimizer()
    out = {}
    for k in (1, K):
        step = train.make_step(objective, opt, grad_accum=k)
        p, o = params, opt.init(params)
        for _ in range(3):  # mu = 3 updates on one rollout: the ratio moves off 1
            p, o, metrics = step(p, o, batch, None)
        out[k] = (p, metrics)
    assert compare.relative_distance(out[K][0], out[1][0], params) <= TOLERANCE
    np.testing.assert_allclose(out[K][1]["clip_ratio"], out[1][1]["clip_ratio"], atol=1e-7)


def test_a_batch_that_does_not_divide_is_refused(tiny, sft_rows):
    graphdef, params = tiny
    opt = optimizer()
    step = train.make_step(sft_method.objective(graphdef), opt, grad_accum=3)
    with pytest.raises(ValueError, match="32 rows .* does not divide into grad_accum=3 micro-batches"):
        step(params, opt.init(params), ragged_batch(sft_rows, 0), None)
    with pytest.raises(ValueError, match="grad_accum must be an int >= 1"):
        train.make_step(sft_method.objective(graphdef), opt, grad_accum=0)


def test_the_training_command_accumulates_to_the_same_run(tiny, tmp_path, capsys):
    """The command's 6 AdamW steps (lr 3e-3) on 16 rows x 24 positions: within
    float32_bound(384) = 4.6e-5 of the distance travelled. Measured: 8.7e-7 to 1.2e-6 (XLA's
    default, AVX2 and AVX code; as a largest parameter difference 3.9e-7 to 1.05e-6, which
    is why a bound of 1e-6 on that failed on some processors); the mean of micro-batch
    means ends 0.11 away."""
    from tunix_nb import checkpoint
    from tunix_nb import cli as cli_module

    # float32 compute, as every agreement check (tunix_nb.compare); "auto" is bfloat16 on a TPU
    base = ["sft", "--model", "tiny", "--batch-size", "16", "--steps", "6", "--save-every", "3",
            "--compute-dtype", "float32"]
    assert cli_module.main([*base, "--ckpt-dir", str(tmp_path / "whole")]) == 0
    assert cli_module.main([*base, "--grad-accum", "4", "--ckpt-dir", str(tmp_path / "accum")]) == 0
    graphdef, params = tiny
    start = nnx.to_pure_dict(params)
    whole = checkpoint.load_params(tmp_path / "whole")
    tolerance = compare.float32_bound(16 * data.DEFAULT_SEQ_LEN)
    assert compare.relative_distance(checkpoint.load_params(tmp_path / "accum"), whole, start) <= tolerance
    # the same run, accumulated the known-wrong way, fails the tolerance by far more than 100x
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=3e-3, warmup_steps=0, total_steps=6))
    rows = data.sft_arrays(data.load_sft(), ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    step = train.make_step(mean_of_micro_batch_means(sft_method.objective(graphdef)), opt, grad_accum=K)
    wrong = train.run(step, params, opt.init(params), lambda s: data.batch_at(rows, s, 16, seed=0), steps=6,
                      progress=False)[0]
    assert compare.relative_distance(nnx.to_pure_dict(wrong), whole, start) >= 100 * tolerance
    assert checkpoint.load_meta(tmp_path / "accum")["config"]["grad_accum"] == 4
    # resuming with another K is another run (its bits differ), and is refused
    assert cli_module.main([*base, "--steps", "6", "--ckpt-dir", str(tmp_path / "accum")]) == 2
    assert "grad_accum: saved 4, given 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_module.main([*base, "--grad-accum", "3"])
    assert "--grad-accum 3: the 16 rows per device do not divide into 3 micro-batches" in capsys.readouterr().err


def test_a_checkpoint_from_before_grad_accum_still_resumes():
    from tunix_nb import cli as cli_module

    config = cli_module.config_from_argv(["sft", "--model", "tiny", "--steps", "4", "--batch-size", "16",
                                          "--warmup-steps", "0", "--compute-dtype", "float32"])
    older = {k: v for k, v in config.record().items() if k not in ("grad_accum", *cli_module.LORA_FLAGS)}
    assert config.clashes_with(older) == {}
