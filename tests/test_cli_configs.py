"""python -m tunix_nb.train as subcommands built from config dataclasses: help, flags <-> fields,
the recorded run config (and runs from before it), --model's content hash, --reward-funcs,
--report-to tensorboard, --eval-every and the best checkpoint, --dtype, --packing.

Runs call `cli.main` in this process (no JAX start-up per run) on the tiny preset.
"""

import dataclasses
import json
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import checkpoint, cli, config_flags, data, distill, dpo, gkd, grpo, hf, lora, packing, sft, tracking
from tunix_nb.train import config as train_config

TINY = ["--model", "tiny", "--batch-size", "8"]
QWEN3 = "tests/fixtures/hf/qwen3"
OWN_OPTIONS = {"sft": (sft.SFTConfig, lora.LoRAConfig), "dpo": (dpo.DPOConfig, lora.LoRAConfig),
               "grpo": (grpo.GRPOConfig, lora.LoRAConfig), "distill": (distill.DistillConfig, gkd.GKDConfig)}
SHARED = [cls for cls, _, _ in train_config.SHARED_OPTIONS]


def _names(*classes):
    return {f.name for cls in classes for f in config_flags.option_fields(cls)}


def _run(argv) -> int:
    """cli.main's exit status, whether it returns it or argparse exits with it."""
    try:
        return cli.main([str(a) for a in argv])
    except SystemExit as exit_info:
        return exit_info.code


@pytest.fixture(scope="module")
def tiny_sft(tmp_path_factory):
    """A tiny SFT checkpoint for dpo/grpo's --init-from."""
    ckpt = tmp_path_factory.mktemp("tiny_sft") / "run"
    assert cli.main(["sft", *TINY, "--steps", "2", "--save-every", "2", "--ckpt-dir", str(ckpt)]) == 0
    return str(ckpt)


