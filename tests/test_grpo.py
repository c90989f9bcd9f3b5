"""GRPO training: rollouts, the training batch, the objective, data-parallel updates, the CLI.

The tiny model, 8 prompts, G = 4 completions each, 8 new tokens: small enough that every
strategy compiles in seconds. conftest.py simulates 8 CPU devices, so under pmap and on
a mesh each device samples one prompt's group.

Comparing strategies: the gradients agree to float32 rounding, but Adam divides each
gradient component by its own running scale, so a component whose true value is about
0 (GRPO's group-centred advantages cancel a lot) turns its rounding noise into a step of
up to the learning rate. The parameters after Adam updates therefore differ by about
lr * 2e-3 (measured on this batch, every strategy: 2.0e-5 at lr 1e-2, 6e-7 at GRPO's
default 3e-4, after 2 updates), while plain SGD (lr 1) shows the updates themselves
equal to 1.8e-7. The tests check both.
"""

import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tunix_nb import checkpoint, compare, data, grpo, losses, model, rewards, train
from tunix_nb import cli as cli_module

B, G, T = 8, 4, 8  # prompts, completions per prompt, new tokens
STRATEGIES = ("pmap", "shard_map", "dp", "fsdp")


def optimizer(learning_rate=1e-2, total_steps=20):
    """No warmup: the first update already moves the policy."""
    return train.make_optimizer(train.OptimizerConfig(learning_rate=learning_rate, warmup_steps=0,
                                                      total_steps=total_steps))


def length(prompts, completions, **example):
    """A dense reward (most groups' rewards differ, even for an untrained model): a plain callable."""
    return [len(c) / T for c in completions]


@pytest.fixture(scope="module")
def setup():
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    examples = data.load_sft()[:64]
    reward_set = rewards.combine([rewards.exact_match, rewards.char_match, length])
    return graphdef, params, examples, reward_set


def make_rollout(setup, parallel_mode="jit", num_iterations=2, beta=0.04, mesh=None):
    graphdef, _, examples, reward_set = setup
    return grpo.make_rollout(graphdef, examples, reward_set, batch_size=B, group_size=G, seed=0,
                             num_iterations=num_iterations, beta=beta, max_new_tokens=T, compute_dtype=None,
                             parallel_mode=parallel_mode, mesh=mesh)


@pytest.fixture(scope="module")
def rolled(setup):
    """Step 0's rollout on one device (policy = reference = the initial params)."""
    _, params, _, _ = setup
    return make_rollout(setup)(0, params, params)


def objective(setup, **kwargs):
    return grpo.objective(setup[0], compute_dtype=None, **kwargs)


# ------------------------------------------------------------------------------ rollouts


def test_rollout_shapes_and_metrics(rolled):
    batch, metrics = rolled
    P = data.DEFAULT_PROMPT_LEN
    assert {k: v.shape for k, v in batch.items()} == {
        "inputs": (B * G, P + T - 1), "targets": (B * G, P + T - 1), "attention_mask": (B * G, P + T - 1),
        "completion_mask": (B * G, T), "old_logps": (B * G, T), "ref_logps": (B * G, T), "advantages": (B * G,)}
    # each prompt G times in a row
    prompts = batch["inputs"][:, :P].reshape(B, G, P)
    assert (prompts == prompts[:, :1]).all() and not (prompts[1:] == prompts[:1]).all()
    # the completion mask covers the tokens up to and including eos, and the attention mask agrees
    mask = batch["completion_mask"]
    assert (np.diff(mask, axis=1) <= 0).all() and (mask[:, 0] == 1).all()
    np.testing.assert_array_equal(batch["attention_mask"][:, P:], mask[:, :-1])
    assert {"reward", "reward_std", "rewards/exact_match/mean", "rewards/char_match/std", "frac_reward_zero_std",
            "completions/mean_length"} <= set(metrics)
    assert metrics["completions/mean_length"] == mask.sum(1).mean()
    # policy == reference at step 0: the same log-probs
    np.testing.assert_allclose(batch["old_logps"], batch["ref_logps"], atol=1e-6)


