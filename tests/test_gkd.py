"""On-policy distillation (GKD): the batch source, the divergence, own samples, 8 devices = 1, the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import checkpoint, compare, data, distill, evaluate, gkd, grpo, losses, model, sampler, train
from tunix_nb.tokenizer import ByteTokenizer

EXAMPLES = 64
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def models():
    graphdef, student, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    teacher_graphdef, teacher = distill.load_teacher()
    return graphdef, student, teacher_graphdef, teacher


# ------------------------------------------------------------------ which steps sample


def test_the_source_is_a_pure_function_of_seed_and_step():
    picks = [gkd.batch_source(0, s, 0.5, False) for s in range(40)]
    assert picks == [gkd.batch_source(0, s, 0.5, False) for s in range(40)]
    assert picks != [gkd.batch_source(1, s, 0.5, False) for s in range(40)]
    assert set(picks) == {"student", "data"}


@pytest.mark.parametrize("lmbda", [0.0, 0.3, 1.0])
def test_lmbda_is_the_share_of_sampled_steps(lmbda):
    share = np.mean([gkd.batch_source(3, s, lmbda, True) == "student" for s in range(4000)])
    assert abs(share - lmbda) < 0.03  # 4000 draws: the binomial's std is at most 0.008
    others = {gkd.batch_source(3, s, lmbda, True) for s in range(200)} - {"student"}
    assert others <= {"teacher"} and {gkd.batch_source(3, s, lmbda, False) for s in range(200)} <= {"data", "student"}


@pytest.mark.parametrize("lmbda, beta", [(-0.1, 0.0), (1.5, 0.0), (0.5, 2.0), (float("nan"), 0.0)])
def test_settings_out_of_range_are_refused(lmbda, beta):
    with pytest.raises(ValueError, match="lmbda|beta"):
        gkd.check_settings(lmbda, beta)


# ------------------------------------------------------------------ the divergence


def _logits(seed, B=3, L=5, V=11):
    k = jax.random.split(jax.random.key(seed), 3)
    mask = (jnp.arange(L) < jnp.array([5, 2, 0])[:, None]).astype(jnp.float32)  # row 2 empty
    return (3 * jax.random.normal(k[0], (B, L, V)), 3 * jax.random.normal(k[1], (B, L, V)),
            jax.random.randint(k[2], (B, L), 0, V), mask)


def test_beta_0_is_the_offline_loss_bit_for_bit():
    s, t, y, m = _logits(0)
    before = jnp.mean(jax.vmap(lambda *a: losses.kl_distillation_per_example(*a, temperature=2.0, alpha=0.5))(s, t, y, m))
    after, _ = losses.distillation_loss(s, t, y, m, temperature=2.0, alpha=0.5, beta=0.0)
    assert np.asarray(before).tobytes() == np.asarray(after).tobytes()
    per_row, _ = losses.distillation_loss(s, t, y, m, alpha_B=jnp.full((3,), 0.5))
    assert np.asarray(per_row).tobytes() == np.asarray(after).tobytes()


@pytest.mark.parametrize("beta", [0.1, 0.5, 1.0])
def test_beta_makes_the_soft_term_the_generalized_jsd(beta):
    s, t, y, m = _logits(1)
    _, metrics = losses.distillation_loss(s, t, y, m, beta=beta, temperature=1.5)
    jsd_B = jax.vmap(lambda *a: losses.generalized_jsd_per_example(*a, beta=beta, temperature=1.5))(s, t, y, m)
    np.testing.assert_allclose(metrics["distill/soft_loss"], jnp.mean(jsd_B), rtol=1e-6)
    if beta == 1.0:  # reverse KL
        rkl_B = jax.vmap(lambda *a: losses.reverse_kl_per_example(*a, temperature=1.5))(s, t, y, m)
        np.testing.assert_allclose(jnp.mean(jsd_B), jnp.mean(rkl_B), rtol=1e-6)


def test_a_bad_beta_names_the_range():
    s, t, y, m = _logits(2)
    with pytest.raises(ValueError, match=r"beta must be a Python float in \[0, 1\]"):
        losses.distillation_loss(s, t, y, m, beta=1.5)


def test_own_samples_train_on_the_divergence_alone(models):
    graphdef, student, teacher_graphdef, teacher = models
    rows = data.sft_arrays(data.load_sft()[:4], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    objective = distill.objective(graphdef, teacher_graphdef, alpha=0.5, beta=0.5)
    own = {**rows, "own_sample": np.array([1, 1, 0, 0], np.float32)}
    loss_sum, weight, metrics = objective(student, own, teacher)
    s = model.apply(graphdef, student, rows["inputs"], rows["attention_mask"])
    t = model.apply(teacher_graphdef, teacher, rows["inputs"], rows["attention_mask"])
    per = [(losses.generalized_jsd_per_example(s[i], t[i], rows["targets"][i], rows["loss_mask"][i], beta=0.5),
            losses._masked_mean(-losses.token_log_probs(s[i], rows["targets"][i]), rows["loss_mask"][i]))
           for i in range(4)]
    expected = per[0][0] + per[1][0] + sum(0.5 * soft + 0.5 * hard for soft, hard in per[2:])
    # two programs' sums over the rows' tokens, with each entry's exp and logs (1e-5 on a CPU)
    rtol = compare.float32_bound(64, transcendentals={"exp": 2, "log": 2})
    np.testing.assert_allclose(loss_sum, expected, rtol=rtol)
    assert float(weight) == 4.0


# ------------------------------------------------------------------ the batches


def test_sampled_batches_mask_the_prompt_and_keep_the_completion(models):
    graphdef, student, teacher_graphdef, teacher = models
    examples = data.load_sft()[:EXAMPLES]
    rollout = gkd.make_batches(graphdef, teacher_graphdef, examples, batch_size=8, seed=0, lmbda=1.0)
    batch, metrics = rollout(0, student)
    T = data.MAX_NEW_TOKENS
    assert batch["loss_mask"][:, :-T].sum() == 0 and batch["own_sample"].tolist() == [1.0] * 8
    assert metrics["gkd/on_policy"] == 1.0 and metrics["completions/mean_length"] == batch["loss_mask"].sum(1).mean()
    again, _ = rollout(0, student)  # the same step draws the same tokens
    assert all(np.array_equal(batch[k], again[k]) for k in batch)
    assert not np.array_equal(rollout(1, student)[0]["targets"], batch["targets"])


def test_seq_kd_trains_on_the_teachers_greedy_answers(models):
    graphdef, student, teacher_graphdef, teacher = models
    examples = data.load_sft()[:EXAMPLES]
    rollout = gkd.make_batches(graphdef, teacher_graphdef, examples, batch_size=8, seed=0, lmbda=0.0,
                               seq_kd=True)
    batch, metrics = rollout(0, student, None, teacher)
    assert metrics["gkd/on_policy"] == 0.0 and batch["own_sample"].sum() == 0
    prompts = sampler.prompt_rows(examples)
    picked = data.batch_at(prompts, 0, 8, seed=0)
    greedy_BxT = model.greedy_generate(teacher_graphdef, teacher, picked["prompt_tokens"], picked["prompt_mask"],
                                       max_new_tokens=data.MAX_NEW_TOKENS)  # no KV cache: an independent decoder
    T = data.MAX_NEW_TOKENS
    mask = batch["loss_mask"][:, -T:] > 0
    assert np.array_equal(batch["targets"][:, -T:][mask], np.asarray(greedy_BxT)[mask])


def test_gkd_samples_beside_the_sampler_without_importing_grpo():
    """On-policy sampling is the sampler's (`sampler.make_sampler`), shared with GRPO, whose
    old names still point at it (lessons 08 and 11 call them as grpo.*)."""
    code = "import sys, tunix_nb.gkd; print('tunix_nb.grpo' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr[-2000:]
    for name in ("make_sampler", "prompt_rows", "rollout_keys", "training_rows", "completion_log_probs"):
        assert getattr(grpo, name) is getattr(sampler, name), name


def test_offline_settings_are_refused_by_make_batches(models):
    graphdef, _, teacher_graphdef, teacher = models
    with pytest.raises(ValueError, match="offline distillation"):
        gkd.make_batches(graphdef, teacher_graphdef, data.load_sft()[:8], batch_size=8, seed=0, lmbda=0.0)


# ------------------------------------------------------------------ 8 devices = 1


def _gkd_run(models, parallel_mode, steps=2):
    graphdef, student, teacher_graphdef, teacher = models
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-3, warmup_steps=1, total_steps=steps))
    step_fn = train.make_step(distill.objective(graphdef, teacher_graphdef, beta=0.5), opt, parallel_mode=parallel_mode)
    rollout = gkd.make_batches(graphdef, teacher_graphdef, data.load_sft()[:EXAMPLES], batch_size=16,
                               seed=SEED, lmbda=0.5, seq_kd=True, parallel_mode=parallel_mode)
    return train.run_on_policy(step_fn, student, opt.init(student), rollout, steps=steps, parallel_mode=parallel_mode,
                               frozen=teacher, progress=False)


SEED = 2  # its first two steps: one the student samples, one on the teacher's answers
assert {gkd.batch_source(SEED, s, 0.5, True) for s in (0, 1)} == {"student", "teacher"}


@pytest.fixture(scope="module")
def one_device_run(models):
    return _gkd_run(models, "jit")


# pmap samples under jax.pmap; fsdp under shard_map on the mesh (as shard_map and dp do), with params all-gathered
@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("parallel_mode", ["pmap", "fsdp"])
def test_on_policy_distillation_on_8_devices_equals_1(models, one_device_run, parallel_mode):
    one, _, hist_one = one_device_run
    many, _, hist_many = _gkd_run(models, parallel_mode)
    assert jax.device_count() == 8
    assert [h["gkd/on_policy"] for h in hist_one] == [h["gkd/on_policy"] for h in hist_many]
    # the same samples: the completion lengths agree exactly
    assert [h["completions/mean_length"] for h in hist_one] == [h["completions/mean_length"] for h in hist_many]
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def env():
    """Every run in its own process, on one device unless --devices says otherwise (the command
    shares the kit's compilation cache on its own)."""
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _train(env, *args):
    out = subprocess.run([sys.executable, "-m", "tunix_nb.train", "distill", "--model", "tiny", "--batch-size", "16",
                          *args],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def _params(path):
    return jax.tree.leaves(checkpoint.load_params(path))


def test_lmbda_0_beta_0_is_todays_distillation_bit_for_bit(env, tmp_path):
    """Today's command, uninterrupted, against today's command stopped at step 2 and resumed
    with --lmbda 0 --beta 0: the same run (the checkpoint's config matches) and the same bits."""
    _train(env, "--steps", "3", "--export-params", str(tmp_path / "plain"))
    _train(env, "--steps", "3", "--stop-after", "2", "--ckpt-dir", str(tmp_path / "run"))
    out = _train(env, "--steps", "3", "--lmbda", "0", "--beta", "0", "--ckpt-dir", str(tmp_path / "run"),
                 "--export-params", str(tmp_path / "flags"))
    assert "Resuming from the checkpoint at step 2" in out.stdout
    assert all(a.tobytes() == b.tobytes() for a, b in zip(_params(tmp_path / "plain"), _params(tmp_path / "flags")))


def test_on_policy_distillation_resumes_bit_for_bit(env, tmp_path):
    flags = ["--steps", "6", "--lmbda", "0.5", "--beta", "0.5", "--seq-kd", "--devices", "2",
             "--parallel", "shard_map", "--save-every", "3"]
    _train(env, *flags, "--ckpt-dir", str(tmp_path / "whole"), "--export-params", str(tmp_path / "whole_params"),
           "--metrics-file", str(tmp_path / "whole.jsonl"))
    _train(env, *flags, "--ckpt-dir", str(tmp_path / "cut"), "--stop-after", "3")
    _train(env, *flags, "--ckpt-dir", str(tmp_path / "cut"), "--export-params", str(tmp_path / "cut_params"))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(_params(tmp_path / "whole_params"),
                                                           _params(tmp_path / "cut_params")))
    records = [json.loads(line) for line in (tmp_path / "whole.jsonl").read_text().splitlines()]
    assert {r["gkd/on_policy"] for r in records} == {0.0, 1.0}  # sampled and teacher steps on both sides of the cut


@pytest.mark.parametrize("args, message", [
    (["distill", "--lmbda", "1.5"], "--lmbda: 1.5 is a share of steps"),
    (["distill", "--beta", "2"], "must be in [0, 1] for distill"),
    (["distill", "--temperature", "0.7"], "--temperature samples the student's batches: it needs --lmbda > 0"),
    (["distill", "--max-new-tokens", "4"], "--max-new-tokens needs --lmbda > 0 or --seq-kd"),
    (["sft", "--lmbda", "0.5"], "--lmbda applies only to distill"),
    (["sft", "--seq-kd"], "--seq-kd applies only to distill"),
    (["distill", "--lmbda", "0.5", "--distributed", "--parallel", "dp"], "runs in one process"),
])
def test_bad_gkd_flags_get_clear_errors(capsys, args, message):
    from tunix_nb import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------ exposure bias, and the lesson's record


def test_errors_by_position_against_a_row_by_row_count(models):
    graphdef, student, _, _ = models
    examples = data.load_sft(data.DATA_DIR / "sft_eval.jsonl")[:40]
    got = evaluate.errors_by_position(graphdef, student, examples)
    tok = ByteTokenizer()
    answers = evaluate.generate_answers(graphdef, student, [e["prompt"] for e in examples])
    L = max(len(e["completion"]) + 1 for e in examples)
    forced, free, rows = np.zeros(L), np.zeros(L), np.zeros(L)
    for e, own in zip(examples, answers):
        gold = tok.encode(e["completion"]) + [tok.eos_id]
        mine = tok.encode(own) + [tok.eos_id]  # the greedy answer, cut at eos, as tokens
        prefix = [tok.bos_id, *tok.encode(e["prompt"])]
        for k, token in enumerate(gold):  # teacher-forced: the right first k tokens, then argmax
            n = len(prefix) + k
            ids = np.array([prefix + gold[:k] + [0] * (data.DEFAULT_SEQ_LEN - n)])  # one shape: one compile
            logits = model.apply(graphdef, student, ids, (np.arange(data.DEFAULT_SEQ_LEN) < n)[None].astype(np.int32))
            forced[k] += int(np.argmax(logits[0, n - 1])) != token
            free[k] += k >= len(mine) or mine[k] != token
            rows[k] += 1
    assert got["rows"].tolist() == rows.tolist()
    np.testing.assert_allclose(got["teacher_forced"], forced / rows, atol=1e-6)
    np.testing.assert_allclose(got["free_running"], free / rows, atol=1e-6)
    assert (got["free_running"] >= got["teacher_forced"])[0] and got["teacher_forced"][0] == got["free_running"][0]


def test_error_rates_of_some_rows_are_errors_by_position_of_those_rows(models):
    """Lesson 11's sub-task figures come from one pass over the longest third, cut by row."""
    graphdef, student, _, _ = models
    examples = data.load_sft(data.DATA_DIR / "sft_eval.jsonl")[:40]
    right = evaluate.right_tokens_by_row(graphdef, student, examples)
    some = np.arange(len(examples)) % 3 == 0
    for rows, part in ((slice(None), examples), (some, [e for e, x in zip(examples, some) if x])):
        got, want = evaluate.error_rates(right, rows), evaluate.errors_by_position(graphdef, student, part)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