# ------------------------------------------------------------------ subcommands and their flags


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_each_subcommand_shows_its_options_and_no_other_methods(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    listed = set(re.findall(r"^  (--[a-z-]+)", capsys.readouterr().out, re.MULTILINE))  # the option lines
    others = _names(*(c for other, classes in OWN_OPTIONS.items() if other != command for c in classes))
    assert listed == {config_flags.flag_name(n) for n in _names(*OWN_OPTIONS[command], *SHARED)}
    assert others - _names(*OWN_OPTIONS[command])  # what it must not show: other methods' options


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_flags_are_the_config_fields_with_their_defaults_help_and_choices(command):
    sub = cli.command_parser(cli.build_parser(), command)
    actions = {a.dest: a for a in sub._actions if a.option_strings and a.dest != "help"}
    fields = {f.name: f for cls in (*OWN_OPTIONS[command], *SHARED) for f in config_flags.option_fields(cls)}
    assert set(actions) == set(fields)
    for name, field in fields.items():
        action = actions[name]
        assert action.option_strings == [config_flags.flag_name(name)]
        assert action.help.replace("%%", "%") == field.metadata["help"]
        assert action.choices == field.metadata["choices"]
        want = cli.METHOD_CONFIGS[command].DEFAULT_LEARNING_RATE if name == "learning_rate" else field.default
        assert action.default == want, name


@pytest.mark.parametrize("argv, message", [
    (["sft", "--beta", "0.1"], "--beta applies only to dpo, grpo and distill, not sft"),
    (["dpo", "--reward-funcs", "m:f"], "--reward-funcs applies only to grpo, not dpo"),
    (["distill", "--lora-rank", "2"], "--lora-rank applies only to sft, dpo, grpo, not distill"),
    (["sft", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--model", "tiny", "sft"], "the command comes first, then its flags: python -m tunix_nb.train sft --model tiny"),
    (["sft", "--report-to", "wandb"], "argument --report-to: 'wandb': give distinct names from jsonl, tensorboard"),
    (["sft", "--metrics-file", "m.jsonl", "--report-to", "tensorboard", "--logging-dir", "tb"],
     "--metrics-file is the jsonl tracker's file, but --report-to tensorboard leaves it out"),
    (["sft", "--report-to", "tensorboard"], "--report-to tensorboard needs --logging-dir (or --ckpt-dir"),
    (["grpo", "--eval-every", "2"], "--eval-every: grpo has no eval loss"),
    (["sft", "--model", "tiny", "--revision", "main"], "--revision applies only to a Hub id"),
    (["sft", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["dpo", "--packing"], "--packing applies only to sft and distill, not dpo"),
    (["grpo", "--packing"], "--packing applies only to sft and distill, not grpo"),
    (["distill", "--packing", "--lmbda", "0.5"], "on-policy distillation (--lmbda, --seq-kd) trains on rows"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_flag_errors_name_the_fix(capsys, argv, message):
    assert _run([*argv, "--steps", "2"]) == 2
    assert message in capsys.readouterr().err


def test_the_recorded_run_config_keeps_the_flat_layout_of_older_runs(tiny_sft):
    """record() holds every field any command has (None where this one has none), the resolved
    defaults, and the configs' values: what checkpoints held before the subcommands."""
    config = cli.config_from_argv(["dpo", "--init-from", tiny_sft, "--steps", "4", "--compute-dtype", "float32"])
    record = config.record()
    assert set(record) == set(cli.RECORD_FIELDS)
    assert {k: record[k] for k in dataclasses.asdict(config.method)} == dataclasses.asdict(dpo.DPOConfig(
        init_from=tiny_sft))
    assert record["learning_rate"] == dpo.DPOConfig.DEFAULT_LEARNING_RATE and record["warmup_steps"] == 0
    assert record["model"] == "tiny" and record["group_size"] is None and record["lmbda"] is None
    assert config.clashes_with(record) == {}
    assert config.clashes_with({**record, "beta": 0.5}) == {"beta": (0.5, 0.1)}


def _old_layout(record: dict) -> dict:
    """A record as runs before the subcommands wrote it: without the fields added since."""
    return {k: v for k, v in record.items() if k not in ("dtype", "revision", "model_sha256", "reward_funcs")}


def test_a_run_from_before_the_subcommands_resumes_bitwise(tmp_path):
    """A checkpoint whose meta holds the older flat config (no dtype, model hash or reward
    functions) resumes, to the bits of an uninterrupted run."""
    run = ["sft", *TINY, "--steps", "4", "--save-every", "2", "--sync-save"]
    assert _run([*run, "--ckpt-dir", tmp_path / "whole"]) == 0
    assert _run([*run, "--ckpt-dir", tmp_path / "old", "--stop-after", "2"]) == 0
    meta_file = tmp_path / "old" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["config"] = _old_layout(meta["config"])
    meta_file.write_text(json.dumps(meta))
    assert "dtype" not in checkpoint.load_meta(tmp_path / "old")["config"]
    assert _run([*run, "--ckpt-dir", tmp_path / "old"]) == 0
    whole, resumed = checkpoint.load_params(tmp_path / "whole"), checkpoint.load_params(tmp_path / "old")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)))


# ------------------------------------------------------------------ --model and --dtype


def test_hf_model_trains_records_its_hash_and_resume_refuses_other_weights(tmp_path, capsys):
    shutil.copytree(QWEN3, tmp_path / "model")
    run = ["sft", "--model", tmp_path / "model", "--batch-size", "8", "--steps", "2", "--save-every", "1",
           "--lora-rank", "2", "--ckpt-dir", tmp_path / "run"]
    assert _run([*run, "--stop-after", "1"]) == 0
    config = checkpoint.load_meta(tmp_path / "run")["config"]
    want = hf.source_fingerprint(QWEN3)
    assert config["model"] == cli.HF_MODEL and config["model_sha256"] == want
    assert str(tmp_path) not in json.dumps(config)  # the folder is not what identifies the model
    with (tmp_path / "model" / "model.safetensors").open("r+b") as f:  # other weights, same folder
        f.seek(-4, 2)
        f.write(b"\x01\x02\x03\x04")
    changed = hf.source_fingerprint(tmp_path / "model")
    assert _run(run) == 2
    err = capsys.readouterr().err
    assert f"hash to {want}, --model {tmp_path / 'model'} to {changed}" in err and "Nothing was changed" in err
    assert _run(["sft", *TINY, "--steps", "2", "--ckpt-dir", tmp_path / "run"]) == 2
    assert "none (a preset)" in capsys.readouterr().err


def test_dtype_keeps_the_params_in_bfloat16_and_lora_adapters_in_float32(tiny_sft):
    from tunix_nb import model

    full = cli.build_method(cli.config_from_argv(["sft", *TINY, "--dtype", "bfloat16"]))
    assert {x.dtype for x in jax.tree.leaves(full.params)} == {jnp.dtype(jnp.bfloat16)}
    adapted = cli.build_method(cli.config_from_argv(["dpo", "--init-from", tiny_sft, "--batch-size", "8",
                                                     "--lora-rank", "2", "--dtype", "bfloat16"]))
    assert {x.dtype for x in jax.tree.leaves(adapted.params)} == {jnp.dtype(jnp.float32)}
    base = [x for p, x in jax.tree_util.tree_leaves_with_path(adapted.frozen)
            if model.param_name(p).endswith("kernel")]
    assert base and {x.dtype for x in base} == {jnp.dtype(jnp.bfloat16)}


# ------------------------------------------------------------------ --reward-funcs

REWARD_MODULE = '''
import math


def quarter(prompts, completions, **columns):
    return [0.25] * len(completions)


def one_value(prompts, completions, **columns):
    return [1.0]


def not_a_number(prompts, completions, **columns):
    return [math.nan] * len(completions)


def nan_on_samples(prompts, completions, completion, **columns):
    return [1.0 if c == ref else math.nan for c, ref in zip(completions, completion)]
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """my_rewards.py in the working directory, as a user writes it."""
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("my_rewards", None)  # the next test's my_rewards.py is another file


def _grpo(tiny_sft, *flags):
    return ["grpo", "--init-from", tiny_sft, "--batch-size", "4", "--group-size", "2", "--max-new-tokens", "4",
            "--steps", "2", *flags]


def test_own_reward_functions_log_their_own_metric(tiny_sft, reward_module):
    metrics = reward_module / "grpo.jsonl"
    assert _run(_grpo(tiny_sft, "--rewards", "exact_match", "--reward-funcs", "my_rewards:quarter",
                      "--metrics-file", metrics)) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["rewards/quarter/mean"] for r in records] == [0.25, 0.25]
    assert all(r["reward"] == pytest.approx(r["rewards/exact_match/mean"] + 0.25, abs=1e-6) for r in records)


@pytest.mark.parametrize("flags, message", [
    (["--reward-funcs", "no_such_module:f"], "--reward-funcs 'no_such_module:f': could not import module "
                                             "'no_such_module' (ModuleNotFoundError"),
    (["--reward-funcs", "my_rewards:nope"], "module 'my_rewards' has no function 'nope'"),
    (["--reward-funcs", "my_rewards"], "--reward-funcs 'my_rewards': write MODULE:FUNCTION"),
    (["--reward-funcs", "my_rewards:one_value"], "reward function 'one_value' returned shape (1,) for 4 completions"),
    (["--reward-funcs", "my_rewards:not_a_number"], "reward function 'not_a_number' returned a non-finite reward"),
    (["--rewards", "", "--reward-funcs", "my_rewards:nan_on_samples"],
     "error: --rewards / --reward-funcs: reward function 'nan_on_samples' returned a non-finite reward"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_reward_function_errors_name_the_function_and_the_fix(tiny_sft, reward_module, capsys, flags, message):
    """Import and signature problems, and a wrong length or NaN on the first examples, stop the
    run before it starts; a NaN on the sampled completions stops it at that step."""
    assert _run(_grpo(tiny_sft, *flags)) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ tracking, eval, best


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _as_tensorboard_reads_it(records):
    out = {}
    for record in records:
        for tag, value in record.items():
            if tag != "step":
                out.setdefault(tag, []).append((record["step"], value))
    return out


def test_tensorboard_equals_jsonl_and_the_best_checkpoint_survives_a_resume(tmp_path):
    """--report-to jsonl,tensorboard: the event files hold the JSONL's values, exactly, also
    after a resume that repeats steps a killed run had logged (TensorBoard drops those);
    --eval-every keeps the checkpoint of the lowest eval loss in best/."""
    run = ["sft", *TINY, "--steps", "6", "--save-every", "2", "--eval-every", "2", "--sync-save",
           "--ckpt-dir", tmp_path / "run", "--metrics-file", tmp_path / "m.jsonl", "--report-to", "jsonl,tensorboard"]
    assert _run(run) == 0
    records = _jsonl(tmp_path / "m.jsonl")
    evals = {r["step"]: r["eval/loss"] for r in records if "eval/loss" in r}
    assert sorted(evals) == [2, 4, 6] and [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    best_step = min(evals, key=evals.get)
    best_meta = checkpoint.load_meta(tmp_path / "run" / "best")
    assert (best_meta["step"], best_meta["eval_loss"]) == (best_step, evals[best_step])
    assert tracking.read_tensorboard_scalars(tmp_path / "run" / "tensorboard") == _as_tensorboard_reads_it(records)
    shutil.rmtree(tmp_path / "run" / "6")  # as if killed after logging step 6, before saving it
    assert _run(run) == 0
    assert _jsonl(tmp_path / "m.jsonl") == records  # the same run, bit for bit
    assert tracking.read_tensorboard_scalars(tmp_path / "run" / "tensorboard") == _as_tensorboard_reads_it(records)
    assert checkpoint.load_meta(tmp_path / "run" / "best")["step"] == best_step
    assert np.isfinite(list(evals.values())).all()


# ------------------------------------------------------------------ --packing
# sft and distill on packed batches (tunix_nb.packing), on a --train-file whose lengths are
# skewed: the shipped task's rows (11 to 22 of 24 tokens) rarely hold two examples.

PACKING_TINY = [*TINY, "--compute-dtype", "float32"]
N_EXAMPLES = 48
# A step's loss, packed against unpacked: the same sums over the same tokens, reduced in
# another order (float32, eps 1.2e-7, over ~100 tokens; the step's own rounding).
LOSS_RTOL = 1e-6
# Later steps start from parameters that differ by that rounding (AdamW normalises the update).
LATER_RTOL = 1e-5


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """["--train-file", a prompt/completion .jsonl]: prompts and completions of 2 to 30 letters."""
    rng = np.random.default_rng(0)
    words = lambda n: "".join(rng.choice(list("abcdefghij "), n))  # noqa: E731
    rows = [{"prompt": words(rng.integers(2, 31)), "completion": words(rng.integers(2, 31))}
            for _ in range(N_EXAMPLES)]
    path = tmp_path_factory.mktemp("skewed") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--train-file", str(path)]


def _losses(tmp_path, name, argv) -> list[float]:
    metrics = tmp_path / f"{name}.jsonl"
    assert _run([*argv, "--metrics-file", metrics]) == 0
    return [record["loss"] for record in _jsonl(metrics)]


def test_packed_batches_are_fewer_rows_of_the_same_examples(skewed):
    config = cli.config_from_argv(["sft", *PACKING_TINY, *skewed, "--steps", "6", "--packing"])
    method = cli.build_method(config)
    cfg = cli.packing_of(config, method.rows, "jit")
    assert cfg.max_length == method.rows["inputs"].shape[1]  # as long as the unpacked rows
    # the fullest of the run's steps, and no fewer rows than it needs
    needed = [packing.packed_batch_at(method.rows, k, 8, seed=0, cfg=packing.PackingConfig(cfg.max_length))[1]
              for k in range(6)]
    assert cfg.num_rows == max(layout.shape[0] for layout in needed) < 8
    assert cli.packing_of(config, method.rows, "dp").num_rows % jax.device_count() == 0
    batch = cli.batch_source(dataclasses.replace(method, packing=cfg), config, None)(3)
    plain = data.batch_at(method.rows, 3, 8, seed=0)
    assert batch["inputs"].shape == (cfg.num_rows, cfg.max_length)
    assert batch["loss_mask"].sum() == plain["loss_mask"].sum() and batch["attention_mask"].sum() == \
        plain["attention_mask"].sum()
    assert cli.config_from_argv(["sft", *PACKING_TINY, *skewed, "--steps", "6"]).record()["packing"] is False
    assert config.record()["packing"] is True


@pytest.mark.parametrize("command, chunks", [("sft", []), ("distill", []), ("distill", ["--vocab-chunk", "64"])])
def test_a_packed_run_has_the_unpacked_runs_losses(tmp_path, skewed, command, chunks):
    """The same examples each step, packed: sft's token-mean NLL, distill's mean over examples
    (also from chunked log-probs, against the unpacked full logits)."""
    run = [command, *PACKING_TINY, *skewed, "--steps", "3"]
    plain, packed = _losses(tmp_path, "plain", run), _losses(tmp_path, "packed", [*run, "--packing", *chunks])
    np.testing.assert_allclose(packed[0], plain[0], rtol=LOSS_RTOL)
    np.testing.assert_allclose(packed, plain, rtol=LATER_RTOL)


def test_packed_rows_split_over_devices_and_micro_batches(tmp_path, skewed):
    """dp on 8 devices with 2 micro-batches: the packed rows are a multiple of 16, and the
    loss is the single-device unpacked run's (sums all-reduced in another order)."""
    run = ["sft", *PACKING_TINY, *skewed, "--steps", "2", "--batch-size", "16"]
    plain = _losses(tmp_path, "plain", run)
    packed = _losses(tmp_path, "dp", [*run, "--packing", "--parallel", "dp", "--grad-accum", "2"])
    np.testing.assert_allclose(packed, plain, rtol=LATER_RTOL)


def test_a_packed_run_resumes_bitwise_and_refuses_the_other_packing(tmp_path, skewed, capsys):
    run = ["sft", *PACKING_TINY, *skewed, "--steps", "4", "--save-every", "2", "--sync-save", "--packing"]
    assert _run([*run, "--ckpt-dir", tmp_path / "whole"]) == 0
    assert _run([*run, "--ckpt-dir", tmp_path / "cut", "--stop-after", "2"]) == 0
    assert checkpoint.load_meta(tmp_path / "cut")["config"]["packing"] is True
    unpacked = [a for a in run if a != "--packing"]
    assert _run([*unpacked, "--ckpt-dir", tmp_path / "cut"]) == 2
    assert "packing: saved True, given False" in capsys.readouterr().err
    assert _run([*run, "--ckpt-dir", tmp_path / "cut"]) == 0
    whole, resumed = checkpoint.load_params(tmp_path / "whole"), checkpoint.load_params(tmp_path / "cut")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)))


def test_a_run_from_before_packing_resumes_unpacked(tmp_path, capsys):
    """A checkpoint whose config predates the field counts as unpacked (cli.OLDER_RUN_DEFAULTS)."""
    run = ["sft", *PACKING_TINY, "--steps", "2", "--save-every", "1", "--sync-save",
           "--ckpt-dir", tmp_path / "run"]
    assert _run([*run, "--stop-after", "1"]) == 0
    meta_file = tmp_path / "run" / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["config"]["packing"]
    meta_file.write_text(json.dumps(meta))
    assert _run([*run, "--packing"]) == 2  # packed, it would be another run
    assert "packing: saved False, given True" in capsys.readouterr().err
    assert _run(run) == 0


def test_packed_distillation_scores_the_eval_split_unpacked(skewed):
    """distill --packing trains on packed rows (packing.distill_objective) and scores the eval
    split's plain rows with distill.objective: the unpacked run's eval loss, bit for bit."""
    argv = ["distill", *PACKING_TINY, *skewed, "--steps", "2"]
    packed = cli.build_method(cli.config_from_argv([*argv, "--packing"]), with_eval=True)
    plain = cli.build_method(cli.config_from_argv(argv), with_eval=True)
    assert packed.eval_objective is not None and plain.eval_objective is None
    with pytest.raises(KeyError, match="segment_ids"):  # the packed objective needs packed rows
        packed.objective(packed.params, {k: v[:2] for k, v in packed.eval_rows.items()}, packed.frozen)
    losses = [cli.make_eval_loss(m, 8, None)(m.params) for m in (packed, plain)]
    assert losses[0] == losses[1] and np.isfinite(losses[0])