def test_rollouts_are_a_function_of_seed_and_step(setup, rolled):
    _, params, _, _ = setup
    rollout_fn = make_rollout(setup)
    again, _ = rollout_fn(0, params, params)
    assert all(np.array_equal(again[k], rolled[0][k]) for k in again)
    other, _ = rollout_fn(1, params, params)
    assert not np.array_equal(other["inputs"], rolled[0]["inputs"])
    # the G completions of a prompt differ: each row has its own key
    completions = rolled[0]["targets"][:, -T:].reshape(B, G, T)
    assert any(len({tuple(c) for c in group.tolist()}) > 1 for group in completions)


def test_rows_do_not_depend_on_the_batch_split(setup, rolled):
    """The sampler on half the prompts, with those rows' keys, gives those rows."""
    graphdef, params, examples, reward_set = setup
    sample = grpo.make_sampler(graphdef, max_new_tokens=T, compute_dtype=None)
    batch = rolled[0]
    P = data.DEFAULT_PROMPT_LEN
    keys = grpo.rollout_keys(0, 0, B * G)
    half = slice(B * G // 2, B * G)
    out = sample(params, None, batch["inputs"][half, :P], (batch["inputs"][half, :P] != 0).astype(np.int32),
                 keys[half])
    np.testing.assert_array_equal(out["targets"], batch["targets"][half])


def test_advantages_are_zero_mean_per_group(rolled):
    batch, metrics = rolled
    adv = batch["advantages"].reshape(B, G)
    np.testing.assert_allclose(adv.mean(axis=1), 0, atol=1e-6)
    zero = (adv == 0).all(axis=1).mean()
    assert zero == metrics["frac_reward_zero_std"]


def test_sampling_is_the_same_on_every_strategy(setup, rolled):
    _, params, _, _ = setup
    for mode in STRATEGIES:
        place = train.loop.Placement(None, mode)
        p, _, ref = place.state(params, {}, params)
        batch, _ = make_rollout(setup, mode, mesh=place.mesh)(0, p, ref)
        np.testing.assert_array_equal(batch["targets"], rolled[0]["targets"], err_msg=mode)
        for k in ("old_logps", "ref_logps", "advantages"):
            np.testing.assert_allclose(batch[k], rolled[0][k], atol=1e-5, err_msg=f"{mode}: {k}")


# ------------------------------------------------------------------------------ the objective


def test_objective_is_grpo_loss_on_hand_assembled_inputs(setup, rolled):
    graphdef, params, _, _ = setup
    batch = {k: jnp.asarray(v) for k, v in rolled[0].items()}
    moved = jax.tree.map(lambda x: x * 1.05, params)  # another policy: ratios away from 1, some clipped
    kwargs = dict(epsilon=0.02, epsilon_high=0.05, beta=0.1, kl_estimator="kl", aggregation="token-mean")
    loss_sum, weight, metrics = objective(setup, **kwargs)(moved, batch)
    # by hand: prompt + completion through the model, the completion positions' log-probs
    logits = model.apply(graphdef, moved, batch["inputs"], batch["attention_mask"])
    logps = losses.token_log_probs(logits[:, -T:], batch["targets"][:, -T:])
    want_sum, want_weight, want = losses.grpo_loss(logps, batch["old_logps"], batch["ref_logps"], batch["advantages"],
                                                   batch["completion_mask"], **kwargs)
    np.testing.assert_allclose(loss_sum, want_sum, rtol=1e-6)
    np.testing.assert_allclose(weight, want_weight)
    assert 0 < want["clip_ratio"] < 1
    for k, v in want.items():  # metrics come as (sum, count): the step all-reduces both
        total, count = metrics[k]
        assert count == batch["completion_mask"].sum()
        np.testing.assert_allclose(total / count, v, rtol=1e-5, atol=1e-7)
    p = jax.nn.softmax(logits[:, -T:])
    entropy = -(p * jnp.log(p)).sum(-1)
    total, count = metrics["entropy"]
    np.testing.assert_allclose(total / count, (entropy * batch["completion_mask"]).sum() / count, rtol=1e-5)


def test_objective_without_old_or_reference_log_probs(setup, rolled):
    """num_iterations = 1 and beta = 0: the rollout computes neither; ratio 1, no KL."""
    _, params, _, _ = setup
    batch = {k: v for k, v in rolled[0].items() if k not in ("old_logps", "ref_logps")}
    _, _, metrics = objective(setup, beta=0.0)(params, batch)
    # every ratio exp(logp - stop_gradient(logp)) is 1: exactly, where XLA computes logp once (a CPU);
    # a TPU may compute it in two fusions, each with a float32 log within about 2**-11 of |logp|
    ratio_sum, count = (float(x) for x in metrics["is_ratio/mean"])
    largest_logp = float(np.abs(np.asarray(rolled[0]["old_logps"])[batch["completion_mask"] > 0]).max())
    bound = compare.float32_bound(1, max(1.0, largest_logp), transcendentals={"exp": 1, "log": 2})
    assert abs(ratio_sum - count) <= count * bound, (ratio_sum, count, bound)
    assert metrics["kl"][0] == 0 and metrics["clip_ratio"][0] == 0
    with pytest.raises(ValueError, match="beta=0.04 needs the reference's log-probs"):
        objective(setup)(params, batch)
    short = make_rollout(setup, num_iterations=1, beta=0.0)(0, params, None)[0]
    assert set(short) == set(batch)


# ------------------------------------------------------------------------------ updates


def test_one_step_is_the_rollout_then_mu_updates(setup, rolled):
    """run_on_policy with num_iterations=2 == the step applied twice to the step's rollout."""
    _, params, _, _ = setup
    opt = optimizer()
    step = train.make_step(objective(setup), opt)
    new, state, history = train.run_on_policy(step, params, opt.init(params), make_rollout(setup), steps=1,
                                              num_iterations=2, reference=params, progress=False)
    p, s = params, opt.init(params)
    updates = []
    for _ in range(2):
        p, s, m = step(p, s, rolled[0], None)
        updates.append(m)
    assert compare.bitwise_equal(new, p)
    assert int(state[1][0].count) == 2  # two optimizer updates (adamw's step count)
    record = history[0]
    assert record["step"] == 1 and record["time/rollout_s"] > 0 and record["time/update_s"] > 0
    for k in ("loss", "clip_ratio", "kl", "entropy", "is_ratio/mean"):
        np.testing.assert_allclose(record[k], np.mean([float(u[k]) for u in updates]), rtol=1e-6)
    assert record["reward"] == rolled[1]["reward"]
    # the first update is on-policy (ratio 1 up to rounding), the second off it (some ratios clipped)
    assert abs(float(updates[0]["is_ratio/mean"]) - 1) < 1e-5 and float(updates[0]["clip_ratio"]) == 0
    assert float(updates[1]["clip_ratio"]) > 0, {k: float(v) for k, v in updates[1].items()}


OPTIMIZERS = {"sgd": (lambda: optax.sgd(1.0), 1e-6), "adamw": (lambda: optimizer(3e-4), 1e-5)}


def two_updates(setup, batch, mode, opt_name):
    """(params, metrics of each update) after two updates on `batch` under `mode`."""
    _, params, _, _ = setup
    opt = OPTIMIZERS[opt_name][0]()
    step = train.make_step(objective(setup, aggregation="sequence-mean-token-mean", epsilon=0.05), opt,
                           parallel_mode=mode)
    place = train.loop.Placement(step, mode)
    p, s, _ = place.state(params, opt.init(params))
    batch = place.batch(batch)
    history = []
    for _ in range(2):
        p, s, metrics = step(p, s, batch, None)
        history.append(place.metrics(metrics))
    return place.on_one_device(p), history


@pytest.fixture(scope="module")
def on_one_device(setup, rolled):
    return {name: two_updates(setup, rolled[0], "jit", name) for name in OPTIMIZERS}


@pytest.mark.parametrize("mode", STRATEGIES)
def test_data_parallel_update_equals_one_device(setup, rolled, on_one_device, mode):
    """The same rollout batch, two updates (the second off-policy, clipped): every
    strategy ends where jit does, with the same metrics, although the devices hold
    different numbers of completion tokens. SGD: the updates themselves, to 1e-6;
    the kit's AdamW at GRPO's learning rate: to 1e-5 (see the module docstring)."""
    tokens = rolled[0]["completion_mask"].reshape(8, -1).sum(1)
    assert len(set(tokens.tolist())) > 1, "the test wants devices with different token counts"
    for name, (_, tolerance) in OPTIMIZERS.items():
        (want, want_history), (got, history) = on_one_device[name], two_updates(setup, rolled[0], mode, name)
        assert compare.max_abs_diff(want, got) <= tolerance, name
        assert history[1]["clip_ratio"] > 0
        for one, many in zip(want_history, history):
            for k in ("loss", "clip_ratio", "kl", "entropy", "is_ratio/mean", "grad_norm"):
                np.testing.assert_allclose(many[k], one[k], rtol=1e-5, atol=1e-6, err_msg=f"{mode}, {name}: {k}")


def test_pmap_training_equals_one_device_and_the_reference_stays_frozen(setup):
    """Two GRPO steps (rollout + 2 updates each) under pmap and jit, with a donating step
    as the CLI builds it: the same params, and the reference untouched."""
    _, params, _, _ = setup
    reference = jax.tree.map(jnp.copy, params)
    before = jax.tree.map(np.asarray, reference)
    out = {}
    for mode in ("jit", "pmap"):
        opt = optimizer(3e-4)
        step = train.make_step(objective(setup), opt, parallel_mode=mode, donate=True)
        out[mode] = train.run_on_policy(step, params, opt.init(params), make_rollout(setup, mode), steps=2,
                                        num_iterations=2, parallel_mode=mode, reference=reference,
                                        progress=False)
    assert compare.max_abs_diff(out["jit"][0], out["pmap"][0]) <= 1e-5
    assert compare.max_abs_diff(out["jit"][0], params) > 1e-4  # it trained
    for a, b in zip(out["jit"][2], out["pmap"][2]):
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5, atol=1e-6)
    assert compare.bitwise_equal(reference, before)
    # the second rollout scored with the reference, not the policy: its KL is no longer 0
    assert out["jit"][2][1]["kl"] > 0


# ------------------------------------------------------------------------------ command line


@pytest.fixture(scope="module")
def tiny_sft(tmp_path_factory, setup):
    """A params-only checkpoint of the tiny model, as --init-from wants it."""
    path = tmp_path_factory.mktemp("tiny_sft") / "ckpt"
    checkpoint.export_params(setup[1], path, step=0, meta={"model": "tiny"})
    return str(path)


def grpo_argv(init_from, ckpt, metrics, *extra):
    return ["grpo", "--init-from", init_from, "--batch-size", str(B), "--group-size", str(G), "--max-new-tokens",
            str(T), "--steps", "4", "--save-every", "2", "--num-iterations", "2", "--epsilon-high", "0.28",
            "--ckpt-dir", str(ckpt), "--metrics-file", str(metrics), *extra]


def without_times(path):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, tiny_sft):
    """grpo_argv's run, uninterrupted and in this process: (its --ckpt-dir, its --metrics-file)."""
    root = tmp_path_factory.mktemp("grpo_whole")
    assert cli_module.main(grpo_argv(tiny_sft, root / "whole", root / "whole.jsonl")) == 0
    return root / "whole", root / "whole.jsonl"


def test_cli_grpo_stops_and_resumes_bitwise(tmp_path, tiny_sft, whole_run, capsys):
    (whole, whole_metrics), cut = whole_run, tmp_path / "cut"
    assert cli_module.main(grpo_argv(tiny_sft, cut, tmp_path / "cut.jsonl", "--stop-after", "1")) == 0
    assert "Stopped after step 1 of 4" in capsys.readouterr().out
    assert cli_module.main(grpo_argv(tiny_sft, cut, tmp_path / "cut.jsonl")) == 0
    assert "Resuming from the checkpoint at step 1" in capsys.readouterr().out
    assert compare.bitwise_equal(checkpoint.load_params(whole), checkpoint.load_params(cut))
    lines = without_times(whole_metrics)
    assert lines == without_times(tmp_path / "cut.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert {"loss", "reward", "reward_std", "rewards/exact_match/mean", "rewards/char_match/mean",
            "frac_reward_zero_std", "clip_ratio", "kl", "entropy", "completions/mean_length"} <= set(lines[0])
    assert all({"time/rollout_s", "time/update_s"} <= set(json.loads(line))
               for line in whole_metrics.read_text().splitlines())
    config = checkpoint.load_meta(whole)["config"]
    assert {k: config[k] for k in ("command", "model", "group_size", "num_iterations", "epsilon_high", "beta",
                                   "advantage", "rewards")} == {
        "command": "grpo", "model": "tiny", "group_size": G, "num_iterations": 2, "epsilon_high": 0.28,
        "beta": 0.04, "advantage": "grpo", "rewards": "exact_match,char_match"}
    # another group size is another run
    assert cli_module.main([*grpo_argv(tiny_sft, whole, tmp_path / "x.jsonl"), "--group-size", "2"]) == 2
    assert "(group_size: saved 4, given 2)" in capsys.readouterr().err


def test_cli_grpo_data_parallel_matches_one_device(tmp_path, tiny_sft):
    """--parallel dp on the 8 test devices (rollouts and updates split) ends where jit does."""
    dp, one = tmp_path / "dp", tmp_path / "one"
    argv = ["grpo", "--init-from", tiny_sft, "--batch-size", str(B), "--group-size", str(G), "--max-new-tokens",
            str(T), "--steps", "2", "--save-every", "2", "--advantage", "rloo", "--beta", "0"]
    assert cli_module.main([*argv, "--parallel", "dp", "--ckpt-dir", str(dp)]) == 0
    assert cli_module.main([*argv, "--ckpt-dir", str(one)]) == 0
    assert compare.max_abs_diff(checkpoint.load_params(dp), checkpoint.load_params(one)) <= 1e-5


@pytest.mark.parametrize("args, message", [
    (["grpo", "--group-size", "1"], "--group-size 1 must be at least 2"),
    pytest.param(["grpo", "--parallel", "pmap", "--batch-size", "12"], "--batch-size 12 does not divide by the 8 devices",
                 marks=pytest.mark.needs_devices(8)),
    (["grpo", "--temperature", "0"], "argument --temperature: 0.0 must be greater than 0"),
    (["grpo", "--rewards", "exact_match,bogus"], "--rewards 'exact_match,bogus': give distinct names from"),
    (["grpo", "--advantage", "ppo"], "argument --advantage: invalid choice: 'ppo'"),
    (["grpo", "--aggregation", "mean"], "argument --aggregation: invalid choice: 'mean'"),
    (["grpo", "--loss-type", "ipo"], "--loss-type applies only to dpo, not grpo"),
    (["sft", "--group-size", "4"], "--group-size applies only to grpo, not sft"),
    (["dpo", "--num-iterations", "2"], "--num-iterations applies only to grpo, not dpo"),
    (["grpo", "--init-from", "no/such/dir"], "--init-from no/such/dir: no checkpoint there"),
    (["grpo", "--batch-size", "8000"], "--batch-size 8000 is larger than the 4000 training examples"),
    (["grpo", "--distributed", "--parallel", "dp"], "grpo runs in one process"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_cli_errors_name_the_fix(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main([*args, "--steps", "4"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def long_argv(init_from, ckpt, metrics):
    """A run long enough to be interrupted from outside: 12 steps, saved every 4."""
    return [*grpo_argv(init_from, ckpt, metrics), "--steps", "12", "--save-every", "4"]


def command_env() -> dict:
    """The environment of a run of the command in a process of its own: this one's, simulated devices
    and all, so that its steps compute as this process's do, to the bit; the compilation cache is
    shared too (how long a run takes, not what it computes)."""
    import os

    return dict(os.environ)


# A run in this process and runs of the command in processes of their own are compared to the bit:
# both must compute on the CPU (with TUNIX_NB_TEST_ON_ACCELERATOR this one runs on the chip).
SAME_BACKEND = pytest.mark.cpu_only(reason="compares this process's run with a command's on the CPU, to the bit")


@pytest.fixture(scope="module")
def long_whole_run(tmp_path_factory, tiny_sft):
    """long_argv's run, uninterrupted, in this process (on one of its devices, as a process of its own
    runs on its one): (its --ckpt-dir, its --metrics-file)."""
    root = tmp_path_factory.mktemp("grpo_long_whole")
    assert cli_module.main(long_argv(tiny_sft, root / "whole", root / "whole.jsonl")) == 0
    return root / "whole", root / "whole.jsonl"


@SAME_BACKEND
def test_cli_grpo_killed_mid_run_resumes_bitwise(tmp_path, tiny_sft, long_whole_run, capsys):
    """SIGKILL between saves, then the same command again: the same bits as a run never killed
    (the rollouts' sampling keys are a function of seed and step)."""
    from tunix_nb import preempt

    cut, metrics = tmp_path / "cut", tmp_path / "cut.jsonl"
    killed = preempt.run_and_kill(long_argv(tiny_sft, cut, metrics), ckpt_dir=cut, metrics_file=metrics,
                                  when="between_saves", after_step=6, env=command_env(), timeout=300)
    assert killed["killed"] and killed["step"] < 12, killed
    assert cli_module.main(long_argv(tiny_sft, cut, metrics)) == 0  # resumed here: the kill was the command's
    assert "Resuming from the checkpoint" in capsys.readouterr().out
    assert compare.bitwise_equal(checkpoint.load_params(long_whole_run[0]), checkpoint.load_params(cut))
    assert without_times(long_whole_run[1]) == without_times(metrics)


@SAME_BACKEND
def test_cli_grpo_ctrl_c_saves_the_step_in_flight_and_resumes_bitwise(tmp_path, tiny_sft, long_whole_run, capsys):
    """SIGINT from outside the process once step 5 is logged, off the save interval (4): the run
    saves the step in flight, not step 4, exits 130 in one line, and resumes to the bits of a run
    never stopped. (SIGTERM: in this process, below; SFT's: tests/test_cli.py, tests/test_multiprocess.py.)"""
    from tunix_nb import preempt

    cut, metrics = tmp_path / "cut", tmp_path / "cut.jsonl"
    stopped = preempt.run_and_signal(long_argv(tiny_sft, cut, metrics), metrics_file=metrics, signum=signal.SIGINT,
                                     after_step=5, env=command_env(), timeout=300)
    assert stopped["returncode"] == 130, stopped["stderr"][-2000:]
    saved = max(int(p.name) for p in cut.iterdir() if p.name.isdigit())
    print(f"SIGINT after step {stopped['signalled_after']}: saved step {saved}")
    assert stopped["signalled_after"] <= saved < 12  # the step in flight (the metrics file may lag a step)
    assert f"Stopped by SIGINT after step {saved} of 12: saved step {saved}" in stopped["stdout"]
    assert "Traceback" not in stopped["stderr"] and not list(cut.glob(f"*{preempt.TMP_SUFFIX}*"))
    assert cli_module.main(long_argv(tiny_sft, cut, metrics)) == 0  # resumed here: the stop was the command's
    assert f"Resuming from the checkpoint at step {saved}" in capsys.readouterr().out
    assert compare.bitwise_equal(checkpoint.load_params(long_whole_run[0]), checkpoint.load_params(cut))
    assert without_times(long_whole_run[1]) == without_times(metrics)


def test_cli_grpo_sigterm_in_process_saves_the_step_it_finds_and_resumes_bitwise(tmp_path, tiny_sft, whole_run,
                                                                                  capsys, monkeypatch):
    """SIGTERM raised in cli.main's own process (as a notebook's kernel gets it) as step 1 is logged,
    off the save interval (2): step 1 is saved, main returns 143, the handlers of before are back,
    and the resumed run ends on the uninterrupted run's bits."""
    from stop_signal_probe import signal_at_step

    from tunix_nb import tracking

    cut, before, log = tmp_path / "cut", signal.getsignal(signal.SIGTERM), tracking.Trackers.log
    signal_at_step(monkeypatch, signal.SIGTERM, step=1)
    assert cli_module.main(grpo_argv(tiny_sft, cut, tmp_path / "cut.jsonl")) == 143
    assert "Stopped by SIGTERM after step 1 of 4: saved step 1" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before
    monkeypatch.setattr(tracking.Trackers, "log", log)
    assert cli_module.main(grpo_argv(tiny_sft, cut, tmp_path / "cut.jsonl")) == 0
    assert "Resuming from the checkpoint at step 1" in capsys.readouterr().out
    assert compare.bitwise_equal(checkpoint.load_params(whole_run[0]), checkpoint.load_params(cut))
    assert without_times(whole_run[1]) == without_times(tmp_path / "cut.jsonl")
